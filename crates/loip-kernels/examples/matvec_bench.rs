//! Decode matvec throughput per stored type, against the machine's streaming read bandwidth.
//!
//! ```text
//! cargo run --release -p loip-kernels --example matvec_bench [-- --threads N] [--quick]
//! ```
//! Prints GB/s of weight bytes streamed by `matmul` with one token (n = 1), for matrices that
//! do not fit in the caches (several distinct copies are cycled through), for 1 and 2 rayon
//! threads (or only N), plus the SmolLM2-135M Q4_1 per-token matmul set.

#[path = "../tests/common/mod.rs"]
mod common;

use loip_kernels::{matmul, simd_level, DType, Matrix};
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
}

fn parse_args() -> Args {
    let mut threads = vec![1, 2];
    let mut quick = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--threads" => {
                if let Some(n) = it.next().and_then(|s| s.parse().ok()) {
                    threads = vec![n];
                } else {
                    eprintln!("--threads needs a number");
                    std::process::exit(2);
                }
            }
            "--quick" => quick = true,
            _ => {
                eprintln!("usage: matvec_bench [--threads N] [--quick]");
                std::process::exit(2);
            }
        }
    }
    Args { threads, quick }
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

/// Runs `f` (which streams `bytes` bytes) until MIN_TIME has passed; returns GB/s.
fn rate(bytes: usize, min_time: Duration, mut f: impl FnMut()) -> f64 {
    f(); // warm up
    let start = Instant::now();
    let mut iters = 0usize;
    while start.elapsed() < min_time {
        f();
        iters += 1;
    }
    (bytes * iters) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Streaming read bandwidth: sum of a 1 GiB f32 buffer, split over the pool's threads.
fn memory_bandwidth(threads: usize) -> f64 {
    let buf = vec![1.0f32; (1usize << 30) / 4]; // 1 GiB
    let p = pool(threads);
    let mut best = 0f64;
    for _ in 0..3 {
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
    fn new(dtype: DType, rows: usize, cols: usize, working_set: usize, rng: &mut rand_chacha::ChaCha8Rng) -> Mats {
        let one = common::random_matrix(dtype, rows, cols, rng);
        let copies = working_set.div_ceil(one.len()).max(1);
        let bufs = (0..copies).map(|_| one.clone()).collect();
        Mats { bufs, dtype, rows, cols }
    }

    fn bytes(&self) -> usize {
        self.bufs.iter().map(Vec::len).sum()
    }

    fn run_all(&self, x: &[f32], y: &mut [f32]) {
        for b in &self.bufs {
            let w = Matrix { dtype: self.dtype, rows: self.rows, cols: self.cols, data: b };
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
    let working_set = if args.quick { WORKING_SET / 4 } else { WORKING_SET };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    println!("simd path: {}", simd_level());

    let tcols: Vec<String> = args.threads.iter().map(|t| format!("{t} thr GB/s")).collect();
    print!("{:<34}", "memory read bandwidth (1 GiB sum)");
    for &t in &args.threads {
        print!(" {:>13.1}", memory_bandwidth(t));
    }
    println!("  ({})", tcols.join(", "));
    println!();

    println!("{:<6} {:>12} {:>9} {}", "dtype", "shape", "MiB", tcols.iter().map(|s| format!("{s:>13}")).collect::<String>());
    let (rows, cols) = (4096, 4096);
    let x = common::random_f32(cols, &mut rng);
    let mut y = vec![0f32; rows];
    for dtype in common::ALL {
        let m = Mats::new(dtype, rows, cols, working_set, &mut rng);
        print!("{:<6} {:>12} {:>9.1}", dtype.name(), format!("{rows}x{cols}"), m.bytes() as f64 / m.bufs.len() as f64 / (1 << 20) as f64);
        for &t in &args.threads {
            let p = pool(t);
            let r = p.install(|| rate(m.bytes(), min_time, || m.run_all(&x, &mut y)));
            print!(" {r:>13.1}");
        }
        println!();
    }
    println!();

    // SmolLM2-135M decode: 30 layers of Q4_1 projections + the tied Q8_0 head, distinct copies
    let layer: [(usize, usize); 7] = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)];
    let mut mats = Vec::new(); // (matrix bytes, rows, cols, dtype)
    for _ in 0..30 {
        for &(r, c) in &layer {
            mats.push((common::random_matrix(DType::Q4_1, r, c, &mut rng), r, c, DType::Q4_1));
        }
    }
    mats.push((common::random_matrix(DType::Q8_0, 49152, 576, &mut rng), 49152, 576, DType::Q8_0));
    let total: usize = mats.iter().map(|m| m.0.len()).sum();
    let xs = common::random_f32(1536, &mut rng);
    let mut ys = vec![0f32; 49152];
    let mut token = || {
        for (b, r, c, d) in &mats {
            let w = Matrix { dtype: *d, rows: *r, cols: *c, data: b };
            if let Err(e) = matmul(&w, &xs[..*c], &mut ys[..*r]) {
                eprintln!("matmul: {e}");
                std::process::exit(1);
            }
        }
    };
    println!("SmolLM2-135M per-token matmuls (30 x Q4_1 layer + Q8_0 head 49152x576), {:.1} MiB:", total as f64 / (1 << 20) as f64);
    for &t in &args.threads {
        let p = pool(t);
        let r = p.install(|| rate(total, min_time, &mut token));
        println!("  {t} thread(s): {:>6.2} ms/token  ({r:.1} GB/s)   [llama.cpp: 6.5 ms 1 thr, 5.4 ms 2 thr]", total as f64 / r / 1e6);
    }
}
