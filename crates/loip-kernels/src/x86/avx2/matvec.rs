//! AVX2 single-token (n = 1) dot kernel for Q4_1, the type of the decode hot path (SmolLM2
//! Q4_1's layers).
//!
//! Same values and the same canonical order as [`super::rows`]' per-row kernels; cheaper per
//! weight, as the 256-bit FP ports (fma, convert) bound these loops:
//! - The block scales are converted 8 blocks at a time (the f16 pairs collected by dword
//!   blends of overlapping loads, two `vcvtph2ps` per 8 blocks) into a small table,
//!   from which the loop broadcasts them with plain loads, instead of a convert and three
//!   shuffles per block.
//! - Q4_1 high nibbles stay in place (`16 q = v - (v & 0xF)`, exact) and are scaled by `d / 16` (exact: a
//!   power-of-two scaling of an f16, far from f32's subnormals), so `fma(16 q, d / 16, m)` is
//!   `fma(q, d, m)`, the one rounding of `q * d + m`, without a shift per 8 weights.
//! - The horizontal reductions of 8 rows share one transposed tree ([`super::hsum8`]).
//!
//! Q8_0 (the SmolLM2 head) stays on the per-row kernel: the same scale table, and `q * d` as
//! one fma of `1.5 * 2^23 + q` (an integer add to the bits of `1.5 * 2^23`; exact, as
//! `1.5 * 2^23 * d` is) instead of a convert and a multiply, both measured slower there (the
//! loop spilled registers).

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::{f16_scalar, fma_halves, fold, hsum, hsum8, u8x8};
use crate::dtype::DType;

/// Blocks whose scales are converted before their dots (a multiple of 8).
const SEG: usize = 64;

/// Scales of up to [`SEG`] consecutive blocks.
#[repr(C, align(32))]
struct Scales {
    /// `d`
    d: [f32; SEG],
    /// `m`
    m: [f32; SEG],
    /// `d / 16`
    d16: [f32; SEG],
}

/// A block type of the single-token kernels.
trait Kind {
    const BLOCK_BYTES: usize;
    /// scales of the 8 blocks at `p`, into entries `i .. i + 8` (`i` a multiple of 8)
    unsafe fn prep8(p: *const u8, s: &mut Scales, i: usize);
    /// scales of the one block at `p`, into entry `i`
    unsafe fn prep1(p: *const u8, s: &mut Scales, i: usize);
    /// the block at `p` (entry `i < SEG` of `s`): elements 0..8, 8..16, 16..24, 24..32
    unsafe fn block(p: *const u8, s: &Scales, i: usize) -> [__m256; 4];
}

/// The 8 dwords at `p + 20 i` (`i < 8`): lane `i` of the load at `p + 16 i` is the dword at
/// `p + 20 i`; reads `p .. p + 144`.
#[inline(always)]
unsafe fn dwords_stride20(p: *const u8) -> __m256i {
    let l = |i: usize| _mm256_loadu_si256(p.add(16 * i) as *const __m256i);
    let t01 = _mm256_blend_epi32::<0b0000_0010>(l(0), l(1));
    let t23 = _mm256_blend_epi32::<0b0000_1000>(l(2), l(3));
    let t45 = _mm256_blend_epi32::<0b0010_0000>(l(4), l(5));
    let t67 = _mm256_blend_epi32::<0b1000_0000>(l(6), l(7));
    let lo = _mm256_blend_epi32::<0b0000_1100>(t01, t23);
    let hi = _mm256_blend_epi32::<0b1100_0000>(t45, t67);
    _mm256_blend_epi32::<0b1111_0000>(lo, hi)
}

struct Q41;
impl Kind for Q41 {
    const BLOCK_BYTES: usize = 20;
    #[inline(always)]
    unsafe fn prep8(p: *const u8, s: &mut Scales, i: usize) {
        // dword i = (d_i, m_i) as two f16
        let h = dwords_stride20(p);
        let lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h)); // d0 m0 d1 m1 d2 m2 d3 m3
        let hi = _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)); // d4 m4 .. d7 m7
        // [d0 d1 d4 d5 | d2 d3 d6 d7] -> d0 .. d7 (and the same for m)
        let d = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(
            _mm256_shuffle_ps::<0x88>(lo, hi),
        )));
        let m = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(
            _mm256_shuffle_ps::<0xDD>(lo, hi),
        )));
        _mm256_store_ps(s.d.as_mut_ptr().add(i), d);
        _mm256_store_ps(s.m.as_mut_ptr().add(i), m);
        _mm256_store_ps(
            s.d16.as_mut_ptr().add(i),
            _mm256_mul_ps(d, _mm256_set1_ps(1.0 / 16.0)),
        );
    }
    #[inline(always)]
    unsafe fn prep1(p: *const u8, s: &mut Scales, i: usize) {
        let d = f16_scalar(p);
        s.d[i] = d;
        s.m[i] = f16_scalar(p.add(2));
        s.d16[i] = d * (1.0 / 16.0);
    }
    #[inline(always)]
    unsafe fn block(p: *const u8, s: &Scales, i: usize) -> [__m256; 4] {
        // low nibbles: fma(q, d, m); high nibbles: fma(16 q, d / 16, m), the same value
        // (i < SEG: unchecked, a bounds check per block costs a branch in the hot loop)
        let d = _mm256_broadcast_ss(s.d.get_unchecked(i));
        let m = _mm256_broadcast_ss(s.m.get_unchecked(i));
        let d16 = _mm256_broadcast_ss(s.d16.get_unchecked(i));
        let (a, b) = (u8x8(p.add(4)), u8x8(p.add(12)));
        // the high nibbles in place as v - (v & 0xF): one mask register, not two (16 registers:
        // 8 accumulators, the mask, 3 scales, 4 weights)
        let lo = _mm256_set1_epi32(0x0F);
        let (a_lo, b_lo) = (_mm256_and_si256(a, lo), _mm256_and_si256(b, lo));
        let (a_hi, b_hi) = (_mm256_sub_epi32(a, a_lo), _mm256_sub_epi32(b, b_lo));
        let f = |v: __m256i, d: __m256| _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, m);
        [f(a_lo, d), f(b_lo, d), f(a_hi, d16), f(b_hi, d16)]
    }
}

/// One pair of blocks at `p`, entries `i`, `i + 1` of `s`, elements `e ..` of the row:
/// groups 4u, 4u+1 (accumulators 0, 1) and 4u+2, 4u+3 (2, 3); fetches the bytes `ahead` on
/// (the same bytes of a later row) into L2.
#[inline(always)]
unsafe fn pair<K: Kind>(
    acc: &mut [__m256; 8],
    s: &Scales,
    p: *const u8,
    ahead: usize,
    i: usize,
    x: *const f32,
    e: usize,
) {
    let bb = K::BLOCK_BYTES;
    super::super::prefetch(p.wrapping_add(ahead), 2 * bb);
    fma_halves::<4, 0>(acc, &K::block(p, s, i), x, e);
    fma_halves::<4, 4>(acc, &K::block(p.add(bb), s, i + 1), x, e + 32);
}

/// The scales of the `k` blocks at `p` (`k <= SEG`) into `s`.
#[inline(always)]
unsafe fn prep<K: Kind>(p: *const u8, k: usize, s: &mut Scales) {
    let bb = K::BLOCK_BYTES;
    let k8 = k / 8 * 8;
    for i in (0..k8).step_by(8) {
        K::prep8(p.add(i * bb), s, i);
    }
    for i in k8..k {
        K::prep1(p.add(i * bb), s, i);
    }
}

/// The dots of the `k` blocks at `p` (`k <= SEG`, scales in `s`), blocks `b0 ..` of a row,
/// fetching the bytes `ahead` on (loops with run-time bounds: the scales are broadcast from
/// memory, nothing is hoisted into spills).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dots<K: Kind>(
    acc: &mut [__m256; 8],
    p: *const u8,
    k: usize,
    b0: usize,
    ahead: usize,
    x: *const f32,
    s: &Scales,
) {
    let bb = K::BLOCK_BYTES;
    for j in 0..k / 2 {
        pair::<K>(acc, s, p.add(2 * j * bb), ahead, 2 * j, x, 32 * (b0 + 2 * j));
    }
    if k % 2 == 1 {
        // an odd last block (SEG is even): groups 4u, 4u+1
        let i = k - 1;
        fma_halves::<4, 0>(acc, &K::block(p.add(i * bb), s, i), x, 32 * (b0 + i));
    }
}

/// The canonical dot of row `r` of `d` (rows of `rb` bytes, `blocks` blocks) with `x`, up to
/// [`fold`]. Rows of up to [`SEG`] blocks find their scales in `tabs[r % 2]` and convert the
/// next row's into the other table first, so that no dot waits for its scales' conversion
/// (measured: converting a short row's scales right before its dots cost more than it saved);
/// they fetch two rows ahead, so that those conversions read fetched lines. Longer rows
/// convert each segment before its dots and fetch the next row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn row_folded<K: Kind>(
    d: *const u8,
    r: usize,
    rows: usize,
    blocks: usize,
    rb: usize,
    x: *const f32,
    tabs: &mut [Scales; 2],
) -> __m256 {
    let bb = K::BLOCK_BYTES;
    let row = d.add(r * rb);
    let mut acc = [_mm256_setzero_ps(); 8];
    if blocks <= SEG {
        let [t0, t1] = tabs;
        let (cur, next) = if r % 2 == 0 { (t0, t1) } else { (t1, t0) };
        if r + 1 < rows {
            prep::<K>(row.add(rb), blocks, next);
        }
        dots::<K>(&mut acc, row, blocks, 0, 2 * rb, x, cur);
    } else {
        let s = &mut tabs[0];
        for b0 in (0..blocks).step_by(SEG) {
            let k = (blocks - b0).min(SEG);
            let p = row.add(b0 * bb);
            prep::<K>(p, k, s);
            dots::<K>(&mut acc, p, k, b0, rb, x, s);
        }
    }
    fold(&acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows1<K: Kind>(data: &[u8], rb: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    let (d, xp, rows) = (data.as_ptr(), x.as_ptr(), out.len());
    let blocks = cols / 32;
    let table = || Scales {
        d: [0.0; SEG],
        m: [0.0; SEG],
        d16: [0.0; SEG],
    };
    let mut tabs = [table(), table()];
    if blocks <= SEG && rows > 0 {
        prep::<K>(d, blocks, &mut tabs[0]);
    }
    let mut r = 0;
    while r + 8 <= rows {
        let mut u = [_mm256_setzero_ps(); 8];
        for (i, ui) in u.iter_mut().enumerate() {
            *ui = row_folded::<K>(d, r + i, rows, blocks, rb, xp, &mut tabs);
        }
        _mm256_storeu_ps(out.as_mut_ptr().add(r), hsum8(&u));
        r += 8;
    }
    for (i, o) in out.iter_mut().enumerate().skip(r) {
        *o = hsum(row_folded::<K>(d, i, rows, blocks, rb, xp, &mut tabs));
    }
}

/// `out[r]` = canonical dot of row `r` of `data` (rows of `rb` bytes) with `x`; `false`,
/// writing nothing, for a type without a single-token kernel here.
///
/// # Safety
/// AVX2/FMA/F16C available; `x.len() == cols`, `cols` a multiple of 32,
/// `data.len() == out.len() * rb`, `rb` the bytes of `cols` elements of `dtype`.
pub(super) unsafe fn rows(
    dtype: DType,
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    out: &mut [f32],
) -> bool {
    debug_assert!(x.len() == cols && data.len() == out.len() * rb);
    match dtype {
        DType::Q4_1 => rows1::<Q41>(data, rb, cols, x, out),
        _ => return false,
    }
    true
}
