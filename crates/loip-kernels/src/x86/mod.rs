//! x86 SIMD kernels, compiled with `#[target_feature]` and selected at run time.

pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod avx512_act;

/// Bytes of weights per cache tile in batched (n > 1) calls: about a quarter of L2.
const BATCH_TILE_BYTES: usize = 256 << 10;

/// Rows per cache tile for batched calls with rows of `row_bytes` (a multiple of 4).
pub(crate) fn batch_tile_rows(row_bytes: usize) -> usize {
    (BATCH_TILE_BYTES / row_bytes.max(1)).max(4) / 4 * 4
}
