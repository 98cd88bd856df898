//! Safe dispatch from a [`Level`] to the kernel of that instruction set.
//!
//! A level the CPU does not support falls back to the scalar path, so these functions are
//! safe to call with any level. Slice lengths are checked here, before any `unsafe` code.

use crate::dequant::{prefix_bytes, row_dots_scalar};
use crate::dtype::DType;
use crate::simd::{detected, Level};

/// `level` if this CPU runs it, else the scalar path.
#[inline]
fn usable(level: Level) -> Level {
    match (level, detected()) {
        (Level::Avx512, Level::Avx512) => Level::Avx512,
        (Level::Avx2, Level::Avx2 | Level::Avx512) => Level::Avx2,
        _ => Level::Scalar,
    }
}

/// `out[r * n + t]` = canonical dot of row `r` of `data` with token `t` of `x`.
///
/// `data`: `out.len() / n` rows of `cols` elements of `dtype`; `x`: `n × cols`.
/// Panics if the lengths disagree (callers validate shapes first).
pub(crate) fn rows(level: Level, dtype: DType, data: &[u8], cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    assert!(n > 0 && cols % dtype.block_elems() == 0, "bad matmul shape");
    assert_eq!(x.len(), n * cols, "x length");
    assert_eq!(out.len() % n, 0, "out length");
    let rb = prefix_bytes(dtype, cols);
    assert_eq!(data.len(), out.len() / n * rb, "weight bytes");
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: AVX-512F/AVX2/FMA/F16C detected; lengths checked above.
        Level::Avx512 => unsafe { crate::x86::avx512::rows(dtype, data, cols, x, n, out) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: AVX2/FMA/F16C detected; lengths checked above.
        Level::Avx2 => unsafe { crate::x86::avx2::rows(dtype, data, cols, x, n, out) },
        _ => {
            for (r, o) in out.chunks_exact_mut(n).enumerate() {
                row_dots_scalar(dtype, &data[r * rb..(r + 1) * rb], cols, x, o);
            }
        }
    }
}

/// Canonical dot product of two f32 slices. Panics if the lengths differ.
pub(crate) fn dot_f32(level: Level, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot lengths");
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        Level::Avx512 => unsafe { crate::x86::avx512::dot_f32(a, b) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        Level::Avx2 => unsafe { crate::x86::avx2::dot_f32(a, b) },
        _ => crate::canon::dot_f32(a, b),
    }
}

/// `s[i] = exp(s[i])` with the canonical exp.
pub(crate) fn exp_inplace(level: Level, s: &mut [f32]) {
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected.
        Level::Avx512 => unsafe { crate::x86::avx512::exp_inplace(s) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected.
        Level::Avx2 => unsafe { crate::x86::avx2::exp_inplace(s) },
        _ => s.iter_mut().for_each(|v| *v = crate::canon::exp(*v)),
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`. Panics if the lengths differ.
pub(crate) fn silu_mul(level: Level, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul lengths");
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        Level::Avx512 => unsafe { crate::x86::avx512::silu_mul(gate, up) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        Level::Avx2 => unsafe { crate::x86::avx2::silu_mul(gate, up) },
        _ => crate::elementwise::silu_mul_scalar(gate, up),
    }
}

/// `y[i] = fma(a, x[i], y[i])`. Panics if the lengths differ.
pub(crate) fn axpy(level: Level, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy lengths");
    match usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        Level::Avx512 => unsafe { crate::x86::avx512::axpy(a, x, y) },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: features detected; equal lengths.
        Level::Avx2 => unsafe { crate::x86::avx2::axpy(a, x, y) },
        _ => y.iter_mut().zip(x).for_each(|(yv, &xv)| *yv = a.mul_add(xv, *yv)),
    }
}
