//! What a newcomer tripped on, each fixed and kept fixed: `loip split` without `--out`
//! (the docs' form) splits into the slice cache and prints where; `loip bench serve` fails
//! when every request failed; help texts name every known model; `loip bench model` (the
//! llama.cpp comparison's measurement) prints its figures and refuses ids outside the vocabulary.

mod common;
use common::*;

#[test]
fn split_without_out_uses_the_slice_cache_and_prints_it() {
    let cache = std::env::temp_dir().join(format!("loip-newcomer-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let out = loip()
        .args(["split", &fixture("tiny-llama")])
        .env("LOIP_CACHE", &cache)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = std::path::PathBuf::from(text.trim());
    assert!(dir.starts_with(cache.join("slices")), "{text}");
    assert!(dir.join("manifest.json").is_file(), "{text}");
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn bench_serve_fails_when_every_request_failed() {
    // a port nothing listens on
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = loip()
        .args([
            "bench",
            "serve",
            "--url",
            &format!("http://127.0.0.1:{port}"),
        ])
        .args(["--requests", "2", "--concurrency", "1", "--timeout", "5"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "exit 0 with every request failed: {err}"
    );
    assert!(err.contains("every one of the 2 requests failed"), "{err}");
}

#[test]
fn help_names_every_known_model() {
    for cmd in [
        ["fetch", "--help"],
        ["generate", "--help"],
        ["split", "--help"],
    ] {
        let out = loip().args(cmd).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("gemma3-270m"), "{cmd:?}: {text}");
    }
}

#[test]
fn an_os_error_is_said_once() {
    let out = loip()
        .args([
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--mem",
            "100MiB",
            "--store",
        ])
        .arg("/proc/loip-no-such-store")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("{err}"));
    assert_eq!(line.matches("os error").count(), 1, "{line}");
}

#[test]
fn bench_model_prints_prefill_and_decode_and_refuses_ids_outside_the_vocabulary() {
    let v = json_run(loip().args([
        "bench",
        "model",
        "--model",
        &fixture("tiny-llama"),
        "--threads",
        "1",
        "--prompt-ids",
        "1,2,3,4,5,6,7,8",
        "--tokens",
        "3",
        "--rounds",
        "2",
    ]));
    assert_eq!(v["prompt_tokens"], 8, "{v}");
    assert_eq!(v["rounds"], 2, "{v}");
    for k in ["prompt_ms_per_token", "decode_ms_per_token"] {
        let ms = v[k].as_f64().unwrap_or(-1.0);
        assert!(ms.is_finite() && ms > 0.0, "{k}: {v}");
    }
    let out = loip()
        .args(["bench", "model", "--model", &fixture("tiny-llama")])
        .args(["--prompt-ids", "1,4000000000", "--rounds", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "accepted an id outside the vocabulary"
    );
    assert!(err.contains("outside the model's vocabulary"), "{err}");
}
