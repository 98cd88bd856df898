//! The re-priced prediction of a run (`calibrate::reprice`): the cost model fed the rates a
//! run's first decode steps measured, over the placements those steps ran, prices the
//! remaining steps; and the warm-up's loads fitted per group and averaged.

mod common;

use common::llama70b;
use loip_plan::adapt::switch::stage_layout;
use loip_plan::adapt::{evaluate_switched, AdaptEvent};
use loip_plan::calibrate::{self, trimmed_mean, WarmupStep};
use loip_plan::planners::PlanRequest;
use loip_plan::{Cluster, ModelShape, Pattern, Plan};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1e-12)
}

/// A plan and a switch at step 4 that streams every block of its last device.
fn plan_and_switch() -> (ModelShape, Cluster, Plan, Vec<AdaptEvent>) {
    let sh = llama70b();
    let c = common::orin_nx();
    let req = PlanRequest {
        context: 1024,
        ..PlanRequest::default()
    };
    let plan = loip_plan::plan("loip", &sh, &c, &req).unwrap();
    assert_eq!(plan.pattern, Pattern::Sporadic);
    let d = plan.devices.len() - 1;
    let n = plan.devices[d].stages[0].layers.len() as u32;
    let (_, a0, m0) = plan.devices[d].stages[0].counts();
    let ev = AdaptEvent::Switch {
        step: 4,
        device: d,
        tokens: 0,
        from: (a0, m0),
        to: (n, n),
    };
    (sh, c, plan, vec![ev])
}

/// Steps that ran as the cost model prices the first `k` steps, `compute` times its
/// compute, `extra` more in hops, `stall` times its stall.
fn fed(
    plan: &Plan,
    sh: &ModelShape,
    c: &Cluster,
    ev: &[AdaptEvent],
    k: u32,
    (compute, extra, stall): (f64, f64, f64),
) -> WarmupStep {
    let (_, b) = evaluate_switched(plan, sh, c, ev, 2, k).unwrap();
    let (cs, hs, ss) = (
        compute * b.compute_ms / 1e3,
        b.comm_ms / 1e3 + extra,
        stall * b.uncovered_load_ms / 1e3,
    );
    WarmupStep {
        group: 0,
        wall_s: cs + hs + ss,
        compute_s: cs,
        stall_s: ss,
        coordinator_s: 0.0,
    }
}

/// The first 6 steps (two at the plan's placement, four after the switch) ran 20 % slower
/// than priced and 1 ms more in hops a step, at the priced stall: the remaining steps are
/// priced with compute ×1.2, the extra on each transfer and the loads unchanged, with the
/// placement in force at each.
#[test]
fn a_run_is_repriced_from_its_first_steps() {
    let (sh, c, plan, ev) = plan_and_switch();
    let names: Vec<String> = c.devices.iter().map(|d| d.name.clone()).collect();
    let f = fed(&plan, &sh, &c, &ev, 6, (1.2, 1e-3, 1.0));
    let whole = calibrate::Weights {
        compute: 1.0,
        loads: 1.0,
    };
    let r = calibrate::reprice(&plan, &sh, &c, &ev, 2, 6, 40, &f, &names, whole)
        .unwrap()
        .unwrap();
    let cal = &r.calibration;
    assert_eq!(cal.steps, 6);
    assert!(close(cal.compute_scale, 1.2));
    let transfers = calibrate::transfers_per_step(&plan);
    assert!(close(cal.hop_extra, 1e-3 / transfers as f64));
    // the stall as priced after the compute scaled: the factor nearest 1 that prices it
    let (_, fitted) = evaluate_switched(&plan, &sh, &r.cluster, &ev, 2, 6).unwrap();
    assert!(fitted.uncovered_load_ms >= 0.0);
    // the remaining steps 8..=41 on the re-priced cluster
    let (ms, b) = evaluate_switched(&plan, &sh, &r.cluster, &ev, 8, 34).unwrap();
    assert!(close(r.ms_per_token, ms));
    assert!(close(r.breakdown.compute_ms, b.compute_ms));
    let (before, _) = evaluate_switched(&plan, &sh, &c, &ev, 8, 34).unwrap();
    assert!(r.ms_per_token > before, "slower steps price a slower rest");
    // nothing left, nothing fed, or bursty steps: not re-priced
    assert!(
        calibrate::reprice(&plan, &sh, &c, &ev, 2, 6, 6, &f, &names, whole)
            .unwrap()
            .is_none()
    );
    assert!(
        calibrate::reprice(&plan, &sh, &c, &ev, 2, 0, 40, &f, &names, whole)
            .unwrap()
            .is_none()
    );
    let mut bursty = plan.clone();
    bursty.pattern = Pattern::Bursty;
    assert!(
        calibrate::reprice(&bursty, &sh, &c, &ev, 2, 6, 40, &f, &names, whole)
            .unwrap()
            .is_none()
    );
}

/// A run's first steps that stalled half again as long as priced: with the whole factor
/// the re-priced cluster prices those steps' stall as measured; the input cluster is left
/// alone; `REPRICE_WEIGHTS` applies its weights.
#[test]
fn a_repriced_run_takes_its_own_stall_whole() {
    let (sh, c, plan, ev) = plan_and_switch();
    let names: Vec<String> = c.devices.iter().map(|d| d.name.clone()).collect();
    let (_, b0) = evaluate_switched(&plan, &sh, &c, &ev, 2, 6).unwrap();
    assert!(b0.uncovered_load_ms > 0.0, "the switched placement streams");
    let f = fed(&plan, &sh, &c, &ev, 6, (1.0, 0.0, 1.5));
    let whole = calibrate::Weights {
        compute: 1.0,
        loads: 1.0,
    };
    let before = c.clone();
    let r = calibrate::reprice(&plan, &sh, &c, &ev, 2, 6, 40, &f, &names, whole)
        .unwrap()
        .unwrap();
    assert_eq!(c, before);
    let cal = &r.calibration;
    assert!(cal.load_fit > 1.0);
    assert_eq!(cal.load_scale, cal.load_fit);
    let (_, b) = evaluate_switched(&plan, &sh, &r.cluster, &ev, 2, 6).unwrap();
    assert!(
        (b.uncovered_load_ms / 1e3 - f.stall_s).abs() < 1e-6 * f.stall_s,
        "{} vs {}",
        b.uncovered_load_ms / 1e3,
        f.stall_s
    );
    // the weights the runtime re-prices with: compute as the warm-up left it, half the
    // loads' factor
    let w = calibrate::REPRICE_WEIGHTS;
    let r = calibrate::reprice(&plan, &sh, &c, &ev, 2, 6, 40, &f, &names, w)
        .unwrap()
        .unwrap();
    assert_eq!(r.calibration.compute_scale, 1.0f64.powf(w.compute));
    assert!(close(
        r.calibration.load_scale,
        r.calibration.load_fit.powf(w.loads)
    ));
}

/// The warm-up fits the loads per group (each group's median stall, a window of the disk's
/// drifting rate) and applies the mean of those factors (trimmed from four groups on):
/// two groups, one stalling as priced and one twice as long, fit between them.
#[test]
fn a_warm_up_fits_the_loads_per_group_and_averages() {
    let (sh, c, plan, ev) = plan_and_switch();
    // the plan with its switched placement from the start: a streaming plan
    let mut p = plan.clone();
    if let AdaptEvent::Switch { device, to, .. } = ev[0] {
        p.devices[device].stages = stage_layout(&p.devices[device].stages, to.0, to.1);
    }
    p.reprice(&sh, &c).unwrap();
    let names: Vec<String> = c.devices.iter().map(|d| d.name.clone()).collect();
    let s0 = p.breakdown.uncovered_load_ms / 1e3;
    let c0 = p.breakdown.compute_ms / 1e3;
    let m0 = p.breakdown.comm_ms / 1e3;
    let step = |group: u32, stall: f64| WarmupStep {
        group,
        wall_s: c0 + m0 + stall,
        compute_s: c0,
        stall_s: stall,
        coordinator_s: 0.0,
    };
    let fit_of = |steps: &[WarmupStep]| {
        let mut cl = c.clone();
        calibrate::calibrate(&p, &sh, &mut cl, steps, &names)
            .unwrap()
            .unwrap()
            .load_fit
    };
    let (a, b) = (fit_of(&[step(0, s0)]), fit_of(&[step(0, 2.0 * s0)]));
    assert!(close(a, 1.0));
    assert!(b > 1.0);
    let both = fit_of(&[step(0, s0), step(1, 2.0 * s0)]);
    assert!(close(both, (a + b) / 2.0), "{both} vs {}", (a + b) / 2.0);
}

#[test]
fn the_trimmed_mean_drops_the_ends_from_four_values() {
    assert_eq!(trimmed_mean(&[]), None);
    assert_eq!(trimmed_mean(&[f64::NAN]), None);
    assert_eq!(trimmed_mean(&[1.0, 2.0]), Some(1.5));
    assert_eq!(trimmed_mean(&[1.0, 2.0, 6.0]), Some(3.0));
    assert_eq!(trimmed_mean(&[100.0, 1.0, 3.0, 2.0]), Some(2.5));
    assert_eq!(
        trimmed_mean(&[1.0, 2.0, 3.0, 4.0, f64::NAN, 50.0]),
        Some(3.0)
    );
}
