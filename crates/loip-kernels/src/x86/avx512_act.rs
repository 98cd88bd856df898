//! AVX-512F kernels on f32 activations: attention's dot products and weighted sums, the
//! canonical exp, SiLU·up and tanh-GELU·up. Same canonical order as [`crate::canon`].
//!
//! Safety: every `unsafe fn` here requires a CPU with AVX-512F, AVX2, FMA and F16C
//! (checked by [`crate::simd`]) and the buffer lengths stated in its docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::avx512::{dot_float, reduce4, F32};
use crate::canon::exp_consts as ec;
use crate::canon::{gelu_consts as gl, Act};

/// Canonical dot product of two f32 slices of equal length.
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    dot_float::<F32, 1, 1>([a.as_ptr() as *const u8], a.len(), [b.as_ptr()])[0][0]
}

/// `out[t]` = canonical dot of `q` with `k[t * stride .. t * stride + q.len()]`, for
/// `t < out.len()` (attention scores of one head).
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available; `k` holds every row read.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_rows(q: &[f32], k: &[f32], stride: usize, out: &mut [f32]) {
    let hd = q.len();
    debug_assert!(out.is_empty() || (out.len() - 1) * stride + hd <= k.len());
    let (qp, kp) = (q.as_ptr(), k.as_ptr());
    let mut t = 0;
    if hd % 16 == 0 {
        // four rows at a time: accumulate as `dot_float`, then one shared lane tree
        let groups = hd / 16;
        while t + 4 <= out.len() {
            let mut acc = [[_mm512_setzero_ps(); 4]; 4];
            // group g -> accumulator g % 4, with constant indices (keeps `acc` in registers)
            for g0 in (0..groups).step_by(4) {
                for i in 0..4 {
                    if g0 + i < groups {
                        let g = g0 + i;
                        let qv = _mm512_loadu_ps(qp.add(16 * g));
                        for (r, a) in acc.iter_mut().enumerate() {
                            let kv = _mm512_loadu_ps(kp.add((t + r) * stride + 16 * g));
                            a[i] = _mm512_fmadd_ps(kv, qv, a[i]);
                        }
                    }
                }
            }
            let v =
                acc.map(|a| _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3])));
            _mm_storeu_ps(out.as_mut_ptr().add(t), reduce4(v));
            t += 4;
        }
    }
    for (i, o) in out.iter_mut().enumerate().skip(t) {
        *o = dot_float::<F32, 1, 1>([kp.add(i * stride) as *const u8], hd, [qp])[0][0];
    }
}

/// Canonical exp of 16 lanes (see [`crate::canon::exp`]).
#[inline(always)]
pub(super) unsafe fn exp16(x: __m512) -> __m512 {
    let xc = _mm512_max_ps(
        _mm512_set1_ps(ec::LO),
        _mm512_min_ps(_mm512_set1_ps(ec::HI), x),
    );
    let magic = _mm512_set1_ps(ec::MAGIC);
    let t = _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(ec::LOG2E)), magic);
    let nf = _mm512_sub_ps(t, magic);
    let r = _mm512_fmadd_ps(nf, _mm512_set1_ps(-ec::LN2_HI), xc);
    let r = _mm512_fmadd_ps(nf, _mm512_set1_ps(-ec::LN2_LO), r);
    let mut p = _mm512_set1_ps(ec::P[0]);
    for &c in &ec::P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let r2 = _mm512_mul_ps(r, r);
    let y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
    let n = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(magic));
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(n, _mm512_set1_epi32(126)),
        23,
    ));
    let res = _mm512_mul_ps(_mm512_mul_ps(y, scale), _mm512_set1_ps(2.0));
    let lo = _mm512_cmp_ps_mask(x, _mm512_set1_ps(ec::LO), _CMP_LT_OQ);
    let res = _mm512_mask_blend_ps(lo, res, _mm512_setzero_ps());
    let hi = _mm512_cmp_ps_mask(x, _mm512_set1_ps(ec::HI), _CMP_GT_OQ);
    _mm512_mask_blend_ps(hi, res, _mm512_set1_ps(f32::INFINITY))
}

/// `s[i] = exp(s[i])` (canonical exp).
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn exp_inplace(s: &mut [f32]) {
    let mut chunks = s.chunks_exact_mut(16);
    for c in &mut chunks {
        let v = exp16(_mm512_loadu_ps(c.as_ptr()));
        _mm512_storeu_ps(c.as_mut_ptr(), v);
    }
    for v in chunks.into_remainder() {
        *v = crate::canon::exp(*v);
    }
}

/// `gate[i] = v / (1 + exp(arg(v))) * up[i]` with `v = gate[i]`: SiLU·up (`GELU` false,
/// `arg(v) = 0 - v`) or tanh-GELU·up (`GELU` true, `arg(v) = v * fma(v * v, C1, C0)`); see
/// [`crate::canon::Act`].
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available; equal lengths.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn act_mul<const GELU: bool>(gate: &mut [f32], up: &[f32]) {
    let one = _mm512_set1_ps(1.0);
    let (c0, c1) = (_mm512_set1_ps(gl::C0), _mm512_set1_ps(gl::C1));
    let mut g = gate.chunks_exact_mut(16);
    let mut u = up.chunks_exact(16);
    for (gc, uc) in (&mut g).zip(&mut u) {
        let v = _mm512_loadu_ps(gc.as_ptr());
        let arg = if GELU {
            _mm512_mul_ps(v, _mm512_fmadd_ps(_mm512_mul_ps(v, v), c1, c0))
        } else {
            _mm512_sub_ps(_mm512_setzero_ps(), v)
        };
        let s = _mm512_div_ps(v, _mm512_add_ps(one, exp16(arg)));
        _mm512_storeu_ps(
            gc.as_mut_ptr(),
            _mm512_mul_ps(s, _mm512_loadu_ps(uc.as_ptr())),
        );
    }
    let act = if GELU { Act::GeluTanh } else { Act::Silu };
    crate::canon::act_mul_scalar(act, g.into_remainder(), u.remainder());
}

/// `out[i] = fma(p[t], v[t * stride + i], out[i])` for `t = 0, 1, ..` in order, `i < out.len()`
/// (attention's weighted sum of value rows; `out` keeps its initial value as the start).
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available; `v` holds every row read.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn weighted_rows(p: &[f32], v: &[f32], stride: usize, out: &mut [f32]) {
    let hd = out.len();
    debug_assert!(p.is_empty() || (p.len() - 1) * stride + hd <= v.len());
    let vp = v.as_ptr();
    // 64 columns (4 registers) at a time, all rows
    let mut c = 0;
    while c + 64 <= hd {
        let o = out.as_mut_ptr().add(c);
        let mut acc = [
            _mm512_loadu_ps(o),
            _mm512_loadu_ps(o.add(16)),
            _mm512_loadu_ps(o.add(32)),
            _mm512_loadu_ps(o.add(48)),
        ];
        for (t, &pt) in p.iter().enumerate() {
            let pv = _mm512_set1_ps(pt);
            let row = vp.add(t * stride + c);
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(pv, _mm512_loadu_ps(row.add(16 * i)), *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(16 * i), *a);
        }
        c += 64;
    }
    while c + 16 <= hd {
        let o = out.as_mut_ptr().add(c);
        let mut a = _mm512_loadu_ps(o);
        for (t, &pt) in p.iter().enumerate() {
            a = _mm512_fmadd_ps(
                _mm512_set1_ps(pt),
                _mm512_loadu_ps(vp.add(t * stride + c)),
                a,
            );
        }
        _mm512_storeu_ps(o, a);
        c += 16;
    }
    for (i, o) in out.iter_mut().enumerate().skip(c) {
        for (t, &pt) in p.iter().enumerate() {
            *o = pt.mul_add(*vp.add(t * stride + i), *o);
        }
    }
}
