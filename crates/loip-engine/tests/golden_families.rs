//! The model families beyond Llama through every format the engine reads: each tiny HF
//! fixture converted to GGUF as llama.cpp's converter lays it out (`qwen2` with q/k/v biases,
//! `qwen3` with q/k norms, both in HF row order; Mistral as `llama`, q/k permuted) gives the
//! HF transformers logits; and Mistral's sliding window is honoured when set.

use std::path::PathBuf;

use loip_engine::Model;
use loip_model::gguf_write::GgufWriter;
use loip_model::{Arch, Checkpoint};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn expected(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn worst_diff(logits: &[f32], exp: &Value) -> f32 {
    let mut worst = 0f32;
    let rows = exp["logits"].as_array().unwrap();
    let vocab = logits.len() / rows.len();
    for (p, row) in rows.iter().enumerate() {
        for (j, v) in row.as_array().unwrap().iter().enumerate() {
            worst = worst.max((logits[p * vocab + j] - v.as_f64().unwrap() as f32).abs());
        }
    }
    worst
}

#[test]
fn converted_gguf_of_each_family_gives_the_hf_logits() {
    let dir = std::env::temp_dir().join(format!("loip-golden-families-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, arch, gguf_arch) in [
        ("tiny-qwen2", Arch::Qwen2, "qwen2"),
        ("tiny-qwen3", Arch::Qwen3, "qwen3"),
        ("tiny-mistral", Arch::Mistral, "llama"),
    ] {
        let hf = Checkpoint::open(&fixture(name)).unwrap();
        assert_eq!(hf.config.arch, arch, "{name}");
        let path = dir.join(format!("{name}.gguf"));
        GgufWriter::from_checkpoint(&hf)
            .unwrap()
            .write(&path)
            .unwrap();
        let gg = Checkpoint::open(&path).unwrap();
        let meta = gg.gguf_metadata.as_ref().unwrap();
        assert_eq!(meta.architecture(), Some(gguf_arch), "{name}");
        assert_eq!(gg.qk_permuted, gguf_arch == "llama", "{name}");
        assert_eq!(gg.config.attn_bias, arch == Arch::Qwen2, "{name}");
        assert_eq!(gg.config.qk_norm, arch == Arch::Qwen3, "{name}");

        let exp = expected(name);
        let input = ids(&exp["input_ids"]);
        let a = Model::from_checkpoint(&hf)
            .unwrap()
            .prompt_logits(&input)
            .unwrap();
        let b = Model::from_checkpoint(&gg)
            .unwrap()
            .prompt_logits(&input)
            .unwrap();
        let (da, db) = (worst_diff(&a, &exp), worst_diff(&b, &exp));
        assert!(da <= 1e-4 && db <= 1e-4, "{name}: HF {da}, GGUF {db}");
        if gguf_arch != "llama" {
            // Same rows, same order, same kernels: the same bits.
            assert_eq!(a, b, "{name}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mistral_sliding_window_is_honoured() {
    let ck = Checkpoint::open(&fixture("tiny-mistral")).unwrap();
    assert_eq!(ck.config.sliding_window, None);
    let input = ids(&expected("tiny-mistral")["input_ids"]);
    let n = input.len();
    let vocab = ck.config.vocab_size;
    let full = Model::from_checkpoint(&ck)
        .unwrap()
        .prompt_logits(&input)
        .unwrap();
    let with_window = |w: usize| {
        let mut cfg = ck.config.clone();
        cfg.sliding_window = Some(w);
        cfg.validate().unwrap();
        Model::bind(&ck, &cfg, ck.qk_permuted)
            .unwrap()
            .prompt_logits(&input)
            .unwrap()
    };
    // A window covering the whole prompt is full attention, bit for bit.
    assert_eq!(with_window(n), full);
    // A window of 4: the first 4 positions see everything anyway; later ones differ.
    let w4 = with_window(4);
    assert_eq!(w4[..4 * vocab], full[..4 * vocab]);
    for p in 4..n {
        assert_ne!(
            w4[p * vocab..(p + 1) * vocab],
            full[p * vocab..(p + 1) * vocab],
            "{p}"
        );
    }
    // A config that sets it is read.
    let text = std::fs::read_to_string(fixture("tiny-mistral").join("config.json")).unwrap();
    let text = text.replace("\"sliding_window\": null", "\"sliding_window\": 4");
    let cfg = loip_model::ModelConfig::from_hf_json(&text).unwrap();
    assert_eq!(cfg.sliding_window, Some(4));
}
