//! Every extra GGUF type through the whole engine: a GGUF the project writes with every matrix
//! (embedding and tied head included) in `Q5_0`, `Q5_1`, `Q2_K`, `Q3_K`, `Q5_K`, `IQ4_NL` or
//! `IQ4_XS` loads, and its prompt logits are
//! - bit-identical between the detected SIMD path and the forced scalar path, and
//! - within 1e-4 (relative to the largest logit) of the scalar reference: the same model
//!   dequantized to f32 row by row by the scalar `dequant_row`, written as an F32 GGUF and run
//!   through the f32 engine (only the summation order differs).

#[path = "../../loip-kernels/tests/common/mod.rs"]
mod kernels_common;

use std::path::{Path, PathBuf};

use loip_engine::Model;
use loip_kernels::{DType, Matrix};
use loip_model::gguf::hf_to_gguf_name;
use loip_model::gguf_write::GgufWriter;
use loip_model::{model_tensors, preset_config, Checkpoint, GgufValue, ModelConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The extra types: `Q5_0`, `Q5_1`, `Q2_K`, `Q3_K`, `Q5_K`, `IQ4_NL`, `IQ4_XS` (after the
/// eight older types in the kernels' list).
fn extra_types() -> &'static [DType] {
    &kernels_common::ALL[8..]
}

/// Two layers whose every matrix row is whole 256-element super-blocks, tied head.
fn config() -> ModelConfig {
    let mut cfg = preset_config("tiny").unwrap();
    (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) = (256, 512, 2);
    (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) = (4, 2, 64);
    cfg.tie_word_embeddings = true;
    cfg.validate().unwrap();
    cfg
}

/// A GGUF of `cfg` whose tensors are `(GGUF name, dtype, HF shape, bytes)`.
fn write_gguf(cfg: &ModelConfig, tensors: &[(String, DType, Vec<usize>, Vec<u8>)], path: &Path) {
    let mut w = GgufWriter::new();
    w.llama_metadata(cfg);
    let vocab = (0..cfg.vocab_size).map(|i| GgufValue::Str(format!("t{i}")));
    w.kv("tokenizer.ggml.tokens", GgufValue::Array(vocab.collect()));
    for (name, dtype, shape, data) in tensors {
        w.tensor(name.clone(), *dtype, shape, data.clone());
    }
    w.write(path).unwrap();
}

/// The tensors of `cfg` with every matrix random in `dtype` and norms near 1 (F32).
fn random_tensors(
    cfg: &ModelConfig,
    dtype: DType,
    rng: &mut ChaCha8Rng,
) -> Vec<(String, DType, Vec<usize>, Vec<u8>)> {
    model_tensors(cfg)
        .into_iter()
        .map(|spec| {
            let name = hf_to_gguf_name(&spec.name).unwrap();
            let (ty, data) = match spec.shape[..] {
                [n] => (
                    DType::F32,
                    (0..n)
                        .flat_map(|_| rng.gen_range(0.8f32..1.2).to_le_bytes())
                        .collect(),
                ),
                [r, c] => (dtype, kernels_common::random_matrix(dtype, r, c, rng)),
                _ => unreachable!(),
            };
            (name, ty, spec.shape, data)
        })
        .collect()
}

/// The same tensors dequantized to f32 by the scalar path.
fn dequantized(
    tensors: &[(String, DType, Vec<usize>, Vec<u8>)],
) -> Vec<(String, DType, Vec<usize>, Vec<u8>)> {
    tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            let (rows, cols) = match shape[..] {
                [n] => (1, n),
                [r, c] => (r, c),
                _ => unreachable!(),
            };
            let m = Matrix::new(*dtype, rows, cols, data).unwrap();
            let mut row = vec![0f32; cols];
            let mut out = Vec::with_capacity(rows * cols * 4);
            for r in 0..rows {
                loip_kernels::dequant_row(&m, r, &mut row).unwrap();
                out.extend(row.iter().flat_map(|v| v.to_le_bytes()));
            }
            (name.clone(), DType::F32, shape.clone(), out)
        })
        .collect()
}

fn logits(path: &Path, prompt: &[u32]) -> Vec<f32> {
    let ck = Checkpoint::open(path).unwrap();
    Model::from_checkpoint(&ck)
        .unwrap()
        .prompt_logits(prompt)
        .unwrap()
}

struct Dir(PathBuf);
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn each_extra_type_gives_the_scalar_references_logits() {
    let cfg = config();
    let dir = Dir(std::env::temp_dir().join(format!("loip-gguf-types-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1515);
    let prompt: Vec<u32> = (0..9).map(|_| rng.gen_range(0..256)).collect();
    assert_eq!(extra_types()[0], DType::Q5_0);
    for &dtype in extra_types() {
        let quant = random_tensors(&cfg, dtype, &mut rng);
        let (qp, fp) = (
            dir.0.join(format!("{}.gguf", dtype.name())),
            dir.0.join(format!("{}-f32.gguf", dtype.name())),
        );
        write_gguf(&cfg, &quant, &qp);
        write_gguf(&cfg, &dequantized(&quant), &fp);
        let ck = Checkpoint::open(&qp).unwrap();
        assert!(
            ck.tensors
                .values()
                .all(|t| t.shape.len() == 1 || t.dtype == dtype),
            "{dtype}"
        );

        let simd = logits(&qp, &prompt);
        loip_kernels::set_force_scalar(true);
        let scalar = logits(&qp, &prompt);
        loip_kernels::set_force_scalar(false);
        assert!(simd == scalar, "{dtype}: SIMD and scalar logits differ");

        let reference = logits(&fp, &prompt);
        let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = simd
            .iter()
            .zip(&reference)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("{dtype}: max |diff| {worst:.3e}, max |logit| {scale:.3}");
        assert!(
            scale > 0.1,
            "{dtype}: degenerate logits (max |logit| {scale})"
        );
        assert!(
            worst <= 1e-4 * scale,
            "{dtype}: max |diff| {worst} vs max |logit| {scale}"
        );
    }
}
