//! REPS matmuls of N tokens by a 64 × 1536 matrix of seeded weights, for counting instructions
//! under an emulator (`bench/arm_insns.sh`: REPS = 2 minus REPS = 1 is one matmul without the
//! thread pool's start): the portable path against the detected one.
//!
//! ```text
//! one_matmul DTYPE N simd|scalar REPS
//! ```

use loip_kernels::{matmul, set_force_scalar, DType, Matrix};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(dtype), Some(n), Some(mode), Some(reps)) = (
        args.first().and_then(|d| DType::from_name(d)),
        args.get(1).and_then(|n| n.parse::<usize>().ok()),
        args.get(2),
        args.get(3).and_then(|r| r.parse::<usize>().ok()),
    ) else {
        eprintln!("usage: one_matmul DTYPE N simd|scalar REPS");
        std::process::exit(2);
    };
    set_force_scalar(mode == "scalar");
    let (rows, cols) = (64, 1536);
    let Ok(rb) = dtype.row_bytes(cols) else {
        eprintln!("{dtype}: 1536 is not a whole number of blocks");
        std::process::exit(2);
    };
    // seeded bytes, then finite scales and floats
    let mut data = vec![0u8; rows * rb];
    let mut s = 1u32;
    for b in data.iter_mut() {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        *b = (s >> 24) as u8;
    }
    match dtype {
        DType::F32 => data.chunks_exact_mut(4).for_each(|c| c[3] = 0x3f),
        DType::F16 | DType::BF16 => data.chunks_exact_mut(2).for_each(|c| c[1] &= 0x3b),
        _ => {
            for b in data.chunks_exact_mut(dtype.block_bytes()) {
                b[0..2].copy_from_slice(&0x2000u16.to_le_bytes());
                if dtype == DType::Q4_1 {
                    b[2..4].copy_from_slice(&0x2000u16.to_le_bytes());
                }
            }
        }
    }
    let w = match Matrix::new(dtype, rows, cols, &data) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let x: Vec<f32> = (0..n * cols).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut y = vec![0f32; n * rows];
    for _ in 0..reps {
        if let Err(e) = matmul(&w, &x, &mut y) {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
    println!("{}", y.iter().sum::<f32>());
}
