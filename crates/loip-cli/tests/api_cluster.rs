//! `loip api --cluster` end to end: a cluster of worker processes serves the same tokens as
//! `loip generate` alone, one request or several at once (batched micro-batches), and
//! re-plans after a lost device. Helpers in `common/api.rs`.

mod common;
use common::api::*;
use common::*;

use std::process::Stdio;

use serde_json::{json, Value};

#[test]
fn a_cluster_serves_the_same_tokens_and_replans_after_a_lost_device() {
    let model = fixture("tiny-qwen3");
    let dir = std::env::temp_dir().join(format!("loip-api-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut workers = Vec::new();
    let mut toml = String::new();
    for i in 1..=2 {
        let mut w = Guard(
            loip()
                .args([
                    "worker",
                    "--listen",
                    "127.0.0.1:0",
                    "--mem",
                    "256MiB",
                    "--token",
                    TEST_TOKEN,
                ])
                .arg("--name")
                .arg(format!("w{i}"))
                .arg("--store")
                .arg(dir.join(format!("w{i}")))
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let out = w.0.stdout.take().unwrap();
        let (addr, _) = wait_for_line(out, "listening on ");
        toml.push_str(&format!(
            "[[device]]\nname = \"w{i}\"\naddr = \"{addr}\"\n\n"
        ));
        workers.push(w);
    }
    let cluster = dir.join("cluster.toml");
    std::fs::write(&cluster, toml).unwrap();
    let s = cluster_server(
        &model,
        &cluster,
        &["--parallel", "6", "--micro-batches", "2"],
    );
    let health = http(&s.addr, "GET", "/health", b"").json();
    assert_eq!(health["status"], "ok", "{health}");
    assert_eq!(
        health["devices"].as_array().map(Vec::len),
        Some(2),
        "{health}"
    );

    let prompts: Vec<Vec<u32>> = vec![vec![3, 1, 4, 1, 5], vec![1, 5, 9, 23], vec![2, 7, 1, 8]];
    let want = generate_ids(&model, &prompts, 10);
    let got = greedy_ids(&s, &prompts[0], 10);
    assert_eq!(got["choices"][0]["token_ids"], want[0], "{}", s.log());
    let concurrent = concurrent_ids(&s, &prompts, 10);
    assert_eq!(concurrent, want);
    // Two micro-batches (one serving loop each) of three sequences at once over the one
    // pipeline: each request still gets its tokens alone (sequence ids never collide).
    let six: Vec<Vec<u32>> = prompts.iter().chain(&prompts).cloned().collect();
    let want_six: Vec<Value> = want.iter().chain(&want).cloned().collect();
    assert_eq!(concurrent_ids(&s, &six, 10), want_six, "{}", s.log());

    // `/metrics` breaks the steps down per device: compute, network, load stall, queueing,
    // and KV bytes held against the room each budget leaves.
    let m = http(&s.addr, "GET", "/metrics", b"");
    assert_eq!(m.status, 200);
    let text = String::from_utf8_lossy(&m.body);
    for w in ["w1", "w2"] {
        for series in [
            "loip_device_compute_seconds",
            "loip_device_network_seconds",
            "loip_device_load_stall_seconds",
            "loip_device_queued_seconds",
            "loip_device_hops_total",
            "loip_kv_device_used_bytes",
            "loip_kv_device_budget_bytes",
        ] {
            let line = format!("{series}{{device=\"{w}\"}} ");
            assert!(text.contains(&line), "no {line} in\n{text}");
        }
        let hops = format!("loip_device_hops_total{{device=\"{w}\"}} ");
        let n: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&hops))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0);
        assert!(n > 0.0, "{w} ran no hop:\n{text}");
    }
    assert!(!text.contains("device=\"cluster\""), "{text}");

    // A device that dies: the request in flight fails with 503 naming it; the server
    // re-plans over the remaining device (the tiny model fits on one), /health is ok again
    // with one device, and the next requests give the same tokens as before.
    drop(workers.pop());
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": [3, 1, 4], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert!(r.error().contains("w2"), "{}", r.error());
    let health = http(&s.addr, "GET", "/health", b"");
    assert_eq!(health.status, 200, "{}\n{}", health.json(), s.log());
    assert_eq!(
        health.json()["devices"].as_array().map(Vec::len),
        Some(1),
        "{}",
        health.json()
    );
    let again = greedy_ids(&s, &prompts[1], 10);
    assert_eq!(again["choices"][0]["token_ids"], want[1], "{}", s.log());
    drop(s);
    drop(workers);
    let _ = std::fs::remove_dir_all(&dir);
}
