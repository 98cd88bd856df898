//! Exact scalar dequantization of the stored types (the ggml / Hugging Face definitions).
//!
//! Each element is computed with the same IEEE-754 operations, in the same order, as ggml's
//! `dequantize_row_*` (read as ISO C, without contraction into fma), so the values are exact:
//! - `Q8_0`: `q * d`; `Q4_0`: `(nibble - 8) * d`; `Q4_1`: `nibble * d + m`.
//!   A 32-element block stores low nibbles as elements 0..16 and high nibbles as 16..32.
//! - `Q4_K`: sub-block `k` (32 elements) is `(d * sc_k) * q - (dmin * m_k)`, with the 6-bit
//!   scales and mins unpacked as in ggml's `get_scale_min_k4`.
//! - `Q6_K`: element group `g` (16 elements) is `(d * sc_g) * (q - 32)`.
//!
//! The SIMD kernels produce the very same `f32` weights in registers.

use crate::dtype::DType;
use crate::scales::scale_min_k4;
use half::f16;

/// Bytes of a whole-block prefix of `elems` elements (`elems` a multiple of the block size).
#[inline]
pub(crate) fn prefix_bytes(dtype: DType, elems: usize) -> usize {
    elems / dtype.block_elems() * dtype.block_bytes()
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantizes `out.len()` elements from `bytes`, which hold exactly those elements
/// (a whole number of blocks). Panics on inconsistent lengths (internal callers check them).
pub(crate) fn dequant_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), prefix_bytes(dtype, out.len()));
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for (j, v) in o.iter_mut().enumerate() {
                    *v = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
        DType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    let q = b[2 + j];
                    o[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    o[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(20)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                for j in 0..16 {
                    let q = b[4 + j];
                    o[j] = (q & 0xF) as f32 * d + m;
                    o[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        DType::Q4K => {
            for (o, b) in out.chunks_exact_mut(256).zip(bytes.chunks_exact(144)) {
                let d = f16_at(b, 0);
                let dmin = f16_at(b, 2);
                let scales = &b[4..16];
                let qs = &b[16..144];
                for c in 0..4 {
                    let (s1, m1) = scale_min_k4(2 * c, scales);
                    let (s2, m2) = scale_min_k4(2 * c + 1, scales);
                    let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
                    let q = &qs[32 * c..32 * c + 32];
                    let o = &mut o[64 * c..64 * c + 64];
                    for l in 0..32 {
                        o[l] = d1 * (q[l] & 0xF) as f32 - m1;
                        o[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
                    }
                }
            }
        }
        DType::Q5_0 | DType::Q5_1 => crate::quant_ext::dequant_q5(dtype, bytes, out),
        DType::Q2K | DType::Q3K | DType::Q5K | DType::IQ4NL | DType::IQ4XS => {
            crate::quant_k_ext::dequant_ext(dtype, bytes, out)
        }
        DType::Q6K => {
            for (o, b) in out.chunks_exact_mut(256).zip(bytes.chunks_exact(210)) {
                let d = f16_at(b, 208);
                for h in 0..2 {
                    let ql = &b[64 * h..64 * h + 64];
                    let qh = &b[128 + 32 * h..128 + 32 * h + 32];
                    let sc = &b[192 + 8 * h..192 + 8 * h + 8];
                    let o = &mut o[128 * h..128 * h + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        let s = |k: usize| d * (sc[k] as i8) as f32;
                        o[l] = s(is) * q1 as f32;
                        o[l + 32] = s(is + 2) * q2 as f32;
                        o[l + 64] = s(is + 4) * q3 as f32;
                        o[l + 96] = s(is + 6) * q4 as f32;
                    }
                }
            }
        }
    }
}

/// Canonical dot products of one stored row with `n` activation rows (portable path).
///
/// `row`: one row of `cols` elements of `dtype`; `x`: `n × cols`; `out`: `n`.
///
/// Each segment of the row is dequantized once for up to [`TOKENS`] tokens; every token's
/// dot is fed the same elements in the same order as alone.
pub(crate) fn row_dots_scalar(dtype: DType, row: &[u8], cols: usize, x: &[f32], out: &mut [f32]) {
    // 256 is a multiple of every block size, so segments start on block boundaries
    const SEG: usize = 256;
    /// tokens sharing one dequantized segment
    const TOKENS: usize = 8;
    let mut buf = [0f32; SEG]; // one dequantized segment
    for (c, outs) in out.chunks_mut(TOKENS).enumerate() {
        let t0 = c * TOKENS;
        let mut dots: [crate::canon::Dot; TOKENS] =
            std::array::from_fn(|_| crate::canon::Dot::new(cols));
        let mut start = 0;
        while start < cols {
            let len = SEG.min(cols - start);
            let b0 = prefix_bytes(dtype, start);
            let b1 = b0 + prefix_bytes(dtype, len);
            dequant_into(dtype, &row[b0..b1], &mut buf[..len]);
            for (i, dot) in dots[..outs.len()].iter_mut().enumerate() {
                let xt = &x[(t0 + i) * cols + start..][..len];
                dot.push(start, &buf[..len], xt);
            }
            start += len;
        }
        for (o, dot) in outs.iter_mut().zip(&dots) {
            *o = dot.finish();
        }
    }
}
