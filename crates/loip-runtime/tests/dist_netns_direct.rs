//! Direct forwarding on a real (emulated) network: the coordinator and three workers each in
//! their own network namespace, joined by a Linux bridge, every port limited by `tc`.
//!
//! - `direct_hops_skip_the_coordinator`: one bridge, every worker reaches every other. The
//!   same generation runs direct, then relayed (`relay`), on the same workers; both give the
//!   single device's tokens and logits. The kernel's byte counters of every port (and the
//!   coordinator's per-link counters) are printed; with direct forwarding the coordinator's
//!   port carries per step only control frames and the logits it asks for, well under one
//!   activation row, while the workers' ports carry the rows.
//! - `unreachable_pair_is_relayed`: two bridges with nothing routing between them (the
//!   coordinator and dev2 on both, dev1 only on the first, dev3 only on the second): dev1 and
//!   dev3 cannot reach each other, so the hop dev3 → dev1 is relayed by the coordinator and
//!   the others go direct; the output is still identical and the report names the pair.
//!
//! The model is a synthetic one with wide rows (hidden 2048: 8 KiB an activation row) so
//! that rows and control frames are far apart in size. Needs root, `ip` and `tc`; skips with
//! a printed reason otherwise. Namespaces start with `loipt`, addresses are 10.231.x.y inside
//! them only, everything is deleted on every path, and every wait is bounded.

mod dist_common;

use std::path::PathBuf;
use std::time::Duration;

use dist_common::netns::{self, Counters, End};
use dist_common::*;
use loip_engine::generate::{generate, Flow};
use loip_model::Checkpoint;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{uniform_plan, Session};
use loip_runtime::coordinator::next_seq_id;

/// Off loopback a worker needs a token.
const NETNS_TOKEN: &str = "netns-direct-token-0123456789";
const PROMPT: [u32; 6] = [1, 5, 9, 23, 42, 7];
const N_NEW: usize = 6;
/// Every port's limit, both ways  // bits/s
const PORT_BPS: f64 = 100e6;
/// The model's hidden size: one activation row is `4 × HIDDEN` bytes.
const HIDDEN: usize = 2048;
const LAYERS: usize = 6;

#[test]
fn dist_worker_entry() {
    worker_entry();
}

/// A synthetic checkpoint with wide rows and few, thin layers (made once per run).
fn wide_model() -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let dir = dist_common::test_tmp().join("loip-dist-netns-direct-model");
    if dir.join("config.json").exists() {
        return dir;
    }
    let cfg = loip_model::ModelConfig::from_hf_json(&format!(
        r#"{{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":{HIDDEN},
            "intermediate_size":256,"num_hidden_layers":{LAYERS},"num_attention_heads":16,
            "num_key_value_heads":2,"vocab_size":256,"rms_norm_eps":1e-5,"rope_theta":10000.0,
            "max_position_embeddings":256,"tie_word_embeddings":false}}"#
    ))
    .unwrap();
    loip_model::synth_checkpoint(&cfg, loip_kernels::DType::BF16, None, &dir, 7, &|_, _| {})
        .unwrap();
    dir
}

fn end_json(e: &End) -> serde_json::Value {
    serde_json::json!({ "ns": e.ns, "dev": e.dev })
}

fn end_of(v: &serde_json::Value) -> End {
    End {
        ns: v["ns"].as_str().unwrap().into(),
        dev: v["dev"].as_str().unwrap().into(),
    }
}

fn snapshot(ports: &[(String, End)]) -> Vec<Counters> {
    ports
        .iter()
        .map(|(_, e)| netns::counters(e).unwrap())
        .collect()
}

/// The coordinator, run inside its namespace: one generation per entry of `relay`, each in
/// a session of its own over the same workers; per run the output, the kernel's counters of
/// every port over the generation, the coordinator's link counters and the peer report.
#[test]
fn dist_direct_coord_entry() {
    let Some(v) = netns::child_spec("dist_direct_coord_entry") else {
        return;
    };
    let slices = PathBuf::from(v["slices"].as_str().unwrap());
    let addrs = netns::strings(&v["addrs"]);
    let ports: Vec<(String, End)> = v["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap().to_string(), end_of(&p["end"])))
        .collect();
    let names: Vec<String> = (1..=addrs.len()).map(|i| format!("dev{i}")).collect();
    let plan = uniform_plan(
        "m",
        LAYERS as u32,
        &names,
        2,
        ExecMode::Overlapped,
        &|_, _| (0, 0),
    )
    .unwrap();
    let mut runs = Vec::new();
    for relay in v["relay"].as_array().unwrap() {
        let mut opts = netns::session_options(plan.clone(), NETNS_TOKEN);
        opts.relay = relay.as_bool().unwrap();
        opts.step_timeout = Duration::from_secs(60);
        let s = Session::start(&slices, netns::worker_specs(&addrs), opts).unwrap();
        let mut rec = Rec {
            inner: s.pipeline().backend(),
            logits: vec![],
        };
        let (k0, l0) = (snapshot(&ports), s.link_bytes());
        let out = generate(
            &mut rec,
            next_seq_id(),
            &PROMPT,
            &greedy(N_NEW),
            &mut |_| Flow::Continue,
        )
        .unwrap();
        let (k1, l1) = (snapshot(&ports), s.link_bytes());
        let mut run = netns::output_json(&out.new_ids, &rec.logits);
        run["ports"] = ports
            .iter()
            .zip(k0.iter().zip(&k1))
            .map(|((name, _), (a, b))| {
                let d = b.since(a);
                serde_json::json!({ "name": name, "rx": d.rx, "tx": d.tx })
            })
            .collect();
        run["links"] = l1
            .iter()
            .map(|l| {
                let was = l0
                    .iter()
                    .find(|x| x.from == l.from && x.to == l.to)
                    .map_or(0, |x| x.bytes);
                serde_json::json!({ "from": l.from, "to": l.to, "bytes": l.bytes - was })
            })
            .collect();
        run["direct"] = serde_json::json!(s.hop_links().direct);
        run["peers"] = s
            .reports
            .iter()
            .map(|r| serde_json::json!({ "from": r.endpoint.name, "peers": r.peers }))
            .collect();
        runs.push(run);
        s.shutdown();
    }
    netns::child_result(&serde_json::json!({ "runs": runs }));
}

/// One run's figures, read back from the child's JSON.
struct Run {
    ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    /// kernel counters per port: (name, rx, tx)  // bytes
    ports: Vec<(String, u64, u64)>,
    /// the coordinator's counters: (from, to, bytes)
    links: Vec<(String, String, u64)>,
    direct: Vec<bool>,
    peers: serde_json::Value,
}

impl Run {
    fn of(v: &serde_json::Value) -> Run {
        let (ids, logits) = netns::output_of(v);
        let ports = v["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let n = |k: &str| p[k].as_u64().unwrap();
                (p["name"].as_str().unwrap().to_string(), n("rx"), n("tx"))
            })
            .collect();
        let links = v["links"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                let s = |k: &str| l[k].as_str().unwrap().to_string();
                (s("from"), s("to"), l["bytes"].as_u64().unwrap())
            })
            .collect();
        let direct = v["direct"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_bool().unwrap())
            .collect();
        Run {
            ids,
            logits,
            ports,
            links,
            direct,
            peers: v["peers"].clone(),
        }
    }

    fn steps(&self) -> u64 {
        self.logits.len() as u64
    }

    /// Kernel bytes (both ways) through the ports whose names start with `prefix`.
    fn port_bytes(&self, prefix: &str) -> u64 {
        self.ports
            .iter()
            .filter(|(n, _, _)| n.starts_with(prefix))
            .map(|(_, rx, tx)| rx + tx)
            .sum()
    }

    /// Payload bytes the coordinator counted on links between two workers.
    fn peer_link_bytes(&self) -> u64 {
        self.links
            .iter()
            .filter(|(f, t, _)| f != "coordinator" && t != "coordinator")
            .map(|l| l.2)
            .sum()
    }

    fn print(&self, what: &str) {
        eprintln!(
            "{what}: {} steps, hops direct {:?}",
            self.steps(),
            self.direct
        );
        eprintln!("  port (kernel counters)    rx bytes     tx bytes   bytes/step");
        for (n, rx, tx) in &self.ports {
            eprintln!(
                "  {n:<22} {rx:>11} {tx:>12} {:>12.0}",
                (rx + tx) as f64 / self.steps() as f64
            );
        }
        eprintln!("  link (coordinator's counters, payload bytes)");
        for (f, t, b) in &self.links {
            eprintln!("  {f:>11} → {t:<11} {b:>10}");
        }
    }
}

/// Starts the workers (`(namespace, listen address)` each), runs the coordinator in `coord`
/// with one run per entry of `relay`, and returns the runs.
fn run_cluster(
    coord: &str,
    workers: &[(String, String)],
    ports: &[(String, End)],
    relay: &[bool],
    slices: &std::path::Path,
) -> Vec<Run> {
    let root = scratch(&format!("netns-direct-{}", relay.len()));
    let procs: Vec<_> = workers
        .iter()
        .enumerate()
        .map(|(i, (ns, listen))| {
            spawn_worker(&W {
                name: format!("dev{}", i + 1),
                mem: 1 << 30,
                store: root.join(format!("dev{}", i + 1)),
                listen: Some(format!("{listen}:0")),
                netns: Some(ns.clone()),
                token: Some(NETNS_TOKEN.into()),
                ..Default::default()
            })
        })
        .collect();
    let addrs: Vec<String> = procs.iter().map(|w| w.addr.clone()).collect();
    let spec = serde_json::json!({
        "slices": slices,
        "addrs": addrs,
        "relay": relay,
        "ports": ports
            .iter()
            .map(|(n, e)| serde_json::json!({ "name": n, "end": end_json(e) }))
            .collect::<Vec<_>>(),
    });
    let res = netns::run_child(
        coord,
        "dist_direct_coord_entry",
        &spec,
        Duration::from_secs(240),
    );
    drop(procs);
    res["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(Run::of)
        .collect()
}

#[test]
fn direct_hops_skip_the_coordinator() {
    let mut ports = Vec::new();
    let Some(net) = netns::build("d", |net| {
        let b = net.ns("br")?;
        net.bridge(&b, "br0")?;
        for (short, ip) in [("c", 1), ("w1", 11), ("w2", 12), ("w3", 13)] {
            let ns = net.ns(short)?;
            let link = net.attach(&ns, &format!("10.231.1.{ip}/24"), &b, "br0")?;
            net.limit(&link, PORT_BPS)?;
            let name = if short == "c" { "coordinator" } else { short };
            ports.push((name.to_string(), link.a));
        }
        Ok(())
    }) else {
        return;
    };
    let path = wide_model();
    let ckpt = Checkpoint::open(&path).unwrap();
    let slices = slices_of(&path, "netns-direct-wide");
    let (want_ids, want_logits) = reference(&ckpt, &PROMPT, &greedy(N_NEW));
    let workers: Vec<(String, String)> = (1..=3)
        .map(|i| (net.name(&format!("w{i}")), format!("10.231.1.{}", 10 + i)))
        .collect();
    let runs = run_cluster(&net.name("c"), &workers, &ports, &[false, true], &slices);
    let (direct, relay) = (&runs[0], &runs[1]);
    direct.print("direct forwarding");
    relay.print("relayed (--relay)");
    for (what, r) in [("direct", direct), ("relayed", relay)] {
        assert_eq!(r.ids, want_ids, "{what}: tokens");
        assert_bits(what, &r.logits, &want_logits);
    }
    assert!(direct.direct.iter().skip(1).all(|&d| d), "every hop direct");
    assert!(relay.direct.iter().all(|&d| !d), "every hop relayed");

    let row = (HIDDEN * 4) as u64; // bytes: one activation row
    let hops = direct.direct.len() as u64;
    let steps = direct.steps();
    // rows each hop boundary carries over the run: the prompt's, then one per decode step
    let rows = (PROMPT.len() as u64 + steps - 1) * (hops - 1);
    let logits: u64 = direct.logits.iter().map(|l| 4 * l.len() as u64).sum();
    let coord = direct.port_bytes("coordinator");
    let control = coord.saturating_sub(logits) as f64 / steps as f64;
    eprintln!(
        "coordinator port per step: direct {:.0} bytes ({control:.0} besides the logits), \
         relayed {:.0} bytes; one activation row is {row} bytes",
        coord as f64 / steps as f64,
        relay.port_bytes("coordinator") as f64 / steps as f64
    );
    assert!(
        control < row as f64 / 2.0,
        "the coordinator's port carried {control:.0} bytes a step besides the logits \
         (one activation row: {row})"
    );
    assert!(
        relay.port_bytes("coordinator") > 2 * rows * row,
        "relaying, every row crosses the coordinator's port twice"
    );
    assert!(
        direct.peer_link_bytes() >= rows * row,
        "worker↔worker links carried {} bytes, the rows are {}",
        direct.peer_link_bytes(),
        rows * row
    );
    assert_eq!(
        relay.peer_link_bytes(),
        0,
        "relayed: no rows between workers"
    );
    let workers_tx: u64 = direct
        .ports
        .iter()
        .filter(|(n, _, _)| n.starts_with('w'))
        .map(|p| p.2)
        .sum();
    assert!(
        workers_tx >= rows * row,
        "the workers' ports sent {workers_tx} bytes, less than the rows"
    );
    drop(net);
}

#[test]
fn unreachable_pair_is_relayed() {
    let mut ports = Vec::new();
    // bridge A: coordinator .1.1, dev1 .1.11, dev2 .1.12; bridge B: coordinator .2.1,
    // dev2 .2.12, dev3 .2.13. dev3 reaches dev2's listening address (on A) through dev2's
    // port on B (a host route; dev2 forwards nothing), and has no route to dev1.
    let Some(net) = netns::build("u", |net| {
        let b = net.ns("br")?;
        net.bridge(&b, "bra")?;
        net.bridge(&b, "brb")?;
        let c = net.ns("c")?;
        let (w1, w2, w3) = (net.ns("w1")?, net.ns("w2")?, net.ns("w3")?);
        for (name, ns, addr, br) in [
            ("coordinator-a", &c, "10.231.1.1/24", "bra"),
            ("coordinator-b", &c, "10.231.2.1/24", "brb"),
            ("w1", &w1, "10.231.1.11/24", "bra"),
            ("w2-a", &w2, "10.231.1.12/24", "bra"),
            ("w2-b", &w2, "10.231.2.12/24", "brb"),
            ("w3", &w3, "10.231.2.13/24", "brb"),
        ] {
            let link = net.attach(ns, addr, &b, br)?;
            net.limit(&link, PORT_BPS)?;
            ports.push((name.to_string(), link.a));
        }
        net.route(&w3, "10.231.1.12/32", "10.231.2.12")
    }) else {
        return;
    };
    let path = wide_model();
    let ckpt = Checkpoint::open(&path).unwrap();
    let slices = slices_of(&path, "netns-direct-wide");
    let (want_ids, want_logits) = reference(&ckpt, &PROMPT, &greedy(N_NEW));
    let workers = [
        (net.name("w1"), "10.231.1.11".to_string()),
        (net.name("w2"), "10.231.1.12".to_string()),
        (net.name("w3"), "10.231.2.13".to_string()),
    ];
    let runs = run_cluster(&net.name("c"), &workers, &ports, &[false], &slices);
    let r = &runs[0];
    r.print("two bridges, dev1 and dev3 apart");
    assert_eq!(r.ids, want_ids, "tokens");
    assert_bits("partly relayed", &r.logits, &want_logits);
    let mut unreachable = Vec::new();
    for dev in r.peers.as_array().unwrap() {
        let from = dev["from"].as_str().unwrap();
        for p in dev["peers"].as_array().unwrap() {
            let to = p["to"].as_str().unwrap();
            if !p["reachable"].as_bool().unwrap() {
                eprintln!(
                    "relayed pair: {from} → {to} ({})",
                    p["error"].as_str().unwrap_or("?")
                );
                unreachable.push((from.to_string(), to.to_string()));
            }
        }
    }
    unreachable.sort();
    let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        unreachable,
        vec![pair("dev1", "dev3"), pair("dev3", "dev1")],
        "only dev1 and dev3 cannot reach each other"
    );
    // route dev1 dev2 dev3 dev1 dev2 dev3: only the hop dev3 → dev1 is relayed
    assert_eq!(r.direct, vec![false, true, true, false, true, true]);
    let bytes = |f: &str, t: &str| {
        r.links
            .iter()
            .find(|l| l.0 == f && l.1 == t)
            .map_or(0, |l| l.2)
    };
    let row = (HIDDEN * 4) as u64;
    let rows = PROMPT.len() as u64 + r.steps() - 1; // rows over one hop boundary
    assert_eq!(
        bytes("dev3", "dev1"),
        0,
        "nothing went dev3 → dev1 directly"
    );
    assert!(
        bytes("dev3", "coordinator") >= rows * row,
        "dev3's rows came back"
    );
    assert!(
        bytes("coordinator", "dev1") >= rows * row,
        "and went on to dev1"
    );
    for (f, t) in [("dev1", "dev2"), ("dev2", "dev3")] {
        assert!(bytes(f, t) >= 2 * rows * row, "{f} → {t} went direct");
    }
    drop(net);
}
