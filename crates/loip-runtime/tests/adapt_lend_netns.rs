//! KV lending over a real, `tc`-limited link whose rate changes during the run: the
//! coordinator and two workers in their own network namespaces. Device 1 (room for 12 tokens
//! of KV) lends to device 2 (room for thousands); mid-generation the test drops device 2's
//! link from 100 to 1 Mbit/s. The rate measured on the fetches (what Eq. 8 sizes lending by)
//! follows the link; tokens and logits stay those of the single-device engine. Two
//! topologies:
//! - a star of veth pairs from the coordinator's namespace (which routes nothing): the
//!   workers cannot reach each other, so hops and lent KV go through the coordinator;
//! - one bridge: the workers reach each other, and the lent KV goes on dev1's peer session
//!   to dev2 (only small notices from dev1 to the coordinator).
//!
//! Needs root (CAP_NET_ADMIN), `ip` and `tc`; skips with a printed reason otherwise.

mod adapt_common;
mod dist_common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use adapt_common::*;
use dist_common::netns::{self, Net};
use dist_common::*;
use loip_engine::generate::{generate, Flow};
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::adapt::AdaptEvent;
use loip_plan::{ExecMode, Plan};
use loip_runtime::cluster_run::{uniform_plan, Session};
use loip_runtime::coordinator::next_seq_id;

const NETNS_TOKEN: &str = "netns-test-token-0123456789";
const PROMPT: [u32; 6] = [1, 5, 9, 23, 42, 7];
const N_NEW: usize = 60;
/// The token after which the rate drops.
const DROP_AT: usize = 25;

#[test]
fn dist_worker_entry() {
    worker_entry();
}

fn plan() -> Plan {
    let names: Vec<String> = vec!["dev1".into(), "dev2".into()];
    uniform_plan("m", 4, &names, 2, ExecMode::Overlapped, &|_, _| (0, 0)).unwrap()
}

/// Waits (bounded) for `path` to exist.
fn wait_for(path: &std::path::Path, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The coordinator, inside its namespace: generates, pausing after `DROP_AT` tokens until
/// the parent has changed the rate.
#[test]
fn dist_coord_entry() {
    let Some(v) = netns::child_spec("dist_coord_entry") else {
        return;
    };
    let slices = PathBuf::from(v["slices"].as_str().unwrap());
    let (paused, resumed) = (
        PathBuf::from(v["paused"].as_str().unwrap()),
        PathBuf::from(v["resumed"].as_str().unwrap()),
    );
    let addrs = netns::strings(&v["addrs"]);
    let mut opts = netns::session_options(plan(), NETNS_TOKEN);
    opts.context = CONTEXT as u64;
    opts.max_step_tokens = MAX_STEP;
    opts.measure_links = false;
    opts.admitted = Some(PROMPT.len() as u64);
    opts.lending = true;
    // the fixed plan is checked against the planner's working allowance; the workers open
    // with their own, small budgets, which are the truth
    let mut specs = netns::worker_specs(&addrs);
    for w in &mut specs {
        w.mem = Some(1 << 30);
    }
    let s = Session::start(&slices, specs, opts).unwrap();
    let mut rec = Rec {
        inner: s.pipeline().backend(),
        logits: vec![],
    };
    let mut n = 0;
    let (mut before, mut totals) = (None, None);
    let out = generate(
        &mut rec,
        next_seq_id(),
        &PROMPT,
        &greedy(N_NEW),
        &mut |_| {
            n += 1;
            if n == DROP_AT {
                before = s.adaptation();
                totals = Some(s.pipeline().lend_totals());
                std::fs::write(&paused, b"1").unwrap();
                assert!(
                    wait_for(&resumed, Duration::from_secs(30)),
                    "no rate change"
                );
            }
            Flow::Continue
        },
    )
    .unwrap();
    let mut res = netns::output_json(&out.new_ids, &rec.logits);
    let before = before.expect("paused");
    let after = s.adaptation().unwrap();
    res["steps_before"] = serde_json::json!(before.events.len());
    res["events"] = serde_json::to_value(&after.events).unwrap();
    res["bw_before"] = serde_json::json!(before.lend_bandwidth);
    res["bw_after"] = serde_json::json!(after.lend_bandwidth);
    // the mean rate of the fetches before and after the drop (one small fetch may still fit
    // the token bucket's burst and go at line rate; their mean follows the link)
    let (t0, t1) = (totals.expect("paused"), s.pipeline().lend_totals());
    let rate = |bytes: u64, secs: f64| bytes as f64 / secs.max(1e-9);
    res["mean_before"] = serde_json::json!(rate(t0.bytes, t0.fetch_s));
    res["mean_after"] = serde_json::json!(rate(t1.bytes - t0.bytes, t1.fetch_s - t0.fetch_s));
    res["links"] = serde_json::to_value(s.link_bytes()).unwrap();
    netns::child_result(&res);
    s.shutdown();
}

/// The coordinator's namespace with a veth pair to each worker's; 100 Mbit/s on both.
fn star(net: &mut Net) -> Result<(), String> {
    net.star(2, |_| Some(100e6))
}

/// One bridge joining the coordinator (10.231.1.1) and the workers (10.231.1.1i); every
/// port 100 Mbit/s.
fn bridge(net: &mut Net) -> Result<(), String> {
    let b = net.ns("br")?;
    net.bridge(&b, "br0")?;
    for (short, ip) in [("c", 1), ("w1", 11), ("w2", 12)] {
        let ns = net.ns(short)?;
        let link = net.attach(&ns, &format!("10.231.1.{ip}/24"), &b, "br0")?;
        net.limit(&link, 100e6)?;
    }
    Ok(())
}

#[test]
fn lending_over_a_link_whose_rate_drops_keeps_the_output_and_tracks_the_rate() {
    let Some(net) = netns::build("l", star) else {
        return;
    };
    // the star's links: coordinator↔dev1, coordinator↔dev2
    let link = net.links()[1].clone();
    let links = run(&net, &link, "star", |i| format!("10.231.{i}.2:0"));
    let relayed = carried(&links, "dev1", "coordinator");
    assert!(
        relayed > 0,
        "hops and lent KV go through the coordinator: {links:?}"
    );
}

#[test]
fn lending_on_the_peer_session_over_a_link_whose_rate_drops() {
    let Some(net) = netns::build("m", bridge) else {
        return;
    };
    // the bridge's ports: coordinator, dev1, dev2
    let link = net.links()[2].clone();
    let links = run(&net, &link, "bridge", |i| format!("10.231.1.1{i}:0"));
    // dev1 hands every hop to dev2 and lends to it on their session: only its notices go to
    // the coordinator
    let direct = carried(&links, "dev1", "dev2");
    assert!(direct > 0, "{links:?}");
    assert!(
        carried(&links, "dev1", "coordinator") < direct / 10,
        "{links:?}"
    );
}

/// Bytes the link `from` → `to` carried, from the coordinator's `link_bytes`.
fn carried(links: &serde_json::Value, from: &str, to: &str) -> u64 {
    links
        .as_array()
        .into_iter()
        .flatten()
        .filter(|l| l["from"] == from && l["to"] == to)
        .filter_map(|l| l["bytes"].as_u64())
        .sum()
}

/// Generates with lending on `net` (the workers listening at `listen(i)`, files under a
/// scratch directory named with `tag`), dropping `link`
/// to 1 Mbit/s after [`DROP_AT`] tokens; checks the output and the measured rate, and
/// returns the coordinator's link bytes.
fn run(
    net: &Net,
    link: &netns::Link,
    tag: &str,
    listen: impl Fn(usize) -> String,
) -> serde_json::Value {
    let started = Instant::now();
    let path = fixture("tiny-llama");
    let ckpt = Checkpoint::open(&path).unwrap();
    let slices = slices_of(&path, "tiny-llama");
    let m = Manifest::load(&slices).unwrap();
    let plan = plan();
    let c = &m.config;
    let kv_per_token = 2 * (c.num_kv_heads * c.head_dim) as u64 * 4 * 2; // two layers a device
    let held = [12, 4000];
    let (want_ids, want_logits) = reference(&ckpt, &PROMPT, &greedy(N_NEW));
    let root = scratch(&format!("adapt-lend-netns-{tag}"));
    let workers: Vec<_> = (1..=2)
        .map(|i| {
            spawn_worker(&W {
                name: format!("dev{i}"),
                mem: full_fixed(&m, &plan, i - 1) + held[i - 1] * kv_per_token,
                store: root.join(format!("dev{i}")),
                listen: Some(listen(i)),
                netns: Some(net.name(&format!("w{i}"))),
                token: Some(NETNS_TOKEN.into()),
                ..Default::default()
            })
        })
        .collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let (paused, resumed) = (root.join("paused"), root.join("resumed"));
    let _ = std::fs::remove_file(&paused);
    let _ = std::fs::remove_file(&resumed);
    let spec = serde_json::json!({
        "slices": slices, "addrs": addrs, "paused": paused, "resumed": resumed,
    });
    let link = link.clone();
    let coord = {
        let ns = net.name("c");
        std::thread::spawn(move || {
            netns::run_child(&ns, "dist_coord_entry", &spec, Duration::from_secs(240))
        })
    };
    let end = Instant::now() + Duration::from_secs(240);
    while !paused.exists() && !coord.is_finished() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    if paused.exists() {
        net.set_rate(&link, 1e6).unwrap();
        std::fs::write(&resumed, b"1").unwrap();
    }
    let res = coord.join().unwrap();
    let (ids, logits) = netns::output_of(&res);
    assert_eq!(ids, want_ids);
    assert_bits("lending over a changing link", &logits, &want_logits);
    let events: Vec<AdaptEvent> = serde_json::from_value(res["events"].clone()).unwrap();
    eprintln!("events {events:?}");
    eprintln!(
        "rate measured before {} after {}",
        res["bw_before"], res["bw_after"]
    );
    eprintln!(
        "mean fetch rate before {} after {}",
        res["mean_before"], res["mean_after"]
    );
    let before = res["steps_before"].as_u64().unwrap() as usize;
    let lent = |e: &AdaptEvent| match e {
        AdaptEvent::Lend { tokens, .. } => Some(*tokens),
        _ => None,
    };
    let at_drop = events[..before].iter().rev().find_map(lent).unwrap_or(0);
    assert!(at_drop > 0, "lending at the drop: {events:?}");
    // The fetches' rate (what Eq. 8 sizes lending by) follows the link. (With this tiny
    // model a lend is 10 tokens, under the default dead band n_ts = 16, so the policy keeps
    // it until the cap reaches 0.)
    let (bw0, bw1) = (
        res["mean_before"].as_f64().unwrap(),
        res["mean_after"].as_f64().unwrap(),
    );
    assert!(bw1 < bw0 / 10.0, "measured {bw0} then {bw1} bytes/s");
    drop(workers);
    eprintln!("links {}", res["links"]);
    eprintln!(
        "lending under a falling rate: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    res["links"].clone()
}
