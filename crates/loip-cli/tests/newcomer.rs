//! What a newcomer tripped on, each fixed and kept fixed: `loip split` without `--out`
//! (the docs' form) splits into the slice cache and prints where; `loip bench serve` fails
//! when every request failed; help texts name every known model.

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
