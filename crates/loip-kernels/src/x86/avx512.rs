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

use crate::canon::exp_consts as ec;
use crate::dequant::scale_min_k4;
use crate::dtype::DType;
use std::ptr::read_unaligned;

/// One 64-element chunk of dequantized weights: canonical groups `4c .. 4c + 4`.
type Chunk = [__m512; 4];

// ---------------------------------------------------------------------------------------------
// dequantization of the stored types

/// A quantized type, read in units of whole blocks covering a multiple of 64 elements.
trait Quant {
    /// 64-element chunks per unit
    const CHUNKS: usize;
    /// bytes per unit
    const UNIT_BYTES: usize;
    /// per-unit scales, computed once per unit
    type State: Copy;
    unsafe fn prepare(p: *const u8) -> Self::State;
    /// chunk `k` (< CHUNKS) of the unit at `p`
    unsafe fn chunk(p: *const u8, s: &Self::State, k: usize) -> Chunk;
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

/// f16 at `p` (2 bytes), broadcast.
#[inline(always)]
unsafe fn f16_splat(p: *const u8) -> __m512 {
    let h = read_unaligned(p as *const u16) as i32;
    _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)))
}

/// f16 at `p` as a scalar f32.
#[inline(always)]
unsafe fn f16_scalar(p: *const u8) -> f32 {
    let h = read_unaligned(p as *const u16) as i32;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)))
}

/// 16 bytes at `p`, zero-extended to 16 × i32.
#[inline(always)]
unsafe fn u8x16(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
}

/// The f16 scales of 8 blocks (`stride` bytes apart) at once: 8 × 2 f16 words at `p`
/// (Q4_1's `d, m`) or, with `PAIR = false`, 8 × 1 word (`d`), converted to f32.
///
/// Kept in memory: each use is then a broadcast load instead of a register shuffle, which is
/// the scarce resource of these kernels.
#[inline(always)]
unsafe fn scales8<const PAIR: bool>(p: *const u8, stride: usize) -> [f32; 16] {
    let mut out = [0f32; 16];
    if PAIR {
        let mut raw = [0u32; 8];
        for (i, v) in raw.iter_mut().enumerate() {
            *v = read_unaligned(p.add(stride * i) as *const u32);
        }
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_cvtph_ps(_mm256_loadu_si256(raw.as_ptr() as *const __m256i)));
    } else {
        let mut raw = [0u16; 8];
        for (i, v) in raw.iter_mut().enumerate() {
            *v = read_unaligned(p.add(stride * i) as *const u16);
        }
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(raw.as_ptr() as *const __m128i)));
    }
    out
}

/// Scale `i` of a [`scales8`] array, read through memory (see there).
#[inline(always)]
unsafe fn scale(s: &[f32; 16], i: usize) -> __m512 {
    _mm512_set1_ps(*std::hint::black_box(s.as_ptr()).add(i))
}

/// One Q4_0 / Q4_1 block: a 16-entry table of the exact values, indexed by nibble.
#[inline(always)]
unsafe fn q4_groups(table: __m512, qs: *const u8) -> [__m512; 2] {
    let q = u8x16(qs);
    // vpermps uses only the low 4 bits of each index: the low nibble needs no mask
    [_mm512_permutexvar_ps(q, table), _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table)]
}

/// Two 32-element blocks as one chunk.
#[inline(always)]
fn join(a: [__m512; 2], b: [__m512; 2]) -> Chunk {
    [a[0], a[1], b[0], b[1]]
}

/// (q - 8) as f32, the Q4_0 table before scaling.
#[inline(always)]
unsafe fn iota_m8() -> __m512 {
    _mm512_sub_ps(iota(), _mm512_set1_ps(8.0))
}

struct Q40;
impl Quant for Q40 {
    const CHUNKS: usize = 4;
    const UNIT_BYTES: usize = 8 * 18;
    type State = [f32; 16];
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> [f32; 16] {
        scales8::<false>(p, 18)
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &[f32; 16], k: usize) -> Chunk {
        // (q - 8) * d; (q - 8) * d is exact, so the table holds the exact values
        let b = |i: usize| q4_groups(_mm512_mul_ps(iota_m8(), scale(s, i)), p.add(18 * i + 2));
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

struct Q41;
impl Quant for Q41 {
    const CHUNKS: usize = 4;
    const UNIT_BYTES: usize = 8 * 20;
    type State = [f32; 16];
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> [f32; 16] {
        scales8::<true>(p, 20)
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &[f32; 16], k: usize) -> Chunk {
        // q * d + m: q * d is exact, so fma(q, d, m) rounds once, like ggml's q * d + m
        let b = |i: usize| q4_groups(_mm512_fmadd_ps(iota(), scale(s, 2 * i), scale(s, 2 * i + 1)), p.add(20 * i + 4));
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

/// One Q8_0 block's 32 values `q * d` (exact).
#[inline(always)]
unsafe fn q8_groups(d: __m512, qs: *const u8) -> [__m512; 2] {
    let q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(qs as *const __m128i));
    let q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(qs.add(16) as *const __m128i));
    [_mm512_mul_ps(_mm512_cvtepi32_ps(q0), d), _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d)]
}

struct Q80;
impl Quant for Q80 {
    const CHUNKS: usize = 4;
    const UNIT_BYTES: usize = 8 * 34;
    type State = [f32; 16];
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> [f32; 16] {
        scales8::<false>(p, 34)
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &[f32; 16], k: usize) -> Chunk {
        let b = |i: usize| q8_groups(scale(s, i), p.add(34 * i + 2));
        join(b(2 * k), b(2 * k + 1))
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

struct Q4K;
impl Quant for Q4K {
    const CHUNKS: usize = 4;
    const UNIT_BYTES: usize = 144;
    /// `[d * sc_k for k in 0..8] ++ [dmin * m_k for k in 0..8]`
    type State = [f32; 16];
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> [f32; 16] {
        let d = f16_scalar(p);
        let dmin = f16_scalar(p.add(2));
        let scales = std::slice::from_raw_parts(p.add(4), 12);
        let mut s = [0f32; 16];
        for k in 0..8 {
            let (sc, m) = scale_min_k4(k, scales);
            s[k] = d * sc as f32;
            s[8 + k] = dmin * m as f32;
        }
        s
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &[f32; 16], k: usize) -> Chunk {
        // (d * sc) * q - dmin * m, as two tables (low nibbles: sub-block 2k, high: 2k + 1)
        let lo = _mm512_sub_ps(
            _mm512_mul_ps(iota(), _mm512_set1_ps(s[2 * k])),
            _mm512_set1_ps(s[8 + 2 * k]),
        );
        let hi = _mm512_sub_ps(
            _mm512_mul_ps(iota(), _mm512_set1_ps(s[2 * k + 1])),
            _mm512_set1_ps(s[8 + 2 * k + 1]),
        );
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

struct Q6K;
impl Quant for Q6K {
    const CHUNKS: usize = 4;
    const UNIT_BYTES: usize = 210;
    /// `d * sc_g` for the 16 groups
    type State = [f32; 16];
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> [f32; 16] {
        let d = f16_scalar(p.add(208));
        let mut s = [0f32; 16];
        for (g, v) in s.iter_mut().enumerate() {
            *v = d * (*p.add(192 + g) as i8) as f32;
        }
        s
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &[f32; 16], k: usize) -> Chunk {
        let h = k / 2;
        let ql = p.add(64 * h);
        let qh = p.add(128 + 32 * h);
        let l = [u8x16(ql), u8x16(ql.add(16)), u8x16(ql.add(32)), u8x16(ql.add(48))];
        let (h0, h1) = (u8x16(qh), u8x16(qh.add(16)));
        let m4 = _mm512_set1_epi32(0xF);
        let m2 = _mm512_set1_epi32(0x30);
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
        let mut q = [_mm512_setzero_si512(); 4];
        for i in 0..4 {
            q[i] = _mm512_or_si512(low[i], _mm512_and_si512(high[i], m2));
        }
        let mut w = [_mm512_setzero_ps(); 4];
        for i in 0..4 {
            let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(q[i], _mm512_set1_epi32(32)));
            w[i] = _mm512_mul_ps(_mm512_set1_ps(s[4 * k + i]), v);
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
trait Float {
    const ELEM_BYTES: usize;
    const DTYPE: DType;
    /// group `g` of the row at `p`
    unsafe fn group(p: *const u8, g: usize) -> __m512;
}

struct F32;
impl Float for F32 {
    const ELEM_BYTES: usize = 4;
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> __m512 {
        _mm512_loadu_ps(p.add(64 * g) as *const f32)
    }
}

struct F16;
impl Float for F16 {
    const ELEM_BYTES: usize = 2;
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32 * g) as *const __m256i))
    }
}

struct BF16;
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
unsafe fn reduce(a: &[__m512; 4]) -> f32 {
    let v = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    let u = _mm256_add_ps(lo, hi); // lanes l + l+8
    let w = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)); // l + l+4
    let z = _mm_add_ps(w, _mm_movehl_ps(w, w)); // l + l+2
    _mm_cvtss_f32(_mm_add_ss(z, _mm_shuffle_ps(z, z, 1))) // l + l+1
}

/// Accumulators of R rows × N tokens: `[row][token][canonical accumulator]`.
type Acc<const R: usize, const N: usize> = [[[__m512; 4]; N]; R];

/// The `G` groups of activations at element `e` for each token.
#[inline(always)]
unsafe fn load_x<const N: usize, const G: usize>(xs: &[*const f32; N], e: usize) -> [[__m512; G]; N] {
    let mut v = [[_mm512_setzero_ps(); G]; N];
    for t in 0..N {
        for i in 0..G {
            v[t][i] = _mm512_loadu_ps(xs[t].add(e + 16 * i));
        }
    }
    v
}

/// `acc[t][a0 + i] = fma(w[i], x[t][i], acc[t][a0 + i])` for every token and group `i < G`.
#[inline(always)]
unsafe fn fma_groups<const N: usize, const G: usize>(acc: &mut [[__m512; 4]; N], w: &[__m512; G], x: &[[__m512; G]; N], a0: usize) {
    for t in 0..N {
        for i in 0..G {
            acc[t][a0 + i] = _mm512_fmadd_ps(w[i], x[t][i], acc[t][a0 + i]);
        }
    }
}

/// Reduces every accumulator set.
#[inline(always)]
unsafe fn finish<const R: usize, const N: usize>(acc: &Acc<R, N>) -> [[f32; N]; R] {
    let mut out = [[0f32; N]; R];
    for r in 0..R {
        for t in 0..N {
            out[r][t] = reduce(&acc[r][t]);
        }
    }
    out
}

/// Canonical dots of R quantized rows (`cols` elements each) with N activation rows.
/// Each activation chunk is loaded once and used by all R rows.
#[inline(always)]
unsafe fn dot_quant<Q: Quant, const R: usize, const N: usize>(
    rows: [*const u8; R],
    cols: usize,
    xs: [*const f32; N],
) -> [[f32; N]; R] {
    let unit_elems = Q::CHUNKS * 64;
    let units = cols / unit_elems;
    let mut acc: Acc<R, N> = [[[_mm512_setzero_ps(); 4]; N]; R];
    for u in 0..units {
        let off = u * Q::UNIT_BYTES;
        let mut st = [Q::prepare(rows[0].add(off)); R];
        for r in 1..R {
            st[r] = Q::prepare(rows[r].add(off));
        }
        for k in 0..Q::CHUNKS {
            let x = load_x::<N, 4>(&xs, (u * Q::CHUNKS + k) * 64);
            for r in 0..R {
                let w = Q::chunk(rows[r].add(off), &st[r], k);
                fma_groups(&mut acc[r], &w, &x, 0);
            }
        }
    }
    // 32-element-block types: whole block pairs, then one block, after the last whole unit
    let rest = cols - units * unit_elems;
    let (mut e, mut off) = (units * unit_elems, units * Q::UNIT_BYTES);
    for _ in 0..rest / 64 {
        let x = load_x::<N, 4>(&xs, e);
        for r in 0..R {
            fma_groups(&mut acc[r], &Q::pair(rows[r].add(off)), &x, 0);
        }
        e += 64;
        off += Q::UNIT_BYTES / Q::CHUNKS;
    }
    if rest % 64 != 0 {
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
unsafe fn dot_float<F: Float, const R: usize, const N: usize>(
    rows: [*const u8; R],
    cols: usize,
    xs: [*const f32; N],
) -> [[f32; N]; R] {
    let groups = cols / 16;
    let chunks = groups / 4;
    let mut acc: Acc<R, N> = [[[_mm512_setzero_ps(); 4]; N]; R];
    for c in 0..chunks {
        let x = load_x::<N, 4>(&xs, 64 * c);
        for r in 0..R {
            let p = rows[r];
            let w = [F::group(p, 4 * c), F::group(p, 4 * c + 1), F::group(p, 4 * c + 2), F::group(p, 4 * c + 3)];
            fma_groups(&mut acc[r], &w, &x, 0);
        }
    }
    for g in 4 * chunks..groups {
        let x = load_x::<N, 1>(&xs, 16 * g);
        for r in 0..R {
            fma_groups(&mut acc[r], &[F::group(rows[r], g)], &x, g % 4);
        }
    }
    let mut out = finish(&acc);
    let tail = 16 * groups;
    if tail < cols {
        let n = cols - tail;
        for r in 0..R {
            let mut buf = [0f32; 16]; // the dequantized tail (< 16 elements)
            let bytes = std::slice::from_raw_parts(rows[r].add(tail * F::ELEM_BYTES), n * F::ELEM_BYTES);
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
        unsafe fn $name<T: $bound>(data: &[u8], rb: usize, cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
            let rows = out.len() / n;
            if n == 1 {
                let full = rows / TILE_ROWS * TILE_ROWS;
                tiles::<TILE_ROWS, 1>(|p, xs| $dot::<T, TILE_ROWS, 1>(p, cols, xs), data, rb, cols, x, 0, 1, out, 0, full);
                tiles::<1, 1>(|p, xs| $dot::<T, 1, 1>(p, cols, xs), data, rb, cols, x, 0, 1, out, full, rows);
                return;
            }
            let mut t0 = 0;
            while t0 < n {
                let step = (n - t0).min(4);
                match step {
                    4 => tiles::<1, 4>(|p, xs| $dot::<T, 1, 4>(p, cols, xs), data, rb, cols, x, t0, n, out, 0, rows),
                    3 => tiles::<1, 3>(|p, xs| $dot::<T, 1, 3>(p, cols, xs), data, rb, cols, x, t0, n, out, 0, rows),
                    2 => tiles::<1, 2>(|p, xs| $dot::<T, 1, 2>(p, cols, xs), data, rb, cols, x, t0, n, out, 0, rows),
                    _ => tiles::<1, 1>(|p, xs| $dot::<T, 1, 1>(p, cols, xs), data, rb, cols, x, t0, n, out, 0, rows),
                }
                t0 += step;
            }
        }
    };
}
rows_fn!(rows_quant, Quant, dot_quant);
rows_fn!(rows_float, Float, dot_float);

/// `out[r * n + t]` = canonical dot of row `r` of `data` (rows of `cols` elements of `dtype`)
/// with row `t` of `x` (`n × cols`).
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available; `data.len() == out.len() / n * row_bytes(cols)`,
/// `x.len() == n * cols`, `cols` a multiple of the block size, `n > 0`.
pub(crate) unsafe fn rows(dtype: DType, data: &[u8], cols: usize, x: &[f32], n: usize, out: &mut [f32]) {
    let rb = crate::dequant::prefix_bytes(dtype, cols);
    debug_assert!(n > 0 && x.len() == n * cols && data.len() == out.len() / n * rb);
    match dtype {
        DType::F32 => rows_float::<F32>(data, rb, cols, x, n, out),
        DType::F16 => rows_float::<F16>(data, rb, cols, x, n, out),
        DType::BF16 => rows_float::<BF16>(data, rb, cols, x, n, out),
        DType::Q8_0 => rows_quant::<Q80>(data, rb, cols, x, n, out),
        DType::Q4_0 => rows_quant::<Q40>(data, rb, cols, x, n, out),
        DType::Q4_1 => rows_quant::<Q41>(data, rb, cols, x, n, out),
        DType::Q4K => rows_quant::<Q4K>(data, rb, cols, x, n, out),
        DType::Q6K => rows_quant::<Q6K>(data, rb, cols, x, n, out),
    }
}

// ---------------------------------------------------------------------------------------------
// f32 vector helpers for attention and activations

/// Canonical dot product of two f32 slices of equal length.
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    dot_float::<F32, 1, 1>([a.as_ptr() as *const u8], a.len(), [b.as_ptr()])[0][0]
}

/// Canonical exp of 16 lanes (see [`crate::canon::exp`]).
#[inline(always)]
unsafe fn exp16(x: __m512) -> __m512 {
    let xc = _mm512_max_ps(_mm512_set1_ps(ec::LO), _mm512_min_ps(_mm512_set1_ps(ec::HI), x));
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
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(126)), 23));
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

/// `gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i]`.
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available; equal lengths.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let one = _mm512_set1_ps(1.0);
    let mut g = gate.chunks_exact_mut(16);
    let mut u = up.chunks_exact(16);
    for (gc, uc) in (&mut g).zip(&mut u) {
        let v = _mm512_loadu_ps(gc.as_ptr());
        let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
        let s = _mm512_div_ps(v, _mm512_add_ps(one, e));
        _mm512_storeu_ps(gc.as_mut_ptr(), _mm512_mul_ps(s, _mm512_loadu_ps(uc.as_ptr())));
    }
    crate::elementwise::silu_mul_scalar(g.into_remainder(), u.remainder());
}

/// `y[i] = fma(a, x[i], y[i])`.
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available; equal lengths.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    let av = _mm512_set1_ps(a);
    let mut yc = y.chunks_exact_mut(16);
    let mut xc = x.chunks_exact(16);
    for (yv, xv) in (&mut yc).zip(&mut xc) {
        let r = _mm512_fmadd_ps(av, _mm512_loadu_ps(xv.as_ptr()), _mm512_loadu_ps(yv.as_ptr()));
        _mm512_storeu_ps(yv.as_mut_ptr(), r);
    }
    for (yv, &xv) in yc.into_remainder().iter_mut().zip(xc.remainder()) {
        *yv = a.mul_add(xv, *yv);
    }
}
