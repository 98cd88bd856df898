//! The price of a speculative step (issue 31): one forward verifies the pending token and
//! `k` drafts, `k + 1` positions per sequence, and yields between 1 and `k + 1` tokens.
//!
//! ```text
//! S(k)     s       one step of k + 1 positions: cost::evaluate_rows at positions = k + 1
//!                  (every block at the profile's t(b) for b = seqs·(k+1) rows, on each
//!                  device; loads, links and the pipeline's round as for one position)
//! α                acceptance rate: the chance that a draft equals the model's own token,
//!                  given that the drafts before it did (drafts are checked in order and the
//!                  first mismatch ends the step)
//! E(k, α)  tokens  expected tokens per step = Σ_{i=0..k} α^i = (1 − α^{k+1}) / (1 − α)
//!                  (the accepted drafts, plus the token the verification itself produces)
//! ms/token         S(k) / E(k, α)
//! ```
//!
//! A step that streams offloaded blocks or waits on the pipeline's round costs nearly the
//! same for `k + 1` positions as for one (the load is paid once), so even a modest `α` makes
//! `k > 0` pay; in memory on a compute-bound device `S(k)` grows with `k` and the best `k`
//! is small or 0. [`best_k`] takes the `k` that minimises ms/token; [`choose_k`] does the
//! same from a table of step times however they were obtained (the cost model's, or times an
//! engine measured), so a running sequence can re-pick its `k` as its acceptance rate
//! moves; [`acceptance_rate`] estimates `α` from the counts an engine keeps,
//! [`verify_step_times`] gives a session's table from the parts of its plan's evaluation
//! ([`step_parts`], kept with the session: no evaluation per speculative run), and
//! [`device_step_times`] gives one device's table from its profile when there is no plan.
//!
//! Pure: no I/O; every function is total on its inputs (α is clamped to [0, 1]).

use crate::cluster::Cluster;
use crate::cost::{block_times_rows, evaluate_rows, Cost};
use crate::error::PlanError;
use crate::plan::Plan;
use crate::shape::ModelShape;
use serde::{Deserialize, Serialize};

/// Largest `k` the helpers consider (the scheduler caps drafts by the step's spare tokens).
pub const MAX_K: u32 = 32;

/// Expected tokens per step with `k` drafts at acceptance rate `alpha`:
/// `Σ_{i=0..k} α^i` (1 at `k = 0` or `α = 0`, `k + 1` at `α = 1`).  // tokens
pub fn expected_tokens(k: u32, alpha: f64) -> f64 {
    let a = clamp_alpha(alpha);
    let mut term = 1.0;
    let mut sum = 0.0;
    for _ in 0..=k.min(MAX_K) {
        sum += term;
        term *= a;
    }
    sum
}

fn clamp_alpha(alpha: f64) -> f64 {
    if alpha.is_nan() {
        0.0
    } else {
        alpha.clamp(0.0, 1.0)
    }
}

/// Acceptance rate from an engine's counters: `accepted` drafts kept over `steps` speculative
/// steps, of which `rejected_steps` ended at a mismatch (the others kept every draft). The
/// maximum-likelihood `α` of the model above is `accepted / (accepted + rejected_steps)`;
/// with nothing observed it is `prior`.
pub fn acceptance_rate(accepted: u64, rejected_steps: u64, prior: f64) -> f64 {
    let n = accepted.saturating_add(rejected_steps);
    if n == 0 {
        clamp_alpha(prior)
    } else {
        accepted as f64 / n as f64
    }
}

/// The `k` (index into `step_s`) that minimises `step_s[k] / E(k, alpha)`, where
/// `step_s[k]` is the time of a step of `k + 1` positions; ties go to the smaller `k`.
/// Non-finite or negative times are skipped; an empty or all-invalid table gives 0.
pub fn choose_k(step_s: &[f64], alpha: f64) -> u32 {
    let mut best = (0u32, f64::INFINITY);
    for (k, &s) in step_s.iter().enumerate().take(MAX_K as usize + 1) {
        if !s.is_finite() || s < 0.0 {
            continue;
        }
        let per_token = s / expected_tokens(k as u32, alpha);
        if per_token < best.1 * (1.0 - 1e-9) {
            best = (k as u32, per_token);
        }
    }
    best.0
}

/// A plan's price with speculation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpecCost {
    /// drafts per step
    pub k: u32,
    /// acceptance rate the price assumes
    pub acceptance: f64,
    /// expected tokens per step `E(k, α)`  // tokens
    pub expected_tokens: f64,
    /// one step of `k + 1` positions per sequence, per sequence (the plan's ms/token figure
    /// at `k + 1` positions: a round divided by the sequences it advances)  // ms
    pub step_ms: f64,
    /// the plan's cost per generated token: every figure of the step divided by `E`
    pub cost: Cost,
}

/// Prices `plan` with `k` drafts per step at acceptance rate `alpha`, each micro-batch
/// carrying `seqs` sequences (1 unless continuous batching fills micro-batches).
pub fn evaluate_speculative(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    seqs: u32,
    k: u32,
    alpha: f64,
) -> Result<SpecCost, PlanError> {
    let k = k.min(MAX_K);
    let step = evaluate_rows(plan, shape, cluster, seqs, k + 1)?;
    let e = expected_tokens(k, alpha);
    let mut cost = step.clone();
    cost.ms_per_token /= e;
    cost.breakdown.compute_ms /= e;
    cost.breakdown.comm_ms /= e;
    cost.breakdown.uncovered_load_ms /= e;
    for d in &mut cost.devices {
        d.compute_ms /= e;
        d.load_ms /= e;
        d.stall_ms /= e;
    }
    Ok(SpecCost {
        k,
        acceptance: clamp_alpha(alpha),
        expected_tokens: e,
        step_ms: step.ms_per_token,
        cost,
    })
}

/// Step times of `plan` for `k = 0..=max_k` drafts: entry `k` is one step of `k + 1`
/// positions (per sequence), the table [`choose_k`] takes.  // seconds
pub fn step_times(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    seqs: u32,
    max_k: u32,
) -> Result<Vec<f64>, PlanError> {
    (0..=max_k.min(MAX_K))
        .map(|k| evaluate_rows(plan, shape, cluster, seqs, k + 1).map(|c| c.ms_per_token / 1e3))
        .collect()
}

/// A plan's one-sequence step in the parts that grow differently with the positions it
/// carries, from what the plan's evaluation already priced (each device's compute, the links,
/// the uncovered load) and each device's batched-compute growth from its profile: made once
/// when a session's plan is made ([`step_parts`]) and kept with it, so that a verify step of
/// `k + 1` positions is priced without evaluating the plan again ([`verify_step_times`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepParts {
    /// each plan device's compute of a one-position step  // seconds
    pub compute: Vec<f64>,
    /// each plan device's compute at `p` positions over its compute at one, `p = 1..`
    pub growth: Vec<Vec<f64>>,
    /// the links' time of a one-position step  // seconds
    pub comm: f64,
    /// the links' time each further position adds (its activations on every hop and its
    /// result on the return trip)  // seconds
    pub comm_per_position: f64,
    /// the load the compute does not hide at one position  // seconds
    pub uncovered: f64,
    /// loads overlap the compute (overlapped mode): a longer step hides more of them
    pub overlapped: bool,
}

/// The parts of `plan`'s step ([`StepParts`]): its devices' planned compute
/// (`PlanDevice::compute_ms`), links and uncovered load (`Plan::breakdown`), as the plan's
/// evaluation left them, with each device's growth for up to [`MAX_K`] + 1 positions
/// ([`crate::cost::block_times_rows`] of its blocks and head). A plan without prices (made
/// by hand: no predicted ms/token) is evaluated once first. Errors only if a plan device is
/// not in `cluster`.
pub fn step_parts(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
) -> Result<StepParts, PlanError> {
    if plan.predicted_ms_per_token <= 0.0 {
        let mut priced = plan.clone();
        crate::cost::apply(&mut priced, &crate::cost::evaluate(plan, shape, cluster)?);
        if priced.predicted_ms_per_token > 0.0 {
            return step_parts(&priced, shape, cluster);
        }
    }
    let b = plan.micro_batches.max(1);
    let mut growth = Vec::with_capacity(plan.devices.len());
    for d in &plan.devices {
        let dev = cluster
            .device(&d.name)
            .ok_or_else(|| PlanError::UnknownDevice(d.name.clone()))?;
        let layers: u32 = d.stages.iter().map(|s| s.layers.len() as u32).sum();
        let compute = |p: u32| {
            let t = block_times_rows(dev, shape, plan.context, b, 1, p, plan.loader);
            layers as f64 * (t.attn + t.mlp) + if d.holds_head { t.head } else { 0.0 }
        };
        let one = compute(1);
        growth.push(
            (1..=MAX_K + 1)
                .map(|p| if one > 0.0 { compute(p) / one } else { 1.0 })
                .collect(),
        );
    }
    let nd = plan.devices.len() as u64;
    let rounds = plan
        .devices
        .iter()
        .map(|d| d.stages.len())
        .max()
        .unwrap_or(0) as u64;
    // every round's hops carry an activation per position, the last round's last hop the
    // position's result instead
    let bytes = (rounds * nd).saturating_sub(1) * shape.act_bytes_per_token
        + shape.return_bytes_per_token();
    let comm_per_position = if nd > 1 {
        bytes as f64 / cluster.link.bandwidth
    } else {
        0.0
    };
    Ok(StepParts {
        compute: plan.devices.iter().map(|d| d.compute_ms / 1e3).collect(),
        growth,
        comm: plan.breakdown.comm_ms / 1e3,
        comm_per_position,
        uncovered: plan.breakdown.uncovered_load_ms / 1e3,
        overlapped: plan.mode == crate::plan::ExecMode::Overlapped,
    })
}

/// Step times for `k = 0..=max_k` drafts from a plan's [`StepParts`]: entry `k` is a step of
/// `p = k + 1` positions, `Σ_i compute_i · growth_i(p) + comm + (p − 1) · comm_per_position`
/// plus the uncovered load (overlapped: less what the step's extra compute and links hide),
/// the table
/// [`choose_k`] takes. Empty when the parts are (a plan that could not be priced).
/// // seconds
pub fn verify_step_times(parts: &StepParts, max_k: u32) -> Vec<f64> {
    if parts.compute.is_empty() {
        return Vec::new();
    }
    let one: f64 = parts.compute.iter().sum();
    (0..=max_k.min(MAX_K))
        .map(|k| {
            let p = k as usize + 1;
            let compute: f64 = parts
                .compute
                .iter()
                .zip(&parts.growth)
                .map(|(c, g)| c * g.get(p - 1).copied().unwrap_or(p as f64))
                .sum();
            let comm = parts.comm + k as f64 * parts.comm_per_position;
            // overlapped: the loads run beside the round, so what the step adds to it hides
            // as much more of them
            let uncovered = if parts.overlapped {
                (parts.uncovered - (compute - one) - (comm - parts.comm)).max(0.0)
            } else {
                parts.uncovered
            };
            compute + comm + uncovered
        })
        .collect()
}

/// Step times of one device running every layer of `shape` (the engine on one machine,
/// without a plan) for `k = 0..=max_k` drafts: entry `k` is
/// `L · (t^A(k + 1, ⌈n / (k + 1)⌉) + t^P(k + 1)) + t^H(k + 1) + load`, the profile's
/// grid at `k + 1` rows (as [`crate::cost::block_times_rows`]) at `context` cached tokens,
/// plus reading `offloaded_bytes` in `reads` reads with `loader` once per step (not hidden:
/// a one-device offloaded step waits for its blocks). The table [`choose_k`] takes.
/// // seconds
pub fn device_step_times(
    profile: &crate::profile::DeviceProfile,
    shape: &ModelShape,
    context: u64,
    offloaded_bytes: u64,
    reads: u32,
    loader: crate::profile::LoaderKind,
    max_k: u32,
) -> Vec<f64> {
    let load = profile.loader(loader).load_time(offloaded_bytes, reads);
    (0..=max_k.min(MAX_K))
        .map(|k| {
            let rows = k + 1;
            let n = context.div_ceil(rows as u64);
            shape.layers as f64
                * (profile.attn_time(shape, rows, n) + profile.mlp_time(shape, rows))
                + profile.head_time(shape, rows)
                + load
        })
        .collect()
}

/// Every `k = 0..=max_k` priced ([`evaluate_speculative`]) and the index of the cheapest per
/// token (ties: the smaller `k`; `k = 0` is the plan without speculation).
pub fn price_ks(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    seqs: u32,
    alpha: f64,
    max_k: u32,
) -> Result<(Vec<SpecCost>, usize), PlanError> {
    let all: Vec<SpecCost> = (0..=max_k.min(MAX_K))
        .map(|k| evaluate_speculative(plan, shape, cluster, seqs, k, alpha))
        .collect::<Result<_, _>>()?;
    let steps: Vec<f64> = all.iter().map(|c| c.step_ms).collect();
    let best = choose_k(&steps, alpha) as usize;
    Ok((all, best))
}

/// The cheapest `k ≤ max_k` for `plan` at acceptance rate `alpha`, priced.
pub fn best_k(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    seqs: u32,
    alpha: f64,
    max_k: u32,
) -> Result<SpecCost, PlanError> {
    let (mut all, best) = price_ks(plan, shape, cluster, seqs, alpha, max_k)?;
    Ok(all.swap_remove(best))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_tokens_is_the_truncated_geometric_sum() {
        assert_eq!(expected_tokens(0, 0.9), 1.0);
        assert_eq!(expected_tokens(4, 0.0), 1.0);
        assert_eq!(expected_tokens(4, 1.0), 5.0);
        let a: f64 = 0.6;
        let closed = (1.0 - a.powi(4)) / (1.0 - a);
        assert!((expected_tokens(3, a) - closed).abs() < 1e-12);
        assert_eq!(expected_tokens(3, f64::NAN), 1.0);
        assert_eq!(expected_tokens(3, 7.0), 4.0);
    }

    #[test]
    fn choose_k_trades_step_time_against_expected_tokens() {
        // load-bound: a step costs the same for any k, so take every draft when α > 0
        let flat = [1.0; 9];
        assert_eq!(choose_k(&flat, 0.5), 8);
        assert_eq!(choose_k(&flat, 0.0), 0);
        // compute-bound: each position costs as much as the first, never worth drafting
        let linear: Vec<f64> = (1..=9).map(|p| p as f64).collect();
        assert_eq!(choose_k(&linear, 0.99), 0);
        // in between: 1 + 0.25·k; at α = 0.8, k = 3 → (1.75)/(2.952) beats k = 2 and 4
        let mid: Vec<f64> = (0..9).map(|k| 1.0 + 0.25 * k as f64).collect();
        let k = choose_k(&mid, 0.8);
        let per = |k: usize| mid[k] / expected_tokens(k as u32, 0.8);
        assert!((0..9).all(|j| per(k as usize) <= per(j) + 1e-12), "{k}");
        assert_eq!(choose_k(&[], 0.5), 0);
        assert_eq!(choose_k(&[f64::NAN, -1.0], 0.5), 0);
    }

    #[test]
    fn acceptance_rate_from_counters() {
        assert_eq!(acceptance_rate(0, 0, 0.7), 0.7);
        assert_eq!(acceptance_rate(6, 2, 0.0), 0.75);
        assert_eq!(acceptance_rate(0, 5, 0.9), 0.0);
    }
}
