//! A real bandwidth-limited network: the coordinator and two workers in their own network
//! namespaces, joined by veth pairs; `tc` limits worker 1's link to 100 Mbit/s both ways.
//! The output must still be identical to one machine (tokens and logits), and the bandwidth
//! the coordinator measures on the limited link must be within 20% of the limit.
//!
//! Needs root (CAP_NET_ADMIN), `ip` and `tc`; skips with a printed reason otherwise. It
//! creates and deletes its own namespaces (names starting with `loipt`), uses addresses only
//! inside them (10.231.x.0/24), and cleans up on every path.

mod dist_common;

use std::time::Duration;

use dist_common::netns::{self, Net};
use dist_common::*;
use loip_model::Checkpoint;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{uniform_plan, Session};
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

/// The coordinator, run inside its namespace as a child process.
#[test]
fn dist_coord_entry() {
    let Some(v) = netns::child_spec("dist_coord_entry") else {
        return;
    };
    let slices = std::path::PathBuf::from(v["slices"].as_str().unwrap());
    let addrs = netns::strings(&v["addrs"]);
    let names: Vec<String> = (1..=addrs.len()).map(|i| format!("dev{i}")).collect();
    let plan = uniform_plan("m", 4, &names, 2, ExecMode::Overlapped, &|d, n| {
        if d == 0 {
            (0, 1.min(n))
        } else {
            (0, 0)
        }
    })
    .unwrap();
    let opts = netns::session_options(plan, NETNS_TOKEN);
    let s = Session::start(&slices, netns::worker_specs(&addrs), opts).unwrap();
    let (ids, logits) = recorded(
        s.pipeline().backend(),
        next_seq_id(),
        &PROMPT,
        &greedy(N_NEW),
    )
    .unwrap();
    let mut res = netns::output_json(&ids, &logits);
    res["links"] = serde_json::json!(s.reports.iter().map(|r| r.link).collect::<Vec<_>>());
    netns::child_result(&res);
    s.shutdown();
}

/// The coordinator's namespace with a veth pair to each worker's; 100 Mbit/s on worker 1's
/// link, both directions.
fn setup(net: &mut Net) -> Result<(), String> {
    net.star(2, |i| (i == 1).then_some(LIMIT_BPS * 8.0))
}

#[test]
fn limited_link_is_measured_and_output_is_unchanged() {
    let Some(net) = netns::build("d", setup) else {
        return;
    };
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
                netns: Some(net.name(&format!("w{i}"))),
                token: Some(NETNS_TOKEN.into()),
                ..Default::default()
            })
        })
        .collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let spec = serde_json::json!({ "slices": slices, "addrs": addrs });
    let res = netns::run_child(
        &net.name("c"),
        "dist_coord_entry",
        &spec,
        Duration::from_secs(120),
    );
    let (ids, logits) = netns::output_of(&res);
    assert_eq!(ids, want_ids);
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
    drop(net);
}

/// The helper's live rate change: a limited veth pair, its limit replaced, then removed.
#[test]
fn a_links_rate_changes_while_it_is_up() {
    let Some(net) = netns::build("r", |net| {
        let (a, b) = (net.ns("a")?, net.ns("b")?);
        let link = net.veth(&a, Some("10.231.9.1/24"), &b, Some("10.231.9.2/24"))?;
        net.limit(&link, 100e6)
    }) else {
        return;
    };
    let link = net.links()[0].clone();
    for end in [&link.a, &link.b] {
        assert_eq!(netns::rate(end).unwrap(), Some(100e6));
    }
    net.set_rate(&link, 20e6).unwrap();
    for end in [&link.a, &link.b] {
        assert_eq!(netns::rate(end).unwrap(), Some(20e6));
    }
    net.unlimit(&link).unwrap();
    assert_eq!(netns::rate(&link.a).unwrap(), None);
}
