//! AVX2 + FMA + F16C kernels (256-bit registers; one canonical 16-lane group is a pair of
//! registers: lanes 0..8 and 8..16).
//!
//! Same values and the same canonical order as [`super::avx512`] and [`crate::canon`].
//!
//! Safety: every `unsafe fn` here requires a CPU with AVX2, FMA and F16C (checked by
//! [`crate::simd`]) and the buffer lengths stated in its docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::canon::exp_consts as ec;
use crate::canon::{gelu_consts as gl, Act};
use crate::dtype::DType;
use crate::scales::unpack_scales_k4;
use std::ptr::read_unaligned;

/// One 64-element chunk: `[2i]` = lanes 0..8 and `[2i + 1]` = lanes 8..16 of group `i`.
type Chunk = [__m256; 8];
/// One canonical 16-lane group as two halves.
type Group = [__m256; 2];

/// The f16 at `p` in all 8 lanes: the word broadcast (`vpbroadcastw` writes the whole
/// register), then converted. Converting one lane and broadcasting it compiled to `vpinsrw`
/// into a register last written by the previous block's products, a false dependency that
/// chained the blocks of a row (Q5_0's one-token dot at 7 GB/s).
#[inline(always)]
pub(super) unsafe fn f16_splat(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16(read_unaligned(p as *const u16) as i16))
}

#[inline(always)]
pub(super) unsafe fn f16_scalar(p: *const u8) -> f32 {
    let h = read_unaligned(p as *const u16) as i32;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)))
}

/// `p`, through an empty `asm!` that LLVM cannot see through: shuffle controls read from
/// there stay the in-lane byte shuffles they are written as (with constants, LLVM turned
/// broadcasts and `vpshufb` into cross-lane shuffles, more of them), and since the barrier
/// may write memory, the loads after it stay after the loads (the previous fmas) before it,
/// which keeps LLVM from decoding a block ahead and spilling the accumulators.
#[inline(always)]
pub(super) unsafe fn opaque<T>(mut p: *const T) -> *const T {
    std::arch::asm!("/* {0} */", inout(reg) p, options(nostack, preserves_flags));
    p
}

/// 32 bytes as 4 × 8 dwords, in-lane: `[bytes 0..16 | bytes 0..16]` and `[16..32 | 16..32]`
/// (one `vpermq` each) picked by `pick` (the 4 bytes `8a + 4l ..` of lane `l` into its
/// dwords, zero-extended: `pick[0]` for a = 0, 2, `pick[1]` for a = 1, 3), converted.
#[inline(always)]
pub(super) unsafe fn bytes_ps(q: __m256i, pick: *const [i8; 32]) -> [__m256; 4] {
    let (lo, hi) = (
        _mm256_permute4x64_epi64(q, 0x44),
        _mm256_permute4x64_epi64(q, 0xEE),
    );
    let ctl = |a: usize| _mm256_load_si256(pick.add(a) as *const __m256i);
    let f = |v, a| _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, ctl(a)));
    [f(lo, 0), f(lo, 1), f(hi, 0), f(hi, 1)]
}

/// The controls of [`bytes_ps`] (`pick`) and the byte masks `0x0F`, `0x30` of Q6_K's
/// values, read from memory through [`opaque`] (as constants, LLVM kept the masks in
/// registers and spilled them and the accumulators).
#[repr(C, align(32))]
pub(super) struct ByteConsts {
    pub(super) pick: [[i8; 32]; 2],
    pub(super) m0f: [i8; 32],
    pub(super) m30: [i8; 32],
}

pub(super) static BYTE_CONSTS: ByteConsts = {
    let mut c = [[-1i8; 32]; 2];
    let mut a = 0;
    while a < 2 {
        let mut l = 0;
        while l < 2 {
            let mut j = 0;
            while j < 4 {
                c[a][16 * l + 4 * j] = (8 * a + 4 * l + j) as i8;
                j += 1;
            }
            l += 1;
        }
        a += 1;
    }
    ByteConsts {
        pick: c,
        m0f: [0xF; 32],
        m30: [0x30; 32],
    }
};

/// 8 bytes at `p`, zero-extended to 8 × i32.
#[inline(always)]
pub(super) unsafe fn u8x8(p: *const u8) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))
}

/// 8 bytes at `p`, sign-extended to 8 × f32.
#[inline(always)]
unsafe fn i8x8_ps(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
}

/// The 32 nibbles of a Q4 block at `qs` as 4 × 8 integers (elements 0..8, 8..16, 16..24, 24..32).
#[inline(always)]
unsafe fn nibbles(qs: *const u8) -> [__m256i; 4] {
    let m = _mm256_set1_epi32(0xF);
    let a = u8x8(qs);
    let b = u8x8(qs.add(8));
    [
        _mm256_and_si256(a, m),
        _mm256_and_si256(b, m),
        _mm256_srli_epi32(a, 4),
        _mm256_srli_epi32(b, 4),
    ]
}

/// `[d * sc_k for k in 0..8] ++ [dmin * m_k for k in 0..8]` of a Q4_K / Q5_K block at `p`
/// (`d`, `dmin` its two f16 words, the 6-bit scales and mins packed after them), eight at a
/// time: each one product of exact values, as the scalar `d * sc as f32`.
#[inline(always)]
pub(super) unsafe fn k4_scales(p: *const u8) -> [f32; 16] {
    let [sc, m] = unpack_scales_k4(p.add(4));
    let packed = [sc[0].to_le(), sc[1].to_le(), m[0].to_le(), m[1].to_le()];
    let b = packed.as_ptr() as *const u8;
    let mut s = [0f32; 16];
    // `d`, `dmin` by `f16_splat`: converted in one lane (`f16_scalar`), each was loaded by
    // `vpinsrw` into a register the previous block's fmas wrote last, which chained the
    // blocks of a row (as for Q5_0, see `f16_splat`)
    for (h, f) in [f16_splat(p), f16_splat(p.add(2))].into_iter().enumerate() {
        let v = _mm256_mul_ps(f, _mm256_cvtepi32_ps(u8x8(b.add(8 * h))));
        _mm256_storeu_ps(s.as_mut_ptr().add(8 * h), v);
    }
    s
}

/// A quantized type, read one block (32 or 256 elements) at a time.
pub(super) trait Quant {
    /// 64-element chunks per block (0 for 32-element blocks, read in pairs)
    const CHUNKS: usize;
    const BLOCK_BYTES: usize;
    type State: Copy;
    unsafe fn prepare(p: *const u8) -> Self::State;
    /// 64-element chunk `k` of the block at `p` (or of the block pair for 32-element blocks)
    ///
    /// Always inlined: compiled on its own, this default method has no AVX2 enabled, so each
    /// intrinsic of `half4` became a call (Q4_K and Q6_K prefill weights were dequantized
    /// that way, 6 % of a Gemma 3 prefill's CPU time).
    #[inline(always)]
    unsafe fn chunk(p: *const u8, s: &Self::State, k: usize) -> Chunk {
        let [a, b, c, d] = Self::half4(p, s, k, 0);
        let [e, f, g, h] = Self::half4(p, s, k, 1);
        [a, b, c, d, e, f, g, h]
    }
    /// halves `4h .. 4h + 4` of [`Quant::chunk`] (`h < 2`): the dot kernel takes a chunk in
    /// two, so that 8 accumulators, 4 weights and the block's constants fit the 16 registers
    unsafe fn half4(p: *const u8, s: &Self::State, k: usize, h: usize) -> [__m256; 4];
    /// [`Quant::half4`] for a dot product: the same values but for the sign of a zero
    /// (which no sum starting at `+0` can see).
    #[inline(always)]
    unsafe fn dot_half4(p: *const u8, s: &Self::State, k: usize, h: usize) -> [__m256; 4] {
        Self::half4(p, s, k, h)
    }
    /// one 32-element block as two groups (32-element types only)
    unsafe fn block32(p: *const u8) -> [Group; 2];
    /// `acc[j] = fma(w_j, x[e + 8 j ..], acc[j])` for the 8 weight octets `w_j` of chunk `k`
    /// of the block at `p` ([`Quant::dot_half4`] of both halves), in any order across `j`.
    #[inline(always)]
    unsafe fn dot_chunk(
        acc: &mut [__m256; 8],
        p: *const u8,
        s: &Self::State,
        k: usize,
        x: *const f32,
        e: usize,
    ) {
        fma_halves::<4, 0>(acc, &Self::dot_half4(p, s, k, 0), x, e);
        fma_halves::<4, 4>(acc, &Self::dot_half4(p, s, k, 1), x, e + 32);
    }
}

/// `q * d + m` per element as one fma: `q * d` is exact (a 4-bit integer times an f16 fits
/// in 24 bits), so the one rounding of the fma gives `dequant`'s twice-rounded value.
#[inline(always)]
unsafe fn affine(q: __m256i, d: __m256, m: Option<__m256>) -> __m256 {
    match m {
        Some(m) => _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m),
        None => _mm256_mul_ps(_mm256_cvtepi32_ps(q), d),
    }
}

macro_rules! pair_quant {
    ($t:ident, $bytes:expr) => {
        impl Quant for $t {
            const CHUNKS: usize = 0;
            const BLOCK_BYTES: usize = $bytes;
            type State = ();
            #[inline(always)]
            unsafe fn prepare(_p: *const u8) {}
            #[inline(always)]
            unsafe fn half4(p: *const u8, _s: &(), _k: usize, h: usize) -> [__m256; 4] {
                let [[a, b], [c, d]] = $t::block32(p.add(h * $bytes));
                [a, b, c, d]
            }
            #[inline(always)]
            unsafe fn block32(p: *const u8) -> [Group; 2] {
                $t::block(p)
            }
        }
    };
}

pub(super) struct Q40;
impl Q40 {
    #[inline(always)]
    unsafe fn block(p: *const u8) -> [Group; 2] {
        // (q - 8) * d
        let d = f16_splat(p);
        let n = nibbles(p.add(2));
        let e = _mm256_set1_epi32(8);
        let f = |q| affine(_mm256_sub_epi32(q, e), d, None);
        [[f(n[0]), f(n[1])], [f(n[2]), f(n[3])]]
    }
}
pair_quant!(Q40, 18);

pub(super) struct Q41;
impl Q41 {
    #[inline(always)]
    unsafe fn block(p: *const u8) -> [Group; 2] {
        // q * d + m
        let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(read_unaligned(p as *const i32)));
        let d = _mm256_broadcastss_ps(dm);
        let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        let n = nibbles(p.add(4));
        let f = |q| affine(q, d, Some(m));
        [[f(n[0]), f(n[1])], [f(n[2]), f(n[3])]]
    }
}
pair_quant!(Q41, 20);

pub(super) struct Q80;
impl Q80 {
    #[inline(always)]
    unsafe fn block(p: *const u8) -> [Group; 2] {
        // q * d
        let d = f16_splat(p);
        let f = |o: usize| _mm256_mul_ps(i8x8_ps(p.add(2 + o)), d);
        [[f(0), f(8)], [f(16), f(24)]]
    }
}
pair_quant!(Q80, 34);

pub(super) struct Q4K;
impl Quant for Q4K {
    const CHUNKS: usize = 4;
    const BLOCK_BYTES: usize = 144;
    /// `[d * sc_k for k in 0..8] ++ [dmin * m_k for k in 0..8]`
    type State = [f32; 16];
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> [f32; 16] {
        k4_scales(p)
    }
    #[inline(always)]
    unsafe fn half4(p: *const u8, s: &[f32; 16], k: usize, h: usize) -> [__m256; 4] {
        // (d * sc) * q - dmin * m as one fms: (d * sc) * q is exact (17 + 4 significant bits);
        // low nibbles (h = 0): sub-block 2k, high nibbles (h = 1): 2k + 1
        let (d, m) = (
            _mm256_set1_ps(s[2 * k + h]),
            _mm256_set1_ps(s[8 + 2 * k + h]),
        );
        let q = p.add(16 + 32 * k);
        let mask = _mm256_set1_epi32(0xF);
        let f = |o: usize| {
            let v = u8x8(q.add(o));
            let v = if h == 0 {
                _mm256_and_si256(v, mask)
            } else {
                _mm256_srli_epi32(v, 4)
            };
            _mm256_fmsub_ps(_mm256_cvtepi32_ps(v), d, m)
        };
        [f(0), f(8), f(16), f(24)]
    }
    /// Each byte's two nibbles at once: octet `o` of the 32 bytes is loaded once (zero-
    /// extended to dwords), its low nibbles (`and`) are octet `o` of the chunk's first half
    /// and its high nibbles (`srl`) octet `o` of the second, so a byte costs one load and
    /// the registers hold 8 accumulators, the 4 scales and two weights (36 vector
    /// instructions per 64 weights, against 44 for the halves one after the other, whose
    /// second half LLVM loaded again as bytes to shift and mask before widening). The
    /// scales are broadcast from memory and the bytes' address read through [`opaque`]: as
    /// values LLVM kept the 16 scales in registers (broadcast by shuffles) and reused the
    /// previous chunk's bytes, spilling accumulators.
    #[inline(always)]
    unsafe fn dot_chunk(
        acc: &mut [__m256; 8],
        p: *const u8,
        s: &[f32; 16],
        k: usize,
        x: *const f32,
        e: usize,
    ) {
        let s = opaque(s.as_ptr());
        let q = opaque(p.add(16 + 32 * k));
        let c = opaque(&BYTE_CONSTS);
        // (d * sc) * q - dmin * m as one fms, as in `half4`
        let (d0, m0) = (
            _mm256_broadcast_ss(&*s.add(2 * k)),
            _mm256_broadcast_ss(&*s.add(8 + 2 * k)),
        );
        let (d1, m1) = (
            _mm256_broadcast_ss(&*s.add(2 * k + 1)),
            _mm256_broadcast_ss(&*s.add(8 + 2 * k + 1)),
        );
        for o in 0..4 {
            let v = u8x8(q.add(8 * o));
            // 0x0F0F0F0F on zero-extended bytes: the low nibble
            let lo = _mm256_and_si256(v, _mm256_load_si256((*c).m0f.as_ptr() as *const __m256i));
            let hi = _mm256_srli_epi32(v, 4);
            let wl = _mm256_fmsub_ps(_mm256_cvtepi32_ps(lo), d0, m0);
            acc[o] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x.add(e + 8 * o)), acc[o]);
            let wh = _mm256_fmsub_ps(_mm256_cvtepi32_ps(hi), d1, m1);
            acc[4 + o] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x.add(e + 32 + 8 * o)), acc[4 + o]);
        }
    }
    #[inline(always)]
    unsafe fn block32(_p: *const u8) -> [Group; 2] {
        unreachable!("Q4_K has 256-element blocks")
    }
}

pub(super) struct Q6K;
impl Q6K {
    /// The 6-bit values `q` (0..64) of elements `64k + 32h .. + 32` of the block at `p` as
    /// bytes: the 32 low nibbles (`ql`, low or high half of each byte) or'ed with 2 bits of
    /// each of the 32 `qh` bytes, on whole registers.
    #[inline(always)]
    unsafe fn bytes(p: *const u8, c: *const ByteConsts, k: usize, h: usize) -> __m256i {
        let ld = |v: &[i8; 32]| _mm256_load_si256(v.as_ptr() as *const __m256i);
        let n = k / 2; // the 128-element half
        let ql = _mm256_loadu_si256(p.add(64 * n + 32 * h) as *const __m256i);
        let qh = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
        let nib = if k % 2 == 0 {
            ql
        } else {
            _mm256_srli_epi16(ql, 4)
        };
        let nib = _mm256_and_si256(nib, ld(&(*c).m0f));
        // bits 2m, 2m + 1 of `qh` (m = 2 (k % 2) + h, the 32-element quarter) to bits 4, 5
        let hb = match 2 * (k % 2) + h {
            0 => _mm256_slli_epi16(qh, 4),
            1 => _mm256_slli_epi16(qh, 2),
            2 => qh,
            _ => _mm256_srli_epi16(qh, 2),
        };
        _mm256_or_si256(nib, _mm256_and_si256(hb, ld(&(*c).m30)))
    }

    /// `EXACT`: `d sc · (q − 32)` (the scalar product); otherwise `d sc · q − 32 d sc` as one
    /// fms, the same value but `+0` for `q = 32` and `sc < 0`. The scales are read from
    /// memory (`vbroadcastss`, a load; LLVM otherwise kept them in registers and
    /// broadcast them with shuffles).
    #[inline(always)]
    unsafe fn values<const EXACT: bool>(
        p: *const u8,
        s: &[f32; 32],
        k: usize,
        h: usize,
    ) -> [__m256; 4] {
        let c = opaque(&BYTE_CONSTS);
        let v = bytes_ps(Self::bytes(p, c, k, h), (*c).pick.as_ptr());
        let s = opaque(s.as_ptr());
        std::array::from_fn(|a| {
            // group 4k + 2h + a / 2 (16 elements each)
            let g = 4 * k + 2 * h + a / 2;
            let ds = _mm256_broadcast_ss(&*s.add(g));
            if EXACT {
                _mm256_mul_ps(ds, _mm256_sub_ps(v[a], _mm256_set1_ps(32.0)))
            } else {
                _mm256_fmsub_ps(v[a], ds, _mm256_broadcast_ss(&*s.add(16 + g)))
            }
        })
    }
}
impl Quant for Q6K {
    const CHUNKS: usize = 4;
    const BLOCK_BYTES: usize = 210;
    /// `d * sc_g` for the 16 groups, then `32 d sc_g`
    type State = [f32; 32];
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> [f32; 32] {
        // eight at a time in vectors (one exact product each, as the scalar `d * sc as f32`;
        // scalar `vcvtsi2ss` conversions merged into their register's last value)
        let d = f16_splat(p.add(208));
        let mut s = [0f32; 32];
        for i in 0..2 {
            let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(192 + 8 * i) as *const __m128i));
            let ds = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
            _mm256_storeu_ps(s.as_mut_ptr().add(8 * i), ds);
            let ds32 = _mm256_mul_ps(ds, _mm256_set1_ps(32.0));
            _mm256_storeu_ps(s.as_mut_ptr().add(16 + 8 * i), ds32);
        }
        s
    }
    #[inline(always)]
    unsafe fn half4(p: *const u8, s: &[f32; 32], k: usize, h: usize) -> [__m256; 4] {
        Self::values::<true>(p, s, k, h)
    }
    #[inline(always)]
    unsafe fn dot_half4(p: *const u8, s: &[f32; 32], k: usize, h: usize) -> [__m256; 4] {
        Self::values::<false>(p, s, k, h)
    }
    #[inline(always)]
    unsafe fn block32(_p: *const u8) -> [Group; 2] {
        unreachable!("Q6_K has 256-element blocks")
    }
}

/// A float type, read one 8-element half group at a time.
pub(super) trait Float {
    const ELEM_BYTES: usize;
    const DTYPE: DType;
    /// elements `8h .. 8h + 8` of the row at `p`
    unsafe fn half(p: *const u8, h: usize) -> __m256;
}

pub(super) struct F32;
impl Float for F32 {
    const ELEM_BYTES: usize = 4;
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    unsafe fn half(p: *const u8, h: usize) -> __m256 {
        _mm256_loadu_ps(p.add(32 * h) as *const f32)
    }
}

pub(super) struct F16;
impl Float for F16 {
    const ELEM_BYTES: usize = 2;
    const DTYPE: DType = DType::F16;
    #[inline(always)]
    unsafe fn half(p: *const u8, h: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(16 * h) as *const __m128i))
    }
}

pub(super) struct BF16;
impl Float for BF16 {
    const ELEM_BYTES: usize = 2;
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    unsafe fn half(p: *const u8, h: usize) -> __m256 {
        let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(16 * h) as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))
    }
}

/// The vertical part of the canonical reduction: `(acc0 + acc2) + (acc1 + acc3)`, then lanes
/// `l + l+8`; `a[2i]`, `a[2i + 1]` are the halves of accumulator `i`.
#[inline(always)]
unsafe fn fold(a: &[__m256; 8]) -> __m256 {
    let lo = _mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6]));
    let hi = _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]));
    _mm256_add_ps(lo, hi) // lanes l + l+8
}

/// The rest of the canonical reduction of a folded vector: `l + l+4`, `+2`, `+1`.
#[inline(always)]
pub(super) unsafe fn hsum(u: __m256) -> f32 {
    let w = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)); // l + l+4
    let z = _mm_add_ps(w, _mm_movehl_ps(w, w)); // l + l+2
    _mm_cvtss_f32(_mm_add_ss(z, _mm_shuffle_ps(z, z, 1))) // l + l+1
}

/// [`hsum`] of 8 folded vectors at once, `[hsum(u[0]), .., hsum(u[7])]`: the same additions
/// of the same operands, arranged by shuffles (a transposed reduction tree).
#[inline(always)]
pub(super) unsafe fn hsum8(u: &[__m256; 8]) -> __m256 {
    // l + l+4 of rows i and i+4: [w_i | w_{i+4}]
    let w: [__m256; 4] = std::array::from_fn(|i| {
        let (a, b) = (u[i], u[i + 4]);
        _mm256_add_ps(
            _mm256_permute2f128_ps(a, b, 0x20),
            _mm256_permute2f128_ps(a, b, 0x31),
        )
    });
    // l + l+2: [z_0, z_1 of row i, row i+1 | of row i+4, row i+5]
    let z = |a: __m256, b: __m256| {
        _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x44), _mm256_shuffle_ps(a, b, 0xEE))
    };
    let (z01, z23) = (z(w[0], w[1]), z(w[2], w[3]));
    // l + l+1: rows 0, 1, 2, 3 | 4, 5, 6, 7
    _mm256_add_ps(
        _mm256_shuffle_ps(z01, z23, 0x88),
        _mm256_shuffle_ps(z01, z23, 0xDD),
    )
}

/// Canonical reduction; `a[2i]`, `a[2i + 1]` are the halves of accumulator `i`.
#[inline(always)]
pub(super) unsafe fn reduce(a: &[__m256; 8]) -> f32 {
    hsum(fold(a))
}

/// `acc[A + j] = fma(w[j], x[e + 8 j ..], acc[A + j])` for `j < J`.
#[inline(always)]
unsafe fn fma_halves<const J: usize, const A: usize>(
    acc: &mut [__m256; 8],
    w: &[__m256; J],
    x: *const f32,
    e: usize,
) {
    for j in 0..J {
        acc[A + j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x.add(e + 8 * j)), acc[A + j]);
    }
}

#[inline(always)]
unsafe fn dot_quant<Q: Quant>(row: *const u8, cols: usize, x: *const f32) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 8];
    // the next row starts right after this one; short rows prefetch further ahead
    let rb = if Q::CHUNKS == 0 {
        cols / 32 * Q::BLOCK_BYTES
    } else {
        cols / (64 * Q::CHUNKS) * Q::BLOCK_BYTES
    }
    .max(super::MIN_AHEAD);
    if Q::CHUNKS == 0 {
        // 32-element blocks, read in pairs
        let pairs = cols / 64;
        for u in 0..pairs {
            super::prefetch(
                row.wrapping_add(rb + 2 * u * Q::BLOCK_BYTES),
                2 * Q::BLOCK_BYTES,
            );
            // each block's four halves go into their accumulators at once: 8 accumulators
            // + 4 weights + the block's constants fit the 16 registers (a whole chunk of 8
            // weights spilled)
            let p = row.add(2 * u * Q::BLOCK_BYTES);
            let [[a, b], [c, d]] = Q::block32(p);
            fma_halves::<4, 0>(&mut acc, &[a, b, c, d], x, 64 * u);
            let [[a, b], [c, d]] = Q::block32(p.add(Q::BLOCK_BYTES));
            fma_halves::<4, 4>(&mut acc, &[a, b, c, d], x, 64 * u + 32);
        }
        if cols % 64 != 0 {
            let [[a, b], [c, d]] = Q::block32(row.add(2 * pairs * Q::BLOCK_BYTES));
            fma_halves::<4, 0>(&mut acc, &[a, b, c, d], x, 64 * pairs);
        }
    } else {
        for b in 0..cols / (64 * Q::CHUNKS) {
            let p = row.add(b * Q::BLOCK_BYTES);
            super::prefetch(p.wrapping_add(rb), Q::BLOCK_BYTES);
            let s = Q::prepare(p);
            #[inline(always)]
            unsafe fn step<Q: Quant>(
                acc: &mut [__m256; 8],
                (p, s): (*const u8, &Q::State),
                k: usize,
                x: *const f32,
                e: usize,
            ) {
                Q::dot_chunk(acc, p, s, k, x, e)
            }
            let e = b * Q::CHUNKS * 64;
            if Q::CHUNKS == 4 {
                // unrolled by hand: as a loop LLVM kept it one (Q6_K: branches on k and
                // three accumulators on the stack; Q4_K, whose loop was kept rolled before
                // its `dot_chunk`, is no slower unrolled now)
                step::<Q>(&mut acc, (p, &s), 0, x, e);
                step::<Q>(&mut acc, (p, &s), 1, x, e + 64);
                step::<Q>(&mut acc, (p, &s), 2, x, e + 128);
                step::<Q>(&mut acc, (p, &s), 3, x, e + 192);
            } else {
                for k in 0..Q::CHUNKS {
                    step::<Q>(&mut acc, (p, &s), k, x, e + 64 * k);
                }
            }
        }
    }
    reduce(&acc)
}

#[inline(always)]
unsafe fn dot_float<F: Float>(row: *const u8, cols: usize, x: *const f32) -> f32 {
    let (u, tail) = dot_float_folded::<F>(row, cols, x);
    let out = hsum(u);
    match tail {
        Some(t) => out + t,
        None => out,
    }
}

/// The canonical dot up to [`fold`], and the tail's sequential sum when there is a tail.
#[inline(always)]
unsafe fn dot_float_folded<F: Float>(
    row: *const u8,
    cols: usize,
    x: *const f32,
) -> (__m256, Option<f32>) {
    let groups = cols / 16;
    let chunks = groups / 4;
    let mut acc = [_mm256_setzero_ps(); 8];
    let rb = cols * F::ELEM_BYTES;
    // 16-bit rows gain from fetching the next row (bf16 +8 % here); f32 rows do not
    let ahead = F::ELEM_BYTES < 4;
    for c in 0..chunks {
        if ahead {
            super::prefetch(
                row.wrapping_add(rb + 64 * c * F::ELEM_BYTES),
                64 * F::ELEM_BYTES,
            );
        }
        let mut w = [_mm256_setzero_ps(); 8];
        for (j, v) in w.iter_mut().enumerate() {
            *v = F::half(row, 8 * c + j);
        }
        fma_halves::<8, 0>(&mut acc, &w, x, 64 * c);
    }
    // the last 1..3 groups go to accumulators 0.. (constant indices keep `acc` in registers)
    let g0 = 4 * chunks;
    for i in 0..3 {
        let g = g0 + i;
        if g < groups {
            acc[2 * i] = _mm256_fmadd_ps(
                F::half(row, 2 * g),
                _mm256_loadu_ps(x.add(16 * g)),
                acc[2 * i],
            );
            acc[2 * i + 1] = _mm256_fmadd_ps(
                F::half(row, 2 * g + 1),
                _mm256_loadu_ps(x.add(16 * g + 8)),
                acc[2 * i + 1],
            );
        }
    }
    let out = fold(&acc);
    let tail = 16 * groups;
    if tail < cols {
        let mut buf = [0f32; 16]; // the dequantized tail (< 16 elements)
        let n = cols - tail;
        let bytes = std::slice::from_raw_parts(row.add(tail * F::ELEM_BYTES), n * F::ELEM_BYTES);
        crate::dequant::dequant_into(F::DTYPE, bytes, &mut buf[..n]);
        let mut s = 0f32;
        for (j, &w) in buf[..n].iter().enumerate() {
            s = w.mul_add(*x.add(tail + j), s);
        }
        return (out, Some(s));
    }
    (out, None)
}

/// `out[r * n + t] = dot(row r, token t)` for all rows and tokens; a tile of rows stays in
/// cache while every token passes.
#[inline(always)]
unsafe fn rows_with(
    dot: impl Fn(*const u8, *const f32) -> f32,
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let rows = out.len() / n;
    let tile = if n == 1 {
        rows.max(1)
    } else {
        crate::x86::batch_tile_rows(rb)
    };
    for r0 in (0..rows).step_by(tile) {
        let r1 = (r0 + tile).min(rows);
        for t in 0..n {
            for r in r0..r1 {
                out[r * n + t] = dot(data.as_ptr().add(r * rb), x.as_ptr().add(t * cols));
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_quant<Q: Quant>(
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    rows_with(
        |p, xp| dot_quant::<Q>(p, cols, xp),
        data,
        rb,
        cols,
        x,
        n,
        out,
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_float<F: Float>(
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    rows_with(
        |p, xp| dot_float::<F>(p, cols, xp),
        data,
        rb,
        cols,
        x,
        n,
        out,
    )
}

/// Dequantizes one row of `cols` elements at `row` into `out` (`cols` f32): the exact
/// values of `dequant`, as the dot kernels compute them.
#[inline(always)]
pub(super) unsafe fn dequant_quant<Q: Quant>(row: *const u8, cols: usize, out: *mut f32) {
    let store = |at: usize, v: &[__m256]| {
        for (j, vj) in v.iter().enumerate() {
            _mm256_storeu_ps(out.add(at + 8 * j), *vj);
        }
    };
    if Q::CHUNKS == 0 {
        let pairs = cols / 64;
        for u in 0..pairs {
            store(
                64 * u,
                &Q::chunk(row.add(2 * u * Q::BLOCK_BYTES), &Q::prepare(row), 0),
            );
        }
        if cols % 64 != 0 {
            let [[a, b], [c, d]] = Q::block32(row.add(2 * pairs * Q::BLOCK_BYTES));
            store(64 * pairs, &[a, b, c, d]);
        }
    } else {
        for b in 0..cols / (64 * Q::CHUNKS) {
            let p = row.add(b * Q::BLOCK_BYTES);
            let s = Q::prepare(p);
            for k in 0..Q::CHUNKS {
                store((b * Q::CHUNKS + k) * 64, &Q::chunk(p, &s, k));
            }
        }
    }
}

/// [`dequant_quant`] for a float type (the last `cols % 8` elements by the scalar path).
#[inline(always)]
pub(super) unsafe fn dequant_float<F: Float>(row: *const u8, cols: usize, out: *mut f32) {
    for h in 0..cols / 8 {
        _mm256_storeu_ps(out.add(8 * h), F::half(row, h));
    }
    let done = cols / 8 * 8;
    if done < cols {
        let bytes = std::slice::from_raw_parts(
            row.add(done * F::ELEM_BYTES),
            (cols - done) * F::ELEM_BYTES,
        );
        let o = std::slice::from_raw_parts_mut(out.add(done), cols - done);
        crate::dequant::dequant_into(F::DTYPE, bytes, o);
    }
}

/// Canonical dot product of two f32 slices of equal length.
///
/// # Safety
/// AVX2/FMA/F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    dot_float::<F32>(a.as_ptr() as *const u8, a.len(), b.as_ptr())
}

/// `out[t]` = canonical dot of `q` with row `t` of `k` (rows `stride` apart, `q.len()`
/// long); 8 rows share one transposed horizontal reduction.
///
/// # Safety
/// AVX2/FMA/F16C available; `k` holds every row read.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_rows(q: &[f32], k: &[f32], stride: usize, out: &mut [f32]) {
    let len = q.len();
    debug_assert!(out.is_empty() || (out.len() - 1) * stride + len <= k.len());
    let (qp, kp) = (q.as_ptr(), k.as_ptr() as *const u8);
    let row = |t: usize| kp.add(4 * t * stride);
    let mut t0 = 0;
    while t0 + 8 <= out.len() {
        let mut u = [_mm256_setzero_ps(); 8];
        let mut tails = [None; 8];
        for i in 0..8 {
            (u[i], tails[i]) = dot_float_folded::<F32>(row(t0 + i), len, qp);
        }
        let mut r = [0f32; 8];
        _mm256_storeu_ps(r.as_mut_ptr(), hsum8(&u));
        for i in 0..8 {
            out[t0 + i] = match tails[i] {
                Some(t) => r[i] + t,
                None => r[i],
            };
        }
        t0 += 8;
    }
    for (t, o) in out.iter_mut().enumerate().skip(t0) {
        *o = dot_float::<F32>(row(t), len, qp);
    }
}

/// Canonical exp of 8 lanes (see [`crate::canon::exp`]).
#[inline(always)]
unsafe fn exp8(x: __m256) -> __m256 {
    let xc = _mm256_max_ps(
        _mm256_set1_ps(ec::LO),
        _mm256_min_ps(_mm256_set1_ps(ec::HI), x),
    );
    let magic = _mm256_set1_ps(ec::MAGIC);
    let t = _mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(ec::LOG2E)), magic);
    let nf = _mm256_sub_ps(t, magic);
    let r = _mm256_fmadd_ps(nf, _mm256_set1_ps(-ec::LN2_HI), xc);
    let r = _mm256_fmadd_ps(nf, _mm256_set1_ps(-ec::LN2_LO), r);
    let mut p = _mm256_set1_ps(ec::P[0]);
    for &c in &ec::P[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    let n = _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(magic));
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(n, _mm256_set1_epi32(126)),
        23,
    ));
    let res = _mm256_mul_ps(_mm256_mul_ps(y, scale), _mm256_set1_ps(2.0));
    let lo = _mm256_cmp_ps(x, _mm256_set1_ps(ec::LO), _CMP_LT_OQ);
    let res = _mm256_blendv_ps(res, _mm256_setzero_ps(), lo);
    let hi = _mm256_cmp_ps(x, _mm256_set1_ps(ec::HI), _CMP_GT_OQ);
    _mm256_blendv_ps(res, _mm256_set1_ps(f32::INFINITY), hi)
}

/// `s[i] = exp(s[i])` (canonical exp).
///
/// # Safety
/// AVX2/FMA/F16C available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn exp_inplace(s: &mut [f32]) {
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_loadu_ps(c.as_ptr())));
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
/// AVX2/FMA/F16C available; equal lengths.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn act_mul<const GELU: bool>(gate: &mut [f32], up: &[f32]) {
    let one = _mm256_set1_ps(1.0);
    let (c0, c1) = (_mm256_set1_ps(gl::C0), _mm256_set1_ps(gl::C1));
    let mut g = gate.chunks_exact_mut(8);
    let mut u = up.chunks_exact(8);
    for (gc, uc) in (&mut g).zip(&mut u) {
        let v = _mm256_loadu_ps(gc.as_ptr());
        let arg = if GELU {
            _mm256_mul_ps(v, _mm256_fmadd_ps(_mm256_mul_ps(v, v), c1, c0))
        } else {
            _mm256_sub_ps(_mm256_setzero_ps(), v)
        };
        let s = _mm256_div_ps(v, _mm256_add_ps(one, exp8(arg)));
        _mm256_storeu_ps(
            gc.as_mut_ptr(),
            _mm256_mul_ps(s, _mm256_loadu_ps(uc.as_ptr())),
        );
    }
    let act = if GELU { Act::GeluTanh } else { Act::Silu };
    crate::canon::act_mul_scalar(act, g.into_remainder(), u.remainder());
}

/// `o[i] = fma(p[t], row_t[i], o[i])` for the `8 K` columns at `o`, all rows in order: `K`
/// independent chains of fmas in flight (8 cover the fma latency of this core).
#[inline(always)]
unsafe fn weighted_block<const K: usize>(p: &[f32], vp: *const f32, stride: usize, o: *mut f32) {
    let mut acc: [__m256; K] = std::array::from_fn(|i| _mm256_loadu_ps(o.add(8 * i)));
    for (t, &pt) in p.iter().enumerate() {
        let pv = _mm256_set1_ps(pt);
        let row = vp.add(t * stride);
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(row.add(8 * i)), *a);
        }
    }
    for (i, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(o.add(8 * i), *a);
    }
}

/// `out[i] = fma(p[t], v[t * stride + i], out[i])` for `t = 0, 1, ..` in order.
///
/// # Safety
/// AVX2/FMA/F16C available; `v` holds every row read.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn weighted_rows(p: &[f32], v: &[f32], stride: usize, out: &mut [f32]) {
    let hd = out.len();
    debug_assert!(p.is_empty() || (p.len() - 1) * stride + hd <= v.len());
    let (vp, op) = (v.as_ptr(), out.as_mut_ptr());
    // 64 columns (8 registers) at a time, all rows; then 32, then 8
    let mut c = 0;
    while c + 64 <= hd {
        weighted_block::<8>(p, vp.add(c), stride, op.add(c));
        c += 64;
    }
    if c + 32 <= hd {
        weighted_block::<4>(p, vp.add(c), stride, op.add(c));
        c += 32;
    }
    while c + 8 <= hd {
        weighted_block::<1>(p, vp.add(c), stride, op.add(c));
        c += 8;
    }
    for (i, o) in out.iter_mut().enumerate().skip(c) {
        for (t, &pt) in p.iter().enumerate() {
            *o = pt.mul_add(*vp.add(t * stride + i), *o);
        }
    }
}
