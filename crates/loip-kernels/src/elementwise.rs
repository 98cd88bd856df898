//! Element-wise and normalization kernels on f32 activations: RMSNorm, SiLU·up, rotary
//! embedding. Each output element depends on its inputs through a fixed sequence of IEEE
//! operations (the RMS sum uses the canonical dot), so every SIMD path gives the same bits.

use crate::dispatch;
use crate::simd::{self, Level};

/// Hugging Face `LlamaRMSNorm` in f32: `out[i] = x[i] / sqrt(mean(x²) + eps) * weight[i]`.
///
/// Computed as `inv = 1 / sqrt(sum(x²) / len + eps)` (canonical sum), then
/// `out[i] = (x[i] * inv) * weight[i]`. `x`, `weight`, `out`: one hidden vector each.
///
/// # Panics
/// If the three lengths differ (a programming error in the caller, not a data error).
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    rmsnorm_at(simd::current(), x, weight, eps, out)
}

pub(crate) fn rmsnorm_at(level: Level, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert!(
        x.len() == weight.len() && x.len() == out.len(),
        "rmsnorm: lengths differ"
    );
    if x.is_empty() {
        return;
    }
    let ss = dispatch::dot_f32(level, x, x);
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(weight) {
        *o = (xi * inv) * wi;
    }
}

/// `gate[i] = silu(gate[i]) * up[i]` with `silu(v) = v / (1 + exp(-v))` (canonical exp).
///
/// # Panics
/// If the lengths differ.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    dispatch::silu_mul(simd::current(), gate, up)
}

/// Rotary embedding, Hugging Face "rotate_half" layout, in place on one head vector.
///
/// `x`: `head_dim`; `cos`, `sin`: `head_dim / 2` (the angles of this position). For
/// `i < head_dim / 2`: `(x[i], x[i + h]) -> (x[i] c - x[i + h] s, x[i + h] c + x[i] s)`.
///
/// # Panics
/// If `x.len()` is odd or `cos`/`sin` are not `x.len() / 2` long.
pub fn rope_half(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let h = x.len() / 2;
    assert!(
        x.len() % 2 == 0 && cos.len() == h && sin.len() == h,
        "rope_half: lengths"
    );
    let (a, b) = x.split_at_mut(h);
    for i in 0..h {
        let (x0, x1, c, s) = (a[i], b[i], cos[i], sin[i]);
        a[i] = x0 * c - x1 * s;
        b[i] = x1 * c + x0 * s;
    }
}
