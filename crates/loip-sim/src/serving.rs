//! Serving on the simulator's virtual clock: the runtime's own step scheduler
//! ([`loip_plan::sched::Scheduler`]) driven by a request trace, each step taking the time a
//! cost function gives it (the cost model's step time, or any function of the step).
//!
//! One policy, two drivers: the runtime's serving loop (`loip_engine::Serving`) and
//! [`simulate_serving`] call the scheduler in the same order: before each round every
//! request that has arrived is submitted, then one `poll`, then each step it decided runs
//! (one after another: one device) and is reported done at its end, then the releases. So
//! the same trace and the same step times give the same steps, item for item (tested in
//! `loip-server`'s `replay` test against the runtime with a recording backend).
//!
//! Speculative decoding ([`simulate_serving_speculative`]): before each round the driver
//! offers `k` drafts for every sequence that speculates ([`Scheduler::set_drafts`]); a
//! decode item of `1 + d` positions keeps `1 + a` tokens, `a` the leading drafts accepted,
//! each with the request's acceptance rate (a seeded ChaCha stream: the same trace and seed
//! give the same run), and reports it ([`Outcome::Kept`]).
//!
//! Invariants: time never goes back; every sampled row of a step continues (a trace
//! request produces exactly its output length: the scheduler ends it at `max_new_tokens`,
//! and caps drafts at the last wanted token); the loop is bounded by the trace's tokens.

use loip_plan::sched::{Action, Limits, Outcome, Request, Scheduler, SeqResult, Step, StepItem};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::SimError;

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// when it arrives  // seconds
    pub arrival: f64,
    /// prompt tokens  // tokens
    pub prompt_len: usize,
    /// tokens it produces  // tokens
    pub output_len: usize,
}

/// One step as it ran.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRecord {
    /// when it started  // seconds
    pub start: f64,
    /// when it ended  // seconds
    pub end: f64,
    /// its sequences (the trace index is the sequence id)
    pub items: Vec<StepItem>,
    /// new tokens it produced (accepted drafts included)  // tokens
    pub kept: usize,
}

/// What happened to the trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServingRun {
    /// every step, in order
    pub steps: Vec<StepRecord>,
    /// per request: time from arrival to its first token  // seconds
    pub ttft: Vec<Option<f64>>,
    /// per request: when it finished  // seconds
    pub finished: Vec<Option<f64>>,
    /// requests the scheduler refused at arrival, with the reason
    pub refused: Vec<(usize, String)>,
    /// drafts verified (speculative decode items' positions beyond the first)
    pub drafted: u64,
    /// drafts accepted
    pub accepted: u64,
}

/// How one request speculates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SpecRequest {
    /// drafts offered before each step (0: plain decoding)
    pub k: usize,
    /// chance that a draft is accepted, given the drafts before it were (0–1)
    pub acceptance: f64,
}

/// Speculative decoding for a trace: one entry per request (missing entries: plain).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Speculation {
    /// per trace request
    pub per_request: Vec<SpecRequest>,
    /// seed of the acceptance draws
    pub seed: u64,
}

/// Replays `trace` (sorted by arrival or not) through a scheduler under `limits`; a step
/// takes `step_time(step)` seconds (at least zero). Sequence ids are trace indices.
pub fn simulate_serving(
    limits: Limits,
    trace: &[TraceRequest],
    step_time: &dyn Fn(&Step) -> f64,
) -> Result<ServingRun, SimError> {
    simulate_serving_speculative(limits, trace, None, step_time)
}

/// [`simulate_serving`] with the requests that `spec` names speculating (module docs).
pub fn simulate_serving_speculative(
    limits: Limits,
    trace: &[TraceRequest],
    spec: Option<&Speculation>,
    step_time: &dyn Fn(&Step) -> f64,
) -> Result<ServingRun, SimError> {
    let spec_of = |k: usize| -> SpecRequest {
        spec.and_then(|s| s.per_request.get(k))
            .copied()
            .unwrap_or(SpecRequest {
                k: 0,
                acceptance: 0.0,
            })
    };
    let mut rng = ChaCha8Rng::seed_from_u64(spec.map_or(0, |s| s.seed));
    let mut sched = Scheduler::new(limits).map_err(|e| SimError::Invalid {
        field: "limits",
        reason: e.to_string(),
    })?;
    let mut order: Vec<usize> = (0..trace.len()).collect();
    order.sort_by(|&a, &b| trace[a].arrival.total_cmp(&trace[b].arrival));
    let mut next = 0; // into `order`
    let mut now = 0.0f64;
    let mut run = ServingRun {
        steps: Vec::new(),
        ttft: vec![None; trace.len()],
        finished: vec![None; trace.len()],
        refused: Vec::new(),
        drafted: 0,
        accepted: 0,
    };
    let mut produced = vec![0usize; trace.len()];
    // Each round feeds at least one token or admits nothing new: bounded by the tokens.
    let bound: usize = trace
        .iter()
        .map(|r| r.prompt_len + r.output_len + 2)
        .sum::<usize>()
        + 2 * trace.len()
        + 16;
    for _ in 0..bound {
        while next < order.len() && trace[order[next]].arrival <= now {
            let i = order[next];
            let r = trace[i];
            let req = Request {
                seq: i as u64,
                prompt_len: r.prompt_len,
                max_new_tokens: r.output_len,
            };
            if let Err(e) = sched.submit(now, req) {
                run.refused.push((i, e.to_string()));
            }
            next += 1;
        }
        if sched.is_idle() {
            match order.get(next) {
                Some(&i) => {
                    now = now.max(trace[i].arrival);
                    continue;
                }
                None => return Ok(run),
            }
        }
        if spec.is_some() {
            for &i in &order[..next] {
                let d = spec_of(i).k;
                if d > 0 && run.finished[i].is_none() {
                    sched.set_drafts(i as u64, d);
                }
            }
        }
        let mut ran = false;
        for action in sched.poll(now) {
            let Action::Run(step) = action else { continue };
            ran = true;
            let start = now;
            now += step_time(&step).max(0.0);
            let mut results = Vec::new();
            for item in step.items.iter().filter(|i| i.sample) {
                let k = item.seq as usize;
                let Some(r) = trace.get(k) else { continue };
                // a decode item of 1 + d positions keeps 1 + (leading drafts accepted)
                let drafts = if item.start >= r.prompt_len {
                    item.len.saturating_sub(1)
                } else {
                    0
                };
                let alpha = match spec_of(k).acceptance {
                    a if a.is_finite() => a.clamp(0.0, 1.0),
                    _ => 0.0,
                };
                let accepted = (0..drafts).take_while(|_| rng.gen_bool(alpha)).count();
                run.drafted += drafts as u64;
                run.accepted += accepted as u64;
                let kept = 1 + accepted;
                results.push(SeqResult {
                    seq: item.seq,
                    outcome: if kept == 1 {
                        Outcome::Continue
                    } else {
                        Outcome::Kept(kept)
                    },
                });
                if let Some(p) = produced.get_mut(k) {
                    let before = *p;
                    *p += kept;
                    if before == 0 {
                        run.ttft[k] = Some(now - r.arrival);
                    }
                    if before < r.output_len && *p >= r.output_len {
                        run.finished[k] = Some(now);
                    }
                }
            }
            sched
                .on_step_done(now, step.id, &results)
                .map_err(|e| SimError::Invalid {
                    field: "trace",
                    reason: e.to_string(),
                })?;
            let kept = results
                .iter()
                .map(|r| match r.outcome {
                    Outcome::Kept(n) => n,
                    _ => 1,
                })
                .sum();
            run.steps.push(StepRecord {
                start,
                end: now,
                items: step.items,
                kept,
            });
        }
        sched.poll_releases();
        if !ran {
            // Nothing could run (cannot happen under the scheduler's admission rule): wait
            // for the next arrival, or stop.
            match order.get(next) {
                Some(&i) => now = now.max(trace[i].arrival),
                None => break,
            }
        }
    }
    Err(SimError::Invalid {
        field: "trace",
        reason: "the serving trace did not finish within its bound".into(),
    })
}

/// A step's time from per-step and per-token costs: `fixed_s + per_token_s × tokens`, the
/// shape of the cost model's batched step on one device (weights read once, compute per
/// token).
pub fn linear_step_time(fixed_s: f64, per_token_s: f64) -> impl Fn(&Step) -> f64 {
    move |s: &Step| fixed_s + per_token_s * s.tokens() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        let mut l = Limits::one_device(u64::MAX, 1);
        l.prefill_chunk = 4;
        l.max_batch_tokens = 8;
        l
    }

    #[test]
    fn a_short_request_behind_a_long_prompt_gets_its_token_within_two_steps() {
        let trace = [
            TraceRequest {
                arrival: 0.0,
                prompt_len: 64,
                output_len: 2,
            },
            TraceRequest {
                arrival: 0.0005,
                prompt_len: 2,
                output_len: 2,
            },
        ];
        let cost = linear_step_time(0.001, 0.0001);
        let run = simulate_serving(limits(), &trace, &cost).unwrap();
        let step = 0.001 + 0.0001 * 8.0;
        let ttft = run.ttft[1].unwrap();
        assert!(
            ttft < 2.0 * step + 1e-9,
            "{ttft} vs {step}: {:?}",
            run.steps
        );
        assert!(run.finished.iter().all(Option::is_some), "{run:?}");
        // every step within the limits, time moves forward
        for w in run.steps.windows(2) {
            assert!(w[0].end <= w[1].start + 1e-12);
        }
        assert!(run
            .steps
            .iter()
            .all(|s| s.items.iter().map(|i| i.len).sum::<usize>() <= 8));
    }

    #[test]
    fn every_request_produces_its_output_and_idle_gaps_jump_to_the_next_arrival() {
        let trace: Vec<TraceRequest> = (0..6)
            .map(|i| TraceRequest {
                arrival: i as f64 * 0.5,
                prompt_len: 3 + i,
                output_len: 2 + i % 3,
            })
            .collect();
        let cost = linear_step_time(0.01, 0.0);
        let run = simulate_serving(limits(), &trace, &cost).unwrap();
        let sampled = |k: u64| {
            run.steps
                .iter()
                .flat_map(|s| &s.items)
                .filter(|i| i.seq == k && i.sample)
                .count()
        };
        for (k, r) in trace.iter().enumerate() {
            assert_eq!(sampled(k as u64), r.output_len);
            assert!(run.finished[k].unwrap() >= r.arrival);
        }
        // the last request starts at its arrival, not before
        let last_start = run
            .steps
            .iter()
            .find(|s| s.items.iter().any(|i| i.seq == 5))
            .unwrap()
            .start;
        assert!((last_start - 2.5).abs() < 1e-9, "{last_start}");
    }
}
