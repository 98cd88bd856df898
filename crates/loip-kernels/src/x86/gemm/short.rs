//! AVX-512 tiles for short batches ([`WIDE_MIN`] ..= [`SHORT_BATCH`] tokens: batched
//! decode of 4 to 8 sequences, small prefill chunks, draft verification) of 32-element-block
//! types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and 256-element super-block types (Q4_K, Q6_K), with
//! the weights dequantized in registers: no
//! panel, no stores, and each block dequantized once for all the tokens (the per-row kernels
//! of `avx512` hold at most 4 tokens, so 8 tokens dequantized every block twice; Q5_0 and
//! Q5_1 had no per-row kernel there and took the L1 panels of `gemm.rs`).
//!
//! The canonical dot of an output is 64 lanes of state (see [`crate::canon`] and the slots of
//! [`super`]): slot `s` (16 lanes, canonical accumulator `s`) collects the elements
//! `64 j + 16 s .. 64 j + 16 (s + 1)`. A tile of `R` rows × `T` tokens runs one *pass* per
//! slot, with one accumulator register per (row, token): per 64 elements, each row's 16
//! elements of that slot are dequantized once and fused into all `T` tokens. Q4: the row's
//! 16 bytes broadcast to the four 128-bit lanes, one variable shift (the nibble of byte
//! `4 b + a` to lane `4 a + b`: a 4 × 4 transposed lane order, see [`perm`]) and one
//! `vpermps` from the block's 16-entry table of exact values, built in L1 once per segment;
//! the tokens are copied once per call, permuted alike and 64-byte aligned (no load splits a
//! line), and each output's state is permuted back before the canonical tree. Q5_0 / Q5_1:
//! the same nibbles, the element's bit of `qh` rotated into bit 4 (`vprorvd`, merged by
//! `vpternlogd`), and one `vpermt2ps` from the block's 32-entry table. Q8_0: a
//! widening, a conversion and one multiply. Columns go in segments of [`SEG`]: a segment's
//! per-block data is built once for the tile's rows, and the tokens' activations of a
//! segment stay in L1 across the passes. Between segments a pass's
//! registers rest in the tile's slot state. A pass's loop runs a counted number of chunks
//! (no register rotation across its back edge), and a tile's outputs are reduced four at a
//! time (`avx512::reduce4`: the canonical tree on shuffled registers).
//!
//! Tables and shift against the earlier widening per pass (`vpmovzxbd`, plus a shift and a
//! mask for the high nibbles, and the table's fma per pass): 3 instead of 4-5 vector ops
//! per row and chunk beside the 24 fmas of a 3 × 8 tile; with the aligned tokens and 576-
//! column segments, 8 tokens of Q4_1 576×1536 take 152 µs instead of 174 (one thread, in
//! L2, `matvec_bench --min`: minimum of single calls, alternating binaries), 1536×576 153
//! instead of 167; Q8_0 150 / 159 instead of 175 / 166.
//!
//! Q5_0 at 8 tokens (one thread, `prefill_bench --tokens 8`, alternating binaries, Zen 5):
//! 113-115 GFLOP/s on Qwen2.5's 896-column matrices against 83-85 with the L1 panels of
//! `gemm.rs`, 97-100 against 80 on Gemma 3's 640-column ones.
//!
//! Super-blocks: a pass steps over one block (four chunks, each with constant offsets) in
//! segments of 512 columns. Q4_K: one 16-entry table per 32-element sub-block (`d_k q - m_k`,
//! exact), a slot as Q4_0's. Q6_K: a slot is one 16-element group (one scale): nibbles as
//! Q4_0's, two bits of `qh` rotated into bits 4-5 and merged, `q - 32` converted and
//! multiplied by the group's `d · sc`. At 8 tokens (one thread, `prefill_bench --tokens 8`,
//! alternating binaries, Zen 5) against the per-row kernels: Q6_K 896×4864 100-110 GFLOP/s
//! against 73-79, Q4_K 896×4864 124-130 against 74-80 and 640×1024 127-134 against 122.
//!
//! Measured (SmolLM2 down projection 576×1536, one thread, in L2, alternating trials): 8
//! tokens of Q4_1 in 0.69× the time of the per-row kernels, Q8_0 0.87×. On AVX2 the same
//! tiles (8-lane slots: widen, convert and one fma per slot) were no faster than the L1
//! panels of `gemm.rs` (within ±10 %, either way), so AVX2 keeps those.
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
use crate::x86::avx2::f16_scalar;
use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::ptr::read_unaligned;

/// Columns per segment (a multiple of 64): 8 tokens' activations of a segment are 18 KiB;
/// rows of 576 columns (SmolLM2's width) take one segment (with 512, a second one of 64
/// columns stored and reloaded every pass's state for one chunk: 1536×576 took 1.09× the
/// time).
const SEG: usize = 576;
/// f32 per segment and row of the blocks' data (at most 32 per 32-element block: the two
/// 16-entry tables of a 5-bit type).
const SEG_AUX: usize = 32 * SEG / 32;

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

/// The `E`-entry tables (16 or 32) of `blocks` nibble blocks at `p` (`S` scales each) to
/// `out` (`E` f32 per block): entry `q` is `value(q, scales)`, exact.
#[inline(always)]
unsafe fn tables<const S: usize, const B: usize, const E: usize>(
    p: *const u8,
    blocks: usize,
    out: *mut f32,
    value: impl Fn(__m512, *const f32) -> __m512,
) {
    let mut s = [0f32; 2 * SEG / 32];
    scales::<S, B>(p, blocks, s.as_mut_ptr());
    for b in 0..blocks {
        let sb = s.as_ptr().add(S * b);
        for h in 0..E / 16 {
            let q = _mm512_add_ps(iota(), _mm512_set1_ps(16.0 * h as f32));
            _mm512_store_ps(out.add(E * b + 16 * h), value(q, sb));
        }
    }
}

/// Elements `o .. o + 16` of a 5-bit block (`qh` the 32 high bits at `qh`, the nibbles at
/// `qs`), in the order of [`perm`], from its 32-entry table at `a`: the nibble of
/// [`nibbles16`] in bits 0-3 and the element's bit of `qh`, rotated to bit 4, select the
/// entry (`vpermt2ps` reads the low 5 bits of an index).
#[inline(always)]
unsafe fn slot5(qh: *const u8, qs: *const u8, a: *const f32, o: usize) -> __m512 {
    // lane 4 a + b holds element e = o + 4 b + a: rotate bit e of qh to bit 4
    let r = |a: i32, b: i32| (o as i32 + 4 * b + a - 4) & 31;
    let rot = _mm512_setr_epi32(
        r(0, 0),
        r(0, 1),
        r(0, 2),
        r(0, 3),
        r(1, 0),
        r(1, 1),
        r(1, 2),
        r(1, 3),
        r(2, 0),
        r(2, 1),
        r(2, 2),
        r(2, 3),
        r(3, 0),
        r(3, 1),
        r(3, 2),
        r(3, 3),
    );
    let h = _mm512_rorv_epi32(_mm512_set1_epi32(read_unaligned(qh as *const i32)), rot);
    // bits 0-3 from the nibbles, the others from h: (mask ? nibbles : h)
    let idx = _mm512_ternarylogic_epi32::<0xE4>(nibbles16(qs, o), h, _mm512_set1_epi32(0x0F));
    _mm512_permutex2var_ps(_mm512_load_ps(a), idx, _mm512_load_ps(a.add(16)))
}

/// `impl Deq` for a nibble type whose slots come from a table of exact values, in the order
/// of [`perm`]: its block bytes, table length, scales per block (f16 words at the block's
/// start), the entry `q`'s value, and the slot's selection from the table.
macro_rules! nibble_type {
    ($t:ident, $bytes:literal, $aux:literal, $s:literal,
     |$q:ident, $sc:ident| $value:expr, |$p:ident, $a:ident, $o:ident| $slot:expr) => {
        impl Deq<__m512> for $t {
            const BLOCK_BYTES: usize = $bytes;
            const AUX: usize = $aux;
            const PERMUTED: bool = true;
            #[inline(always)]
            unsafe fn aux(p: *const u8, blocks: usize, out: *mut f32) {
                tables::<$s, $bytes, $aux>(p, blocks, out, |$q, $sc| $value);
            }
            #[inline(always)]
            unsafe fn slot($p: *const u8, $a: *const f32, $o: usize) -> __m512 {
                $slot
            }
        }
    };
}

// (q - 8) * d is exact: the table holds the exact values
nibble_type!(
    Q40,
    18,
    16,
    1,
    |q, s| _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(8.0)), _mm512_set1_ps(*s)),
    |p, a, o| _mm512_permutexvar_ps(nibbles16(p.add(2), o), _mm512_load_ps(a))
);
// q * d is exact, so fma(q, d, m) rounds once, like ggml's q * d + m
nibble_type!(
    Q41,
    20,
    16,
    2,
    |q, s| _mm512_fmadd_ps(q, _mm512_set1_ps(*s), _mm512_set1_ps(*s.add(1))),
    |p, a, o| _mm512_permutexvar_ps(nibbles16(p.add(4), o), _mm512_load_ps(a))
);
// (q - 16) * d, as `dequant` computes it (exact)
nibble_type!(
    Q50,
    22,
    32,
    1,
    |q, s| _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(16.0)), _mm512_set1_ps(*s)),
    |p, a, o| slot5(p.add(2), p.add(6), a, o)
);
// as Q4_1: fma(q, d, m) rounds once, like `dequant`'s q * d + m
nibble_type!(
    Q51,
    24,
    32,
    2,
    |q, s| _mm512_fmadd_ps(q, _mm512_set1_ps(*s), _mm512_set1_ps(*s.add(1))),
    |p, a, o| slot5(p.add(4), p.add(8), a, o)
);

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
/// two bits of `qh` (see `dequant`). A slot is one 16-element group, so one scale: the
/// group's nibbles as in [`nibbles16`], its two bits of `qh` rotated to bits 4-5 and merged
/// by `vpternlogd`, then `q - 32` converted and multiplied by the scale, as `dequant` does.
struct Q6K;

impl Deq<__m512> for Q6K {
    const BLOCK: usize = 256;
    const BLOCK_BYTES: usize = 210;
    const AUX: usize = 16;
    const PERMUTED: bool = true;
    // 8 tokens of 512 columns: 16 KiB of L1
    const SEG: usize = 512;
    #[inline(always)]
    unsafe fn aux(p: *const u8, blocks: usize, out: *mut f32) {
        for b in 0..blocks {
            let q = p.add(b * 210);
            let d = _mm512_set1_ps(f16_scalar(q.add(208)));
            let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.add(192) as *const __m128i));
            // d * sc, as `dequant` computes each group's scale
            _mm512_store_ps(out.add(16 * b), _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
        }
    }
    #[inline(always)]
    unsafe fn slot(p: *const u8, a: *const f32, o: usize) -> __m512 {
        // half h, quarter j (bits 2j of qh, the high nibbles from j = 2), group offset l0
        let (h, j, l0) = (o / 128, o % 128 / 32, o % 32);
        let nib = nibbles16(p.add(64 * h + 32 * (j % 2) + l0), 16 * (j / 2));
        // lane 4 a + b holds byte 4 b + a of qh, whose bits 2j, 2j + 1 go to bits 4, 5
        let r = |a: i32| (8 * a + 2 * j as i32 - 4) & 31;
        let rot = _mm512_setr_epi32(
            r(0),
            r(0),
            r(0),
            r(0),
            r(1),
            r(1),
            r(1),
            r(1),
            r(2),
            r(2),
            r(2),
            r(2),
            r(3),
            r(3),
            r(3),
            r(3),
        );
        let qh =
            _mm512_broadcast_i32x4(_mm_loadu_si128(p.add(128 + 32 * h + l0) as *const __m128i));
        let hb = _mm512_rorv_epi32(qh, rot);
        // bits 0-3 from the nibbles, 4-5 from hb: q
        let q = _mm512_and_si512(
            _mm512_ternarylogic_epi32::<0xE4>(nib, hb, _mm512_set1_epi32(0x0F)),
            _mm512_set1_epi32(0x3F),
        );
        let q = _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(32)));
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
    // 8 tokens of 512 columns: 16 KiB of L1; two blocks' tables, 1 KiB per row
    const SEG: usize = 512;
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
    st: &mut State<V, R, T>,
) {
    let mut sc: [Aux; R] = std::array::from_fn(|_| Aux([MaybeUninit::uninit(); SEG_AUX]));
    let mut k0 = 0;
    while k0 < cols {
        let k1 = (k0 + Q::SEG).min(cols);
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
    let xs: [*const f32; T] = std::array::from_fn(|t| x.as_ptr().add(t * cols));
    let mut r0 = 0;
    while r0 < rows {
        let ws: [*const u8; R] =
            std::array::from_fn(|i| data.as_ptr().add((r0 + i).min(rows - 1) * rb));
        // the next tile's rows, while this one computes (a hint; never faults)
        crate::x86::prefetch(data.as_ptr().wrapping_add((r0 + R) * rb), R * rb);
        let mut st: State<__m512, R, T> = [[[MaybeUninit::uninit(); 8]; T]; R];
        tile::<__m512, Q, R, T>(&ws, &xs, cols, &mut st);
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
    let nibbles = |buf: &mut Vec<f32>| {
        // 15 more for the start on a 64-byte line: no load of a token splits a line
        if buf.len() < x.len() + 15 {
            buf.resize(x.len() + 15, 0.0);
        }
        let off = buf.as_ptr().align_offset(64).min(15);
        let xp = &mut buf[off..off + x.len()];
        match dtype {
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q4K | DType::Q6K => {
                permute(x, xp)
            }
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
    };
    XP.with(|b| match b.try_borrow_mut() {
        Ok(mut xp) => nibbles(&mut xp),
        Err(_) => nibbles(&mut Vec::new()),
    })
}

thread_local! {
    /// The permuted tokens of this thread (f32), reused across calls.
    static XP: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
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
