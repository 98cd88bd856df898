//! How to run `N` concurrent sequences through a plan (design §11): `b` micro-batches in
//! flight of `q` sequences each (`b = ⌈N/q⌉`), chosen by the cost model.
//!
//! For every `q` in `1..=N` with `b = ⌈N/q⌉` (only the tightest `b` for each `q`), the named
//! planner lays the model out for `b` micro-batches in flight (bursty; sporadic when
//! `b = 1`) at the request's context (the KV of all `N` sequences), and
//! [`crate::cost::evaluate_batched`] prices the plan with `q` sequences per micro-batch:
//! block times `t(q)` from the profile's grid over b, `q` activations per hop, each
//! offloaded block read once per round (overlapped) or per micro-batch (sequential). When
//! `q` does not divide `N` the last micro-batch is short, so a round yields `N` tokens, not
//! `b·q`:
//!
//! ```text
//! ms/token(b, q) = evaluate_batched(plan_b, q).ms_per_token · b·q / N
//! ```
//!
//! A choice whose memory at `b·q` sequences' working buffers exceeds a device's budget is
//! refused. [`choose_batching`] keeps the fastest (ties: the smaller `q`, whose sequences
//! wait less for each other). The layout itself is the planner's for `b` micro-batches of
//! one sequence; `q` changes only its price. Pure: no I/O, no clock.

use super::{plan, PlanRequest};
use crate::cluster::Cluster;
use crate::cost::{self, Cost};
use crate::error::PlanError;
use crate::plan::{Pattern, Plan};
use crate::shape::ModelShape;
use serde::Serialize;

/// One way to run the concurrent sequences, priced.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Batching {
    /// Concurrent sequences `N`.
    pub sequences: u32,
    /// Micro-batches in flight `b = ⌈N/q⌉`.
    pub micro_batches: u32,
    /// Sequences per micro-batch `q`.
    pub seqs_per_micro_batch: u32,
    /// The plan, laid out for `b` micro-batches in flight.
    pub plan: Plan,
    /// Its price with `q` sequences per micro-batch (per token of a full round).
    pub cost: Cost,
    /// Time per generated token over all `N` sequences.  // milliseconds
    pub ms_per_token: f64,
}

impl Batching {
    /// Aggregate generation rate of the `N` sequences.  // tokens/s
    pub fn tokens_per_s(&self) -> f64 {
        if self.ms_per_token > 0.0 {
            1e3 / self.ms_per_token
        } else {
            0.0
        }
    }
}

/// The `(b, q)` pairs worth pricing for `n` sequences: every `q` in `1..=n` with
/// `b = ⌈n/q⌉`, skipping a `q` whose `b` also fits a smaller `q` (same pipeline depth, more
/// waiting).
pub fn candidates(n: u32) -> Vec<(u32, u32)> {
    let n = n.max(1);
    (1..=n)
        .filter_map(|q| {
            let b = n.div_ceil(q);
            (n.div_ceil(b) == q).then_some((b, q))
        })
        .collect()
}

/// Plans and prices `sequences` run as `b` micro-batches of `q` (module docs).
pub fn batching(
    planner: &str,
    shape: &ModelShape,
    cluster: &Cluster,
    req: &PlanRequest,
    sequences: u32,
    q: u32,
) -> Result<Batching, PlanError> {
    let n = sequences.max(1);
    let q = q.clamp(1, n);
    let b = n.div_ceil(q);
    let req_b = PlanRequest {
        pattern: if b > 1 {
            Pattern::Bursty
        } else {
            Pattern::Sporadic
        },
        micro_batches: Some(b),
        ..req.clone()
    };
    let p = plan(planner, shape, cluster, &req_b)?;
    let (ms_per_token, c) = price_layout(&p, shape, cluster, n, q)?;
    if let Some(d) = c.devices.iter().find(|d| d.memory_bytes > d.budget_bytes) {
        return Err(PlanError::DoesNotFit {
            planner: planner.to_string(),
            device: d.name.clone(),
            lacks_bytes: d.memory_bytes - d.budget_bytes,
        });
    }
    Ok(Batching {
        sequences: n,
        micro_batches: b,
        seqs_per_micro_batch: q,
        ms_per_token,
        plan: p,
        cost: c,
    })
}

/// Prices `layout` (any plan; its layers and offloading kept) running `sequences` as
/// micro-batches of `q` (`b = ⌈N/q⌉` in flight, bursty when `b > 1`): milliseconds per
/// generated token over all `N` (module docs) and the full-round cost.
pub fn price_layout(
    layout: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    sequences: u32,
    q: u32,
) -> Result<(f64, Cost), PlanError> {
    let n = sequences.max(1);
    let q = q.clamp(1, n);
    let b = n.div_ceil(q);
    let p = Plan {
        micro_batches: b,
        pattern: if b > 1 {
            Pattern::Bursty
        } else {
            Pattern::Sporadic
        },
        ..layout.clone()
    };
    let c = cost::evaluate_batched(&p, shape, cluster, q)?;
    let per_round = (b * q) as f64; // tokens a full round is priced for
    Ok((c.ms_per_token * per_round / n as f64, c))
}

/// Every candidate of [`candidates`], priced (or why it cannot run), `q` ascending.
pub fn batchings(
    planner: &str,
    shape: &ModelShape,
    cluster: &Cluster,
    req: &PlanRequest,
    sequences: u32,
) -> Vec<(u32, Result<Batching, PlanError>)> {
    candidates(sequences)
        .into_iter()
        .map(|(_, q)| (q, batching(planner, shape, cluster, req, sequences, q)))
        .collect()
}

/// The fastest way to run `sequences` concurrent sequences (ties: the smaller `q`); the
/// error of `q = 1` when none can run.
pub fn choose_batching(
    planner: &str,
    shape: &ModelShape,
    cluster: &Cluster,
    req: &PlanRequest,
    sequences: u32,
) -> Result<Batching, PlanError> {
    let mut best: Option<Batching> = None;
    let mut first_err: Option<PlanError> = None;
    for (_, r) in batchings(planner, shape, cluster, req, sequences) {
        match r {
            Ok(bt) => {
                if best
                    .as_ref()
                    .is_none_or(|x| bt.ms_per_token < x.ms_per_token * (1.0 - 1e-9))
                {
                    best = Some(bt);
                }
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    best.ok_or_else(|| {
        first_err.unwrap_or_else(|| PlanError::BadRequest("no batching to price".into()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_are_the_tight_pairs() {
        assert_eq!(candidates(1), vec![(1, 1)]);
        assert_eq!(candidates(6), vec![(6, 1), (3, 2), (2, 3), (1, 6)]);
        assert_eq!(
            candidates(8),
            vec![(8, 1), (4, 2), (3, 3), (2, 4), (1, 8)]
        );
        for n in 1..40 {
            for (b, q) in candidates(n) {
                assert!(b * q >= n && (b - 1) * q < n && b * (q - 1) < n, "{n}: {b}x{q}");
            }
        }
    }
}
