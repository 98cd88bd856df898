//! The public kernel entry points, gathered in one place.
//!
//! - [`matmul`] / [`matmul_ref`] / [`dequant_row`]: weights in their stored dtype.
//! - [`rmsnorm`], [`silu_mul`], [`rope_half`]: element-wise f32 kernels.
//! - [`attention`] / [`attention_ref`]: one query token over a KV cache.
//! - [`simd_level`] / [`set_force_scalar`]: which SIMD path runs.
//!
//! Every optimized kernel follows the canonical order of operations of `canon` (see the crate
//! docs), so results are bit-identical across SIMD paths, batch sizes, thread counts and
//! weight addresses. The `_ref` functions are plain, independent scalar code for tests.

pub use crate::attention::{attention, attention_ref};
pub use crate::elementwise::{rmsnorm, rope_half, silu_mul};
pub use crate::matmul::{dequant_row, matmul, matmul_ref};
pub use crate::simd::{set_force_scalar, simd_level};
