//! Real quantized models against the HF transformers reference: SmolLM2-135M-Instruct (Q4_1
//! GGUF) and Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q6_K, Q5_0 and Q8_0 tensors, sliding-window
//! layers). The models are fetched and verified on first use (cached), so CI runs these tests.
//! Checks per case: last-position logits within 5e-3, the same top-20 set, and the greedy
//! continuation identical.

use std::path::PathBuf;

use loip_engine::generate::{generate, Flow};
use loip_engine::{GenerateOptions, Generator, Model, SamplingParams};
use loip_model::Checkpoint;
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn smollm2_matches_reference() {
    let path = loip_model::fetch::fetch_smollm2().expect("fetch SmolLM2");
    matches_reference(&path, "smollm2");
}

#[test]
fn gemma3_270m_matches_reference() {
    let path = loip_model::fetch::fetch_gemma3_270m().expect("fetch Gemma 3 270M");
    matches_reference(&path, "gemma3-270m");
}

fn matches_reference(path: &std::path::Path, fixture: &str) {
    let ckpt = Checkpoint::open(path).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(fixture)
        .join("expected.json");
    let exp: Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    for case in exp["cases"].as_array().unwrap() {
        let input = ids(&case["input_ids"]);
        let mut gen = Generator::new(&model, None);
        let want_new = ids(&case["greedy_new_ids"]);
        let opts = GenerateOptions {
            max_tokens: want_new.len(),
            sampling: SamplingParams::default(),
            eos_ids: ckpt.config.eos_token_ids.clone(),
            min_tokens: want_new.len(),
        };
        // Last-position logits of the prompt.
        let logits = {
            let mut kv = model.new_cache(None);
            let batch: Vec<_> = (0..input.len())
                .map(|pos| loip_engine::TokenPos { seq: 0, pos })
                .collect();
            let x = model.forward_hidden(&input, &batch, &mut kv).unwrap();
            model.logits(&x, &[input.len() - 1]).unwrap()
        };
        let reference: Vec<f32> = case["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let worst = logits
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("{}: max |logit diff| = {worst}", case["prompt"]);
        assert!(
            worst <= 5e-3,
            "{}: max |logit diff| = {worst}",
            case["prompt"]
        );
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let mut top: Vec<u32> = order[..20].iter().map(|&i| i as u32).collect();
        let mut want_top = ids(&case["top20_ids"]);
        top.sort_unstable();
        want_top.sort_unstable();
        assert_eq!(top, want_top, "top-20 set");
        let out = generate(&mut gen, 0, &input, &opts, &mut |_| Flow::Continue).unwrap();
        assert_eq!(out.new_ids, want_new, "{}", case["prompt"]);
    }
}
