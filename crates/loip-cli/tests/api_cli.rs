//! `loip api` end to end through the binary, serving: greedy completions equal `loip
//! generate` on the same model (in memory and from slice files), streamed text equals the
//! whole response, concurrent, staggered, sampled and cancelled requests equal each alone,
//! and `loip bench serve` runs a bounded load. Helpers in `common/api.rs`.

mod common;
use common::api::*;
use common::*;

use std::io::Read;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[test]
fn greedy_completions_equal_generate_streamed_and_concurrent() {
    let model = fixture("tiny-llama");
    // Two at once: of three concurrent requests below, one waits in the queue.
    let s = Server::start(&["--model", &model, "--parallel", "2"]);
    let want = generate(&[
        "--model",
        &model,
        "--prompt-ids",
        "1,5,9,23",
        "-n",
        "8",
        "--ignore-eos",
    ]);
    let got = greedy_ids(&s, &[1, 5, 9, 23], 8);
    let c = &got["choices"][0];
    assert_eq!(c["token_ids"], want["new_ids"], "{got}");
    assert_eq!(c["text"], want["text"]);
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(got["object"], "text_completion");
    assert_eq!(
        got["usage"],
        json!({"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12})
    );
    assert_eq!(got["prompt_token_ids"], json!([1, 5, 9, 23]));

    // Without ignore_eos both stop at the same end-of-sequence token (or run to the limit).
    let want = generate(&["--model", &model, "--prompt-ids", "3,1,4", "-n", "40"]);
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": [3, 1, 4], "max_tokens": 40, "temperature": 0}),
    );
    let c = &r.json()["choices"][0];
    assert_eq!(c["text"], want["text"]);
    let reason = if want["stop"] == "length" {
        "length"
    } else {
        "stop"
    };
    assert_eq!(c["finish_reason"], reason);

    // Streaming gives the same text.
    let want = generate(&[
        "--model",
        &model,
        "--prompt-ids",
        "1,5,9,23",
        "-n",
        "8",
        "--ignore-eos",
    ]);
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": [1, 5, 9, 23], "max_tokens": 8, "temperature": 0,
                "ignore_eos": true, "stream": true}),
    );
    assert_eq!(
        streamed(&r, false),
        (want["text"].as_str().unwrap().to_string(), "length".into())
    );

    // Three requests at once give what they give one after another.
    let prompts: Vec<Vec<u32>> = vec![
        vec![1, 5, 9, 23],
        vec![3, 1, 4, 1, 5],
        vec![2, 7, 1, 8, 2, 8],
    ];
    let sequential: Vec<Value> = prompts
        .iter()
        .map(|p| greedy_ids(&s, p, 24)["choices"][0]["token_ids"].clone())
        .collect();
    let concurrent = concurrent_ids(&s, &prompts, 24);
    assert_eq!(concurrent, sequential);
    assert!(sequential
        .iter()
        .all(|ids| ids.as_array().map(Vec::len) == Some(24)));
}

#[test]
fn offloaded_serving_interleaves_requests_and_stays_lossless() {
    // Every block streamed from slice files through the one-slot loader; three requests at
    // once share the device step by step: the in-memory engine's tokens, each of them.
    let model = fixture("tiny-llama");
    let s = Server::start(&[
        "--model",
        &model,
        "--offload-blocks",
        "all",
        "--parallel",
        "3",
    ]);
    let prompts: Vec<Vec<u32>> = vec![
        vec![1, 5, 9, 23],
        vec![3, 1, 4, 1, 5],
        vec![2, 7, 1, 8, 2, 8],
    ];
    let want = generate_ids(&model, &prompts, 12);
    let concurrent = concurrent_ids(&s, &prompts, 12);
    assert_eq!(concurrent, want, "{}", s.log());
    // finished sequences leave the device's cache: the same again still fits and agrees
    assert_eq!(
        greedy_ids(&s, &prompts[0], 12)["choices"][0]["token_ids"],
        want[0]
    );
}

#[test]
fn chat_and_text_completions_equal_generate_on_smollm2() {
    let s = Server::start(&["--model", "smollm2"]);
    let question = "What is the capital of France?";
    let want = generate(&[
        "--model", "smollm2", "--chat", "--prompt", question, "-n", "16",
    ]);
    let body = json!({"model": "smollm2", "messages": [{"role": "user", "content": question}],
                      "max_tokens": 16, "temperature": 0});
    let got = s.post("/v1/chat/completions", &body).json();
    assert_eq!(got["object"], "chat.completion");
    assert_eq!(got["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        got["choices"][0]["message"]["content"], want["text"],
        "{got}"
    );
    assert_eq!(
        got["usage"]["prompt_tokens"],
        json!(want["prompt_ids"].as_array().map(Vec::len))
    );
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let (text, _) = streamed(&s.post("/v1/chat/completions", &stream), true);
    assert_eq!(text, want["text"].as_str().unwrap());

    let prompt = "Once upon a time, there was a little";
    let want = generate(&["--model", "smollm2", "--prompt", prompt, "-n", "20"]);
    let body = json!({"prompt": prompt, "max_tokens": 20, "temperature": 0});
    let got = s.post("/v1/completions", &body).json();
    let full = want["text"].as_str().unwrap();
    assert_eq!(got["choices"][0]["text"], full);
    // A stop string cuts the text before it, streamed or not.
    let word = full.split_whitespace().nth(2).unwrap();
    let cut = &full[..full.find(word).unwrap()];
    let mut stop = body.clone();
    stop["stop"] = json!([word, "never appears"]);
    let got = s.post("/v1/completions", &stop).json();
    assert_eq!(got["choices"][0]["text"], cut);
    assert_eq!(got["choices"][0]["finish_reason"], "stop");
    stop["stream"] = json!(true);
    assert_eq!(
        streamed(&s.post("/v1/completions", &stop), false),
        (cut.to_string(), "stop".to_string())
    );
    // Sampling with a seed is repeatable.
    let sample = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0.8, "top_p": 0.9,
                        "top_k": 40, "seed": 7});
    let a = s.post("/v1/completions", &sample).json();
    let b = s.post("/v1/completions", &sample).json();
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
}

#[test]
fn batched_requests_staggered_sampled_and_cancelled_equal_generate_alone() {
    // Continuous batching on one device (in memory, then every block from slice files):
    // requests of different lengths arrive staggered, two sample with their own seeds, one
    // client leaves mid-way; each finished request has the tokens of `loip generate` alone.
    let model = fixture("tiny-llama");
    // (prompt, new tokens, temperature, seed)
    let reqs: Vec<(Vec<u32>, usize, f64, u64)> = vec![
        (vec![1, 5, 9, 23], 14, 0.0, 0),
        (vec![3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 6, 0.8, 7),
        (vec![2, 7], 20, 0.0, 0),
        (vec![8, 8, 4, 1, 9], 9, 1.0, 42),
    ];
    let want: Vec<Value> = reqs
        .iter()
        .map(|(p, n, t, seed)| {
            let (t, seed) = (t.to_string(), seed.to_string());
            generate_one(&model, p, *n, &["--temperature", &t, "--seed", &seed])
        })
        .collect();
    for extra in [&[][..], &["--offload-blocks", "all"][..]] {
        let mut args = vec!["--model", model.as_str(), "--parallel", "4"];
        args.extend_from_slice(extra);
        let s = Server::start(&args);
        let got: Vec<Value> = std::thread::scope(|sc| {
            // a client that leaves: its sequence is cancelled, the others go on
            let leaver = sc.spawn(|| {
                let body = json!({"prompt": [4, 4, 4], "ignore_eos": true,
                                  "temperature": 0, "stream": true})
                .to_string();
                let head = format!(
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\n\r\n",
                    body.len()
                );
                let mut c = send_raw(&s.addr, &head, body.as_bytes());
                let mut first = [0u8; 12];
                c.read_exact(&mut first).unwrap();
                assert_eq!(&first, b"HTTP/1.1 200");
                drop(c);
            });
            let handles: Vec<_> = reqs
                .iter()
                .enumerate()
                .map(|(i, (p, n, t, seed))| {
                    let s = &s;
                    sc.spawn(move || {
                        std::thread::sleep(Duration::from_millis(40 * i as u64));
                        let r = s.post(
                            "/v1/completions",
                            &json!({"prompt": p, "max_tokens": n, "temperature": t,
                                    "seed": seed, "ignore_eos": true, "return_token_ids": true}),
                        );
                        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                        r.json()["choices"][0]["token_ids"].clone()
                    })
                })
                .collect();
            leaver.join().unwrap();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, want, "{extra:?}: {}", s.log());
        // the leaver's KV is freed: the scheduler ends with nothing running
        let deadline = Instant::now() + WAIT;
        loop {
            let h = http(&s.addr, "GET", "/health", b"").json();
            let left = s.log().contains("the client went away");
            if left && h["scheduler"]["running"] == 0 && h["scheduler"]["kv_used_bytes"] == 0 {
                break;
            }
            assert!(Instant::now() < deadline, "{h}\n{}", s.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn bench_serve_runs_a_bounded_load() {
    let model = fixture("tiny-llama");
    let s = Server::start(&["--model", &model, "--parallel", "2"]);
    let json_path =
        std::env::temp_dir().join(format!("loip-bench-serve-{}.json", std::process::id()));
    let out = loip()
        .args(["bench", "serve", "--url"])
        .arg(format!("http://{}", s.addr))
        .args([
            "--requests",
            "5",
            "--arrival",
            "poisson",
            "--rate",
            "50",
            "--prompt-len",
            "4",
            "--output-len",
            "6",
            "--token-prompt",
            "--vocab",
            "32",
            "--timeout",
            "60",
        ])
        .arg("--json")
        .arg(&json_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json_path);
    assert_eq!(v["ok"], 5, "{v}\n{}", s.log());
    assert_eq!(v["output_tokens"], 30, "{v}");
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["ttft"]["p50_ms"].is_number(), "{v}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("tokens/s"));
    // the load shows in /metrics, Prometheus text
    let m = http(&s.addr, "GET", "/metrics", b"");
    assert_eq!(m.status, 200);
    let text = String::from_utf8_lossy(&m.body).to_string();
    for series in [
        "loip_requests_total 5",
        "loip_prompt_tokens_total 20",
        "loip_completion_tokens_total 30",
        "loip_queue_depth",
        "loip_running_sequences",
        "loip_batch_size",
        "loip_step_seconds",
        "loip_time_to_first_token_seconds",
        "loip_inter_token_seconds",
        "loip_kv_used_bytes",
        "loip_kv_reserved_bytes",
    ] {
        assert!(text.contains(series), "{series} missing:\n{text}");
    }
}
