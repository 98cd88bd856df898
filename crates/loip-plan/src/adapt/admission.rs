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
//!
//! Every plan here is placed with the working memory the runtime accounts
//! ([`runtime_budgets`]): the planner's fixed scratch allowance
//! ([`crate::shape::WORKING_SCRATCH_BYTES`], 16 MiB for the attention scores of any context)
//! would leave that much of each device unplanned, so a device's first threshold would lie
//! 16 MiB of KV past where the planner put it (hundreds of tokens) and the runtime and the
//! simulator would disagree on when it is crossed.

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

/// `cluster` with each budget raised by what the planner's working allowance for `b`
/// sequences in flight ([`ModelShape::working_bytes`]) reserves beyond what the runtime
/// accounts for the same steps over `context` tokens ([`ModelShape::step_working_bytes`]: the
/// scores of the whole context instead of the fixed scratch). A plan placed on it uses the
/// device's memory as the runtime does: its KV room is the runtime's.
pub fn runtime_budgets(shape: &ModelShape, cluster: &Cluster, b: u32, context: u64) -> Cluster {
    let extra = working_surplus(shape, b, context);
    let mut c = cluster.clone();
    for d in &mut c.devices {
        d.profile.mem_budget = d.profile.mem_budget.saturating_add(extra);
    }
    c
}

/// What the planner's working allowance for `b` sequences in flight reserves beyond what the
/// runtime accounts for the same steps over `context` tokens ([`runtime_budgets`]).  // bytes
fn working_surplus(shape: &ModelShape, b: u32, context: u64) -> u64 {
    let b = b.max(1);
    let runtime = shape.step_working_bytes(
        shape.step_tokens.unwrap_or(0).max(b as u64),
        b as u64,
        context,
    );
    shape.working_bytes(b).saturating_sub(runtime)
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
    let b = req.micro_batches.unwrap_or(1);
    let placed_on = runtime_budgets(shape, cluster, b, whole);
    let surplus = working_surplus(shape, b, whole);
    let at = |context: u64| {
        let r = PlanRequest {
            context,
            ..req.clone()
        };
        // the budgets the plan reports are the cluster's own, and its memory what the
        // runtime accounts (without the planner's surplus scratch), so it stays within them
        crate::plan(planner, shape, &placed_on, &r).map(|mut p| {
            for d in &mut p.devices {
                if let Some(c) = cluster.devices.iter().find(|c| c.name == d.name) {
                    d.budget_bytes = c.budget();
                    d.memory_bytes = d.memory_bytes.saturating_sub(surplus);
                }
            }
            p
        })
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
