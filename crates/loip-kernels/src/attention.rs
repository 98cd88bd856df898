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

#[allow(clippy::too_many_arguments)]
fn check(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &[f32],
) -> Shape {
    assert!(
        n_kv_heads > 0 && n_heads % n_kv_heads == 0,
        "attention: n_heads must be a multiple of n_kv_heads"
    );
    let stride = n_kv_heads * head_dim;
    assert_eq!(q.len(), n_heads * head_dim, "attention: q length");
    assert_eq!(out.len(), n_heads * head_dim, "attention: out length");
    assert!(
        k.len() >= n_ctx * stride && v.len() >= n_ctx * stride,
        "attention: k/v shorter than n_ctx positions"
    );
    Shape {
        n_ctx,
        head_dim,
        group: n_heads / n_kv_heads,
        stride,
    }
}

/// The canonical sum (equal to the canonical dot with a vector of ones).
pub(crate) fn sum(s: &[f32]) -> f32 {
    let mut acc = [[0f32; LANES]; ACCS];
    let full = s.len() / LANES * LANES;
    let mut chunks = s[..full].chunks_exact(LANES * ACCS);
    for c in &mut chunks {
        // constant indices: the compiler keeps this in vector registers
        for (a, g) in acc.iter_mut().zip(c.chunks_exact(LANES)) {
            for l in 0..LANES {
                a[l] += g[l];
            }
        }
    }
    for (a, g) in acc.iter_mut().zip(chunks.remainder().chunks_exact(LANES)) {
        for l in 0..LANES {
            a[l] += g[l];
        }
    }
    let r = canon::reduce(&acc);
    if full == s.len() {
        r
    } else {
        r + s[full..].iter().fold(0f32, |t, &x| t + x)
    }
}

/// Positions per block: the query heads of one task read a block of K (or V) rows while it
/// is in cache (`POS_BLOCK × head_dim × 4` bytes).
const POS_BLOCK: usize = 128;

/// Query heads `h0 .. h0 + out.len() / head_dim`, all on the same kv head.
///
/// `q`: those heads' queries; `out`: their outputs; `scores`: scratch of `heads × n_ctx`.
#[allow(clippy::too_many_arguments)]
fn heads(
    level: Level,
    sh: Shape,
    h0: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    scores: &mut Vec<f32>,
) {
    let (hd, n) = (sh.head_dim, sh.n_ctx);
    let nh = out.len() / hd;
    let off = (h0 / sh.group) * hd; // the kv head's columns
    out.fill(0.0);
    if n == 0 {
        return;
    }
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    scores.clear();
    scores.resize(nh * n, 0.0);
    // scores, block by block so that each K block is read from memory once for all heads
    for t0 in (0..n).step_by(POS_BLOCK) {
        let t1 = (t0 + POS_BLOCK).min(n);
        let kb = &k[t0 * sh.stride + off..];
        for (i, s) in scores.chunks_exact_mut(n).enumerate() {
            dispatch::dot_rows(
                level,
                &q[i * hd..(i + 1) * hd],
                kb,
                sh.stride,
                &mut s[t0..t1],
            );
        }
    }
    // softmax per head
    for s in scores.chunks_exact_mut(n) {
        s.iter_mut().for_each(|x| *x *= scale);
        let m = s.iter().fold(f32::NEG_INFINITY, |m, &x| vmax(x, m));
        s.iter_mut().for_each(|x| *x -= m);
        dispatch::exp_inplace(level, s);
        let total = sum(s);
        s.iter_mut().for_each(|e| *e /= total);
    }
    // weighted sums of V rows, block by block, in increasing position
    for t0 in (0..n).step_by(POS_BLOCK) {
        let t1 = (t0 + POS_BLOCK).min(n);
        let vb = &v[t0 * sh.stride + off..];
        for (s, oh) in scores.chunks_exact(n).zip(out.chunks_exact_mut(hd)) {
            dispatch::weighted_rows(level, &s[t0..t1], vb, sh.stride, oh);
        }
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
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_ctx: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    attention_at(
        simd::current(),
        q,
        k,
        v,
        n_ctx,
        n_heads,
        n_kv_heads,
        head_dim,
        out,
    )
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
    let threads = rayon::current_num_threads();
    let work = n_ctx.saturating_mul(n_heads).saturating_mul(head_dim);
    if threads <= 1 || work < PAR_MIN_WORK || n_heads < 2 {
        let mut scores = Vec::new();
        for (i, o) in out.chunks_mut(sh.group * head_dim).enumerate() {
            let h0 = i * sh.group;
            heads(
                level,
                sh,
                h0,
                &q[h0 * head_dim..(h0 + sh.group) * head_dim],
                k,
                v,
                o,
                &mut scores,
            );
        }
    } else {
        // a task is a run of query heads of one kv head; split groups until there are at
        // least two tasks per thread (results do not depend on the split)
        let splits = (2 * threads).div_ceil(n_kv_heads).clamp(1, sh.group);
        let task_heads = sh.group.div_ceil(splits);
        let tasks: Vec<(usize, usize)> = (0..n_kv_heads)
            .flat_map(|kv| {
                (0..sh.group)
                    .step_by(task_heads)
                    .map(move |j| (kv * sh.group + j, task_heads.min(sh.group - j)))
            })
            .collect();
        // one output slice per task, in head order
        let mut outs = Vec::with_capacity(tasks.len());
        let mut rest = &mut out[..];
        for &(_, nh) in &tasks {
            let (a, b) = rest.split_at_mut(nh * head_dim);
            outs.push(a);
            rest = b;
        }
        tasks
            .into_par_iter()
            .zip(outs)
            .for_each_init(Vec::new, |scores, ((h0, nh), o)| {
                heads(
                    level,
                    sh,
                    h0,
                    &q[h0 * head_dim..(h0 + nh) * head_dim],
                    k,
                    v,
                    o,
                    scores,
                )
            });
    }
}

/// Plain scalar reference of [`attention`]: sequential dot products, `f32::exp`, sequential
/// sums, `acc += p * v`. Same arguments and panics.
#[allow(clippy::too_many_arguments)]
pub fn attention_ref(
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
