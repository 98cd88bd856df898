//! AVX-512F tiles of prompt attention, in the canonical order of [`crate::canon`]:
//! - scores from K transposed (`kt[d * ld + t]`), 16 positions per vector: the products,
//!   the accumulator combination and the lane tree of the canonical dot are all lane-wise
//!   adds, one position per lane (no shuffles), for up to [`MAX_Q`] query heads per K load;
//! - the softmax of one row of scores (vector max, canonical exp, canonical sum, division);
//! - the weighted sum of value rows for up to [`MAX_Q`] query heads at once: their fma chains
//!   (one per output element, in increasing position) are independent and share the V loads.
//!
//! The safe wrappers check every length; the CPU features are the caller's precondition
//! (`simd::detected() == Level::Avx512`), asserted here too.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::avx512_act::exp16;
use crate::canon::{self, ACCS, LANES};
use crate::simd::{self, Level};

/// Query heads per tile.
pub(crate) const MAX_Q: usize = 4;

fn check_cpu() {
    assert!(
        simd::detected() == Level::Avx512,
        "attention tiles: AVX-512 not available"
    );
}

/// `rows[j][t0 + i] = scale × dot(q[j], k[t0 + i])` for `i < 16 × blocks` (canonical dot),
/// with K transposed: `kt[d * ld + i]` is element `d` of position `t0 + i`.
///
/// # Panics
/// If `qs` is empty or longer than [`MAX_Q`], a query is not `head_dim` long (a multiple of
/// 16), `kt` is too short, or a row is shorter than `t0 + 16 × blocks`.
pub(crate) fn scores(
    qs: &[&[f32]],
    kt: &[f32],
    ld: usize,
    blocks: usize,
    scale: f32,
    t0: usize,
    rows: &mut [&mut [f32]],
) {
    check_cpu();
    let hd = qs.first().map_or(0, |q| q.len());
    assert!(!qs.is_empty() && qs.len() <= MAX_Q && qs.len() == rows.len());
    assert!(hd > 0 && hd % LANES == 0 && qs.iter().all(|q| q.len() == hd));
    if blocks == 0 {
        return;
    }
    assert!(
        kt.len() >= (hd - 1) * ld + 16 * blocks,
        "scores: kt too short"
    );
    assert!(rows.iter().all(|r| r.len() >= t0 + 16 * blocks));
    let q: [*const f32; MAX_Q] = std::array::from_fn(|j| qs[j.min(qs.len() - 1)].as_ptr());
    let o: [*mut f32; MAX_Q] = std::array::from_fn(|j| {
        if j < rows.len() {
            // SAFETY: t0 <= row length (checked above)
            unsafe { rows[j].as_mut_ptr().add(t0) }
        } else {
            std::ptr::null_mut()
        }
    });
    // SAFETY: features checked; every element read or written is inside the slices (checked).
    unsafe {
        match qs.len() {
            1 => scores_q::<1>(q, hd, kt.as_ptr(), ld, blocks, scale, o),
            2 => scores_q::<2>(q, hd, kt.as_ptr(), ld, blocks, scale, o),
            3 => scores_q::<3>(q, hd, kt.as_ptr(), ld, blocks, scale, o),
            _ => scores_q::<4>(q, hd, kt.as_ptr(), ld, blocks, scale, o),
        }
    }
}

/// Lane-wise sums of two sets of `Q` vectors.
#[inline(always)]
unsafe fn add_q<const Q: usize>(mut a: [__m512; Q], b: [__m512; Q]) -> [__m512; Q] {
    // loops, not closures: a closure does not inherit the target features (no inlining)
    for (x, y) in a.iter_mut().zip(b) {
        *x = _mm512_add_ps(*x, y);
    }
    a
}

/// Lane `l` of the canonical dot (its four accumulators combined) for 16 positions.
#[inline(always)]
unsafe fn lane<const Q: usize>(
    q: &[*const f32; MAX_Q],
    groups: usize,
    kt: *const f32,
    ld: usize,
    l: usize,
) -> [__m512; Q] {
    let z = _mm512_setzero_ps();
    let mut acc = [[z; ACCS]; Q];
    // group g -> accumulator g % 4, constant indices
    for g0 in (0..groups).step_by(ACCS) {
        for i in 0..ACCS {
            let g = g0 + i;
            if g < groups {
                let e = LANES * g + l;
                let kv = _mm512_loadu_ps(kt.add(e * ld));
                for (a, qj) in acc.iter_mut().zip(q) {
                    a[i] = _mm512_fmadd_ps(kv, _mm512_set1_ps(*qj.add(e)), a[i]);
                }
            }
        }
    }
    let mut v = [z; Q];
    for (vj, a) in v.iter_mut().zip(&acc) {
        *vj = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
    }
    v
}

/// Lanes `l + l+8` (`l < 8`).
#[inline(always)]
unsafe fn tree8<const Q: usize>(
    q: &[*const f32; MAX_Q],
    g: usize,
    kt: *const f32,
    ld: usize,
    l: usize,
) -> [__m512; Q] {
    add_q(lane::<Q>(q, g, kt, ld, l), lane::<Q>(q, g, kt, ld, l + 8))
}

/// Then `+4` (`l < 4`).
#[inline(always)]
unsafe fn tree4<const Q: usize>(
    q: &[*const f32; MAX_Q],
    g: usize,
    kt: *const f32,
    ld: usize,
    l: usize,
) -> [__m512; Q] {
    add_q(tree8::<Q>(q, g, kt, ld, l), tree8::<Q>(q, g, kt, ld, l + 4))
}

/// Then `+2` (`l < 2`).
#[inline(always)]
unsafe fn tree2<const Q: usize>(
    q: &[*const f32; MAX_Q],
    g: usize,
    kt: *const f32,
    ld: usize,
    l: usize,
) -> [__m512; Q] {
    add_q(tree4::<Q>(q, g, kt, ld, l), tree4::<Q>(q, g, kt, ld, l + 2))
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn scores_q<const Q: usize>(
    q: [*const f32; MAX_Q],
    hd: usize,
    kt: *const f32,
    ld: usize,
    blocks: usize,
    scale: f32,
    out: [*mut f32; MAX_Q],
) {
    let groups = hd / LANES;
    let sc = _mm512_set1_ps(scale);
    for b in 0..blocks {
        let kb = kt.add(16 * b);
        let s = add_q(
            tree2::<Q>(&q, groups, kb, ld, 0),
            tree2::<Q>(&q, groups, kb, ld, 1),
        );
        for (j, sj) in s.iter().enumerate() {
            _mm512_storeu_ps(out[j].add(16 * b), _mm512_mul_ps(*sj, sc));
        }
    }
}

/// Softmax of one row of scaled scores in place: `m = max`, `e = exp(s - m)` (canonical exp),
/// `s = e / sum(e)` (canonical sum) — the operations of `attention::heads`.
pub(crate) fn softmax(s: &mut [f32]) {
    check_cpu();
    // SAFETY: features checked; the kernel stays inside `s`.
    unsafe { softmax_row(s) }
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn softmax_row(s: &mut [f32]) {
    let n = s.len();
    if n == 0 {
        return;
    }
    let full = n / LANES * LANES;
    let p = s.as_mut_ptr();
    // max: lanes never hold NaN (`max(x, m)` keeps `m`); which zero wins does not matter
    // (s - m and exp give the same bits for either)
    let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < full {
        mv = _mm512_max_ps(_mm512_loadu_ps(p.add(i)), mv);
        i += LANES;
    }
    let mut lanes = [0f32; LANES];
    _mm512_storeu_ps(lanes.as_mut_ptr(), mv);
    let m = s[full..]
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| canon::vmax(x, m));
    // exp and the canonical sum: group g into accumulator g % 4
    let mm = _mm512_set1_ps(m);
    let z = _mm512_setzero_ps();
    let mut acc = [z; ACCS];
    let mut g = 0;
    while (g + ACCS) * LANES <= full {
        for (a, acc_a) in acc.iter_mut().enumerate() {
            let at = p.add((g + a) * LANES);
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(at), mm));
            _mm512_storeu_ps(at, e);
            *acc_a = _mm512_add_ps(*acc_a, e);
        }
        g += ACCS;
    }
    for (a, acc_a) in acc.iter_mut().enumerate() {
        if (g + a) * LANES < full {
            let at = p.add((g + a) * LANES);
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(at), mm));
            _mm512_storeu_ps(at, e);
            *acc_a = _mm512_add_ps(*acc_a, e);
        }
    }
    let mut a = [[0f32; LANES]; ACCS];
    for (dst, v) in a.iter_mut().zip(acc) {
        _mm512_storeu_ps(dst.as_mut_ptr(), v);
    }
    let r = canon::reduce(&a);
    let mut tail = 0f32;
    for x in &mut s[full..] {
        *x = canon::exp(*x - m);
        tail += *x;
    }
    let total = if full == n { r } else { r + tail };
    let tv = _mm512_set1_ps(total);
    let p = s.as_mut_ptr();
    let mut i = 0;
    while i < full {
        _mm512_storeu_ps(p.add(i), _mm512_div_ps(_mm512_loadu_ps(p.add(i)), tv));
        i += LANES;
    }
    for x in &mut s[full..] {
        *x /= total;
    }
}

/// `outs[j][i] = fma(ps[j][t], v[t * stride + i], outs[j][i])` for `t = 0, 1, ..` in order:
/// the weighted sums of up to [`MAX_Q`] query heads over the same value rows, interleaved.
///
/// # Panics
/// If `ps` is empty, longer than [`MAX_Q`] or not as long as `outs`, the `ps` differ in
/// length, the `outs` in length, or `v` is too short.
pub(crate) fn weighted(ps: &[&[f32]], v: &[f32], stride: usize, outs: &mut [&mut [f32]]) {
    check_cpu();
    assert!(!ps.is_empty() && ps.len() <= MAX_Q && ps.len() == outs.len());
    let rows = ps[0].len();
    let hd = outs[0].len();
    assert!(ps.iter().all(|p| p.len() == rows) && outs.iter().all(|o| o.len() == hd));
    if rows == 0 || hd == 0 {
        return;
    }
    assert!((rows - 1) * stride + hd <= v.len(), "weighted: v too short");
    let p: [*const f32; MAX_Q] = std::array::from_fn(|j| ps[j.min(ps.len() - 1)].as_ptr());
    let mut o: [*mut f32; MAX_Q] = [std::ptr::null_mut(); MAX_Q];
    for (oj, out) in o.iter_mut().zip(outs.iter_mut()) {
        *oj = out.as_mut_ptr();
    }
    // SAFETY: features checked; every element read or written is inside the slices (checked).
    unsafe {
        match ps.len() {
            1 => weighted_q::<1>(p, rows, v.as_ptr(), stride, hd, o),
            2 => weighted_q::<2>(p, rows, v.as_ptr(), stride, hd, o),
            3 => weighted_q::<3>(p, rows, v.as_ptr(), stride, hd, o),
            _ => weighted_q::<4>(p, rows, v.as_ptr(), stride, hd, o),
        }
    }
}

/// `C` registers (16 C columns) from column `c` of every output, over all rows.
#[inline(always)]
unsafe fn weighted_cols<const Q: usize, const C: usize>(
    p: &[*const f32; MAX_Q],
    rows: usize,
    v: *const f32,
    stride: usize,
    c: usize,
    o: &[*mut f32; MAX_Q],
) {
    let mut acc = [[_mm512_setzero_ps(); C]; Q];
    for (j, a) in acc.iter_mut().enumerate() {
        for (i, ai) in a.iter_mut().enumerate() {
            *ai = _mm512_loadu_ps(o[j].add(c + 16 * i));
        }
    }
    let mut vr = [_mm512_setzero_ps(); C];
    for t in 0..rows {
        let row = v.add(t * stride + c);
        for (i, vi) in vr.iter_mut().enumerate() {
            *vi = _mm512_loadu_ps(row.add(16 * i));
        }
        for (j, a) in acc.iter_mut().enumerate() {
            let pv = _mm512_set1_ps(*p[j].add(t));
            for (ai, vi) in a.iter_mut().zip(&vr) {
                *ai = _mm512_fmadd_ps(pv, *vi, *ai);
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        for (i, ai) in a.iter().enumerate() {
            _mm512_storeu_ps(o[j].add(c + 16 * i), *ai);
        }
    }
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn weighted_q<const Q: usize>(
    p: [*const f32; MAX_Q],
    rows: usize,
    v: *const f32,
    stride: usize,
    hd: usize,
    o: [*mut f32; MAX_Q],
) {
    let mut c = 0;
    while c + 64 <= hd {
        weighted_cols::<Q, 4>(&p, rows, v, stride, c, &o);
        c += 64;
    }
    while c + 16 <= hd {
        weighted_cols::<Q, 1>(&p, rows, v, stride, c, &o);
        c += 16;
    }
    for j in 0..Q {
        for i in c..hd {
            let oi = &mut *o[j].add(i);
            for t in 0..rows {
                *oi = (*p[j].add(t)).mul_add(*v.add(t * stride + i), *oi);
            }
        }
    }
}
