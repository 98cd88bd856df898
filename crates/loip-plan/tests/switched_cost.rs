//! A run's cost over its threshold switches (`adapt::evaluate_switched`): each decode step
//! priced with the placement in force, averaged.

mod common;

use common::llama13b;
use loip_plan::adapt::switch::stage_layout;
use loip_plan::adapt::{evaluate_switched, AdaptEvent};
use loip_plan::cost::evaluate;
use loip_plan::planners::PlanRequest;

#[test]
fn steps_are_priced_with_the_placement_in_force_and_averaged() {
    let sh = llama13b();
    let c = common::orin_nx();
    let req = PlanRequest {
        context: 1024,
        ..PlanRequest::default()
    };
    let plan = loip_plan::plan("loip", &sh, &c, &req).unwrap();
    let base = evaluate(&plan, &sh, &c).unwrap();
    // No switch: the plan's own price, whatever the steps.
    let (ms, b) = evaluate_switched(&plan, &sh, &c, &[], 2, 63).unwrap();
    assert!((ms - base.ms_per_token).abs() < 1e-9);
    assert!((b.total_ms() - base.ms_per_token).abs() < 1e-9);
    // The last device offloads every block from step 12: steps 2..=11 (10) at the plan's
    // price, 12..=41 (30) at the switched placement's.
    let d = plan.devices.len() - 1;
    let n = plan.devices[d].stages[0].layers.len() as u32;
    let (_, a0, m0) = plan.devices[d].stages[0].counts();
    let to = (n, n);
    let ev = AdaptEvent::Switch {
        step: 12,
        device: d,
        tokens: 0,
        from: (a0, m0),
        to,
    };
    let mut switched = plan.clone();
    switched.devices[d].stages = stage_layout(&switched.devices[d].stages, to.0, to.1);
    let after = evaluate(&switched, &sh, &c).unwrap();
    assert!(
        after.ms_per_token > base.ms_per_token * 1.01,
        "streaming every block costs"
    );
    let (ms, b) = evaluate_switched(&plan, &sh, &c, std::slice::from_ref(&ev), 2, 40).unwrap();
    let want = (10.0 * base.ms_per_token + 30.0 * after.ms_per_token) / 40.0;
    assert!((ms - want).abs() < 1e-9 * want, "{ms} vs {want}");
    assert!((b.total_ms() - want).abs() < 1e-9 * want);
    // A switch after the last step changes nothing; one before the first prices every step.
    let late = evaluate_switched(&plan, &sh, &c, std::slice::from_ref(&ev), 2, 10)
        .unwrap()
        .0;
    assert!((late - base.ms_per_token).abs() < 1e-9);
    let early = evaluate_switched(&plan, &sh, &c, &[ev], 12, 5).unwrap().0;
    assert!((early - after.ms_per_token).abs() < 1e-9);
    // Lending and eviction events are not placements: ignored.
    let other = [AdaptEvent::Evict { step: 3, tokens: 4 }];
    let (ms, _) = evaluate_switched(&plan, &sh, &c, &other, 2, 20).unwrap();
    assert!((ms - base.ms_per_token).abs() < 1e-9);
}

/// Each step that switches parks once, for the largest `switch_s` among the devices it
/// switches, spread over the steps priced; a switch before the window parks none of them;
/// the presets' 0 changes nothing.
#[test]
fn a_switch_parks_its_step_once() {
    let sh = common::llama70b();
    let mut c = common::orin_nx();
    let req = PlanRequest {
        context: 1024,
        ..PlanRequest::default()
    };
    let plan = loip_plan::plan("loip", &sh, &c, &req).unwrap();
    assert_eq!(plan.devices.len(), 2, "both devices run a stage");
    let ev = |step: u32, device: usize| {
        let n = plan.devices[device].stages[0].layers.len() as u32;
        let (_, a0, m0) = plan.devices[device].stages[0].counts();
        AdaptEvent::Switch {
            step,
            device,
            tokens: 0,
            from: (a0, m0),
            to: (n, n),
        }
    };
    let events = [ev(5, 0), ev(5, 1), ev(9, 1), ev(1, 0)];
    let (free, b0) = evaluate_switched(&plan, &sh, &c, &events, 2, 20).unwrap();
    assert_eq!(b0.switch_ms, 0.0);
    let by_name = |c: &mut loip_plan::Cluster, d: usize, s: f64| {
        let name = &plan.devices[d].name;
        if let Some(dev) = c.devices.iter_mut().find(|x| &x.name == name) {
            dev.profile.switch_s = s;
        }
    };
    by_name(&mut c, 0, 0.010);
    by_name(&mut c, 1, 0.004);
    let (ms, b) = evaluate_switched(&plan, &sh, &c, &events, 2, 20).unwrap();
    // step 5 parks 10 ms (both devices, the larger), step 9 parks 4 ms; step 1 is before
    // the window: 14 ms over 20 steps
    let want = 14.0 / 20.0;
    assert!((b.switch_ms - want).abs() < 1e-12, "{}", b.switch_ms);
    assert!((ms - free - want).abs() < 1e-9);
    assert!((b.total_ms() - ms).abs() < 1e-9);
    assert_eq!((b.compute_ms, b.comm_ms), (b0.compute_ms, b0.comm_ms));
}
