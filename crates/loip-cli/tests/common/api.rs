//! Helpers of the `loip api` tests: a server on loopback spoken to over plain HTTP/1.1, and
//! `loip generate` to compare with. Every wait is bounded; servers and workers are killed
//! when their guard drops (also on a failed assertion).

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::loip;

/// How long a server may take to come up, or a request to be answered.
pub const WAIT: Duration = Duration::from_secs(180);

/// A child process killed when dropped.
pub struct Guard(pub Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The cluster tests' shared token (tokens have at least 16 characters).
pub const TEST_TOKEN: &str = "cli-test-token-0123456789";

/// Reads `child`'s lines from `out` on a thread; returns the first line's rest after `prefix`
/// (within [`WAIT`]) and the whole log so far.
pub fn wait_for_line(
    out: impl Read + Send + 'static,
    prefix: &'static str,
) -> (String, Arc<Mutex<String>>) {
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = mpsc::channel();
    let keep = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.strip_prefix(prefix) {
                let _ = tx.send(rest.trim().to_string());
            }
            if let Ok(mut l) = keep.lock() {
                l.push_str(&line);
                l.push('\n');
            }
        }
    });
    let found = rx.recv_timeout(WAIT);
    let text = log.lock().map(|l| l.clone()).unwrap_or_default();
    let found =
        found.unwrap_or_else(|_| panic!("no line starting with {prefix:?}; output:\n{text}"));
    (found, log)
}

/// A running `loip api`.
pub struct Server {
    pub addr: String,
    pub log: Arc<Mutex<String>>,
    pub _child: Guard,
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut cmd = loip();
        cmd.args(["api", "--listen", "127.0.0.1:0"])
            .args(args)
            .envs(env.iter().copied());
        Server::spawn(&mut cmd)
    }

    /// Starts `cmd` (a `loip api` command line, e.g. inside a network namespace) and waits
    /// (within [`WAIT`]) for the address it prints.
    pub fn spawn(cmd: &mut Command) -> Server {
        let mut child = Guard(
            cmd.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let err = child.0.stderr.take().unwrap();
        let (addr, log) = wait_for_line(err, "listening on http://");
        Server {
            addr,
            log,
            _child: child,
        }
    }

    pub fn post(&self, path: &str, body: &Value) -> Reply {
        http(&self.addr, "POST", path, body.to_string().as_bytes())
    }

    /// [`Server::post`] with more header lines (`extra`, e.g. the API key's).
    pub fn post_with(&self, path: &str, extra: &str, body: &Value) -> Reply {
        http_with(&self.addr, "POST", path, extra, body.to_string().as_bytes())
    }

    pub fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
}

/// A response: status, lower-cased head, body (de-chunked).
pub struct Reply {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{e}: status {}, body {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The `data:` payloads of a server-sent event stream.
    pub fn events(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.body)
            .split("\n\n")
            .filter_map(|e| e.trim().strip_prefix("data: ").map(str::to_string))
            .collect()
    }

    pub fn error(&self) -> String {
        let v = self.json();
        assert!(v["error"]["type"].as_str().is_some(), "{v}");
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }
}

/// One HTTP/1.1 request on a new connection (`Connection: close`); the body is written from
/// another thread so that a server refusing a large body early cannot block us.
pub fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> Reply {
    http_with(addr, method, path, "", body)
}

/// [`http`] with more header lines (`extra`: each ending in `\r\n`).
pub fn http_with(addr: &str, method: &str, path: &str, extra: &str, body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.set_write_timeout(Some(WAIT)).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         {extra}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let mut w = s.try_clone().unwrap();
    let body = body.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&body);
    });
    let start = Instant::now();
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    while start.elapsed() < WAIT {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    let _ = writer.join();
    let text_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {:?}", String::from_utf8_lossy(&raw)));
    let head = String::from_utf8_lossy(&raw[..text_end]).to_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head}"));
    let mut body = raw[text_end + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Reply { status, head, body }
}

pub fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap();
        if size == 0 {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 2 + size + 2..];
    }
    out
}

/// `loip generate --json` on one device.
pub fn generate(args: &[&str]) -> Value {
    let out = loip()
        .arg("generate")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "generate {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{')).unwrap();
    serde_json::from_str(line).unwrap()
}

/// Greedy `/v1/completions` for token ids, ignoring EOS, with the ids returned.
pub fn greedy_ids(s: &Server, ids: &[u32], n: usize) -> Value {
    let r = s.post(
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": true,
                "return_token_ids": true}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// The new ids `loip generate` gives for each prompt (`n` tokens, EOS ignored).
pub fn generate_ids(model: &str, prompts: &[Vec<u32>], n: usize) -> Vec<Value> {
    prompts
        .iter()
        .map(|p| {
            let ids: Vec<String> = p.iter().map(u32::to_string).collect();
            let n = n.to_string();
            generate(&[
                "--model",
                model,
                "--prompt-ids",
                &ids.join(","),
                "-n",
                &n,
                "--ignore-eos",
            ])["new_ids"]
                .clone()
        })
        .collect()
}

/// The new ids of greedy completions of all `prompts`, requested at the same time.
pub fn concurrent_ids(s: &Server, prompts: &[Vec<u32>], n: usize) -> Vec<Value> {
    std::thread::scope(|sc| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| sc.spawn(move || greedy_ids(s, p, n)["choices"][0]["token_ids"].clone()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The text of a streamed response and the finish reason of its last chunk.
pub fn streamed(r: &Reply, chat: bool) -> (String, String) {
    assert_eq!(r.status, 200);
    assert!(r.head.contains("text/event-stream"), "{}", r.head);
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let mut text = String::new();
    let mut finish = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        let piece = if chat {
            &c["delta"]["content"]
        } else {
            &c["text"]
        };
        text.push_str(piece.as_str().unwrap_or_default());
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish)
}

/// Reads `c` until the server closes it (what it sent before, e.g. a 408, is ignored);
/// whether that happened before `deadline`.
pub fn closed_by(c: &mut TcpStream, deadline: Instant) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        c.set_read_timeout(Some(left)).unwrap();
        match c.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// Sends a request head (and `body`) on a new connection and leaves it open.
pub fn send_raw(addr: &str, head: &str, body: &[u8]) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(body).unwrap();
    c
}

/// `loip generate` alone for one prompt with sampling arguments: its new ids.
pub fn generate_one(model: &str, ids: &[u32], n: usize, extra: &[&str]) -> Value {
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let n = n.to_string();
    let mut args = vec![
        "--model",
        model,
        "--prompt-ids",
        &ids,
        "-n",
        &n,
        "--ignore-eos",
    ];
    args.extend_from_slice(extra);
    generate(&args)["new_ids"].clone()
}

/// `loip worker NAME` on `addr` (port 0: a free one) with its store under `dir/NAME`, the
/// cluster tests' token and 256 MiB; and the address it listens on.
pub fn worker(dir: &Path, name: &str, addr: &str) -> (Guard, String) {
    let mut w = Guard(
        loip()
            .args(["worker", "--listen", addr, "--mem", "256MiB", "--token"])
            .arg(TEST_TOKEN)
            .arg("--name")
            .arg(name)
            .arg("--store")
            .arg(dir.join(name))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = w.0.stdout.take().unwrap();
    let (addr, _) = wait_for_line(out, "listening on ");
    (w, addr)
}

/// `n` workers `w1`… on loopback, in a fresh directory `loip-TAG-PID` under the temp
/// directory, and a cluster file listing them: (the directory, the workers, the file).
pub fn workers_and_cluster(
    tag: &str,
    n: usize,
) -> (std::path::PathBuf, Vec<Guard>, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("loip-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut workers = Vec::new();
    let mut toml = String::new();
    for i in 1..=n {
        let (w, addr) = worker(&dir, &format!("w{i}"), "127.0.0.1:0");
        toml.push_str(&format!(
            "[[device]]\nname = \"w{i}\"\naddr = \"{addr}\"\n\n"
        ));
        workers.push(w);
    }
    let cluster = dir.join("cluster.toml");
    std::fs::write(&cluster, toml).unwrap();
    (dir, workers, cluster)
}

/// `loip api` on the cluster file `cluster` with the test token and the uniform planner,
/// plus `extra` flags.
pub fn cluster_server(model: &str, cluster: &Path, extra: &[&str]) -> Server {
    let cluster = cluster.to_string_lossy();
    let mut args = vec![
        "--model",
        model,
        "--cluster",
        &cluster,
        "--token",
        TEST_TOKEN,
        "--planner",
        "loip-uniform",
    ];
    args.extend_from_slice(extra);
    Server::start(&args)
}

/// `series{device="…"}`'s value in Prometheus text.
pub fn metric(text: &str, series: &str, device: &str) -> f64 {
    let p = format!("{series}{{device=\"{device}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&p))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {p} in\n{text}"))
}

/// Checks that a `/dashboard.json` device entry's step sums (compute, network, load stall,
/// queueing, hops) equal the `loip_device_*` series of `/metrics` (`metrics`) for that device.
pub fn steps_match_metrics(dev: &Value, metrics: &str) {
    let name = dev["name"].as_str().expect("device name");
    let steps = &dev["steps"];
    for (field, series) in [
        ("compute_s", "loip_device_compute_seconds"),
        ("network_s", "loip_device_network_seconds"),
        ("stall_s", "loip_device_load_stall_seconds"),
        ("queued_s", "loip_device_queued_seconds"),
        ("hops", "loip_device_hops_total"),
    ] {
        let a = steps[field].as_f64().unwrap_or(-1.0);
        let b = metric(metrics, series, name);
        assert!(
            (a - b).abs() <= 1e-9 * b.abs().max(1.0),
            "{name} {field}: {a} vs {b}"
        );
    }
}

/// Debian's `chromium` (or `chromium-browser`) if it is on the PATH.
pub fn chromium() -> Option<&'static str> {
    ["chromium", "chromium-browser"].into_iter().find(|c| {
        std::process::Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// The DOM of `url` as headless Chromium renders it after 3 s of virtual time (its scripts
/// and their polls run), its profile under `profile`; within [`WAIT`] (killed after).
/// `None`, with the reason printed, where Chromium is not installed.
pub fn rendered_dom(url: &str, profile: &Path) -> Option<String> {
    let Some(chromium) = chromium() else {
        eprintln!("skipping the rendered dashboard: no chromium on the PATH");
        return None;
    };
    let mut child = Guard(
        Command::new(chromium)
            .args(["--headless", "--no-sandbox", "--disable-gpu"])
            .args(["--virtual-time-budget=3000", "--dump-dom"])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(url)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut out = child.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        let _ = tx.send(s);
    });
    let dom = rx
        .recv_timeout(WAIT)
        .unwrap_or_else(|_| panic!("chromium rendered nothing within {WAIT:?}"));
    Some(dom)
}
