//! Decode-time attention: one query token over `n_ctx` cached positions, grouped-query.
//!
//! Per head `h` (kv head `h / (n_heads / n_kv_heads)`), in this fixed order:
//! 1. `s[t] = dot(q_h, k_t) * scale` (canonical dot, `scale = 1/sqrt(head_dim)` rounded to f32);
//! 2. `m = max(s)`; `e[t] = exp(s[t] - m)` (canonical exp);
//! 3. `p[t] = e[t] / sum(e)` (canonical sum: the canonical dot with ones);
//! 4. `out_h = Σ_t p[t] · v_t`, accumulated in increasing `t` with one fma per element.
//!
//! Heads are independent rayon tasks, so results do not depend on the thread count or the
//! SIMD path.

use crate::canon::{self, vmax, ACCS, LANES};
use crate::dispatch;
use crate::simd::{self, Level};
use rayon::prelude::*;

/// Below this many multiply-adds (`n_ctx × n_heads × head_dim`) heads run on the caller.
const PAR_MIN_WORK: usize = 1 << 15;

/// The shape of one attention call.
#[derive(Clone, Copy)]
struct Shape {
    n_ctx: usize,
    head_dim: usize,
    /// query heads per kv head
    group: usize,
    /// elements per cached position (`n_kv_heads × head_dim`)
    stride: usize,
}

fn check(q: &[f32], k: &[f32], v: &[f32], n_ctx: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, out: &[f32]) -> Shape {
    assert!(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "attention: n_heads must be a multiple of n_kv_heads");
    let stride = n_kv_heads * head_dim;
    assert_eq!(q.len(), n_heads * head_dim, "attention: q length");
    assert_eq!(out.len(), n_heads * head_dim, "attention: out length");
    assert!(k.len() >= n_ctx * stride && v.len() >= n_ctx * stride, "attention: k/v shorter than n_ctx positions");
    Shape { n_ctx, head_dim, group: n_heads / n_kv_heads, stride }
}

/// The canonical sum (equal to the canonical dot with a vector of ones).
fn sum(s: &[f32]) -> f32 {
    let mut acc = [[0f32; LANES]; ACCS];
    let full = s.len() / LANES * LANES;
    for (g, c) in s[..full].chunks_exact(LANES).enumerate() {
        let a = &mut acc[g % ACCS];
        for l in 0..LANES {
            a[l] += c[l];
        }
    }
    let r = canon::reduce(&acc);
    if full == s.len() {
        r
    } else {
        r + s[full..].iter().fold(0f32, |t, &x| t + x)
    }
}

/// One head: `qh`: `head_dim`; `out_h`: `head_dim`; `scores`: scratch of `n_ctx`.
fn head(level: Level, sh: Shape, h: usize, qh: &[f32], k: &[f32], v: &[f32], out_h: &mut [f32], scores: &mut Vec<f32>) {
    let hd = sh.head_dim;
    let off = (h / sh.group) * hd;
    out_h.fill(0.0);
    if sh.n_ctx == 0 {
        return;
    }
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    scores.clear();
    scores.extend((0..sh.n_ctx).map(|t| {
        let kt = &k[t * sh.stride + off..t * sh.stride + off + hd];
        dispatch::dot_f32(level, kt, qh) * scale
    }));
    let m = scores.iter().fold(f32::NEG_INFINITY, |m, &s| vmax(s, m));
    scores.iter_mut().for_each(|s| *s -= m);
    dispatch::exp_inplace(level, scores);
    let total = sum(scores);
    for (t, &e) in scores.iter().enumerate() {
        let vt = &v[t * sh.stride + off..t * sh.stride + off + hd];
        dispatch::axpy(level, e / total, vt, out_h);
    }
}

/// Causal attention of one query token over `n_ctx` cached positions (grouped-query).
///
/// `q`: `n_heads × head_dim`; `k`, `v`: at least `n_ctx` rows of `n_kv_heads × head_dim`
/// (row stride `n_kv_heads × head_dim`; only the first `n_ctx` rows are read);
/// `out`: `n_heads × head_dim`. Head `h` uses kv head `h / (n_heads / n_kv_heads)`.
/// See the module docs for the exact order of operations. With `n_ctx == 0`, `out` is zero.
///
/// # Panics
/// If the lengths do not match the shape or `n_heads` is not a multiple of `n_kv_heads > 0`.
#[allow(clippy::too_many_arguments)]
pub fn attention(q: &[f32], k: &[f32], v: &[f32], n_ctx: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, out: &mut [f32]) {
    attention_at(simd::current(), q, k, v, n_ctx, n_heads, n_kv_heads, head_dim, out)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_at(
    level: Level,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let sh = check(q, k, v, n_ctx, n_heads, n_kv_heads, head_dim, out);
    if head_dim == 0 {
        return;
    }
    let work = n_ctx.saturating_mul(n_heads).saturating_mul(head_dim);
    if rayon::current_num_threads() <= 1 || work < PAR_MIN_WORK || n_heads < 2 {
        let mut scores = Vec::with_capacity(n_ctx);
        for (h, oh) in out.chunks_exact_mut(head_dim).enumerate() {
            head(level, sh, h, &q[h * head_dim..(h + 1) * head_dim], k, v, oh, &mut scores);
        }
    } else {
        out.par_chunks_mut(head_dim).enumerate().for_each_init(
            || Vec::with_capacity(n_ctx),
            |scores, (h, oh)| head(level, sh, h, &q[h * head_dim..(h + 1) * head_dim], k, v, oh, scores),
        );
    }
}

/// Plain scalar reference of [`attention`]: sequential dot products, `f32::exp`, sequential
/// sums, `acc += p * v`. Same arguments and panics.
#[allow(clippy::too_many_arguments)]
pub fn attention_ref(q: &[f32], k: &[f32], v: &[f32], n_ctx: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize, out: &mut [f32]) {
    let sh = check(q, k, v, n_ctx, n_heads, n_kv_heads, head_dim, out);
    let scale = (1.0 / (head_dim as f64).sqrt()) as f32;
    for h in 0..n_heads {
        let off = (h / sh.group) * head_dim;
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        let mut s: Vec<f32> = (0..n_ctx)
            .map(|t| {
                let kt = &k[t * sh.stride + off..t * sh.stride + off + head_dim];
                qh.iter().zip(kt).fold(0f32, |a, (x, y)| a + x * y) * scale
            })
            .collect();
        let m = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut total = 0f32;
        for x in s.iter_mut() {
            *x = (*x - m).exp();
            total += *x;
        }
        let oh = &mut out[h * head_dim..(h + 1) * head_dim];
        for (d, o) in oh.iter_mut().enumerate() {
            let mut acc = 0f32;
            for (t, &e) in s.iter().enumerate() {
                acc += e / total * v[t * sh.stride + off + d];
            }
            *o = acc;
        }
    }
}
