//! `--mem` is the whole process's budget and the kernel judges it: `loip local --cgroup`
//! runs every worker in a memory cgroup of exactly its `--mem`, and `loip worker` without
//! `--mem` takes the budget of the cgroup it runs in. Each test prints the kernel's figures
//! and skips with a printed reason where memory cgroups cannot be made.

mod common;
use common::*;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use loip_runtime::memory::Cgroup;

/// Why memory cgroups cannot be made here, or None.
fn cgroup_skip_reason() -> Option<String> {
    match Cgroup::create(&format!("loip-cli-test-{}", std::process::id()), 64 << 20) {
        Ok(_) => None,
        Err(e) => Some(format!("cannot create a memory cgroup here: {e}")),
    }
}

fn run_json(args: &[&str]) -> serde_json::Value {
    json_run(loip().args(args))
}

/// SmolLM2 on three workers of 66 MiB each, every one in a cgroup of exactly 66 MiB: no OOM
/// kill, every peak charge within the limit, the tokens of one device. A fresh store first
/// (slices received and written under the limit), then the same stores again (cached).
#[test]
fn smollm2_on_three_66mib_workers_each_in_a_66mib_cgroup() {
    if let Some(why) = cgroup_skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let (prompt, n) = ("Write a short poem about the sea", "24");
    let want = run_json(&[
        "generate",
        "--model",
        "smollm2",
        "--prompt",
        prompt,
        "-n",
        n,
        "--min-tokens",
        n,
        "--json",
    ]);
    let stores = std::env::temp_dir().join(format!("loip-cg-stores-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&stores);
    for run in ["fresh store", "cached store"] {
        let got = run_json(&[
            "local",
            "--model",
            "smollm2",
            "--devices",
            "3",
            "--mem",
            "66MiB",
            "--cgroup",
            "--store-root",
            &stores.to_string_lossy(),
            "--prompt",
            prompt,
            "-n",
            n,
            "--min-tokens",
            n,
            "--json",
        ]);
        assert_eq!(got["new_ids"], want["new_ids"], "{run}: tokens");
        let cgroups = got["cgroups"].as_array().expect("cgroup figures");
        assert_eq!(cgroups.len(), 3);
        for c in cgroups {
            let (limit, peak) = (c["limit"].as_u64().unwrap(), c["peak"].as_u64().unwrap());
            eprintln!(
                "{run}: {} limit {} MiB, peak charge {:.1} MiB, OOM kills {}",
                c["device"],
                limit >> 20,
                peak as f64 / (1 << 20) as f64,
                c["oom_kills"]
            );
            assert_eq!(c["oom_kills"], 0, "{run}: {c}");
            assert!(peak <= limit && limit == 66 << 20, "{run}: {c}");
        }
    }
    let _ = std::fs::remove_dir_all(&stores);
}

/// `loip worker` without `--mem` inside a 300 MiB cgroup picks a budget below 300 MiB, says
/// why, and splits it between the engine and the process.
#[test]
fn a_worker_without_mem_takes_its_cgroups_budget_and_says_why() {
    if let Some(why) = cgroup_skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let cg = Cgroup::create(
        &format!("loip-cli-test-default-{}", std::process::id()),
        300 << 20,
    )
    .unwrap();
    let store = std::env::temp_dir().join(format!("loip-cg-default-{}", std::process::id()));
    let mut cmd = loip();
    cmd.args(["worker", "--listen", "127.0.0.1:0", "--store"])
        .arg(&store)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cg.confine(&mut cmd).unwrap();
    let mut child = cmd.spawn().unwrap();
    let err = child.stderr.take().unwrap();
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    for line in BufReader::new(err).lines() {
        let Ok(line) = line else { break };
        lines.push(line);
        if lines.iter().any(|l| l.contains("= engine")) || Instant::now() > deadline {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&store);
    let text = lines.join("\n");
    eprintln!("{text}");
    let chosen = lines
        .iter()
        .find(|l| l.contains("(no --mem)"))
        .unwrap_or_else(|| panic!("no budget line: {text}"));
    assert!(chosen.contains("cgroup"), "{chosen}");
    let mib: f64 = chosen
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{chosen}"));
    assert!(mib < 300.0 && mib > 200.0, "{chosen}");
    assert!(text.contains("= engine"), "{text}");
}
