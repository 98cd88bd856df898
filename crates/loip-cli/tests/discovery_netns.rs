//! One command per device, as a person sets a cluster up on a LAN: three network namespaces
//! the test makes on a bridge with multicast (two workers, one coordinator). Each worker is
//! `loip worker --name wN` (no token, no address list) and prints a pairing code; on the
//! coordinator `loip devices` lists both as not paired, a wrong code is refused, `loip pair
//! CODE --device wN` pairs each, and `loip serve --discover` finds them, uses only the paired
//! ones and generates the tokens of `loip generate` on one device (and so does
//! `loip generate --discover`). Then `loip api --discover` in the coordinator's namespace,
//! reached over the bridge, answers a greedy completion with the same tokens, and its
//! dashboard (`/dashboard.json`, and the page rendered by headless Chromium where installed)
//! shows each paired worker's resident/streamed blocks and compute / load-stall figures equal
//! to `/metrics`: issue 35's "How we will know" in one test. The workers pin the coordinator
//! that paired them, so another coordinator holding the same token is refused.
//!
//! Needs root and `ip` (iproute2): skipped with a printed reason otherwise.

mod common;
use common::api::{
    generate_ids, http, http_with, metric, rendered_dom, steps_match_metrics, Guard, Server,
};
use common::*;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Namespaces and their bridge, deleted when dropped.
struct Net {
    names: Vec<String>,
}

impl Drop for Net {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// A bridge namespace and one namespace per entry of `hosts` on it (`SUBNET.i/24`, the
/// subnet `10.77.X` of [`subnet`]); this (the root) namespace is on the bridge too, as
/// `SUBNET.254`, so that the test reaches the namespaces' servers. Everything goes with the
/// bridge namespace (deleting it deletes the veth pairs).
fn make_net(hosts: &[&str]) -> Result<(Net, Vec<String>), String> {
    let pid = std::process::id() % 100_000;
    let sub = subnet();
    let br = format!("lxbr{pid}");
    let mut net = Net {
        names: vec![br.clone()],
    };
    ip(&["netns", "add", &br])?;
    ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
    // multicast reaches every port: no snooping
    let _ = ip(&[
        "-n",
        &br,
        "link",
        "set",
        "br0",
        "type",
        "bridge",
        "mcast_snooping",
        "0",
    ]);
    ip(&["-n", &br, "link", "set", "br0", "up"])?;
    let mut spaces = Vec::new();
    for (i, h) in hosts.iter().enumerate() {
        let ns = format!("lx{h}{pid}");
        ip(&["netns", "add", &ns])?;
        net.names.push(ns.clone());
        let (a, b) = (format!("ux{pid}{i}a"), format!("ux{pid}{i}b"));
        ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
        ip(&["link", "set", &a, "netns", &ns])?;
        ip(&["link", "set", &b, "netns", &br])?;
        ip(&["-n", &ns, "link", "set", &a, "name", "eth0"])?;
        let addr = format!("{sub}.{}/24", i + 1);
        ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&["-n", &br, "link", "set", &b, "master", "br0"])?;
        ip(&["-n", &br, "link", "set", &b, "up"])?;
        spaces.push(ns);
    }
    let (a, b) = (format!("ux{pid}ha"), format!("ux{pid}hb"));
    ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
    ip(&["link", "set", &b, "netns", &br])?;
    ip(&["addr", "add", &format!("{sub}.254/24"), "dev", &a])?;
    ip(&["link", "set", &a, "up"])?;
    ip(&["-n", &br, "link", "set", &b, "master", "br0"])?;
    ip(&["-n", &br, "link", "set", &b, "up"])?;
    Ok((net, spaces))
}

/// This run's subnet `10.77.X` (X from the process id, so that runs side by side do not
/// share the root namespace's route).
fn subnet() -> String {
    format!("10.77.{}", std::process::id() % 250)
}

/// Why this test cannot run here, if it cannot.
fn unavailable() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(2))
        == Some("0");
    if !root {
        return Some("not root (network namespaces need it)".into());
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("no `ip` command (iproute2)".into()),
    }
}

/// `loip ARGS` inside namespace `ns`, with the coordinator's directory `config`.
fn in_ns(ns: &str, config: &Path) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns])
        .arg(env!("CARGO_BIN_EXE_loip"))
        .env("LOIP_CONFIG_DIR", config);
    c
}

/// A worker in `ns`, named `name`, its store under `dir`: (the process, its pairing code).
fn worker(ns: &str, dir: &Path, name: &str) -> (Guard, String) {
    let mut w = Guard(
        in_ns(ns, &dir.join("unused"))
            .args(["worker", "--listen", "0.0.0.0:7001", "--mem", "256MiB"])
            .args(["--name", name, "--store"])
            .arg(dir.join(name))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = w.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(c) = line.strip_prefix("pairing code ") {
                let _ = tx.send(c.trim().to_string());
            }
        }
    });
    let code = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("worker {name} printed no pairing code"));
    (w, code)
}

fn run_ok(c: &mut Command) -> String {
    let out = c.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{c:?}: {text}");
    text
}

#[test]
fn workers_found_on_the_lan_are_paired_by_code_and_serve_losslessly() {
    if let Some(why) = unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let (_net, ns) = match make_net(&["c", "a", "b"]) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("skipped: could not make the namespaces: {e}");
            return;
        }
    };
    let dir: PathBuf = std::env::temp_dir().join(format!("loip-netns-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("coordinator");
    let model = fixture("tiny-qwen3");
    let want = generate_ids(&model, &[vec![3, 1, 4, 1, 5]], 8);

    let (_w1, code1) = worker(&ns[1], &dir, "w1");
    let (_w2, code2) = worker(&ns[2], &dir, "w2");

    // both answer, neither is paired: listed as such
    let listed = run_ok(in_ns(&ns[0], &config).args(["devices", "--wait", "3s"]));
    for w in ["w1", "w2"] {
        let line = listed.lines().find(|l| l.starts_with(w));
        let line = line.unwrap_or_else(|| panic!("{w} not listed: {listed}"));
        assert!(line.contains("not paired"), "{listed}");
    }
    // with nothing paired, --discover refuses and says how to pair
    let out = in_ns(&ns[0], &config)
        .args(["serve", "--discover", "--model", &model])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("loip pair"), "{err}");

    // a wrong code is refused; the right ones pair
    let wrong = if code1.starts_with('A') {
        "BBBB-BBBB"
    } else {
        "AAAA-AAAA"
    };
    let out = in_ns(&ns[0], &config)
        .args(["pair", wrong, "--device", "w1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not the one"),
        "{err}"
    );
    for (w, code) in [("w1", &code1), ("w2", &code2)] {
        let said = run_ok(in_ns(&ns[0], &config).args(["pair", code, "--device", w]));
        assert!(said.contains(&format!("paired {w}")), "{said}");
    }
    let token = config.join("token");
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&token).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    // an mDNS answer may come before its address records (then it is skipped as having no
    // usable address): list again, a bounded number of times
    let both_paired = |listed: &str| {
        ["w1", "w2"].iter().all(|w| {
            listed
                .lines()
                .find(|l| l.starts_with(w))
                .is_some_and(|l| l.trim_end().ends_with(" paired"))
        })
    };
    let mut listed = String::new();
    for _ in 0..4 {
        listed = run_ok(in_ns(&ns[0], &config).args(["devices", "--wait", "3s"]));
        if both_paired(&listed) {
            break;
        }
    }
    assert!(both_paired(&listed), "{listed}");

    // the coordinator finds and uses them: the tokens of one device
    let mut serve = Guard(
        in_ns(&ns[0], &config)
            .args([
                "serve",
                "--discover",
                "--model",
                &model,
                "--planner",
                "loip-uniform",
            ])
            .args([
                "--json",
                "-n",
                "8",
                "--ignore-eos",
                "--connect-retry",
                "20s",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stdin = serve.0.stdin.take().unwrap();
    writeln!(stdin, "[3, 1, 4, 1, 5]").unwrap();
    drop(stdin);
    let (tx, rx) = mpsc::channel();
    let out = serve.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(out), &mut s);
        let _ = tx.send(s);
    });
    let log = serve.0.stderr.take().unwrap();
    let (ltx, lrx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(log), &mut s);
        let _ = ltx.send(s);
    });
    let text = rx
        .recv_timeout(Duration::from_secs(300))
        .unwrap_or_default();
    let log = lrx
        .recv_timeout(Duration::from_secs(10))
        .unwrap_or_default();
    let line = text.lines().rev().find(|l| l.starts_with('{'));
    let line = line.unwrap_or_else(|| panic!("no JSON from serve: {text}\n{log}"));
    let got: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(got["new_ids"], want[0], "{log}");
    assert!(log.contains("w1") && log.contains("w2"), "{log}");
    drop(serve);

    // `loip generate --discover` too (the shared flag group), on the same paired workers
    let out = run_ok(
        in_ns(&ns[0], &config)
            .args(["generate", "--discover", "--model", &model])
            .args(["--planner", "loip-uniform", "--prompt-ids", "3,1,4,1,5"])
            .args([
                "-n",
                "8",
                "--ignore-eos",
                "--json",
                "--connect-retry",
                "20s",
            ]),
    );
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or("{}");
    let got: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(got["new_ids"], want[0], "{out}");

    // `loip api --discover` on the coordinator: the API's tokens and its dashboard
    api_on_the_lan(&ns[0], &config, &model, &want[0]);

    // the workers pin the coordinator that paired them: another one holding the same token
    // (but not its key) is refused, naming why
    let other = dir.join("other-coordinator");
    std::fs::create_dir_all(&other).unwrap();
    let out = in_ns(&ns[0], &other)
        .args(["generate", "--model", &model, "--planner", "loip-uniform"])
        .arg("--cluster")
        .arg(config.join("discovered.toml"))
        .arg("--token-file")
        .arg(&token)
        .args([
            "--prompt-ids",
            "3,1,4,1,5",
            "-n",
            "2",
            "--connect-retry",
            "0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("paired with the coordinator"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The API key of the coordinator's `loip api`.
const KEY: &str = "netns-api-key";

/// `loip api --discover` in the coordinator's namespace `ns` (reached over the bridge): a
/// greedy completion gives `want` (one device's tokens); `/dashboard.json` lists both paired
/// workers, alive, with their blocks (every layer's attention and MLP block retained or
/// offloaded, the layers of the model covered once) and step sums equal to `/metrics`.
fn api_on_the_lan(ns: &str, config: &Path, model: &str, want: &serde_json::Value) {
    let listen = format!("{}.1:0", subnet());
    let s = Server::spawn(
        in_ns(ns, config)
            .args(["api", "--discover", "--listen", &listen, "--model", model])
            .args(["--planner", "loip-uniform", "--api-key", KEY])
            .args(["--connect-retry", "20s"]),
    );
    let auth = format!("Authorization: Bearer {KEY}\r\n");
    let get = |path: &str| http_with(&s.addr, "GET", path, &auth, b"");
    assert_eq!(http(&s.addr, "GET", "/dashboard.json", b"").status, 401);

    let body = serde_json::json!({"prompt": [3, 1, 4, 1, 5], "max_tokens": 8,
        "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    let r = s.post_with("/v1/completions", &auth, &body);
    assert_eq!(
        r.status,
        200,
        "{}\n{}",
        String::from_utf8_lossy(&r.body),
        s.log()
    );
    assert_eq!(&r.json()["choices"][0]["token_ids"], want, "{}", s.log());

    let d = get("/dashboard.json");
    assert_eq!(d.status, 200);
    let d = d.json();
    let m = get("/metrics");
    assert_eq!(m.status, 200);
    let metrics = String::from_utf8_lossy(&m.body).to_string();
    let devices = d["devices"].as_array().expect("devices");
    let planned = d["plan"]["devices"].as_array().expect("plan devices");
    let mut layers = Vec::new();
    let mut shown = Vec::new();
    for name in ["w1", "w2"] {
        let dev = devices.iter().find(|x| x["name"] == name);
        let dev = dev.unwrap_or_else(|| panic!("{name} not on the dashboard: {d}"));
        assert_eq!(dev["alive"], true, "{d}");
        steps_match_metrics(dev, &metrics);
        assert!(dev["steps"]["hops"].as_f64().unwrap_or(0.0) > 0.0, "{d}");
        let plan = planned.iter().find(|x| x["name"] == name).expect("planned");
        let (mut resident, mut streamed) = (0, 0);
        for st in plan["stages"].as_array().expect("stages") {
            for l in st["layers"].as_array().expect("layers") {
                layers.push(l["layer"].as_u64().expect("layer"));
                for block in [&l["attn"], &l["mlp"]] {
                    match block.as_str() {
                        Some("retained") => resident += 1,
                        Some("offloaded") => streamed += 1,
                        _ => panic!("{name}: block {block} in {plan}"),
                    }
                }
            }
        }
        assert!(resident + streamed > 0, "{name} holds no block: {plan}");
        let compute = metric(&metrics, "loip_device_compute_seconds", name);
        let stall = metric(&metrics, "loip_device_load_stall_seconds", name);
        shown.push((
            name,
            format!("{resident} resident, {streamed} streamed blocks"),
            format!("compute {compute:.3} s"),
            format!("load stall {stall:.3} s"),
        ));
        eprintln!(
            "{name}: {resident} blocks resident, {streamed} streamed; compute {} s, \
             load stall {} s",
            dev["steps"]["compute_s"], dev["steps"]["stall_s"]
        );
    }
    layers.sort_unstable();
    let all: Vec<u64> = (0..layers.len() as u64).collect();
    assert_eq!(layers, all, "the model's layers, each once: {d}");

    // the page as a browser on the LAN renders it (the key in the link): each device's card
    // shows its blocks and the same figures
    let url = format!("http://{}/#key={KEY}", s.addr);
    let Some(dom) = rendered_dom(&url, &config.with_file_name("chromium")) else {
        return;
    };
    for (name, blocks, compute, stall) in shown {
        let at = format!("data-device=\"{name}\"");
        let card = dom.split(&at).nth(1);
        let card = card.unwrap_or_else(|| panic!("no card for {name}: {dom}"));
        let card = card.split("data-device=").next().unwrap_or_default();
        for text in [&blocks, &compute, &stall] {
            assert!(
                card.contains(text.as_str()),
                "{name}: no {text:?} in {card}"
            );
        }
    }
    eprintln!("the dashboard rendered in chromium shows both devices' blocks and figures");
}
