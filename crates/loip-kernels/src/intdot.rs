//! An integer-dot canonical order for Q8_0 and Q5_0, and its portable scalar model:
//! implemented on every x86 path and tested bit for bit, not switched on (see [`handles`]).
//!
//! Rows on this order do not follow the f32 order of [`crate::canon`]: the activations are
//! quantized to int16 once per call and each weight block contributes integer products,
//! scaled once.
//! Both types are 32-element blocks of one f16 scale `d` (the block's first two
//! bytes) and integers `q`: Q8_0's int8, Q5_0's 5-bit values minus 16 (`quant_ext`).
//!
//! **Activations** ([`quantize`]), per 32 elements (one weight block) of each token's row:
//! - `amax` = the largest bit pattern of `|x_i|` (`bits & 0x7fff_ffff`, an integer max: exact
//!   and order-free). Where it is `0x7f80_0000` or more (an infinity or a NaN in the block),
//!   `dx = f32::from_bits(amax)` and every `xq_i = 0`, so the dot is NaN.
//! - Else `dx = amax / 32767` (one correctly rounded f32 division) and, if `dx != 0`,
//!   `xq_i = ((x_i / dx) + 1.5·2^23) − 1.5·2^23` as an integer: round half to even, by two
//!   correctly rounded additions (`|x_i / dx| ≤ 32767`, far below 2^22); `xq_i = 0` where
//!   `dx == 0`. The error is at most `dx / 2 ≈ 2^-16 · amax` per element.
//!
//! **Dot** of a row (`q` in -128..=127, `d` f16 per block) with one token:
//! - Block `b` goes to accumulator `b % 4` (of [`ACCS`], 16 lanes each); lane `l` gets
//!   `p_l = q[2l]·xq[2l] + q[2l+1]·xq[2l+1]` in i32 (exact: `|p| ≤ 2·128·32767 < 2^24`, so
//!   its f32 conversion is exact too; this is `vpmaddwd` / `smlal` pairs), then one fma:
//!   `acc[b % 4][l] = fma(p_l as f32, d_b · dx_b, acc[b % 4][l])`, the factor one f32
//!   multiply of the widened scale and `dx_b`.
//! - The accumulators are combined and reduced as [`crate::canon::reduce`]. Q8_0 rows are
//!   whole blocks: no tail.
//!
//! Every path (scalar, AVX2, AVX-512, NEON through this model; one token or many; any thread
//! count) computes exactly these operations, so results are bit-identical everywhere.
//! Against f64 the dot's error is about `2^-16` of `Σ|w·x|` (the f32 order's is `2^-24`):
//! far inside what a quantized model's logits differ from its float model by.

use crate::canon::{reduce, ACCS, LANES};
use crate::dtype::DType;
pub(crate) use crate::quantx::{quantize, QuantX, BLOCK, Q5_0_BYTES, Q8_0_BYTES};
use crate::simd::Level;

/// Whether `dtype` follows the integer-dot order (else the f32 order of [`crate::canon`]):
/// none today. Q8_0 and Q5_0 have every path of this order ([`implemented`], tested bit for
/// bit) but stay on the f32 order:
/// - Q8_0: x86 decode gains (one-token matvec 1.27–1.78× at AVX-512, Gemma 3 decode 0.91×),
///   but batched steps lose (0.8–0.95× at n ≥ 8: 3 instructions per block and token against
///   2 fmas) and aarch64 would run the portable scalar model until a NEON kernel of this
///   order exists, where the f32 order has NEON kernels: a cluster must give the same bits on
///   x86 and ARM, so a type switches on every architecture at once.
/// - Q5_0: its batched tiles (1 row × 4 tokens) made Qwen2.5's 256-token prefill 1.3–1.8×
///   slower than the f32 GEMM panels, and its logits left the 1e-4 tolerance of
///   `loip-engine/tests/gguf_types.rs` (6 December 2026).
#[inline]
pub(crate) fn handles(dtype: DType) -> bool {
    let _ = dtype;
    false
}

/// Whether this module has the kernels of `dtype` (a superset of [`handles`]).
#[inline]
pub(crate) fn implemented(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q5_0)
}

/// Bytes of one block of an integer-dot type.
pub(crate) fn block_bytes(dtype: DType) -> usize {
    if dtype == DType::Q5_0 {
        Q5_0_BYTES
    } else {
        Q8_0_BYTES
    }
}

/// The 32 integers of one block of `dtype` (Q5_0: `q - 16` of the 5-bit `q`).
#[inline]
fn block_q(dtype: DType, blk: &[u8]) -> [i8; BLOCK] {
    let mut q = [0i8; BLOCK];
    if dtype == DType::Q5_0 {
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        for j in 0..16 {
            let lo = (blk[6 + j] & 0x0F) as u32 | ((qh >> j) & 1) << 4;
            let hi = (blk[6 + j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
            q[j] = lo as i8 - 16;
            q[j + 16] = hi as i8 - 16;
        }
    } else {
        for (v, &b) in q.iter_mut().zip(&blk[2..2 + BLOCK]) {
            *v = b as i8;
        }
    }
    q
}

/// Canonical dots of one row of `dtype` with every token of `qx` (portable path; the model
/// every SIMD path matches). `out.len()` = tokens of `qx`.
pub(crate) fn dots_scalar(dtype: DType, row: &[u8], qx: &QuantX, out: &mut [f32]) {
    /// tokens sharing one decoded block
    const TOKENS: usize = 8;
    for (c, outs) in out.chunks_mut(TOKENS).enumerate() {
        let mut acc = [[[0f32; LANES]; ACCS]; TOKENS];
        for (b, blk) in row.chunks_exact(block_bytes(dtype)).enumerate() {
            let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
            let q = block_q(dtype, blk);
            for (i, at) in acc[..outs.len()].iter_mut().enumerate() {
                let t = c * TOKENS + i;
                let f = d * qx.dx[t * qx.stride + b];
                let xb = &qx.xq[t * qx.cols + BLOCK * b..][..BLOCK];
                let a = &mut at[b % ACCS];
                for l in 0..LANES {
                    let p = q[2 * l] as i32 * xb[2 * l] as i32
                        + q[2 * l + 1] as i32 * xb[2 * l + 1] as i32;
                    a[l] = (p as f32).mul_add(f, a[l]);
                }
            }
        }
        for (o, a) in outs.iter_mut().zip(&acc) {
            *o = reduce(a);
        }
    }
}

/// `out[r * n + t]` = canonical integer dot of row `r` of `data` (rows of `qx.cols` elements
/// of `dtype`, one [`implemented`]) with token `t` of `qx` (`n` tokens). Panics if the
/// lengths disagree.
pub(crate) fn rows(level: Level, dtype: DType, data: &[u8], qx: &QuantX, out: &mut [f32]) {
    let n = qx.tokens();
    let rb = qx.cols / BLOCK * block_bytes(dtype);
    assert!(implemented(dtype), "not an integer-dot type");
    assert!(n > 0 && rb > 0, "bad matmul shape");
    assert_eq!(out.len() % n, 0, "out length");
    assert_eq!(data.len(), out.len() / n * rb, "weight bytes");
    assert_eq!(qx.dx.len(), n * qx.stride, "dx length");
    match crate::simd::usable(level) {
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: AVX-512F/BW, AVX2, FMA and F16C detected; lengths checked above.
        Level::Avx512 if is_x86_feature_detected!("avx512bw") => unsafe {
            crate::x86::intdot::rows::<true>(dtype, data, qx, out)
        },
        #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
        // SAFETY: AVX2, FMA and F16C detected (AVX-512F implies them here); lengths checked.
        Level::Avx2 | Level::Avx512 => unsafe {
            crate::x86::intdot::rows::<false>(dtype, data, qx, out)
        },
        _ => {
            for (r, o) in out.chunks_exact_mut(n).enumerate() {
                dots_scalar(dtype, &data[r * rb..(r + 1) * rb], qx, o);
            }
        }
    }
}
