//! `loip local --speculate`: through the pipeline of worker processes on loopback, the
//! tokens of `loip generate` without speculation, greedy and seeded sampled (prompt lookup's
//! drafts are point masses: the same seeded tokens); a sampled verify step gets the logits
//! of its k + 1 rows from the last device.

mod common;
use common::api::generate;
use common::*;

use serde_json::Value;

/// A prompt that repeats itself; tiny-llama's greedy and sampled continuations of it repeat
/// a few n-grams within 48 tokens, so lookup finds drafts.
const PROMPT: &str = "5,9,14,5,9,14,5,9,14,5,9";

fn local(model: &str, extra: &[&str]) -> Value {
    let mut cmd = loip();
    cmd.args([
        "local",
        "--model",
        model,
        "--devices",
        "2",
        "--mem",
        "64MiB",
        "--prompt-ids",
        PROMPT,
        "-n",
        "48",
        "--ignore-eos",
        "--json",
    ]);
    cmd.args(extra);
    json_run(&mut cmd)
}

/// The working bytes (activations, logits rows, scratch) the head's device accounted when
/// it opened.
fn head_working(run: &Value) -> u64 {
    let plan = run["plan"]["devices"].as_array().expect("plan devices");
    let head = plan
        .iter()
        .find(|d| d["holds_head"] == true)
        .and_then(|d| d["name"].as_str())
        .expect("a device holds the head");
    let devices = run["devices"].as_array().expect("devices");
    let dev = devices
        .iter()
        .find(|d| d["endpoint"]["name"] == head)
        .expect("the head's device");
    dev["memory"]["working"].as_u64().expect("working bytes")
}

#[test]
fn local_speculation_gives_the_tokens_of_generate_greedy_and_sampled() {
    let model = fixture("tiny-llama");
    let mut working = Vec::new();
    for (sampling, what) in [
        (vec![], "greedy"),
        // top-k 2: draws that repeat enough n-grams for the lookup to propose (this seed's
        // drafts are partly kept, partly rejected)
        (
            vec!["--temperature", "0.9", "--top-k", "2", "--seed", "3"],
            "sampled",
        ),
    ] {
        let mut args = vec![
            "--model",
            &model,
            "--prompt-ids",
            PROMPT,
            "-n",
            "48",
            "--ignore-eos",
        ];
        args.extend_from_slice(&sampling);
        let want = generate(&args);
        let mut extra = sampling.clone();
        extra.extend_from_slice(&[
            "--speculate",
            "lookup",
            "--speculate-k",
            "3",
            "--speculate-fixed",
        ]);
        let got = local(&model, &extra);
        assert_eq!(got["new_ids"], want["new_ids"], "{what}: {got}");
        let drafted = got["speculation"]["drafted"].as_u64();
        assert!(drafted.is_some_and(|d| d > 0), "{what}: {got}");
        working.push(head_working(&got));
    }
    // a sampled verify step's k + 1 = 4 logits rows (256 tokens of f32) are accounted
    // when the head's device opens, a greedy one's argmax needs one row
    assert!(
        working[1] >= working[0] + 3 * 256 * 4,
        "working bytes greedy {}, sampled {}",
        working[0],
        working[1]
    );
}
