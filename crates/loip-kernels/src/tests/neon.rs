//! aarch64: the NEON kernels against the portable path, bit for bit, for every type they take
//! (F32, F16, BF16, Q8_0, Q4_0, Q4_1): rows whose length is not a multiple of 64 or 16 (odd
//! group counts, float tails), 1 to 9 tokens (one-token kernel, tiles of 2, 3, 4 and their
//! remainders), 1 to 3 threads, and extreme values (f16 subnormals, infinities, NaN); and the
//! other GGUF types, which decode a row at a time for the F32 kernels, on the same cases.

use super::single_token::scale;
use super::{bits, col_cases, random_f32, random_matrix, ALL, EXT};
use crate::dequant::{prefix_bytes, row_dots_scalar};
use crate::dtype::{DType, Matrix};
use crate::matmul::matmul_at;
use crate::simd::{supported, Level};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const NEON_TYPES: [DType; 6] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
];

/// Equal bits, or NaN for NaN.
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

/// `neon::rows` against `row_dots_scalar` on `rows x cols` of `data`, `n` tokens.
fn check_rows(dtype: DType, rows: usize, cols: usize, data: &[u8], n: usize, x: &[f32]) {
    let rb = prefix_bytes(dtype, cols);
    let mut want = vec![0f32; rows * n];
    for (r, o) in want.chunks_exact_mut(n).enumerate() {
        row_dots_scalar(dtype, &data[r * rb..(r + 1) * rb], cols, x, o);
    }
    let mut got = vec![f32::NAN; rows * n];
    // SAFETY: a NEON type; whole blocks; x is n x cols; data holds `rows` rows
    unsafe { crate::arm::neon::rows(dtype, data, cols, x, n, &mut got) };
    assert!(same(&got, &want), "{dtype} {rows}x{cols} n={n}");
}

#[test]
fn neon_is_detected() {
    assert!(supported(Level::Neon));
    for dtype in NEON_TYPES {
        assert!(crate::arm::neon::handles(dtype));
    }
}

/// The types without a NEON kernel of their own (decoded rows, then the F32 kernels).
fn decoded_types() -> Vec<DType> {
    ALL.iter()
        .chain(&EXT)
        .copied()
        .filter(|&d| !NEON_TYPES.contains(&d))
        .collect()
}

#[test]
fn neon_rows_match_portable() {
    rows_match_portable(&NEON_TYPES, 40);
}

#[test]
fn neon_decoded_rows_match_portable() {
    let types = decoded_types();
    assert!(types.iter().all(|&d| !crate::arm::neon::handles(d)));
    rows_match_portable(&types, 43);
}

fn rows_match_portable(types: &[DType], seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for &dtype in types {
        for cols in col_cases(dtype) {
            for rows in [1, 3] {
                let data = random_matrix(dtype, rows, cols, &mut rng);
                let x = random_f32(9 * cols, &mut rng);
                for n in 1..=9 {
                    check_rows(dtype, rows, cols, &data, n, &x[..n * cols]);
                }
            }
        }
    }
}

#[test]
fn neon_matmul_matches_portable_on_threads() {
    matmul_matches_portable_on_threads(&NEON_TYPES, 41);
}

#[test]
fn neon_decoded_matmul_matches_portable_on_threads() {
    matmul_matches_portable_on_threads(&decoded_types(), 44);
}

fn matmul_matches_portable_on_threads(types: &[DType], seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for &dtype in types {
        let cases = col_cases(dtype);
        // a length with a tail (floats) or an odd number of 64-element chunks, and the longest
        for cols in [cases[cases.len() / 2], cases[cases.len() - 1]] {
            let rows = 67;
            let data = random_matrix(dtype, rows, cols, &mut rng);
            let w = Matrix::new(dtype, rows, cols, &data).expect("shape");
            let x = random_f32(9 * cols, &mut rng);
            for n in 1..=9 {
                let x = &x[..n * cols];
                let mut want = vec![0f32; n * rows];
                matmul_at(Level::Scalar, &w, x, &mut want).expect("matmul");
                for threads in [1, 2, 3] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .expect("pool");
                    let mut y = vec![f32::NAN; n * rows];
                    pool.install(|| matmul_at(Level::Neon, &w, x, &mut y))
                        .expect("matmul");
                    assert_eq!(
                        bits(&y),
                        bits(&want),
                        "{dtype} {rows}x{cols} n={n} threads={threads}"
                    );
                }
            }
        }
    }
}

#[test]
fn neon_extreme_values() {
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    for dtype in NEON_TYPES {
        for cols in col_cases(dtype).into_iter().take(6) {
            let rows = 5;
            let mut data = vec![0u8; rows * prefix_bytes(dtype, cols)];
            rng.fill(&mut data[..]);
            match dtype {
                // raw random bits: every f16 / bf16 / f32 pattern, NaN and infinities included
                DType::F32 | DType::F16 | DType::BF16 => {}
                _ => {
                    for b in data.chunks_exact_mut(dtype.block_bytes()) {
                        b[0..2].copy_from_slice(&scale(&mut rng).to_bits().to_le_bytes());
                        if dtype == DType::Q4_1 {
                            b[2..4].copy_from_slice(&scale(&mut rng).to_bits().to_le_bytes());
                        }
                        if rng.gen_bool(0.05) {
                            b[0..2].copy_from_slice(&0x7C00u16.to_le_bytes()); // +inf
                        }
                    }
                }
            }
            // f16 subnormals only: every f16 with a zero exponent
            if dtype == DType::F16 {
                for c in data.chunks_exact_mut(2).step_by(3) {
                    c[1] &= 0x83;
                }
            }
            let x = random_f32(4 * cols, &mut rng);
            for n in [1, 2, 3, 4] {
                check_rows(dtype, rows, cols, &data, n, &x[..n * cols]);
            }
        }
    }
}
