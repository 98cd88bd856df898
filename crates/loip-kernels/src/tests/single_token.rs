//! Single-token (n = 1) matmuls of the decode hot path's types (Q4_1 layers, Q8_0 head) against
//! the scalar path, bit for bit, on every level this CPU runs: row counts from 1 to 23 (SIMD
//! paths that reduce several rows together), block counts 1 to 48 (odd last blocks, chunked
//! scale conversions), and extreme f16 scales (signed zeros, subnormals, ±65504), which
//! exactness arguments such as "q * d is exact, so fma(q, d, m) = q * d + m" must survive.

use crate::dtype::{DType, Matrix};
use crate::matmul::matmul_at;
use crate::simd::{supported, Level};
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// f16 scales worth a test: ordinary values, signed zeros, subnormals, the extremes.
pub(super) fn scale(rng: &mut ChaCha8Rng) -> f16 {
    const SPECIAL: [u16; 10] = [
        0x0000, 0x8000, // ±0
        0x0001, 0x8001, // ±smallest subnormal
        0x03FF, 0x83FF, // ±largest subnormal
        0x0400, // smallest normal
        0x7BFF, 0xFBFF, // ±65504
        0x3C00, // 1
    ];
    if rng.gen_bool(0.3) {
        f16::from_bits(SPECIAL[rng.gen_range(0..SPECIAL.len())])
    } else {
        f16::from_f32(rng.gen_range(-2.0f32..2.0))
    }
}

fn matrix(dtype: DType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut data = vec![0u8; rows * dtype.row_bytes(cols).expect("whole blocks")];
    rng.fill(&mut data[..]);
    // the f16 scale `d`: first, or last (Q6_K)
    let at = if dtype == DType::Q6K { 208 } else { 0 };
    for b in data.chunks_exact_mut(dtype.block_bytes()) {
        b[at..at + 2].copy_from_slice(&scale(rng).to_bits().to_le_bytes());
        if matches!(dtype, DType::Q4_1 | DType::Q5_1) {
            b[2..4].copy_from_slice(&scale(rng).to_bits().to_le_bytes());
        }
    }
    data
}

/// Every SIMD level this CPU runs gives the scalar path's bits for one token times `data`
/// (`rows x cols` of `dtype`); any NaN stands for any NaN.
fn check(dtype: DType, rows: usize, cols: usize, data: &[u8], rng: &mut ChaCha8Rng) {
    let w = Matrix::new(dtype, rows, cols, data).expect("shape");
    let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
    let mut want = vec![0f32; rows];
    matmul_at(Level::Scalar, &w, &x, &mut want).expect("matmul");
    for level in [Level::Avx2, Level::Avx512, Level::Neon] {
        if !supported(level) {
            continue;
        }
        let mut y = vec![0f32; rows];
        matmul_at(level, &w, &x, &mut y).expect("matmul");
        for (r, (g, e)) in y.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan()),
                "{dtype} {rows}x{cols} {level:?} row {r}: {g} vs {e}"
            );
        }
    }
}

#[test]
fn single_token_kernels_bit_identical() {
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    for dtype in [DType::Q4_1, DType::Q8_0, DType::Q5_0, DType::Q5_1] {
        // blocks: 1, 2, 3, 7, 8, 9, 10, 16, 17, 18 (SmolLM2's 576), 48 (1536), 65, 152
        // (Qwen2.5's 4864); Q5_0's AVX2 dot takes the blocks by pairs, then the last odd
        // one, in segments of 64 blocks
        for blocks in [1, 2, 3, 7, 8, 9, 10, 16, 17, 18, 48, 65, 152] {
            let cols = 32 * blocks;
            for rows in [1, 7, 8, 9, 16, 23] {
                let data = matrix(dtype, rows, cols, &mut rng);
                check(dtype, rows, cols, &data, &mut rng);
            }
        }
    }
}

/// Q6_K (Qwen2.5's FFN-down rows): the AVX2 dot in assembly converts the scales per segment
/// of 32 blocks; 19 blocks are Qwen2.5's 4864 columns.
#[test]
fn single_token_q6k_bit_identical() {
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    for blocks in [1, 2, 3, 7, 19, 31, 32, 33, 65] {
        let cols = 256 * blocks;
        for rows in [1, 7, 8, 9, 16, 23] {
            let data = matrix(DType::Q6K, rows, cols, &mut rng);
            check(DType::Q6K, rows, cols, &data, &mut rng);
        }
    }
}

/// Infinite scales: the same bits as the scalar path, NaN for NaN (a SIMD form such as
/// `fma(1.5 * 2^23 + q, d, -1.5 * 2^23 * d)` for Q8_0's `q * d` would give NaN there).
#[test]
fn single_token_infinite_scales() {
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    for dtype in [DType::Q4_1, DType::Q8_0, DType::Q6K] {
        for blocks in [3, 8, 18] {
            let (rows, cols) = (9, dtype.block_elems() * blocks);
            let mut data = matrix(dtype, rows, cols, &mut rng);
            let at = if dtype == DType::Q6K { 208 } else { 0 };
            for b in data.chunks_exact_mut(dtype.block_bytes()) {
                if rng.gen_bool(0.1) {
                    let inf: u16 = if rng.gen_bool(0.5) { 0x7C00 } else { 0xFC00 };
                    b[at..at + 2].copy_from_slice(&inf.to_le_bytes());
                }
            }
            check(dtype, rows, cols, &data, &mut rng);
        }
    }
}
