//! `loip chat` as a person uses it, on SmolLM2 (fetched and cached on first use): turns from
//! stdin, each reply the tokens `loip generate --chat` gives for the same message, the
//! history kept from turn to turn, `--system` opening the conversation, the turns echoed.

mod common;
use common::*;

use std::io::Write;
use std::process::Stdio;

/// `loip chat ARGS` with `input` on stdin: (stdout, stderr).
fn chat(args: &[&str], input: &str) -> (String, String) {
    let mut c = loip()
        .args(["chat", "--model", "smollm2", "-n", "10"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    c.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = c.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    (String::from_utf8_lossy(&out.stdout).to_string(), err)
}

fn turns(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn chat_keeps_the_history_and_answers_as_generate_does() {
    let q1 = "What is the capital of France?";
    let q2 = "And of Italy?";
    let want = json_run(loip().args([
        "generate", "--model", "smollm2", "--chat", "--prompt", q1, "-n", "10", "--json",
    ]));
    let (out, _) = chat(&["--json"], &format!("{q1}\n{q2}\n"));
    let t = turns(&out);
    assert_eq!(t.len(), 2, "{out}");
    assert_eq!(t[0]["user"], q1);
    assert_eq!(t[0]["prompt_ids"], want["prompt_ids"], "{out}");
    assert_eq!(t[0]["new_ids"], want["new_ids"], "{out}");
    // the second turn's prompt holds the first question and answer
    let len = |v: &serde_json::Value| v.as_array().map_or(0, Vec::len);
    assert!(
        len(&t[1]["prompt_ids"]) > len(&t[0]["prompt_ids"]) + len(&t[0]["new_ids"]),
        "{out}"
    );

    // /reset forgets; --system opens the conversation
    let (out, _) = chat(
        &["--json", "--system", "You answer in one word."],
        &format!("{q1}\n/reset\n{q1}\n"),
    );
    let t = turns(&out);
    assert_eq!(t.len(), 2, "{out}");
    assert_eq!(t[0]["prompt_ids"], t[1]["prompt_ids"], "{out}");
    // (SmolLM2's template opens with its own system message when none is given)
    assert_ne!(t[0]["prompt_ids"], want["prompt_ids"], "{out}");

    // text mode: each turn echoed, then the reply
    let (out, _) = chat(&[], &format!("{q1}\n"));
    assert!(out.starts_with(&format!("> {q1}\n")), "{out}");
    assert!(out.contains(want["text"].as_str().unwrap()), "{out}");
}
