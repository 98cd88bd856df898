//! x86 SIMD kernels, compiled with `#[target_feature]` and selected at run time.

pub(crate) mod attn_tiles;
pub(crate) mod attn_tiles_avx2;
pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod avx512_act;
pub(crate) mod gemm;
pub(crate) mod intdot;
pub(crate) mod quant_ext_avx512;
pub(crate) mod quant_ext_decode;
pub(crate) mod quant_ext_simd;
pub(crate) mod route;

/// Software prefetch of the `bytes` bytes at `p` into L2, one request per 64-byte line (into
/// L2: measured clearly faster here than into L1). A hint: it never faults, so `p` may point
/// past the last row. It reaches across the 4 KiB pages where hardware prefetchers stop.
#[inline(always)]
pub(crate) fn prefetch(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86")]
    use std::arch::x86::{_mm_prefetch, _MM_HINT_T1};
    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let mut b = 0;
    while b < bytes {
        // SAFETY: SSE is baseline on x86_64 (and this module is only built for x86); a
        // prefetch reads nothing and never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(b) as *const i8) };
        b += 64;
    }
}

/// Software prefetch of the tile of consecutive rows after this one, spread over the steps
/// of the tile's loop: step `s` of `steps` prefetches its share of the bytes
/// `base + dist .. base + dist + tile` (`tile`: the tile's bytes, `dist`: at least `tile`
/// and at least [`MIN_AHEAD`]). Every byte of the next tile is asked for, the row tails
/// that no whole unit covers included. A hint: any address is harmless.
#[derive(Clone, Copy)]
pub(crate) struct Ahead {
    start: *const u8,
    chunk: usize,
}

/// Least distance of [`Ahead`] and of the AVX2 one-row kernels' prefetch (bytes). A tile of
/// short rows (4 rows of 640 Q8_0 weights: 2,720 bytes) is too close for the lines to arrive
/// from memory in time: Gemma 3's 262144 × 640 Q8_0 head streamed at 17.5–20 GB/s on one
/// thread with the next tile as the distance, 29–31 GB/s with 16 KiB (Zen 5; rows of 4096
/// columns, whose tiles are 17 KiB, are unchanged).
pub(crate) const MIN_AHEAD: usize = 16 << 10;

impl Ahead {
    /// The plan of a tile of `tile` bytes at `base`, read in `steps` steps.
    #[inline(always)]
    pub(crate) fn new(base: *const u8, tile: usize, steps: usize) -> Ahead {
        let dist = tile.max(MIN_AHEAD);
        Ahead {
            start: base.wrapping_add(dist),
            chunk: tile.div_ceil(steps.max(1)).next_multiple_of(64),
        }
    }
    /// Step `s`'s share.
    #[inline(always)]
    pub(crate) fn step(self, s: usize) {
        prefetch(self.start.wrapping_add(s * self.chunk), self.chunk)
    }
}

/// Bytes of weights per cache tile in batched (n > 1) calls: about a quarter of L2.
const BATCH_TILE_BYTES: usize = 256 << 10;

/// Rows per cache tile for batched calls with rows of `row_bytes` (a multiple of 4).
pub(crate) fn batch_tile_rows(row_bytes: usize) -> usize {
    (BATCH_TILE_BYTES / row_bytes.max(1)).max(4) / 4 * 4
}
