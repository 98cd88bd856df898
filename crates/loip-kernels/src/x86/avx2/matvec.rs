//! AVX2 single-token (n = 1) dot kernels for Q4_1 and Q8_0, the types of the decode hot path
//! (SmolLM2 Q4_1 layers and its Q8_0 tied head).
//!
//! Same values and the same canonical order as [`super::rows`]' per-row kernels; cheaper per
//! weight, as the 256-bit FP ports (fma, convert) bound these loops:
//! - The block scales are converted 8 blocks at a time (the f16 fields collected by dword or
//!   word blends of overlapping loads, one `vcvtph2ps` per 8 or 4 blocks) into a small table,
//!   from which the loop broadcasts them with plain loads, instead of a convert and three
//!   shuffles per block.
//! - Q4_1 high nibbles are masked in place (`q * 16`, exact) and scaled by `d / 16` (exact: a
//!   power-of-two scaling of an f16, far from f32's subnormals), so `fma(16 q, d / 16, m)` is
//!   `fma(q, d, m)`, the one rounding of `q * d + m`, without a shift per 8 weights.
//! - Q8_0 weights `q * d` come from one fma of `1.5 * 2^23 + q` (an integer add to the bits
//!   of `1.5 * 2^23`) instead of a convert and a multiply (see [`Q80`]).
//! - The horizontal reductions of 8 rows share one transposed tree ([`super::hsum8`]).

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
    /// `m` (Q4_1); `-1.5 * 2^23 * d` (Q8_0)
    m: [f32; SEG],
    /// `d / 16` (Q4_1)
    d16: [f32; SEG],
    /// every `d` of the segment finite (Q8_0)
    finite: bool,
}

/// A block type of the single-token kernels.
trait Kind {
    const BLOCK_BYTES: usize;
    /// scales of the 8 blocks at `p`, into entries `i .. i + 8` (`i` a multiple of 8)
    unsafe fn prep8(p: *const u8, s: &mut Scales, i: usize);
    /// scales of the one block at `p`, into entry `i`
    unsafe fn prep1(p: *const u8, s: &mut Scales, i: usize);
    /// the block at `p` (entry `i` of `s`): elements 0..8, 8..16, 16..24, 24..32
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

/// The 8 words at `p + 34 i` (`i < 8`): word `i` of the load at `p + 32 i` is the word at
/// `p + 34 i`; reads `p .. p + 240`.
#[inline(always)]
unsafe fn words_stride34(p: *const u8) -> __m128i {
    let l = |i: usize| _mm_loadu_si128(p.add(32 * i) as *const __m128i);
    let t01 = _mm_blend_epi16::<0b0000_0010>(l(0), l(1));
    let t23 = _mm_blend_epi16::<0b0000_1000>(l(2), l(3));
    let t45 = _mm_blend_epi16::<0b0010_0000>(l(4), l(5));
    let t67 = _mm_blend_epi16::<0b1000_0000>(l(6), l(7));
    let lo = _mm_blend_epi16::<0b0000_1100>(t01, t23);
    let hi = _mm_blend_epi16::<0b1100_0000>(t45, t67);
    _mm_blend_epi16::<0b1111_0000>(lo, hi)
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
        let d = _mm256_broadcast_ss(&s.d[i]);
        let m = _mm256_broadcast_ss(&s.m[i]);
        let d16 = _mm256_broadcast_ss(&s.d16[i]);
        let (a, b) = (u8x8(p.add(4)), u8x8(p.add(12)));
        let (lo, hi) = (_mm256_set1_epi32(0x0F), _mm256_set1_epi32(0xF0));
        let f = |v: __m256i, mask: __m256i, d: __m256| {
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, mask)), d, m)
        };
        [f(a, lo, d), f(b, lo, d), f(a, hi, d16), f(b, hi, d16)]
    }
}

/// `1.5 * 2^23`: the f32 with bits `0x4B40_0000 + q` is `MAGIC + q` for `|q| < 2^22`.
const MAGIC: f32 = 12_582_912.0;

struct Q80;
impl Q80 {
    /// [`Kind::prep1`] and [`Kind::prep8`] for the 8 scales `d` at entries `i ..`.
    #[inline(always)]
    unsafe fn store(s: &mut Scales, i: usize, d: __m256) {
        _mm256_store_ps(s.d.as_mut_ptr().add(i), d);
        _mm256_store_ps(
            s.m.as_mut_ptr().add(i),
            _mm256_mul_ps(d, _mm256_set1_ps(-MAGIC)),
        );
        let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), d);
        let fin = _mm256_cmp_ps::<_CMP_LT_OQ>(abs, _mm256_set1_ps(f32::INFINITY));
        s.finite &= _mm256_movemask_ps(fin) == 0xFF;
    }
}
impl Kind for Q80 {
    const BLOCK_BYTES: usize = 34;
    #[inline(always)]
    unsafe fn prep8(p: *const u8, s: &mut Scales, i: usize) {
        Q80::store(s, i, _mm256_cvtph_ps(words_stride34(p)));
    }
    #[inline(always)]
    unsafe fn prep1(p: *const u8, s: &mut Scales, i: usize) {
        let d = f16_scalar(p);
        s.d[i] = d;
        s.m[i] = d * -MAGIC;
        s.finite &= d.is_finite();
    }
    #[inline(always)]
    unsafe fn block(p: *const u8, s: &Scales, i: usize) -> [__m256; 4] {
        let q = |o: usize| _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(2 + o) as *const __m128i));
        let d = _mm256_broadcast_ss(&s.d[i]);
        if s.finite {
            // q * d as fma(MAGIC + q, d, -MAGIC * d): MAGIC * d is exact (3 * 2^22 times an
            // f16: 13 significant bits), so the fma's one rounding is of q * d itself, exact;
            // MAGIC + q by an integer add to MAGIC's bits instead of a convert. (Where q * d is
            // zero the sign of that zero may differ, which no canonical dot can tell: its
            // accumulators start at +0.0 and so never hold -0.0.)
            let m = _mm256_broadcast_ss(&s.m[i]);
            let magic = _mm256_set1_epi32(0x4B40_0000);
            let f = |o: usize| {
                let v = _mm256_castsi256_ps(_mm256_add_epi32(q(o), magic));
                _mm256_fmadd_ps(v, d, m)
            };
            [f(0), f(8), f(16), f(24)]
        } else {
            // an infinite scale: q * d as scalar code computes it (+-inf, or NaN for q = 0)
            let f = |o: usize| _mm256_mul_ps(_mm256_cvtepi32_ps(q(o)), d);
            [f(0), f(8), f(16), f(24)]
        }
    }
}

/// One pair of blocks at `p`, entries `i`, `i + 1` of `s`, elements `e ..` of the row:
/// groups 4u, 4u+1 (accumulators 0, 1) and 4u+2, 4u+3 (2, 3); fetches the same bytes of the
/// next row (`rb` on) into L2.
#[inline(always)]
unsafe fn pair<K: Kind>(
    acc: &mut [__m256; 8],
    s: &Scales,
    p: *const u8,
    rb: usize,
    i: usize,
    x: *const f32,
    e: usize,
) {
    let bb = K::BLOCK_BYTES;
    super::super::prefetch(p.wrapping_add(rb), 2 * bb);
    fma_halves::<4, 0>(acc, &K::block(p, s, i), x, e);
    fma_halves::<4, 4>(acc, &K::block(p.add(bb), s, i + 1), x, e + 32);
}

/// The canonical dot of the row at `row` (`cols` elements, the next row `rb` bytes on) with
/// `x`, up to [`fold`].
#[inline(always)]
unsafe fn row_folded<K: Kind>(
    row: *const u8,
    cols: usize,
    rb: usize,
    x: *const f32,
    s: &mut Scales,
) -> __m256 {
    let bb = K::BLOCK_BYTES;
    let blocks = cols / 32;
    let mut acc = [_mm256_setzero_ps(); 8];
    for b0 in (0..blocks).step_by(SEG) {
        // the scales of the segment first, then its dots (loops with run-time bounds: the
        // scales are broadcast from memory, nothing is hoisted into spills)
        let k = (blocks - b0).min(SEG);
        let p = row.add(b0 * bb);
        let k8 = k / 8 * 8;
        s.finite = true;
        for i in (0..k8).step_by(8) {
            K::prep8(p.add(i * bb), s, i);
        }
        for i in k8..k {
            K::prep1(p.add(i * bb), s, i);
        }
        for j in 0..k / 2 {
            pair::<K>(&mut acc, s, p.add(2 * j * bb), rb, 2 * j, x, 32 * (b0 + 2 * j));
        }
        if k % 2 == 1 {
            // an odd last block (SEG is even): groups 4u, 4u+1
            let i = k - 1;
            fma_halves::<4, 0>(&mut acc, &K::block(p.add(i * bb), s, i), x, 32 * (b0 + i));
        }
    }
    fold(&acc)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows1<K: Kind>(data: &[u8], rb: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    let (d, xp, rows) = (data.as_ptr(), x.as_ptr(), out.len());
    // one table for all rows (filled per segment before it is read)
    let mut s = Scales {
        d: [0.0; SEG],
        m: [0.0; SEG],
        d16: [0.0; SEG],
        finite: true,
    };
    let mut r = 0;
    while r + 8 <= rows {
        let mut u = [_mm256_setzero_ps(); 8];
        for (i, ui) in u.iter_mut().enumerate() {
            *ui = row_folded::<K>(d.add((r + i) * rb), cols, rb, xp, &mut s);
        }
        _mm256_storeu_ps(out.as_mut_ptr().add(r), hsum8(&u));
        r += 8;
    }
    for (i, o) in out.iter_mut().enumerate().skip(r) {
        *o = hsum(row_folded::<K>(d.add(i * rb), cols, rb, xp, &mut s));
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
        DType::Q8_0 => rows1::<Q80>(data, rb, cols, x, out),
        _ => return false,
    }
    true
}
