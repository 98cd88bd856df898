//! Bursty sequences go through the pipeline as waves (`coordinator/wave.rs`): with `b`
//! sequences in flight, each device reads each stage's offloaded blocks once per round for
//! all of them, as the cost model assumes — not once per sequence. Tiny Llama on 2 worker
//! processes × 2 stages, every block offloaded, 3 concurrent greedy sequences, direct and
//! relayed hops: the tokens are the single-device engine's, and the bytes the decode steps
//! read, over the rounds, are about one read of every offloaded block per round.
//!
//! Keeping blocks is a loader hint only (timing decides whether a late sequence catches its
//! wave), so the check is a bound halfway between one read a round and one a sequence:
//! without waves the last sequence of each round trails and reloads every stage, well above it.

mod dist_common;

use std::time::Duration;

use dist_common::*;
use loip_model::slice::{Manifest, SliceKind};
use loip_model::Checkpoint;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{uniform_plan, Session, SessionOptions};

#[test]
fn dist_worker_entry() {
    worker_entry();
}

const PROMPTS: [&[u32]; 3] = [&[1, 5, 9, 23, 42, 7], &[1, 77, 3], &[1, 200, 100, 50, 25]];
const NEW: usize = 16; // tokens per sequence

/// `bound`: most reads of each offloaded block per round (one is the design's; three would
/// be once per sequence).
fn run(relay: bool, bound: f64) {
    let ckpt_dir = fixture("tiny-llama");
    let ckpt = Checkpoint::open(&ckpt_dir).unwrap();
    let slices = slices_of(&ckpt_dir, "tiny-llama");
    let m = Manifest::load(&slices).unwrap();
    let root = scratch(if relay { "relay" } else { "direct" });
    let workers = spawn_workers(&root, 2, 64 << 20, None);
    let names = vec!["dev1".to_string(), "dev2".to_string()];
    let plan = uniform_plan(
        "m",
        m.config.num_layers as u32,
        &names,
        2,
        ExecMode::Overlapped,
        &|_, n| (n, n),
    )
    .unwrap();
    // one read of every offloaded block: what a round should cost  // bytes
    let per_round: u64 = plan
        .devices
        .iter()
        .flat_map(|d| &d.stages)
        .flat_map(|s| &s.layers)
        .map(|l| {
            let size = |k| m.slice(k).map_or(0, |s| s.size);
            size(SliceKind::Attn(l.layer as usize)) + size(SliceKind::Mlp(l.layer as usize))
        })
        .sum();
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let specs = dist_common::netns::worker_specs(&addrs);
    let opts = SessionOptions {
        plan: Some(plan),
        measure_links: false,
        shape_name: "m".into(),
        context: 128,
        max_step_tokens: 16,
        relay,
        step_timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let s = Session::start(&slices, specs, opts).unwrap_or_else(|e| panic!("session: {e}"));
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| p.to_vec()).collect();
    let _ = s.take_totals();
    let outs = s.generate_many(&prompts, &greedy(NEW));
    for (i, (o, p)) in outs.into_iter().zip(PROMPTS).enumerate() {
        let o = o.unwrap_or_else(|e| panic!("sequence {i}: {e}"));
        let (want, _) = reference(&ckpt, p, &greedy(NEW));
        assert_eq!(o.new_ids, want, "relay {relay}: sequence {i} tokens");
    }
    let t = s.take_totals();
    let rounds = t.decode_steps as f64 / PROMPTS.len() as f64;
    let loads = t.decode.loaded_bytes as f64 / (rounds * per_round as f64);
    eprintln!(
        "relay {relay}: {} decode steps, {} bytes read, {per_round} bytes a round: {loads:.2} reads of each block per round",
        t.decode_steps, t.decode.loaded_bytes
    );
    assert!(
        loads <= bound,
        "relay {relay}: {loads:.2} reads of each offloaded block per round (at most {bound})"
    );
    s.shutdown();
}

#[test]
fn a_wave_reads_each_stage_once_per_round_direct() {
    // measured 1.00 on a quiet machine, 1.27 once on a loaded CI runner (a late sequence
    // missed its wave); 1.50 before headers sent ahead counted the same wave's later steps,
    // 3 would be once per sequence
    run(false, 2.0);
}

#[test]
fn a_wave_reads_each_stage_once_per_round_relayed() {
    // measured 1.00 (see the direct case for the bound)
    run(true, 2.0);
}
