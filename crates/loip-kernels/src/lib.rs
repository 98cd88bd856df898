//! Compute kernels: the only crate with `unsafe` and SIMD.
//!
//! Weights are borrowed byte slices (`Matrix`) in their stored dtype; quantized blocks are
//! dequantized on the fly inside the kernels. Activations and accumulation are f32.
//!
//! Invariant (lossless): every output element of [`matmul`] is produced by one call of the
//! same per-row dot routine, whatever the batch size, the thread count, or the address and
//! alignment of the weight bytes. So the same weights give bit-identical results whether they
//! come from an mmap, a slice file in the loader's slot, or a network buffer.
#![deny(missing_docs)]

mod dtype;
pub use dtype::{DType, KernelError, Matrix};

pub mod ops;
pub use ops::*;
