//! Attention, grouped-query: one query token over `n_ctx` cached positions ([`attention`],
//! decode), or the tokens of a prompt each over its causal prefix ([`attention_causal`],
//! prefill: tiled over queries, the same operations per query as [`attention`]) or over the
//! last positions of a sliding window ([`attention_sliding`], likewise tiled).
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
use crate::team;

/// Below this many multiply-adds (`n_ctx × n_heads × head_dim`) heads run on the caller.
const PAR_MIN_WORK: usize = 1 << 15;

/// The shape of one attention call (the context length is per query).
#[derive(Clone, Copy)]
struct Shape {
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

/// Steps 2 and 3 of the module docs on one row of scaled scores, in place.
fn softmax(level: Level, s: &mut [f32]) {
    let m = s.iter().fold(f32::NEG_INFINITY, |m, &x| vmax(x, m));
    softmax_from(level, s, m)
}

/// [`softmax`] given `m = max(s)` (`vmax` semantics: NaN never wins; either zero may).
fn softmax_from(level: Level, s: &mut [f32], m: f32) {
    s.iter_mut().for_each(|x| *x -= m);
    dispatch::exp_inplace(level, s);
    let total = sum(s);
    s.iter_mut().for_each(|e| *e /= total);
}

/// Positions per block: the query heads of one task read a block of K (or V) rows while it
/// is in cache (`POS_BLOCK × head_dim × 4` bytes).
const POS_BLOCK: usize = 128;

/// One query token of a task: its queries for the task's heads (`heads × head_dim`), the
/// positions it attends (`first .. n_ctx` of the call's K and V rows), and its outputs
/// (`heads × head_dim`).
struct Query<'a> {
    q: &'a [f32],
    first: usize,
    n_ctx: usize,
    out: &'a mut [f32],
}

impl Query<'_> {
    /// Positions attended: the length of each head's row of scores.
    fn len(&self) -> usize {
        self.n_ctx - self.first
    }
}

/// Query heads `h0 ..` (all on the same kv head) of each query token in `qs`; every query
/// gets exactly the operations of the module docs, whatever the other queries of the task.
///
/// `scores`: scratch, `heads × len` per query. Each block of K (or V) rows is read once
/// for all heads and queries of the task while it is in cache; a query's row of scores
/// starts at its first position, so its operations are those of [`attention`] on the rows
/// `first .. n_ctx` alone.
fn heads(
    level: Level,
    sh: Shape,
    h0: usize,
    qs: &mut [Query<'_>],
    k: &[f32],
    v: &[f32],
    scores: &mut Vec<f32>,
) {
    let hd = sh.head_dim;
    let off = (h0 / sh.group) * hd; // the kv head's columns
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    // per query: its first score, heads
    let starts: Vec<usize> = qs
        .iter()
        .scan(0, |acc, q| {
            let at = *acc;
            *acc += q.out.len() / hd * q.len();
            Some(at)
        })
        .collect();
    let total: usize = qs.iter().map(|q| q.out.len() / hd * q.len()).sum();
    scores.clear();
    scores.resize(total, 0.0);
    let lowest = qs.iter().map(|q| q.first).min().unwrap_or(0);
    let longest = qs.iter().map(|q| q.n_ctx).max().unwrap_or(0);
    // scores, block by block
    for t0 in (lowest..longest).step_by(POS_BLOCK) {
        for (qi, &at) in qs.iter().zip(&starts) {
            let (f, n) = (qi.first, qi.len());
            let (a, t1) = (t0.max(f), (t0 + POS_BLOCK).min(qi.n_ctx));
            if t1 <= a {
                continue;
            }
            let kb = &k[a * sh.stride + off..];
            let sq = &mut scores[at..at + qi.out.len() / hd * n];
            for (i, s) in sq.chunks_exact_mut(n).enumerate() {
                let qh = &qi.q[i * hd..(i + 1) * hd];
                dispatch::dot_rows(level, qh, kb, sh.stride, &mut s[a - f..t1 - f]);
            }
        }
    }
    // softmax per query and head
    for (qi, &at) in qs.iter().zip(&starts) {
        let n = qi.len();
        if n == 0 {
            continue;
        }
        for s in scores[at..at + qi.out.len() / hd * n].chunks_exact_mut(n) {
            s.iter_mut().for_each(|x| *x *= scale);
            softmax(level, s);
        }
    }
    // weighted sums of V rows, block by block, in increasing position
    qs.iter_mut().for_each(|q| q.out.fill(0.0));
    for t0 in (lowest..longest).step_by(POS_BLOCK) {
        for (qi, &at) in qs.iter_mut().zip(&starts) {
            let (f, n) = (qi.first, qi.len());
            let (a, t1) = (t0.max(f), (t0 + POS_BLOCK).min(qi.n_ctx));
            if t1 <= a {
                continue;
            }
            let vb = &v[a * sh.stride + off..];
            let sq = &scores[at..at + qi.out.len() / hd * n];
            for (s, oh) in sq.chunks_exact(n).zip(qi.out.chunks_exact_mut(hd)) {
                dispatch::weighted_rows(level, &s[a - f..t1 - f], vb, sh.stride, oh);
            }
        }
    }
}

/// Runs of query heads that one task takes, `(first head, heads)`: a run lies on one kv head;
/// groups are split until there are at least two runs per thread (results do not depend on
/// the split).
fn head_runs(sh: Shape, n_kv_heads: usize, threads: usize) -> Vec<(usize, usize)> {
    let splits = (2 * threads).div_ceil(n_kv_heads).clamp(1, sh.group);
    let task_heads = sh.group.div_ceil(splits);
    (0..n_kv_heads)
        .flat_map(|kv| {
            (0..sh.group)
                .step_by(task_heads)
                .map(move |j| (kv * sh.group + j, task_heads.min(sh.group - j)))
        })
        .collect()
}

/// Query tokens per task of [`attention_causal`]: their scores (`heads × n_ctx` each) stay
/// in L2 while the task's K and V blocks pass once for all of them.
const QUERY_BLOCK: usize = 16;

/// Causal attention of `m = q.len() / (n_heads × head_dim)` consecutive query tokens (a
/// prompt or a prompt chunk): query `i` sits at position `start + i` and attends positions
/// `0 ..= start + i`. Bit-identical to [`attention`] of each query alone with
/// `n_ctx = start + i + 1` (the same operations in the same order per query and head), but
/// tiled over queries: each block of K and V rows is read once for up to [`QUERY_BLOCK`]
/// queries, and the tasks are blocks of queries × runs of heads.
///
/// `q`, `out`: `m × n_heads × head_dim`; `k`, `v`: at least `start + m` rows of
/// `n_kv_heads × head_dim`.
///
/// # Panics
/// If the lengths do not match the shape or `n_heads` is not a multiple of `n_kv_heads > 0`.
#[allow(clippy::too_many_arguments)]
pub fn attention_causal(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    start: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let heads = (n_heads, n_kv_heads, head_dim);
    attention_causal_at(simd::current(), q, k, v, start, heads, out)
}

/// Sliding-window causal attention of `m` consecutive query tokens: query `i` sits at
/// position `start + i` and attends the last `window` positions, itself included
/// (`max(0, start + i + 1 − window) ..= start + i`). Bit-identical to [`attention`] of each
/// query alone over exactly those rows, tiled as [`attention_causal`] (which is this with an
/// unbounded window).
///
/// `k`, `v`: rows of `n_kv_heads × head_dim` from position `first = max(0, start + 1 −
/// window)` (the first query's first position) on, at least `start + m − first` of them;
/// `q`, `out`: `m × n_heads × head_dim`. A window of 0 attends nothing (zero outputs).
///
/// # Panics
/// If the lengths do not match the shape or `n_heads` is not a multiple of `n_kv_heads > 0`.
#[allow(clippy::too_many_arguments)]
pub fn attention_sliding(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    start: usize,
    window: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut [f32],
) {
    let heads = (n_heads, n_kv_heads, head_dim);
    attention_window_at(simd::current(), q, k, v, (start, window), heads, out)
}

/// [`attention_causal`] on an explicit level; `heads`: `(n_heads, n_kv_heads, head_dim)`.
pub(crate) fn attention_causal_at(
    level: Level,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    start: usize,
    heads: (usize, usize, usize),
    out: &mut [f32],
) {
    attention_window_at(level, q, k, v, (start, usize::MAX), heads, out)
}

/// [`attention_sliding`] on an explicit level; `(start, window)`, `heads`: `(n_heads,
/// n_kv_heads, head_dim)`.
pub(crate) fn attention_window_at(
    level: Level,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (start, window): (usize, usize),
    (n_heads, n_kv_heads, head_dim): (usize, usize, usize),
    out: &mut [f32],
) {
    let width = n_heads * head_dim;
    assert!(width > 0 || q.is_empty(), "attention: empty heads");
    let m = q.len().checked_div(width).unwrap_or(0);
    assert_eq!(q.len(), m * width, "attention: q length");
    assert_eq!(out.len(), q.len(), "attention: out length");
    if m == 0 {
        return;
    }
    // K and V row 0 is position `base`; query at position `p` attends rows
    // `(p + 1).saturating_sub(window) - base .. p + 1 - base`
    let base = (start + 1).saturating_sub(window);
    let n_last = start + m - base;
    // checks k, v and the head counts once, for the longest context
    let sh = check(
        &q[..width],
        k,
        v,
        n_last,
        n_heads,
        n_kv_heads,
        head_dim,
        &out[..width],
    );
    let runs = head_runs(sh, n_kv_heads, rayon::current_num_threads());
    // tasks: (query block, run) with each query's outputs of that run
    let mut tasks: Vec<(usize, usize, Vec<Query<'_>>)> = Vec::new();
    for (b, (qb, ob)) in q
        .chunks(QUERY_BLOCK * width)
        .zip(out.chunks_mut(QUERY_BLOCK * width))
        .enumerate()
    {
        let mut per_run: Vec<Vec<Query<'_>>> = runs.iter().map(|_| Vec::new()).collect();
        for (i, (qt, ot)) in qb.chunks(width).zip(ob.chunks_mut(width)).enumerate() {
            let mut rest = ot;
            let end = start + b * QUERY_BLOCK + i + 1;
            for (r, &(h0, nh)) in runs.iter().enumerate() {
                let (o, tail) = rest.split_at_mut(nh * head_dim);
                rest = tail;
                per_run[r].push(Query {
                    q: &qt[h0 * head_dim..(h0 + nh) * head_dim],
                    first: end.saturating_sub(window) - base,
                    n_ctx: end - base,
                    out: o,
                });
            }
        }
        for (r, qs) in per_run.into_iter().enumerate() {
            tasks.push((b, runs[r].0, qs));
        }
    }
    let kt = (m >= TILED_MIN_QUERIES && tiles_usable(level, head_dim))
        .then(|| transpose_k(k, n_last, sh.stride));
    let run = |scores: &mut Vec<f32>, h0: usize, qs: &mut [Query<'_>]| match &kt {
        Some(kt) => tiled_heads(level, sh, h0, qs, (k, kt), v, scores),
        None => heads(level, sh, h0, qs, k, v, scores),
    };
    let work = m.saturating_mul(n_last.min(window)).saturating_mul(width);
    if rayon::current_num_threads() <= 1 || work < PAR_MIN_WORK {
        let mut scores = Vec::new();
        for (_, h0, mut qs) in tasks {
            run(&mut scores, h0, &mut qs);
        }
    } else {
        team::par_drain(tasks, Vec::new, |scores, (_, h0, mut qs)| {
            run(scores, h0, &mut qs)
        });
    }
}

#[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
mod tiled;

/// [`heads`] on the AVX-512 or AVX2 tiles (only where [`tiles_usable`]).
#[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
fn tiled_heads(
    level: Level,
    sh: Shape,
    h0: usize,
    qs: &mut [Query<'_>],
    (_, kt): (&[f32], &KTrans),
    v: &[f32],
    scores: &mut Vec<f32>,
) {
    tiled::heads(level, sh, h0, qs, kt, v, scores)
}

/// No tiles off x86 ([`tiles_usable`] is false there): the plain path.
#[cfg(not(any(target_arch = "x86_64", target_arch = "x86")))]
fn tiled_heads(
    level: Level,
    sh: Shape,
    h0: usize,
    qs: &mut [Query<'_>],
    (k, _): (&[f32], &KTrans),
    v: &[f32],
    scores: &mut Vec<f32>,
) {
    heads(level, sh, h0, qs, k, v, scores)
}

/// Queries from which [`attention_causal`] transposes K for the tiles (the transpose
/// reads the cache once; each query then reads it once per head).
const TILED_MIN_QUERIES: usize = 4;

/// Whether the AVX-512 or AVX2 tiles serve `level` (head dims that are whole vectors).
pub(crate) fn tiles_usable(level: Level, head_dim: usize) -> bool {
    cfg!(any(target_arch = "x86_64", target_arch = "x86"))
        && match level {
            Level::Avx512 => simd::detected() == Level::Avx512,
            Level::Avx2 => matches!(simd::detected(), Level::Avx2 | Level::Avx512),
            Level::Scalar | Level::Neon => false,
        }
        && head_dim > 0
        && head_dim % LANES == 0
}

/// The first `n` cached K rows transposed: element `c` (of `stride`) of position `t` at
/// `kt[c × ld + t]`, with `ld` at least `n`, a whole (odd) number of vectors, and zeros after `n`.
#[cfg_attr(
    not(any(target_arch = "x86_64", target_arch = "x86")),
    allow(dead_code)
)]
struct KTrans {
    kt: Vec<f32>,
    ld: usize,
}

fn transpose_k(k: &[f32], n: usize, stride: usize) -> KTrans {
    // an odd number of 64-byte lines per row: the rows of a block fall in different L1 sets
    let ld = (n.div_ceil(LANES) | 1) * LANES;
    let mut kt = vec![0f32; stride * ld];
    // 16 positions at a time: contiguous writes, 16 rows read
    for (b, rows) in k[..n * stride].chunks(LANES * stride).enumerate() {
        for c in 0..stride {
            let dst = &mut kt[c * ld + b * LANES..];
            for (d, row) in dst.iter_mut().zip(rows.chunks_exact(stride)) {
                *d = row[c];
            }
        }
    }
    KTrans { kt, ld }
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
    let one = |h0: usize, o: &mut [f32], scores: &mut Vec<f32>| {
        let nh = o.len() / head_dim;
        let mut qs = [Query {
            q: &q[h0 * head_dim..(h0 + nh) * head_dim],
            first: 0,
            n_ctx,
            out: o,
        }];
        heads(level, sh, h0, &mut qs, k, v, scores);
    };
    if threads <= 1 || work < PAR_MIN_WORK || n_heads < 2 {
        let mut scores = Vec::new();
        for (i, o) in out.chunks_mut(sh.group * head_dim).enumerate() {
            one(i * sh.group, o, &mut scores);
        }
    } else {
        let tasks = head_runs(sh, n_kv_heads, threads);
        // one output slice per task, in head order
        let mut outs = Vec::with_capacity(tasks.len());
        let mut rest = &mut out[..];
        for &(_, nh) in &tasks {
            let (a, b) = rest.split_at_mut(nh * head_dim);
            outs.push(a);
            rest = b;
        }
        let tasks: Vec<_> = tasks.into_iter().zip(outs).collect();
        team::par_drain(tasks, Vec::new, |scores, ((h0, _), o)| one(h0, o, scores));
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
