//! Planning for the KV held at admission (design §6): a plan sized for the whole context
//! reserves memory a request may never use, and refuses what does not fit at once. Here the
//! plan is made for the tokens admitted, and is kept only if online adaptation can carry it
//! to the whole context: on every device some threshold layout ([`super::stage_layout`],
//! blocks offloaded per stage) holds the device's KV of the whole context within its budget.
//!
//! Order: the plan for the admitted tokens if it can grow; else the plan for the whole
//! context if there is one (nothing to adapt); else, if the plan for the largest context the
//! planner can place (bisection) can grow, the plan for the smallest context that still
//! can (bisection below it); else the whole-context planning error.

use super::switch::{choose_switch, stage_layout};
use crate::cost;
use crate::error::PlanError;
use crate::{Cluster, ModelShape, Plan, PlanRequest};

/// Whether every device of `plan` has a layout (blocks offloaded per stage, same layers)
/// that holds `context` KV tokens within its budget in `cluster`, with the working buffers
/// of that context ([`ModelShape::step_working_bytes`], as the runtime accounts them)
/// instead of the planner's fixed scratch.
pub fn can_grow_to(plan: &Plan, shape: &ModelShape, cluster: &Cluster, context: u64) -> bool {
    let b = plan.micro_batches.max(1);
    let exact_working = shape.step_working_bytes(
        shape.step_tokens.unwrap_or(0).max(b as u64),
        b as u64,
        cost::per_sequence_context(context, b),
    );
    plan.devices.iter().all(|d| {
        let Some(dev) = cluster.devices.iter().find(|c| c.name == d.name) else {
            return false;
        };
        let n = d
            .stages
            .iter()
            .map(|s| s.layers.len() as u32)
            .max()
            .unwrap_or(0);
        let fits = |a: u32, m: u32| {
            let stages = stage_layout(&d.stages, a, m);
            let mem = cost::device_memory(
                shape,
                plan.mode,
                &stages,
                d.holds_embedding,
                d.holds_head,
                context,
                plan.micro_batches,
            );
            // The step's own buffers at this context, not the planner's fixed scratch for
            // any context: what the device accounts once it runs.
            let mem = mem.saturating_sub(shape.working_bytes(b)) + exact_working;
            mem <= dev.budget()
        };
        choose_switch(n, (0, 0), fits, |_, _| 0.0).is_some()
    })
}

/// The plan for `admitted` KV tokens (summed over sequences) that can adapt up to
/// `req.context` (see the module docs). `admitted ≥ req.context` plans as usual.
pub fn plan_for_admission(
    planner: &str,
    shape: &ModelShape,
    cluster: &Cluster,
    req: &PlanRequest,
    admitted: u64,
) -> Result<Plan, PlanError> {
    let whole = req.context;
    let at = |context: u64| {
        let r = PlanRequest {
            context,
            ..req.clone()
        };
        crate::plan(planner, shape, cluster, &r)
    };
    if admitted >= whole {
        return at(whole);
    }
    if let Ok(p) = at(admitted) {
        if can_grow_to(&p, shape, cluster, whole) {
            return Ok(p);
        }
    }
    let err = match at(whole) {
        Ok(p) => return Ok(p),
        Err(e) => e,
    };
    // The largest context the planner places (to within 1/64 of the whole).
    let (mut lo, mut hi) = (admitted, whole);
    let mut best = None;
    let step = (whole / 64).max(1);
    while hi - lo > step {
        let mid = lo + (hi - lo) / 2;
        match at(mid) {
            Ok(p) => {
                lo = mid;
                best = Some(p);
            }
            Err(_) => hi = mid,
        }
    }
    let Some(mut best) = best.filter(|p| can_grow_to(p, shape, cluster, whole)) else {
        return Err(err);
    };
    // The smallest context whose plan still grows to the whole: the fewest blocks offloaded
    // up front, more as the KV grows (bisection; growth is not strictly monotonic in the
    // context, so this is the smallest found, not necessarily the smallest there is).
    let (mut lo, mut hi) = (admitted, lo);
    while hi - lo > step {
        let mid = lo + (hi - lo) / 2;
        match at(mid) {
            Ok(p) if can_grow_to(&p, shape, cluster, whole) => {
                hi = mid;
                best = p;
            }
            _ => lo = mid,
        }
    }
    Ok(best)
}
