//! A real bandwidth-limited network: the coordinator and two workers in their own network
//! namespaces, joined by veth pairs; `tc` limits worker 1's link to 100 Mbit/s both ways.
//! The output must still be identical to one machine (tokens and logits), and the bandwidth
//! the coordinator measures on the limited link must be within 20% of the limit.
//!
//! Needs root (CAP_NET_ADMIN), `ip` and `tc`; skips with a printed reason otherwise. It
//! creates and deletes its own namespaces (names starting with `loipt`), uses addresses only
//! inside them (10.231.x.0/24), and cleans up on every path.

mod dist_common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dist_common::*;
use loip_engine::generate::{generate, Flow};
use loip_model::Checkpoint;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{uniform_plan, Session, SessionOptions, WorkerSpec};
use loip_runtime::coordinator::next_seq_id;

/// Off loopback a worker needs a token.
const NETNS_TOKEN: &str = "netns-test-token-0123456789";

#[test]
fn dist_worker_entry() {
    worker_entry();
}

const LIMIT_BPS: f64 = 100e6 / 8.0; // bytes/s
const PROMPT: [u32; 6] = [1, 5, 9, 23, 42, 7];
const N_NEW: usize = 6;

/// The coordinator, run inside its namespace as a child process; prints `RESULT {json}`.
#[test]
fn dist_coord_entry() {
    let Ok(spec) = std::env::var("LOIP_DIST_COORD") else {
        return;
    };
    let v: serde_json::Value = serde_json::from_str(&spec).unwrap();
    let slices = std::path::PathBuf::from(v["slices"].as_str().unwrap());
    let addrs: Vec<String> = v["addrs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    let names: Vec<String> = (1..=addrs.len()).map(|i| format!("dev{i}")).collect();
    let plan = uniform_plan("m", 4, &names, 2, ExecMode::Overlapped, &|d, n| {
        if d == 0 {
            (0, 1.min(n))
        } else {
            (0, 0)
        }
    })
    .unwrap();
    let specs = names
        .iter()
        .zip(&addrs)
        .map(|(n, a)| WorkerSpec {
            profile: loip_plan::profile::preset("host-zen5-2c"),
            ..WorkerSpec::new(n, a)
        })
        .collect();
    let mut opts = SessionOptions {
        plan: Some(plan),
        shape_name: "m".into(),
        context: 64,
        max_step_tokens: 16,
        ..Default::default()
    };
    opts.connect.token = Some(NETNS_TOKEN.into());
    let s = Session::start(&slices, specs, opts).unwrap();
    let mut rec = Rec {
        inner: s.pipeline().backend(),
        logits: vec![],
    };
    let out = generate(
        &mut rec,
        next_seq_id(),
        &PROMPT,
        &greedy(N_NEW),
        &mut |_| Flow::Continue,
    )
    .unwrap();
    let bits: Vec<Vec<u32>> = rec
        .logits
        .iter()
        .map(|l| l.iter().map(|x| x.to_bits()).collect())
        .collect();
    let links: Vec<_> = s.reports.iter().map(|r| r.link).collect();
    let res = serde_json::json!({ "tokens": out.new_ids, "logits": bits, "links": links });
    println!("RESULT {res}");
    s.shutdown();
}

fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Deletes the namespaces it was given when dropped (which removes their veth ends too).
struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
    }
}

fn skip_reason() -> Option<String> {
    if std::env::var("USER").as_deref() != Ok("root")
        && !std::fs::read_to_string("/proc/self/status").is_ok_and(|s| s.contains("Uid:\t0\t"))
    {
        return Some("not running as root".into());
    }
    for tool in ["ip", "tc"] {
        if Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_err()
        {
            return Some(format!("`{tool}` is not installed"));
        }
    }
    None
}

fn setup(p: &str, ns: &Netns) -> Result<(), String> {
    let c = &ns.0[0];
    for n in &ns.0 {
        sh(&["ip", "netns", "add", n])?;
        sh(&["ip", "-n", n, "link", "set", "lo", "up"])?;
    }
    for i in 1..=2 {
        let (vc, vw, w) = (format!("{p}c{i}"), format!("{p}w{i}"), &ns.0[i]);
        sh(&[
            "ip", "link", "add", &vc, "type", "veth", "peer", "name", &vw,
        ])?;
        sh(&["ip", "link", "set", &vc, "netns", c])?;
        sh(&["ip", "link", "set", &vw, "netns", w])?;
        sh(&[
            "ip",
            "-n",
            c,
            "addr",
            "add",
            &format!("10.231.{i}.1/24"),
            "dev",
            &vc,
        ])?;
        sh(&[
            "ip",
            "-n",
            w,
            "addr",
            "add",
            &format!("10.231.{i}.2/24"),
            "dev",
            &vw,
        ])?;
        sh(&["ip", "-n", c, "link", "set", &vc, "up"])?;
        sh(&["ip", "-n", w, "link", "set", &vw, "up"])?;
    }
    // 100 Mbit/s on worker 1's link, both directions.
    for (n, dev) in [
        (c.clone(), format!("{p}c1")),
        (ns.0[1].clone(), format!("{p}w1")),
    ] {
        sh(&[
            "ip", "netns", "exec", &n, "tc", "qdisc", "add", "dev", &dev, "root", "tbf", "rate",
            "100mbit", "burst", "64kb", "latency", "100ms",
        ])?;
    }
    Ok(())
}

#[test]
fn limited_link_is_measured_and_output_is_unchanged() {
    if std::env::var("LOIP_DIST_WORKER").is_ok() || std::env::var("LOIP_DIST_COORD").is_ok() {
        return;
    }
    if let Some(r) = skip_reason() {
        eprintln!("skipping the network-namespace test: {r}");
        return;
    }
    let p = format!("loipt{}", std::process::id() % 100_000);
    let ns = Netns(vec![format!("{p}c"), format!("{p}w1"), format!("{p}w2")]);
    for n in &ns.0 {
        let _ = sh(&["ip", "netns", "del", n]); // leftovers of a killed run
    }
    if let Err(e) = setup(&p, &ns) {
        if e.contains("Operation not permitted") || e.contains("Permission denied") {
            eprintln!("skipping the network-namespace test: no CAP_NET_ADMIN ({e})");
            return;
        }
        panic!("{e}");
    }
    let path = fixture("tiny-llama");
    let ckpt = Checkpoint::open(&path).unwrap();
    let slices = slices_of(&path, "tiny-llama");
    let (want_ids, want_logits) = reference(&ckpt, &PROMPT, &greedy(N_NEW));
    let root = scratch("netns");
    let workers: Vec<_> = (1..=2)
        .map(|i| {
            spawn_worker(&W {
                name: format!("dev{i}"),
                mem: 1 << 30,
                store: root.join(format!("dev{i}")),
                listen: Some(format!("10.231.{i}.2:0")),
                netns: Some(ns.0[i].clone()),
                token: Some(NETNS_TOKEN.into()),
                ..Default::default()
            })
        })
        .collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let spec = serde_json::json!({ "slices": slices, "addrs": addrs });
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.0[0]])
        .arg(exe)
        .args([
            "dist_coord_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LOIP_DIST_COORD", spec.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pipe = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let mut out = String::new();
        let _ = pipe.read_to_string(&mut out);
        out
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the coordinator did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = reader.join().unwrap();
    assert!(status.success(), "coordinator failed: {stdout}");
    let line = stdout
        .lines()
        .find_map(|l| l.split("RESULT ").nth(1))
        .unwrap_or_else(|| panic!("no result in: {stdout}"));
    let res: serde_json::Value = serde_json::from_str(line).unwrap();
    let ids: Vec<u32> = res["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(ids, want_ids);
    let logits: Vec<Vec<f32>> = res["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|b| f32::from_bits(b.as_u64().unwrap() as u32))
                .collect()
        })
        .collect();
    assert_bits("namespaced cluster", &logits, &want_logits);
    let link = &res["links"][0];
    for dir in ["up_bps", "down_bps"] {
        let bw = link[dir].as_f64().unwrap();
        let ratio = bw / LIMIT_BPS;
        eprintln!(
            "limited link {dir}: {:.1} Mbit/s ({:.0}% of the limit)",
            bw * 8e-6,
            ratio * 100.0
        );
        assert!(
            (0.8..=1.2).contains(&ratio),
            "{dir} measured {:.1} Mbit/s on a 100 Mbit/s link",
            bw * 8e-6
        );
    }
    let free = res["links"][1]["up_bps"].as_f64().unwrap();
    assert!(
        free > 2.0 * LIMIT_BPS,
        "the unlimited link measured only {:.1} Mbit/s",
        free * 8e-6
    );
    drop(workers);
    drop(ns);
}
