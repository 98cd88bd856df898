//! Public-API tests: kernels against the plain scalar references, determinism (address,
//! batch, threads), exact dequantization of hand-built blocks, and error handling.

mod common;

use common::{random_f32, random_matrix, ALL};
use half::{bf16, f16};
use loip_kernels::{
    attention, attention_ref, dequant_row, matmul, matmul_ref, rmsnorm, rope_half, silu_mul,
    simd_level, DType, KernelError, Matrix,
};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
}

/// Checks `got` against the reference with a tolerance relative to `Σ |w x|` per output.
fn assert_close(w: &Matrix, x: &[f32], got: &[f32], want: &[f32], rel: f32) {
    let n = x.len() / w.cols;
    let mut row = vec![0f32; w.cols];
    for r in 0..w.rows {
        dequant_row(w, r, &mut row).expect("row");
        for t in 0..n {
            let scale: f32 = row
                .iter()
                .zip(&x[t * w.cols..])
                .map(|(a, b)| (a * b).abs())
                .sum();
            let (g, e) = (got[t * w.rows + r], want[t * w.rows + r]);
            assert!(
                (g - e).abs() <= rel * scale + 1e-30,
                "{} row {r} token {t}: {g} vs {e} (scale {scale})",
                w.dtype
            );
        }
    }
}

#[test]
fn simd_level_is_named() {
    assert!(["avx512", "avx2", "neon", "scalar"].contains(&simd_level()));
}

#[test]
fn matmul_matches_reference_all_dtypes() {
    let mut g = rng(10);
    for dtype in ALL {
        for (rows, cols, n) in [(64, 512, 1), (100, 768, 3), (300, 1536, 1), (7, 256, 4)] {
            let data = random_matrix(dtype, rows, cols, &mut g);
            let w = Matrix::new(dtype, rows, cols, &data).expect("shape");
            let x = random_f32(n * cols, &mut g);
            let (mut y, mut y_ref) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            matmul(&w, &x, &mut y).expect("matmul");
            matmul_ref(&w, &x, &mut y_ref).expect("matmul_ref");
            assert_close(&w, &x, &y, &y_ref, 1e-5);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn matmul_matches_reference_shapes(
        d in 0usize..8, rows in 1usize..48, blocks in 1usize..10, n in 1usize..4, extra in 0usize..16, seed in 0u64..1000
    ) {
        let dtype = ALL[d];
        // float types get any length (tails); quantized types whole blocks
        let cols = blocks * dtype.block_elems().max(16) + if dtype.block_elems() == 1 { extra } else { 0 };
        let mut g = rng(seed);
        let data = random_matrix(dtype, rows, cols, &mut g);
        let w = Matrix::new(dtype, rows, cols, &data).expect("shape");
        let x = random_f32(n * cols, &mut g);
        let (mut y, mut y_ref) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        matmul(&w, &x, &mut y).expect("matmul");
        matmul_ref(&w, &x, &mut y_ref).expect("matmul_ref");
        assert_close(&w, &x, &y, &y_ref, 1e-5);
        // batch rows are bit-identical to single-token calls
        for t in 0..n {
            let mut y1 = vec![0f32; rows];
            matmul(&w, &x[t * cols..(t + 1) * cols], &mut y1).expect("matmul");
            prop_assert_eq!(bits(&y1), bits(&y[t * rows..(t + 1) * rows]));
        }
    }
}

#[test]
fn matmul_independent_of_weight_address() {
    let mut g = rng(11);
    for dtype in ALL {
        let (rows, cols) = (37, 512);
        let data = random_matrix(dtype, rows, cols, &mut g);
        let x = random_f32(2 * cols, &mut g);
        let mut first: Option<Vec<u32>> = None;
        for offset in [0usize, 1, 3, 7] {
            let mut buf = vec![0u8; data.len() + offset];
            buf[offset..].copy_from_slice(&data);
            let w = Matrix::new(dtype, rows, cols, &buf[offset..]).expect("shape");
            let mut y = vec![0f32; 2 * rows];
            matmul(&w, &x, &mut y).expect("matmul");
            match &first {
                None => first = Some(bits(&y)),
                Some(f) => assert_eq!(&bits(&y), f, "{dtype} offset {offset}"),
            }
        }
    }
}

#[test]
fn matmul_batch_equals_single_tokens() {
    let mut g = rng(12);
    for dtype in ALL {
        let (rows, cols) = (131, 768);
        let data = random_matrix(dtype, rows, cols, &mut g);
        let w = Matrix::new(dtype, rows, cols, &data).expect("shape");
        let x = random_f32(3 * cols, &mut g);
        let mut y3 = vec![0f32; 3 * rows];
        matmul(&w, &x, &mut y3).expect("matmul");
        for t in 0..3 {
            let mut y1 = vec![0f32; rows];
            matmul(&w, &x[t * cols..(t + 1) * cols], &mut y1).expect("matmul");
            assert_eq!(
                bits(&y1),
                bits(&y3[t * rows..(t + 1) * rows]),
                "{dtype} token {t}"
            );
        }
    }
}

#[test]
fn matmul_independent_of_thread_count() {
    let mut g = rng(13);
    for dtype in ALL {
        // large enough to be split over rayon tasks
        let (rows, cols) = (1027, 1024);
        let data = random_matrix(dtype, rows, cols, &mut g);
        let w = Matrix::new(dtype, rows, cols, &data).expect("shape");
        for n in [1, 2] {
            let x = random_f32(n * cols, &mut g);
            let run = |threads| {
                let mut y = vec![0f32; n * rows];
                pool(threads)
                    .install(|| matmul(&w, &x, &mut y))
                    .expect("matmul");
                bits(&y)
            };
            assert_eq!(run(1), run(2), "{dtype} n={n}");
            assert_eq!(run(1), run(3), "{dtype} n={n}");
        }
    }
}

#[test]
fn attention_matches_reference_and_is_thread_independent() {
    let mut g = rng(14);
    for (n_ctx, n_heads, n_kv, hd) in [
        (1, 4, 2, 16),
        (17, 9, 3, 64),
        (513, 8, 2, 64),
        (64, 4, 4, 100),
    ] {
        let q = random_f32(n_heads * hd, &mut g);
        let k = random_f32(n_ctx * n_kv * hd, &mut g);
        let v = random_f32(n_ctx * n_kv * hd, &mut g);
        let mut want = vec![0f32; n_heads * hd];
        attention_ref(&q, &k, &v, n_ctx, n_heads, n_kv, hd, &mut want);
        let run = |threads| {
            let mut out = vec![0f32; n_heads * hd];
            pool(threads).install(|| attention(&q, &k, &v, n_ctx, n_heads, n_kv, hd, &mut out));
            out
        };
        let one = run(1);
        assert_eq!(bits(&one), bits(&run(2)), "threads, n_ctx {n_ctx}");
        for (a, b) in one.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}

#[test]
fn attention_grouped_heads_share_kv() {
    // GQA with 2 kv heads == MHA with each kv head repeated for its group of query heads
    let mut g = rng(15);
    let (n_ctx, n_heads, n_kv, hd) = (20, 6, 2, 32);
    let q = random_f32(n_heads * hd, &mut g);
    let k = random_f32(n_ctx * n_kv * hd, &mut g);
    let v = random_f32(n_ctx * n_kv * hd, &mut g);
    let expand = |src: &[f32]| -> Vec<f32> {
        let mut out = Vec::new();
        for t in 0..n_ctx {
            for h in 0..n_heads {
                let kv = h / (n_heads / n_kv);
                out.extend_from_slice(&src[(t * n_kv + kv) * hd..(t * n_kv + kv + 1) * hd]);
            }
        }
        out
    };
    let (mut a, mut b) = (vec![0f32; n_heads * hd], vec![0f32; n_heads * hd]);
    attention(&q, &k, &v, n_ctx, n_heads, n_kv, hd, &mut a);
    attention(
        &q,
        &expand(&k),
        &expand(&v),
        n_ctx,
        n_heads,
        n_heads,
        hd,
        &mut b,
    );
    assert_eq!(bits(&a), bits(&b));
    // one position: the output is that position's value row
    let mut one = vec![0f32; n_heads * hd];
    attention(&q, &k, &v, 1, n_heads, n_kv, hd, &mut one);
    for h in 0..n_heads {
        let kv = h / 3;
        assert_eq!(&one[h * hd..(h + 1) * hd], &v[kv * hd..(kv + 1) * hd]);
    }
}

#[test]
fn rmsnorm_silu_rope_match_formulas() {
    let mut g = rng(16);
    let x = random_f32(576, &mut g);
    let w = random_f32(576, &mut g);
    let mut out = vec![0f32; 576];
    rmsnorm(&x, &w, 1e-5, &mut out);
    let ms: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / 576.0;
    let inv = 1.0 / (ms + 1e-5).sqrt();
    for i in 0..576 {
        let e = x[i] as f64 * inv * w[i] as f64;
        assert!(
            (out[i] as f64 - e).abs() <= 1e-6 * (1.0 + e.abs()),
            "rmsnorm {i}"
        );
    }

    let mut gate: Vec<f32> = random_f32(1000, &mut g).iter().map(|v| v * 20.0).collect();
    gate.extend_from_slice(&[0.0, -0.0, 100.0, -100.0, -1e30, 1e30]);
    let up = random_f32(gate.len(), &mut g);
    let mut s = gate.clone();
    silu_mul(&mut s, &up);
    for i in 0..gate.len() {
        let v = gate[i] as f64;
        let e = v / (1.0 + (-v).exp()) * up[i] as f64;
        assert!(
            (s[i] as f64 - e).abs() <= 1e-6 * (1.0 + e.abs()),
            "silu {}: {} vs {e}",
            gate[i],
            s[i]
        );
    }

    let mut h = random_f32(64, &mut g);
    let orig = h.clone();
    let (cos, sin): (Vec<f32>, Vec<f32>) = (0..32)
        .map(|i| ((i as f32 * 0.1).cos(), (i as f32 * 0.1).sin()))
        .unzip();
    rope_half(&mut h, &cos, &sin);
    for i in 0..32 {
        assert_eq!(h[i], orig[i] * cos[i] - orig[i + 32] * sin[i]);
        assert_eq!(h[i + 32], orig[i + 32] * cos[i] + orig[i] * sin[i]);
    }
}

// ------------------------------------------------------------------------------------------
// exact dequantization of hand-built blocks

fn f16b(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

fn dequant(dtype: DType, cols: usize, data: &[u8]) -> Vec<f32> {
    let w = Matrix::new(dtype, 1, cols, data).expect("shape");
    let mut out = vec![0f32; cols];
    dequant_row(&w, 0, &mut out).expect("row");
    out
}

#[test]
fn dequant_float_types() {
    let vals = [1.5f32, -2.25, 0.0, 65504.0, 1e-3, -7.0];
    let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(dequant(DType::F32, 6, &f32b), vals);
    let f16s: Vec<u8> = vals
        .iter()
        .flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    let want: Vec<f32> = vals.iter().map(|v| f16::from_f32(*v).to_f32()).collect();
    assert_eq!(dequant(DType::F16, 6, &f16s), want);
    let bf: Vec<u8> = vals
        .iter()
        .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    let want: Vec<f32> = vals.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
    assert_eq!(dequant(DType::BF16, 6, &bf), want);
}

#[test]
fn dequant_q8_0_block() {
    let mut b = f16b(0.5).to_vec();
    let qs: Vec<i8> = (0..32)
        .map(|j| [-128i8, -1, 0, 1, 127, 5, -7, 64][j % 8])
        .collect();
    b.extend(qs.iter().map(|&q| q as u8));
    let out = dequant(DType::Q8_0, 32, &b);
    assert_eq!(&out[..8], &[-64.0, -0.5, 0.0, 0.5, 63.5, 2.5, -3.5, 32.0]);
}

#[test]
fn dequant_q4_0_and_q4_1_blocks() {
    // byte j: low nibble j, high nibble 15 - j; low nibbles are elements 0..16
    let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
    let mut b = f16b(2.0).to_vec();
    b.extend(&qs);
    let out = dequant(DType::Q4_0, 32, &b);
    assert_eq!(out[0], -16.0); // (0 - 8) * 2
    assert_eq!(out[15], 14.0); // (15 - 8) * 2
    assert_eq!(out[16], 14.0); // high nibble of byte 0 = 15
    assert_eq!(out[31], -16.0);

    let mut b = f16b(0.25).to_vec();
    b.extend(f16b(-1.0));
    b.extend(&qs);
    let out = dequant(DType::Q4_1, 32, &b);
    assert_eq!(out[0], -1.0); // 0 * 0.25 - 1
    assert_eq!(out[5], 0.25); // 5 * 0.25 - 1
    assert_eq!(out[16], 2.75); // 15 * 0.25 - 1
    assert_eq!(out[31], -1.0);
}

/// Packs 256 4-bit values like ggml's `quantize_row_q4_K` (q[l] = L[l] | L[l + 32] << 4 per 64).
fn pack_q4k(levels: &[u8; 256]) -> Vec<u8> {
    let mut q = Vec::new();
    for j in (0..256).step_by(64) {
        for l in 0..32 {
            q.push(levels[j + l] | (levels[j + l + 32] << 4));
        }
    }
    q
}

#[test]
fn dequant_q4_k_block() {
    // sub-block scales sc = 1..=8 and mins m = 1, 3, .., 15, packed as ggml's 12-byte layout
    let sc: [u8; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
    let mn: [u8; 8] = [1, 3, 5, 7, 9, 11, 13, 15];
    let mut scales = [0u8; 12];
    scales[..4].copy_from_slice(&sc[..4]);
    scales[4..8].copy_from_slice(&mn[..4]);
    for j in 4..8 {
        scales[j + 4] = sc[j] | (mn[j] << 4);
    }
    let levels: [u8; 256] = std::array::from_fn(|i| ((i * 7 + 3) % 16) as u8);
    let (d, dmin) = (1.0f32, 0.5f32);
    let mut b = f16b(d).to_vec();
    b.extend(f16b(dmin));
    b.extend(scales);
    b.extend(pack_q4k(&levels));
    assert_eq!(b.len(), 144);
    let out = dequant(DType::Q4K, 256, &b);
    for (i, &v) in out.iter().enumerate() {
        let s = i / 32;
        let want = d * sc[s] as f32 * levels[i] as f32 - dmin * mn[s] as f32;
        assert_eq!(v, want, "element {i}");
    }
    assert_eq!(out[0], 3.0 - 0.5); // level 3, sc 1, m 1
    assert_eq!(out[33], 2.0 * 10.0 - 1.5); // level (33*7+3)%16 = 10, sc 2, m 3
}

#[test]
fn dequant_q6_k_block() {
    // 6-bit levels L, packed like ggml's quantize_row_q6_K
    let levels: [u8; 256] = std::array::from_fn(|i| ((i * 37 + 11) % 64) as u8);
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for (h, j) in (0..256).step_by(128).enumerate() {
        for l in 0..32 {
            let q = |o: usize| levels[j + l + o];
            ql[64 * h + l] = (q(0) & 0xF) | ((q(64) & 0xF) << 4);
            ql[64 * h + l + 32] = (q(32) & 0xF) | ((q(96) & 0xF) << 4);
            qh[32 * h + l] =
                (q(0) >> 4) | ((q(32) >> 4) << 2) | ((q(64) >> 4) << 4) | ((q(96) >> 4) << 6);
        }
    }
    let sc: [i8; 16] = std::array::from_fn(|g| g as i8 - 8);
    let d = 0.5f32;
    let mut b = ql.to_vec();
    b.extend(qh);
    b.extend(sc.iter().map(|&s| s as u8));
    b.extend(f16b(d));
    assert_eq!(b.len(), 210);
    let out = dequant(DType::Q6K, 256, &b);
    for (i, &v) in out.iter().enumerate() {
        let want = d * sc[i / 16] as f32 * (levels[i] as i32 - 32) as f32;
        assert_eq!(v, want, "element {i}");
    }
    assert_eq!(out[0], 0.5 * -8.0 * (11.0 - 32.0));
}

// ------------------------------------------------------------------------------------------
// errors, never panics

#[test]
fn bad_shapes_are_errors() {
    let data = vec![0u8; 4 * 34];
    let w = Matrix::new(DType::Q8_0, 2, 64, &data).expect("shape");
    let mut y = vec![0f32; 2];
    assert!(matches!(
        matmul(&w, &[0.0; 63], &mut y),
        Err(KernelError::NotMultiple { .. })
    ));
    assert!(matches!(
        matmul(&w, &[0.0; 64], &mut [0.0; 3]),
        Err(KernelError::Length { .. })
    ));
    assert!(matches!(
        matmul_ref(&w, &[0.0; 128], &mut y),
        Err(KernelError::Length { .. })
    ));
    assert!(matches!(
        Matrix::new(DType::Q4K, 1, 100, &data),
        Err(KernelError::PartialBlock { .. })
    ));
    assert!(matches!(
        Matrix::new(DType::Q8_0, 3, 64, &data),
        Err(KernelError::WrongSize { .. })
    ));
    // a hand-built inconsistent Matrix is rejected, not read out of bounds
    let bad = Matrix {
        dtype: DType::Q8_0,
        rows: 5,
        cols: 64,
        data: &data,
    };
    assert!(matches!(
        matmul(&bad, &[0.0; 64], &mut [0.0; 5]),
        Err(KernelError::WrongSize { .. })
    ));
    let bad = Matrix {
        dtype: DType::Q4_0,
        rows: 1,
        cols: 33,
        data: &data[..18],
    };
    assert!(matches!(
        matmul(&bad, &[0.0; 33], &mut [0.0; 1]),
        Err(KernelError::PartialBlock { .. })
    ));
    let bad = Matrix {
        dtype: DType::F32,
        rows: usize::MAX,
        cols: 4,
        data: &data,
    };
    assert!(matmul(&bad, &[0.0; 4], &mut [0.0; 1]).is_err());
    let mut out = vec![0f32; 64];
    assert!(matches!(
        dequant_row(&w, 2, &mut out),
        Err(KernelError::RowOutOfRange { .. })
    ));
    assert!(matches!(
        dequant_row(&w, 0, &mut out[..10]),
        Err(KernelError::Length { .. })
    ));
    // n = 0 is a no-op
    assert!(matmul(&w, &[], &mut []).is_ok());
}
