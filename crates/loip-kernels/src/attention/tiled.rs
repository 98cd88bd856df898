//! The AVX-512 or AVX2 tiles of [`super::attention_causal`]: one task (a block of queries ×
//! a run of query heads on one kv head) with K transposed once per call. Every query head gets exactly
//! the operations of the module docs of [`super`], in the same order, as [`super::heads`].

use super::{KTrans, Query, Shape, POS_BLOCK};
use crate::canon::LANES;
use crate::simd::Level;
use crate::x86::attn_tiles::{self as tiles, MAX_Q};
use crate::x86::attn_tiles_avx2 as tiles2;

/// `scores(qs, kt, ld, blocks, scale, t0, rows)` of [`tiles::scores`].
type ScoresFn = fn(&[&[f32]], &[f32], usize, usize, f32, usize, &mut [&mut [f32]]);
/// `weighted(ps, v, stride, outs)` of [`tiles::weighted`].
type WeightedFn = fn(&[&[f32]], &[f32], usize, &mut [&mut [f32]]);

/// The tile kernels of one level: scores, softmax of a row, weighted sums.
struct Kernels {
    scores: ScoresFn,
    softmax: fn(&mut [f32]),
    weighted: WeightedFn,
}

/// AVX2: 8 positions per vector; the softmax of [`super::heads`].
fn kernels(level: Level) -> Kernels {
    match level {
        Level::Avx512 => Kernels {
            scores: tiles::scores,
            softmax: tiles::softmax,
            weighted: tiles::weighted,
        },
        _ => Kernels {
            scores: tiles2::scores,
            softmax: |s| super::softmax_from(Level::Avx2, s, tiles2::max(s)),
            weighted: tiles2::weighted,
        },
    }
}

/// Whole vectors of positions covering `n`.
fn padded(n: usize) -> usize {
    n.div_ceil(LANES) * LANES
}

/// [`super::heads`] on the tiles: scores for up to [`MAX_Q`] query heads per pass over the
/// transposed K block, their softmax, then their weighted sums interleaved `MAX_Q` at a time
/// (each query head's own positions before and past the shared ones go alone, still in order).
///
/// A query head's row of scores covers whole vectors of positions, from its first position
/// rounded down to a vector: the tiles compute the positions outside its window on real or
/// zero K rows, and its softmax and weighted sum take only the window's part of the row.
pub(super) fn heads(
    level: Level,
    sh: Shape,
    h0: usize,
    qs: &mut [Query<'_>],
    kt: &KTrans,
    v: &[f32],
    scores: &mut Vec<f32>,
) {
    let kern = kernels(level);
    let hd = sh.head_dim;
    let off = (h0 / sh.group) * hd; // the kv head's columns
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let ld = kt.ld;
    let ktb = &kt.kt[off * ld..(off + hd) * ld];
    // one query head per row: its positions `fs[j] .. ns[j]`; the row holds positions
    // `los[j] .. padded(ns[j])`
    let per_head = |f: fn(&Query<'_>) -> usize| -> Vec<usize> {
        qs.iter()
            .flat_map(|q| std::iter::repeat_n(f(q), q.out.len() / hd))
            .collect()
    };
    let ns = per_head(|q| q.n_ctx);
    let fs = per_head(|q| q.first);
    let los: Vec<usize> = fs.iter().map(|&f| f / LANES * LANES).collect();
    let qv: Vec<&[f32]> = qs.iter().flat_map(|q| q.q.chunks_exact(hd)).collect();
    let span = |j: usize| padded(ns[j]).max(los[j]) - los[j];
    scores.clear();
    scores.resize((0..ns.len()).map(span).sum(), 0.0);
    let mut rows: Vec<&mut [f32]> = Vec::with_capacity(ns.len());
    let mut rest = &mut scores[..];
    for j in 0..ns.len() {
        let (r, tail) = rest.split_at_mut(span(j));
        rows.push(r);
        rest = tail;
    }
    let lowest = los.iter().copied().min().unwrap_or(0);
    let longest = ns.iter().copied().max().unwrap_or(0);
    let sets: Vec<std::ops::Range<usize>> = (0..ns.len())
        .step_by(MAX_Q)
        .map(|a| a..(a + MAX_Q).min(ns.len()))
        .collect();
    // a row's own scores at positions `a .. b` (whole vectors)
    let own = |rows: &mut [&mut [f32]], j: usize, a: usize, b: usize| {
        if b > a {
            let r = &mut rows[j..j + 1];
            let t = a - los[j];
            (kern.scores)(&qv[j..j + 1], &ktb[a..], ld, (b - a) / LANES, scale, t, r);
        }
    };
    // scores, block by block
    for t0 in (lowest..longest).step_by(POS_BLOCK) {
        // whole vectors of row j's positions in this block
        let from = |j: usize| t0.max(los[j]);
        let to = |j: usize| padded(ns[j].min(t0 + POS_BLOCK)).max(from(j));
        for set in &sets {
            let a = set.clone().map(from).max().unwrap_or(t0);
            let b = set.clone().map(to).min().unwrap_or(t0);
            if b > a {
                for j in set.clone() {
                    own(&mut rows, j, from(j), a);
                }
                // the set's rows from position `a` on
                let mut sub: [&mut [f32]; MAX_Q] = Default::default();
                for (d, (r, j)) in sub
                    .iter_mut()
                    .zip(rows[set.clone()].iter_mut().zip(set.clone()))
                {
                    *d = &mut r[a - los[j]..];
                }
                let q = &qv[set.clone()];
                let blocks = (b - a) / LANES;
                (kern.scores)(q, &ktb[a..], ld, blocks, scale, 0, &mut sub[..set.len()]);
                for j in set.clone() {
                    own(&mut rows, j, b, to(j));
                }
            } else {
                for j in set.clone() {
                    own(&mut rows, j, from(j), to(j));
                }
            }
        }
    }
    // each row's window: positions `fs[j] .. ns[j]`
    let window = |j: usize| fs[j] - los[j]..ns[j].max(fs[j]) - los[j];
    for j in 0..ns.len() {
        (kern.softmax)(&mut rows[j][window(j)]);
    }
    // weighted sums of V rows, block by block, in increasing position
    let rows: Vec<&[f32]> = rows.into_iter().map(|r| &*r).collect();
    let mut outs: Vec<&mut [f32]> = qs
        .iter_mut()
        .flat_map(|q| q.out.chunks_exact_mut(hd))
        .collect();
    outs.iter_mut().for_each(|o| o.fill(0.0));
    let alone = |outs: &mut [&mut [f32]], j: usize, a: usize, b: usize| {
        if b > a {
            let vb = &v[a * sh.stride + off..];
            let o = &mut outs[j..j + 1];
            (kern.weighted)(&[&rows[j][a - los[j]..b - los[j]]], vb, sh.stride, o);
        }
    };
    let mut ps: [&[f32]; MAX_Q] = [&[]; MAX_Q];
    for t0 in (lowest..longest).step_by(POS_BLOCK) {
        let from = |j: usize| t0.max(fs[j]);
        let to = |j: usize| ns[j].min(t0 + POS_BLOCK).max(from(j));
        for set in &sets {
            // each query head's positions before the shared ones, the shared ones, its own past them
            let a = set.clone().map(from).max().unwrap_or(t0);
            let b = set.clone().map(to).min().unwrap_or(t0);
            if b > a {
                for j in set.clone() {
                    alone(&mut outs, j, from(j), a);
                }
                for (p, j) in ps.iter_mut().zip(set.clone()) {
                    *p = &rows[j][a - los[j]..b - los[j]];
                }
                let vb = &v[a * sh.stride + off..];
                (kern.weighted)(&ps[..set.len()], vb, sh.stride, &mut outs[set.clone()]);
                for j in set.clone() {
                    alone(&mut outs, j, b, to(j));
                }
            } else {
                for j in set.clone() {
                    alone(&mut outs, j, from(j), to(j));
                }
            }
        }
    }
}
