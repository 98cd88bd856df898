//! `loip api --speculate lookup` end to end (issue 31): concurrent greedy completions, each
//! speculating beside the others in the serving loop's shared steps, give `loip generate`'s
//! tokens without speculation, in memory and from slice files, on a full-attention and a
//! sliding-window model; `/metrics` counts the drafts; a draft model and a cluster are
//! refused at startup with a clear message.

mod common;
use common::api::*;
use common::*;

fn prompts() -> Vec<Vec<u32>> {
    // prompts that repeat themselves, so lookup drafts
    (0..3u32)
        .map(|s| {
            (0..12 + 5 * s)
                .map(|i| 4 + s * 11 + (i % (3 + s)) * 13)
                .collect()
        })
        .collect()
}

#[test]
fn speculating_requests_give_generates_tokens_in_memory_and_offloaded() {
    for name in ["tiny-llama", "tiny-gemma3"] {
        let model = fixture(name);
        let ps = prompts();
        let want = generate_ids(&model, &ps, 32);
        for place in [vec![], vec!["--offload-blocks", "all"]] {
            let mut args = vec![
                "--model",
                &model,
                "--parallel",
                "3",
                "--speculate",
                "lookup",
            ];
            args.extend_from_slice(&place);
            let s = Server::start(&args);
            let got = concurrent_ids(&s, &ps, 32);
            assert_eq!(got, want, "{name} {place:?}");
            let m = http(&s.addr, "GET", "/metrics", b"");
            let text = String::from_utf8_lossy(&m.body).into_owned();
            let drafted = text
                .lines()
                .find_map(|l| l.strip_prefix("loip_speculate_drafted_total{source=\"lookup\"} "))
                .and_then(|v| v.trim().parse::<f64>().ok());
            assert!(drafted.is_some_and(|d| d > 0.0), "{name} {place:?}: {text}");
        }
    }
}

#[test]
fn a_draft_model_and_bad_k_are_refused_at_startup() {
    let model = fixture("tiny-llama");
    for (flags, needle) in [
        (vec!["--speculate", "draft"], "prompt lookup"),
        (
            vec!["--speculate", "lookup", "--speculate-k", "99"],
            "--speculate-k",
        ),
        (
            vec!["--speculate", "sometimes"],
            "expected lookup, draft or off",
        ),
    ] {
        let out = loip()
            .args(["api", "--listen", "127.0.0.1:0", "--model", &model])
            .args(&flags)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?} started");
        assert!(err.contains(needle), "{flags:?}: {err}");
    }
}
