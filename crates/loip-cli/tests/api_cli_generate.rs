//! `loip generate` on the one backend of `loip api` (a batched serving loop): its greedy
//! tokens are the HF transformers fixture's, in memory and from slice files (every block
//! offloaded), and
//! its `--json` fields are the same as before the move (tokens, timings, memory).

mod common;
use common::api::generate;
use common::*;

use serde_json::Value;

fn expected(name: &str) -> (Vec<u64>, Vec<u64>) {
    let path = format!("{}/expected.json", fixture(name));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    (ids("input_ids"), ids("greedy_new_ids"))
}

fn run(model: &str, ids: &[u64], n: usize, extra: &[&str]) -> Value {
    let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
    let (ids, n) = (ids.join(","), n.to_string());
    let mut args = vec![
        "--model",
        model,
        "--prompt-ids",
        &ids,
        "-n",
        &n,
        "--min-tokens",
        &n,
    ];
    args.extend_from_slice(extra);
    generate(&args)
}

#[test]
fn generate_gives_the_fixtures_tokens_in_memory_and_from_slice_files() {
    for name in ["tiny-llama", "tiny-qwen3"] {
        let model = fixture(name);
        let (prompt, want) = expected(name);
        let n = want.len().min(24);
        let want: Vec<Value> = want[..n].iter().map(|&x| x.into()).collect();
        let mem = run(&model, &prompt, n, &[]);
        assert_eq!(
            mem["new_ids"].as_array().unwrap(),
            &want,
            "{name} in memory"
        );
        assert_eq!(mem["stop"], "length", "{mem}");
        for k in [
            "prompt_ids",
            "text",
            "decode_ms_per_token",
            "prompt_ms_per_token",
        ] {
            assert!(mem.get(k).is_some(), "{k} missing: {mem}");
        }
        assert!(mem["peak_rss_bytes"].as_u64().is_some(), "{mem}");
        let sliced = run(&model, &prompt, n, &["--offload-blocks", "all"]);
        assert_eq!(
            sliced["new_ids"].as_array().unwrap(),
            &want,
            "{name} from slice files"
        );
        assert!(sliced["memory"]["slot"].as_u64().unwrap() > 0, "{sliced}");
        assert!(sliced["loaded_bytes"].as_u64().unwrap() > 0, "{sliced}");
        assert!(
            sliced["load_stall_ms_per_token"].as_f64().is_some(),
            "{sliced}"
        );
    }
}
