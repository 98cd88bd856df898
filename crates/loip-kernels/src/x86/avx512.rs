//! AVX-512F kernels (512-bit registers; one canonical 16-lane group per register).
//!
//! Weights are dequantized in registers to exactly the values of [`crate::dequant`] and
//! multiplied into f32 activations with the canonical accumulation of [`crate::canon`].
//! All loads are unaligned; no path depends on an address.
//!
//! Safety: every `unsafe fn` here requires a CPU with AVX-512F, AVX2, FMA and F16C
//! (checked by [`crate::simd`]) and the buffer lengths stated in its docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::dtype::DType;
use crate::scales::unpack_scales_k4;
use std::ptr::read_unaligned;

/// One 64-element chunk of dequantized weights: canonical groups `4c .. 4c + 4`.
type Chunk = [__m512; 4];

// ---------------------------------------------------------------------------------------------
// dequantization of the stored types

/// A quantized type, read in units of 256 elements (8 blocks of 32, or one super-block).
///
/// The scales of a unit are converted to f32 in a separate pass over a segment of units and
/// kept in a stack buffer: each use is then a broadcast load (`vbroadcastss` or an embedded
/// `{1to16}` operand) rather than a register shuffle, the scarce resource of these kernels.
pub(super) trait Quant {
    /// bytes per unit of 256 elements
    const UNIT_BYTES: usize;
    /// Writes 16 f32 scale values per unit for `units` consecutive units at `p` to `out`.
    unsafe fn scales(p: *const u8, units: usize, out: *mut f32);
    /// 64-element chunk `k` (< 4) of the unit at `p`, whose scales are at `s`
    unsafe fn chunk(p: *const u8, s: *const f32, k: usize) -> Chunk;
    /// 32-element-block types: the 64 elements of two blocks outside a whole unit
    unsafe fn pair(p: *const u8) -> Chunk;
    /// 32-element-block types: the two groups of one block outside a whole unit
    unsafe fn half(p: *const u8) -> [__m512; 2];
}

#[inline(always)]
unsafe fn iota() -> __m512 {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    )
}

/// (q - 8) as f32, the Q4_0 table before scaling.
#[inline(always)]
unsafe fn iota_m8() -> __m512 {
    _mm512_sub_ps(iota(), _mm512_set1_ps(8.0))
}

/// f16 at `p` (2 bytes), broadcast.
#[inline(always)]
unsafe fn f16_splat(p: *const u8) -> __m512 {
    let h = read_unaligned(p as *const u16) as i32;
    _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)))
}

/// 16 bytes at `p`, zero-extended to 16 × i32.
#[inline(always)]
unsafe fn u8x16(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
}

/// Scale `i` of a unit's scales, broadcast (a load from the scale buffer).
#[inline(always)]
unsafe fn splat(s: *const f32, i: usize) -> __m512 {
    _mm512_set1_ps(*s.add(i))
}

/// Converts the f16 scale words of 8 blocks per unit (`stride` bytes apart, the first at `p`):
/// one word `d` per block (`PAIR = false`, to `out[0..8]` of each unit) or two, `d, m`
/// (to `out[2i], out[2i + 1]`).
#[inline(always)]
unsafe fn block_scales<const PAIR: bool>(p: *const u8, stride: usize, units: usize, out: *mut f32) {
    for u in 0..units {
        let q = |i: usize| p.add(stride * (8 * u + i));
        let o = out.add(16 * u);
        if PAIR {
            let w = |i: usize| read_unaligned(q(i) as *const i32);
            let v = _mm256_setr_epi32(w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7));
            _mm512_storeu_ps(o, _mm512_cvtph_ps(v));
        } else {
            let w = |i: usize| read_unaligned(q(i) as *const i16);
            let v = _mm_setr_epi16(w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7));
            _mm256_storeu_ps(o, _mm256_cvtph_ps(v));
        }
    }
}

/// One Q4_0 / Q4_1 block: a 16-entry table of the exact values, indexed by nibble.
#[inline(always)]
unsafe fn q4_groups(table: __m512, qs: *const u8) -> [__m512; 2] {
    let q = u8x16(qs);
    // vpermps uses only the low 4 bits of each index: the low nibble needs no mask
    [
        _mm512_permutexvar_ps(q, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table),
    ]
}

/// One Q8_0 block's 32 values `q * d` (exact).
#[inline(always)]
unsafe fn q8_groups(d: __m512, qs: *const u8) -> [__m512; 2] {
    let q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(qs as *const __m128i));
    let q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(qs.add(16) as *const __m128i));
    [
        _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d),
        _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d),
    ]
}

/// Two 32-element blocks as one chunk.
#[inline(always)]
fn join(a: [__m512; 2], b: [__m512; 2]) -> Chunk {
    [a[0], a[1], b[0], b[1]]
}

pub(super) struct Q40;
impl Quant for Q40 {
    const UNIT_BYTES: usize = 8 * 18;
    #[inline(always)]
    unsafe fn scales(p: *const u8, units: usize, out: *mut f32) {
        block_scales::<false>(p, 18, units, out)
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: *const f32, k: usize) -> Chunk {
        // (q - 8) * d is exact: the table holds the exact values
        let b = |i: usize| q4_groups(_mm512_mul_ps(iota_m8(), splat(s, i)), p.add(18 * i + 2));
        join(b(2 * k), b(2 * k + 1))
    }
    #[inline(always)]
    unsafe fn pair(p: *const u8) -> Chunk {
        join(Q40::half(p), Q40::half(p.add(18)))
    }
    #[inline(always)]
    unsafe fn half(p: *const u8) -> [__m512; 2] {
        q4_groups(_mm512_mul_ps(iota_m8(), f16_splat(p)), p.add(2))
    }
}

pub(super) struct Q41;
impl Quant for Q41 {
    const UNIT_BYTES: usize = 8 * 20;
    #[inline(always)]
    unsafe fn scales(p: *const u8, units: usize, out: *mut f32) {
        block_scales::<true>(p, 20, units, out)
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: *const f32, k: usize) -> Chunk {
        // q * d is exact, so fma(q, d, m) rounds once, like ggml's q * d + m
        let b = |i: usize| {
            q4_groups(
                _mm512_fmadd_ps(iota(), splat(s, 2 * i), splat(s, 2 * i + 1)),
                p.add(20 * i + 4),
            )
        };
        join(b(2 * k), b(2 * k + 1))
    }
    #[inline(always)]
    unsafe fn pair(p: *const u8) -> Chunk {
        join(Q41::half(p), Q41::half(p.add(20)))
    }
    #[inline(always)]
    unsafe fn half(p: *const u8) -> [__m512; 2] {
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(read_unaligned(p as *const i32)));
        let d = _mm512_broadcastss_ps(dm);
        let m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
        q4_groups(_mm512_fmadd_ps(iota(), d, m), p.add(4))
    }
}

pub(super) struct Q80;
impl Quant for Q80 {
    const UNIT_BYTES: usize = 8 * 34;
    #[inline(always)]
    unsafe fn scales(_p: *const u8, _units: usize, _out: *mut f32) {
        // measured faster with per-block register broadcasts
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, _s: *const f32, k: usize) -> Chunk {
        Q80::pair(p.add(68 * k))
    }
    #[inline(always)]
    unsafe fn pair(p: *const u8) -> Chunk {
        join(Q80::half(p), Q80::half(p.add(34)))
    }
    #[inline(always)]
    unsafe fn half(p: *const u8) -> [__m512; 2] {
        q8_groups(f16_splat(p), p.add(2))
    }
}

pub(super) struct Q4K;
impl Quant for Q4K {
    const UNIT_BYTES: usize = 144;
    /// `d * sc_k` for the 8 sub-blocks `k`, then `-(dmin * m_k)`
    #[inline(always)]
    unsafe fn scales(p: *const u8, units: usize, out: *mut f32) {
        for u in 0..units {
            let b = p.add(144 * u);
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(read_unaligned(b as *const i32)));
            let d = _mm512_broadcastss_ps(dm);
            let neg_dmin = _mm512_sub_ps(
                _mm512_setzero_ps(),
                _mm512_broadcastss_ps(_mm_movehdup_ps(dm)),
            );
            let [sc, m] = unpack_scales_k4(b.add(4));
            let q = _mm_setr_epi32(sc[0] as i32, sc[1] as i32, m[0] as i32, m[1] as i32);
            let v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
            _mm512_storeu_ps(
                out.add(16 * u),
                _mm512_mul_ps(v, _mm512_mask_blend_ps(0xFF00, d, neg_dmin)),
            );
        }
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: *const f32, k: usize) -> Chunk {
        // (d * sc) * q - dmin * m as two tables (low nibbles: sub-block 2k, high: 2k + 1);
        // (d * sc) * q is exact, so one fma rounds like ggml's d1 * q - m1
        let lo = _mm512_fmadd_ps(iota(), splat(s, 2 * k), splat(s, 8 + 2 * k));
        let hi = _mm512_fmadd_ps(iota(), splat(s, 2 * k + 1), splat(s, 8 + 2 * k + 1));
        let q = p.add(16 + 32 * k);
        let b0 = u8x16(q);
        let b1 = u8x16(q.add(16));
        [
            _mm512_permutexvar_ps(b0, lo),
            _mm512_permutexvar_ps(b1, lo),
            _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), hi),
            _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), hi),
        ]
    }
    #[inline(always)]
    unsafe fn pair(_p: *const u8) -> Chunk {
        unreachable!("Q4_K rows are whole 256-element blocks")
    }
    #[inline(always)]
    unsafe fn half(_p: *const u8) -> [__m512; 2] {
        unreachable!("Q4_K rows are whole 256-element blocks")
    }
}

pub(super) struct Q6K;
impl Quant for Q6K {
    const UNIT_BYTES: usize = 210;
    /// `d * sc_g` for the 16 groups
    #[inline(always)]
    unsafe fn scales(p: *const u8, units: usize, out: *mut f32) {
        for u in 0..units {
            let b = p.add(210 * u);
            let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                b.add(192) as *const __m128i
            )));
            // d * sc, as ggml (d * sc[is]) before multiplying by q
            _mm512_storeu_ps(out.add(16 * u), _mm512_mul_ps(f16_splat(b.add(208)), sc));
        }
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: *const f32, k: usize) -> Chunk {
        let h = k / 2;
        let ql = p.add(64 * h);
        let qh = p.add(128 + 32 * h);
        let l = [
            u8x16(ql),
            u8x16(ql.add(16)),
            u8x16(ql.add(32)),
            u8x16(ql.add(48)),
        ];
        let (h0, h1) = (u8x16(qh), u8x16(qh.add(16)));
        let m4 = _mm512_set1_epi32(0xF);
        // 6-bit q = 4 bits of ql | 2 bits of qh moved to bits 4-5
        let (low, high) = if k % 2 == 0 {
            // low nibbles; qh bits 0-1 (groups 0, 1) and 2-3 (groups 2, 3)
            (
                [
                    _mm512_and_si512(l[0], m4),
                    _mm512_and_si512(l[1], m4),
                    _mm512_and_si512(l[2], m4),
                    _mm512_and_si512(l[3], m4),
                ],
                [
                    _mm512_slli_epi32(h0, 4),
                    _mm512_slli_epi32(h1, 4),
                    _mm512_slli_epi32(h0, 2),
                    _mm512_slli_epi32(h1, 2),
                ],
            )
        } else {
            // high nibbles; qh bits 4-5 and 6-7
            (
                [
                    _mm512_srli_epi32(l[0], 4),
                    _mm512_srli_epi32(l[1], 4),
                    _mm512_srli_epi32(l[2], 4),
                    _mm512_srli_epi32(l[3], 4),
                ],
                [h0, h1, _mm512_srli_epi32(h0, 2), _mm512_srli_epi32(h1, 2)],
            )
        };
        let m2 = _mm512_set1_epi32(0x30);
        let mut w = [_mm512_setzero_ps(); 4];
        for i in 0..4 {
            let q = _mm512_or_si512(low[i], _mm512_and_si512(high[i], m2));
            let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32)));
            // (d * sc) * q, as ggml
            w[i] = _mm512_mul_ps(splat(s, 4 * k + i), v);
        }
        w
    }
    #[inline(always)]
    unsafe fn pair(_p: *const u8) -> Chunk {
        unreachable!("Q6_K rows are whole 256-element blocks")
    }
    #[inline(always)]
    unsafe fn half(_p: *const u8) -> [__m512; 2] {
        unreachable!("Q6_K rows are whole 256-element blocks")
    }
}

/// A float type, read one 16-element group at a time.
pub(super) trait Float {
    const ELEM_BYTES: usize;
    const DTYPE: DType;
    /// group `g` of the row at `p`
    unsafe fn group(p: *const u8, g: usize) -> __m512;
}

pub(super) struct F32;
impl Float for F32 {
    const ELEM_BYTES: usize = 4;
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> __m512 {
        _mm512_loadu_ps(p.add(64 * g) as *const f32)
    }
}

pub(super) struct F16;
impl Float for F16 {
    const ELEM_BYTES: usize = 2;
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32 * g) as *const __m256i))
    }
}

pub(super) struct BF16;
impl Float for BF16 {
    const ELEM_BYTES: usize = 2;
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> __m512 {
        let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(32 * g) as *const __m256i));
        _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))
    }
}

// ---------------------------------------------------------------------------------------------
// canonical accumulation, R rows × N tokens at a time

/// Canonical reduction of four 16-lane accumulators (see [`crate::canon::reduce`]).
#[inline(always)]
pub(super) unsafe fn reduce(a: &[__m512; 4]) -> f32 {
    let v = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    let u = _mm256_add_ps(lo, hi); // lanes l + l+8
    let w = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)); // l + l+4
    let z = _mm_add_ps(w, _mm_movehl_ps(w, w)); // l + l+2
    _mm_cvtss_f32(_mm_add_ss(z, _mm_shuffle_ps(z, z, 1))) // l + l+1
}

/// The canonical lane tree (16 → 1) of four 16-lane vectors at once; returns the four sums.
/// Same pairs and order as [`reduce`] after its accumulator combination.
#[inline(always)]
pub(super) unsafe fn reduce4(v: [__m512; 4]) -> __m128 {
    // lanes l + l+8: 128-bit blocks (0,1) + (2,3) of two vectors side by side
    let w01 = _mm512_add_ps(
        _mm512_shuffle_f32x4(v[0], v[1], 0x44),
        _mm512_shuffle_f32x4(v[0], v[1], 0xEE),
    );
    let w23 = _mm512_add_ps(
        _mm512_shuffle_f32x4(v[2], v[3], 0x44),
        _mm512_shuffle_f32x4(v[2], v[3], 0xEE),
    );
    // lanes l + l+4: block t now holds the four partial sums of vector t
    let z = _mm512_add_ps(
        _mm512_shuffle_f32x4(w01, w23, 0x88),
        _mm512_shuffle_f32x4(w01, w23, 0xDD),
    );
    // l + l+2, then l + l+1, within each block
    let z = _mm512_add_ps(z, _mm512_shuffle_ps(z, z, 0x4E));
    let z = _mm512_add_ps(z, _mm512_shuffle_ps(z, z, 0x01));
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, z))
}

/// Accumulators of R rows × N tokens: `[row][token][canonical accumulator]`.
type Acc<const R: usize, const N: usize> = [[[__m512; 4]; N]; R];

/// The `G` groups of activations at element `e` for each token.
#[inline(always)]
unsafe fn load_x<const N: usize, const G: usize>(
    xs: &[*const f32; N],
    e: usize,
) -> [[__m512; G]; N] {
    let mut v = [[_mm512_setzero_ps(); G]; N];
    for (vt, x) in v.iter_mut().zip(xs) {
        for (i, vi) in vt.iter_mut().enumerate() {
            *vi = _mm512_loadu_ps(x.add(e + 16 * i));
        }
    }
    v
}

/// `acc[t][a0 + i] = fma(w[i], x[t][i], acc[t][a0 + i])` for every token and group `i < G`.
#[inline(always)]
unsafe fn fma_groups<const N: usize, const G: usize>(
    acc: &mut [[__m512; 4]; N],
    w: &[__m512; G],
    x: &[[__m512; G]; N],
    a0: usize,
) {
    for t in 0..N {
        for i in 0..G {
            acc[t][a0 + i] = _mm512_fmadd_ps(w[i], x[t][i], acc[t][a0 + i]);
        }
    }
}

/// Reduces every accumulator set (four rows of one token share one lane tree).
#[inline(always)]
unsafe fn finish<const R: usize, const N: usize>(acc: &Acc<R, N>) -> [[f32; N]; R] {
    let mut out = [[0f32; N]; R];
    if R == 4 && N == 1 {
        let v: [__m512; 4] = std::array::from_fn(|r| {
            let a = &acc[r][0];
            _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]))
        });
        let mut s = [0f32; 4];
        _mm_storeu_ps(s.as_mut_ptr(), reduce4(v));
        for (o, v) in out.iter_mut().zip(s) {
            o[0] = v;
        }
        return out;
    }
    for r in 0..R {
        for t in 0..N {
            out[r][t] = reduce(&acc[r][t]);
        }
    }
    out
}

/// Units per segment of the scale pre-pass (4096 elements).
const SEG_UNITS: usize = 16;

/// Canonical dots of R quantized rows (`cols` elements each) with N activation rows.
/// Each activation chunk is loaded once and used by all R rows.
#[inline(always)]
unsafe fn dot_quant<Q: Quant, const R: usize, const N: usize>(
    rows: [*const u8; R],
    cols: usize,
    xs: [*const f32; N],
) -> [[f32; N]; R] {
    let units = cols / 256;
    let rb = Q::UNIT_BYTES * (cols / 32) / 8;
    let rest = cols - units * 256;
    // the next tile of R rows (consecutive: `tiles`), one share per unit and block pair
    let ahead = super::Ahead::new(rows[0], R * rb, units + rest.div_ceil(64));
    let mut acc: Acc<R, N> = [[[_mm512_setzero_ps(); 4]; N]; R];
    // f32 scales of one segment, 16 per unit; only the entries written by `Q::scales` are read
    let mut sc = [[std::mem::MaybeUninit::<f32>::uninit(); 16 * SEG_UNITS]; R];
    let mut u0 = 0;
    while u0 < units {
        let nu = (units - u0).min(SEG_UNITS);
        for r in 0..R {
            Q::scales(
                rows[r].add(u0 * Q::UNIT_BYTES),
                nu,
                sc[r].as_mut_ptr() as *mut f32,
            );
        }
        for u in u0..u0 + nu {
            let off = u * Q::UNIT_BYTES;
            // software prefetch (a hint, never faults; it crosses the 4 KiB pages the
            // hardware prefetchers stop at)
            ahead.step(u);
            for k in 0..4 {
                let x = load_x::<N, 4>(&xs, (4 * u + k) * 64);
                for r in 0..R {
                    let w = Q::chunk(
                        rows[r].add(off),
                        (sc[r].as_ptr() as *const f32).add(16 * (u - u0)),
                        k,
                    );
                    fma_groups(&mut acc[r], &w, &x, 0);
                }
            }
        }
        u0 += nu;
    }
    // 32-element-block types: whole block pairs, then one block, after the last whole unit
    let (mut e, mut off) = (units * 256, units * Q::UNIT_BYTES);
    for i in 0..rest / 64 {
        ahead.step(units + i);
        let x = load_x::<N, 4>(&xs, e);
        for r in 0..R {
            fma_groups(&mut acc[r], &Q::pair(rows[r].add(off)), &x, 0);
        }
        e += 64;
        off += Q::UNIT_BYTES / 4;
    }
    if rest % 64 != 0 {
        ahead.step(units + rest / 64);
        // canonical groups 4k, 4k + 1 -> accumulators 0, 1
        let x = load_x::<N, 2>(&xs, e);
        for r in 0..R {
            fma_groups(&mut acc[r], &Q::half(rows[r].add(off)), &x, 0);
        }
    }
    finish(&acc)
}

/// Canonical dots of R float rows with N activation rows (any `cols`).
#[inline(always)]
pub(super) unsafe fn dot_float<F: Float, const R: usize, const N: usize>(
    rows: [*const u8; R],
    cols: usize,
    xs: [*const f32; N],
) -> [[f32; N]; R] {
    let groups = cols / 16;
    let chunks = groups / 4;
    // the next tile of R rows (as in `dot_quant`; the last groups and the tail ride along)
    let ahead = super::Ahead::new(rows[0], R * cols * F::ELEM_BYTES, chunks.max(1));
    let mut acc: Acc<R, N> = [[[_mm512_setzero_ps(); 4]; N]; R];
    for c in 0..chunks {
        let x = load_x::<N, 4>(&xs, 64 * c);
        ahead.step(c);
        for r in 0..R {
            let p = rows[r];
            let w = [
                F::group(p, 4 * c),
                F::group(p, 4 * c + 1),
                F::group(p, 4 * c + 2),
                F::group(p, 4 * c + 3),
            ];
            fma_groups(&mut acc[r], &w, &x, 0);
        }
    }
    // the last 1..3 groups go to accumulators 0.. (constant indices keep `acc` in registers)
    let g0 = 4 * chunks;
    for i in 0..3 {
        if g0 + i < groups {
            let x = load_x::<N, 1>(&xs, 16 * (g0 + i));
            for r in 0..R {
                fma_groups(&mut acc[r], &[F::group(rows[r], g0 + i)], &x, i);
            }
        }
    }
    let mut out = finish(&acc);
    let tail = 16 * groups;
    if tail < cols {
        let n = cols - tail;
        for r in 0..R {
            let mut buf = [0f32; 16]; // the dequantized tail (< 16 elements)
            let bytes =
                std::slice::from_raw_parts(rows[r].add(tail * F::ELEM_BYTES), n * F::ELEM_BYTES);
            crate::dequant::dequant_into(F::DTYPE, bytes, &mut buf[..n]);
            for t in 0..N {
                let mut s = 0f32;
                for (j, &w) in buf[..n].iter().enumerate() {
                    s = w.mul_add(*xs[t].add(tail + j), s);
                }
                out[r][t] += s;
            }
        }
    }
    out
}

/// Rows per tile for single-token (decode) calls: one activation load feeds this many rows.
const TILE_ROWS: usize = 4;

/// Runs `dot` over all rows, `R` rows and tokens `t0 .. t0 + N` at a time; `out[r * n + t]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tiles<const R: usize, const N: usize>(
    dot: impl Fn([*const u8; R], [*const f32; N]) -> [[f32; N]; R],
    data: &[u8],
    row_bytes: usize,
    cols: usize,
    x: &[f32],
    t0: usize,
    n: usize,
    out: &mut [f32],
    r0: usize,
    r1: usize,
) {
    let mut xs = [x.as_ptr(); N];
    for (t, p) in xs.iter_mut().enumerate() {
        *p = x.as_ptr().add((t0 + t) * cols);
    }
    let mut r = r0;
    while r + R <= r1 {
        let mut ps = [data.as_ptr(); R];
        for (i, p) in ps.iter_mut().enumerate() {
            *p = data.as_ptr().add((r + i) * row_bytes);
        }
        let d = dot(ps, xs);
        for (i, di) in d.iter().enumerate() {
            out[(r + i) * n + t0..(r + i) * n + t0 + N].copy_from_slice(di);
        }
        r += R;
    }
}

macro_rules! rows_fn {
    ($name:ident, $bound:ident, $dot:ident) => {
        /// `out[r * n + t]` = canonical dot of row `r` of `data` with token `t` of `x`.
        #[target_feature(enable = "avx512f,avx2,fma,f16c")]
        pub(super) unsafe fn $name<T: $bound>(
            data: &[u8],
            rb: usize,
            cols: usize,
            x: &[f32],
            n: usize,
            out: &mut [f32],
        ) {
            let rows = out.len() / n;
            if n == 1 {
                let full = rows / TILE_ROWS * TILE_ROWS;
                tiles::<TILE_ROWS, 1>(
                    |p, xs| $dot::<T, TILE_ROWS, 1>(p, cols, xs),
                    data,
                    rb,
                    cols,
                    x,
                    0,
                    1,
                    out,
                    0,
                    full,
                );
                tiles::<1, 1>(
                    |p, xs| $dot::<T, 1, 1>(p, cols, xs),
                    data,
                    rb,
                    cols,
                    x,
                    0,
                    1,
                    out,
                    full,
                    rows,
                );
                return;
            }
            // batches: a tile of rows stays in cache while every block of 4 tokens passes
            let tile = crate::x86::batch_tile_rows(rb);
            for r0 in (0..rows).step_by(tile) {
                let r1 = (r0 + tile).min(rows);
                let mut t0 = 0;
                while t0 < n {
                    let step = (n - t0).min(4);
                    match step {
                        4 => tiles::<1, 4>(
                            |p, xs| $dot::<T, 1, 4>(p, cols, xs),
                            data,
                            rb,
                            cols,
                            x,
                            t0,
                            n,
                            out,
                            r0,
                            r1,
                        ),
                        3 => tiles::<1, 3>(
                            |p, xs| $dot::<T, 1, 3>(p, cols, xs),
                            data,
                            rb,
                            cols,
                            x,
                            t0,
                            n,
                            out,
                            r0,
                            r1,
                        ),
                        2 => tiles::<1, 2>(
                            |p, xs| $dot::<T, 1, 2>(p, cols, xs),
                            data,
                            rb,
                            cols,
                            x,
                            t0,
                            n,
                            out,
                            r0,
                            r1,
                        ),
                        _ => tiles::<1, 1>(
                            |p, xs| $dot::<T, 1, 1>(p, cols, xs),
                            data,
                            rb,
                            cols,
                            x,
                            t0,
                            n,
                            out,
                            r0,
                            r1,
                        ),
                    }
                    t0 += step;
                }
            }
        }
    };
}
rows_fn!(rows_quant, Quant, dot_quant);
rows_fn!(rows_float, Float, dot_float);
