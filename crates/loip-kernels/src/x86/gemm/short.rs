//! AVX-512 tiles for short batches ([`WIDE_MIN`] ..= [`SHORT_BATCH`] tokens: batched
//! decode of 4 to 8 sequences, small prefill chunks, draft verification) of 32-element-block
//! types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and 256-element super-block types (Q4_K, Q6_K): no
//! f32 panel, and each block dequantized once for all the tokens (the per-row kernels of
//! `avx512` hold at most 4 tokens, so 8 tokens dequantized every block twice; Q5_0 and Q5_1
//! had no per-row kernel there and took the L1 panels of `gemm.rs`).
//!
//! The canonical dot of an output is 64 lanes of state (see [`crate::canon`] and the slots of
//! [`super`]): slot `s` (16 lanes, canonical accumulator `s`) collects the elements
//! `64 j + 16 s .. 64 j + 16 (s + 1)`. A tile of `R` rows × `T` tokens runs one *pass* per
//! slot, with one accumulator register per (row, token): per 64 elements, each row's 16
//! elements of that slot are dequantized once and fused into all `T` tokens.
//!
//! Columns go in segments of at most [`SEG`] (as even as whole blocks allow, see
//! [`seg_len`]): per segment, [`Deq::aux`] unpacks each of the tile's rows into L1, and the
//! tokens' activations of a segment stay in L1 across the passes; between segments a pass's
//! registers rest in the tile's slot state. What a slot then costs beside its `T` fmas:
//! - Q8_0, and the nibble types Q4_0, Q4_1, Q5_0, Q5_1 (unpacked to int8 `q - offset` in
//!   natural order, with the block's scales): 16 bytes sign-extended (`vpmovsxbd`),
//!   converted, and one multiply by the block's scale (or `fma(q, d, m)`), as `dequant`;
//! - Q6_K: the same, from its unpacked int8 `q - 32` and the group's `d · sc`;
//! - Q4_K: the row's 16 bytes broadcast to the four 128-bit lanes, one variable shift (the
//!   nibble of byte `4 b + a` to lane `4 a + b`: a 4 × 4 transposed lane order, see
//!   [`perm`]) and one `vpermps` from the sub-block's 16-entry table of exact values
//!   (`d_k q - m_k`); its tokens are copied once per call, permuted alike, and each output's
//!   state is permuted back before the canonical tree.
//!
//! The tokens are copied 64-byte aligned (no load splits a line). A pass's loop runs a
//! counted number of chunks (a super-block's four chunks each with constant offsets), and a
//! tile's outputs are reduced four at a time (`avx512::reduce4`: the canonical tree on
//! shuffled registers). The figures, and what the unpacked rows replaced (slots unpacked in
//! registers: 4-6 vector ops each, whose constants spilled accumulators), are in the
//! CHANGELOG ("short tiles" under Kernels). On AVX2 the same tiles (8-lane slots) were no
//! faster than the L1 panels of `gemm.rs` (within ±10 %, either way), so AVX2 keeps those.
//!
//! Invariant: each register sees exactly the fmas of its lanes in the canonical order, on the
//! exact values of `dequant`; the slots are reduced with the canonical tree. So every output
//! is bit-identical to the per-row kernels and the portable path.
//!
//! Safety: the `unsafe fn`s require AVX-512F, AVX2, FMA and F16C, checked by
//! [`crate::simd`], and the buffer lengths stated in their docs.

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::tile::{Out, Slot, State, SHORT_BATCH};
use crate::dtype::DType;
use crate::thread_buf::{with_thread_buf, ThreadBuf, KEEP_ALL};
use crate::x86::avx2::f16_scalar;
use std::mem::MaybeUninit;
use std::ptr::read_unaligned;

/// Most columns per segment (a multiple of 64 and of 256): 8 tokens' activations of a
/// segment are 32 KiB of L1, and rows of 640 and 896 columns (Gemma 3's and Qwen2.5's width)
/// take one segment (with at most 576, their passes stored and reloaded their state once a
/// row: 8 tokens of Qwen2.5's Q8_0 head 0.83× the GFLOP/s, Q5_0 0.85-0.93×).
const SEG: usize = 1024;
/// f32 per segment and row of the blocks' data (at most 16 per 32-element block: the
/// unpacked bytes and scales of a nibble type; Q4_K 128 per super-block).
const SEG_AUX: usize = 512;

/// Lane `k` of a permuted register holds element `perm(k)` of its 16 (a 4 × 4 transpose; the
/// permutation is its own inverse): lane `4 a + b` takes the low (or high) nibble of byte
/// `4 b + a` of a block, which a shift of the block's 16 bytes broadcast to the four 128-bit
/// lanes by `8 a` (or `8 a + 4`) brings to its low 4 bits. The tokens are permuted alike once
/// per call, and each output's state back once before the canonical tree.
#[inline(always)]
unsafe fn perm() -> __m512i {
    _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
}

/// A block type (blocks of 32 elements, or 256-element super-blocks) whose slots dequantize
/// in registers of type `V`.
trait Deq<V> {
    /// elements per block (32 or 256)
    const BLOCK: usize = 32;
    /// bytes per block
    const BLOCK_BYTES: usize;
    /// f32 of per-block data (the scales, or a 16-entry table of exact values)
    const AUX: usize;
    /// whether [`Deq::slot`] gives its lanes in the order of [`perm`]
    const PERMUTED: bool;
    /// columns per segment: a multiple of 64 and of the block, with `SEG / BLOCK * AUX` at
    /// most [`SEG_AUX`]
    const SEG: usize = SEG;
    /// The per-block data of `blocks` (at most `SEG / BLOCK`) consecutive blocks at `p` to
    /// `out[.. blocks * AUX]` (64-byte aligned).
    unsafe fn aux(p: *const u8, blocks: usize, out: *mut f32);
    /// Elements `o .. o + WIDTH` (`o` a multiple of the width, below `BLOCK`) of the block
    /// at `p`, whose data [`Deq::aux`] wrote at `a`: exactly the values of `dequant` (in the
    /// order of [`perm`] if `PERMUTED`).
    unsafe fn slot(p: *const u8, a: *const f32, o: usize) -> V;
}

struct Q40;
struct Q41;
struct Q50;
struct Q51;
struct Q80;

/// 0.0, 1.0, .., 15.0: a nibble's value.
#[inline(always)]
unsafe fn iota() -> __m512 {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    )
}

/// Table indices of the 16 nibbles of bytes `qs[0..16]`, low (`o < 16`) or high, in the
/// order of [`perm`]: vpermps reads only the low 4 bits of an index.
#[inline(always)]
unsafe fn nibbles16(qs: *const u8, o: usize) -> __m512i {
    let q = _mm512_broadcast_i32x4(_mm_loadu_si128(qs as *const __m128i));
    let h = if o < 16 { 0 } else { 4 };
    let sh = _mm512_setr_epi32(
        h,
        h,
        h,
        h,
        8 + h,
        8 + h,
        8 + h,
        8 + h,
        16 + h,
        16 + h,
        16 + h,
        16 + h,
        24 + h,
        24 + h,
        24 + h,
        24 + h,
    );
    _mm512_srlv_epi32(q, sh)
}

/// The scales of `blocks` consecutive blocks at `p` (`S` f16 words at the start of each
/// block of `B` bytes) as f32 to `out` (`S` per block): eight blocks' words are gathered and
/// converted at once.
#[inline(always)]
unsafe fn scales<const S: usize, const B: usize>(p: *const u8, blocks: usize, out: *mut f32) {
    let at = |b: usize| p.add(b * B);
    let mut b = 0;
    while b + 8 <= blocks {
        let o = out.add(b * S);
        if S == 2 {
            let w = |i: usize| read_unaligned(at(b + i) as *const i32);
            let v = _mm256_setr_epi32(w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7));
            _mm256_storeu_ps(o, _mm256_cvtph_ps(_mm256_castsi256_si128(v)));
            _mm256_storeu_ps(o.add(8), _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1)));
        } else {
            let h = |i: usize| read_unaligned(at(b + i) as *const i16);
            let v = _mm_setr_epi16(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7));
            _mm256_storeu_ps(o, _mm256_cvtph_ps(v));
        }
        b += 8;
    }
    while b < blocks {
        for i in 0..S {
            *out.add(b * S + i) = f16_scalar(at(b).add(2 * i));
        }
        b += 1;
    }
}

/// `impl Deq` for a 32-element nibble type (optionally with 32 bits `qh` of fifth bits),
/// whose slots are Q8_0's: per segment, [`Deq::aux`] writes each block's quants `q - sub`
/// as 32 int8 in natural order, then its scales (16 f32 a block: 32 bytes, `d`, `m` or
/// padding); a slot is 16 bytes sign-extended, converted and `value(q, scales)`, exactly as
/// `dequant`. Arguments: block bytes, whether it has `qh` (at byte 2 × scales), scales (f16
/// words at the block's start), `sub`, the value.
///
/// Against the earlier slots in registers (the nibbles of [`nibbles16`], `qh`'s bit rotated
/// in, one `vpermt2ps` from a 32-entry table of exact values built per block; 4 vector ops
/// and a table load beside the fmas): Q5_0 at 8 tokens 1.2× the GFLOP/s.
macro_rules! byte_type {
    ($t:ident, $bytes:literal, $qh:literal, $s:literal, $sub:literal,
     |$q:ident, $a:ident| $value:expr) => {
        impl Deq<__m512> for $t {
            const BLOCK_BYTES: usize = $bytes;
            const AUX: usize = 16;
            const PERMUTED: bool = false;
            #[inline(always)]
            unsafe fn aux(p: *const u8, blocks: usize, out: *mut f32) {
                // byte i of a lane (element i, or 16 + i) takes byte i / 8 of qh (or 2 + i / 8)
                let spread = _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                    3, 3, 3, 3, 3, 3,
                );
                let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
                let (m4, sub) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(-$sub));
                let hi = _mm256_set1_epi8(16 - $sub);
                let qs_at = 2 * $s + if $qh { 4 } else { 0 };
                for b in 0..blocks {
                    let q = p.add(b * $bytes);
                    let o = out.add(16 * b);
                    // elements 0..16 the low nibbles, 16..32 the high ones
                    let qs = _mm_loadu_si128(q.add(qs_at) as *const __m128i);
                    let nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), m4);
                    // q - sub = the nibble, plus 16 where the element's fifth bit is set, less sub
                    let add = if $qh {
                        // bit e of qh is element e's fifth bit
                        let qh = _mm256_set1_epi32(read_unaligned(q.add(2 * $s) as *const i32));
                        let h = _mm256_and_si256(_mm256_shuffle_epi8(qh, spread), bit);
                        _mm256_blendv_epi8(sub, hi, _mm256_cmpeq_epi8(h, bit))
                    } else {
                        sub
                    };
                    _mm256_store_si256(o as *mut __m256i, _mm256_add_epi8(nib, add));
                    for i in 0..$s {
                        *o.add(8 + i) = f16_scalar(q.add(2 * i));
                    }
                }
            }
            #[inline(always)]
            unsafe fn slot(_p: *const u8, $a: *const f32, o: usize) -> __m512 {
                let q = ($a as *const u8).add(o) as *const __m128i;
                let $q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(q)));
                let $a = $a.add(8);
                $value
            }
        }
    };
}

// (q - 8) * d, as `dequant` computes it (q - 8 exact)
byte_type!(Q40, 18, false, 1, 8, |q, a| _mm512_mul_ps(
    q,
    _mm512_set1_ps(*a)
));
// q * d is exact, so fma(q, d, m) rounds once, like ggml's q * d + m
byte_type!(Q41, 20, false, 2, 0, |q, a| _mm512_fmadd_ps(
    q,
    _mm512_set1_ps(*a),
    _mm512_set1_ps(*a.add(1))
));
// (q - 16) * d, as `dequant` computes it
byte_type!(Q50, 22, true, 1, 16, |q, a| _mm512_mul_ps(
    q,
    _mm512_set1_ps(*a)
));
// as Q4_1: fma(q, d, m) rounds once, like `dequant`'s q * d + m
byte_type!(Q51, 24, true, 2, 0, |q, a| _mm512_fmadd_ps(
    q,
    _mm512_set1_ps(*a),
    _mm512_set1_ps(*a.add(1))
));

impl Deq<__m512> for Q80 {
    const BLOCK_BYTES: usize = 34;
    const AUX: usize = 1;
    const PERMUTED: bool = false;
    #[inline(always)]
    unsafe fn aux(p: *const u8, blocks: usize, out: *mut f32) {
        scales::<1, 34>(p, blocks, out);
    }
    #[inline(always)]
    unsafe fn slot(p: *const u8, a: *const f32, o: usize) -> __m512 {
        let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2 + o) as *const __m128i));
        _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(*a))
    }
}

/// Q6_K (256-element super-blocks of 210 bytes: `ql` 128, `qh` 64, 16 int8 scales, f16
/// `d`): element `e` is `(d * sc[e / 16]) * (q - 32)`, its 6-bit `q` the nibble of `ql` and
/// two bits of `qh` (see `dequant`). Per segment, [`Deq::aux`] writes each block's 16 group
/// scales `d * sc` and its 256 `q - 32` as int8 in natural order (byte ops, 32 elements
/// each); a slot is then one group: 16 bytes sign-extended, converted and multiplied by the
/// group's scale, as `dequant` does (Q8_0's slot). Unpacking in the loop instead (16 lanes a
/// slot: the nibbles of [`nibbles16`], two bits of `qh` rotated into bits 4-5 and merged,
/// masked, `q - 32`) took 6 vector ops beside the multiply, and its constants spilled
/// accumulators.
struct Q6K;

impl Deq<__m512> for Q6K {
    const BLOCK: usize = 256;
    const BLOCK_BYTES: usize = 210;
    // 16 scales, then 256 int8 (64 f32)
    const AUX: usize = 80;
    const PERMUTED: bool = false;
    #[inline(always)]
    unsafe fn aux(p: *const u8, blocks: usize, out: *mut f32) {
        let (m4, m2, k32) = (
            _mm256_set1_epi8(0x0F),
            _mm256_set1_epi8(0x30),
            _mm256_set1_epi8(32),
        );
        for b in 0..blocks {
            let q = p.add(b * 210);
            let o = out.add(80 * b);
            let d = _mm512_set1_ps(f16_scalar(q.add(208)));
            let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(192) as *const __m128i));
            // d * sc, as `dequant` computes each group's scale
            _mm512_store_ps(o, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
            let qb = o.add(16) as *mut __m256i;
            for h in 0..2 {
                let ld = |k: usize| _mm256_loadu_si256(q.add(k) as *const __m256i);
                let (ql0, ql1, qh) = (ld(64 * h), ld(64 * h + 32), ld(128 + 32 * h));
                // elements 128 h + 32 j + l: the low (j < 2) or high nibble of ql[32 (j % 2)
                // + l], bits 2 j, 2 j + 1 of qh[l] above (16-bit shifts: the bits that cross
                // into a byte are masked off)
                let v = |nib: __m256i, hi: __m256i| {
                    let q6 = _mm256_or_si256(_mm256_and_si256(nib, m4), _mm256_and_si256(hi, m2));
                    _mm256_sub_epi8(q6, k32)
                };
                _mm256_store_si256(qb.add(4 * h), v(ql0, _mm256_slli_epi16(qh, 4)));
                _mm256_store_si256(qb.add(4 * h + 1), v(ql1, _mm256_slli_epi16(qh, 2)));
                _mm256_store_si256(qb.add(4 * h + 2), v(_mm256_srli_epi16(ql0, 4), qh));
                let hi = _mm256_srli_epi16(qh, 2);
                _mm256_store_si256(qb.add(4 * h + 3), v(_mm256_srli_epi16(ql1, 4), hi));
            }
        }
    }
    #[inline(always)]
    unsafe fn slot(_p: *const u8, a: *const f32, o: usize) -> __m512 {
        let q = (a.add(16) as *const u8).add(o) as *const __m128i;
        let q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(q)));
        _mm512_mul_ps(_mm512_set1_ps(*a.add(o / 16)), q)
    }
}

/// Q4_K (256-element super-blocks of 144 bytes: f16 `d` and `dmin`, 12 bytes of 6-bit
/// scales and mins, 128 of nibbles): sub-block `k` (32 elements) is `d_k * q - m_k`, with
/// `d_k = d * sc_k` and `m_k = dmin * min_k` (see `dequant`). As Q4_0: one 16-entry table of
/// exact values per sub-block, and a slot is one `vpermps` of its nibbles.
struct Q4K;

impl Deq<__m512> for Q4K {
    const BLOCK: usize = 256;
    const BLOCK_BYTES: usize = 144;
    const AUX: usize = 128;
    const PERMUTED: bool = true;
    #[inline(always)]
    unsafe fn aux(p: *const u8, blocks: usize, out: *mut f32) {
        for b in 0..blocks {
            let q = p.add(b * 144);
            let (d, dmin) = (f16_scalar(q), f16_scalar(q.add(2)));
            // the 8 scales and 8 mins at once: d * sc_k and dmin * min_k, as `dequant`
            let [sc, m] = crate::scales::unpack_scales_k4(q.add(4));
            let sm = _mm_setr_epi32(sc[0] as i32, sc[1] as i32, m[0] as i32, m[1] as i32);
            let dm = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d), _mm512_set1_ps(dmin));
            let mut km = [0f32; 16];
            _mm512_storeu_ps(
                km.as_mut_ptr(),
                _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm))),
            );
            for k in 0..8 {
                // d_k * q - m_k, rounded twice as `dequant` computes it
                let v = _mm512_sub_ps(
                    _mm512_mul_ps(iota(), _mm512_set1_ps(km[k])),
                    _mm512_set1_ps(km[8 + k]),
                );
                _mm512_store_ps(out.add(128 * b + 16 * k), v);
            }
        }
    }
    #[inline(always)]
    unsafe fn slot(p: *const u8, a: *const f32, o: usize) -> __m512 {
        // chunk c of 64 elements: 32 bytes, low nibbles its first 32 elements, high the rest
        let (c, s) = (o / 64, o % 64);
        let nib = nibbles16(p.add(16 + 32 * c + s % 32), s / 32 * 16);
        _mm512_permutexvar_ps(nib, _mm512_load_ps(a.add(16 * (o / 32))))
    }
}

/// Columns per segment of rows of `cols` columns: the fewest segments of at most `max`
/// columns (a multiple of `unit`), as even as whole `unit`s allow (rows of 640 columns took
/// a segment of 576 and one of 64, whose pass stored and reloaded every register's state for
/// one chunk).
fn seg_len(cols: usize, max: usize, unit: usize) -> usize {
    let units = cols.div_ceil(unit);
    let segs = units.div_ceil(max / unit);
    units.div_ceil(segs) * unit
}

/// The per-block data of a segment for one row, 64-byte aligned for the tables' loads.
#[repr(C, align(64))]
struct Aux([MaybeUninit<f32>; SEG_AUX]);

/// Pass `S` of a tile over the columns `k0 .. k1` of one segment (`k0` a multiple of
/// [`SEG`]): slot `S` of rows `w` × tokens `x`, from `st` (or `+0.0` at `k0 == 0`) back into
/// `st`. `sc[i]` holds row `i`'s per-block data of the segment's blocks ([`Deq::aux`]).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // one index runs over three arrays
unsafe fn pass<V: Slot, Q: Deq<V>, const R: usize, const T: usize, const S: usize>(
    w: &[*const u8; R],
    x: &[*const f32; T],
    k0: usize,
    k1: usize,
    sc: &[[f32; SEG_AUX]; R],
    st: &mut State<V, R, T>,
) {
    if S >= V::SLOTS {
        return;
    }
    let mut acc = [[V::zero(); T]; R];
    if k0 > 0 {
        for i in 0..R {
            for t in 0..T {
                // written by this pass in the segment before (k0 > 0)
                acc[i][t] = st[i][t][S].assume_init();
            }
        }
    }
    // a step is one block of 256 (four 64-element chunks) or two blocks of 32 (one chunk);
    // this slot's elements of chunk `u` of a step lie in one block, at offset `o`; the steps
    // of the segment whose slot is whole (`k1 - k0` is a multiple of 32, or of 256)
    let step = Q::BLOCK.max(64);
    let first = V::WIDTH * S;
    let steps = (k1 - k0 + step - first - V::WIDTH) / step;
    let wb: [*const u8; R] = std::array::from_fn(|i| w[i].add(k0 / Q::BLOCK * Q::BLOCK_BYTES));
    let sb: [*const f32; R] = std::array::from_fn(|i| sc[i].as_ptr());
    let xb: [*const f32; T] = std::array::from_fn(|t| x[t].add(k0 + first));
    for c in 0..steps {
        // each chunk's offsets are constants (a loop over `u` was left rolled, its shifts
        // and rotations built at run time)
        chunk::<V, Q, R, T, S, 0>(&wb, &sb, &xb, c, &mut acc);
        if step == 256 {
            chunk::<V, Q, R, T, S, 1>(&wb, &sb, &xb, c, &mut acc);
            chunk::<V, Q, R, T, S, 2>(&wb, &sb, &xb, c, &mut acc);
            chunk::<V, Q, R, T, S, 3>(&wb, &sb, &xb, c, &mut acc);
        }
    }
    for i in 0..R {
        for t in 0..T {
            st[i][t][S].write(acc[i][t]);
        }
    }
}

/// Chunk `U` (64 elements) of step `c` of pass `S` (see [`pass`]): slot `S` of the rows at
/// `wb` (their per-block data at `sb`) fused into the tokens at `xb`, onto `acc`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // one index runs over three arrays
unsafe fn chunk<
    V: Slot,
    Q: Deq<V>,
    const R: usize,
    const T: usize,
    const S: usize,
    const U: usize,
>(
    wb: &[*const u8; R],
    sb: &[*const f32; R],
    xb: &[*const f32; T],
    c: usize,
    acc: &mut [[V; T]; R],
) {
    let step = Q::BLOCK.max(64);
    let e = 64 * U + V::WIDTH * S;
    let (blk, o) = (c * step / Q::BLOCK + e / Q::BLOCK, e % Q::BLOCK);
    // a loop, not `array::from_fn`: the 5-bit types' closure was too large to inline, and
    // outside it the intrinsics were calls
    let mut wv = [V::zero(); R];
    for i in 0..R {
        wv[i] = Q::slot(wb[i].add(blk * Q::BLOCK_BYTES), sb[i].add(blk * Q::AUX), o);
    }
    for t in 0..T {
        let xv = V::load(xb[t].add(step * c + 64 * U));
        for i in 0..R {
            acc[i][t] = V::fma(wv[i], xv, acc[i][t]);
        }
    }
}

/// One tile: rows `w` (`cols` elements each) × tokens `x`, every slot of `st` written.
#[inline(always)]
unsafe fn tile<V: Slot, Q: Deq<V>, const R: usize, const T: usize>(
    w: &[*const u8; R],
    x: &[*const f32; T],
    cols: usize,
    seg: usize,
    st: &mut State<V, R, T>,
) {
    let mut sc: [Aux; R] = std::array::from_fn(|_| Aux([MaybeUninit::uninit(); SEG_AUX]));
    let mut k0 = 0;
    while k0 < cols {
        let k1 = (k0 + seg).min(cols);
        for (i, sci) in sc.iter_mut().enumerate() {
            let p = w[i].add(k0 / Q::BLOCK * Q::BLOCK_BYTES);
            Q::aux(p, (k1 - k0) / Q::BLOCK, sci.0.as_mut_ptr() as *mut f32);
        }
        // the data of every block of the segment is written above
        let sc = &*(&sc as *const _ as *const [[f32; SEG_AUX]; R]);
        pass::<V, Q, R, T, 0>(w, x, k0, k1, sc, st);
        pass::<V, Q, R, T, 1>(w, x, k0, k1, sc, st);
        pass::<V, Q, R, T, 2>(w, x, k0, k1, sc, st);
        pass::<V, Q, R, T, 3>(w, x, k0, k1, sc, st);
        pass::<V, Q, R, T, 4>(w, x, k0, k1, sc, st);
        pass::<V, Q, R, T, 5>(w, x, k0, k1, sc, st);
        pass::<V, Q, R, T, 6>(w, x, k0, k1, sc, st);
        pass::<V, Q, R, T, 7>(w, x, k0, k1, sc, st);
        k0 = k1;
    }
}

/// Every row of `data` (`rows` rows of `cols` elements of `Q`) × the `T` tokens of `x`, `R`
/// rows at a time (the last tile repeats its last row and drops the copies).
#[inline(always)]
unsafe fn run<Q: Deq<__m512>, const R: usize, const T: usize>(
    data: &[u8],
    cols: usize,
    x: &[f32],
    rows: usize,
    out: Out,
) {
    let rb = cols / Q::BLOCK * Q::BLOCK_BYTES;
    const {
        assert!(Q::SEG / Q::BLOCK * Q::AUX <= SEG_AUX && Q::SEG % Q::BLOCK == 0 && Q::SEG % 64 == 0)
    };
    let seg = seg_len(cols, Q::SEG, Q::BLOCK.max(64));
    let xs: [*const f32; T] = std::array::from_fn(|t| x.as_ptr().add(t * cols));
    let mut r0 = 0;
    while r0 < rows {
        let ws: [*const u8; R] =
            std::array::from_fn(|i| data.as_ptr().add((r0 + i).min(rows - 1) * rb));
        // the next tile's rows, while this one computes (a hint; never faults)
        crate::x86::prefetch(data.as_ptr().wrapping_add((r0 + R) * rb), R * rb);
        let mut st: State<__m512, R, T> = [[[MaybeUninit::uninit(); 8]; T]; R];
        tile::<__m512, Q, R, T>(&ws, &xs, cols, seg, &mut st);
        let vals = reduce_tile(&st, Q::PERMUTED);
        for (i, vi) in vals.iter().enumerate().take(rows - r0) {
            for (t, &v) in vi.iter().enumerate() {
                out.put(r0 + i, t, v);
            }
        }
        r0 += R;
    }
}

/// The canonical reduction of every output of a tile (see [`crate::canon::reduce`]): the
/// four accumulators combined as `(a0 + a2) + (a1 + a3)`, then the lane tree of four outputs
/// at a time ([`crate::x86::avx512::reduce4`], the same pairs in the same order); lanes in
/// the order of [`perm`] (`permuted`) are put back in between.
///
/// # Safety
/// Slots `0 .. 4` of every output of `st` are written.
#[inline(always)]
unsafe fn reduce_tile<const R: usize, const T: usize>(
    st: &State<__m512, R, T>,
    permuted: bool,
) -> [[f32; T]; R] {
    let v = |k: usize| {
        let s = &st[k / T][k % T];
        let a: [__m512; 4] = std::array::from_fn(|j| s[j].assume_init());
        let v = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
        if permuted {
            _mm512_permutexvar_ps(perm(), v)
        } else {
            v
        }
    };
    let mut out = [[0f32; T]; R];
    let total = R * T;
    let mut k = 0;
    while k < total {
        let m = (total - k).min(4);
        // a short last group repeats its last output (the copies are dropped)
        let g = crate::x86::avx512::reduce4(std::array::from_fn(|j| v(k + j.min(m - 1))));
        let mut s = [0f32; 4];
        _mm_storeu_ps(s.as_mut_ptr(), g);
        for (j, &sj) in s.iter().enumerate().take(m) {
            out[(k + j) / T][(k + j) % T] = sj;
        }
        k += 4;
    }
    out
}

/// [`run`] with the tile shape of `n` tokens: 32 registers hold R × T accumulators, R
/// weights, one token and the table's constants.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn short_avx512<Q: Deq<__m512>>(
    data: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    rows: usize,
    out: Out,
) {
    match n {
        4 => run::<Q, 4, 4>(data, cols, x, rows, out),
        5 => run::<Q, 4, 5>(data, cols, x, rows, out),
        6 => run::<Q, 3, 6>(data, cols, x, rows, out),
        7 => run::<Q, 3, 7>(data, cols, x, rows, out),
        _ => run::<Q, 3, 8>(data, cols, x, rows, out),
    }
}

/// Shortest batch taken here: below, the per-row kernels of `avx512` (1 row × up to 4 tokens,
/// weights in registers too) dequantize each block once for both of its groups, and were as
/// fast or faster (n = 2: 76 µs per-row against 90 µs here, Q4_1 576×1536 in L2, one thread;
/// n = 4: 0.8-0.9× the per-row time here).
const WIDE_MIN: usize = 4;

/// Whether [`rows`] takes `n` tokens of `dtype` (AVX-512 only).
pub(crate) fn handles(dtype: DType, n: usize) -> bool {
    (WIDE_MIN..=SHORT_BATCH).contains(&n)
        && matches!(
            dtype,
            DType::Q4_0
                | DType::Q4_1
                | DType::Q5_0
                | DType::Q5_1
                | DType::Q8_0
                | DType::Q4K
                | DType::Q6K
        )
}

/// Output (row `r`, token `t`) of `out` = canonical dot of row `r` of `data` (`rows` rows)
/// with row `t` of `x` (`n × cols`). Call only where [`handles`] says so.
///
/// # Safety
/// AVX-512F/AVX2/FMA/F16C available; `data.len() == rows * row_bytes(cols)`,
/// `x.len() == n * cols`, `cols` a positive multiple of 32, `rows > 0`.
pub(super) unsafe fn rows(
    dtype: DType,
    data: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    rows: usize,
    out: Out,
) {
    debug_assert!(
        handles(dtype, n) && cols > 0 && cols % dtype.block_elems() == 0 && x.len() == n * cols
    );
    // the tokens on a 64-byte line: no load of a token splits a line
    with_thread_buf(&XP, x.len(), KEEP_ALL, |xp| {
        match dtype {
            DType::Q4K => permute(x, xp),
            _ => xp.copy_from_slice(x),
        }
        match dtype {
            DType::Q4_0 => short_avx512::<Q40>(data, cols, xp, n, rows, out),
            DType::Q4_1 => short_avx512::<Q41>(data, cols, xp, n, rows, out),
            DType::Q5_0 => short_avx512::<Q50>(data, cols, xp, n, rows, out),
            DType::Q5_1 => short_avx512::<Q51>(data, cols, xp, n, rows, out),
            DType::Q6K => short_avx512::<Q6K>(data, cols, xp, n, rows, out),
            DType::Q4K => short_avx512::<Q4K>(data, cols, xp, n, rows, out),
            _ => short_avx512::<Q80>(data, cols, xp, n, rows, out),
        }
    })
}

thread_local! {
    /// The permuted tokens of this thread (f32), reused across calls.
    static XP: ThreadBuf = const { ThreadBuf::new(Vec::new()) };
}

/// `xp` = `x` with every 16 elements in the order of [`perm`] (`x.len()` a multiple of 16,
/// `xp.len() == x.len()`).
#[target_feature(enable = "avx512f")]
unsafe fn permute(x: &[f32], xp: &mut [f32]) {
    for (o, i) in xp.chunks_exact_mut(16).zip(x.chunks_exact(16)) {
        _mm512_storeu_ps(
            o.as_mut_ptr(),
            _mm512_permutexvar_ps(perm(), _mm512_loadu_ps(i.as_ptr())),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Random blocks of `dtype` with finite f16 scales (`d`, and `m` where the type has one).
    fn matrix(dtype: DType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
        let mut data = vec![0u8; rows * dtype.row_bytes(cols).expect("whole blocks")];
        rng.fill(&mut data[..]);
        for b in data.chunks_exact_mut(dtype.block_bytes()) {
            let mut put = |at: usize| {
                let v = half::f16::from_f32(rng.gen_range(-0.05f32..0.05));
                b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            };
            match dtype {
                DType::Q4_1 | DType::Q5_1 | DType::Q4K => {
                    put(0);
                    put(2)
                }
                DType::Q6K => put(208),
                _ => put(0),
            }
        }
        data
    }

    #[test]
    fn segments_are_even_and_at_most_the_longest() {
        // Gemma 3's and Qwen2.5's widths take one segment; 4864 = 19 super-blocks take 5
        assert_eq!(seg_len(640, 1024, 64), 640);
        assert_eq!(seg_len(896, 1024, 64), 896);
        assert_eq!(seg_len(1536, 1024, 64), 768);
        assert_eq!(seg_len(4864, 1024, 256), 1024);
        assert_eq!(seg_len(2304, 1024, 256), 768);
        assert_eq!(seg_len(160, 1024, 64), 192);
    }

    /// Every short batch (2 ..= SHORT_BATCH tokens: the per-row kernels below `WIDE_MIN`, the
    /// tiles above) of every type here, on rows of one segment, of even segments and of a
    /// short last one (the models' widths among them), against the scalar canonical dots.
    #[test]
    fn short_tiles_are_the_canonical_dots() {
        if !crate::simd::supported(crate::simd::Level::Avx512) {
            return;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(27);
        let types = [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q8_0,
            DType::Q4K,
            DType::Q6K,
        ];
        for dtype in types {
            let widths = [96, 160, 640, 896, 1024, 1536, 2304, 3072, 4864];
            for cols in widths.into_iter().filter(|c| c % dtype.block_elems() == 0) {
                let rows = 7;
                let data = matrix(dtype, rows, cols, &mut rng);
                let rb = dtype.row_bytes(cols).expect("blocks");
                for n in 2..=SHORT_BATCH {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-2.0..2.0)).collect();
                    let mut want = vec![0f32; rows * n];
                    for (r, o) in want.chunks_exact_mut(n).enumerate() {
                        let row = &data[r * rb..(r + 1) * rb];
                        crate::dequant::row_dots_scalar(dtype, row, cols, &x, o);
                    }
                    let mut got = vec![f32::NAN; rows * n];
                    // SAFETY: AVX-512 is supported; lengths as documented
                    unsafe {
                        let out = Out::row_major(&mut got, n);
                        super::super::rows(true, dtype, &data, cols, &x, n, rows, out, None)
                    };
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{dtype} {rows}x{cols} n={n}");
                }
            }
        }
    }
}
