//! Golden tests: the engine against HF transformers float32 references, and the lossless
//! invariants (step grouping and micro-batching never change a token's logits).

use std::path::PathBuf;

use loip_engine::generate::{generate, Flow};
use loip_engine::{GenerateOptions, Generator, KvCache, Model, SamplingParams, TokenPos};
use loip_model::Checkpoint;
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

const TINY: [&str; 5] = [
    "tiny-llama",
    "tiny-qwen3",
    "tiny-llama-bf16-tied",
    "tiny-qwen2",
    "tiny-mistral",
];

#[test]
fn tiny_fixtures_logits_match_reference_at_every_position() {
    for name in TINY {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let model = Model::from_checkpoint(&ckpt).unwrap();
        let exp = expected(name);
        let input = ids(&exp["input_ids"]);
        let logits = model.prompt_logits(&input).unwrap();
        let vocab = ckpt.config.vocab_size;
        let mut worst = 0f32;
        for (p, row) in exp["logits"].as_array().unwrap().iter().enumerate() {
            for (j, v) in row.as_array().unwrap().iter().enumerate() {
                let d = (logits[p * vocab + j] - v.as_f64().unwrap() as f32).abs();
                worst = worst.max(d);
            }
        }
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
