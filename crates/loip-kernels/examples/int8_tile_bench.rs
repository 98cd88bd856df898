//! What an integer-dot order with int8 activations could give prefill: a prototype AVX-512
//! VNNI tile for Q8_0 weights, against the f32-order tiles of `matmul`, on one thread.
//!
//! ```text
//! cargo run --release -p loip-kernels --example int8_tile_bench [-- --tokens N] [--rounds R]
//! ```
//! Not a kernel of the crate: a measurement for the choice of a prefill order (issue 33).
//! The order it prototypes: activations quantized per 32-element block to int8 (`dx = amax /
//! 127`, `q = round(x / dx)`), each output `acc = fma(f32(Σ qw·qx), dw·dx, acc)` over the
//! blocks in increasing order from `+0.0`. The block's integer sum is exact on every
//! instruction set (`vpdpbusd`, `vpmaddwd`, NEON `sdot` / `smlal`), so the order is
//! bit-identical across paths by construction; its numbers differ from the f32 order's by
//! the activations' rounding (as llama.cpp's Q8_0 × Q8_0 dot). Tile: 16 rows (one lane per
//! row: weights repacked 16 rows × 4 bytes per register, offset by 128 to unsigned, the
//! offset's `128 Σ qx` subtracted per block) × 8 tokens (each token's 4 bytes broadcast).
//! Prints GFLOP/s (2 per multiply-add, by CPU time, best of R rounds) of both, the time of the
//! activations' quantization per call (AVX-512), and checks the tile and the quantizer bit
//! for bit against their scalar models.

#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code, unused_imports))]

#[path = "../tests/common/mod.rs"]
mod common;

use loip_kernels::{matmul, DType, Matrix};
use rand::{Rng, SeedableRng};

/// Rows per tile (one per lane of a 512-bit register).
const ROWS: usize = 16;
/// Tokens per tile.
const TOKENS: usize = 8;

/// Activations quantized per 32-element block: int8 values, scales, and `128 Σ q` per block.
struct QAct {
    q: Vec<i8>,
    d: Vec<f32>,
    off: Vec<i32>,
}

fn quantize(x: &[f32]) -> QAct {
    let blocks = x.len() / 32;
    let mut a = QAct {
        q: vec![0i8; x.len()],
        d: vec![0f32; blocks],
        off: vec![0i32; blocks],
    };
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F detected; the buffers hold `blocks` blocks
        unsafe { quantize_avx512(x, &mut a) };
        return a;
    }
    quantize_scalar(x, &mut a);
    a
}

/// [`quantize`]'s scalar model.
fn quantize_scalar(x: &[f32], a: &mut QAct) {
    for b in 0..x.len() / 32 {
        let xb = &x[32 * b..32 * b + 32];
        let (db, inv) = block_scale(xb.iter().fold(0f32, |m, v| m.max(v.abs())));
        let mut s = 0i32;
        for (qi, &v) in a.q[32 * b..32 * b + 32].iter_mut().zip(xb) {
            *qi = (v * inv).round_ties_even() as i8;
            s += *qi as i32;
        }
        a.d[b] = db;
        a.off[b] = 128 * s;
    }
}

/// A block's scale `amax / 127` and its inverse (0 for an all-zero block).
fn block_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

/// [`quantize`] with AVX-512 (the same values: `vcvtps2dq` rounds ties to even).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_avx512(x: &[f32], a: &mut QAct) {
    use std::arch::x86_64::*;
    for b in 0..x.len() / 32 {
        let p = x.as_ptr().add(32 * b);
        let (v0, v1) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        let (db, inv) = block_scale(amax);
        let inv = _mm512_set1_ps(inv);
        let q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
        let q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        let o = a.q.as_mut_ptr().add(32 * b) as *mut __m128i;
        _mm_storeu_si128(o, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(o.add(1), _mm512_cvtsepi32_epi8(q1));
        a.d[b] = db;
        a.off[b] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/// Q8_0 weights repacked for the tile: per tile of 16 rows, per block, 8 registers of 16 rows
/// × 4 consecutive bytes (`q + 128`), then the 16 rows' scales.
struct Packed {
    bytes: Vec<u8>,
    scales: Vec<f32>,
}

fn pack(qw: &[i8], dw: &[f32], rows: usize, cols: usize) -> Packed {
    let blocks = cols / 32;
    let mut bytes = vec![0u8; rows * cols];
    let mut scales = vec![0f32; rows * blocks];
    for rt in 0..rows / ROWS {
        for b in 0..blocks {
            for g in 0..8 {
                for r in 0..ROWS {
                    for k in 0..4 {
                        let row = rt * ROWS + r;
                        let v = qw[row * cols + 32 * b + 4 * g + k];
                        bytes[((rt * blocks + b) * 8 + g) * 64 + 4 * r + k] =
                            (v as i16 + 128) as u8;
                    }
                }
            }
            for r in 0..ROWS {
                scales[(rt * blocks + b) * ROWS + r] = dw[(rt * ROWS + r) * blocks + b];
            }
        }
    }
    Packed { bytes, scales }
}

/// `y[t * rows + r]` in the prototype order (scalar model).
fn scalar(qw: &[i8], dw: &[f32], rows: usize, cols: usize, x: &QAct, n: usize, y: &mut [f32]) {
    let blocks = cols / 32;
    for t in 0..n {
        for r in 0..rows {
            let mut acc = 0f32;
            for b in 0..blocks {
                let mut s = 0i32;
                for i in 0..32 {
                    s += qw[r * cols + 32 * b + i] as i32 * x.q[t * cols + 32 * b + i] as i32;
                }
                acc = (s as f32).mul_add(dw[r * blocks + b] * x.d[t * blocks + b], acc);
            }
            y[t * rows + r] = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn tile_vnni(p: &Packed, rows: usize, cols: usize, x: &QAct, n: usize, y: &mut [f32]) {
    use std::arch::x86_64::*;
    let blocks = cols / 32;
    let xq = x.q.as_ptr() as *const i32;
    for rt in 0..rows / ROWS {
        let mut t0 = 0;
        while t0 < n {
            let mut acc = [_mm512_setzero_ps(); TOKENS];
            for b in 0..blocks {
                let wp = p.bytes.as_ptr().add((rt * blocks + b) * 512) as *const __m512i;
                let w: [__m512i; 8] = std::array::from_fn(|g| _mm512_loadu_si512(wp.add(g)));
                let dw = _mm512_loadu_ps(p.scales.as_ptr().add((rt * blocks + b) * ROWS));
                for (t, a) in acc.iter_mut().enumerate() {
                    let tb = (t0 + t) * blocks + b;
                    let xb = xq.add(tb * 8);
                    let mut s = _mm512_setzero_si512();
                    for (g, &wg) in w.iter().enumerate() {
                        s = _mm512_dpbusd_epi32(s, wg, _mm512_set1_epi32(*xb.add(g)));
                    }
                    s = _mm512_sub_epi32(s, _mm512_set1_epi32(*x.off.get_unchecked(tb)));
                    let d = _mm512_mul_ps(dw, _mm512_set1_ps(*x.d.get_unchecked(tb)));
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, *a);
                }
            }
            for (t, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(y.as_mut_ptr().add((t0 + t) * rows + rt * ROWS), *a);
            }
            t0 += TOKENS;
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("the prototype tile is AVX-512 VNNI only: nothing to measure here");
}

#[cfg(target_arch = "x86_64")]
fn main() {
    let (mut tokens, mut rounds) = (256usize, 3usize);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let v = it.next().and_then(|v| v.parse().ok());
        match (a.as_str(), v) {
            ("--tokens", Some(v)) => tokens = v,
            ("--rounds", Some(v)) => rounds = v,
            _ => {
                eprintln!("usage: int8_tile_bench [--tokens N] [--rounds R]");
                std::process::exit(2);
            }
        }
    }
    tokens = tokens.div_ceil(TOKENS).max(1) * TOKENS;
    if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni")) {
        println!("no AVX-512 VNNI here: nothing to measure");
        return;
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build();
    let Ok(pool) = pool else {
        eprintln!("thread pool");
        std::process::exit(1);
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(33);
    println!("{tokens} tokens, 1 thread, GFLOP/s per CPU second (2 per multiply-add)");
    println!("shape        f32 order (matmul)  int8 tile  ratio  quantize µs/call");
    pool.install(|| {
        for (rows, cols) in [(1024, 640), (2048, 640), (4864, 896), (896, 4864)] {
            let blocks = cols / 32;
            let qw: Vec<i8> = (0..rows * cols)
                .map(|_| rng.gen_range(-127..=127))
                .collect();
            let dw: Vec<f32> = (0..rows * blocks)
                .map(|_| rng.gen_range(1e-3..1e-2))
                .collect();
            // the same weights as a GGUF Q8_0 matrix (f16 scale, 32 int8 per block)
            let mut data = Vec::with_capacity(rows * blocks * 34);
            let mut dw16 = dw.clone();
            for r in 0..rows {
                for b in 0..blocks {
                    let h = half::f16::from_f32(dw[r * blocks + b]);
                    dw16[r * blocks + b] = h.to_f32();
                    data.extend_from_slice(&h.to_le_bytes());
                    data.extend(
                        qw[r * cols + 32 * b..r * cols + 32 * b + 32]
                            .iter()
                            .map(|&q| q as u8),
                    );
                }
            }
            let w = Matrix::new(DType::Q8_0, rows, cols, &data).expect("shape");
            let x = common::random_f32(tokens * cols, &mut rng);
            let mut y = vec![0f32; tokens * rows];
            let flops = 2.0 * (rows * cols * tokens) as f64;
            let best = |f: &mut dyn FnMut()| {
                (0..rounds)
                    .map(|_| common::cpu_ns_per_call(&mut *f))
                    .fold(f64::MAX, f64::min)
            };
            let f32_ns = best(&mut || matmul(&w, &x, &mut y).expect("matmul"));
            let p = pack(&qw, &dw16, rows, cols);
            let qx = quantize(&x);
            let mut qs = QAct {
                q: vec![0; qx.q.len()],
                d: vec![0.0; qx.d.len()],
                off: vec![0; qx.off.len()],
            };
            quantize_scalar(&x, &mut qs);
            let same_d =
                qx.d.iter()
                    .zip(&qs.d)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                qx.q == qs.q && qx.off == qs.off && same_d,
                "quantizers differ"
            );
            let q_ns = best(&mut || {
                std::hint::black_box(quantize(&x));
            });
            // SAFETY: AVX-512F and VNNI detected; rows a multiple of 16, tokens of 8
            let int_ns = best(&mut || unsafe { tile_vnni(&p, rows, cols, &qx, tokens, &mut y) });
            let mut want = vec![0f32; tokens * rows];
            scalar(&qw, &dw16, rows, cols, &qx, tokens, &mut want);
            let same = y.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "the tile differs from the scalar model");
            println!(
                "{rows:>5}x{cols:<5}  {:>17.1}  {:>9.1}  {:>5.2}  {:>9.1}",
                flops / f32_ns,
                flops / int_ns,
                f32_ns / int_ns,
                q_ns / 1e3
            );
        }
    });
}
