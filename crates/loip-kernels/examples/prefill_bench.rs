//! Prefill matmuls of real models' layers, by CPU time, against this core's FMA peak.
//!
//! ```text
//! cargo run --release -p loip-kernels --example prefill_bench [-- --tokens N] [--model M] [--rounds R]
//! cargo run --release -p loip-kernels --example prefill_bench -- --shape 1024x1024:Q6_K [--shape ..]
//! ```
//! For each matrix of one layer of SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M and Qwen2.5-0.5B
//! Q4_K_M (their shapes and stored types; `--model smollm2`, `gemma3` or `qwen2.5` for one), GFLOP/s of `matmul` with `N`
//! tokens (default 256, a prompt) on one thread, by the thread's CPU time (meaningful on a
//! machine shared with other work), best of `R` rounds (default 3), and its share of the FMA
//! peak; then the whole layer's matmuls in µs per token and their time's share by stored
//! type, and its gated activation (tanh GELU
//! for Gemma 3, SiLU for the others) in µs per token. The peak is that of one core,
//! measured by a loop of 12 independent fma chains at the level the kernels run
//! (multiply-adds per second × 2; `LOIP_SIMD=avx2` gives the AVX2 figures); where the CPU
//! has AVX-512 VNNI, also the int8 and int16 dot peaks of one core (`vpdpbusd`, `vpdpwssd`
//! chains), the ceilings of integer-dot orders with int8 or int16 activations.
//!
//! `--scaling`: instead, the layer's matmuls as the engine calls them (q, k, v in one
//! `matmul_many`, o, gate and up in one `matmul_many`, down), each in `on_pool` steps of a
//! 1-thread and a 2-thread pool, alternating (one step per round and pool: an untimed call,
//! then 4 timed), wall time, best of all: ms per call at 1
//! and 2 threads and the speedup (what the split of rows between a step's threads leaves of
//! the 2×; run it on a quiet machine, as it times wall clock). `--unpinned`: the team's threads
//! stay where the scheduler puts them (`set_pin_off`) instead of one per core.
//!
//! `--shape ROWSxCOLS:TYPE` (repeatable; a GGUF type name such as `Q5_0`, any case): only these
//! matrices instead of the models' layers, e.g. one shape per stored type for the per-type
//! rates of `docs/benchmarks.md`, or a model's matrix in another type.

#[path = "../tests/common/mod.rs"]
mod common;

use loip_kernels::{
    gelu_tanh_mul, matmul, matmul_many, on_pool, set_pin_off, silu_mul, simd_level, DType, LineVec,
    Matrix,
};
use rand::SeedableRng;

/// A gated activation kernel: `(gate, up)`, `gate` in place.
type Act = fn(&mut [f32], &[f32]);

/// One matrix of a layer: name, rows, cols, stored type.
type Shape = (&'static str, usize, usize, DType);

/// SmolLM2-135M Q4_1 (its GGUF: every layer matrix Q4_1).
const SMOLLM2: [Shape; 7] = [
    ("attn_q", 576, 576, DType::Q4_1),
    ("attn_k", 192, 576, DType::Q4_1),
    ("attn_v", 192, 576, DType::Q4_1),
    ("attn_output", 576, 576, DType::Q4_1),
    ("ffn_gate", 1536, 576, DType::Q4_1),
    ("ffn_up", 1536, 576, DType::Q4_1),
    ("ffn_down", 576, 1536, DType::Q4_1),
];

/// Gemma 3 270M Q4_K_M: the types of its GGUF (attn_v and ffn_down alternate between two
/// types over the layers: the first is listed).
const GEMMA3: [Shape; 7] = [
    ("attn_q", 1024, 640, DType::Q5_0),
    ("attn_k", 256, 640, DType::Q5_0),
    ("attn_v", 256, 640, DType::Q8_0),
    ("attn_output", 640, 1024, DType::Q4K),
    ("ffn_gate", 2048, 640, DType::Q5_0),
    ("ffn_up", 2048, 640, DType::Q5_0),
    ("ffn_down", 640, 2048, DType::Q6K),
];

/// Qwen2.5-0.5B Q4_K_M: rows of 896 (not a multiple of 256) fall back to Q5_0 / Q8_0.
const QWEN25: [Shape; 7] = [
    ("attn_q", 896, 896, DType::Q5_0),
    ("attn_k", 128, 896, DType::Q5_0),
    ("attn_v", 128, 896, DType::Q8_0),
    ("attn_output", 896, 896, DType::Q5_0),
    ("ffn_gate", 4864, 896, DType::Q5_0),
    ("ffn_up", 4864, 896, DType::Q5_0),
    ("ffn_down", 896, 4864, DType::Q6K),
];

/// `ROWSxCOLS:TYPE` (a GGUF type name, any case) as a shape named "shape".
fn parse_shape(s: &str) -> Option<Shape> {
    let (dims, ty) = s.split_once(':')?;
    let (r, c) = dims.split_once('x')?;
    let dtype = DType::from_name(&ty.to_ascii_uppercase())?;
    Some(("shape", r.parse().ok()?, c.parse().ok()?, dtype))
}

/// Multiply-adds per CPU second of 12 independent fma chains at the widest level.
fn fma_peak() -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f")]
        unsafe fn chains512(iters: u64) -> f32 {
            let mut a = [_mm512_set1_ps(1.0); 12];
            let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
            for _ in 0..iters {
                for v in a.iter_mut() {
                    *v = _mm512_fmadd_ps(*v, b, c);
                }
            }
            a.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn chains256(iters: u64) -> f32 {
            let mut a = [_mm256_set1_ps(1.0); 12];
            let (b, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
            for _ in 0..iters {
                for v in a.iter_mut() {
                    *v = _mm256_fmadd_ps(*v, b, c);
                }
            }
            let mut s = [0f32; 8];
            a.iter()
                .map(|&v| {
                    _mm256_storeu_ps(s.as_mut_ptr(), v);
                    s[0]
                })
                .sum()
        }
        let iters = 1_000_000u64;
        let (lanes, ns) = if simd_level() == "avx512" {
            // SAFETY: AVX-512F detected (the kernels' level)
            (
                16.0,
                common::cpu_ns_per_call(|| {
                    std::hint::black_box(unsafe { chains512(std::hint::black_box(iters)) });
                }),
            )
        } else if simd_level() == "avx2" {
            // SAFETY: AVX2 and FMA detected (the kernels' level)
            (
                8.0,
                common::cpu_ns_per_call(|| {
                    std::hint::black_box(unsafe { chains256(std::hint::black_box(iters)) });
                }),
            )
        } else {
            return 0.0;
        };
        12.0 * lanes * iters as f64 / ns * 1e9
    }
    #[cfg(not(target_arch = "x86_64"))]
    0.0
}

/// Multiply-adds per CPU second of 12 independent AVX-512 VNNI chains (0 without VNNI):
/// `vpdpbusd` (u8 × i8, 64 per instruction) if `int8`, else `vpdpwssd` (i16 × i16, 32 per
/// instruction): the ceilings of integer-dot orders with int8 or int16 activations, next to
/// [`fma_peak`]'s f32 ceiling.
fn int_peak(int8: bool) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f,avx512vnni")]
        unsafe fn chains(iters: u64, int8: bool) -> i32 {
            let mut a = [_mm512_set1_epi32(1); 12];
            let (b, c) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
            if int8 {
                for _ in 0..iters {
                    for v in a.iter_mut() {
                        *v = _mm512_dpbusd_epi32(*v, b, c);
                    }
                }
            } else {
                for _ in 0..iters {
                    for v in a.iter_mut() {
                        *v = _mm512_dpwssd_epi32(*v, b, c);
                    }
                }
            }
            a.iter().map(|&v| _mm512_reduce_add_epi32(v)).sum()
        }
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni")) {
            return 0.0;
        }
        let iters = 1_000_000u64;
        // SAFETY: AVX-512F and AVX-512 VNNI detected above
        let ns = common::cpu_ns_per_call(|| {
            std::hint::black_box(unsafe { chains(std::hint::black_box(iters), int8) });
        });
        let per_instr = if int8 { 64.0 } else { 32.0 };
        12.0 * per_instr * iters as f64 / ns * 1e9
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = int8;
        0.0
    }
}

fn main() {
    let mut tokens = 256usize;
    let mut rounds = 3usize;
    let mut models: Vec<(&str, Vec<Shape>)> = vec![
        ("smollm2", SMOLLM2.to_vec()),
        ("gemma3", GEMMA3.to_vec()),
        ("qwen2.5", QWEN25.to_vec()),
    ];
    let mut custom: Vec<Shape> = Vec::new();
    let mut scaling = false;
    let mut unpinned = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let num = |v: Option<String>| v.and_then(|v| v.parse().ok());
        match a.as_str() {
            "--tokens" => tokens = num(it.next()).unwrap_or(tokens).max(1),
            "--rounds" => rounds = num(it.next()).unwrap_or(rounds).max(1),
            "--scaling" => scaling = true,
            "--unpinned" => unpinned = true,
            "--model" => {
                let m = it.next().unwrap_or_default();
                models.retain(|(name, _)| *name == m);
            }
            "--shape" => match it.next().as_deref().and_then(parse_shape) {
                Some(shape) => custom.push(shape),
                None => {
                    eprintln!("--shape takes ROWSxCOLS:TYPE, e.g. 640x2048:q6_k");
                    std::process::exit(2);
                }
            },
            _ => {
                eprintln!(
                    "usage: prefill_bench [--tokens N] [--model smollm2|gemma3|qwen2.5] [--rounds R] [--scaling [--unpinned]] [--shape ROWSxCOLS:TYPE ...]"
                );
                std::process::exit(2);
            }
        }
    }
    if !custom.is_empty() {
        // only the given matrices (and the activation of the first one's rows)
        models = vec![("shapes", custom)];
    }
    if scaling {
        scaling_table(&models, tokens, rounds, unpinned);
        return;
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build();
    let Ok(pool) = pool else {
        eprintln!("thread pool");
        std::process::exit(1);
    };
    pool.install(|| {
        let peak = 2.0 * fma_peak() / 1e9;
        println!(
            "simd {}, {tokens} tokens, 1 thread, GFLOP/s per CPU second (share of the FMA peak, {peak:.1})",
            simd_level()
        );
        for (int8, what) in [(true, "int8 (vpdpbusd)"), (false, "int16 (vpdpwssd)")] {
            let ops = 2.0 * int_peak(int8) / 1e9;
            if ops > 0.0 {
                println!(
                    "{what} dot peak, 2 ops per multiply-add: {ops:.1} GOP/s, {:.1}x the f32 peak",
                    ops / peak
                );
            }
        }
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(33);
        for (name, shapes) in models {
            let mut layer = 0f64; // CPU ns per call of the whole layer
            let mut by_type: Vec<(&str, f64)> = Vec::new(); // CPU ns of the layer per stored type
            for &(m, rows, cols, dtype) in &shapes {
                let data = common::random_matrix(dtype, rows, cols, &mut rng);
                let w = Matrix::new(dtype, rows, cols, &data).expect("shape");
                let x = LineVec::from_slice(&common::random_f32(tokens * cols, &mut rng)); // on lines, as the engine's
                let mut y = vec![0f32; tokens * rows];
                let best = (0..rounds)
                    .map(|_| common::cpu_ns_per_call(|| matmul(&w, &x, &mut y).expect("matmul")))
                    .fold(f64::MAX, f64::min);
                let gf = 2.0 * (rows * cols * tokens) as f64 / best;
                println!(
                    "{name:<8} {m:<12} {rows:>5}x{cols:<5} {:<5} {gf:>6.1} ({:>3.0} %)",
                    dtype.name(),
                    100.0 * gf / peak
                );
                layer += best;
                match by_type.iter_mut().find(|(t, _)| *t == dtype.name()) {
                    Some((_, ns)) => *ns += best,
                    None => by_type.push((dtype.name(), best)),
                }
            }
            println!(
                "{name:<8} layer matmuls: {:.1} µs per token",
                layer / tokens as f64 / 1e3
            );
            // where the layer's matmul time goes, by stored type
            by_type.sort_by(|a, b| b.1.total_cmp(&a.1));
            let shares: Vec<String> = by_type
                .iter()
                .map(|(t, ns)| format!("{t} {:.0} %", 100.0 * ns / layer))
                .collect();
            println!("{name:<8} layer matmul time by type: {}", shares.join(", "));
            // the gated activation between the up/gate and down projections, on the gate's
            // (tokens, intermediate) output: Gemma 3's tanh GELU, SiLU for the others
            let inter = shapes[shapes.len().min(5) - 1].1;
            let (act_name, act): (&str, Act) = if name == "gemma3" {
                ("gelu_tanh_mul", gelu_tanh_mul)
            } else {
                ("silu_mul", silu_mul)
            };
            let src = common::random_f32(tokens * inter, &mut rng);
            let up = common::random_f32(tokens * inter, &mut rng);
            let mut gate = src.clone();
            let best = (0..rounds)
                .map(|_| {
                    common::cpu_ns_per_call(|| {
                        gate.copy_from_slice(&src); // fresh inputs each call
                        act(&mut gate, &up)
                    })
                })
                .fold(f64::MAX, f64::min);
            println!(
                "{name:<8} {act_name} ({tokens}x{inter}, with a copy of its input): {:.2} µs per token, {:.2} ns per element",
                best / tokens as f64 / 1e3,
                best / (tokens * inter) as f64
            );
        }
    });
}

/// Timed calls per step of `--scaling` (after one untimed call).
const CALLS_PER_STEP: usize = 4;

/// `--scaling`: the layer's matmul groups (as the engine calls them) at 1 and 2 threads.
fn scaling_table(models: &[(&str, Vec<Shape>)], tokens: usize, rounds: usize, unpinned: bool) {
    set_pin_off(unpinned);
    let pools: Vec<rayon::ThreadPool> = [1, 2]
        .iter()
        .filter_map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().ok())
        .collect();
    if pools.len() != 2 {
        eprintln!("thread pools");
        std::process::exit(1);
    }
    println!(
        "simd {}, {tokens} tokens, wall ms per call, best of {rounds} alternating rounds",
        simd_level()
    );
    println!("| model | matmuls | 1 thread | 2 threads | speedup |\n|---|---|---|---|---|");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(33);
    for (name, shapes) in models {
        if shapes.len() != 7 {
            continue; // a model's layer: q, k, v, o, gate, up, down
        }
        let data: Vec<Vec<u8>> = shapes
            .iter()
            .map(|&(_, r, c, t)| common::random_matrix(t, r, c, &mut rng))
            .collect();
        let ws: Vec<Matrix> = shapes
            .iter()
            .zip(&data)
            .map(|(&(_, r, c, t), d)| Matrix::new(t, r, c, d).expect("shape"))
            .collect();
        // the groups of one layer: indices into `ws`, all with the same input width
        let groups: [(&str, &[usize]); 4] = [
            ("q k v", &[0, 1, 2]),
            ("o", &[3]),
            ("gate up", &[4, 5]),
            ("down", &[6]),
        ];
        let mut total = [0f64; 2];
        for (gname, idx) in groups {
            let cols = ws[idx[0]].cols;
            let x = LineVec::from_slice(&common::random_f32(tokens * cols, &mut rng)); // on lines, as the engine's
            let mut ys: Vec<Vec<f32>> = idx
                .iter()
                .map(|&i| vec![0f32; tokens * ws[i].rows])
                .collect();
            let mut best = [f64::MAX; 2];
            let mut call = || {
                if let [i] = idx {
                    // a single matrix: `matmul`, as the engine calls it
                    return matmul(&ws[*i], &x, &mut ys[0]).expect("matmul");
                }
                let wr: Vec<&Matrix> = idx.iter().map(|&i| &ws[i]).collect();
                let mut yr: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
                matmul_many(&wr, &x, &mut yr).expect("matmul_many")
            };
            for _ in 0..rounds {
                for (k, pool) in pools.iter().enumerate() {
                    // one step per round: its first call wakes the team (and lets the
                    // scheduler place the helpers), the others are timed, as a prefill's
                    // calls run inside one step
                    let ms = pool.install(|| {
                        on_pool(|| {
                            call();
                            (0..CALLS_PER_STEP)
                                .map(|_| {
                                    let t0 = std::time::Instant::now();
                                    call();
                                    t0.elapsed().as_secs_f64() * 1e3
                                })
                                .fold(f64::MAX, f64::min)
                        })
                    });
                    best[k] = best[k].min(ms);
                }
            }
            total[0] += best[0];
            total[1] += best[1];
            println!(
                "| {name} | {gname} | {:.2} | {:.2} | {:.2} |",
                best[0],
                best[1],
                best[0] / best[1]
            );
        }
        println!(
            "| {name} | layer | {:.2} | {:.2} | {:.2} |",
            total[0],
            total[1],
            total[0] / total[1]
        );
    }
}
