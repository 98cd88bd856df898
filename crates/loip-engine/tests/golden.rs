//! Golden tests: the engine against HF transformers float32 references, and the lossless
//! invariants (step grouping and micro-batching never change a token's logits). The families
//! beyond Llama go through every format the engine reads: each tiny HF fixture converted to
//! GGUF as llama.cpp's converter lays it out (`qwen2` with q/k/v biases, `qwen3` with q/k
//! norms, both in HF row order; Mistral as `llama`, q/k permuted) gives the HF logits; and
//! Mistral's sliding window is honoured when set.

use std::path::PathBuf;

use loip_engine::generate::{generate, Flow};
use loip_engine::{GenerateOptions, Generator, KvCache, Model, SamplingParams, TokenPos};
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

const TINY: [&str; 6] = [
    "tiny-llama",
    "tiny-qwen3",
    "tiny-llama-bf16-tied",
    "tiny-qwen2",
    "tiny-mistral",
    "tiny-gemma3",
];

#[test]
fn tiny_fixtures_logits_match_reference_at_every_position() {
    for name in TINY {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let model = Model::from_checkpoint(&ckpt).unwrap();
        let exp = expected(name);
        let input = ids(&exp["input_ids"]);
        let logits = model.prompt_logits(&input).unwrap();
        let worst = worst_diff(&logits, &exp);
        assert!(worst <= 1e-4, "{name}: max |logit diff| = {worst}");
    }
}

#[test]
fn tiny_fixtures_greedy_tokens_match_reference() {
    for name in TINY {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let model = Model::from_checkpoint(&ckpt).unwrap();
        let exp = expected(name);
        let want = ids(&exp["greedy_new_ids"]);
        let mut gen = Generator::new(&model, None);
        let opts = GenerateOptions {
            max_tokens: want.len(),
            sampling: SamplingParams::default(),
            eos_ids: ckpt.config.eos_token_ids.clone(),
            min_tokens: want.len(),
        };
        let out = generate(&mut gen, 0, &ids(&exp["input_ids"]), &opts, &mut |_| {
            Flow::Continue
        })
        .unwrap();
        assert_eq!(out.new_ids, want, "{name}");
    }
}

#[test]
fn step_grouping_and_micro_batching_are_bit_identical() {
    let ckpt = Checkpoint::open(&fixture("tiny-qwen3")).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let prompt = ids(&expected("tiny-qwen3")["input_ids"]);
    let full = model.prompt_logits(&prompt).unwrap();
    let vocab = ckpt.config.vocab_size;

    // One token per step.
    let mut kv = model.new_cache(None);
    for (p, &id) in prompt.iter().enumerate() {
        let x = model
            .forward_hidden(&[id], &[TokenPos { seq: 0, pos: p }], &mut kv)
            .unwrap();
        let l = model.logits(&x, &[0]).unwrap();
        assert_eq!(l, full[p * vocab..(p + 1) * vocab], "position {p}");
    }

    // Three sequences interleaved in one micro-batch, at different positions.
    let mut kv = KvCache::new(0..ckpt.config.num_layers, model.tf.kv_dim(), None);
    let other: Vec<u32> = prompt.iter().rev().copied().collect();
    let x = model
        .forward_hidden(
            &other[..3],
            &[0, 1, 2].map(|pos| TokenPos { seq: 7, pos }),
            &mut kv,
        )
        .unwrap();
    drop(x);
    let mut batch_ids = vec![];
    let mut batch = vec![];
    for p in 0..4 {
        batch_ids.push(prompt[p]);
        batch.push(TokenPos { seq: 1, pos: p });
    }
    batch_ids.push(other[3]);
    batch.push(TokenPos { seq: 7, pos: 3 });
    let x = model.forward_hidden(&batch_ids, &batch, &mut kv).unwrap();
    let l = model.logits(&x, &[0, 1, 2, 3]).unwrap();
    assert_eq!(l, full[..4 * vocab]);
    let alone = model.prompt_logits(&other[..4]).unwrap();
    assert_eq!(model.logits(&x, &[4]).unwrap(), alone[3 * vocab..]);
}

#[test]
fn bad_token_id_and_kv_budget_are_errors() {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    assert!(model.prompt_logits(&[1, 999]).is_err());
    let mut kv = model.new_cache(Some(100));
    let err = model.forward_hidden(
        &[1, 2],
        &[TokenPos { seq: 0, pos: 0 }, TokenPos { seq: 0, pos: 1 }],
        &mut kv,
    );
    assert!(
        matches!(err, Err(loip_engine::EngineError::KvBudget { .. })),
        "{err:?}"
    );
    assert_eq!(kv.used_bytes(), 0);
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
        ("tiny-gemma3", Arch::Gemma3, "gemma3"),
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
        let qk_norm = matches!(arch, Arch::Qwen3 | Arch::Gemma3);
        assert_eq!(gg.config.qk_norm, qk_norm, "{name}");
        let (mut a_cfg, mut g_cfg) = (hf.config.clone(), gg.config.clone());
        // A Gemma GGUF stores its norms as 1 + w, a Mistral one says llama; nothing else may
        // differ.
        a_cfg.arch = g_cfg.arch;
        (a_cfg.norm_plus_one, g_cfg.norm_plus_one) = (false, false);
        (a_cfg.eos_token_ids, g_cfg.eos_token_ids) = (vec![], vec![]);
        assert_eq!(a_cfg, g_cfg, "{name}");

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
