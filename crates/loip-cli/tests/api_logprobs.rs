//! Issue 34, "logprobs on every path equal to `loip logits` within f32 bits": `loip api`
//! on one device, from slice files (`--offload-blocks all`, the `--mem` backend) and over a
//! cluster of two workers, each serving three requests at once (batched) and one alone;
//! every token's `logprob` is, bit for bit, the log-softmax of the logits `loip logits`
//! gives for the prompt and the tokens before it. Helpers in `common/api.rs`.

mod common;
use common::api::*;
use common::*;

use serde_json::{json, Value};

/// `loip logits` of `ids`: one row per position.
fn logits(model: &str, ids: &[u32]) -> Vec<Vec<f32>> {
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let v = json_run(loip().args(["logits", "--model", model, "--ids", &ids.join(",")]));
    v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

/// Checks a completion of `prompt` (token ids and `logprobs`) against `loip logits`.
fn check(model: &str, prompt: &[u32], v: &Value, path: &str) {
    check_choice(model, prompt, &v["choices"][0], path);
}

/// [`check`] of one choice `c`.
fn check_choice(model: &str, prompt: &[u32], c: &Value, path: &str) {
    let v = c;
    let ids: Vec<u32> = c["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("{path}: {v}"))
        .iter()
        .map(|i| i.as_u64().unwrap() as u32)
        .collect();
    let got = c["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(got.len(), ids.len(), "{path}: {v}");
    let mut all = prompt.to_vec();
    all.extend_from_slice(&ids[..ids.len() - 1]);
    let rows = logits(model, &all);
    for (j, (&id, lp)) in ids.iter().zip(got).enumerate() {
        let row = &rows[prompt.len() - 1 + j];
        let want = loip_engine::sampling::logprob_of(row, id, 0).logprob;
        let got = lp.as_f64().unwrap() as f32;
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "{path}: token {j} ({id}): {got} vs {want}"
        );
    }
}

/// Three requests at once (one step serves them together), then one alone; sampled with a
/// seed, so the tokens are not only the argmax.
fn serve_and_check(s: &Server, model: &str, path: &str) {
    let prompts: [&[u32]; 3] = [&[3, 1, 4, 1, 5], &[1, 5, 9, 23], &[2, 7, 1, 8, 2, 8]];
    let body = |p: &[u32], seed: u64| {
        json!({"prompt": p, "max_tokens": 6, "temperature": 0.8, "seed": seed,
               "ignore_eos": true, "return_token_ids": true, "logprobs": 2})
    };
    let replies: Vec<Value> = std::thread::scope(|sc| {
        let handles: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let b = body(p, i as u64);
                sc.spawn(move || s.post("/v1/completions", &b))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().json())
            .collect()
    });
    for (p, v) in prompts.iter().zip(&replies) {
        check(model, p, v, &format!("{path}, batched"));
    }
    let v = s.post("/v1/completions", &body(prompts[0], 9)).json();
    check(model, prompts[0], &v, &format!("{path}, alone"));
    // three choices of one prompt: where the backend can, they share its KV (computed once)
    let mut b = body(prompts[1], 11);
    b["n"] = json!(3);
    let v = s.post("/v1/completions", &b).json();
    let choices = v["choices"]
        .as_array()
        .unwrap_or_else(|| panic!("{path}: {v}"));
    assert_eq!(choices.len(), 3, "{path}: {v}");
    for c in choices {
        check_choice(model, prompts[1], c, &format!("{path}, n = 3"));
    }
}

#[test]
fn logprobs_equal_loip_logits_on_one_device_and_from_slice_files() {
    let model = fixture("tiny-qwen3");
    for (path, extra) in [
        ("one device", &[][..]),
        ("slice files", &["--offload-blocks", "all"][..]),
    ] {
        let mut args = vec!["--model", model.as_str(), "--parallel", "4"];
        args.extend_from_slice(extra);
        let s = Server::start(&args);
        serve_and_check(&s, &model, path);
    }
}

#[test]
fn logprobs_equal_loip_logits_over_a_cluster() {
    let model = fixture("tiny-qwen3");
    let (_dir, _workers, cluster) = workers_and_cluster("api-logprobs", 2);
    let s = Server::start(&[
        "--model",
        &model,
        "--cluster",
        cluster.to_str().unwrap(),
        "--token",
        TEST_TOKEN,
        "--planner",
        "loip-uniform",
        "--parallel",
        "4",
    ]);
    serve_and_check(&s, &model, "cluster");
}
