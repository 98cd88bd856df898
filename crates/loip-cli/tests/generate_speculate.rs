//! `loip generate --speculate`: the tokens of the same request without speculation, in
//! memory and from slice files, greedy and seeded sampled, from prompt lookup and from a
//! draft model (a sampled request's draft samples: the same number of tokens, their law
//! tested in the engine); a draft model with other token ids is refused with a clear error.

mod common;
use common::api::generate;
use common::*;

use serde_json::Value;

fn run(model: &str, extra: &[&str]) -> Value {
    // a prompt that repeats itself, so lookup finds drafts
    let mut args = vec![
        "--model",
        model,
        "--prompt-ids",
        "5,9,14,5,9,14,5,9,14,5,9",
        "-n",
        "24",
        "--min-tokens",
        "24",
    ];
    args.extend_from_slice(extra);
    generate(&args)
}

#[test]
fn speculation_gives_the_same_tokens_in_memory_offloaded_and_sampled() {
    let model = fixture("tiny-llama");
    let draft = fixture("tiny-llama-bf16-tied");
    for (base, what) in [
        (vec![], "greedy"),
        (vec!["--temperature", "0.9", "--seed", "11"], "sampled"),
    ] {
        for place in [vec![], vec!["--offload-blocks", "all"]] {
            let mut plain_args = base.clone();
            plain_args.extend_from_slice(&place);
            let plain = run(&model, &plain_args);
            for spec in [
                vec!["--speculate", "lookup"],
                vec![
                    "--speculate",
                    "lookup",
                    "--speculate-k",
                    "3",
                    "--speculate-fixed",
                ],
                vec!["--speculate", "draft", "--draft", &draft],
            ] {
                let mut args = plain_args.clone();
                args.extend_from_slice(&spec);
                let got = run(&model, &args);
                let tag = format!("{what} {place:?} {spec:?}");
                if what == "sampled" && spec[1] == "draft" {
                    // a sampling draft keeps the distribution, not the seeded tokens
                    // (loip-engine/tests/speculate_sampling.rs); the length is fixed here
                    let n = |v: &Value| v["new_ids"].as_array().map(Vec::len);
                    assert_eq!(n(&got), n(&plain), "{tag}");
                } else {
                    assert_eq!(got["new_ids"], plain["new_ids"], "{tag}");
                }
                assert!(
                    got["speculation"]["steps"].as_u64().unwrap() > 0,
                    "{tag}: {got}"
                );
                if !place.is_empty() {
                    assert!(got["loaded_bytes"].as_u64().unwrap() > 0, "{tag}: {got}");
                }
            }
        }
    }
}

/// The error of a `loip generate` on tiny-llama with `spec` flags, which must fail.
fn refusal(spec: &[&str]) -> String {
    let model = fixture("tiny-llama");
    let out = loip()
        .args(["generate", "--model", &model, "--prompt-ids", "1,2,3"])
        .args(spec)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{spec:?} ran");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_draft_with_other_token_ids_is_refused() {
    let qwen = fixture("tiny-qwen3");
    let err = refusal(&["--speculate", "draft", "--draft", &qwen]);
    assert!(err.contains("cannot draft for this model"), "{err}");
    let err = refusal(&["--speculate", "draft"]);
    assert!(err.contains("--draft MODEL"), "{err}");
}
