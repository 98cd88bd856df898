//! The cost model over a run whose placement switched: the adaptive policy offloads more
//! blocks as the KV cache grows past each device's threshold (or brings them back), so a run
//! of many tokens streams more than the plan it started with. [`evaluate_switched`] prices
//! every decode step with the placement in force at it and averages them, which is what a
//! run's measured ms/token is set against. A switch also parks the step that needs it until
//! the device answers: each switching step is charged the switched devices' largest
//! `switch_s` (measured by the runtime; 0 for presets), spread over the run's steps.

use crate::adapt::switch::stage_layout;
use crate::adapt::AdaptEvent;
use crate::cluster::Cluster;
use crate::cost::{evaluate, CostBreakdown};
use crate::error::PlanError;
use crate::plan::Plan;
use crate::shape::ModelShape;

/// The mean cost of steps `first .. first + steps` of a run of `plan` whose devices switched
/// their (attention, MLP) offloaded blocks per stage at `events` (a switch applies from its
/// step on; lending and eviction events are left out). Each distinct placement is evaluated
/// once with [`evaluate`]; the result weighs it by the steps it ran. Each step that switches
/// parks once, for the largest [`crate::DeviceProfile::switch_s`] among the devices it
/// switches (they apply their switches side by side), in the breakdown's `switch_ms`.
/// Returns the mean ms/token and the mean breakdown (the plan's own for `steps == 0`).
/// // milliseconds
pub fn evaluate_switched(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    events: &[AdaptEvent],
    first: u32,
    steps: u32,
) -> Result<(f64, CostBreakdown), PlanError> {
    let mut switches: Vec<(u32, usize, (u32, u32))> = events
        .iter()
        .filter_map(|e| match e {
            AdaptEvent::Switch {
                step, device, to, ..
            } => Some((*step, *device, *to)),
            _ => None,
        })
        .collect();
    switches.sort_by_key(|s| s.0);
    let mut current = plan.clone();
    let mut sum = CostBreakdown::default();
    let mut total = 0.0;
    let mut priced: Option<(f64, CostBreakdown)> = None;
    let mut next = 0;
    let mut parked_s = 0.0;
    for step in first..first.saturating_add(steps) {
        let mut park: f64 = 0.0;
        while let Some(&(at, d, (a, m))) = switches.get(next) {
            if at > step {
                break;
            }
            if let Some(dev) = current.devices.get_mut(d) {
                dev.stages = stage_layout(&dev.stages, a, m);
                priced = None;
                // a switch before the window shaped the placement; it parked no step in it
                if at == step {
                    park = cluster
                        .device(&dev.name)
                        .map_or(park, |c| park.max(c.profile.switch_s));
                }
            }
            next += 1;
        }
        parked_s += park;
        let (ms, b) = match priced {
            Some(p) => p,
            None => {
                let c = evaluate(&current, shape, cluster)?;
                let p = (c.ms_per_token, c.breakdown);
                priced = Some(p);
                p
            }
        };
        total += ms;
        sum.compute_ms += b.compute_ms;
        sum.comm_ms += b.comm_ms;
        sum.uncovered_load_ms += b.uncovered_load_ms;
        sum.coordinator_ms += b.coordinator_ms;
    }
    if steps == 0 {
        let c = evaluate(plan, shape, cluster)?;
        return Ok((c.ms_per_token, c.breakdown));
    }
    let n = steps as f64;
    let switch_ms = parked_s * 1e3 / n;
    Ok((
        total / n + switch_ms,
        CostBreakdown {
            compute_ms: sum.compute_ms / n,
            comm_ms: sum.comm_ms / n,
            uncovered_load_ms: sum.uncovered_load_ms / n,
            coordinator_ms: sum.coordinator_ms / n,
            switch_ms,
        },
    ))
}
