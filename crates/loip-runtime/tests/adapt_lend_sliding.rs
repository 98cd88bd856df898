//! KV lending with sliding-window layers (tiny Gemma 3: window 4, five sliding layers and one
//! full one, stages mixing both): two workers, the first with room for a few tokens of KV
//! and refusing plan switches, lends the oldest rows each stage holds (a ring layer holds only its window) and
//! fetches them back; tokens and logits stay bit-identical to the single-device engine.

mod adapt_common;
mod dist_common;

use adapt_common::*;
use dist_common::*;
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::adapt::AdaptEvent;
use loip_runtime::cluster_run::{Session, SessionOptions};
use loip_runtime::coordinator::next_seq_id;

#[test]
fn lending_ring_layers_keeps_tokens_and_logits_bit_identical() {
    const PROMPT: &[u32] = &[1, 5, 9, 23, 42, 7, 11, 3, 17];
    let path = fixture("tiny-gemma3");
    let slices = slices_of(&path, "tiny-gemma3");
    let m = Manifest::load(&slices).unwrap();
    let (names, plan, kv_per_token) = two_device_plan(&m);
    let held = [30, 4000];
    let root = scratch("adapt-lend-sliding");
    // the first refuses plan switches, so its shortage is met by lending
    let addrs: Vec<String> = (0..2)
        .map(|i| {
            let mem = full_fixed(&m, &plan, i) + held[i] * kv_per_token;
            in_process_worker(&names[i], mem, root.join(&names[i]), [1000, 0][i])
        })
        .collect();
    let opts = SessionOptions {
        lending: true,
        ..session_options(plan, PROMPT.len())
    };
    let s = Session::start(&slices, worker_specs(&names, &addrs), opts)
        .unwrap_or_else(|e| panic!("session: {e}"));
    let ckpt = Checkpoint::open(&path).unwrap();
    let seq = next_seq_id();
    let (want_ids, want_logits) = reference(&ckpt, PROMPT, &greedy(80));
    let (ids, logits) = recorded(s.pipeline().backend(), seq, PROMPT, &greedy(80))
        .unwrap_or_else(|e| panic!("generation: {e}"));
    assert_eq!(ids, want_ids, "tokens");
    assert_bits("lending with ring layers", &logits, &want_logits);
    s.pipeline().release(&[seq]);
    let ad = s.adaptation().expect("adaptation on");
    eprintln!("events {:?}\ndevices {:?}", ad.events, ad.devices);
    let lent = ad
        .events
        .iter()
        .any(|e| matches!(e, AdaptEvent::Lend { tokens, .. } if *tokens > 0));
    assert!(lent && ad.devices[0].fetches > 0, "{:?}", ad.events);
    s.shutdown();
}
