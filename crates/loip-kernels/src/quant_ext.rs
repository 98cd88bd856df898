//! GGUF types beyond the core set: `Q5_0` and `Q5_1`, which llama.cpp's K-quant mixes
//! (Q4_K_M, Q5_K_M) fall back to wherever a row is not whole 256-element super-blocks
//! (640- and 896-column matrices, for example).
//!
//! Layouts (ggml `block_q5_0` / `block_q5_1`), 32 elements per block, little-endian:
//! - `Q5_0`, 22 bytes: f16 `d`, `u32 qh`, 16 bytes `qs`. Element `j < 16` has low bits
//!   `qs[j] & 0xF` and high bit `(qh >> j) & 1`; element `j + 16` has `qs[j] >> 4` and bit
//!   `(qh >> (j + 16)) & 1`. Its value is `(q - 16) * d` for the 5-bit `q`.
//! - `Q5_1`, 24 bytes: f16 `d`, f16 `m`, `u32 qh`, 16 bytes `qs`; value `q * d + m`.
//!
//! Dequantization performs ggml's `dequantize_row_q5_0` / `_q5_1` operations in the same
//! order (exact: `q * d` has at most 16 significant bits). The SIMD levels
//! (`x86/quant_ext_simd.rs`) decode the same values with 256-bit integer unpacking and feed
//! them to their canonical accumulators (`canon.rs`) in the portable path's order: every level
//! gives the same bits.

use crate::dtype::DType;
use half::f16;

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantizes whole `Q5_0` / `Q5_1` blocks of `bytes` into `out` (`out.len()` elements).
/// Panics on another dtype or inconsistent lengths (internal callers check them).
pub(crate) fn dequant_q5(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let (bb, has_min) = match dtype {
        DType::Q5_0 => (22, false),
        DType::Q5_1 => (24, true),
        other => panic!("dequant_q5: {other}"),
    };
    assert_eq!(bytes.len() / bb * 32, out.len(), "dequant_q5 lengths");
    let off = if has_min { 4 } else { 2 };
    for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(bb)) {
        let d = f16_at(b, 0);
        let qh = u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]]);
        let qs = &b[off + 4..off + 20];
        // the 5-bit values q of elements j and j + 16
        let q = |j: usize| {
            let xh_0 = ((qh >> j) << 4) & 0x10;
            let xh_1 = (qh >> (j + 12)) & 0x10;
            ((qs[j] as u32 & 0x0F) | xh_0, (qs[j] as u32 >> 4) | xh_1)
        };
        if has_min {
            let m = f16_at(b, 2);
            for j in 0..16 {
                let (lo, hi) = q(j);
                o[j] = lo as f32 * d + m;
                o[j + 16] = hi as f32 * d + m;
            }
        } else {
            for j in 0..16 {
                let (lo, hi) = q(j);
                o[j] = (lo as i32 - 16) as f32 * d;
                o[j + 16] = (hi as i32 - 16) as f32 * d;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// A block from its parts: `q` the 32 five-bit values, `d` and `m` as f16.
    fn block(dtype: DType, q: &[u8; 32], d: f32, m: f32) -> Vec<u8> {
        let mut b = f16::from_f32(d).to_bits().to_le_bytes().to_vec();
        if dtype == DType::Q5_1 {
            b.extend_from_slice(&f16::from_f32(m).to_bits().to_le_bytes());
        }
        let qh = (0..32).fold(0u32, |acc, j| acc | (u32::from(q[j] >> 4) << j));
        b.extend_from_slice(&qh.to_le_bytes());
        b.extend((0..16).map(|j| (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)));
        b
    }

    /// Every 5-bit value in every position decodes to ggml's formula (a hand-packed block
    /// round-trips through the layout).
    #[test]
    fn q5_blocks_round_trip() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for dtype in [DType::Q5_0, DType::Q5_1] {
            for _ in 0..200 {
                let q: [u8; 32] = std::array::from_fn(|_| rng.gen_range(0..32));
                let (d, m) = (rng.gen_range(-0.1f32..0.1), rng.gen_range(-0.1f32..0.1));
                let b = block(dtype, &q, d, m);
                assert_eq!(b.len(), dtype.block_bytes());
                let mut out = [0f32; 32];
                dequant_q5(dtype, &b, &mut out);
                let (d, m) = (f16::from_f32(d).to_f32(), f16::from_f32(m).to_f32());
                for j in 0..32 {
                    let want = match dtype {
                        DType::Q5_0 => (q[j] as f32 - 16.0) * d,
                        _ => q[j] as f32 * d + m,
                    };
                    assert_eq!(out[j].to_bits(), want.to_bits(), "{dtype} element {j}");
                }
            }
        }
    }
}
