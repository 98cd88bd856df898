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
/// (each query head's own positions past the shared ones follow alone, still in order).
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
    // one query head per row: its context length; rows padded to whole vectors
    let ns: Vec<usize> = qs
        .iter()
        .flat_map(|q| std::iter::repeat_n(q.n_ctx, q.out.len() / hd))
        .collect();
    let qv: Vec<&[f32]> = qs.iter().flat_map(|q| q.q.chunks_exact(hd)).collect();
    scores.clear();
    scores.resize(ns.iter().map(|&n| padded(n)).sum(), 0.0);
    let mut rows: Vec<&mut [f32]> = Vec::with_capacity(ns.len());
    let mut rest = &mut scores[..];
    for &n in &ns {
        let (r, tail) = rest.split_at_mut(padded(n));
        rows.push(r);
        rest = tail;
    }
    let longest = ns.iter().copied().max().unwrap_or(0);
    let sets: Vec<std::ops::Range<usize>> = (0..ns.len())
        .step_by(MAX_Q)
        .map(|a| a..(a + MAX_Q).min(ns.len()))
        .collect();
    // scores, block by block (positions past a row's context are computed on zeros and ignored)
    for t0 in (0..longest).step_by(POS_BLOCK) {
        let blocks = |n: usize| padded(n.min(t0 + POS_BLOCK)).saturating_sub(t0) / LANES;
        for set in &sets {
            let common = ns[set.clone()]
                .iter()
                .map(|&n| blocks(n))
                .min()
                .unwrap_or(0);
            if common > 0 {
                let (q, r) = (&qv[set.clone()], &mut rows[set.clone()]);
                (kern.scores)(q, &ktb[t0..], ld, common, scale, t0, r);
            }
            for j in set.clone() {
                let more = blocks(ns[j]) - common;
                if more > 0 {
                    let t = t0 + common * LANES;
                    let r = &mut rows[j..j + 1];
                    (kern.scores)(&qv[j..j + 1], &ktb[t..], ld, more, scale, t, r);
                }
            }
        }
    }
    for (r, &n) in rows.iter_mut().zip(&ns) {
        (kern.softmax)(&mut r[..n]);
    }
    // weighted sums of V rows, block by block, in increasing position
    let rows: Vec<&[f32]> = rows.into_iter().map(|r| &*r).collect();
    let mut outs: Vec<&mut [f32]> = qs
        .iter_mut()
        .flat_map(|q| q.out.chunks_exact_mut(hd))
        .collect();
    outs.iter_mut().for_each(|o| o.fill(0.0));
    let mut ps: [&[f32]; MAX_Q] = [&[]; MAX_Q];
    for t0 in (0..longest).step_by(POS_BLOCK) {
        let end = |n: usize| n.min(t0 + POS_BLOCK).max(t0);
        for set in &sets {
            // positions every query head of the set attends, then each one's own
            let tc = ns[set.clone()].iter().map(|&n| end(n)).min().unwrap_or(t0);
            if tc > t0 {
                for (p, r) in ps.iter_mut().zip(&rows[set.clone()]) {
                    *p = &r[t0..tc];
                }
                let vb = &v[t0 * sh.stride + off..];
                (kern.weighted)(&ps[..set.len()], vb, sh.stride, &mut outs[set.clone()]);
            }
            for j in set.clone() {
                let e = end(ns[j]);
                if e > tc {
                    let vb = &v[tc * sh.stride + off..];
                    let o = &mut outs[j..j + 1];
                    (kern.weighted)(&[&rows[j][tc..e]], vb, sh.stride, o);
                }
            }
        }
    }
}
