//! The same bits on every machine: the kernels' outputs for fixed inputs, hashed, against
//! the values recorded on an x86-64 machine. Every SIMD level follows the canonical order
//! (`canon.rs`), so an AVX-512, an AVX2 and an ARM machine (CI runs these tests for aarch64
//! under qemu) must all give exactly these hashes. A failure on one machine only is a
//! kernel that broke the order; a failure everywhere after a deliberate change of the
//! canonical order means the recorded values must be updated (run with `--nocapture`).

mod common;

use common::{random_f32, random_matrix, ALL};
use loip_kernels::{attention, attention_causal, matmul, rmsnorm, silu_mul, DType, Matrix};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// FNV-1a over the f32 bit patterns.
fn hash(v: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in v {
        for b in x.to_bits().to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Hash of `matmul` over 1, 3, 5 and 8 tokens (the per-row, tiled and short-tile paths) of
/// a 37 × cols matrix of `dtype` with seeded random weights and inputs.
fn matmul_hash(dtype: DType) -> u64 {
    let cols = if dtype.block_elems() == 1 { 520 } else { 512 };
    let rows = 37;
    let mut g = ChaCha8Rng::seed_from_u64(0x5eed ^ dtype as u64);
    let data = random_matrix(dtype, rows, cols, &mut g);
    let w = Matrix::new(dtype, rows, cols, &data).expect("shape");
    let mut all = Vec::new();
    for n in [1usize, 3, 5, 8] {
        let x = random_f32(n * cols, &mut g);
        let mut y = vec![0f32; n * rows];
        matmul(&w, &x, &mut y).expect("matmul");
        all.extend_from_slice(&y);
    }
    hash(&all)
}

/// Recorded on x86-64 (AVX-512 and `LOIP_SIMD=avx2`/`scalar` alike).
const MATMUL: [(DType, u64); 15] = [
    (DType::F32, 0xb25bf8f5e246c745),
    (DType::F16, 0xa24d5c74445412c8),
    (DType::BF16, 0xbd8da73675817159),
    (DType::Q8_0, 0x2fbc4c52f55337b4),
    (DType::Q4_0, 0xa588eb44e0965267),
    (DType::Q4_1, 0x64f80eadb4846a85),
    (DType::Q4K, 0xf2b645835855188f),
    (DType::Q6K, 0x7af7dbab78cc594f),
    (DType::Q5_0, 0x6a6b3d43de6deb7c),
    (DType::Q5_1, 0x39d44b762fc239a8),
    (DType::Q2K, 0x542b4b3e9e765584),
    (DType::Q3K, 0x288e75134a5f01c0),
    (DType::Q5K, 0x907d9325bef0f57a),
    (DType::IQ4NL, 0xf5ec67d4a52776e5),
    (DType::IQ4XS, 0xd5d2a31c2a1d7586),
];

#[test]
fn matmul_bits_are_the_recorded_ones_for_every_dtype() {
    assert_eq!(ALL.len(), MATMUL.len());
    let mut wrong = Vec::new();
    for (dtype, want) in MATMUL {
        let got = matmul_hash(dtype);
        println!("    (DType::{dtype:?}, {got:#018x}),");
        if got != want {
            wrong.push(format!("{dtype}: {got:#018x}, recorded {want:#018x}"));
        }
    }
    assert!(wrong.is_empty(), "matmul bits differ: {wrong:?}");
}

/// Attention (decode and a causal prefill chunk), RMSNorm and SiLU·up on seeded inputs.
fn activation_hash() -> u64 {
    let mut g = ChaCha8Rng::seed_from_u64(0xa77e);
    let (heads, kv_heads, hd, ctx) = (4usize, 2usize, 64usize, 37usize);
    let stride = kv_heads * hd;
    let k = random_f32(ctx * stride, &mut g);
    let v = random_f32(ctx * stride, &mut g);
    let mut all = Vec::new();
    let q = random_f32(heads * hd, &mut g);
    let mut out = vec![0f32; heads * hd];
    attention(&q, &k, &v, ctx, heads, kv_heads, hd, &mut out);
    all.extend_from_slice(&out);
    let (start, n) = (30usize, 7usize);
    let qs = random_f32(n * heads * hd, &mut g);
    let mut outs = vec![0f32; n * heads * hd];
    attention_causal(&qs, &k, &v, start, heads, kv_heads, hd, &mut outs);
    all.extend_from_slice(&outs);
    let x = random_f32(576, &mut g);
    let w = random_f32(576, &mut g);
    let mut y = vec![0f32; 576];
    rmsnorm(&x, &w, 1e-5, &mut y);
    all.extend_from_slice(&y);
    let mut gate = random_f32(1536, &mut g);
    let up = random_f32(1536, &mut g);
    silu_mul(&mut gate, &up);
    all.extend_from_slice(&gate);
    hash(&all)
}

/// Recorded on x86-64.
const ACTIVATIONS: u64 = 0x26f2cb54a7cbca55;

#[test]
fn attention_and_elementwise_bits_are_the_recorded_ones() {
    let got = activation_hash();
    println!("activations: {got:#018x}");
    assert_eq!(got, ACTIVATIONS, "attention / rmsnorm / silu bits differ");
}
