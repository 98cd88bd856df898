//! Element-wise and normalization kernels on f32 activations: RMSNorm, SiLU·up, tanh-GELU·up,
//! rotary embedding. Each output element depends on its inputs through a fixed sequence of IEEE
//! operations (the RMS sum uses the canonical dot), so every SIMD path gives the same bits.

use crate::canon::Act;
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
/// `gate`, `up`: `(n, intermediate)` or any length; long inputs (a prompt's) are split over
/// the pool, see [`act_mul_par`].
///
/// # Panics
/// If the lengths differ.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    act_mul_par(simd::current(), Act::Silu, gate, up)
}

/// `gate[i] = gelu_tanh(gate[i]) * up[i]`, PyTorch's `gelu(approximate="tanh")`
/// `0.5 v (1 + tanh(√(2/π) (v + 0.044715 v³)))` (Gemma's GeGLU), computed as
/// `v / (1 + exp(v * fma(v * v, -2√(2/π) 0.044715, -2√(2/π))))` with the canonical exp, so
/// that every SIMD level and machine gives the same bits (no libm `tanhf`).
///
/// `gate`, `up`: `(n, intermediate)` or any length; long inputs are split over the pool.
///
/// # Panics
/// If the lengths differ.
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    act_mul_par(simd::current(), Act::GeluTanh, gate, up)
}

/// Elements per parallel chunk of [`act_mul_par`] (64 KiB of `gate`): shorter inputs (a
/// decode step's few rows) run on the calling thread.
const ACT_CHUNK: usize = 16 * 1024;

/// [`dispatch::act_mul`] over chunks of [`ACT_CHUNK`] elements in parallel (on the step's
/// team inside `on_pool`). Each element's value does not depend on the split.
pub(crate) fn act_mul_par(level: Level, act: Act, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "act_mul lengths");
    if gate.len() <= ACT_CHUNK {
        return dispatch::act_mul(level, act, gate, up);
    }
    crate::team::par_chunks_mut(gate, ACT_CHUNK, |i, g| {
        let a = i * ACT_CHUNK;
        dispatch::act_mul(level, act, g, &up[a..a + g.len()])
    });
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
