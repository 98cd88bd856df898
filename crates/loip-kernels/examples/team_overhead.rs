//! scratch: wall µs per step of 200 small matmuls (decode-sized), team off/on, alternating
use loip_kernels::{matmul, on_pool, set_team_off, DType, Matrix};
use std::time::Instant;
fn main() {
    let p = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let rows: usize = std::env::args().nth(1).map_or(576, |s| s.parse().unwrap()); let cols = 576;
    let rb = DType::Q8_0.row_bytes(cols).unwrap();
    let mut data = vec![0u8; rows * rb];
    for b in data.chunks_exact_mut(34) { b[0] = 0; b[1] = 0x20; }
    let w = Matrix { dtype: DType::Q8_0, rows, cols, data: &data };
    let x = vec![0.5f32; cols];
    let mut y = vec![0f32; rows];
    let mut best = [f64::INFINITY; 2];
    for round in 0..40 {
        for off in [true, false] {
            set_team_off(off);
            let t = Instant::now();
            p.install(|| on_pool(|| for _ in 0..200 { matmul(&w, &x, &mut y).unwrap(); }));
            let us = t.elapsed().as_secs_f64() * 1e6 / 200.0;
            let i = off as usize;
            best[i] = best[i].min(us);
        }
        if round % 10 == 9 { println!("best µs per matmul: team {:.2}  rayon {:.2}", best[0], best[1]); }
    }
}
