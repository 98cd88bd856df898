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

/// Bytes of weights per cache tile in batched (n > 1) calls: about a quarter of L2.
const BATCH_TILE_BYTES: usize = 256 << 10;

/// Rows per cache tile for batched calls with rows of `row_bytes` (a multiple of 4).
pub(crate) fn batch_tile_rows(row_bytes: usize) -> usize {
    (BATCH_TILE_BYTES / row_bytes.max(1)).max(4) / 4 * 4
}
