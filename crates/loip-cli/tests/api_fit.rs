//! `loip api --mem` without `--context`/`--parallel`/`--max-prompt`: a budget that holds
//! only a smaller context or fewer sequences than the defaults gets a working server and
//! the one line saying what was chosen and why; a budget that holds not even the smallest
//! is refused naming the flags and the numbers.

mod common;
use common::api::*;
use common::*;

#[test]
fn a_budget_too_small_for_the_defaults_serves_the_largest_that_fits() {
    let s = Server::start(&["--model", "smollm2", "--mem", "200MiB"]);
    let log = s.log();
    let line = log
        .lines()
        .find(|l| l.starts_with("serving with --context"))
        .unwrap_or_else(|| panic!("no choice printed:\n{log}"));
    assert!(line.contains("the largest that fit --mem 200"), "{line}");
    assert!(
        line.contains("--context 4096 --max-prompt 2048 --parallel 4 refused"),
        "{line}"
    );
    let num = |flag: &str| -> usize {
        let rest = line.split(flag).nth(1).unwrap().trim_start();
        rest.split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (context, parallel) = (num("--context "), num("--parallel "));
    assert!(context < 4096 || parallel < 4, "{line}");
    // it serves, and greedily the tokens of `loip generate`
    let ids = [1u32, 504, 3458, 282, 4649, 314];
    let got = greedy_ids(&s, &ids, 8)["choices"][0]["token_ids"].clone();
    assert_eq!(got, generate_one("smollm2", &ids, 8, &[]));
}

#[test]
fn a_budget_that_holds_not_even_the_smallest_is_refused_naming_the_flags() {
    let out = loip()
        .args([
            "api",
            "--listen",
            "127.0.0.1:0",
            "--model",
            "smollm2",
            "--mem",
            "72MiB",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    for want in [
        "--mem 72.0 MiB",
        "--context 256 --max-prompt 128 --parallel 1",
        "KV",
        "--context, --max-prompt or --parallel",
    ] {
        assert!(err.contains(want), "{want:?} missing from:\n{err}");
    }
}
