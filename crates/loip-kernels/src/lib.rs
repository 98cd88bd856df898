//! Compute kernels: the only crate with `unsafe` and SIMD.
//!
//! Weights are borrowed byte slices (`Matrix`) in their stored dtype; quantized blocks are
//! dequantized on the fly inside the kernels. Activations and accumulation are f32.
//!
//! Invariant (lossless): every output element of [`matmul`] is produced by one call of the
//! same per-row dot routine, whatever the batch size, the thread count, or the address and
//! alignment of the weight bytes. So the same weights give bit-identical results whether they
//! come from an mmap, a slice file in the loader's slot, or a network buffer.
//!
//! Stronger still, the AVX-512, AVX2, NEON and portable paths perform the same IEEE-754
//! operations in the same order (the *canonical order*, documented in `canon.rs`): a dot
//! product uses 4 accumulators of 16 lanes fed by fused multiply-adds and a fixed reduction
//! tree, `exp` is a fixed polynomial. So two machines with different SIMD support also agree
//! bit for bit.
//!
//! Layout: `dtype` (types, errors, `Matrix`), `scales` (K-quant scale unpacking), `dequant`
//! (exact scalar dequantization), `canon` (the canonical order, portable),
//! `x86::{avx512, avx512_act, avx2, quant_ext_*, gemm}` and `arm::neon` (SIMD kernels),
//! `x86::route` (stored type → x86 kernel), `dispatch` (safe level → kernel), `matmul`,
//! `attention`, `elementwise`, `lines` (f32 buffers on 64-byte lines), `pages` (f32 buffers in their own mapping: the KV cache's rows), `simd` (run-time detection), `team` and `affinity` (a step's
//! threads, pinned one per core), and `ops` (the public entry
//! points, re-exported here). Every module imports only modules below it: no two import each
//! other, directly or around a loop.
#![deny(missing_docs)]
// `is_multiple_of` needs Rust 1.87; the workspace supports 1.85
#![allow(clippy::manual_is_multiple_of)]

mod dtype;
pub use dtype::{DType, KernelError, Matrix};

mod affinity;
#[cfg(all(target_arch = "aarch64", target_endian = "little"))]
mod arm;
mod attention;
mod canon;
mod dequant;
mod dispatch;
mod elementwise;
mod intdot;
mod lines;
mod matmul;
mod pages;
pub use pages::{page_bytes, PageVec};
mod quant_ext;
mod quant_k_ext;
mod quantx;
mod scales;
mod simd;
mod team;
mod thread_buf;
#[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
mod x86;

pub mod ops;
pub use ops::*;

#[cfg(test)]
mod tests;
