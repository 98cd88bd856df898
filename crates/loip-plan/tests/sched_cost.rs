//! The cost model for micro-batches of several sequences (`cost::evaluate_batched`): one
//! sequence per micro-batch is `evaluate` exactly; block times come from the profile's grid
//! over b; with times flat in b the price is `evaluate` on q-fold transfers divided by q;
//! the planner's choice of micro-batches in flight and sequences per micro-batch
//! (`planners::batching`).

use loip_plan::cost::{block_times_batched, evaluate, evaluate_batched};
use loip_plan::planners::batching::{batching, batchings, choose_batching};
use loip_plan::planners::PlanRequest;
use loip_plan::profile::{preset, LoaderProfile};
use loip_plan::{
    plan, planner_names, Cluster, DeviceProfile, LinkProfile, LoaderKind, ModelShape, Pattern,
};

fn shape() -> ModelShape {
    ModelShape::from_dims("t1b", 2048, 8192, 16, 32, 8, 64, 32000, true, 2.0, 2)
}

/// `nd` devices at `share` of the model's bytes each; block times at b = 1, 4, 8 are
/// `(1, grow, grow²)` times the b = 1 time (flat in the context).
fn cluster(nd: usize, share: f64, grow: f64) -> Cluster {
    let sh = shape();
    let loader = LoaderProfile {
        bandwidth: 1.5e9,
        per_read_overhead: 1e-4,
    };
    let bs = [(1u32, 1.0), (4, grow), (8, grow * grow)];
    let profile = |i: usize| {
        let f = 1.0 + 0.3 * i as f64;
        let attn = bs
            .iter()
            .flat_map(|&(b, g)| [(b, 1, 1e-3 * f * g), (b, 1 << 16, 1e-3 * f * g)])
            .collect();
        let mlp = bs.iter().map(|&(b, g)| (b, 2e-3 * f * g)).collect();
        let budget = (sh.total_bytes() as f64 * share) as u64;
        DeviceProfile::from_measurements("hw", budget, &sh, attn, mlp, loader, loader).unwrap()
    };
    let devices = (0..nd).map(|i| (format!("d{i}"), profile(i))).collect();
    Cluster::new(devices, LINK)
}

const LINK: LinkProfile = LinkProfile {
    bandwidth: 12.5e6, // bytes/s
    latency: 2e-3,     // seconds
};

/// Calls `f(planner, plan, cluster, pattern)` for every plan the planners make for 1 and 3
/// devices (budgets from ample to tight) and every pattern and loader; returns how many.
fn for_each_plan(grow: f64, mut f: impl FnMut(&str, &loip_plan::Plan, &Cluster, Pattern)) -> usize {
    let sh = shape();
    let mut priced = 0;
    for (nd, share) in [(1, 1.5), (3, 0.6), (3, 0.25)] {
        let cl = cluster(nd, share, grow);
        for req in requests() {
            for name in planner_names() {
                if let Ok(p) = plan(name, &sh, &cl, &req) {
                    f(name, &p, &cl, req.pattern);
                    priced += 1;
                }
            }
        }
    }
    priced
}

fn requests() -> Vec<PlanRequest> {
    let mut out = Vec::new();
    for pattern in [Pattern::Sporadic, Pattern::Bursty] {
        for loader in [LoaderKind::Direct, LoaderKind::Conventional] {
            out.push(PlanRequest {
                context: 2048,
                pattern,
                micro_batches: None,
                loader,
                allow_drop: false,
            });
        }
    }
    out
}

#[test]
fn one_sequence_per_micro_batch_is_evaluate_exactly() {
    let sh = shape();
    let priced = for_each_plan(1.2, |name, p, cl, _| {
        let a = evaluate(p, &sh, cl).unwrap();
        assert_eq!(a, evaluate_batched(p, &sh, cl, 1).unwrap(), "{name}");
    });
    assert!(priced >= 40, "only {priced} plans");
}

#[test]
fn block_times_come_from_the_grid_over_b() {
    let sh = shape();
    let cl = cluster(1, 1.5, 1.25);
    let d = &cl.devices[0];
    for (q, g) in [(1, 1.0), (4, 1.25), (8, 1.5625)] {
        let t = block_times_batched(d, &sh, 2048, 1, q, LoaderKind::Direct);
        assert!((t.attn - 1e-3 * g).abs() < 1e-12, "q={q}: {}", t.attn);
        assert!((t.mlp - 2e-3 * g).abs() < 1e-12, "q={q}: {}", t.mlp);
    }
    // One device, one stage, nothing offloaded: the round is L·(t^A + t^P) + t^H at b = q,
    // and it yields q tokens.
    let req = PlanRequest {
        context: 2048,
        ..Default::default()
    };
    let p = plan("loip", &sh, &cl, &req).unwrap();
    let t4 = block_times_batched(d, &sh, 2048, 1, 4, LoaderKind::Direct);
    let want = (16.0 * (t4.attn + t4.mlp) + t4.head) / 4.0 * 1e3;
    let got = evaluate_batched(&p, &sh, &cl, 4).unwrap().ms_per_token;
    assert!((got - want).abs() < 1e-9 * want, "{got} vs {want}");
}

#[test]
fn with_times_flat_in_b_the_price_is_q_fold_transfers_over_q() {
    let sh = shape();
    let q = 3u32;
    let mut shq = sh.clone();
    shq.act_bytes_per_token *= q as u64;
    shq.return_bytes = Some(sh.return_bytes_per_token() * q as u64);
    let priced = for_each_plan(1.0, |name, p, cl, pattern| {
        let want = evaluate(p, &shq, cl).unwrap().ms_per_token / q as f64;
        let got = evaluate_batched(p, &sh, cl, q).unwrap().ms_per_token;
        assert!(
            (got - want).abs() <= 1e-9 * want,
            "{name} {pattern:?}: {got} vs {want}"
        );
        assert!(got < evaluate(p, &sh, cl).unwrap().ms_per_token);
    });
    assert!(priced >= 40, "only {priced} plans");
}

#[test]
fn a_memory_bound_roofline_device_gains_nearly_q_fold() {
    let sh = shape();
    let prof = preset("orin64").unwrap();
    let cl = Cluster::new(vec![("orin".into(), prof)], LINK);
    let p = plan("loip", &sh, &cl, &PlanRequest::default()).unwrap();
    let one = evaluate_batched(&p, &sh, &cl, 1).unwrap().ms_per_token;
    let eight = evaluate_batched(&p, &sh, &cl, 8).unwrap().ms_per_token;
    assert!(eight < one / 6.0, "{one} ms/token at q=1, {eight} at q=8");
}

#[test]
fn the_planner_batches_memory_bound_sequences_and_not_compute_bound_ones() {
    let sh = shape();
    let req = PlanRequest {
        context: 6 * 256,
        allow_drop: false,
        ..Default::default()
    };
    // Block times flat in b (memory-bound): one micro-batch per device in flight is
    // slower than fewer, fuller micro-batches.
    for nd in [1, 3] {
        let cl = cluster(nd, if nd == 1 { 1.5 } else { 0.6 }, 1.0);
        let best = choose_batching("loip", &sh, &cl, &req, 6).unwrap();
        assert!(best.seqs_per_micro_batch > 1, "{nd} devices: {best:?}");
        let all = batchings("loip", &sh, &cl, &req, 6);
        assert_eq!(
            all.iter().map(|(q, _)| *q).collect::<Vec<_>>(),
            vec![1, 2, 3, 6]
        );
        for (q, r) in &all {
            let r = r.as_ref().unwrap();
            assert!(best.ms_per_token <= r.ms_per_token, "q={q}");
            assert_eq!(r.micro_batches, 6u32.div_ceil(*q));
        }
    }
    // Times that grow faster than b (compute-bound, 1, 5, 25 at b = 1, 4, 8): one
    // sequence per micro-batch.
    let cl = cluster(1, 1.5, 5.0);
    let best = choose_batching("loip", &sh, &cl, &req, 6).unwrap();
    assert_eq!(best.seqs_per_micro_batch, 1, "{best:?}");
}

#[test]
fn a_short_last_micro_batch_is_priced_per_generated_token() {
    let sh = shape();
    let cl = cluster(3, 0.6, 1.2);
    let req = PlanRequest {
        context: 2048,
        allow_drop: false,
        ..Default::default()
    };
    // 5 sequences in micro-batches of 2: 3 in flight, the last one short; a round
    // yields 5 tokens for the price of 6.
    let bt = batching("loip", &sh, &cl, &req, 5, 2).unwrap();
    assert_eq!((bt.micro_batches, bt.seqs_per_micro_batch), (3, 2));
    assert_eq!(bt.plan.micro_batches, 3);
    let full = evaluate_batched(&bt.plan, &sh, &cl, 2).unwrap().ms_per_token;
    assert!((bt.ms_per_token - full * 6.0 / 5.0).abs() < 1e-9 * full);
    assert!((bt.tokens_per_s() - 1e3 / bt.ms_per_token).abs() < 1e-9);
    // One sequence: sporadic, q = 1, the plain plan's price.
    let one = choose_batching("loip", &sh, &cl, &req, 1).unwrap();
    let p = plan("loip", &sh, &cl, &req).unwrap();
    assert_eq!(one.plan, p);
    assert!((one.ms_per_token - evaluate(&p, &sh, &cl).unwrap().ms_per_token).abs() < 1e-12);
}

#[test]
fn a_batching_that_does_not_fit_is_refused() {
    let sh = shape();
    let cl = cluster(1, 0.3, 1.0);
    let req = PlanRequest {
        context: 1 << 20,
        allow_drop: false,
        ..Default::default()
    };
    assert!(batching("loip", &sh, &cl, &req, 4, 4).is_err());
    assert!(choose_batching("loip", &sh, &cl, &req, 4).is_err());
}
