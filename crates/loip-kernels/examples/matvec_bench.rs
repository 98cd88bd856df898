//! Decode matvec throughput per stored type, against the machine's streaming read bandwidth.
//!
//! ```text
//! cargo run --release -p loip-kernels --example matvec_bench [-- --threads N] [--quick]
//! ```
//! Prints GB/s of weight bytes streamed by `matmul` with one token (n = 1), for matrices that
//! do not fit in the caches (several distinct copies are cycled through), for 1 and 2 rayon
//! threads (or only N), plus the SmolLM2-135M Q4_1 per-token matmul set.
//!
//! `--cols N`: the table's matrices have rows of N columns (a multiple of 32, and of each
//! type's block; rows: 16 Mi weights / N), e.g. 640 for Gemma 3's 262144 × 640 head.
//!
//! `--decode`: only the SmolLM2 single-token matmuls. `--table --dtype T`: only that stored type's row (and no bandwidth line).
//!
//! `--cpu` times by the CPU time of the process (meaningful with `--threads 1` on a machine
//! shared with other work). `--gemm`: GFLOP/s of `matmul` with n = 1, 8, 64, 256 tokens on a SmolLM2 MLP shape
//! (576×1536, the down projection, in cache) per stored type, next to the FMA peak of one AVX2 core at the clock
//! `/proc/cpuinfo` reports (2 FMA units × 8 lanes × 2 flops per cycle).
//!
//! `--batch`: the cost of a batched decode step over a step of one token: µs per `matmul` call
//! with n = 1, 2, 4, 8 tokens and the ratio to n = 1, per stored type on the SmolLM2 down shape
//! (576×1536; distinct copies, 16 MiB, cycled through; with `--hot` one copy, in L2), then the
//! whole SmolLM2-135M step (30 Q4_1 layers and the Q8_0 tied head). Per-row kernels / default
//! kernel choice, alternating trials; by CPU time with one thread, wall time with more.
//! `--step`: only the whole step. `LOIP_AB=short`: the first column is the kernels without
//! the AVX-512 short-batch tiles instead of the per-row kernels (5 alternating trials).
//! `LOIP_AB=team`: the first column is plain rayon fork-join instead of the step's team of
//! spinning threads (`set_team_off`), n = 1 included (5 alternating trials). Each call of the
//! set is one `on_pool`, as an engine step.
//! `LOIP_SIMD=avx2` gives the AVX2 figures on an AVX-512 machine.

#[path = "../tests/common/mod.rs"]
mod common;

use loip_kernels::{
    attention, attention_causal, matmul, on_pool, set_per_row_batches, set_short_tiles_off,
    set_team_off, simd_level, DType, Matrix,
};
use rand::SeedableRng;
use rayon::prelude::*;
use std::time::{Duration, Instant};

/// Working set per benchmark: well above the 32 MiB L3.
const WORKING_SET: usize = 512 << 20; // bytes
/// Minimum timed duration per measurement.
const MIN_TIME: Duration = Duration::from_millis(700);

struct Args {
    threads: Vec<usize>,
    quick: bool,
    /// only the SmolLM2 per-token set
    smol_only: bool,
    /// only the memory bandwidth and per-dtype table
    table_only: bool,
    /// also time one small matrix that stays in L2 (the kernels' compute ceiling)
    hot: bool,
    /// only the batched (GEMM) table
    gemm: bool,
    /// only this stored type in the GEMM table
    dtype: Option<DType>,
    /// columns of the per-dtype table's matrices (a multiple of 32; types with larger blocks
    /// are left out where it is not a multiple of theirs)
    cols: usize,
    /// only the batched-decode table (n = 1, 2, 4, 8)
    batch: bool,
    /// in the batched-decode table, only the whole SmolLM2 step
    step: bool,
    /// in the SmolLM2 set, only the single-token matmuls (no prefill, no attention)
    decode: bool,
    /// the short-batch tiles' minimum µs per call (one thread, in L2): robust on a loaded host
    min: bool,
}

/// The flags (see the module docs); `parse_args` turns them into [`Args`].
#[derive(clap::Parser)]
#[command(
    name = "matvec_bench",
    about = "Decode matvec throughput per stored type"
)]
struct Cli {
    /// only this many rayon threads (default: 1, then 2)
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// shorter trials and a smaller working set
    #[arg(long)]
    quick: bool,
    /// time by the CPU time of the process
    #[arg(long)]
    cpu: bool,
    /// also time one small matrix that stays in L2
    #[arg(long)]
    hot: bool,
    /// the short-batch tiles' minimum µs per call
    #[arg(long)]
    min: bool,
    /// only this stored type (F32, Q4_1, ...)
    #[arg(long, value_name = "T", value_parser = parse_dtype)]
    dtype: Option<DType>,
    /// table rows of this many columns (default 4096; rows: 16 Mi weights / cols), e.g. 640
    /// for Gemma 3's head (262144 x 640)
    #[arg(long, value_name = "N", default_value_t = 4096)]
    cols: usize,
    /// only the SmolLM2 per-token set
    #[arg(long)]
    smol: bool,
    /// only the SmolLM2 single-token matmuls
    #[arg(long)]
    decode: bool,
    /// only the memory bandwidth and per-dtype table
    #[arg(long)]
    table: bool,
    /// only the batched (GEMM) table
    #[arg(long)]
    gemm: bool,
    /// only the batched-decode table (n = 1, 2, 4, 8)
    #[arg(long)]
    batch: bool,
    /// only the whole SmolLM2 step of the batched-decode table
    #[arg(long)]
    step: bool,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::from_name(s).ok_or_else(|| "needs a stored type name (F32, Q4_1, ...)".to_string())
}

fn parse_args() -> Args {
    let cli = <Cli as clap::Parser>::parse();
    CPU_TIME.store(cli.cpu, std::sync::atomic::Ordering::Relaxed);
    Args {
        threads: cli.threads.map_or_else(|| vec![1, 2], |n| vec![n]),
        quick: cli.quick,
        smol_only: cli.smol || cli.decode,
        table_only: cli.table,
        hot: cli.hot,
        gemm: cli.gemm,
        dtype: cli.dtype,
        cols: cli.cols.max(32) / 32 * 32,
        batch: cli.batch || cli.step,
        step: cli.step,
        decode: cli.decode,
        min: cli.min,
    }
}

fn pool(threads: usize) -> rayon::ThreadPool {
    match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("thread pool: {e}");
            std::process::exit(1);
        }
    }
}

/// Runs `f` (which streams `bytes` bytes) in 7 trials of about `min_time / 7` each and returns
/// the best trial's GB/s (the machine may be shared: the best trial is the least disturbed).
/// With `--cpu`, the CPU time of the process instead (for one thread on a shared machine).
fn rate(bytes: usize, min_time: Duration, mut f: impl FnMut()) -> f64 {
    f(); // warm up
    let cpu = CPU_TIME.load(std::sync::atomic::Ordering::Relaxed);
    // the scheduler's CPU time advances in ticks of a few ms
    let trial = if cpu {
        (min_time / 7).max(Duration::from_millis(100))
    } else {
        min_time / 7
    };
    let mut best = 0f64;
    for _ in 0..7 {
        let (start, c0) = (Instant::now(), cpu_ns());
        let mut iters = 0usize;
        while iters == 0 || start.elapsed() < trial {
            f();
            iters += 1;
        }
        let secs = if cpu {
            (cpu_ns() - c0).max(1) as f64 / 1e9
        } else {
            start.elapsed().as_secs_f64()
        };
        best = best.max((bytes * iters) as f64 / secs / 1e9);
    }
    best
}

/// `--cpu`: rates by CPU time.
static CPU_TIME: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Streaming read bandwidth: sum of a 1 GiB f32 buffer, split over the pool's threads.
fn memory_bandwidth(threads: usize) -> f64 {
    let buf = vec![1.0f32; (1usize << 30) / 4]; // 1 GiB
    let p = pool(threads);
    let mut best = 0f64;
    for _ in 0..5 {
        let start = Instant::now();
        let s: f32 = p.install(|| {
            buf.par_chunks(buf.len() / threads)
                .map(|c| {
                    // 16 independent accumulators: vectorizes and keeps loads in flight
                    let mut acc = [0f32; 16];
                    for v in c.chunks_exact(16) {
                        for i in 0..16 {
                            acc[i] += v[i];
                        }
                    }
                    acc.iter().sum::<f32>()
                })
                .sum()
        });
        std::hint::black_box(s);
        best = best.max((1usize << 30) as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    best
}

struct Mats {
    bufs: Vec<Vec<u8>>,
    dtype: DType,
    rows: usize,
    cols: usize,
}

impl Mats {
    fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        working_set: usize,
        rng: &mut rand_chacha::ChaCha8Rng,
    ) -> Mats {
        let one = common::random_matrix(dtype, rows, cols, rng);
        let copies = working_set.div_ceil(one.len()).max(1);
        let bufs = (0..copies).map(|_| one.clone()).collect();
        Mats {
            bufs,
            dtype,
            rows,
            cols,
        }
    }

    fn bytes(&self) -> usize {
        self.bufs.iter().map(Vec::len).sum()
    }

    fn run_all(&self, x: &[f32], y: &mut [f32]) {
        for b in &self.bufs {
            let w = Matrix {
                dtype: self.dtype,
                rows: self.rows,
                cols: self.cols,
                data: b,
            };
            if let Err(e) = matmul(&w, x, y) {
                eprintln!("matmul: {e}");
                std::process::exit(1);
            }
        }
    }
}

fn main() {
    let args = parse_args();
    let min_time = if args.quick { MIN_TIME / 4 } else { MIN_TIME };
    let working_set = if args.quick {
        WORKING_SET / 4
    } else {
        WORKING_SET
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    println!("simd path: {}", simd_level());
    if args.gemm {
        gemm_table(&args, min_time, &mut rng);
        return;
    }
    if args.min {
        min_table(&args, &mut rng);
        return;
    }
    if args.batch {
        batch_table(&args, &mut rng);
        return;
    }

    if !args.smol_only {
        dtype_table(&args, min_time, working_set, &mut rng);
    }
    if !args.table_only {
        smol(&args, min_time, &mut rng);
    }
}

/// The memory bandwidth line and the per-dtype table.
fn dtype_table(
    args: &Args,
    min_time: Duration,
    working_set: usize,
    rng: &mut rand_chacha::ChaCha8Rng,
) {
    let tcols: Vec<String> = args
        .threads
        .iter()
        .map(|t| format!("{t} thr GB/s"))
        .collect();
    if args.dtype.is_none() {
        print!("{:<34}", "memory read bandwidth (1 GiB sum)");
        for &t in &args.threads {
            print!(" {:>13.1}", memory_bandwidth(t));
        }
        println!("  ({})", tcols.join(", "));
        println!();
    }

    let hot_shape = (256, 512);
    println!(
        "{:<6} {:>12} {:>9} {}{}",
        "dtype",
        "shape",
        "MiB",
        tcols.iter().map(|s| format!("{s:>13}")).collect::<String>(),
        if args.hot {
            format!(
                "   in L2 ({}x{}): {}",
                hot_shape.0,
                hot_shape.1,
                tcols.join(", ")
            )
        } else {
            String::new()
        }
    );
    let cols = args.cols;
    let rows = (4096 * 4096) / cols;
    let x = common::random_f32(cols, rng);
    let mut y = vec![0f32; rows];
    for dtype in common::ALL {
        if args.dtype.is_some_and(|d| d != dtype) || !cols.is_multiple_of(dtype.block_elems()) {
            continue;
        }
        let m = Mats::new(dtype, rows, cols, working_set, rng);
        print!(
            "{:<6} {:>12} {:>9.1}",
            dtype.name(),
            format!("{rows}x{cols}"),
            m.bytes() as f64 / m.bufs.len() as f64 / (1 << 20) as f64
        );
        for &t in &args.threads {
            let p = pool(t);
            let r = p.install(|| rate(m.bytes(), min_time, || m.run_all(&x, &mut y)));
            print!(" {r:>13.1}");
        }
        if args.hot {
            let (hr, hc) = hot_shape;
            let m = Mats::new(dtype, hr, hc, 0, rng);
            let mut hy = vec![0f32; hr];
            print!("   ");
            for &t in &args.threads {
                let p = pool(t);
                let r = p.install(|| rate(m.bytes(), min_time, || m.run_all(&x[..hc], &mut hy)));
                print!(" {r:>13.1}");
            }
        }
        println!();
    }
    println!();
}

/// SmolLM2-135M decode: 30 layers of Q4_1 projections + the tied Q8_0 head, distinct copies.
fn smol(args: &Args, min_time: Duration, rng: &mut rand_chacha::ChaCha8Rng) {
    let mats = smol_set(rng);
    let total: usize = mats.iter().map(|m| m.0.len()).sum();
    let xs = common::random_f32(1536, rng);
    let mut ys = vec![0f32; 49152];
    let mut token = || run_set(&mats, &xs, &mut ys, 1);
    println!(
        "SmolLM2-135M per-token matmuls (30 x Q4_1 layer + Q8_0 head 49152x576), {:.1} MiB:",
        total as f64 / (1 << 20) as f64
    );
    for &t in &args.threads {
        let p = pool(t);
        let r = p.install(|| rate(total, min_time, &mut token));
        println!("  {t} thread(s): {:>6.2} ms/token  ({r:.1} GB/s)   (whole-model decode vs llama.cpp: bench/compare_llama_cpp.sh)", total as f64 / r / 1e6);
    }
    if args.decode {
        return;
    }

    // prefill: the same matrices with a batch of 32 tokens
    let nb = 32;
    let xb = common::random_f32(nb * 1536, rng);
    let mut yb = vec![0f32; nb * 49152];
    let mut batch = || run_set(&mats, &xb, &mut yb, nb);
    print!("  prefill, batch of {nb} tokens:");
    for &t in &args.threads {
        let p = pool(t);
        let r = p.install(|| rate(total, min_time, &mut batch));
        print!(
            "  {t} thr {:>6.3} ms/token",
            total as f64 / r / 1e6 / nb as f64
        );
    }
    println!();

    // attention of one token, SmolLM2 shape (9 heads, 3 kv heads, head_dim 64), 30 layers
    let (n_heads, n_kv, hd) = (9, 3, 64);
    println!("SmolLM2-135M attention (9 heads, 3 kv heads, dim 64) x 30 layers:");
    for n_ctx in [256, 2048] {
        let q = common::random_f32(n_heads * hd, rng);
        let k = common::random_f32(n_ctx * n_kv * hd, rng);
        let v = common::random_f32(n_ctx * n_kv * hd, rng);
        let mut out = vec![0f32; n_heads * hd];
        print!("  n_ctx {n_ctx:>5}:");
        for &t in &args.threads {
            let p = pool(t);
            let kv_bytes = 2 * n_ctx * n_kv * hd * 4;
            let r = p.install(|| {
                rate(kv_bytes, min_time, || {
                    attention(&q, &k, &v, n_ctx, n_heads, n_kv, hd, &mut out)
                })
            });
            print!(
                "  {t} thr {:>6.3} ms/token",
                30.0 * kv_bytes as f64 / r / 1e6
            );
        }
        println!();
    }
    // prefill of a 2048-token prompt: token t attends to positions 0..=t (one layer timed)
    let n_ctx = 2048;
    let q = common::random_f32(n_ctx * n_heads * hd, rng);
    let k = common::random_f32(n_ctx * n_kv * hd, rng);
    let v = common::random_f32(n_ctx * n_kv * hd, rng);
    let mut out = vec![0f32; n_ctx * n_heads * hd];
    // `rate` counts bytes; here a "byte" is one attended (token, position) pair
    let pairs = n_ctx * (n_ctx + 1) / 2;
    let qd = n_heads * hd;
    for tiled in [false, true] {
        print!(
            "  prefill of {n_ctx} tokens, causal, {}:",
            if tiled {
                "tiled over queries (attention_causal)"
            } else {
                "token by token in parallel"
            }
        );
        for &t in &args.threads {
            let p = pool(t);
            let r = p.install(|| {
                rate(pairs, min_time, || {
                    if tiled {
                        attention_causal(&q, &k, &v, 0, n_heads, n_kv, hd, &mut out)
                    } else {
                        out.par_chunks_mut(qd).enumerate().for_each(|(i, o)| {
                            let qi = &q[i * qd..(i + 1) * qd];
                            attention(qi, &k, &v, i + 1, n_heads, n_kv, hd, o)
                        })
                    }
                })
            });
            let ms = 30.0 * pairs as f64 / r / 1e6 / n_ctx as f64;
            print!("  {t} thr {ms:>6.3} ms/token");
        }
        println!();
    }
    println!("  (30 layers)");
}

/// The clock `/proc/cpuinfo` reports, in MHz (0 if unknown).
fn cpu_mhz() -> f64 {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0.0)
}

/// CPU time of this process so far, ns (all threads; from the scheduler's statistics, 0 if
/// unreadable). On a shared machine it counts only the time this process ran.
fn cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| {
            s.split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
        })
        .sum()
}

/// Best GFLOP/s over 3 trials of about `trial` each, by CPU time: `f` does `flops` flops.
/// (The scheduler's figures advance in ticks of a few ms: trials last 100 ms or more.)
fn gflops_cpu(flops: usize, trial: Duration, mut f: impl FnMut()) -> f64 {
    f(); // warm up
    let trial = trial.max(Duration::from_millis(100));
    let mut best = 0f64;
    for _ in 0..3 {
        let (start, c0) = (Instant::now(), cpu_ns());
        let mut iters = 0usize;
        while iters == 0 || start.elapsed() < trial {
            f();
            iters += 1;
        }
        let ns = (cpu_ns() - c0).max(1) as f64;
        best = best.max((flops * iters) as f64 / ns);
    }
    best
}

/// GFLOP/s of batched matmuls (a 576×1536 matrix in cache) for n = 1, 8, 64, 256 tokens, the
/// per-row kernels and the tiled kernel side by side (alternating trials), by CPU time.
fn gemm_table(args: &Args, min_time: Duration, rng: &mut rand_chacha::ChaCha8Rng) {
    let (rows, cols) = (576, 1536);
    let ns = [1usize, 8, 64, 256];
    let mhz = cpu_mhz();
    let peak = mhz * 1e6 * 32.0 / 1e9; // one AVX2 core: 2 FMA x 8 lanes x 2 flops per cycle
    println!(
        "GEMM {rows}x{cols}: GFLOP/s per CPU second (2 flops per multiply-add), per-row kernels / tiled kernel; one AVX2 core's FMA peak at {mhz:.0} MHz: {peak:.1} GFLOP/s"
    );
    if simd_level() == "avx512" {
        println!("(AVX-512 keeps its per-row kernels for batches: both columns run them)");
    }
    for &t in &args.threads {
        print!("{:<6} {t} thr", "dtype");
        for n in ns {
            print!(" {:>17}", format!("n={n}"));
        }
        println!();
        let p = pool(t);
        for dtype in common::ALL {
            if args.dtype.is_some_and(|d| d != dtype) {
                continue;
            }
            let data = common::random_matrix(dtype, rows, cols, rng);
            let w = Matrix {
                dtype,
                rows,
                cols,
                data: &data,
            };
            print!("{:<12}", dtype.name());
            for n in ns {
                let x = common::random_f32(n * cols, rng);
                let mut y = vec![0f32; n * rows];
                let flops = 2 * rows * cols * n;
                let mut run = |per_row: bool| {
                    set_per_row_batches(per_row);
                    p.install(|| {
                        gflops_cpu(flops, min_time / 10, || {
                            if let Err(e) = matmul(&w, &x, &mut y) {
                                eprintln!("matmul: {e}");
                                std::process::exit(1);
                            }
                        })
                    })
                };
                let (mut a, mut b) = (0f64, 0f64);
                for _ in 0..2 {
                    a = a.max(run(true));
                    b = b.max(run(false));
                }
                set_per_row_batches(false);
                if n == 1 {
                    print!(" {:>17}", format!("{b:.1}"));
                } else {
                    print!(" {:>17}", format!("{a:.1} / {b:.1}"));
                }
            }
            println!();
        }
    }
}

/// Best µs per call of `f` (7 trials, as [`rate`]; by CPU time if `cpu`).
fn micros(trial: Duration, cpu: bool, f: impl FnMut()) -> f64 {
    CPU_TIME.store(cpu, std::sync::atomic::Ordering::Relaxed);
    // `rate` of one "byte" per call: calls per ns
    1e-3 / rate(1, 7 * trial, f)
}

/// Matrices of one batch benchmark: `(bytes, rows, cols, dtype)`, run in order per call.
type Set = Vec<(Vec<u8>, usize, usize, DType)>;

/// `matmul` of each matrix of `set` with `n` tokens of `x` (the first `n × cols` of it).
fn run_set(set: &Set, x: &[f32], y: &mut [f32], n: usize) {
    for (b, r, c, d) in set {
        let w = Matrix {
            dtype: *d,
            rows: *r,
            cols: *c,
            data: b,
        };
        if let Err(e) = matmul(&w, &x[..n * c], &mut y[..n * r]) {
            eprintln!("matmul: {e}");
            std::process::exit(1);
        }
    }
}

/// One row of the batch table: µs per call of `set` (`per_call` matmuls) for n = 1, 2, 4, 8,
/// per-row kernels / default, with the ratios to n = 1.
fn batch_row(label: &str, set: &Set, per_call: usize, trial: Duration, threads: usize) {
    let p = pool(threads);
    let cols = set.iter().map(|m| m.2).max().unwrap_or(0);
    let rows = set.iter().map(|m| m.1).max().unwrap_or(0);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let x = common::random_f32(8 * cols, &mut rng);
    let mut y = vec![0f32; 8 * rows];
    print!("{label:<14}");
    let mut base = 0f64;
    for n in [1, 2, 4, 8] {
        // the first column: the per-row kernels, or with `LOIP_AB=short` the kernels used
        // before the short-batch tiles
        let ab = std::env::var("LOIP_AB").unwrap_or_default();
        let (short_ab, team_ab) = (ab == "short", ab == "team");
        let mut time = |first: bool| {
            if team_ab {
                set_team_off(first);
            } else if short_ab {
                set_short_tiles_off(first);
            } else {
                set_per_row_batches(first);
            }
            // one step: one `on_pool`, as the engine runs it
            let us = p.install(|| {
                micros(trial, threads == 1, || {
                    on_pool(|| run_set(set, &x, &mut y, n))
                })
            });
            us / per_call as f64
        };
        let (mut a, mut b) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..if short_ab || team_ab { 5 } else { 2 } {
            if n > 1 || team_ab {
                a = a.min(time(true));
            }
            b = b.min(time(false));
        }
        set_per_row_batches(false);
        set_short_tiles_off(false);
        set_team_off(false);
        if n == 1 && team_ab {
            base = b;
            print!(" {:>22}", format!("{a:.1}/{b:.1} ({:.2})", b / a));
        } else if n == 1 {
            base = b;
            print!(" {:>22}", format!("{b:.1}"));
        } else {
            let cell = format!("{a:.1}/{b:.1} ({:.2}/{:.2})", a / base, b / base);
            print!(" {cell:>22}");
        }
    }
    println!();
}

/// The batched-decode table (`--batch`).
fn batch_table(args: &Args, rng: &mut rand_chacha::ChaCha8Rng) {
    let trial = Duration::from_millis(if args.quick { 30 } else { 100 });
    let working_set: usize = if args.hot { 0 } else { 16 << 20 }; // bytes
    println!("µs per call, per-row kernels / default (ratio to n = 1 in brackets)");
    let (rows, cols) = (576, 1536);
    for &t in &args.threads {
        print!("{:<14}", format!("{t} thr"));
        for n in [1, 2, 4, 8] {
            print!(" {:>22}", format!("n={n}"));
        }
        println!();
        for dtype in common::ALL {
            if args.step || args.dtype.is_some_and(|d| d != dtype) {
                continue;
            }
            let one = common::random_matrix(dtype, rows, cols, rng);
            let copies = working_set.div_ceil(one.len()).max(1);
            let set: Set = (0..copies)
                .map(|_| (one.clone(), rows, cols, dtype))
                .collect();
            let label = format!("{} {rows}x{cols}", dtype.name());
            batch_row(&label, &set, copies, trial, t);
        }
        if args.dtype.is_none() {
            batch_row("SmolLM2 step", &smol_set(rng), 1, trial, t);
        }
    }
}

/// SmolLM2-135M's per-step matmuls: 30 layers of Q4_1 projections and the tied Q8_0 head.
fn smol_set(rng: &mut rand_chacha::ChaCha8Rng) -> Set {
    let layer = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    let mut set = Set::new();
    for _ in 0..30 {
        for &(r, c) in &layer {
            let m = common::random_matrix(DType::Q4_1, r, c, rng);
            set.push((m, r, c, DType::Q4_1));
        }
    }
    let head = common::random_matrix(DType::Q8_0, 49152, 576, rng);
    set.push((head, 49152, 576, DType::Q8_0));
    set
}

/// `--min`: the minimum and median µs of single calls (one thread, one 576×1536 matrix in L2)
/// for n = 1, 4, 6, 8 tokens: a preempted call only lengthens the tail, so the minimum stays
/// comparable on a loaded host.
fn min_table(args: &Args, rng: &mut rand_chacha::ChaCha8Rng) {
    let calls = if args.quick { 300 } else { 1500 };
    println!("min / median µs per call, one thread, in L2, {calls} calls");
    pool(1).install(|| {
        for (dtype, rows, cols) in [
            (DType::Q4_1, 576, 1536),
            (DType::Q4_1, 1536, 576),
            (DType::Q8_0, 576, 1536),
            (DType::Q8_0, 1536, 576),
        ] {
            let x = common::random_f32(8 * cols, rng);
            let mut y = vec![0f32; 8 * rows];
            if args.dtype.is_some_and(|d| d != dtype) {
                continue;
            }
            let data = common::random_matrix(dtype, rows, cols, rng);
            let w = Matrix {
                dtype,
                rows,
                cols,
                data: &data,
            };
            // `LOIP_AB_VAR=NAME LOIP_AB_VALS=a,b,..`: calls rotate over the values of the
            // variable (a kernel's tuning knob), one minimum per value
            let var = std::env::var("LOIP_AB_VAR").unwrap_or_default();
            let vals: Vec<String> = std::env::var("LOIP_AB_VALS")
                .unwrap_or_default()
                .split(',')
                .map(str::to_string)
                .collect();
            let mut cells = vec![String::new(); vals.len()];
            for n in [1, 4, 6, 8] {
                let mut us = vec![Vec::with_capacity(calls); vals.len()];
                for i in 0..(calls + 20) * vals.len() {
                    let k = i % vals.len();
                    if !var.is_empty() {
                        std::env::set_var(&var, &vals[k]);
                    }
                    let t = Instant::now();
                    if let Err(e) = matmul(&w, &x[..n * cols], &mut y[..n * rows]) {
                        eprintln!("matmul: {e}");
                        std::process::exit(1);
                    }
                    if i >= 20 * vals.len() {
                        us[k].push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
                for (u, c) in us.iter_mut().zip(&mut cells) {
                    u.sort_by(f64::total_cmp);
                    c.push_str(&format!("  n={n} {:>6.1} / {:>6.1}", u[0], u[u.len() / 2]));
                }
            }
            for (v, c) in vals.iter().zip(&cells) {
                let label = format!("{} {rows}x{cols}", dtype.name());
                if var.is_empty() {
                    println!("{label:<16}{c}");
                } else {
                    println!("{label:<16} {var}={v}{c}");
                }
            }
        }
    });
}
