#[path = "../tests/common/mod.rs"]
mod common;
use loip_kernels::{matmul, DType, Matrix};
use rand::SeedableRng;
use std::time::Instant;
fn main() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let args: Vec<String> = std::env::args().collect();
    let rows: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(128);
    let cols: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for dtype in common::ALL {
        let data = common::random_matrix(dtype, rows, cols, &mut rng);
        let w = Matrix::new(dtype, rows, cols, &data).unwrap();
        let x = common::random_f32(cols, &mut rng);
        let mut y = vec![0f32; rows];
        let r = pool.install(|| {
            for _ in 0..10 { matmul(&w, &x, &mut y).unwrap(); }
            let t = Instant::now();
            let mut it = 0;
            while t.elapsed().as_secs_f64() < 0.3 { matmul(&w, &x, &mut y).unwrap(); it += 1; }
            let s = t.elapsed().as_secs_f64();
            (data.len() * it) as f64 / s / 1e9
        });
        let cyc_per_block = 4.5e9 / (r * 1e9 / dtype.block_bytes() as f64) ;
        println!("{:<6} {}x{} {:>8.1} KiB  {:>6.1} GB/s  {:.2} cyc/32 elems (at 4.5GHz)", dtype.name(), rows, cols, data.len() as f64/1024.0, r, cyc_per_block * 32.0 / dtype.block_elems() as f64);
    }
}
