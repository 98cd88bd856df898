//! Q8_0 matvec (one token) rates on the shapes of the models' Q8_0 tensors, one thread.
//!
//! ```text
//! cargo run --release -p loip-kernels --example q8_bench [-- --tokens N]
//! LOIP_SIMD=avx2 cargo run --release -p loip-kernels --example q8_bench
//! ```
//! GB/s of weight bytes of `matmul` with one token (or N), by the CPU time of the process
//! (best of 3 rounds of 7 trials), for 262144×640 (Gemma 3's tied head: out of cache),
//! 151936×896 (Qwen2.5's head), 4096×4096 and 256×512 (in L2); and the largest error of the
//! outputs against f64, relative to `Σ|w·x|` of the row.

#[path = "../tests/common/mod.rs"]
mod common;

use loip_kernels::{matmul, simd_level, DType, Matrix};
use rand::SeedableRng;

fn cpu_ns() -> u64 {
    extern "C" {
        fn clock_gettime(clk: i32, ts: *mut [i64; 2]) -> i32;
    }
    let mut ts = [0i64; 2];
    // SAFETY: clock_gettime(CLOCK_PROCESS_CPUTIME_ID = 2) writes one timespec (two i64 on
    // 64-bit Linux) into `ts`
    unsafe { clock_gettime(2, &mut ts) };
    ts[0] as u64 * 1_000_000_000 + ts[1] as u64
}

/// Best GB/s over 7 trials of about 30 ms of CPU time each.
fn rate(bytes: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = 0f64;
    for _ in 0..7 {
        let c0 = cpu_ns();
        let mut it = 0;
        while it == 0 || cpu_ns() - c0 < 30_000_000 {
            f();
            it += 1;
        }
        best = best.max((bytes * it) as f64 / (cpu_ns() - c0) as f64);
    }
    best
}

fn main() {
    let n: usize = match std::env::args().skip_while(|a| a != "--tokens").nth(1) {
        Some(v) => v.parse().unwrap_or(1),
        None => 1,
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    println!("simd path: {}, {n} token(s), one thread", simd_level());
    println!(
        "{:<14} {:>8} {:>8} {:>14}",
        "shape", "MiB", "GB/s", "max rel. err"
    );
    for (rows, cols) in [
        (262144usize, 640usize),
        (151936, 896),
        (4096, 4096),
        (256, 512),
    ] {
        let data = common::random_matrix(DType::Q8_0, rows, cols, &mut rng);
        let x = common::random_f32(n * cols, &mut rng);
        let w = Matrix::new(DType::Q8_0, rows, cols, &data).expect("shape");
        let mut y = vec![0f32; n * rows];
        let mut best = 0f64;
        for _ in 0..3 {
            best = best
                .max(pool.install(|| rate(data.len(), || matmul(&w, &x, &mut y).expect("matmul"))));
        }
        // error against f64, relative to the row's Σ|w·x| (first token, first 2048 rows)
        let rb = cols / 32 * 34;
        let mut err = 0f64;
        for r in 0..rows.min(2048) {
            let (mut s, mut a) = (0f64, 0f64);
            for (b, blk) in data[r * rb..(r + 1) * rb].chunks_exact(34).enumerate() {
                let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f64();
                for j in 0..32 {
                    let v = d * (blk[2 + j] as i8 as f64) * x[32 * b + j] as f64;
                    s += v;
                    a += v.abs();
                }
            }
            err = err.max((y[r] as f64 - s).abs() / a);
        }
        println!(
            "{:<14} {:>8.1} {:>8.1} {:>14.2e}",
            format!("{rows}x{cols}"),
            data.len() as f64 / (1 << 20) as f64,
            best,
            err
        );
    }
}
