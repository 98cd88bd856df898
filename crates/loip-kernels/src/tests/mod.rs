//! In-crate tests: every SIMD level this CPU runs must give the same bits as the portable
//! canonical path, for every kernel and odd shapes (tails, remainders, tiles).

mod attn_tiles;
mod intdot;
#[cfg(all(target_arch = "aarch64", target_endian = "little"))]
mod neon;
mod single_token;
mod team;

use crate::attention::{attention_at, attention_causal_at};
use crate::canon;
use crate::dispatch;
use crate::dtype::{DType, Matrix};
use crate::elementwise::rmsnorm_at;
use crate::matmul::{matmul_at, matmul_many_at};
use crate::simd::{supported, Level};
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Every level; a test runs those [`supported`] here (x86: AVX2, AVX-512; aarch64: NEON).
const LEVELS: [Level; 4] = [Level::Scalar, Level::Avx2, Level::Avx512, Level::Neon];

const ALL: [DType; 8] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q4K,
    DType::Q6K,
];

/// The other GGUF types (`quant_ext`, `quant_k_ext`): the batched tests take them too.
pub(crate) const EXT: [DType; 7] = [
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q5K,
    DType::IQ4NL,
    DType::IQ4XS,
];

/// Random bytes with finite f16 scales (the exact helper of the integration tests, reduced).
fn random_matrix(dtype: DType, rows: usize, cols: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
    let rb = dtype.row_bytes(cols).expect("whole blocks");
    let mut data = vec![0u8; rows * rb];
    let put = |b: &mut [u8], at: usize, v: f32| {
        b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())
    };
    match dtype {
        DType::F32 => data
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&rng.gen_range(-1.0f32..1.0).to_le_bytes())),
        DType::F16 | DType::BF16 => {
            for c in data.chunks_exact_mut(2) {
                let v = rng.gen_range(-1.0f32..1.0);
                let bits = if dtype == DType::F16 {
                    f16::from_f32(v).to_bits()
                } else {
                    half::bf16::from_f32(v).to_bits()
                };
                c.copy_from_slice(&bits.to_le_bytes());
            }
        }
        _ => {
            rng.fill(&mut data[..]);
            for b in data.chunks_exact_mut(dtype.block_bytes()) {
                let d = rng.gen_range(-0.05f32..0.05);
                let m = rng.gen_range(-0.05f32..0.05);
                // the f16 scales (and minimums) of each type's block
                match dtype {
                    DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4NL | DType::IQ4XS => {
                        put(b, 0, d)
                    }
                    DType::Q4_1 | DType::Q4K | DType::Q5_1 | DType::Q5K => {
                        put(b, 0, d);
                        put(b, 2, m);
                    }
                    DType::Q2K => {
                        put(b, 80, d);
                        put(b, 82, m);
                    }
                    DType::Q3K => put(b, 108, d),
                    _ => put(b, 208, d),
                }
            }
        }
    }
    data
}

fn random_f32(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Column counts exercising every remainder path of `dtype`.
fn col_cases(dtype: DType) -> Vec<usize> {
    match dtype.block_elems() {
        1 => vec![1, 7, 16, 17, 48, 63, 64, 65, 100, 576, 1000, 1041],
        32 => vec![32, 64, 96, 160, 256, 288, 576, 1536],
        _ => vec![256, 512, 768, 1536],
    }
}

#[test]
fn matmul_levels_bit_identical() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    for dtype in ALL {
        for cols in col_cases(dtype) {
            for (rows, n) in [(1, 1), (5, 1), (9, 2), (13, 5), (4, 4), (67, 3)] {
                let data = random_matrix(dtype, rows, cols, &mut rng);
                let w = Matrix::new(dtype, rows, cols, &data).expect("shape");
                let x = random_f32(n * cols, &mut rng);
                let mut want = vec![0f32; n * rows];
                matmul_at(Level::Scalar, &w, &x, &mut want).expect("matmul");
                for level in LEVELS.into_iter().filter(|&l| supported(l)) {
                    let mut y = vec![f32::NAN; n * rows];
                    matmul_at(level, &w, &x, &mut y).expect("matmul");
                    assert_eq!(
                        bits(&y),
                        bits(&want),
                        "{dtype} {rows}x{cols} n={n} {level:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn matmul_many_is_separate_matmuls_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for dtype in ALL {
        let cols = *col_cases(dtype).last().expect("cases");
        // q, k, v-like shapes: big enough to be split over the threads
        let shapes = [(96, cols), (33, cols), (40, cols)];
        let datas: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(r, c)| random_matrix(dtype, r, c, &mut rng))
            .collect();
        let ws: Vec<Matrix> = shapes
            .iter()
            .zip(&datas)
            .map(|(&(r, c), d)| Matrix::new(dtype, r, c, d).expect("shape"))
            .collect();
        let w_refs: Vec<&Matrix> = ws.iter().collect();
        // n > 1: one parallel region over all matrices where each takes the tiled kernel
        // (above 8 tokens split at finer row boundaries)
        for n in [1, 2, 3, 4, 8, 9, 40] {
            let x = random_f32(n * cols, &mut rng);
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("pool");
                for level in LEVELS.into_iter().filter(|&l| supported(l)) {
                    let mut outs: Vec<Vec<f32>> =
                        shapes.iter().map(|&(r, _)| vec![f32::NAN; n * r]).collect();
                    pool.install(|| {
                        let mut ys: Vec<&mut [f32]> =
                            outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                        matmul_many_at(level, &w_refs, &x, &mut ys).expect("matmul_many")
                    });
                    for (w, got) in ws.iter().zip(&outs) {
                        let mut want = vec![0f32; n * w.rows];
                        matmul_at(Level::Scalar, w, &x, &mut want).expect("matmul");
                        assert_eq!(
                            bits(got),
                            bits(&want),
                            "{dtype} {}x{cols} n={n} threads={threads} {level:?}",
                            w.rows
                        );
                    }
                }
            }
        }
    }
    // mismatched lists and shapes are errors
    let data = random_matrix(DType::F32, 4, 16, &mut rng);
    let w = Matrix::new(DType::F32, 4, 16, &data).expect("shape");
    let x = random_f32(16, &mut rng);
    let mut y = [0f32; 4];
    assert!(matmul_many_at(Level::Scalar, &[&w, &w], &x, &mut [&mut y[..]]).is_err());
    assert!(matmul_many_at(Level::Scalar, &[&w], &x[..15], &mut [&mut y[..]]).is_err());
}

#[test]
fn scalar_path_is_canonical_dot_of_dequantized_row() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for dtype in ALL {
        let cols = col_cases(dtype)[1];
        let data = random_matrix(dtype, 3, cols, &mut rng);
        let w = Matrix::new(dtype, 3, cols, &data).expect("shape");
        let x = random_f32(cols, &mut rng);
        let mut y = vec![0f32; 3];
        matmul_at(Level::Scalar, &w, &x, &mut y).expect("matmul");
        let mut row = vec![0f32; cols];
        let rb = dtype.row_bytes(cols).expect("blocks");
        for (r, yr) in y.iter().enumerate() {
            let want = if crate::intdot::handles(dtype) {
                // the integer-dot order (`crate::intdot`)
                let mut o = [0f32];
                let q = crate::intdot::quantize(&x, cols);
                crate::intdot::dots_scalar(dtype, &data[r * rb..(r + 1) * rb], &q, &mut o);
                o[0]
            } else {
                crate::dequant_row(&w, r, &mut row).expect("row");
                canon::dot_f32(&row, &x)
            };
            assert_eq!(yr.to_bits(), want.to_bits(), "{dtype}");
        }
    }
}

#[test]
fn dot_exp_act_rows_levels_bit_identical() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for len in [0, 1, 5, 8, 15, 16, 17, 31, 64, 65, 130, 1000] {
        let a = random_f32(len, &mut rng);
        let b = random_f32(len, &mut rng);
        // exp inputs across the whole range, with the special values
        let mut e: Vec<f32> = (0..len).map(|_| rng.gen_range(-120.0f32..100.0)).collect();
        for (i, s) in [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            -86.6,
            88.72,
        ]
        .iter()
        .enumerate()
        {
            if i < e.len() {
                e[i] = *s;
            }
        }
        let want_dot = canon::dot_f32(&a, &b);
        let want_exp: Vec<f32> = e.iter().map(|&v| canon::exp(v)).collect();
        let mut want_silu = a.clone();
        canon::act_mul_scalar(canon::Act::Silu, &mut want_silu, &b);
        // GELU inputs: its whole range (the exp's clamps at both ends), with special values
        let mut ge: Vec<f32> = (0..len).map(|_| rng.gen_range(-40.0f32..40.0)).collect();
        for (i, s) in [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            1e20,
            -1e20,
            -9.3,
        ]
        .iter()
        .enumerate()
        {
            if i < ge.len() {
                ge[i] = *s;
            }
        }
        let mut want_gelu = ge.clone();
        canon::act_mul_scalar(canon::Act::GeluTanh, &mut want_gelu, &b);
        for level in LEVELS.into_iter().filter(|&l| supported(l)) {
            assert_eq!(
                dispatch::dot_f32(level, &a, &b).to_bits(),
                want_dot.to_bits(),
                "dot {len} {level:?}"
            );
            let mut got = e.clone();
            dispatch::exp_inplace(level, &mut got);
            for (g, w) in got.iter().zip(&want_exp) {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "exp {level:?}: {g} vs {w}"
                );
            }
            let mut s = a.clone();
            dispatch::act_mul(level, canon::Act::Silu, &mut s, &b);
            assert_eq!(bits(&s), bits(&want_silu), "silu {len} {level:?}");
            let mut s = ge.clone();
            dispatch::act_mul(level, canon::Act::GeluTanh, &mut s, &b);
            for (g, w) in s.iter().zip(&want_gelu) {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "gelu {len} {level:?}: {g} vs {w}"
                );
            }
            // rows of `len` columns, stride len + 3, 19 rows (two blocks of 8 and a rest)
            let stride = len + 3;
            let rows = random_f32(19 * stride, &mut rng);
            let p = random_f32(19, &mut rng);
            let mut want = vec![0f32; 19];
            dispatch::dot_rows(Level::Scalar, &a, &rows, stride, &mut want);
            let mut got = vec![0f32; 19];
            dispatch::dot_rows(level, &a, &rows, stride, &mut got);
            assert_eq!(bits(&got), bits(&want), "dot_rows {len} {level:?}");
            let mut want = b.clone();
            dispatch::weighted_rows(Level::Scalar, &p, &rows, stride, &mut want);
            let mut got = b.clone();
            dispatch::weighted_rows(level, &p, &rows, stride, &mut got);
            assert_eq!(bits(&got), bits(&want), "weighted_rows {len} {level:?}");
        }
    }
}

#[test]
fn attention_and_rmsnorm_levels_bit_identical() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for (n_ctx, n_heads, n_kv, hd) in [
        (1, 1, 1, 16),
        (7, 4, 2, 64),
        (33, 9, 3, 64),
        (100, 8, 8, 24),
        (300, 6, 1, 128),
    ] {
        let q = random_f32(n_heads * hd, &mut rng);
        let k = random_f32(n_ctx * n_kv * hd, &mut rng);
        let v = random_f32(n_ctx * n_kv * hd, &mut rng);
        let mut want = vec![0f32; n_heads * hd];
        attention_at(
            Level::Scalar,
            &q,
            &k,
            &v,
            n_ctx,
            n_heads,
            n_kv,
            hd,
            &mut want,
        );
        for level in LEVELS.into_iter().filter(|&l| supported(l)) {
            let mut out = vec![0f32; n_heads * hd];
            attention_at(level, &q, &k, &v, n_ctx, n_heads, n_kv, hd, &mut out);
            assert_eq!(
                bits(&out),
                bits(&want),
                "attention {n_ctx} {n_heads} {level:?}"
            );
        }
    }
    for len in [1, 17, 576, 2048] {
        let x = random_f32(len, &mut rng);
        let w = random_f32(len, &mut rng);
        let mut want = vec![0f32; len];
        rmsnorm_at(Level::Scalar, &x, &w, 1e-5, &mut want);
        for level in LEVELS.into_iter().filter(|&l| supported(l)) {
            let mut out = vec![0f32; len];
            rmsnorm_at(level, &x, &w, 1e-5, &mut out);
            assert_eq!(bits(&out), bits(&want), "rmsnorm {len} {level:?}");
        }
    }
}

/// Prompt attention tiled over queries is each query's decode attention, bit for bit, on
/// every level and thread count (query blocks of 16, chunks starting mid-cache).
#[test]
fn causal_attention_is_token_by_token() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for (start, m, n_heads, n_kv, hd) in [
        (0, 1, 1, 1, 16),
        (0, 37, 9, 3, 64),
        (5, 20, 4, 2, 24),
        (130, 17, 6, 1, 32),
    ] {
        let n = start + m;
        let q = random_f32(m * n_heads * hd, &mut rng);
        let k = random_f32(n * n_kv * hd, &mut rng);
        let v = random_f32(n * n_kv * hd, &mut rng);
        let w = n_heads * hd;
        for level in LEVELS.into_iter().filter(|&l| supported(l)) {
            let mut want = vec![0f32; m * w];
            for (i, o) in want.chunks_exact_mut(w).enumerate() {
                let qi = &q[i * w..(i + 1) * w];
                attention_at(level, qi, &k, &v, start + i + 1, n_heads, n_kv, hd, o);
            }
            for threads in [1, 2, 3] {
                let got = causal_on(
                    level,
                    threads,
                    &q,
                    &k,
                    &v,
                    start,
                    (n_heads, n_kv, hd),
                    m * w,
                );
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "causal {start}+{m} {n_heads}/{n_kv} {level:?} threads={threads}"
                );
            }
        }
    }
}

#[test]
fn unsupported_level_falls_back() {
    // asking for any level is safe: unsupported ones run the scalar path
    let a = [1.0f32; 40];
    for level in LEVELS {
        assert_eq!(dispatch::dot_f32(level, &a, &a), 40.0);
    }
}

#[test]
fn softmax_sum_is_canonical_dot_with_ones() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for len in [0, 1, 15, 16, 17, 63, 64, 65, 100, 129, 1000, 2048] {
        let s: Vec<f32> = (0..len).map(|_| rng.gen_range(0.0f32..1.0)).collect();
        let ones = vec![1.0f32; len];
        assert_eq!(
            crate::attention::sum(&s).to_bits(),
            canon::dot_f32(&s, &ones).to_bits(),
            "len {len}"
        );
    }
}

/// Prefill, chunked prefill and batched decode are token-by-token decoding, bit for bit: a
/// matmul of `n = 1..=17` tokens (register-tiled on x86) equals `n` one-token matmuls on the
/// portable path, for every dtype (the GGUF extras Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL and
/// IQ4_XS included), SIMD level, odd row counts (partial row tiles, several panels) and 1–3
/// threads.
#[test]
fn batched_matmul_is_token_by_token_every_level() {
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    for dtype in ALL.into_iter().chain(EXT) {
        let cases = col_cases(dtype);
        // a short row, a middle one and the longest (several panels for the tiled kernel)
        let picks = [cases[0], cases[cases.len() / 2], cases[cases.len() - 1]];
        for (i, cols) in picks.into_iter().enumerate() {
            let rows = [13, 7, 67][i];
            let data = random_matrix(dtype, rows, cols, &mut rng);
            let w = Matrix::new(dtype, rows, cols, &data).expect("shape");
            let x = random_f32(40 * cols, &mut rng);
            let want: Vec<u32> = (0..40)
                .flat_map(|t| {
                    let mut y = vec![0f32; rows];
                    matmul_at(Level::Scalar, &w, &x[t * cols..(t + 1) * cols], &mut y)
                        .expect("matmul");
                    bits(&y)
                })
                .collect();
            for level in LEVELS.into_iter().filter(|&l| supported(l)) {
                for n in 1..=17 {
                    let mut y = vec![f32::NAN; n * rows];
                    matmul_at(level, &w, &x[..n * cols], &mut y).expect("matmul");
                    assert_eq!(
                        bits(&y),
                        want[..n * rows],
                        "{dtype} {rows}x{cols} n={n} {level:?}"
                    );
                }
                // the longest rows are split over the threads
                if i == 2 {
                    for threads in [1, 2, 3] {
                        let pool = rayon::ThreadPoolBuilder::new()
                            .num_threads(threads)
                            .build()
                            .expect("pool");
                        for n in [2, 5, 8, 9, 16, 40] {
                            let mut y = vec![f32::NAN; n * rows];
                            pool.install(|| matmul_at(level, &w, &x[..n * cols], &mut y))
                                .expect("matmul");
                            assert_eq!(
                                bits(&y),
                                want[..n * rows],
                                "{dtype} {rows}x{cols} n={n} threads={threads} {level:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The tiled kernel gives the canonical dots on its own, whichever level the dispatcher picks
/// for batches (on AVX-512 machines too).
#[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
#[test]
fn tiled_kernel_bit_identical() {
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    if !supported(Level::Avx2) {
        return;
    }
    for dtype in ALL.into_iter().chain(EXT) {
        let cases = col_cases(dtype);
        // the extras: a short row, a middle one and the longest
        let cols_of = if ALL.contains(&dtype) {
            cases
        } else {
            vec![cases[0], cases[cases.len() / 2], cases[cases.len() - 1]]
        };
        for cols in cols_of {
            let rows = 11;
            let data = random_matrix(dtype, rows, cols, &mut rng);
            let rb = dtype.row_bytes(cols).expect("blocks");
            for n in [2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 18, 33, 50] {
                let x = random_f32(n * cols, &mut rng);
                let mut want = vec![0f32; rows * n];
                for (r, o) in want.chunks_exact_mut(n).enumerate() {
                    let row = &data[r * rb..(r + 1) * rb];
                    crate::dequant::row_dots_scalar(dtype, row, cols, &x, o);
                }
                // the token-lane tiles (16 tokens and more) and the column-lane ones, the
                // short batches' in-register tiles and the panels; other tests running
                // meanwhile see either, with the same bits
                let shapes = [(false, false), (false, true), (true, false)];
                for ((wide, lanes), short_off) in
                    shapes.into_iter().flat_map(|s| [(s, false), (s, true)])
                {
                    if wide && !supported(Level::Avx512) {
                        continue;
                    }
                    crate::simd::set_lane_tiles(lanes);
                    crate::simd::set_short_tiles_off(short_off);
                    let mut got = vec![f32::NAN; rows * n];
                    // SAFETY: AVX2 (and AVX-512 if wide) is supported; lengths as documented
                    unsafe {
                        let out = crate::x86::gemm::Out::row_major(&mut got, n);
                        crate::x86::gemm::rows(wide, dtype, &data, cols, &x, n, rows, out, None)
                    };
                    crate::simd::set_lane_tiles(false);
                    crate::simd::set_short_tiles_off(false);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{dtype} {rows}x{cols} n={n} wide={wide} lanes={lanes} short_off={short_off}"
                    );
                }
            }
        }
    }
}

/// `attention_causal_at` on `level` in a pool of `threads`, into `len` fresh outputs.
#[allow(clippy::too_many_arguments)]
pub(super) fn causal_on(
    level: Level,
    threads: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    start: usize,
    shape: (usize, usize, usize),
    len: usize,
) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let mut got = vec![f32::NAN; len];
    pool.install(|| attention_causal_at(level, q, k, v, start, shape, &mut got));
    got
}
