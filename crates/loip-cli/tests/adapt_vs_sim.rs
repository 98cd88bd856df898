//! The runtime against the simulator: one `loip local --json` run whose KV crosses its
//! device's threshold (SmolLM2 on one worker of 96 MiB, about 61 MiB of it the engine's, 450
//! tokens), replayed in the simulator library with the same plan, the same device profile (a fixed one) and the same
//! request ([`loip_sim::replay`]): both take the same threshold switches (device, step, KV
//! tokens, blocks offloaded before and after). Speed is printed, not asserted
//! (`bench/runtime_vs_sim.sh` prints both ms/token).

mod common;
use common::*;

use loip_sim::replay::{switches, ReplayRun};
use loip_sim::{AdaptEvent, KvPolicy};

/// Budget and length of the run: one device holds all 30 layers' KV (46 KB a token); the
/// admission plan is placed with the runtime's own working memory
/// (`loip_plan::adapt::runtime_budgets`), so its thresholds come as the KV grows. `--mem` is
/// the worker process's whole budget: the engine's share is what the process leaves.
const ARGS: &[&str] = &[
    "--devices",
    "1",
    "--mem",
    "96MiB",
    "--prompt",
    "Tell me a very long story about a dragon",
    "--max-tokens",
    "450",
    "--min-tokens",
    "450",
];

/// The device's profile, fixed (`--profile`): measured, the plan followed the machine's load
/// (a profile taken while other work slowed the compute placed fewer layers, left the KV room
/// for all 450 tokens and crossed no threshold). Measured once by `loip local` itself.
const PROFILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/smollm2-device-profile.json"
);

/// About 45 s on a loaded 2-core machine.
#[test]
fn runtime_and_simulator_take_the_same_threshold_switches() {
    let out = loip()
        .args([
            "local",
            "--model",
            "smollm2",
            "--json",
            "--profile",
            PROFILE,
        ])
        .args(ARGS)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "loip local failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{')).unwrap();
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let run = ReplayRun::from_local_json(&v).unwrap_or_else(|e| panic!("{e}"));
    let events: Vec<AdaptEvent> =
        serde_json::from_value(v["adaptation"]["events"].clone()).unwrap();
    let runtime = switches(&events, false);
    // The runtime does not lend KV: compare with the policy without lending.
    let report = run
        .simulate(KvPolicy::Adaptive { lending: false })
        .unwrap_or_else(|e| panic!("{e}"));
    let simulated = switches(&report.events, true);
    eprintln!(
        "runtime {:.2} ms/token, simulator {:.2} ms/token\nruntime switches   {runtime:?}\n\
         simulator switches {simulated:?}",
        v["ms_per_token"].as_f64().unwrap_or(f64::NAN),
        report.ms_per_token
    );
    assert!(!runtime.is_empty(), "no threshold was crossed: {events:?}");
    assert_eq!(runtime, simulated, "threshold switches");
    // the first threshold of every device is the same in both
    for (i, d) in report.devices.iter().enumerate() {
        let rt = v["adaptation"]["devices"][i]["crossings"][0]["threshold"].as_u64();
        if let Some(rt) = rt {
            assert_eq!(d.first_threshold, Some(rt), "TS¹ of {}", d.name);
        }
    }
}
