//! Speculative decoding of a plan replayed on the virtual clock (issue 31, item 4).
//!
//! The runtime's step scheduler ([`crate::serving`]) runs a request trace twice, without and
//! with speculation, and every step takes the cost model's time for its rows: one pass of
//! `T` rows (prompt chunks, decode tokens and the drafts being verified) through the plan's
//! devices, [`loip_plan::cost::evaluate_rows`] at `T` positions, each row attending over one
//! sequence's context. Steps run one at a time (the serving loop of one coordinator), so for
//! a multi-device plan this prices the sporadic pipeline, not overlapped micro-batches.
//! Beside the replay, the cost model's closed form ([`loip_plan::speculate`]) gives the
//! expected figure: step time of `k + 1` positions ÷ `E(k, α)`.
//!
//! Pure and deterministic (the acceptance draws come from the seed).

use loip_plan::cost::evaluate_rows;
use loip_plan::sched::{Limits, Step};
use loip_plan::speculate::evaluate_speculative;
use loip_plan::{Cluster, ModelShape, Pattern, Plan};
use serde::Serialize;

use crate::serving::{
    simulate_serving_speculative, ServingRun, SpecRequest, Speculation, TraceRequest,
};
use crate::SimError;

/// Step times of `plan` for serving steps of `1..=max_rows` rows, one pass each through the
/// plan's devices at one sequence's context.  // seconds, index rows − 1
pub fn step_table(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    max_rows: usize,
) -> Result<Vec<f64>, SimError> {
    let mut one = plan.clone();
    one.context = plan.context.div_ceil(plan.micro_batches.max(1) as u64);
    one.micro_batches = 1;
    one.pattern = Pattern::Sporadic;
    (1..=max_rows.max(1))
        .map(|rows| {
            let rows = u32::try_from(rows).unwrap_or(u32::MAX);
            Ok(evaluate_rows(&one, shape, cluster, 1, rows)?.ms_per_token / 1e3)
        })
        .collect::<Result<_, loip_plan::PlanError>>()
        .map_err(SimError::from)
}

/// Decode ms per generated token of a serving run: the time of the steps that carried no
/// prompt chunk over the tokens they produced.  // ms
pub fn decode_ms_per_token(run: &ServingRun, trace: &[TraceRequest]) -> f64 {
    let (mut s, mut n) = (0.0, 0usize);
    for st in &run.steps {
        let decode_only = st.items.iter().all(|i| {
            trace
                .get(i.seq as usize)
                .is_some_and(|r| i.start >= r.prompt_len)
        });
        if decode_only {
            s += st.end - st.start;
            n += st.kept;
        }
    }
    if n == 0 {
        f64::NAN
    } else {
        s * 1e3 / n as f64
    }
}

/// A trace served without and with speculation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SpecReplay {
    /// drafts per step of the speculating requests (the first one's, for the summary)
    pub k: usize,
    /// acceptance rate of the speculating requests (the first one's)
    pub acceptance: f64,
    /// decode ms per token without speculation  // ms
    pub plain_ms_per_token: f64,
    /// decode ms per token with speculation  // ms
    pub spec_ms_per_token: f64,
    /// decode steps without / with speculation
    pub plain_steps: usize,
    /// see `plain_steps`
    pub spec_steps: usize,
    /// drafts verified
    pub drafted: u64,
    /// drafts accepted
    pub accepted: u64,
    /// the cost model's ms/token at one sequence, without / with speculation  // ms
    pub predicted_plain_ms_per_token: f64,
    /// see `predicted_plain_ms_per_token`
    pub predicted_spec_ms_per_token: f64,
}

/// Serves `trace` on `plan` without and with `spec` (module docs), under `limits`
/// (the KV budget is the caller's: the plan's own memory check is the planner's).
pub fn replay_speculative(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    limits: &Limits,
    trace: &[TraceRequest],
    spec: &Speculation,
) -> Result<SpecReplay, SimError> {
    let table = step_table(plan, shape, cluster, limits.max_batch_tokens)?;
    let last = table.last().copied().unwrap_or(0.0);
    let step_time = |s: &Step| -> f64 {
        let t = s.tokens().max(1);
        table.get(t - 1).copied().unwrap_or(last)
    };
    let plain = simulate_serving_speculative(limits.clone(), trace, None, &step_time)?;
    let with = simulate_serving_speculative(limits.clone(), trace, Some(spec), &step_time)?;
    let first = spec
        .per_request
        .iter()
        .find(|r| r.k > 0)
        .copied()
        .unwrap_or(SpecRequest {
            k: 0,
            acceptance: 0.0,
        });
    let mut one = plan.clone();
    one.context = plan.context.div_ceil(plan.micro_batches.max(1) as u64);
    one.micro_batches = 1;
    one.pattern = Pattern::Sporadic;
    let k = u32::try_from(first.k).unwrap_or(u32::MAX);
    let predicted = |k: u32| {
        evaluate_speculative(&one, shape, cluster, 1, k, first.acceptance)
            .map(|c| c.cost.ms_per_token)
            .map_err(SimError::from)
    };
    let decode_steps = |r: &ServingRun| {
        r.steps
            .iter()
            .filter(|s| {
                s.items.iter().all(|i| {
                    trace
                        .get(i.seq as usize)
                        .is_some_and(|r| i.start >= r.prompt_len)
                })
            })
            .count()
    };
    Ok(SpecReplay {
        k: first.k,
        acceptance: first.acceptance,
        plain_ms_per_token: decode_ms_per_token(&plain, trace),
        spec_ms_per_token: decode_ms_per_token(&with, trace),
        plain_steps: decode_steps(&plain),
        spec_steps: decode_steps(&with),
        drafted: with.drafted,
        accepted: with.accepted,
        predicted_plain_ms_per_token: predicted(0)?,
        predicted_spec_ms_per_token: predicted(k)?,
    })
}
