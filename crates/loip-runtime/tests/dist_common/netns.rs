//! Network namespaces for the distributed tests: a [`Net`] creates namespaces, veth pairs
//! and bridges, limits links with `tc` (and changes a limit while traffic flows), reads the
//! kernel's per-device byte counters, and deletes everything it made when dropped (on every
//! path, a panic included). A child process of this test binary can run inside a namespace
//! ([`run_child`]) and hand back one JSON result.
//!
//! Names: every namespace is `loipt<pid><tag><short>`, so runs and tests never collide and
//! leftovers of a killed run are recognisable; veth devices are created directly inside
//! their namespaces (short names, nothing in the host's namespace). Addresses are the
//! caller's and live only inside the namespaces (use 10.231.0.0/16).
//!
//! Needs root (CAP_NET_ADMIN), `ip` and `tc`: [`build`] prints why it skips otherwise.
//!
//! ```ignore
//! let Some(mut net) = netns::build("ln", |net| {
//!     let a = net.ns("a")?;
//!     let b = net.ns("b")?;
//!     let link = net.veth(&a, Some("10.231.1.1/24"), &b, Some("10.231.1.2/24"))?;
//!     net.limit(&link, 100e6)
//! }) else {
//!     return; // skipped, reason printed
//! };
//! net.set_rate(&net.links()[0], 20e6).unwrap(); // while the test runs
//! ```
#![allow(dead_code)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use loip_plan::Plan;
use loip_runtime::cluster_run::{SessionOptions, WorkerSpec};

/// Runs a command; its stdout, or an error naming the command and its stderr.
pub fn sh(args: &[&str]) -> Result<String, String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", args[0]))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Why namespace tests cannot run here (not root, `ip` or `tc` missing), if so.
pub fn skip_reason() -> Option<String> {
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

/// One end of a veth pair: a device inside a namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct End {
    /// the namespace
    pub ns: String,
    /// the device's name inside it
    pub dev: String,
}

/// A veth pair (a point-to-point link, or a namespace's port on a bridge: `b` is then the
/// bridge's side).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// first end
    pub a: End,
    /// second end
    pub b: End,
}

/// Bytes a device received and sent, as the kernel counts them (frames with their
/// Ethernet/IP/TCP headers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// received  // bytes
    pub rx: u64,
    /// sent  // bytes
    pub tx: u64,
}

impl Counters {
    /// Both directions.
    pub fn total(&self) -> u64 {
        self.rx + self.tx
    }

    /// What was counted since `before`.
    pub fn since(&self, before: &Counters) -> Counters {
        Counters {
            rx: self.rx.saturating_sub(before.rx),
            tx: self.tx.saturating_sub(before.tx),
        }
    }
}

/// The namespaces, links and bridges of one test; all deleted on drop.
pub struct Net {
    prefix: String,
    namespaces: Vec<String>,
    links: Vec<Link>,
}

/// A `tc` token bucket of `bits_per_s` on `end`'s egress.
fn tbf(verb: &str, end: &End, bits_per_s: f64) -> Result<(), String> {
    let rate = format!("{}bit", bits_per_s.round() as u64);
    // at least 10 ms of traffic (and 64 KiB) per bucket, so one timer tick never starves it
    let burst = format!("{}", ((bits_per_s / 8.0 / 100.0) as u64).max(64 << 10));
    sh(&[
        "ip", "netns", "exec", &end.ns, "tc", "qdisc", verb, "dev", &end.dev, "root", "tbf",
        "rate", &rate, "burst", &burst, "latency", "100ms",
    ])
    .map(drop)
}

impl Net {
    /// An empty network of this process, named with `tag` (a few letters; one per test).
    /// Deletes namespaces that a killed run of the same process id and tag left behind.
    pub fn new(tag: &str) -> Net {
        let prefix = format!("loipt{}{tag}", std::process::id() % 100_000);
        if let Ok(list) = sh(&["ip", "netns", "list"]) {
            for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
                if name.starts_with(&prefix) {
                    let _ = sh(&["ip", "netns", "del", name]);
                }
            }
        }
        Net {
            prefix,
            namespaces: Vec::new(),
            links: Vec::new(),
        }
    }

    /// The full name of namespace `short` ([`Net::ns`]).
    pub fn name(&self, short: &str) -> String {
        format!("{}{short}", self.prefix)
    }

    /// Creates namespace `<prefix><short>` with its loopback up; returns its name.
    pub fn ns(&mut self, short: &str) -> Result<String, String> {
        let name = self.name(short);
        sh(&["ip", "netns", "add", &name])?;
        self.namespaces.push(name.clone());
        sh(&["ip", "-n", &name, "link", "set", "lo", "up"])?;
        // no namespace routes between its interfaces (the kernel's default, made sure)
        sh(&[
            "ip",
            "netns",
            "exec",
            &name,
            "sysctl",
            "-q",
            "-w",
            "net.ipv4.ip_forward=0",
        ])?;
        Ok(name)
    }

    /// The links made so far, in order.
    pub fn links(&self) -> &[Link] {
        &self.links
    }

    /// A veth pair from namespace `a` to `b`, up, with the given addresses (`10.231.1.1/24`).
    pub fn veth(
        &mut self,
        a: &str,
        a_addr: Option<&str>,
        b: &str,
        b_addr: Option<&str>,
    ) -> Result<Link, String> {
        let k = self.links.len();
        let link = Link {
            a: End {
                ns: a.to_string(),
                dev: format!("v{k}a"),
            },
            b: End {
                ns: b.to_string(),
                dev: format!("v{k}b"),
            },
        };
        sh(&[
            "ip",
            "link",
            "add",
            &link.a.dev,
            "netns",
            a,
            "type",
            "veth",
            "peer",
            "name",
            &link.b.dev,
            "netns",
            b,
        ])?;
        self.links.push(link.clone());
        for (end, addr) in [(&link.a, a_addr), (&link.b, b_addr)] {
            if let Some(addr) = addr {
                sh(&["ip", "-n", &end.ns, "addr", "add", addr, "dev", &end.dev])?;
            }
            sh(&["ip", "-n", &end.ns, "link", "set", &end.dev, "up"])?;
        }
        Ok(link)
    }

    /// A star: namespace `c` (the coordinator's, 10.231.i.1) with a veth pair to each of
    /// `w1..=wn` (10.231.i.2); `limit(i)` bits/s on worker i's link, both ways, if any.
    pub fn star(&mut self, n: usize, limit: impl Fn(usize) -> Option<f64>) -> Result<(), String> {
        let c = self.ns("c")?;
        for i in 1..=n {
            let w = self.ns(&format!("w{i}"))?;
            let link = self.veth(
                &c,
                Some(&format!("10.231.{i}.1/24")),
                &w,
                Some(&format!("10.231.{i}.2/24")),
            )?;
            if let Some(bits) = limit(i) {
                self.limit(&link, bits)?;
            }
        }
        Ok(())
    }

    /// A Linux bridge `name` inside namespace `ns`, up.
    pub fn bridge(&mut self, ns: &str, name: &str) -> Result<(), String> {
        sh(&["ip", "-n", ns, "link", "add", name, "type", "bridge"])?;
        sh(&["ip", "-n", ns, "link", "set", name, "up"])?;
        Ok(())
    }

    /// Joins namespace `ns` (address `addr`) to `bridge` in `bridge_ns` with a veth pair;
    /// `a` is the namespace's end, `b` the bridge's port.
    pub fn attach(
        &mut self,
        ns: &str,
        addr: &str,
        bridge_ns: &str,
        bridge: &str,
    ) -> Result<Link, String> {
        let link = self.veth(ns, Some(addr), bridge_ns, None)?;
        sh(&[
            "ip",
            "-n",
            bridge_ns,
            "link",
            "set",
            &link.b.dev,
            "master",
            bridge,
        ])?;
        Ok(link)
    }

    /// A route in `ns` to `dest` (`10.231.1.12/32`) via the gateway `via`.
    pub fn route(&self, ns: &str, dest: &str, via: &str) -> Result<(), String> {
        sh(&["ip", "-n", ns, "route", "add", dest, "via", via]).map(drop)
    }

    /// Limits `link` to `bits_per_s` in both directions (a `tbf` qdisc on each end).
    pub fn limit(&self, link: &Link, bits_per_s: f64) -> Result<(), String> {
        tbf("add", &link.a, bits_per_s)?;
        tbf("add", &link.b, bits_per_s)
    }

    /// Changes (or sets) `link`'s limit to `bits_per_s` both ways; safe while traffic flows,
    /// the connections on it stay open.
    pub fn set_rate(&self, link: &Link, bits_per_s: f64) -> Result<(), String> {
        tbf("replace", &link.a, bits_per_s)?;
        tbf("replace", &link.b, bits_per_s)
    }

    /// Removes `link`'s limit (both ends).
    pub fn unlimit(&self, link: &Link) -> Result<(), String> {
        for end in [&link.a, &link.b] {
            sh(&[
                "ip", "netns", "exec", &end.ns, "tc", "qdisc", "del", "dev", &end.dev, "root",
            ])?;
        }
        Ok(())
    }

    /// A command that runs `program` inside namespace `ns`.
    pub fn command(ns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(program);
        c
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // deleting a namespace deletes its devices, and the veth ends' peers with them
        for ns in self.namespaces.iter().rev() {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
    }
}

/// The kernel's byte counters of `end` (readable from any namespace, a child's included).
pub fn counters(end: &End) -> Result<Counters, String> {
    let out = sh(&[
        "ip", "-n", &end.ns, "-j", "-s", "link", "show", "dev", &end.dev,
    ])?;
    let v: serde_json::Value =
        serde_json::from_str(&out).map_err(|e| format!("`ip -j` output: {e}"))?;
    let s = &v[0]["stats64"];
    match (s["rx"]["bytes"].as_u64(), s["tx"]["bytes"].as_u64()) {
        (Some(rx), Some(tx)) => Ok(Counters { rx, tx }),
        _ => Err(format!("no byte counters for {} in {}", end.dev, end.ns)),
    }
}

/// The `tbf` limit on `end`'s egress, if any  // bits/s
pub fn rate(end: &End) -> Result<Option<f64>, String> {
    let out = sh(&[
        "ip", "netns", "exec", &end.ns, "tc", "-j", "qdisc", "show", "dev", &end.dev,
    ])?;
    let v: serde_json::Value =
        serde_json::from_str(&out).map_err(|e| format!("`tc -j` output: {e}"))?;
    Ok(v.as_array()
        .into_iter()
        .flatten()
        .find(|q| q["kind"] == "tbf")
        .and_then(|q| q["options"]["rate"].as_f64())
        .map(|bytes_per_s| bytes_per_s * 8.0))
}

/// Builds a network with `setup`; None (with the reason printed) where namespace tests
/// cannot run here: not root, no `ip`/`tc`, or namespaces not permitted. Any other setup
/// error panics (after the partial network is deleted). None without a word in a child
/// process ([`is_child`]: a worker or a [`run_child`] run), where the test does nothing.
pub fn build(tag: &str, setup: impl FnOnce(&mut Net) -> Result<(), String>) -> Option<Net> {
    if is_child() {
        return None;
    }
    if let Some(r) = skip_reason() {
        eprintln!("skipping the network-namespace test: {r}");
        return None;
    }
    let mut net = Net::new(tag);
    match setup(&mut net) {
        Ok(()) => Some(net),
        Err(e) if e.contains("Operation not permitted") || e.contains("Permission denied") => {
            eprintln!("skipping the network-namespace test: no CAP_NET_ADMIN ({e})");
            None
        }
        Err(e) => {
            drop(net);
            panic!("{e}")
        }
    }
}

/// Whether this process is a child of [`run_child`] or a worker (the entry tests then
/// run, the others return at once).
pub fn is_child() -> bool {
    std::env::var("LOIP_DIST_WORKER").is_ok() || std::env::var("LOIP_DIST_CHILD").is_ok()
}

/// The spec a child of [`run_child`] was started with, when this process is one started
/// for `test` (call at the start of that `#[test]`).
pub fn child_spec(test: &str) -> Option<serde_json::Value> {
    let v: serde_json::Value =
        serde_json::from_str(&std::env::var("LOIP_DIST_CHILD").ok()?).ok()?;
    (v["test"].as_str() == Some(test)).then(|| v["spec"].clone())
}

/// Hands a child's result back to [`run_child`].
pub fn child_result(v: &serde_json::Value) {
    println!("RESULT {v}");
}

/// Runs this test binary's `#[test] fn test` inside namespace `ns` with `spec` (read there
/// with [`child_spec`]), waits at most `timeout`, and returns what it passed to
/// [`child_result`]. Panics, naming the child's output, when it fails or runs too long.
pub fn run_child(
    ns: &str,
    test: &str,
    spec: &serde_json::Value,
    timeout: Duration,
) -> serde_json::Value {
    let exe = std::env::current_exe().unwrap();
    let mut child = Net::command(ns, exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(
            "LOIP_DIST_CHILD",
            serde_json::json!({ "test": test, "spec": spec }).to_string(),
        )
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
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{test} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = reader.join().unwrap();
    assert!(status.success(), "{test} failed: {stdout}");
    let line = stdout
        .lines()
        .find_map(|l| l.split("RESULT ").nth(1))
        .unwrap_or_else(|| panic!("no result in: {stdout}"));
    serde_json::from_str(line).unwrap()
}

/// The strings of a JSON array (a child's spec).
pub fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

/// Workers dev1..devN at `addrs`, with one fixed profile (plans do not depend on the host).
pub fn worker_specs(addrs: &[String]) -> Vec<WorkerSpec> {
    addrs
        .iter()
        .enumerate()
        .map(|(i, a)| WorkerSpec {
            profile: loip_plan::profile::preset("host-zen5-2c"),
            ..WorkerSpec::new(format!("dev{}", i + 1), a)
        })
        .collect()
}

/// A session of the small test models with a fixed `plan` (shape `m`), workers off loopback
/// (so with `token`).
pub fn session_options(plan: Plan, token: &str) -> SessionOptions {
    let mut o = SessionOptions {
        plan: Some(plan),
        shape_name: "m".into(),
        context: 64,
        max_step_tokens: 16,
        ..Default::default()
    };
    o.connect.token = Some(token.into());
    o
}

/// Tokens and logits as JSON (logits as f32 bit patterns, so they survive exactly).
pub fn output_json(ids: &[u32], logits: &[Vec<f32>]) -> serde_json::Value {
    let bits: Vec<Vec<u32>> = logits
        .iter()
        .map(|l| l.iter().map(|x| x.to_bits()).collect())
        .collect();
    serde_json::json!({ "tokens": ids, "logits": bits })
}

/// The tokens and logits of [`output_json`].
pub fn output_of(v: &serde_json::Value) -> (Vec<u32>, Vec<Vec<f32>>) {
    let ids = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let logits = v["logits"]
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
    (ids, logits)
}
