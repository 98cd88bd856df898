//! The integer-dot order of Q8_0 (`crate::intdot`): the activations' quantization on edge
//! cases, the scalar model's accuracy against f64, and every SIMD path against the model bit
//! for bit (odd block counts, 1 to 9 rows and tokens, extreme scales, non-finite activations).

use super::{bits, random_f32, random_matrix};
use crate::dtype::DType;
use crate::intdot::{block_bytes, dots_scalar, quantize, rows, BLOCK, Q8_0_BYTES};
use crate::simd::{supported, Level};
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Equal bits, or NaN for NaN.
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
}

#[test]
fn quantize_rounds_half_to_even_and_flags_non_finite_blocks() {
    // amax 32767 -> dx 1: x / dx exact, ties go to even
    let mut x = vec![0f32; 4 * BLOCK];
    x[0] = 32767.0;
    x[1] = 2.5;
    x[2] = 3.5;
    x[3] = -2.5;
    x[4] = -32767.0;
    x[5] = 0.49;
    // block 1 all zero; block 2 an infinity; block 3 a NaN
    x[2 * BLOCK + 7] = f32::NEG_INFINITY;
    x[3 * BLOCK + 1] = f32::NAN;
    let q = quantize(&x, 4 * BLOCK);
    assert_eq!(q.dx[0], 1.0);
    assert_eq!(&q.xq[..6], &[32767, 2, 4, -2, -32767, 0]);
    assert_eq!(q.dx[1], 0.0);
    assert!(q.xq[BLOCK..].iter().all(|&v| v == 0));
    assert_eq!(q.dx[2], f32::INFINITY);
    assert!(q.dx[3].is_nan());
    assert_eq!(q.stride, 16);
    assert!(q.dx[4..16].iter().all(|&d| d == 0.0));
    // a row of ones: the infinite and NaN blocks make the dot NaN
    let mut row = vec![0u8; 4 * Q8_0_BYTES];
    for b in row.chunks_exact_mut(Q8_0_BYTES) {
        b[..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
        b[2..].fill(1);
    }
    let mut out = [0f32];
    dots_scalar(DType::Q8_0, &row, &q, &mut out);
    assert!(out[0].is_nan());
    // the largest element maps to ±32767 whatever the scale; tiny blocks to 0 or exact
    for amax in [1e-30f32, 1e-3, 0.7, 3.0e5, 1e30, f32::MAX] {
        let mut x = vec![0.25 * amax; BLOCK];
        x[9] = -amax;
        let q = quantize(&x, BLOCK);
        assert_eq!(q.xq[9], -32767, "{amax}");
        assert!(q.xq[0] == 8192 || q.xq[0] == 8191, "{amax}: {}", q.xq[0]);
    }
    let q = quantize(&[f32::from_bits(1); BLOCK], BLOCK);
    assert_eq!(q.dx[0], 0.0);
    assert!(q.xq.iter().all(|&v| v == 0));
}

#[test]
fn block_integers_are_the_dequantized_values() {
    let mut rng = ChaCha8Rng::seed_from_u64(35);
    for dtype in [DType::Q8_0, DType::Q5_0] {
        let data = random_matrix(dtype, 1, 256, &mut rng);
        let mut want = vec![0f32; 256];
        crate::dequant::dequant_into(dtype, &data, &mut want);
        // x = e_j: xq = 32767 at j, dx = 1/32767 rounded; compare q·d through the model
        for j in [0, 5, 15, 16, 17, 31, 32, 100, 255] {
            let mut x = vec![0f32; 256];
            x[j] = 1.0;
            let q = quantize(&x, 256);
            let mut got = [0f32];
            dots_scalar(dtype, &data, &q, &mut got);
            let rel = (got[0] - want[j]).abs() / want[j].abs().max(1e-30);
            assert!(rel < 1e-6, "{dtype} element {j}: {} vs {}", got[0], want[j]);
        }
    }
}

#[test]
fn scalar_model_is_close_to_f64() {
    let mut rng = ChaCha8Rng::seed_from_u64(33);
    for cols in [32, 96, 640, 4096] {
        let rows = 16;
        let data = random_matrix(DType::Q8_0, rows, cols, &mut rng);
        let x = random_f32(cols, &mut rng);
        let q = quantize(&x, cols);
        let rb = cols / BLOCK * Q8_0_BYTES;
        for r in 0..rows {
            let row = &data[r * rb..(r + 1) * rb];
            let mut got = [0f32];
            dots_scalar(DType::Q8_0, row, &q, &mut got);
            let (mut s, mut a) = (0f64, 0f64);
            for (b, blk) in row.chunks_exact(Q8_0_BYTES).enumerate() {
                let d = f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f64();
                for j in 0..BLOCK {
                    let v = d * (blk[2 + j] as i8 as f64) * x[BLOCK * b + j] as f64;
                    s += v;
                    a += v.abs();
                }
            }
            let err = (got[0] as f64 - s).abs() / a;
            assert!(err < 2e-5, "{cols} cols, row {r}: relative error {err}");
        }
    }
}

/// Rows with extreme scales in some blocks: f16 subnormals, the largest f16, infinity.
fn extreme_rows(dtype: DType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let mut data = random_matrix(dtype, rows, cols, rng);
    for b in data.chunks_exact_mut(block_bytes(dtype)) {
        let d = match rng.gen_range(0..20) {
            0 => f16::from_bits(1),
            1 => f16::MAX,
            2 => f16::INFINITY,
            3 => f16::from_f32(-0.0),
            _ => continue,
        };
        b[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    }
    data
}

#[test]
fn simd_paths_match_the_scalar_model() {
    let mut rng = ChaCha8Rng::seed_from_u64(34);
    let levels: Vec<Level> = [Level::Avx2, Level::Avx512, Level::Neon]
        .into_iter()
        .filter(|&l| supported(l))
        .collect();
    for (dtype, cols) in [DType::Q8_0, DType::Q5_0]
        .into_iter()
        .flat_map(|d| [32, 64, 96, 128, 160, 480, 512, 544, 640, 1056].map(|c| (d, c)))
    {
        for rows_n in 1..=9 {
            for n in [1, 2, 3, 4, 5, 7, 8, 9] {
                let data = if rows_n % 3 == 0 {
                    extreme_rows(dtype, rows_n, cols, &mut rng)
                } else {
                    random_matrix(dtype, rows_n, cols, &mut rng)
                };
                let mut x = random_f32(n * cols, &mut rng);
                if n == 5 {
                    let len = x.len();
                    x[rng.gen_range(0..len)] = f32::INFINITY;
                    x[rng.gen_range(0..len)] = 1e-39; // subnormal
                }
                let q = quantize(&x, cols);
                let rb = cols / BLOCK * block_bytes(dtype);
                let mut want = vec![0f32; rows_n * n];
                for (r, o) in want.chunks_exact_mut(n).enumerate() {
                    dots_scalar(dtype, &data[r * rb..(r + 1) * rb], &q, o);
                }
                // each token alone gives the same bits as in the batch
                for t in 0..n {
                    let mut one = vec![0f32; rows_n];
                    rows(Level::Scalar, dtype, &data, &q.slice(t, 1), &mut one);
                    let col: Vec<f32> = (0..rows_n).map(|r| want[r * n + t]).collect();
                    assert!(same(&one, &col), "{dtype} scalar token {t} alone");
                }
                for &level in &levels {
                    let mut got = vec![f32::NAN; rows_n * n];
                    rows(level, dtype, &data, &q, &mut got);
                    assert!(
                        same(&got, &want),
                        "{dtype} {level:?} {rows_n}x{cols} n={n}: {:?} vs {:?}",
                        &bits(&got)[..got.len().min(4)],
                        &bits(&want)[..want.len().min(4)]
                    );
                }
            }
        }
    }
}
