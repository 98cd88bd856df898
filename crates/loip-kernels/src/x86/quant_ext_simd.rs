//! SIMD row kernels of the extra GGUF types: `Q5_0`, `Q5_1` (`crate::quant_ext`) and `Q2_K`,
//! `Q3_K`, `Q5_K`, `IQ4_NL`, `IQ4_XS` (`crate::quant_k_ext`).
//!
//! Each type has a 256-bit decoder (`quant_ext_decode.rs`) that writes a block's exact values
//! to a small buffer in L1. The AVX2 dot
//! kernel decodes a 256-element segment of a row at a time and feeds it to its canonical
//! accumulators (4 × 2 × 8 lanes) in the canonical order of [`crate::canon`]; single-token
//! AVX-512 calls dequantize in registers instead (`quant_ext_avx512.rs`). Every level gives the
//! portable path's bits. Batches (n > 1) decode each row once and take the level's canonical
//! f32 dot per token; the AVX2 tiled kernel takes the decoded rows from [`dequant_rows`].
//!
//! Safety: every `unsafe fn` here requires AVX2, FMA and F16C (and AVX-512F for the `512`
//! kernels), checked by [`crate::simd`], and the buffer lengths stated in its docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::quant_ext_decode::{Decode, IQ4NL, IQ4XS, Q2K, Q3K, Q5, Q5K};
use crate::dtype::DType;
use crate::thread_buf::{with_thread_buf, ThreadBuf, KEEP_ALL};
use std::mem::MaybeUninit;

/// Elements per decoded segment (a multiple of every block size).
const SEG: usize = 256;

/// One decoded segment, 64-byte aligned.
#[repr(align(64))]
struct Seg([MaybeUninit<f32>; SEG]);

/// Decodes the `elems` elements (whole blocks) at `p` into `out`.
#[inline(always)]
unsafe fn decode_run<D: Decode>(p: *const u8, elems: usize, out: *mut f32) {
    for b in 0..elems / D::ELEMS {
        D::decode(p.add(b * D::BYTES), out.add(b * D::ELEMS));
    }
}

/// Canonical dot of one row of `D` with one activation row (AVX2 accumulators: `acc[2i]`,
/// `acc[2i + 1]` are the halves of canonical accumulator `i`).
#[inline(always)]
unsafe fn dot256<D: Decode>(row: *const u8, cols: usize, x: *const f32, dist: usize) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 8];
    if D::OCTETS {
        // values in registers, a block pair (64 elements: acc[0..8]) at a time
        let pairs = cols / 64;
        for u in 0..pairs {
            let p = row.add(2 * u * D::BYTES);
            super::prefetch(p.wrapping_add(dist), 2 * D::BYTES);
            // each block's values go into their accumulators before the next block is
            // decoded: 8 accumulators + 4 values + the decoder's constants fit the 16
            // registers (both blocks' 8 values at once spilled the accumulators, each fma
            // then waiting on a store and a reload: Q5_0 7.2 GB/s)
            for (i, h0) in [(0, 0), (1, 4)] {
                let w = D::dot_octets(p.add(i * D::BYTES));
                for (h, wh) in w.iter().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(64 * u + 8 * (h0 + h)));
                    acc[h0 + h] = _mm256_fmadd_ps(*wh, xv, acc[h0 + h]);
                }
            }
        }
        if cols % 64 != 0 {
            // the last block: canonical groups 4c, 4c + 1 -> acc[0..4]
            let a = D::dot_octets(row.add(2 * pairs * D::BYTES));
            for (h, wh) in a.iter().enumerate() {
                let xv = _mm256_loadu_ps(x.add(64 * pairs + 8 * h));
                acc[h] = _mm256_fmadd_ps(*wh, xv, acc[h]);
            }
        }
        return super::avx2::reduce(&acc);
    }
    if D::SUB_OCTETS && D::ELEMS == 256 {
        // values in registers, a sub-block pair at a time: sub-block 2k of a block holds the
        // canonical groups of accumulators 0 and 1 (acc[0..4]), 2k + 1 those of 2 and 3
        for b in 0..cols / 256 {
            let p = row.add(b * D::BYTES);
            super::prefetch(p.wrapping_add(dist), D::BYTES);
            let s = D::sub_scales(p);
            for j in 0..8 {
                let w = D::sub_octets(p, &s, j);
                let (a0, e) = (4 * (j % 2), 256 * b + 32 * j);
                for (h, wh) in w.iter().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(e + 8 * h));
                    acc[a0 + h] = _mm256_fmadd_ps(*wh, xv, acc[a0 + h]);
                }
            }
        }
        return super::avx2::reduce(&acc);
    }
    // a type without register decoders: 256-element segments decoded into L1, then read
    // (every type here has them now; kept for the next one)
    let mut buf = Seg([MaybeUninit::uninit(); SEG]);
    let seg = buf.0.as_mut_ptr() as *mut f32;
    let mut e = 0;
    while e < cols {
        let len = SEG.min(cols - e);
        let off = e / D::ELEMS * D::BYTES;
        super::prefetch(row.wrapping_add(dist + off), len / D::ELEMS * D::BYTES);
        decode_run::<D>(row.add(off), len, seg);
        let mut fma = |h: usize, at: usize| {
            let xv = _mm256_loadu_ps(x.add(e + at));
            acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(seg.add(at)), xv, acc[h]);
        };
        for c in 0..len / 64 {
            for h in 0..8 {
                fma(h, 64 * c + 8 * h);
            }
        }
        if len % 64 != 0 {
            let c = len / 64;
            for h in 0..4 {
                fma(h, 64 * c + 8 * h);
            }
        }
        e += len;
    }
    super::avx2::reduce(&acc)
}

thread_local! {
    /// This thread's activations in the order of [`permute_x`] ([`with_permuted`]), kept
    /// between calls: no allocation and no zero-fill per call.
    static XP: ThreadBuf = const { ThreadBuf::new(Vec::new()) };
}

/// `f(xp)` with `xp` the activations `x` in the order of [`permute_x`] (`x.len()` a multiple
/// of 32), in this thread's buffer (a call nested in `f` finds it taken and uses its own).
pub(super) fn with_permuted<R>(x: &[f32], f: impl FnOnce(&[f32]) -> R) -> R {
    with_thread_buf(&XP, x.len(), KEEP_ALL, |xp| {
        permute_x(x, xp);
        f(xp)
    })
}

/// `x` in the order of [`Decode::natural_rows`]: within each 32-element block, for
/// `a < 4`, elements `4a .. 4a + 4`, then `16 + 4a .. 16 + 4a + 4`.
pub(super) fn permute_x(x: &[f32], xp: &mut [f32]) {
    for (b, o) in x.chunks_exact(32).zip(xp.chunks_exact_mut(32)) {
        for a in 0..4 {
            o[8 * a..8 * a + 4].copy_from_slice(&b[4 * a..4 * a + 4]);
            o[8 * a + 4..8 * a + 8].copy_from_slice(&b[16 + 4 * a..20 + 4 * a]);
        }
    }
}

/// Decodes the rows of `data` (rows of `rb` bytes, `cols` elements) into `w` one at a time
/// and writes `out[r * n + t] = dot(w, token t)` with the level's canonical f32 `dot`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_decoded<D: Decode>(
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
) {
    let mut w = vec![0f32; cols]; // one decoded row
    for (r, o) in out.chunks_exact_mut(n).enumerate() {
        decode_run::<D>(data.as_ptr().add(r * rb), cols, w.as_mut_ptr());
        for (t, v) in o.iter_mut().enumerate() {
            *v = dot(&w, &x[t * cols..(t + 1) * cols]);
        }
    }
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn rows512<D: super::quant_ext_avx512::Fused>(
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    if n > 1 {
        let dot = |a: &[f32], b: &[f32]| super::avx512_act::dot_f32(a, b);
        return rows_decoded::<D>(data, rb, cols, x, n, out, dot);
    }
    const T: usize = 4; // rows per activation load
    let rows = out.len();
    let p = |r: usize| data.as_ptr().add(r * rb);
    let mut r = 0;
    while r + T <= rows {
        let d = super::quant_ext_avx512::dot::<D, T>(
            std::array::from_fn(|i| p(r + i)),
            cols,
            x.as_ptr(),
            T * rb,
        );
        out[r..r + T].copy_from_slice(&d);
        r += T;
    }
    for (i, o) in out[r..].iter_mut().enumerate() {
        *o = super::quant_ext_avx512::dot::<D, 1>([p(r + i)], cols, x.as_ptr(), rb)[0];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows256<D: Decode>(
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    if n > 1 {
        let dot = |a: &[f32], b: &[f32]| super::avx2::dot_f32(a, b);
        return rows_decoded::<D>(data, rb, cols, x, n, out, dot);
    }
    if D::NATURAL {
        return with_permuted(x, |xp| D::natural_rows(data, rb, cols, xp, out));
    }
    for (r, o) in out.iter_mut().enumerate() {
        // at least MIN_AHEAD ahead, as the natural-order kernels (one short row is too close)
        *o = dot256::<D>(data.as_ptr().add(r * rb), cols, x.as_ptr(), rb.max(super::MIN_AHEAD));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_rows<D: Decode>(data: &[u8], cols: usize, out: &mut [f32]) {
    let rb = cols / D::ELEMS * D::BYTES;
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        decode_run::<D>(data.as_ptr().add(r * rb), cols, o.as_mut_ptr());
    }
}

/// Whether `dtype` has its kernels here.
pub(crate) fn handles(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q5_0
            | DType::Q5_1
            | DType::Q2K
            | DType::Q3K
            | DType::Q5K
            | DType::IQ4NL
            | DType::IQ4XS
    )
}

macro_rules! by_type {
    ($dtype:expr, $f:ident ( $($a:expr),* )) => {
        match $dtype {
            DType::Q5_0 => $f::<Q5<false>>($($a),*),
            DType::Q5_1 => $f::<Q5<true>>($($a),*),
            DType::Q2K => $f::<Q2K>($($a),*),
            DType::Q3K => $f::<Q3K>($($a),*),
            DType::Q5K => $f::<Q5K>($($a),*),
            DType::IQ4NL => $f::<IQ4NL>($($a),*),
            DType::IQ4XS => $f::<IQ4XS>($($a),*),
            other => unreachable!("no extra-type kernel for {other}"),
        }
    };
}

/// `out[r * n + t]` = canonical dot of row `r` of `data` with token `t` of `x`, with the
/// AVX-512 kernels (`AVX512`) or the AVX2 ones.
///
/// # Safety
/// AVX2/FMA/F16C (and AVX-512F for `AVX512`) available; [`handles`]`(dtype)`;
/// `rb == row_bytes(cols)`, `data.len() == out.len() / n * rb`, `x.len() == n * cols`, `n > 0`.
pub(crate) unsafe fn rows<const AVX512: bool>(
    dtype: DType,
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    if AVX512 {
        by_type!(dtype, rows512(data, rb, cols, x, n, out))
    } else {
        by_type!(dtype, rows256(data, rb, cols, x, n, out))
    }
}

/// Decodes the `out.len() / cols` rows of `data` into `out`, row-major (the exact values).
///
/// # Safety
/// AVX2/FMA/F16C available; [`handles`]`(dtype)`; `cols > 0` a multiple of the block size,
/// `data.len() == out.len() / cols * row_bytes(cols)`.
pub(crate) unsafe fn dequant_rows(dtype: DType, data: &[u8], cols: usize, out: &mut [f32]) {
    by_type!(dtype, decode_rows(data, cols, out))
}
