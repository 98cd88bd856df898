//! KV lending in the running cluster (design §6): two worker processes, each with two
//! one-layer stages; the first has room for 12 tokens of KV, the second for thousands. With
//! lending on, the first lends the oldest rows of each stage's KV to the second after the
//! stage runs and fetches them back before it runs again (through the coordinator); tokens
//! and logits stay bit-identical to the single-device engine, lending on or off, with the
//! hops direct or relayed, and for a request that arrives while another holds lent KV.

mod adapt_common;
mod dist_common;

use adapt_common::*;
use dist_common::*;
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::adapt::AdaptEvent;
use loip_runtime::adapt::AdaptReport;
use loip_runtime::cluster_run::{Session, SessionOptions, WorkerProcess};
use loip_runtime::coordinator::next_seq_id;

#[test]
fn dist_worker_entry() {
    worker_entry();
}

const PROMPT: &[u32] = &[1, 5, 9, 23, 42, 7];
const PROMPT_B: &[u32] = &[3, 14, 15, 92];

/// Starts the two-worker session; `lending`, `relay` as named.
fn start(lending: bool, relay: bool, tag: &str) -> (Session, Vec<WorkerProcess>) {
    let path = fixture("tiny-llama");
    let slices = slices_of(&path, "tiny-llama");
    let m = Manifest::load(&slices).unwrap();
    let (names, plan, kv_per_token) = two_device_plan(&m);
    let held = [12, 4000];
    let root = scratch(tag);
    let workers: Vec<_> = (0..2)
        .map(|i| {
            spawn_worker(&W {
                name: names[i].clone(),
                mem: full_fixed(&m, &plan, i) + held[i] * kv_per_token,
                store: root.join(&names[i]),
                ..Default::default()
            })
        })
        .collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let specs = worker_specs(&names, &addrs);
    let opts = SessionOptions {
        lending,
        relay,
        ..session_options(plan, PROMPT.len())
    };
    let s = Session::start(&slices, specs, opts).unwrap_or_else(|e| panic!("session: {e}"));
    (s, workers)
}

/// Generates `n_new` tokens of `prompt` as sequence `seq` and checks tokens and logits
/// against the single-device engine.
fn check(s: &Session, seq: u64, prompt: &[u32], n_new: usize, what: &str) {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let (want_ids, want_logits) = reference(&ckpt, prompt, &greedy(n_new));
    let (ids, logits) = recorded(s.pipeline().backend(), seq, prompt, &greedy(n_new))
        .unwrap_or_else(|e| panic!("{what}: generation: {e}"));
    assert_eq!(ids, want_ids, "{what}: tokens");
    assert_bits(what, &logits, &want_logits);
}

fn lends(ad: &AdaptReport) -> Vec<(usize, usize, u64)> {
    ad.events
        .iter()
        .filter_map(|e| match e {
            AdaptEvent::Lend {
                device,
                peer,
                tokens,
                ..
            } => Some((*device, *peer, *tokens)),
            _ => None,
        })
        .collect()
}

fn run_case(lending: bool, relay: bool, tag: &str) -> AdaptReport {
    let (s, _w) = start(lending, relay, tag);
    let seq = next_seq_id();
    check(&s, seq, PROMPT, 60, tag);
    s.pipeline().release(&[seq]);
    let ad = s.adaptation().expect("adaptation on");
    eprintln!("{tag}: events {:?}", ad.events);
    eprintln!("{tag}: devices {:?}", ad.devices);
    s.shutdown();
    ad
}

#[test]
fn lending_on_and_off_keep_tokens_and_logits_bit_identical() {
    let off = run_case(false, false, "adapt-lend-off");
    assert!(lends(&off).is_empty(), "{:?}", off.events);
    let on = run_case(true, false, "adapt-lend-on");
    let l = lends(&on);
    assert!(
        l.iter().any(|&(d, p, t)| d == 0 && p == 1 && t > 0),
        "dev1 lends to dev2: {l:?}"
    );
    let d = &on.devices;
    assert!(d[0].fetches > 0 && d[0].kv_moved_bytes > 0, "{d:?}");
    assert!(d[1].borrowed_bytes > 0, "{d:?}");
    assert_eq!(d[0].lent_to.as_deref(), Some("dev2"));
}

#[test]
fn lent_kv_through_relayed_hops() {
    let on = run_case(true, true, "adapt-lend-relay");
    assert!(!lends(&on).is_empty(), "{:?}", on.events);
    assert!(on.devices[0].fetches > 0, "{:?}", on.devices);
}

#[test]
fn a_request_arriving_while_another_holds_lent_kv() {
    let (s, _w) = start(true, false, "adapt-lend-two");
    let a = next_seq_id();
    check(&s, a, PROMPT, 16, "first request");
    let ad = s.adaptation().expect("adaptation on");
    assert!(ad.devices[0].lent_tokens > 0, "{:?}", ad.devices);
    // the first sequence is not released: its rows stay lent while the second runs
    let b = next_seq_id();
    check(&s, b, PROMPT_B, 20, "second request");
    s.pipeline().release(&[a, b]);
    let ad = s.adaptation().expect("adaptation on");
    eprintln!("events {:?}", ad.events);
    assert_eq!(ad.held_admissions, 0, "{ad:?}");
    s.shutdown();
}
