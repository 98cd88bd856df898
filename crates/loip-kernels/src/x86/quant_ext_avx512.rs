//! AVX-512 single-token kernels of the extra GGUF types (`Q5_0`, `Q5_1`, `Q2_K`, `Q3_K`,
//! `Q5_K`, `IQ4_NL`, `IQ4_XS`): weights dequantized in registers, 16 lanes at a time, to the
//! exact values of the scalar references, fed to the canonical accumulators of
//! [`crate::canon`] four rows per activation load.
//!
//! - Q5_0 / Q5_1: the 32 possible values of a block form two 16-entry tables (`(q − 16)·d`,
//!   resp. `q·d + m` as one fma, exact products); `vpermt2ps` picks by the 5-bit index whose
//!   high bit is set by a mask straight from `qh`.
//! - IQ4_NL / IQ4_XS: the table `d·K` (exact), picked by nibble.
//! - Q2_K / Q3_K / Q5_K: the unit's 16 (or 8) scales and mins are converted once per row and
//!   unit into a stack buffer; each group is `fma(q, d·sc, −dmin·m)` (Q2_K, Q5_K) or
//!   `(d·sc)·q` (Q3_K), with the high bits applied by masked integer operations.
//!
//! Safety: every `unsafe fn` requires AVX-512F, AVX2, FMA and F16C, and the lengths stated.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::quant_ext_decode::{Decode, IQ4NL, IQ4XS, Q2K, Q3K, Q5, Q5K};
use crate::quant_k_ext::{scale_iq4xs, scales_q3k, IQ4_TABLE};
use crate::scales::unpack_scales_k4;
use std::ptr::read_unaligned;

/// 64 elements as four canonical 16-lane groups.
type Chunk = [__m512; 4];

/// A type read in units of 256 elements (8 blocks of 32, or one super-block).
pub(super) trait Fused: Decode {
    /// f32 scales of one unit, computed once per row and unit
    type State: Copy;
    /// The state of the unit at `p`.
    unsafe fn prep(p: *const u8) -> Self::State;
    /// Elements `64k .. 64k + 64` (`k < 4`) of the unit at `p`.
    unsafe fn chunk(p: *const u8, s: &Self::State, k: usize) -> Chunk;
    /// 32-element types: the two groups of the one block at `p` (outside whole units).
    unsafe fn block(p: *const u8) -> [__m512; 2];
}

#[inline(always)]
unsafe fn lanes() -> __m512 {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    )
}

/// 16 bytes at `p`, zero-extended to 16 × i32.
#[inline(always)]
unsafe fn bytes16(p: *const u8) -> __m512i {
    _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))
}

/// The f16 at `p`, exactly, broadcast.
#[inline(always)]
unsafe fn half_splat(p: *const u8) -> __m512 {
    _mm512_set1_ps(super::avx2::f16_scalar(p))
}

/// The f16 scale words of the 8 blocks of a unit (`stride` bytes apart from `p`) as f32.
#[inline(always)]
unsafe fn block_scales8(p: *const u8, stride: usize) -> __m256 {
    let mut h = [0i16; 8];
    for (i, v) in h.iter_mut().enumerate() {
        *v = read_unaligned(p.add(stride * i) as *const i16);
    }
    _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i))
}

/// One Q5 block at `p` of scale `d` (and min `m` for Q5_1).
#[inline(always)]
unsafe fn q5_groups<const MIN: bool>(p: *const u8, d: __m512, m: __m512) -> [__m512; 2] {
    let off = if MIN { 4 } else { 2 };
    // the values of q = 0..16 and 16..32
    let (t0, t1) = if MIN {
        let hi = _mm512_add_ps(lanes(), _mm512_set1_ps(16.0));
        (_mm512_fmadd_ps(lanes(), d, m), _mm512_fmadd_ps(hi, d, m))
    } else {
        let lo = _mm512_sub_ps(lanes(), _mm512_set1_ps(16.0));
        (_mm512_mul_ps(lo, d), _mm512_mul_ps(lanes(), d))
    };
    // the high bits of elements 0..16 and 16..32, as masks
    let qh0 = read_unaligned(p.add(off) as *const u16);
    let qh1 = read_unaligned(p.add(off + 2) as *const u16);
    let q = bytes16(p.add(off + 4));
    let c16 = _mm512_set1_epi32(16);
    let lo = _mm512_and_si512(q, _mm512_set1_epi32(0xF));
    let hi = _mm512_srli_epi32(q, 4);
    let i0 = _mm512_mask_or_epi32(lo, qh0, lo, c16);
    let i1 = _mm512_mask_or_epi32(hi, qh1, hi, c16);
    [
        _mm512_permutex2var_ps(t0, i0, t1),
        _mm512_permutex2var_ps(t0, i1, t1),
    ]
}

impl<const MIN: bool> Fused for Q5<MIN> {
    /// `d` of the unit's 8 blocks, then `m` (Q5_1)
    type State = [f32; 16];
    #[inline(always)]
    unsafe fn prep(p: *const u8) -> [f32; 16] {
        let mut s = [0f32; 16];
        _mm256_storeu_ps(s.as_mut_ptr(), block_scales8(p, Self::BYTES));
        if MIN {
            _mm256_storeu_ps(s.as_mut_ptr().add(8), block_scales8(p.add(2), Self::BYTES));
        }
        s
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &[f32; 16], k: usize) -> Chunk {
        let (i, j) = (2 * k, 2 * k + 1);
        let (mi, mj) = if MIN {
            (at(s, 8 + i), at(s, 8 + j))
        } else {
            (_mm512_setzero_ps(), _mm512_setzero_ps())
        };
        let a = q5_groups::<MIN>(p.add(i * Self::BYTES), at(s, i), mi);
        let c = q5_groups::<MIN>(p.add(j * Self::BYTES), at(s, j), mj);
        [a[0], a[1], c[0], c[1]]
    }
    #[inline(always)]
    unsafe fn block(p: *const u8) -> [__m512; 2] {
        let m = if MIN {
            half_splat(p.add(2))
        } else {
            _mm512_setzero_ps()
        };
        q5_groups::<MIN>(p, half_splat(p), m)
    }
}

/// The IQ4 table times `d` (exact products).
#[inline(always)]
unsafe fn iq4_table(d: __m512) -> __m512 {
    let k = _mm512_cvtepi8_epi32(_mm_loadu_si128(IQ4_TABLE.as_ptr() as *const __m128i));
    _mm512_mul_ps(d, _mm512_cvtepi32_ps(k))
}

/// One IQ4 block: elements 0..16 from the low nibbles of `qs`, 16..32 from the high ones.
#[inline(always)]
unsafe fn iq4_groups(table: __m512, qs: *const u8) -> [__m512; 2] {
    let q = bytes16(qs);
    // vpermps reads only the low 4 bits of each index
    [
        _mm512_permutexvar_ps(q, table),
        _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table),
    ]
}

impl Fused for IQ4NL {
    /// `d` of the unit's 8 blocks
    type State = [f32; 8];
    #[inline(always)]
    unsafe fn prep(p: *const u8) -> [f32; 8] {
        let mut s = [0f32; 8];
        _mm256_storeu_ps(s.as_mut_ptr(), block_scales8(p, Self::BYTES));
        s
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &[f32; 8], k: usize) -> Chunk {
        let (i, j) = (2 * k, 2 * k + 1);
        let a = iq4_groups(iq4_table(at(s, i)), p.add(i * Self::BYTES + 2));
        let c = iq4_groups(iq4_table(at(s, j)), p.add(j * Self::BYTES + 2));
        [a[0], a[1], c[0], c[1]]
    }
    #[inline(always)]
    unsafe fn block(p: *const u8) -> [__m512; 2] {
        iq4_groups(iq4_table(half_splat(p)), p.add(2))
    }
}

/// Block `i` (< 8) of the IQ4_XS super-block at `p`.
#[inline(always)]
unsafe fn iq4xs_block(p: *const u8, i: usize) -> [__m512; 2] {
    let d = super::avx2::f16_scalar(p);
    let dl = d * (scale_iq4xs(std::slice::from_raw_parts(p, 8), i) - 32) as f32;
    iq4_groups(iq4_table(_mm512_set1_ps(dl)), p.add(8 + 16 * i))
}

impl Fused for IQ4XS {
    type State = ();
    #[inline(always)]
    unsafe fn prep(_p: *const u8) {}
    #[inline(always)]
    unsafe fn chunk(p: *const u8, _s: &(), k: usize) -> Chunk {
        let (a, c) = (iq4xs_block(p, 2 * k), iq4xs_block(p, 2 * k + 1));
        [a[0], a[1], c[0], c[1]]
    }
    #[inline(always)]
    unsafe fn block(_p: *const u8) -> [__m512; 2] {
        unreachable!("IQ4_XS rows are whole 256-element blocks")
    }
}

/// `[d · sc_g] ++ [dmin · m_g]` of a unit's 16 groups (Q2_K) or 8 sub-blocks (Q5_K).
type Scales = [f32; 32];

/// Broadcast of entry `i` of a unit's scales.
#[inline(always)]
unsafe fn at(s: &[f32], i: usize) -> __m512 {
    _mm512_set1_ps(*s.get_unchecked(i))
}

impl Fused for Q2K {
    type State = Scales;
    #[inline(always)]
    unsafe fn prep(p: *const u8) -> Scales {
        let sc = bytes16(p);
        let m4 = _mm512_set1_epi32(0xF);
        let dl = _mm512_mul_ps(
            half_splat(p.add(80)),
            _mm512_cvtepi32_ps(_mm512_and_si512(sc, m4)),
        );
        let ml = _mm512_mul_ps(
            half_splat(p.add(82)),
            _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)),
        );
        let mut s = [0f32; 32];
        _mm512_storeu_ps(s.as_mut_ptr(), dl);
        _mm512_storeu_ps(s.as_mut_ptr().add(16), ml);
        s
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &Scales, k: usize) -> Chunk {
        // group g = 4k + i: bytes 16 (i % 2) .. of half k / 2's 32, shifted by 2 (2 (k % 2) + i / 2)
        let q = p.add(16 + 32 * (k / 2));
        let (b0, b1) = (bytes16(q), bytes16(q.add(16)));
        let m3 = _mm512_set1_epi32(3);
        let mut w = [_mm512_setzero_ps(); 4];
        for (i, wi) in w.iter_mut().enumerate() {
            let b = if i % 2 == 0 { b0 } else { b1 };
            let sh = _mm_cvtsi32_si128(2 * (2 * (k % 2) + i / 2) as i32);
            let v = _mm512_and_si512(_mm512_srl_epi32(b, sh), m3);
            let g = 4 * k + i;
            *wi = _mm512_fmsub_ps(_mm512_cvtepi32_ps(v), at(s, g), at(s, 16 + g));
        }
        w
    }
    #[inline(always)]
    unsafe fn block(_p: *const u8) -> [__m512; 2] {
        unreachable!("Q2_K rows are whole 256-element blocks")
    }
}

impl Fused for Q3K {
    type State = [f32; 16];
    #[inline(always)]
    unsafe fn prep(p: *const u8) -> [f32; 16] {
        let sc = scales_q3k(std::slice::from_raw_parts(p.add(96), 12));
        let v = _mm512_sub_epi32(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(sc.as_ptr() as *const __m128i)),
            _mm512_set1_epi32(32),
        );
        let mut s = [0f32; 16];
        _mm512_storeu_ps(
            s.as_mut_ptr(),
            _mm512_mul_ps(half_splat(p.add(108)), _mm512_cvtepi32_ps(v)),
        );
        s
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &[f32; 16], k: usize) -> Chunk {
        let (n, q) = (k / 2, p.add(32 + 32 * (k / 2)));
        let (b0, b1) = (bytes16(q), bytes16(q.add(16)));
        let (h0, h1) = (bytes16(p), bytes16(p.add(16)));
        let (m3, c4) = (_mm512_set1_epi32(3), _mm512_set1_epi32(4));
        let mut w = [_mm512_setzero_ps(); 4];
        for (i, wi) in w.iter_mut().enumerate() {
            let (b, h) = if i % 2 == 0 { (b0, h0) } else { (b1, h1) };
            let j = 2 * (k % 2) + i / 2;
            let ql = _mm512_and_si512(_mm512_srl_epi32(b, _mm_cvtsi32_si128(2 * j as i32)), m3);
            // a clear high bit (bit 4n + j of hmask) subtracts 4
            let clear = _mm512_testn_epi32_mask(h, _mm512_set1_epi32(1 << (4 * n + j)));
            let q = _mm512_mask_sub_epi32(ql, clear, ql, c4);
            *wi = _mm512_mul_ps(at(s, 4 * k + i), _mm512_cvtepi32_ps(q));
        }
        w
    }
    #[inline(always)]
    unsafe fn block(_p: *const u8) -> [__m512; 2] {
        unreachable!("Q3_K rows are whole 256-element blocks")
    }
}

impl Fused for Q5K {
    type State = [f32; 16];
    /// `d · sc_k` for the 8 sub-blocks, then `dmin · m_k`
    #[inline(always)]
    unsafe fn prep(p: *const u8) -> [f32; 16] {
        let [sc, m] = unpack_scales_k4(p.add(4));
        let q = _mm_setr_epi32(sc[0] as i32, sc[1] as i32, m[0] as i32, m[1] as i32);
        let v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
        let dm = _mm512_mask_blend_ps(0xFF00, half_splat(p), half_splat(p.add(2)));
        let mut s = [0f32; 16];
        _mm512_storeu_ps(s.as_mut_ptr(), _mm512_mul_ps(dm, v));
        s
    }
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &[f32; 16], k: usize) -> Chunk {
        let ql = p.add(48 + 32 * k);
        let (b0, b1) = (bytes16(ql), bytes16(ql.add(16)));
        let (h0, h1) = (bytes16(p.add(16)), bytes16(p.add(32)));
        let (m4, c16) = (_mm512_set1_epi32(0xF), _mm512_set1_epi32(16));
        let mut w = [_mm512_setzero_ps(); 4];
        for (i, wi) in w.iter_mut().enumerate() {
            // groups 0, 1: low nibbles, sub-block 2k; groups 2, 3: high nibbles, 2k + 1
            let (b, h) = if i % 2 == 0 { (b0, h0) } else { (b1, h1) };
            let sub = 2 * k + i / 2;
            let nib = if i < 2 {
                _mm512_and_si512(b, m4)
            } else {
                _mm512_srli_epi32(b, 4)
            };
            let high = _mm512_test_epi32_mask(h, _mm512_set1_epi32(1 << sub));
            let q = _mm512_mask_or_epi32(nib, high, nib, c16);
            *wi = _mm512_fmsub_ps(_mm512_cvtepi32_ps(q), at(s, sub), at(s, 8 + sub));
        }
        w
    }
    #[inline(always)]
    unsafe fn block(_p: *const u8) -> [__m512; 2] {
        unreachable!("Q5_K rows are whole 256-element blocks")
    }
}

/// `acc[i] = fma(w[i], x[i], acc[i])` for the first `G` groups.
#[inline(always)]
unsafe fn fma4<const G: usize>(acc: &mut [__m512; 4], w: &[__m512], x: &[__m512; 4]) {
    for i in 0..G {
        acc[i] = _mm512_fmadd_ps(w[i], x[i], acc[i]);
    }
}

/// The 64 activations at element `e` of `x`.
#[inline(always)]
unsafe fn load_x(x: *const f32, e: usize) -> [__m512; 4] {
    let l = |i: usize| _mm512_loadu_ps(x.add(e + 16 * i));
    [l(0), l(1), l(2), l(3)]
}

/// Canonical dots of R rows of `D` (`cols` elements, a multiple of 32) with one activation
/// row; `dist`: the prefetch distance in bytes (the next tile of rows).
#[inline(always)]
pub(super) unsafe fn dot<D: Fused, const R: usize>(
    rows: [*const u8; R],
    cols: usize,
    x: *const f32,
    dist: usize,
) -> [f32; R] {
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let unit_bytes = 256 / D::ELEMS * D::BYTES;
    let units = cols / 256;
    // the next tile of R rows (consecutive), one share per unit and block pair
    let ahead = super::Ahead::new(rows[0], dist, units + (cols - 256 * units).div_ceil(64));
    for u in 0..units {
        let off = u * unit_bytes;
        ahead.step(u);
        // a loop, not `array::from_fn`: its closure is a function of its own without this
        // kernel's target features, and when not inlined (as here for Q3_K once) every
        // intrinsic in `prep` became a call
        let mut st = [D::prep(rows[0].add(off)); R];
        for (r, s) in st.iter_mut().enumerate().skip(1) {
            *s = D::prep(rows[r].add(off));
        }
        for k in 0..4 {
            let xv = load_x(x, 256 * u + 64 * k);
            for r in 0..R {
                fma4::<4>(&mut acc[r], &D::chunk(rows[r].add(off), &st[r], k), &xv);
            }
        }
    }
    // 32-element types: block pairs, then one block, after the last whole unit
    let (mut e, mut off) = (256 * units, units * unit_bytes);
    while e + 64 <= cols {
        ahead.step(units + (e - 256 * units) / 64);
        let xv = load_x(x, e);
        for r in 0..R {
            let (a, b) = (
                D::block(rows[r].add(off)),
                D::block(rows[r].add(off + D::BYTES)),
            );
            fma4::<4>(&mut acc[r], &[a[0], a[1], b[0], b[1]], &xv);
        }
        (e, off) = (e + 64, off + 2 * D::BYTES);
    }
    if e < cols {
        ahead.step(units + (e - 256 * units) / 64);
        // canonical groups 4c, 4c + 1 -> accumulators 0, 1
        let xv = [
            _mm512_loadu_ps(x.add(e)),
            _mm512_loadu_ps(x.add(e + 16)),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        ];
        for r in 0..R {
            fma4::<2>(&mut acc[r], &D::block(rows[r].add(off)), &xv);
        }
    }
    // (acc0 + acc2) + (acc1 + acc3), then the lane tree, four rows at a time
    let mut v = [_mm512_setzero_ps(); R];
    for (vr, a) in v.iter_mut().zip(&acc) {
        *vr = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
    }
    let mut out = [0f32; R];
    for r0 in (0..R).step_by(4) {
        let mut four = [_mm512_setzero_ps(); 4];
        for (i, f) in four.iter_mut().enumerate() {
            *f = v[(r0 + i).min(R - 1)];
        }
        let mut s = [0f32; 4];
        _mm_storeu_ps(s.as_mut_ptr(), super::avx512::reduce4(four));
        let n = 4.min(R - r0);
        out[r0..r0 + n].copy_from_slice(&s[..n]);
    }
    out
}
