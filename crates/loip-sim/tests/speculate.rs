//! A plan served with speculative decoding on the virtual clock (issue 31, item 4): the
//! runtime's scheduler verifies the drafts, the acceptance draws are seeded, and the decode
//! time per token follows the cost model's `S(k) / E(k, α)`.

use loip_plan::planners::PlanRequest;
use loip_plan::sched::Limits;
use loip_plan::Pattern;
use loip_sim::serving::{simulate_serving_speculative, SpecRequest, Speculation, TraceRequest};
use loip_sim::shape;
use loip_sim::speculate::{replay_speculative, step_table};
use loip_sim::testkit::preset_cluster;

fn trace(n: usize) -> Vec<TraceRequest> {
    (0..n)
        .map(|_| TraceRequest {
            arrival: 0.0,
            prompt_len: 64,
            output_len: 96,
        })
        .collect()
}

fn spec(n: usize, k: usize, acceptance: f64) -> Speculation {
    Speculation {
        per_request: vec![SpecRequest { k, acceptance }; n],
        seed: 7,
    }
}

#[test]
fn every_request_produces_its_output_and_acceptance_follows_the_rate() {
    let tr = trace(3);
    let limits = Limits::one_device(u64::MAX, 1);
    let cost = |s: &loip_plan::sched::Step| 0.01 + 1e-4 * s.tokens() as f64;
    for alpha in [0.0, 0.5, 0.9, 1.0] {
        let run =
            simulate_serving_speculative(limits.clone(), &tr, Some(&spec(3, 4, alpha)), &cost)
                .unwrap();
        let kept: usize = run.steps.iter().map(|s| s.kept).sum();
        assert_eq!(kept, 3 * 96, "α = {alpha}");
        assert!(run.finished.iter().all(Option::is_some));
        let rate = run.accepted as f64 / run.drafted.max(1) as f64;
        match alpha {
            0.0 => assert_eq!(run.accepted, 0),
            1.0 => assert_eq!(run.accepted, run.drafted),
            _ => assert!(rate > 0.0 && rate < 1.0, "{rate}"),
        }
        // the same seed gives the same run
        let again =
            simulate_serving_speculative(limits.clone(), &tr, Some(&spec(3, 4, alpha)), &cost)
                .unwrap();
        assert_eq!(run, again);
    }
    // all accepted: 96 tokens in ⌈95 / 5⌉ + 1 decode steps per sequence at most
    let all =
        simulate_serving_speculative(limits.clone(), &tr, Some(&spec(3, 4, 1.0)), &cost).unwrap();
    let none = simulate_serving_speculative(limits, &tr, None, &cost).unwrap();
    assert!(
        all.steps.len() * 4 < none.steps.len() * 2,
        "{} vs {}",
        all.steps.len(),
        none.steps.len()
    );
}

#[test]
fn a_load_bound_plan_served_with_speculation_matches_the_cost_model() {
    // 13B (26 GB) on one Xavier NX (11.7 GB): every step streams most of the weights.
    let sh = shape("llama2-13b").unwrap();
    let c = preset_cluster(&["nx16"]);
    let req = PlanRequest {
        context: 160,
        pattern: Pattern::Sporadic,
        ..PlanRequest::default()
    };
    let plan = loip_plan::plan("loip", &sh, &c, &req).unwrap();
    let table = step_table(&plan, &sh, &c, 16).unwrap();
    assert!(table[4] < 1.2 * table[0], "load-bound: {table:?}");
    let limits = Limits::one_device(u64::MAX, 1);
    let tr = trace(1);
    let r = replay_speculative(&plan, &sh, &c, &limits, &tr, &spec(1, 4, 0.8)).unwrap();
    assert!(r.spec_ms_per_token < 0.5 * r.plain_ms_per_token, "{r:?}");
    // the replay's gain within 15 % of the closed form's (finite run: the last steps'
    // drafts are capped at the last wanted token, and the draws are a sample)
    let sim = r.plain_ms_per_token / r.spec_ms_per_token;
    let model = r.predicted_plain_ms_per_token / r.predicted_spec_ms_per_token;
    assert!(
        (sim / model - 1.0).abs() < 0.15,
        "replay {sim:.2}× vs model {model:.2}×: {r:?}"
    );
    // nothing accepted: no faster, and the verify steps cost little more than plain ones
    let z = replay_speculative(&plan, &sh, &c, &limits, &tr, &spec(1, 4, 0.0)).unwrap();
    assert_eq!(z.accepted, 0);
    assert!(z.spec_ms_per_token >= z.plain_ms_per_token - 1e-9, "{z:?}");
    assert!(z.spec_ms_per_token < 1.2 * z.plain_ms_per_token, "{z:?}");
}
