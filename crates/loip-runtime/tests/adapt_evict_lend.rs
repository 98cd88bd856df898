//! Eviction of a sequence whose rows are lent to a peer (design §6, the last resort next to
//! KV lending): two worker processes, each with two one-layer stages already fully
//! offloaded (no switch can free more); `dev1` has room for 20 tokens of KV and lends the
//! oldest rows of each stage to `dev2`, which has room for 400.
//!
//! Sequence A grows until `dev1` lends its rows; then B runs whole beside it. Lending
//! cannot carry both (at most every row but the newest of each sequence, one stage's worth),
//! so the coordinator evicts A while its rows are out at `dev2`: A's KV is released on
//! both devices, the rows `dev2` held for it come back with the next fetch and are dropped
//! (A was restarted), and A is recomputed once B is released. Both are bit-identical to the
//! single-device engine (a worker refuses KV past its budget with a typed error, which
//! would fail the run), and `dev2`'s reservation for `dev1`
//! is never more than the lend the coordinator accounts (nothing is leaked to A). A third
//! request afterwards lends again through the same reservation, bit-identical.

mod adapt_common;
mod dist_common;

use adapt_common::*;
use dist_common::*;

use loip_engine::generate::{generate, Flow};
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::adapt::AdaptEvent;
use loip_runtime::cluster_run::{device_spec, Session, SessionOptions, WorkerProcess};
use loip_runtime::coordinator::next_seq_id;
use loip_runtime::executor::Device;
use loip_runtime::LoaderKind;

#[test]
fn dist_worker_entry() {
    worker_entry();
}

const PROMPT_A: &[u32] = &[1, 5, 9, 23, 42, 7];
const PROMPT_B: &[u32] = &[3, 14, 15, 92, 65, 35];
const PROMPT_C: &[u32] = &[2, 7, 18, 28];
/// KV room of each device  // tokens
const ROOM: [u64; 2] = [20, 400];

fn start(tag: &str) -> (Session, Vec<WorkerProcess>) {
    let path = fixture("tiny-llama");
    let slices = slices_of(&path, "tiny-llama");
    let m = Manifest::load(&slices).unwrap();
    let (names, _, kv_per_token) = two_device_plan(&m);
    let plan = offloaded_plan(&m, &names);
    let root = scratch(tag);
    let workers: Vec<_> = (0..2)
        .map(|i| {
            let spec = device_spec(&plan, i, LoaderKind::Direct, MAX_STEP, CONTEXT, None);
            let mem = Device::open(&slices, &m, spec).unwrap().memory();
            spawn_worker(&W {
                name: names[i].clone(),
                mem: mem.resident + mem.slot + mem.working + ROOM[i] * kv_per_token,
                store: root.join(&names[i]),
                ..Default::default()
            })
        })
        .collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let opts = SessionOptions {
        lending: true,
        ..session_options(plan, PROMPT_A.len())
    };
    let s = Session::start(&slices, worker_specs(&names, &addrs), opts)
        .unwrap_or_else(|e| panic!("session: {e}"));
    (s, workers)
}

/// Generates `n_new` tokens of `prompt` as `seq`, calling `at(k)` after the k-th new token;
/// checks tokens and logits against the single-device engine.
fn check(s: &Session, seq: u64, prompt: &[u32], n_new: usize, at: &mut dyn FnMut(usize)) {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let (want_ids, want_logits) = reference(&ckpt, prompt, &greedy(n_new));
    let mut rec = Rec {
        inner: s.pipeline().backend(),
        logits: vec![],
    };
    let mut k = 0;
    let out = generate(&mut rec, seq, prompt, &greedy(n_new), &mut |_| {
        k += 1;
        at(k);
        Flow::Continue
    })
    .unwrap_or_else(|e| panic!("sequence {seq}: {e}\n{:?}", s.adaptation()));
    assert_eq!(out.new_ids, want_ids, "sequence {seq}: tokens");
    assert_bits(&format!("sequence {seq}"), &rec.logits, &want_logits);
}

#[test]
fn evicting_a_sequence_with_lent_rows_releases_them_and_stays_bit_identical() {
    let (s, _w) = start("adapt-evict-lend");
    let (a, b) = (next_seq_id(), next_seq_id());
    let mut lent_before = 0;
    // A: 6 + 30 tokens; after its 15th (20 held, rows lent), B runs whole (6 + 30)
    check(&s, a, PROMPT_A, 30, &mut |k| {
        if k == 15 {
            let ad = s.adaptation().expect("adaptation on");
            lent_before = ad.devices[0].lent_tokens;
            check(&s, b, PROMPT_B, 30, &mut |_| {});
            s.pipeline().release(&[b]);
        }
    });
    s.pipeline().release(&[a]);
    let ad = s.adaptation().expect("adaptation on");
    eprintln!("events {:?}", ad.events);
    eprintln!("devices {:?}", ad.devices);
    assert!(
        lent_before > 0,
        "dev1 lent A's rows before B: {:?}",
        ad.devices
    );
    assert_eq!(ad.evictions, 1, "{ad:?}");
    let evicted: Vec<u32> = ad
        .events
        .iter()
        .filter_map(|e| match e {
            AdaptEvent::Evict { tokens, .. } => Some(*tokens),
            _ => None,
        })
        .collect();
    assert_eq!(evicted.len(), 1, "{:?}", ad.events);
    assert_eq!(ad.recomputed_tokens, evicted[0] as u64, "{ad:?}");
    let (d1, d2) = (&ad.devices[0], &ad.devices[1]);
    assert!(d1.fetches > 0 && d1.kv_moved_bytes > 0, "{d1:?}");
    // the borrower's reservation is what the lender's current lend needs (accounted on
    // both sides: dev2's budget less the reservation still holds every sequence's KV)
    assert!(d2.borrowed_bytes >= d1.lent_bytes, "{d2:?} {d1:?}");
    // a third request afterwards: lends again through the same reservation, identical
    let c = next_seq_id();
    check(&s, c, PROMPT_C, 30, &mut |_| {});
    s.pipeline().release(&[c]);
    let ad = s.adaptation().expect("adaptation on");
    assert_eq!(ad.evictions, 1, "{ad:?}");
    assert!(ad.devices[0].lent_tokens > 0, "{:?}", ad.devices);
    s.shutdown();
}
