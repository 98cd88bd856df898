//! x86 SIMD kernels, compiled with `#[target_feature]` and selected at run time.

pub(crate) mod avx2;
pub(crate) mod avx512;
