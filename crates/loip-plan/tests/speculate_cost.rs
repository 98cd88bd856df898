//! The cost model prices a speculative step (issue 31, item 4): `k + 1` positions at the
//! profile's batch grid on each device, the expected tokens per step from the acceptance
//! rate, and the `k` that minimises ms/token.

mod common;

use common::llama13b;
use loip_plan::cost::{evaluate, evaluate_rows};
use loip_plan::planners::PlanRequest;
use loip_plan::profile::preset;
use loip_plan::speculate::{
    best_k, choose_k, evaluate_speculative, expected_tokens, step_parts, step_times,
    verify_step_times,
};
use loip_plan::{Cluster, LinkProfile, ModelShape, Pattern, Plan};

fn cluster(presets: &[&str], reserve: u64) -> Cluster {
    let devices = presets
        .iter()
        .enumerate()
        .map(|(i, p)| (format!("d{i}"), preset(p).unwrap()))
        .collect();
    let mut c = Cluster::new(
        devices,
        LinkProfile {
            bandwidth: 12.5e6,
            latency: 2e-3,
        },
    );
    for d in &mut c.devices {
        d.reserve = reserve;
    }
    c
}

fn loip_plan(shape: &ModelShape, c: &Cluster, pattern: Pattern) -> Plan {
    let req = PlanRequest {
        context: 1024,
        pattern,
        ..PlanRequest::default()
    };
    loip_plan::plan("loip", shape, c, &req).unwrap()
}

#[test]
fn one_position_is_the_plain_price_and_more_positions_never_cost_less() {
    let sh = llama13b();
    let c = cluster(&["orin32", "nx16"], 0);
    for pattern in [Pattern::Sporadic, Pattern::Bursty] {
        let p = loip_plan(&sh, &c, pattern);
        let plain = evaluate(&p, &sh, &c).unwrap();
        let k0 = evaluate_speculative(&p, &sh, &c, 1, 0, 0.9).unwrap();
        assert!((k0.cost.ms_per_token - plain.ms_per_token).abs() < 1e-9);
        assert_eq!(k0.expected_tokens, 1.0);
        let steps = step_times(&p, &sh, &c, 1, 8).unwrap();
        assert!((steps[0] * 1e3 - plain.ms_per_token).abs() < 1e-9);
        // (up to the rounding of ⌈n / (k + 1)⌉ cached tokens per row)
        for w in steps.windows(2) {
            assert!(w[1] >= w[0] * (1.0 - 1e-3), "{steps:?}");
        }
        // a step of k + 1 positions costs at most k + 1 steps of one
        for (k, s) in steps.iter().enumerate() {
            assert!(*s <= (k + 1) as f64 * steps[0] + 1e-12, "{steps:?}");
        }
        // the step writes k more KV rows per sequence before the rejected ones are dropped
        let four = evaluate_rows(&p, &sh, &c, 1, 5).unwrap();
        for (a, b) in four.devices.iter().zip(&plain.devices) {
            assert!(a.memory_bytes >= b.memory_bytes, "{a:?} {b:?}");
        }
    }
}

#[test]
fn an_offloaded_load_bound_plan_gains_nearly_the_expected_tokens() {
    // 13B (26 GB) on one Xavier NX (11.7 GB): most of every token is the SSD.
    let sh = llama13b();
    let c = cluster(&["nx16"], 0);
    let p = loip_plan(&sh, &c, Pattern::Sporadic);
    let plain = evaluate(&p, &sh, &c).unwrap();
    assert!(
        plain.breakdown.uncovered_load_ms > 0.5 * plain.ms_per_token,
        "{plain:?}"
    );
    let alpha = 0.7;
    let best = best_k(&p, &sh, &c, 1, alpha, 8).unwrap();
    assert!(best.k >= 4, "{best:?}");
    let gain = plain.ms_per_token / best.cost.ms_per_token;
    let e = expected_tokens(best.k, alpha);
    assert!(gain > 0.9 * e && gain <= e + 1e-9, "gain {gain} of {e}");
    // nothing accepted: speculation never pays
    assert_eq!(best_k(&p, &sh, &c, 1, 0.0, 8).unwrap().k, 0);
}

#[test]
fn the_choice_of_k_agrees_with_the_step_table() {
    let sh = llama13b();
    let c = cluster(&["orin64"], 0);
    let p = loip_plan(&sh, &c, Pattern::Sporadic);
    for alpha in [0.0, 0.3, 0.6, 0.9, 1.0] {
        let steps = step_times(&p, &sh, &c, 1, 8).unwrap();
        let best = best_k(&p, &sh, &c, 1, alpha, 8).unwrap();
        assert_eq!(best.k, choose_k(&steps, alpha), "α = {alpha}");
        for k in 0..=8u32 {
            let other = evaluate_speculative(&p, &sh, &c, 1, k, alpha).unwrap();
            assert!(best.cost.ms_per_token <= other.cost.ms_per_token + 1e-9);
        }
    }
}

#[test]
fn one_device_without_a_plan_has_a_step_table_too() {
    use loip_plan::speculate::device_step_times;
    use loip_plan::LoaderKind;
    let sh = llama13b();
    let nx = preset("nx16").unwrap();
    let mem = device_step_times(&nx, &sh, 512, 0, 0, LoaderKind::Direct, 8);
    let one =
        sh.layers as f64 * (nx.attn_time(&sh, 1, 512) + nx.mlp_time(&sh, 1)) + nx.head_time(&sh, 1);
    assert!((mem[0] - one).abs() < 1e-12);
    // reading half the weights every step: the same load added to every k
    let half = sh.total_bytes() / 2;
    let off = device_step_times(&nx, &sh, 512, half, 40, LoaderKind::Direct, 8);
    let load = off[0] - mem[0];
    assert!(load > mem[0], "load-bound: {off:?}");
    for (a, b) in off.iter().zip(&mem) {
        assert!((a - b - load).abs() < 1e-9);
    }
    // the load is amortised over E tokens, so the offloaded step drafts at least as many
    assert!(choose_k(&off, 0.5) >= choose_k(&mem, 0.5));
    assert!(choose_k(&off, 0.5) > 0);
}

/// A session prices its verify steps from the parts of its plan's evaluation
/// (`step_parts`, kept with it) instead of evaluating the plan at each size: the same table
/// as `step_times`, offloading or not, overlapped or sequential.
#[test]
fn a_step_priced_from_its_parts_is_the_evaluated_step() {
    let sh = llama13b();
    let mut worst: f64 = 0.0;
    // (devices, link, memory each keeps back: the 26 GB model offloads from 6 and 7 GiB)
    for (presets, bw, reserve) in [
        (&["orin32", "nx16"][..], 12.5e6, 0),
        (&["nx16", "nx16", "nx16"][..], 125e6, 0),
        (&["orin32"][..], 125e6, 0),
        (&["nx16", "nx16"][..], 125e6, 6u64 << 30),
        (&["nx16", "nx16", "nx16"][..], 12.5e6, 7 << 30),
        (&["orin32", "nx16", "nx16"][..], 125e6, 7 << 30),
    ] {
        let mut c = cluster(presets, reserve);
        c.link.bandwidth = bw;
        let req = PlanRequest {
            context: 1024,
            pattern: Pattern::Sporadic,
            ..PlanRequest::default()
        };
        for planner in ["loip", "pp-offload"] {
            let Ok(p) = loip_plan::plan(planner, &sh, &c, &req) else {
                continue;
            };
            let want = step_times(&p, &sh, &c, 1, 8).unwrap();
            let got = verify_step_times(&step_parts(&p, &sh, &c).unwrap(), 8);
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                worst = worst.max((g - w).abs() / w);
            }
            eprintln!(
                "{planner} {presets:?} {:?}: {got:?}\n  evaluated {want:?}",
                p.mode
            );
        }
    }
    eprintln!("largest relative difference {worst:.1e}");
    assert!(worst < 1e-3, "{worst}");
}
