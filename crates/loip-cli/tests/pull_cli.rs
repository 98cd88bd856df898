//! `loip pull` against an HTTP server the test starts on loopback, into a cache of its own
//! (`LOIP_CACHE`): a full download found by `loip list` and `loip generate -m NAME` (the
//! same tokens as the model it is a copy of), a sha256 mismatch refused with nothing
//! installed, a download cut once and resumed with a `Range` request, a 404 said plainly,
//! and an HF file set (a directory URL).

mod common;
use common::*;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// What the server was asked: (path, Range header).
type Log = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// A loopback HTTP/1.1 server of fixed files; a path in `cut` is cut after half its body
/// on its first request. Serves until the test process ends (a bounded number of requests).
struct Files {
    addr: String,
    log: Log,
}

impl Files {
    fn start(files: HashMap<String, Vec<u8>>, cut: &[&str]) -> Files {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let log: Log = Arc::default();
        let cut: Arc<Mutex<Vec<String>>> =
            Arc::new(Mutex::new(cut.iter().map(|s| s.to_string()).collect()));
        let (files, log2) = (Arc::new(files), log.clone());
        std::thread::spawn(move || {
            for conn in l.incoming().take(200) {
                let Ok(conn) = conn else { continue };
                let (files, log, cut) = (files.clone(), log2.clone(), cut.clone());
                std::thread::spawn(move || serve(conn, &files, &log, &cut));
            }
        });
        Files { addr, log }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}/{path}", self.addr)
    }
}

fn serve(mut c: TcpStream, files: &HashMap<String, Vec<u8>>, log: &Log, cut: &Mutex<Vec<String>>) {
    c.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .ok();
    let mut r = BufReader::new(c.try_clone().unwrap());
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let path = line
        .split_whitespace()
        .nth(1)
        .unwrap_or("/")
        .trim_start_matches('/')
        .to_string();
    let mut range = None;
    for _ in 0..100 {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("range") {
                range = Some(v.trim().to_string());
            }
        }
    }
    log.lock().unwrap().push((path.clone(), range.clone()));
    let Some(body) = files.get(&path) else {
        let _ = c
            .write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    };
    let from: usize = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.strip_suffix('-'))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let head = if from > 0 {
        format!(
            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {from}-{}/{}\r\nConnection: close\r\n\r\n",
            body.len() - from,
            body.len() - 1,
            body.len()
        )
    } else {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
    };
    let _ = c.write_all(head.as_bytes());
    let cut_now = {
        let mut cut = cut.lock().unwrap();
        let i = cut.iter().position(|p| *p == path);
        i.map(|i| cut.remove(i)).is_some()
    };
    let end = if cut_now { body.len() / 2 } else { body.len() };
    let _ = c.write_all(&body[from..end.max(from)]);
    let _ = c.flush();
    // a cut body: close with bytes still owed
}

/// A fresh cache directory of this test.
fn cache(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("loip-pull-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn pull(cache: &Path, args: &[&str]) -> std::process::Output {
    loip()
        .arg("pull")
        .args(args)
        .env("LOIP_CACHE", cache)
        .output()
        .unwrap()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Bytes that are no model, `n` long, different at every offset modulo 251.
fn payload(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

/// The smollm2 GGUF (fetched by `loip fetch` into the default cache on first use).
fn smollm2() -> Vec<u8> {
    let out = loip().args(["fetch", "smollm2"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let path = text
        .lines()
        .rev()
        .find(|l| l.trim().ends_with(".gguf"))
        .unwrap_or_else(|| panic!("no path in {text}"))
        .trim()
        .to_string();
    let mut v = Vec::new();
    std::fs::File::open(path)
        .unwrap()
        .read_to_end(&mut v)
        .unwrap();
    v
}

#[test]
fn a_pulled_gguf_is_listed_and_generates_the_same_tokens() {
    const SHA: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
    let gguf = smollm2();
    let srv = Files::start(HashMap::from([("m/small.gguf".to_string(), gguf)]), &[]);
    let c = cache("full");
    let out = pull(
        &c,
        &[&srv.url("m/small.gguf"), "--sha256", SHA, "--name", "small"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "small");
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(c.join("small/pulled.json")).unwrap())
            .unwrap();
    assert_eq!(record["files"][0]["sha256"], SHA);

    let list = loip()
        .args(["list", "--json"])
        .env("LOIP_CACHE", &c)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&list.stdout).contains("\"small\""));

    let gen = |model: &str, cache: Option<&Path>| {
        let mut cmd = loip();
        cmd.args([
            "generate",
            "-m",
            model,
            "--prompt",
            "The capital of France is",
        ])
        .args(["-n", "6", "--json"]);
        if let Some(c) = cache {
            cmd.env("LOIP_CACHE", c);
        }
        json_run(&mut cmd)["new_ids"].clone()
    };
    let pulled = gen("small", Some(&c));
    assert!(pulled.as_array().is_some_and(|t| !t.is_empty()), "{pulled}");
    assert_eq!(pulled, gen("smollm2", None));
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn a_sha256_mismatch_installs_nothing_and_a_404_is_said() {
    let srv = Files::start(
        HashMap::from([("x.gguf".to_string(), payload(300_000))]),
        &[],
    );
    let c = cache("sha");
    let wrong = "0".repeat(64);
    let out = pull(&c, &[&srv.url("x.gguf"), "--sha256", &wrong]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("sha256") && err.contains("nothing was installed"),
        "{err}"
    );
    assert!(!c.join("x/x.gguf").exists() && !c.join("x/x.gguf.part").exists());
    assert!(!c.join("x/pulled.json").exists());

    let out = pull(&c, &[&srv.url("missing.gguf")]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("404 Not Found"), "{err}");
    assert_eq!(err.matches("404").count(), 1, "said once: {err}");
    assert!(!c.join("missing").exists(), "no empty entry left");
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn a_cut_download_keeps_its_part_and_resumes_with_a_range() {
    let body = payload(2_000_000);
    let srv = Files::start(
        HashMap::from([("r.gguf".to_string(), body.clone())]),
        &["r.gguf"],
    );
    let c = cache("resume");
    let out = pull(&c, &[&srv.url("r.gguf")]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("run the same loip pull again to resume"),
        "{err}"
    );
    let part = std::fs::metadata(c.join("r/r.gguf.part")).unwrap().len();
    assert_eq!(part, 1_000_000);
    assert!(!c.join("r/r.gguf").exists());

    let out = pull(&c, &[&srv.url("r.gguf")]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::read(c.join("r/r.gguf")).unwrap(), body);
    assert!(!c.join("r/r.gguf.part").exists());
    let log = srv.log.lock().unwrap().clone();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(log[1].1.as_deref(), Some("bytes=1000000-"));
    let _ = std::fs::remove_dir_all(&c);
}

#[test]
fn a_directory_url_pulls_an_hf_file_set() {
    let files = HashMap::from([
        ("hf/tiny/config.json".to_string(), b"{}".to_vec()),
        ("hf/tiny/tokenizer.json".to_string(), b"{}".to_vec()),
        ("hf/tiny/model.safetensors".to_string(), payload(5000)),
    ]);
    let srv = Files::start(files, &[]);
    let c = cache("hf");
    let out = pull(&c, &[&srv.url("hf/tiny/")]);
    assert!(out.status.success(), "{}", stderr(&out));
    for f in [
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "pulled.json",
    ] {
        assert!(c.join("tiny").join(f).is_file(), "{f} missing");
    }
    let record = std::fs::read_to_string(c.join("tiny/pulled.json")).unwrap();
    assert!(
        !record.contains("tokenizer_config"),
        "a 404 optional file is skipped"
    );
    let _ = std::fs::remove_dir_all(&c);
}
