//! `loip api --cluster` as a person meets a cluster whose workers come and go: a worker
//! started after the coordinator is waited for (`--connect-retry`, each try logged); a
//! worker killed is left out (re-plan, 503 for the request in flight); the same worker
//! restarted is taken back (re-plan, logged, `/health` lists it again), the next request is
//! served (no 503), and the tokens stay
//! those of `loip generate` alone. Helpers in `common/api.rs`.

mod common;
use common::api::*;
use common::*;

use std::time::{Duration, Instant};

use serde_json::json;

/// A loopback address nobody listens on now.
fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// `/health`'s device count, polled until `want` (at most `within`).
fn wait_devices(s: &Server, want: usize, within: Duration) -> usize {
    let t = Instant::now();
    loop {
        let h = http(&s.addr, "GET", "/health", b"");
        let n = if h.status == 200 {
            h.json()["devices"].as_array().map_or(0, Vec::len)
        } else {
            0
        };
        if n == want || t.elapsed() > within {
            return n;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_late_worker_is_waited_for_and_a_restarted_one_rejoins() {
    let model = fixture("tiny-qwen3");
    let dir = std::env::temp_dir().join(format!("loip-rejoin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (a1, a2) = (free_addr(), free_addr());
    let (w1, _) = worker(&dir, "w1", &a1);
    let cluster = dir.join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[[device]]\nname = \"w1\"\naddr = \"{a1}\"\n\n[[device]]\nname = \"w2\"\naddr = \"{a2}\"\n"
        ),
    )
    .unwrap();
    let want = generate_ids(&model, &[vec![3, 1, 4, 1, 5]], 8);
    // w2 comes up a second after the coordinator: it is tried again until it answers
    let late = {
        let (dir, a2) = (dir.clone(), a2.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            worker(&dir, "w2", &a2).0
        })
    };
    let s = cluster_server(
        &model,
        &cluster,
        &["--parallel", "2", "--connect-retry", "20s"],
    );
    let w2 = late.join().unwrap();
    assert!(s.log().contains("trying again"), "{}", s.log());
    assert_eq!(wait_devices(&s, 2, Duration::ZERO), 2, "{}", s.log());
    let got = greedy_ids(&s, &[3, 1, 4, 1, 5], 8);
    assert_eq!(got["choices"][0]["token_ids"], want[0], "{}", s.log());

    // w2 dies: the request in flight fails (503), the rest runs on w1
    drop(w2);
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": [3, 1, 4], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(
        wait_devices(&s, 1, Duration::from_secs(10)),
        1,
        "{}",
        s.log()
    );

    // w2 restarted on its address: taken back, said so, /health lists both again
    let _w2 = worker(&dir, "w2", &a2);
    assert_eq!(
        wait_devices(&s, 2, Duration::from_secs(20)),
        2,
        "{}",
        s.log()
    );
    assert!(s.log().contains("w2 answers again"), "{}", s.log());
    // the serving loops take the new pipeline before their next step (its generation
    // changed): the request right after the rejoin is served
    let got = s.post(
        "/v1/completions",
        &json!({"prompt": [3, 1, 4, 1, 5], "max_tokens": 8, "temperature": 0,
                "ignore_eos": true, "return_token_ids": true}),
    );
    assert_eq!(got.status, 200, "{}", s.log());
    assert_eq!(
        got.json()["choices"][0]["token_ids"],
        want[0],
        "{}",
        s.log()
    );
    drop(s);
    drop(w1);
    let _ = std::fs::remove_dir_all(&dir);
}
