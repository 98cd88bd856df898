//! AVX2 tiles of prompt attention: the twins of [`super::attn_tiles`] with 8 positions per
//! vector (two vectors per block of 16 positions), the same canonical operations per score
//! and per output element. The softmax is the plain one of `attention` (AVX2 exp) after the
//! vector [`max`].
//!
//! The safe wrappers check every length; the CPU features are the caller's precondition
//! (`simd::detected()` is AVX2 or AVX-512), asserted here too.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::attn_tiles::MAX_Q;
use crate::canon::{self, ACCS, LANES};
use crate::simd::{self, Level};

fn check_cpu() {
    assert!(
        matches!(simd::detected(), Level::Avx2 | Level::Avx512),
        "attention tiles: AVX2 not available"
    );
}

/// As [`super::attn_tiles::scores`], on AVX2.
///
/// # Panics
/// As [`super::attn_tiles::scores`].
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
    // at most SCORE_Q query heads per pass: their accumulators and lane trees fit 16 ymm
    for (qs, rows) in qs.chunks(SCORE_Q).zip(rows.chunks_mut(SCORE_Q)) {
        let q: [*const f32; MAX_Q] = std::array::from_fn(|j| qs[j.min(qs.len() - 1)].as_ptr());
        let o: [*mut f32; MAX_Q] = std::array::from_fn(|j| {
            if j < rows.len() {
                // SAFETY: t0 <= row length (checked above)
                unsafe { rows[j].as_mut_ptr().add(t0) }
            } else {
                std::ptr::null_mut()
            }
        });
        // SAFETY: features checked; every element read or written is inside the slices
        // (checked).
        unsafe {
            match qs.len() {
                1 => scores_q::<1>(q, hd, kt.as_ptr(), ld, blocks, scale, o),
                _ => scores_q::<{ SCORE_Q }>(q, hd, kt.as_ptr(), ld, blocks, scale, o),
            }
        }
    }
}

/// Query heads per pass over K in [`scores`].
const SCORE_Q: usize = 2;

/// Lane-wise sums of two sets of `Q` vectors.
#[inline(always)]
unsafe fn add_q<const Q: usize>(mut a: [__m256; Q], b: [__m256; Q]) -> [__m256; Q] {
    for (x, y) in a.iter_mut().zip(b) {
        *x = _mm256_add_ps(*x, y);
    }
    a
}

/// Lane `l` of the canonical dot (its four accumulators combined) for 8 positions.
#[inline(always)]
unsafe fn lane<const Q: usize>(
    q: &[*const f32; MAX_Q],
    groups: usize,
    kt: *const f32,
    ld: usize,
    l: usize,
) -> [__m256; Q] {
    let z = _mm256_setzero_ps();
    let mut acc = [[z; ACCS]; Q];
    for g0 in (0..groups).step_by(ACCS) {
        for i in 0..ACCS {
            let g = g0 + i;
            if g < groups {
                let e = LANES * g + l;
                let kv = _mm256_loadu_ps(kt.add(e * ld));
                for (a, qj) in acc.iter_mut().zip(q) {
                    a[i] = _mm256_fmadd_ps(kv, _mm256_set1_ps(*qj.add(e)), a[i]);
                }
            }
        }
    }
    let mut v = [z; Q];
    for (vj, a) in v.iter_mut().zip(&acc) {
        *vj = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
    }
    v
}

/// The canonical lane tree, depth first: lanes `l + l+8` (`l < 8`).
#[inline(always)]
unsafe fn tree8<const Q: usize>(
    q: &[*const f32; MAX_Q],
    g: usize,
    kt: *const f32,
    ld: usize,
    l: usize,
) -> [__m256; Q] {
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
) -> [__m256; Q] {
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
) -> [__m256; Q] {
    add_q(tree4::<Q>(q, g, kt, ld, l), tree4::<Q>(q, g, kt, ld, l + 2))
}

#[target_feature(enable = "avx2,fma,f16c")]
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
    let sc = _mm256_set1_ps(scale);
    for p in (0..16 * blocks).step_by(8) {
        let kb = kt.add(p);
        let s = add_q(
            tree2::<Q>(&q, groups, kb, ld, 0),
            tree2::<Q>(&q, groups, kb, ld, 1),
        );
        for (j, sj) in s.iter().enumerate() {
            _mm256_storeu_ps(out[j].add(p), _mm256_mul_ps(*sj, sc));
        }
    }
}

/// As [`super::attn_tiles::weighted`], on AVX2.
///
/// # Panics
/// As [`super::attn_tiles::weighted`].
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

/// `C` registers (8 C columns) from column `c` of every output, over all rows.
#[inline(always)]
unsafe fn weighted_cols<const Q: usize, const C: usize>(
    p: &[*const f32; MAX_Q],
    rows: usize,
    v: *const f32,
    stride: usize,
    c: usize,
    o: &[*mut f32; MAX_Q],
) {
    let mut acc = [[_mm256_setzero_ps(); C]; Q];
    for (j, a) in acc.iter_mut().enumerate() {
        for (i, ai) in a.iter_mut().enumerate() {
            *ai = _mm256_loadu_ps(o[j].add(c + 8 * i));
        }
    }
    let mut vr = [_mm256_setzero_ps(); C];
    for t in 0..rows {
        let row = v.add(t * stride + c);
        for (i, vi) in vr.iter_mut().enumerate() {
            *vi = _mm256_loadu_ps(row.add(8 * i));
        }
        for (j, a) in acc.iter_mut().enumerate() {
            let pv = _mm256_set1_ps(*p[j].add(t));
            for (ai, vi) in a.iter_mut().zip(&vr) {
                *ai = _mm256_fmadd_ps(pv, *vi, *ai);
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        for (i, ai) in a.iter().enumerate() {
            _mm256_storeu_ps(o[j].add(c + 8 * i), *ai);
        }
    }
}

/// Registers per output in flight: `Q × C` accumulators and `C` rows fit the 16 ymm.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weighted_q<const Q: usize>(
    p: [*const f32; MAX_Q],
    rows: usize,
    v: *const f32,
    stride: usize,
    hd: usize,
    o: [*mut f32; MAX_Q],
) {
    let mut c = 0;
    // 16 columns: 4 heads give 8 independent chains per pass (fma latency × ports)
    while c + 16 <= hd {
        weighted_cols::<Q, 2>(&p, rows, v, stride, c, &o);
        c += 16;
    }
    while c + 8 <= hd {
        weighted_cols::<Q, 1>(&p, rows, v, stride, c, &o);
        c += 8;
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

/// `max(s)` with `vmax` semantics, as `attention`'s fold: lanes never hold NaN (`max(x, m)`
/// keeps `m`), and which zero wins does not matter (`s - m` and exp give the same bits).
pub(crate) fn max(s: &[f32]) -> f32 {
    check_cpu();
    // SAFETY: features checked; the kernel stays inside `s`.
    unsafe { max_row(s) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn max_row(s: &[f32]) -> f32 {
    let full = s.len() / 8 * 8;
    let p = s.as_ptr();
    let mut mv = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    let mut i = 0;
    while i + 32 <= full {
        for (j, m) in mv.iter_mut().enumerate() {
            *m = _mm256_max_ps(_mm256_loadu_ps(p.add(i + 8 * j)), *m);
        }
        i += 32;
    }
    while i < full {
        mv[0] = _mm256_max_ps(_mm256_loadu_ps(p.add(i)), mv[0]);
        i += 8;
    }
    let mut lanes = [0f32; 32];
    for (j, m) in mv.iter().enumerate() {
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * j), *m);
    }
    s[full..]
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| canon::vmax(x, m))
}
