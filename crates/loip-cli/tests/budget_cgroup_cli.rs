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

/// `loip api --mem 256MiB --context 512` in a cgroup of exactly 256 MiB (SmolLM2, 97 MB of weights: part
/// streamed from slice files) under load: 8 clients at once with long prompts, two of them
/// streaming and hanging up after the first bytes, then 8 more requests. Every finished
/// request is answered, the server still says it is healthy, and the kernel killed nothing.
#[test]
fn api_under_load_stays_within_a_cgroup_of_its_budget() {
    use common::api::{http, wait_for_line, Guard};
    use std::io::{Read, Write};
    if let Some(why) = cgroup_skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    const MEM: u64 = 256 << 20;
    let cg = Cgroup::create(&format!("loip-cli-test-api-{}", std::process::id()), MEM).unwrap();
    let mut cmd = loip();
    cmd.args(["api", "--listen", "127.0.0.1:0", "--model", "smollm2", "--mem", "256MiB"])
        .args(["--parallel", "4", "--context", "512"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cg.confine(&mut cmd).unwrap();
    let mut child = Guard(cmd.spawn().unwrap());
    let err = child.0.stderr.take().unwrap();
    let (addr, log) = wait_for_line(err, "listening on http://");
    let long = "Summarise the following notes. ".repeat(30);
    let body = |stream: bool| {
        serde_json::json!({"model": "smollm2", "prompt": long, "max_tokens": 24,
            "min_tokens": 24, "stream": stream})
        .to_string()
    };
    for round in 0..2 {
        let clients: Vec<_> = (0..8)
            .map(|i| {
                let (addr, req) = (addr.clone(), body(i < 2 && round == 0));
                std::thread::spawn(move || {
                    if i < 2 && round == 0 {
                        // a streaming client that hangs up after the first bytes
                        let mut s = std::net::TcpStream::connect(&addr).unwrap();
                        let head = format!(
                            "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\n\
                             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                            req.len()
                        );
                        s.write_all(head.as_bytes()).unwrap();
                        s.write_all(req.as_bytes()).unwrap();
                        let mut b = [0u8; 64];
                        let _ = s.read(&mut b);
                        return 0;
                    }
                    http(&addr, "POST", "/v1/completions", req.as_bytes()).status
                })
            })
            .collect();
        for c in clients {
            let status = c.join().unwrap();
            assert!(status == 0 || status == 200 || status == 429, "status {status}");
        }
    }
    let health = http(&addr, "GET", "/health", b"");
    assert_eq!(health.status, 200, "{}", String::from_utf8_lossy(&health.body));
    // /health reports the split and the live charge
    let h = health.json();
    assert_eq!(h["memory"]["budget"]["total"], MEM, "{h}");
    assert!(h["memory"]["charge"]["bytes"].as_u64().unwrap_or(0) > 0, "{h}");
    let r = cg.report();
    let peak = r.peak.unwrap_or(0);
    let text = log.lock().map(|l| l.clone()).unwrap_or_default();
    eprintln!(
        "loip api --mem 256MiB: peak charge {:.1} MiB, OOM kills {}\n{}",
        peak as f64 / (1 << 20) as f64,
        r.oom_kills,
        text.lines().find(|l| l.contains("= engine")).unwrap_or("")
    );
    assert_eq!(r.oom_kills, 0);
    assert!(peak <= MEM);
    drop(child);
}
