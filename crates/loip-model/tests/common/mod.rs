//! Helpers shared by the integration tests: fixture paths and a self-removing temp dir.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// `tests/fixtures/<name>` at the workspace root.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("loip-model-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copies a fixture directory's files into a new temp dir.
pub fn copy_fixture(name: &str) -> TempDir {
    let t = TempDir::new(name);
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), t.join(e.file_name().to_str().unwrap())).unwrap();
    }
    t
}

/// f32 values of little-endian bytes.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The small `llama` config of [`small_gguf`]: 1 layer, hidden 32, vocabulary 8, tied head.
pub fn small_config() -> loip_model::ModelConfig {
    let mut cfg = loip_model::preset_config("tiny").unwrap();
    cfg.num_layers = 1;
    cfg.hidden_size = 32;
    cfg.intermediate_size = 32;
    cfg.num_heads = 2;
    cfg.num_kv_heads = 1;
    cfg.head_dim = 16;
    cfg.vocab_size = 8;
    cfg.tie_word_embeddings = true;
    cfg
}

/// A valid project-written GGUF of [`small_config`] (Q8_0 matrices, F32 norms, a token list
/// and a nested array), about 6 KB.
pub fn small_gguf() -> Vec<u8> {
    small_gguf_with(&[])
}

/// [`small_gguf`] with some `llama.*` metadata values replaced (the tensors stay those of
/// [`small_config`], so e.g. a huge `llama.block_count` sizes nothing while writing).
pub fn small_gguf_with(overrides: &[(&str, loip_model::GgufValue)]) -> Vec<u8> {
    use loip_model::gguf_write::GgufWriter;
    use loip_model::GgufValue;
    let cfg = small_config();
    let u = |v: usize| GgufValue::U32(v as u32);
    let mut kv: Vec<(&str, GgufValue)> = vec![
        ("general.architecture", GgufValue::Str("llama".into())),
        ("llama.block_count", u(cfg.num_layers)),
        ("llama.context_length", u(cfg.max_position_embeddings)),
        ("llama.embedding_length", u(cfg.hidden_size)),
        ("llama.feed_forward_length", u(cfg.intermediate_size)),
        ("llama.attention.head_count", u(cfg.num_heads)),
        ("llama.attention.head_count_kv", u(cfg.num_kv_heads)),
        ("llama.rope.freq_base", GgufValue::F32(cfg.rope_theta)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(cfg.rms_norm_eps),
        ),
        ("llama.vocab_size", u(cfg.vocab_size)),
        ("llama.rope.dimension_count", u(cfg.head_dim)),
        (
            "tokenizer.ggml.tokens",
            GgufValue::Array((0..8).map(|i| GgufValue::Str(format!("{i}"))).collect()),
        ),
        (
            "x.nested",
            GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::F64(1.0)])]),
        ),
    ];
    if let Some(b) = cfg.bos_token_id {
        kv.push(("tokenizer.ggml.bos_token_id", GgufValue::U32(b)));
    }
    if let Some(&e) = cfg.eos_token_ids.first() {
        kv.push(("tokenizer.ggml.eos_token_id", GgufValue::U32(e)));
    }
    for (key, value) in overrides {
        match kv.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value.clone(),
            None => kv.push((key, value.clone())),
        }
    }
    let mut w = GgufWriter::new();
    for (k, v) in kv {
        w.kv(k, v);
    }
    for spec in loip_model::model_tensors(&cfg) {
        let name = loip_model::gguf::hf_to_gguf_name(&spec.name).unwrap();
        let n: usize = spec.numel();
        if spec.shape.len() == 2 {
            w.tensor(
                name,
                loip_kernels::DType::Q8_0,
                &spec.shape,
                vec![1u8; n / 32 * 34],
            );
        } else {
            w.tensor(
                name,
                loip_kernels::DType::F32,
                &spec.shape,
                vec![0u8; n * 4],
            );
        }
    }
    w.to_bytes().unwrap()
}
