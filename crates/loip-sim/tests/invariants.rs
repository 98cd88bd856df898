//! Acceptance checks of the simulator: agreement with the cost model, determinism, OOM,
//! monotonicity in bandwidth, and KV lending never hurting.

use loip_plan::{Cluster, ExecMode, Pattern, PlanRequest, StagePlan};
use loip_sim::bandwidth::{Bandwidth, BandwidthTrace};
use loip_sim::experiments::{experiments, run_experiments, ExperimentConfig};
use loip_sim::testkit::{random_cluster, random_request, steady_config};
use loip_sim::tp::{place_tp, simulate_tp, TpKind};
use loip_sim::{
    report, run_method, shape, simulate_pipeline, AdaptEvent, KvPolicy, Method, SimConfig, Status,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Simulates `loip`'s plan for `pattern` on random cluster `seed` in steady state at its
/// planned context; returns (simulated, predicted) ms/token and a description, or `None`
/// when nothing can be planned.
fn steady_state(seed: u64, pattern: Pattern) -> Option<(f64, f64, String)> {
    steady_state_of("loip", seed, pattern, false)
}

/// [`steady_state`] of `planner`'s plan; with `extra_loads`, 1–3 more blocks of every stage
/// are offloaded (seeded) and the plan is repriced, so that every device loads.
fn steady_state_of(
    planner: &str,
    seed: u64,
    pattern: Pattern,
    extra_loads: bool,
) -> Option<(f64, f64, String)> {
    let cluster = random_cluster(seed);
    let (name, ctx) = random_request(seed);
    let sh = shape(name).unwrap();
    let b = match pattern {
        Pattern::Sporadic => 1,
        Pattern::Bursty => cluster.devices.len() as u32,
    };
    let req = PlanRequest {
        context: ctx,
        pattern,
        ..Default::default()
    };
    let mut plan = loip_plan::plan(planner, &sh, &cluster, &req).ok()?;
    if planner == "pp-offload" {
        assert_eq!(plan.mode, ExecMode::Sequential);
    }
    if extra_loads {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for st in plan.devices.iter_mut().flat_map(|d| &mut d.stages) {
            let (n, a, m) = st.counts();
            let extra = rng.gen_range(1..=3u32);
            let more_a = rng.gen_range(0..=extra);
            *st =
                StagePlan::with_offload(st.layer_range().start, n, a + more_a, m + extra - more_a);
        }
        plan.reprice(&sh, &cluster).unwrap();
    }
    let steps = 12;
    let mut cfg = steady_config(&cluster, ctx, steps);
    cfg.pattern = pattern;
    cfg.sequences = b;
    // The KV held at the last step, b·(prompt + steps), is at most the planned context.
    cfg.prompt_tokens = ((ctx / b as u64) as u32).saturating_sub(steps).max(1);
    let r = simulate_pipeline(&plan, &sh, &cluster, &cfg).unwrap();
    assert_ne!(r.status, Status::Oom, "seed {seed}");
    assert!(
        r.events.is_empty(),
        "seed {seed} {pattern}: memory was planned for this context"
    );
    let sim = r.window_ms_per_token(4, steps as usize, b);
    let what = format!(
        "{planner} seed {seed} {pattern} ({name}, {} devices, s = {})",
        plan.devices.len(),
        plan.stages_per_device
    );
    Some((sim, plan.predicted_ms_per_token, what))
}

/// For sporadic steady state, the simulator agrees with the planner's cost model within 5%
/// on every `loip` plan of 200 random clusters (LM head and the return trip's
/// `ModelShape::return_bytes_per_token` included in both; in fact within 0.1%).
#[test]
fn sporadic_steady_state_agrees_with_cost_model() {
    let mut checked = 0;
    let mut worst: f64 = 0.0;
    for seed in 0..200u64 {
        let Some((sim, pred, what)) = steady_state(seed, Pattern::Sporadic) else {
            continue;
        };
        let diff = sim / pred - 1.0;
        assert!(
            diff.abs() <= 0.05,
            "{what}: simulated {sim:.2} ms/token, cost model {pred:.2}"
        );
        worst = worst.max(diff.abs());
        checked += 1;
    }
    assert!(
        checked >= 150,
        "only {checked} random clusters could be planned"
    );
    eprintln!(
        "sporadic: {checked} plans, largest difference {:.2}%",
        worst * 100.0
    );
}

/// Bursty steady state (`|D|` sequences in flight) on the same 200 random clusters: every
/// `loip` plan simulates within 10% of the cost model, and at least 95% of them within 5%.
/// The cost model lets a device's slot be busy for `(b−1)·C_i + off_i` per round; a device
/// that is not the bottleneck receives its micro-batches further apart than `C_i`, holds its
/// slot longer and can stall where the model says its load is hidden (up to 9% slower than
/// predicted on these clusters; see `loip_plan::cost`).
#[test]
fn bursty_steady_state_agrees_with_cost_model() {
    let mut checked = 0;
    let mut within_5 = 0;
    let (mut lo, mut hi): (f64, f64) = (0.0, 0.0);
    for seed in 0..200u64 {
        let Some((sim, pred, what)) = steady_state(seed, Pattern::Bursty) else {
            continue;
        };
        let diff = sim / pred - 1.0;
        assert!(
            diff.abs() <= 0.10,
            "{what}: simulated {sim:.2} ms/token, cost model {pred:.2}"
        );
        within_5 += usize::from(diff.abs() <= 0.05);
        lo = lo.min(diff);
        hi = hi.max(diff);
        checked += 1;
    }
    assert!(
        checked >= 150,
        "only {checked} random clusters could be planned"
    );
    assert!(
        within_5 * 100 >= 95 * checked,
        "only {within_5} of {checked} bursty plans within 5%"
    );
    eprintln!(
        "bursty: {checked} plans, {within_5} within 5%, simulated/predicted − 1 in [{:+.2}%, {:+.2}%]",
        lo * 100.0,
        hi * 100.0
    );
}

/// Conventional offloading (`pp-offload`, sequential mode): each micro-batch runs a stage on
/// its own and reads every offloaded block again, in the simulator as in the runtime and the
/// cost model's sequential rounds. On the same 200 random clusters, with `pp-offload`'s own
/// plans and with 1–3 more blocks offloaded per stage (loads on every device), the
/// simulator agrees within 1% in sporadic traffic. In bursty traffic it is never more than
/// 1% slower than predicted and at most 8% faster (95% within 5%): the cost model charges the
/// busiest device `b·(C_i + ld_i + e_i)`, its hops in turn with its compute, while the
/// simulator (like the runtime's worker) sends a micro-batch's activation while it computes
/// the next one. (When the simulator read each block once for all micro-batches it was
/// between 68% faster and 76% slower than predicted here.)
#[test]
fn pp_offload_steady_state_agrees_with_cost_model() {
    for pattern in [Pattern::Sporadic, Pattern::Bursty] {
        let (mut checked, mut within_5) = (0, 0);
        let (mut lo, mut hi): (f64, f64) = (0.0, 0.0);
        for seed in 0..200u64 {
            for extra_loads in [false, true] {
                let Some((sim, pred, what)) =
                    steady_state_of("pp-offload", seed, pattern, extra_loads)
                else {
                    continue;
                };
                let diff = sim / pred - 1.0;
                let ok = match pattern {
                    Pattern::Sporadic => diff.abs() <= 0.01,
                    Pattern::Bursty => (-0.08..=0.01).contains(&diff),
                };
                assert!(
                    ok,
                    "{what}, extra loads {extra_loads}: simulated {sim:.2} ms/token, cost model {pred:.2}"
                );
                within_5 += usize::from(diff.abs() <= 0.05);
                lo = lo.min(diff);
                hi = hi.max(diff);
                checked += 1;
            }
        }
        assert!(
            checked >= 300,
            "only {checked} pp-offload plans could be simulated"
        );
        assert!(
            within_5 * 100 >= 95 * checked,
            "only {within_5} of {checked} {pattern} pp-offload plans within 5%"
        );
        eprintln!(
            "pp-offload {pattern}: {checked} plans, {within_5} within 5%, simulated/predicted − 1 in [{:+.2}%, {:+.2}%]",
            lo * 100.0,
            hi * 100.0
        );
    }
}

fn small_config(cfg: &mut ExperimentConfig) {
    cfg.prompt_tokens = 256;
    cfg.output_tokens = 24;
}

/// The same seed gives the same output; another seed changes the dynamic traces.
#[test]
fn same_seed_same_output() {
    let mut cfg = ExperimentConfig::default();
    small_config(&mut cfg);
    let run = |cfg: &ExperimentConfig| {
        let r =
            run_experiments(experiments("dynamic-bandwidth").unwrap(), cfg, &|_, _| {}).unwrap();
        serde_json::to_string(&report::json_records(&r.records)).unwrap()
    };
    let a = run(&cfg);
    assert_eq!(a, run(&cfg));
    cfg.seed += 1;
    assert_ne!(a, run(&cfg));
}

/// A plan whose weights exceed a device's memory is OOM, and so is a method that cannot place
/// its weights.
#[test]
fn weights_over_budget_is_oom() {
    let sh = shape("llama3.3-70b").unwrap();
    let setup = experiments("end-to-end")
        .unwrap()
        .remove(0)
        .setups
        .remove(2);
    let mut cluster = setup.cluster().unwrap();
    let req = PlanRequest {
        context: 512,
        ..Default::default()
    };
    let plan = loip_plan::plan("loip", &sh, &cluster, &req).unwrap();
    let cfg = steady_config(&cluster, 512, 4);
    assert_eq!(
        simulate_pipeline(&plan, &sh, &cluster, &cfg)
            .unwrap()
            .status,
        Status::Ok
    );
    // Reserve all but 1 GB on the first device: its weights no longer fit.
    let d = cluster.device(&plan.devices[0].name).unwrap().clone();
    let idx = cluster.index_of(&d.name).unwrap();
    cluster.devices[idx].reserve = d.profile.mem_budget - (1 << 30);
    let r = simulate_pipeline(&plan, &sh, &cluster, &cfg).unwrap();
    assert_eq!(r.status, Status::Oom);
    assert!(r.note.unwrap().contains(&d.name));
    // Nothing fits 70B on one NX16: every method is OOM.
    let tiny = experiments("end-to-end")
        .unwrap()
        .remove(0)
        .setups
        .remove(0);
    let mut nx = tiny.cluster().unwrap();
    nx.devices.remove(0);
    let c = SimConfig::new(Pattern::Sporadic, 1, BandwidthTrace::constant(12.5e6), 2e-3);
    for m in [Method::Pp, Method::Edgeshard, Method::Galaxy] {
        assert_eq!(
            run_method(m, &sh, &nx, &c).unwrap().report.status,
            Status::Oom,
            "{m}"
        );
    }
}

/// For the same plan, more bandwidth is never slower (pipeline plans of every planner and
/// tensor-parallel placements, both patterns).
#[test]
fn more_bandwidth_is_never_slower() {
    let mbps = [25.0, 50.0, 100.0, 200.0, 400.0, 1000.0];
    let mut checked = 0;
    for seed in 0..30u64 {
        let cluster = random_cluster(1000 + seed);
        let (name, ctx) = random_request(1000 + seed);
        let sh = shape(name).unwrap();
        for pattern in [Pattern::Sporadic, Pattern::Bursty] {
            let b = if pattern == Pattern::Bursty {
                cluster.devices.len() as u32
            } else {
                1
            };
            for planner in ["loip", "loip-uniform", "pp", "pp-offload", "edgeshard"] {
                let req = PlanRequest {
                    context: ctx,
                    pattern,
                    ..Default::default()
                };
                let Ok(plan) = loip_plan::plan(planner, &sh, &cluster, &req) else {
                    continue;
                };
                let mut prev = f64::INFINITY;
                for &m in &mbps {
                    let mut cfg = SimConfig::new(
                        pattern,
                        b,
                        BandwidthTrace::constant(m * 1e6 / 8.0),
                        cluster.link.latency,
                    );
                    cfg.prompt_tokens = (ctx / b as u64).max(1) as u32;
                    cfg.output_tokens = 10;
                    cfg.kv_policy = KvPolicy::Recompute;
                    cfg.stop_when_oot = false;
                    let r = simulate_pipeline(&plan, &sh, &cluster, &cfg).unwrap();
                    assert!(
                        r.ms_per_token <= prev * (1.0 + 1e-9),
                        "seed {seed} {planner} {pattern}: {m} Mbit/s gives {:.3} ms/token, less bandwidth gave {prev:.3}",
                        r.ms_per_token
                    );
                    prev = r.ms_per_token;
                }
                checked += 1;
            }
            for kind in [TpKind::Galaxy, TpKind::TpiLlm] {
                let Ok(place) = place_tp(kind, &sh, &cluster, b, ctx, ctx, 2) else {
                    continue;
                };
                let mut prev = f64::INFINITY;
                for &m in &mbps {
                    let mut cfg = SimConfig::new(
                        pattern,
                        b,
                        BandwidthTrace::constant(m * 1e6 / 8.0),
                        cluster.link.latency,
                    );
                    cfg.prompt_tokens = (ctx / b as u64).max(1) as u32;
                    cfg.output_tokens = 6;
                    cfg.stop_when_oot = false;
                    let r = simulate_tp(&place, &sh, &cluster, &cfg).unwrap();
                    assert!(
                        r.ms_per_token <= prev * (1.0 + 1e-9),
                        "seed {seed} {kind:?} {pattern} at {m} Mbit/s"
                    );
                    prev = r.ms_per_token;
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 100, "{checked}");
}

/// Disabling KV lending never makes LOIP faster in memory-saturated runs (runs where the
/// KV cache reaches a threshold), and lending does happen in some of them.
#[test]
fn kv_lending_never_makes_loip_slower() {
    let mut saturated = 0;
    let mut lent = 0;
    let mut cases: Vec<(Cluster, &str, Pattern, f64)> = Vec::new();
    let setup = experiments("long-context")
        .unwrap()
        .remove(0)
        .setups
        .remove(0);
    for mbps in [50.0, 100.0, 200.0, 1000.0] {
        cases.push((
            setup.cluster().unwrap(),
            "llama3.3-70b",
            Pattern::Bursty,
            mbps,
        ));
    }
    for seed in 0..40u64 {
        let c = random_cluster(5000 + seed);
        let (name, _) = random_request(5000 + seed);
        let pattern = if seed % 2 == 0 {
            Pattern::Bursty
        } else {
            Pattern::Sporadic
        };
        let bw = c.link.bandwidth * 8.0 / 1e6;
        cases.push((c, name, pattern, bw));
    }
    for (cluster, name, pattern, mbps) in &cases {
        let sh = shape(name).unwrap();
        let b = if *pattern == Pattern::Bursty {
            cluster.devices.len() as u32
        } else {
            1
        };
        let mut cfg = SimConfig::new(
            *pattern,
            b,
            Bandwidth::Mbps(*mbps).trace(1, 0),
            cluster.link.latency,
        );
        cfg.prompt_tokens = 1024;
        cfg.output_tokens = if *pattern == Pattern::Bursty {
            1536
        } else {
            3072
        };
        cfg.stop_when_oot = false;
        let with = run_method(Method::Loip, &sh, cluster, &cfg).unwrap().report;
        let without = run_method(Method::LoipNoKvtransfer, &sh, cluster, &cfg)
            .unwrap()
            .report;
        if without.status == Status::Oom
            || !without
                .events
                .iter()
                .any(|e| matches!(e, AdaptEvent::Switch { .. }))
        {
            continue;
        }
        saturated += 1;
        for r in [&with, &without] {
            for d in &r.devices {
                assert!(
                    d.peak_memory <= d.budget,
                    "{}: peak {} over budget {}",
                    d.name,
                    d.peak_memory,
                    d.budget
                );
            }
        }
        if with
            .events
            .iter()
            .any(|e| matches!(e, AdaptEvent::Lend { .. }))
        {
            lent += 1;
        }
        assert!(
            with.ms_per_token <= without.ms_per_token * (1.0 + 1e-9),
            "{name} on {} devices, {pattern}, {mbps:.0} Mbit/s: with lending {:.9} ms/token, without {:.9}",
            cluster.devices.len(),
            with.ms_per_token,
            without.ms_per_token
        );
    }
    assert!(
        saturated >= 5 && lent >= 2,
        "saturated runs {saturated}, with lending {lent}"
    );
    eprintln!("{saturated} memory-saturated runs, {lent} with KV lending");
}
