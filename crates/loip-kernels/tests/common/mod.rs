//! Helpers shared by the integration tests and the benchmark examples: random but valid
//! weight matrices in every stored type, and the examples' CPU-time measurement.
#![allow(dead_code)]

use half::{bf16, f16};
use loip_kernels::DType;
use rand::Rng;

/// All stored types.
pub const ALL: [DType; 15] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q4K,
    DType::Q6K,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q5K,
    DType::IQ4NL,
    DType::IQ4XS,
];

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// `n` floats uniform in [-1, 1).
pub fn random_f32(n: usize, rng: &mut impl Rng) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// The bytes of a `rows × cols` matrix of `dtype` with random values and sane scales
/// (finite, normal f16 scales of either sign).
pub fn random_matrix(dtype: DType, rows: usize, cols: usize, rng: &mut impl Rng) -> Vec<u8> {
    let rb = dtype
        .row_bytes(cols)
        .expect("cols is a multiple of the block size");
    let mut data = vec![0u8; rows * rb];
    match dtype {
        DType::F32 => {
            for c in data.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.gen_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        DType::F16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(
                    &f16::from_f32(rng.gen_range(-1.0f32..1.0))
                        .to_bits()
                        .to_le_bytes(),
                );
            }
        }
        DType::BF16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(
                    &bf16::from_f32(rng.gen_range(-1.0f32..1.0))
                        .to_bits()
                        .to_le_bytes(),
                );
            }
        }
        _ => {
            rng.fill(&mut data[..]);
            let bb = dtype.block_bytes();
            for b in data.chunks_exact_mut(bb) {
                let mut scale = || {
                    let s: f32 = rng.gen_range(0.002f32..0.05);
                    if rng.gen_bool(0.5) {
                        s
                    } else {
                        -s
                    }
                };
                match dtype {
                    DType::Q8_0 | DType::Q4_0 | DType::Q5_0 | DType::IQ4NL | DType::IQ4XS => {
                        put_f16(b, 0, scale())
                    }
                    DType::Q2K => {
                        let (d, m) = (scale(), scale());
                        put_f16(b, 80, d);
                        put_f16(b, 82, m);
                    }
                    DType::Q3K => put_f16(b, 108, scale()),
                    DType::Q4_1 | DType::Q4K | DType::Q5_1 | DType::Q5K => {
                        let (d, m) = (scale(), scale());
                        put_f16(b, 0, d);
                        put_f16(b, 2, m);
                    }
                    DType::Q6K => put_f16(b, 208, scale()),
                    _ => unreachable!(),
                }
            }
        }
    }
    data
}

/// CPU time of the calling thread, ns (the scheduler's figure).
pub fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// CPU ns per call of `f`, over calls lasting about 150 ms.
pub fn cpu_ns_per_call(mut f: impl FnMut()) -> f64 {
    f(); // warm up
    let (start, c0) = (std::time::Instant::now(), thread_cpu_ns());
    let mut calls = 0u64;
    while calls == 0 || start.elapsed() < std::time::Duration::from_millis(150) {
        f();
        calls += 1;
    }
    (thread_cpu_ns() - c0).max(1) as f64 / calls as f64
}
