//! NEON kernels (128-bit registers; one canonical 16-lane group is four `float32x4_t`:
//! lanes 0..4, 4..8, 8..12, 12..16) for the types edge devices use most: F32, F16, BF16, Q8_0,
//! Q4_0, Q4_1. The other GGUF types (Q5_0, Q5_1, the K types, IQ4) are dequantized a row at a
//! time to their exact values by the portable decoder, then take the F32 kernels
//! ([`rows_decoded`]): the values and order of the portable path, each row decoded once for
//! all the tokens.
//!
//! The canonical order ([`crate::canon`]): group `g` of 16 weights goes to accumulator `g % 4`
//! through `vfmaq_f32` (one rounding, as `f32::mul_add`), the four accumulators are combined
//! by [`reduce`] in `canon::reduce`'s tree, and the tail (float types, `cols % 16` elements) is
//! a sequential scalar fma added last. Weights are `dequant`'s exact values: `q * d` is exact
//! for these types, so `fma(q, d, m)` (Q4_1) is `q * d + m` rounded once, as the scalar path's
//! two roundings; f16 is widened by `fcvtl` (exact, also for subnormals).
//!
//! Kernels:
//! - one token ([`dot1`]): the row in order, all 4 accumulators (16 registers) live;
//! - `n > 1` tokens ([`tile`]): tiles of up to 4 tokens. Accumulator `k` only ever sees groups
//!   `g ≡ k (mod 4)`, in increasing `g`, so the tile runs the row in four phases `k = 0..4`,
//!   each with one accumulator per token live (4 tokens × 4 registers), and dequantizes every
//!   group once per tile: the same operations per output element as [`dot1`], in the same
//!   order.
//!
//! Instructions per 32-weight block (two groups), counted in the inner loops of the release
//! build's disassembly (`aarch64-linux-gnu-objdump -d`), for one token and for a tile of 4
//! tokens (in brackets: per token). The useful work is 8 `fmla` per token.
//!
//! | type | one token | tile of 4 | what the dequantization costs |
//! |---|---|---|---|
//! | Q4_1 | 57 | 108 (27) | ld1r+fcvtl+2 dup, ldr, and/ushr, 12 uxtl, 8 ucvtf, 8 fmla |
//! | Q4_0 | 51.5 | 102 (25.5) | as Q4_1, `sub` on the bytes, 8 fmul instead of fmla |
//! | Q8_0 | 60.5 | 98 (24.5) | scale, ldr, 12 sxtl, 8 scvtf, 8 fmul |
//! | F16 | 29 | 78 (19.5) | 2 loads, 8 fcvtl |
//! | BF16 | 25 | 73 (18) | 2 loads, 8 shll |
//! | F32 | 19 | 65 (16) | 8 loads (ldp) |
//!
//! The tile loads each token's 16 activations per group (`ldp`) and holds 16 accumulators, 4
//! weight registers and the scales: no spills in its loops. Q8_0's one-token loop has 10
//! register moves and 3.5 spill loads/stores per block (the compiler hoists all 4 groups'
//! conversions); it streams the LM head, memory-bound at one token.
//!
//! Safety: every `unsafe fn` here requires the buffer lengths stated in its docs (NEON itself
//! is part of the aarch64 base architecture).

use std::arch::aarch64::*;
use std::arch::asm;
use std::ptr::read_unaligned;

use crate::dequant::prefix_bytes;
use crate::dtype::DType;

/// One canonical 16-lane group: lanes 0..4, 4..8, 8..12, 12..16.
type Group = [float32x4_t; 4];

/// Tokens per tile of the batched kernel.
const TILE: usize = 4;

/// Whether [`rows`] has a kernel of its own for `dtype` (the others go through
/// [`rows_decoded`]); the tests check both sides of it.
#[cfg(test)]
pub(crate) fn handles(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F32 | DType::F16 | DType::BF16 | DType::Q8_0 | DType::Q4_0 | DType::Q4_1
    )
}

/// Four f16 to four f32, exactly (`fcvtl`, base AdvSIMD; an `asm!` block because the
/// `vcvt_f32_f16` intrinsic is newer than the workspace's minimum Rust).
#[inline(always)]
unsafe fn f16x4(h: uint16x4_t) -> float32x4_t {
    let o: float32x4_t;
    asm!(
        "fcvtl {o:v}.4s, {h:v}.4h",
        o = lateout(vreg) o,
        h = in(vreg) h,
        options(pure, nomem, nostack, preserves_flags)
    );
    o
}

/// The f16 at `p` (2 bytes, any alignment) in every lane.
#[inline(always)]
unsafe fn f16_splat(p: *const u8) -> float32x4_t {
    f16x4(vdup_n_u16(u16::from_le(read_unaligned(p as *const u16))))
}

/// 16 bytes at `p` (any alignment) as four f32 (little-endian).
#[inline(always)]
unsafe fn f32x4_at(p: *const u8) -> float32x4_t {
    vreinterpretq_f32_u8(vld1q_u8(p))
}

/// 16 unsigned bytes to 16 f32 (exact).
#[inline(always)]
unsafe fn u8x16_f32(v: uint8x16_t) -> Group {
    let lo = vmovl_u8(vget_low_u8(v));
    let hi = vmovl_high_u8(v);
    [
        vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))),
        vcvtq_f32_u32(vmovl_high_u16(lo)),
        vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))),
        vcvtq_f32_u32(vmovl_high_u16(hi)),
    ]
}

/// 16 signed bytes to 16 f32 (exact).
#[inline(always)]
unsafe fn i8x16_f32(v: int8x16_t) -> Group {
    let lo = vmovl_s8(vget_low_s8(v));
    let hi = vmovl_high_s8(v);
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

/// The 16 nibbles of group `g` of a 32-element Q4 block whose 16 nibble bytes are at `qs`:
/// low nibbles are elements 0..16 (even `g`), high nibbles 16..32 (odd `g`).
#[inline(always)]
unsafe fn nibbles(qs: *const u8, g: usize) -> uint8x16_t {
    let b = vld1q_u8(qs);
    if g % 2 == 0 {
        vandq_u8(b, vdupq_n_u8(0xF))
    } else {
        vshrq_n_u8::<4>(b)
    }
}

/// A row of one stored type, read one canonical group at a time.
trait Row {
    /// Group `g` (weights `16 g .. 16 g + 16`) of the row at `p`, exactly `dequant`'s values.
    /// `p` must hold the row's first `16 g + 16` weights.
    unsafe fn group(p: *const u8, g: usize) -> Group;
    /// Weight `j` of the row at `p` (the tail of the float types; quantized rows have none).
    unsafe fn elem(p: *const u8, j: usize) -> f32;
}

struct F32;
impl Row for F32 {
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> Group {
        let p = p.add(64 * g);
        [
            f32x4_at(p),
            f32x4_at(p.add(16)),
            f32x4_at(p.add(32)),
            f32x4_at(p.add(48)),
        ]
    }
    #[inline(always)]
    unsafe fn elem(p: *const u8, j: usize) -> f32 {
        f32::from_bits(u32::from_le(read_unaligned(p.add(4 * j) as *const u32)))
    }
}

struct F16;
impl Row for F16 {
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> Group {
        let p = p.add(32 * g);
        let a = vreinterpretq_u16_u8(vld1q_u8(p));
        let b = vreinterpretq_u16_u8(vld1q_u8(p.add(16)));
        [
            f16x4(vget_low_u16(a)),
            f16x4(vget_high_u16(a)),
            f16x4(vget_low_u16(b)),
            f16x4(vget_high_u16(b)),
        ]
    }
    #[inline(always)]
    unsafe fn elem(p: *const u8, j: usize) -> f32 {
        half::f16::from_bits(u16::from_le(read_unaligned(p.add(2 * j) as *const u16))).to_f32()
    }
}

struct BF16;
impl Row for BF16 {
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> Group {
        // bf16 bits << 16 are the f32 bits
        let p = p.add(32 * g);
        let a = vreinterpretq_u16_u8(vld1q_u8(p));
        let b = vreinterpretq_u16_u8(vld1q_u8(p.add(16)));
        let w = |v: uint32x4_t| vreinterpretq_f32_u32(v);
        [
            w(vshll_n_u16::<16>(vget_low_u16(a))),
            w(vshll_high_n_u16::<16>(a)),
            w(vshll_n_u16::<16>(vget_low_u16(b))),
            w(vshll_high_n_u16::<16>(b)),
        ]
    }
    #[inline(always)]
    unsafe fn elem(p: *const u8, j: usize) -> f32 {
        f32::from_bits((u16::from_le(read_unaligned(p.add(2 * j) as *const u16)) as u32) << 16)
    }
}

struct Q80;
impl Row for Q80 {
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> Group {
        // q * d; block g / 2 (34 bytes: f16 d, 32 × i8), bytes 16 (g % 2) ..
        let b = p.add(34 * (g / 2));
        let d = f16_splat(b);
        let q = i8x16_f32(vld1q_s8(b.add(2 + 16 * (g % 2)) as *const i8));
        q.map(|q| vmulq_f32(q, d))
    }
    #[inline(always)]
    unsafe fn elem(_p: *const u8, _j: usize) -> f32 {
        unreachable!("Q8_0 rows are whole groups")
    }
}

struct Q40;
impl Row for Q40 {
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> Group {
        // (q - 8) * d; block g / 2 (18 bytes: f16 d, 16 bytes of nibbles)
        let b = p.add(18 * (g / 2));
        let d = f16_splat(b);
        let q = vsubq_s8(vreinterpretq_s8_u8(nibbles(b.add(2), g)), vdupq_n_s8(8));
        i8x16_f32(q).map(|q| vmulq_f32(q, d))
    }
    #[inline(always)]
    unsafe fn elem(_p: *const u8, _j: usize) -> f32 {
        unreachable!("Q4_0 rows are whole groups")
    }
}

struct Q41;
impl Row for Q41 {
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize) -> Group {
        // q * d + m as one fma (q * d is exact); block g / 2 (20 bytes: f16 d, f16 m, 16 bytes)
        let b = p.add(20 * (g / 2));
        let dm = f16x4(vreinterpret_u16_u32(vdup_n_u32(u32::from_le(
            read_unaligned(b as *const u32),
        ))));
        let (d, m) = (vdupq_laneq_f32::<0>(dm), vdupq_laneq_f32::<1>(dm));
        u8x16_f32(nibbles(b.add(4), g)).map(|q| vfmaq_f32(m, q, d))
    }
    #[inline(always)]
    unsafe fn elem(_p: *const u8, _j: usize) -> f32 {
        unreachable!("Q4_1 rows are whole groups")
    }
}

/// `acc += w * x` lane-wise (fused) for the 16 activations at `x`.
#[inline(always)]
unsafe fn fma_group(acc: &mut Group, w: &Group, x: *const f32) {
    for q in 0..4 {
        acc[q] = vfmaq_f32(acc[q], w[q], vld1q_f32(x.add(4 * q)));
    }
}

/// `canon::reduce` on four accumulators: `(acc0 + acc2) + (acc1 + acc3)` lane-wise, then the
/// 16 lanes halved (`+8`, `+4`, `+2`, `+1`).
#[inline(always)]
unsafe fn reduce(acc: &[Group; 4]) -> f32 {
    let v: Group = std::array::from_fn(|q| {
        vaddq_f32(
            vaddq_f32(acc[0][q], acc[2][q]),
            vaddq_f32(acc[1][q], acc[3][q]),
        )
    });
    let v8 = [vaddq_f32(v[0], v[2]), vaddq_f32(v[1], v[3])]; // lanes 0..8 += 8..16
    let v4 = vaddq_f32(v8[0], v8[1]); // lanes 0..4 += 4..8
    let v2 = vadd_f32(vget_low_f32(v4), vget_high_f32(v4)); // lanes 0..2 += 2..4
    vget_lane_f32::<0>(v2) + vget_lane_f32::<1>(v2)
}

/// The canonical sum of a row's accumulators and its tail (elements `16 · (cols / 16) ..`,
/// sequential fma from `+0.0`, added last when not empty).
#[inline(always)]
unsafe fn finish<W: Row>(acc: &[Group; 4], p: *const u8, cols: usize, x: *const f32) -> f32 {
    let s = reduce(acc);
    let full = cols / 16 * 16;
    if full == cols {
        return s;
    }
    let mut t = 0f32;
    for j in full..cols {
        t = W::elem(p, j).mul_add(*x.add(j), t);
    }
    s + t
}

const ZERO: Group = unsafe { std::mem::transmute([0f32; 16]) };

/// Canonical dot of the row at `p` (`cols` weights of `W`) with the `cols` activations at `x`.
#[inline(always)]
unsafe fn dot1<W: Row>(p: *const u8, cols: usize, x: *const f32) -> f32 {
    let groups = cols / 16;
    let mut acc = [ZERO; 4];
    let mut g = 0;
    while g + 4 <= groups {
        for (k, a) in acc.iter_mut().enumerate() {
            fma_group(a, &W::group(p, g + k), x.add(16 * (g + k)));
        }
        g += 4;
    }
    // the last 1..3 groups, with constant accumulator indices (registers)
    let rest = groups - g;
    if rest > 0 {
        fma_group(&mut acc[0], &W::group(p, g), x.add(16 * g));
    }
    if rest > 1 {
        fma_group(&mut acc[1], &W::group(p, g + 1), x.add(16 * (g + 1)));
    }
    if rest > 2 {
        fma_group(&mut acc[2], &W::group(p, g + 2), x.add(16 * (g + 2)));
    }
    finish::<W>(&acc, p, cols, x)
}

/// Phase `K` of a tile of `T` tokens: accumulator `K` of every token over the groups
/// `K, K + 4, ..` of the row at `p` (`x`: `T × cols`, token-major). `K` is a constant so
/// that each group's half of its block (low or high nibbles, `g % 2 = K % 2`) is too.
#[inline(always)]
unsafe fn phase<W: Row, const T: usize, const K: usize>(
    p: *const u8,
    cols: usize,
    x: *const f32,
) -> [Group; T] {
    let mut a = [ZERO; T];
    let mut i = 0;
    while 4 * i + K < cols / 16 {
        let g = 4 * i + K;
        let w = W::group(p, g);
        for (t, a) in a.iter_mut().enumerate() {
            fma_group(a, &w, x.add(t * cols + 16 * g));
        }
        i += 1;
    }
    a
}

/// Stores phase `k`'s accumulators of a tile. The finished phases wait in memory: kept in
/// registers, they left too few for the live phase, whose accumulators then spilled in its
/// loop.
#[inline(always)]
fn keep<const T: usize>(accs: &mut [[Group; 4]; T], k: usize, a: [Group; T]) {
    for (acc, a) in accs.iter_mut().zip(a) {
        acc[k] = a;
    }
    std::hint::black_box(accs);
}

/// Canonical dots of the row at `p` with `T` tokens (`x`: `T × cols`, token-major), into
/// `out[0..T]`: the four [`phase`]s, so that each group is dequantized once for the tile.
#[inline(always)]
unsafe fn tile<W: Row, const T: usize>(p: *const u8, cols: usize, x: *const f32, out: *mut f32) {
    let mut accs = [[ZERO; 4]; T]; // [token][accumulator]
    keep(&mut accs, 0, phase::<W, T, 0>(p, cols, x));
    keep(&mut accs, 1, phase::<W, T, 1>(p, cols, x));
    keep(&mut accs, 2, phase::<W, T, 2>(p, cols, x));
    keep(&mut accs, 3, phase::<W, T, 3>(p, cols, x));
    for (t, acc) in accs.iter().enumerate() {
        *out.add(t) = finish::<W>(acc, p, cols, x.add(t * cols));
    }
}

/// `out[r * n + t]` = canonical dot of row `r` of `data` with token `t` of `x`, for a type `W`.
#[inline(always)]
unsafe fn rows_of<W: Row>(
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    for (r, o) in out.chunks_exact_mut(n).enumerate() {
        let p = data.as_ptr().add(r * rb);
        let mut t0 = 0;
        while t0 < n {
            let (xt, ot) = (x.as_ptr().add(t0 * cols), o.as_mut_ptr().add(t0));
            let step = (n - t0).min(TILE);
            match step {
                1 => *ot = dot1::<W>(p, cols, xt),
                2 => tile::<W, 2>(p, cols, xt, ot),
                3 => tile::<W, 3>(p, cols, xt, ot),
                _ => tile::<W, TILE>(p, cols, xt, ot),
            }
            t0 += step;
        }
    }
}

/// `out[r * n + t]` = canonical dot of row `r` of `data` with token `t` of `x`.
///
/// # Safety
/// [`handles`]`(dtype)`; `cols` a multiple of the block size; `x.len() == n * cols`;
/// `data.len() == out.len() / n * prefix_bytes(dtype, cols)` (checked by the dispatcher).
pub(crate) unsafe fn rows(
    dtype: DType,
    data: &[u8],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let rb = prefix_bytes(dtype, cols);
    match dtype {
        DType::F32 => rows_of::<F32>(data, rb, cols, x, n, out),
        DType::F16 => rows_of::<F16>(data, rb, cols, x, n, out),
        DType::BF16 => rows_of::<BF16>(data, rb, cols, x, n, out),
        DType::Q8_0 => rows_of::<Q80>(data, rb, cols, x, n, out),
        DType::Q4_0 => rows_of::<Q40>(data, rb, cols, x, n, out),
        DType::Q4_1 => rows_of::<Q41>(data, rb, cols, x, n, out),
        _ => rows_decoded(dtype, data, rb, cols, x, n, out),
    }
}

/// [`rows`] of a type without a kernel of its own: each row dequantized once (the portable
/// decoder's exact values) into a buffer, then the F32 kernels over the `n` tokens.
///
/// # Safety
/// As [`rows`], `rb == prefix_bytes(dtype, cols)`.
unsafe fn rows_decoded(
    dtype: DType,
    data: &[u8],
    rb: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let mut w = vec![0f32; cols]; // one decoded row
    for (r, o) in out.chunks_exact_mut(n).enumerate() {
        crate::dequant::dequant_into(dtype, &data[r * rb..(r + 1) * rb], &mut w);
        // SAFETY (of the view): `w` holds `cols` f32, `4 * cols` bytes, alive for the call
        let bytes = std::slice::from_raw_parts(w.as_ptr() as *const u8, 4 * cols);
        rows_of::<F32>(bytes, 4 * cols, cols, x, n, o);
    }
}

/// Canonical dot product of two f32 slices of the same length.
///
/// # Safety
/// `a.len() == b.len()`.
pub(crate) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot1::<F32>(a.as_ptr() as *const u8, a.len(), b.as_ptr())
}

/// `out[t]` = canonical dot of `q` with row `t` of `k` (rows `stride` apart).
///
/// # Safety
/// `(out.len() - 1) * stride + q.len() <= k.len()` when `out` is not empty.
pub(crate) unsafe fn dot_rows(q: &[f32], k: &[f32], stride: usize, out: &mut [f32]) {
    for (t, o) in out.iter_mut().enumerate() {
        *o = dot1::<F32>(k.as_ptr().add(t * stride) as *const u8, q.len(), q.as_ptr());
    }
}

/// `out[i] = fma(p[t], v[t * stride + i], out[i])` for `t = 0, 1, ..` in order.
///
/// # Safety
/// `(p.len() - 1) * stride + out.len() <= v.len()` when `p` is not empty.
pub(crate) unsafe fn weighted_rows(p: &[f32], v: &[f32], stride: usize, out: &mut [f32]) {
    let len = out.len();
    let o = out.as_mut_ptr();
    let mut i = 0;
    // 16 outputs at a time in registers across all rows, then 4, then single elements
    while i + 16 <= len {
        let mut acc: Group = std::array::from_fn(|q| vld1q_f32(o.add(i + 4 * q)));
        for (t, &pt) in p.iter().enumerate() {
            let row = v.as_ptr().add(t * stride + i);
            let s = vdupq_n_f32(pt);
            for (q, a) in acc.iter_mut().enumerate() {
                *a = vfmaq_f32(*a, s, vld1q_f32(row.add(4 * q)));
            }
        }
        for (q, a) in acc.iter().enumerate() {
            vst1q_f32(o.add(i + 4 * q), *a);
        }
        i += 16;
    }
    while i + 4 <= len {
        let mut a = vld1q_f32(o.add(i));
        for (t, &pt) in p.iter().enumerate() {
            a = vfmaq_f32(
                a,
                vdupq_n_f32(pt),
                vld1q_f32(v.as_ptr().add(t * stride + i)),
            );
        }
        vst1q_f32(o.add(i), a);
        i += 4;
    }
    for i in i..len {
        let mut a = *o.add(i);
        for (t, &pt) in p.iter().enumerate() {
            a = pt.mul_add(*v.as_ptr().add(t * stride + i), a);
        }
        *o.add(i) = a;
    }
}
