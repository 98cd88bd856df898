//! Online memory adaptation in the running cluster (design §6): two worker processes whose
//! budgets hold the tiny model with every block resident but only a few tokens of KV; a
//! generation outgrows that mid-run, the coordinator switches each device's plan (blocks
//! offloaded per stage), the workers apply it between steps, and tokens and logits stay
//! bit-identical to the single-device engine (an attention switch, then an MLP one that
//! brings the attention block back). Also: a switch that would exceed the budget
//! is refused and changes nothing; a switch that changes the layers is refused.

mod adapt_common;
mod dist_common;

use adapt_common::*;
use dist_common::*;
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::adapt::AdaptEvent;
use loip_runtime::cluster_run::{device_spec, Session};
use loip_runtime::coordinator::next_seq_id;
use loip_runtime::executor::{BlockPlacement, Device};
use loip_runtime::LoaderKind;

#[test]
fn dist_worker_entry() {
    worker_entry();
}

const PROMPT: &[u32] = &[1, 5, 9, 23, 42, 7];

/// How the workers of [`run_switches`] run.
enum Workers {
    /// worker processes
    Processes,
    /// in this process, each refusing its first this many plan switches
    Refusing([u32; 2]),
}

/// Two devices of two one-layer stages each, every block resident, room for 12 tokens of
/// KV: a 150-token generation crosses thresholds on both. Checks tokens and logits against
/// the single-device engine; returns the adaptation report and the KV bytes per token.
/// The run's adaptation report, the KV bytes a token, and the pipeline's step totals (the
/// switches' parks among them).
fn run_switches(
    workers: Workers,
    tag: &str,
) -> (
    loip_runtime::adapt::AdaptReport,
    u64,
    loip_runtime::coordinator::Totals,
) {
    let path = fixture("tiny-llama");
    let ckpt = Checkpoint::open(&path).unwrap();
    let slices = slices_of(&path, "tiny-llama");
    let m = Manifest::load(&slices).unwrap();
    let (names, plan, kv_per_token) = two_device_plan(&m);
    // Room for 12 tokens of KV with everything resident: the prompt fits, the generation
    // passes the threshold after a few tokens.
    let held = 12;
    let root = scratch(tag);
    let mem = |i: usize| full_fixed(&m, &plan, i) + held * kv_per_token;
    let mut procs = Vec::new();
    let addrs: Vec<String> = match workers {
        Workers::Processes => (0..2)
            .map(|i| {
                let w = spawn_worker(&W {
                    name: names[i].clone(),
                    mem: mem(i),
                    store: root.join(&names[i]),
                    ..Default::default()
                });
                let a = w.addr.clone();
                procs.push(w);
                a
            })
            .collect(),
        Workers::Refusing(r) => (0..2)
            .map(|i| in_process_worker(&names[i], mem(i), root.join(&names[i]), r[i]))
            .collect(),
    };
    let specs = worker_specs(&names, &addrs);
    let opts = session_options(plan, PROMPT.len());
    let s = Session::start(&slices, specs, opts).unwrap_or_else(|e| panic!("session: {e}"));
    // 12 tokens fit with every block resident, ~124 with one attention block offloaded per
    // stage: the run crosses two thresholds (an attention switch, then an MLP one)
    let n_new = N_NEW;
    let (want_ids, want_logits) = reference(&ckpt, PROMPT, &greedy(n_new));
    let seq = next_seq_id();
    let (ids, logits) = recorded(s.pipeline().backend(), seq, PROMPT, &greedy(n_new))
        .unwrap_or_else(|e| panic!("generation: {e}"));
    s.pipeline().release(&[seq]);
    assert_eq!(ids, want_ids, "tokens");
    assert_bits("through the switches", &logits, &want_logits);
    let ad = s.adaptation().expect("adaptation on");
    eprintln!("adaptation: {:?}", ad.events);
    let totals = s.pipeline().take_totals();
    s.shutdown();
    drop(procs);
    (ad, kv_per_token, totals)
}

const N_NEW: usize = 150;

#[test]
fn switches_mid_run_keep_tokens_and_logits_bit_identical() {
    let held = 12;
    let (ad, kv_per_token, totals) = run_switches(Workers::Processes, "adapt-switch");
    let n_new = N_NEW;
    let switched: Vec<usize> = ad
        .events
        .iter()
        .filter_map(|e| match e {
            AdaptEvent::Switch {
                device,
                from,
                to,
                tokens,
                ..
            } => {
                assert_ne!(from, to);
                assert!(
                    *tokens > held,
                    "switched at {tokens} tokens, before the threshold"
                );
                Some(*device)
            }
            _ => None,
        })
        .collect();
    assert!(switched.contains(&0) && switched.contains(&1), "{ad:?}");
    let tos: Vec<(u32, u32)> = ad
        .events
        .iter()
        .filter_map(|e| match e {
            AdaptEvent::Switch { to, .. } => Some(*to),
            _ => None,
        })
        .collect();
    assert!(tos.iter().any(|t| t.0 > 0), "an attention switch: {tos:?}");
    assert!(tos.iter().any(|t| t.1 > 0), "an MLP switch: {tos:?}");
    // each step that waited for switches was timed once, however many devices it switched
    assert!(
        (1..=tos.len() as u64).contains(&totals.switch_parks) && totals.switch_s > 0.0,
        "{totals:?}"
    );
    for d in &ad.devices {
        assert!(d.switches_applied >= 1, "{d:?}");
        assert!(!d.crossings.is_empty(), "{d:?}");
        assert!(d.offloaded != (0, 0), "{d:?}");
        assert!(d.kv_peak_bytes <= d.kv_budget, "{d:?}");
        // The workers' own accounting: what is left for KV after the switch holds the run.
        assert!(
            d.kv_peak_bytes >= (PROMPT.len() + n_new - 1) as u64 * kv_per_token,
            "{d:?}"
        );
    }
    assert_eq!(ad.held_admissions, 0);
}

#[test]
fn a_refused_switch_is_not_assumed_applied() {
    // dev1 refuses its first switch: the coordinator waits for the answer, keeps dev1's
    // layout, takes the next cheapest switch; the run completes bit-identical
    let (ad, _, _) = run_switches(Workers::Refusing([1, 0]), "adapt-refuse");
    let d = &ad.devices;
    assert_eq!(d[0].switches_refused, 1, "{d:?}");
    assert_eq!(d[1].switches_refused, 0, "{d:?}");
    assert!(d[0].switches_applied >= 1, "{d:?}");
    assert!(d[0].kv_peak_bytes <= d[0].kv_budget, "{d:?}");
    let firsts: Vec<(u32, u32)> = ad
        .events
        .iter()
        .filter_map(|e| match e {
            AdaptEvent::Switch { device: 0, to, .. } => Some(*to),
            _ => None,
        })
        .collect();
    assert!(
        firsts.len() >= 2,
        "a switch after the refused one: {firsts:?}"
    );
    assert_ne!(
        firsts[0], firsts[1],
        "the refused layout is not asked again: {firsts:?}"
    );
}

#[test]
fn a_switch_over_budget_or_changing_layers_is_refused() {
    let path = fixture("tiny-llama");
    let slices = slices_of(&path, "tiny-llama");
    let m = Manifest::load(&slices).unwrap();
    let names: Vec<String> = vec!["dev1".into()];
    // everything offloaded: bringing blocks back needs more memory than the budget leaves
    let plan = offloaded_plan(&m, &names);
    let spec = device_spec(&plan, 0, LoaderKind::Direct, MAX_STEP, CONTEXT, None);
    let mut probe = Device::open(&slices, &m, spec.clone()).unwrap();
    let mem = probe.memory();
    // Unlimited: bringing every block back works and accounts the new resident set.
    let mut resident = spec.stages.clone();
    for s in &mut resident {
        for l in &mut s.layers {
            l.attn = BlockPlacement::Resident;
            l.mlp = BlockPlacement::Resident;
        }
    }
    let after = probe.switch(resident.clone()).unwrap();
    assert!(
        after.resident > mem.resident && after.slot == 0,
        "{after:?}"
    );
    drop(probe);
    // A budget that holds the offloaded layout only.
    let budget = mem.resident + mem.slot + mem.working + 1024;
    let mut spec_b = spec.clone();
    spec_b.mem_budget = Some(budget);
    let mut dev = Device::open(&slices, &m, spec_b).unwrap();
    let before = dev.memory();
    let err = dev.switch(resident).expect_err("over budget").to_string();
    assert!(err.contains("budget"), "{err}");
    assert_eq!(dev.memory(), before, "a refused switch changes nothing");
    // Different layers: refused.
    let mut other = spec.stages.clone();
    other.swap(0, 1);
    assert!(dev.switch(other).is_err());
    assert_eq!(dev.memory(), before);
}

/// A switch keeps the blocks that stay resident as they are in memory: it reads only those
/// that become resident. Damaging a kept block's file after the device opened does not fail
/// the switch (it is not read again), and the switched device computes what a device opened
/// with the new placement computes.
#[test]
fn a_switch_keeps_resident_blocks_without_reading_them_again() {
    let path = fixture("tiny-llama");
    let pristine = slices_of(&path, "tiny-llama");
    let m = Manifest::load(&pristine).unwrap();
    let dir = scratch("switch-keeps-resident");
    for e in std::fs::read_dir(&pristine).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    let names: Vec<String> = vec!["dev1".into()];
    let plan = offloaded_plan(&m, &names);
    let spec = device_spec(&plan, 0, LoaderKind::Direct, MAX_STEP, CONTEXT, None);
    let mut resident = spec.stages.clone();
    for s in &mut resident {
        for l in &mut s.layers {
            l.attn = BlockPlacement::Resident;
            l.mlp = BlockPlacement::Resident;
        }
    }
    let all_resident = loip_runtime::executor::DeviceSpec {
        stages: resident.clone(),
        ..spec.clone()
    };
    let mut dev = Device::open(&dir, &m, all_resident).unwrap();
    // offload layer 0's MLP; every other block stays resident
    let mut switched = resident;
    switched[0].layers[0].mlp = BlockPlacement::Offloaded;
    let kept = m
        .slices
        .iter()
        .find(|s| s.kind == loip_model::slice::SliceKind::Attn(0))
        .unwrap();
    std::fs::write(dir.join(&kept.file), b"damaged").unwrap();
    let after = dev
        .switch(switched.clone())
        .expect("kept blocks are not read again");
    assert!(after.slot > 0, "{after:?}");
    let fresh_spec = loip_runtime::executor::DeviceSpec {
        stages: switched,
        ..spec
    };
    let mut fresh = Device::open(&pristine, &m, fresh_spec).unwrap();
    let hidden = m.config.hidden_size;
    let batch = [loip_engine::TokenPos { seq: 0, pos: 0 }];
    let x0: Vec<f32> = (0..hidden).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
    let (mut a, mut b) = (x0.clone(), x0);
    dev.run_stage(0, &mut a, &batch).unwrap();
    fresh.run_stage(0, &mut b, &batch).unwrap();
    assert_eq!(
        a, b,
        "bit-identical to a device opened with the new placement"
    );
}
