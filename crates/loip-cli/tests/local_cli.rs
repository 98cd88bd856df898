//! `loip local`, `loip worker` and `loip serve` end to end, through the binary: real worker
//! processes on loopback, output identical to `loip generate` on one device.
//! (Skips with a message while the binary does not have the commands yet.)

mod common;
use common::*;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The cluster tests' shared token (tokens have at least 16 characters).
const TEST_TOKEN: &str = "cli-test-token-0123456789";

fn has_commands() -> bool {
    let out = loip().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let ok = ["local", "worker", "serve"]
        .iter()
        .all(|c| help.lines().any(|l| l.trim_start().starts_with(c)));
    if !ok {
        eprintln!("skipping: this loip binary has no local/worker/serve commands yet");
    }
    ok
}

fn single_device(model: &str, ids: &str, n: &str) -> serde_json::Value {
    json_run(loip().args([
        "generate",
        "--model",
        model,
        "--prompt-ids",
        ids,
        "-n",
        n,
        "--ignore-eos",
        "--json",
    ]))
}

#[test]
fn local_matches_one_device_and_reports_plan_and_breakdown() {
    if !has_commands() {
        return;
    }
    let model = fixture("tiny-llama");
    let want = single_device(&model, "1,5,9,23", "8");
    for extra in [
        vec![],
        vec!["--bandwidth", "50mbit", "--loader", "conventional"],
        vec!["--devices", "2", "--concurrent", "3"],
    ] {
        let mut cmd = loip();
        cmd.args([
            "local",
            "--model",
            &model,
            "--mem",
            "64MiB",
            "--prompt-ids",
            "1,5,9,23",
            "-n",
            "8",
            "--ignore-eos",
            "--json",
        ]);
        cmd.args(&extra);
        let got = json_run(&mut cmd);
        assert_eq!(got["new_ids"], want["new_ids"], "loip local {extra:?}");
        assert!(
            got["plan"]["devices"]
                .as_array()
                .is_some_and(|d| !d.is_empty()),
            "{got}"
        );
        for k in ["compute_ms", "network_ms", "load_stall_ms"] {
            assert!(
                got["breakdown"][k].as_f64().is_some(),
                "breakdown.{k} missing: {got}"
            );
        }
        if let Some(seqs) = got["sequences"].as_array() {
            assert!(seqs.iter().all(|s| *s == want["new_ids"]));
        }
    }
}

/// `loip local --preview`: the workers measured and planned on, the plan printed, nothing
/// generated; the workers and their temp stores gone afterwards.
#[test]
fn local_preview_prints_the_plan_and_generates_nothing() {
    if !has_commands() {
        return;
    }
    let model = fixture("tiny-llama");
    let out = loip()
        .args(["local", "--model", &model, "--mem", "64MiB", "--preview"])
        .args(["--prompt-ids", "1,5,9,23", "-n", "8"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("preview only: nothing loaded"), "{stderr}");
    assert!(stderr.contains("predicted"), "the plan: {stderr}");
    assert!(!stderr.contains("decode:"), "nothing generated: {stderr}");
    assert!(stdout.trim().is_empty(), "no text: {stdout}");
}

#[test]
fn serve_runs_stdin_prompts_on_workers_refuses_a_wrong_token_and_leaves_out_an_unreachable_one() {
    if !has_commands() {
        return;
    }
    let model = fixture("tiny-qwen3");
    let dir = std::env::temp_dir().join(format!("loip-cli-serve-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut workers = Vec::new();
    let mut addrs = Vec::new();
    for i in 1..=2 {
        let mut child = loip()
            .args([
                "worker",
                "--listen",
                "127.0.0.1:0",
                "--mem",
                "256MiB",
                "--token",
                TEST_TOKEN,
                "--name",
            ])
            .arg(format!("w{i}"))
            .arg("--store")
            .arg(dir.join(format!("w{i}")))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        addrs.push(
            line.trim()
                .strip_prefix("listening on ")
                .unwrap()
                .to_string(),
        );
        workers.push(child);
    }
    let cluster = dir.join("cluster.toml");
    let mut toml = String::new();
    for (i, a) in addrs.iter().enumerate() {
        toml.push_str(&format!(
            "[[device]]\nname = \"w{}\"\naddr = \"{a}\"\n\n",
            i + 1
        ));
    }
    std::fs::write(&cluster, toml).unwrap();
    let want = single_device(&model, "3,1,4,1,5", "5");
    let mut serve = loip()
        .args(["serve", "--model", &model, "--cluster"])
        .arg(&cluster)
        .args([
            "--token",
            TEST_TOKEN,
            "--json",
            "-n",
            "5",
            "--ignore-eos",
            "--planner",
            "loip-uniform",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(serve.stdin.as_mut().unwrap(), "[3, 1, 4, 1, 5]").unwrap();
    writeln!(serve.stdin.as_mut().unwrap(), "[3, 1, 4, 1, 5]").unwrap();
    drop(serve.stdin.take());
    let out = serve.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        assert_eq!(l["new_ids"], want["new_ids"]);
    }
    let bad = loip()
        .args(["serve", "--model", &model, "--cluster"])
        .arg(&cluster)
        .args(["--token", "a-wrong-token-0123456789"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("wrong token") && err.contains("w1"), "{err}");
    // A third device nobody answers for: left out, said so, the others serve.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let with_dead = dir.join("cluster-dead.toml");
    std::fs::write(
        &with_dead,
        format!(
            "{}[[device]]\nname = \"w3\"\naddr = \"{dead}\"\n",
            std::fs::read_to_string(&cluster).unwrap()
        ),
    )
    .unwrap();
    let mut serve = loip()
        .args(["serve", "--model", &model, "--cluster"])
        .arg(&with_dead)
        .args([
            "--token",
            TEST_TOKEN,
            "--connect-retry",
            "1s",
            "--json",
            "-n",
            "5",
            "--ignore-eos",
            "--planner",
            "loip-uniform",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(serve.stdin.as_mut().unwrap(), "[3, 1, 4, 1, 5]").unwrap();
    drop(serve.stdin.take());
    let out = serve.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("w3") && err.contains("unreachable") && err.contains(&dead),
        "{err}"
    );
    // tried again for the --connect-retry window first, each try logged
    assert!(err.contains("trying again"), "{err}");
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with('{'))
        .map(str::to_string)
        .expect("an answer");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&line).unwrap()["new_ids"],
        want["new_ids"]
    );
    for mut w in workers {
        let _ = w.kill();
        let _ = w.wait();
    }
    std::thread::sleep(Duration::from_millis(10));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Children of `pid` (from /proc).
fn children(pid: u32) -> Vec<u32> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid …; comm may hold spaces, so split after the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|r| r.1) else {
            continue;
        };
        let ppid: u32 = rest
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        if ppid == pid {
            v.extend(e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()));
        }
    }
    v
}

#[test]
fn local_on_ctrl_c_kills_its_workers_and_removes_its_temp_dir() {
    if !has_commands() {
        return;
    }
    let model = fixture("tiny-llama");
    // A slow emulated link keeps the generation running long enough to interrupt it.
    let mut child = loip()
        .args([
            "local",
            "--model",
            &model,
            "--mem",
            "64MiB",
            "--prompt-ids",
            "1,5,9,23",
            "-n",
            "200",
            "--ignore-eos",
        ])
        .args(["--bandwidth", "20kbit"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let temp = std::env::temp_dir().join(format!("loip-local-{pid}"));
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while err.read_line(&mut line).unwrap() > 0 && !line.contains("workers on loopback") {
        line.clear();
    }
    assert!(
        line.contains("workers on loopback"),
        "loip local did not start its workers"
    );
    let workers = children(pid);
    assert_eq!(workers.len(), 3, "{workers:?}");
    assert!(temp.exists());
    std::thread::sleep(Duration::from_millis(500));
    assert!(Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success(), "{rest}");
    assert!(rest.contains("interrupted"), "{rest}");
    assert!(!temp.exists(), "{} left behind", temp.display());
    for w in workers {
        // Gone, or a zombie about to be reaped by init. A killed process needs a moment to
        // get there on a loaded machine: look for up to 5 s.
        let mut state = String::new();
        let mut done = false;
        for _ in 0..50 {
            state = std::fs::read_to_string(format!("/proc/{w}/stat")).unwrap_or_default();
            let st = state
                .rsplit_once(')')
                .and_then(|r| r.1.split_whitespace().next().map(str::to_string));
            if st.is_none() || st.as_deref() == Some("Z") {
                done = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(done, "worker {w} still running: {state}");
    }
}
