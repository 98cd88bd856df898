//! The synchronous serving loop of one device: the pure step scheduler
//! ([`loip_plan::sched::Scheduler`]) driving a [`BatchRunner`].
//!
//! Requests join at step boundaries; each [`Serving::step`] polls the scheduler, runs each
//! step it decides as ONE forward over all its sequences' tokens, reports the outcomes back
//! and frees released sequences' KV at once. Time is an input (`clock`): the runtime passes
//! seconds since its start, tests a virtual clock.
//!
//! Speculating sequences (prompt lookup, [`Serving::submit_speculative`]) share steps with
//! plain ones: before each poll the runner prepares their drafts and the scheduler may give
//! a decode item the pending token plus those drafts, within the step's token limit; the
//! kept tokens are reported back and the rejected positions' KV dropped.
//!
//! Invariant: the scheduler's KV reservation (worst case per sequence) is within the same
//! budget as the backend's cache, so an admitted sequence never fails for KV mid-way; and a
//! sequence's tokens are those of [`generate`](crate::generate()) alone (see [`crate::batch`]).

use loip_plan::sched::{
    Action, EndReason, KvDevice, Limits, Outcome, RejectReason, Request, SchedError, SchedStats,
    Scheduler, SeqResult, Time,
};
use thiserror::Error;

use crate::batch::{BatchBackend, BatchRunner, Feed, SeqEvent};
use crate::forward::Model;
use crate::generate::{GenerateOptions, StopReason};
use crate::kv::SeqId;
use crate::sampling::Shaping;
use crate::speculate::adapt::StepCost;
use crate::speculate::{SpecOptions, SpecStats, Speculate};
use crate::EngineError;

/// Errors of the serving loop.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServeError {
    /// the scheduler refused the request
    #[error("request refused: {0}")]
    Rejected(#[from] RejectReason),
    /// the engine refused the request or failed
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// the scheduler's limits or state
    #[error(transparent)]
    Sched(#[from] SchedError),
}

/// Scheduler limits for `model` on one device under an optional KV byte budget: the default
/// batch shape of [`Limits::one_device`], the model's context limit, and its KV cost.
pub fn one_device_limits(model: &Model<'_>, kv_budget: Option<u64>) -> Limits {
    let cfg = &model.tf.cfg;
    let bytes_per_token = 2 * model.tf.kv_dim() as u64 * 4 * cfg.num_layers as u64; // K+V, f32
    let mut limits = Limits::one_device(kv_budget.unwrap_or(u64::MAX), bytes_per_token);
    limits.max_seq_len = Some(cfg.max_position_embeddings);
    limits
}

/// The serving loop: a scheduler and a runner over one backend.
pub struct Serving<B> {
    sched: Scheduler,
    runner: BatchRunner<B>,
    /// the times of its steps by number of positions (speculating sequences' draft lengths)
    cost: StepCost,
}

impl<B: BatchBackend> Serving<B> {
    /// A loop under `limits` over `backend`.
    pub fn new(limits: Limits, backend: B) -> Result<Self, ServeError> {
        let cost = StepCost::new(
            limits.max_batch_tokens,
            SpecOptions::default().prior_per_row,
        );
        Ok(Serving {
            sched: Scheduler::new(limits)?,
            runner: BatchRunner::new(backend),
            cost,
        })
    }

    /// The runner (its backend holds the KV cache).
    pub fn runner(&self) -> &BatchRunner<B> {
        &self.runner
    }

    /// Queues a request at `now`; it joins a step once admitted.
    pub fn submit(
        &mut self,
        now: Time,
        seq: SeqId,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> Result<(), ServeError> {
        self.submit_shaped(now, seq, prompt, opts, &Shaping::default())
    }

    /// [`Serving::submit`] for a request whose tokens are shaped and whose
    /// log-probabilities are recorded ([`Serving::take_logprobs`]).
    pub fn submit_shaped(
        &mut self,
        now: Time,
        seq: SeqId,
        prompt: &[u32],
        opts: &GenerateOptions,
        shaping: &Shaping,
    ) -> Result<(), ServeError> {
        let off = SpecOptions::default();
        self.submit_speculative(now, seq, prompt, opts, shaping, (Speculate::Off, &off))
    }

    /// [`Serving::submit_shaped`] for a request that speculates as `spec` says (prompt
    /// lookup, or off): its decode steps verify its drafts in the same step as the other
    /// sequences' tokens, each draft counted against the step's token limit.
    pub fn submit_speculative(
        &mut self,
        now: Time,
        seq: SeqId,
        prompt: &[u32],
        opts: &GenerateOptions,
        shaping: &Shaping,
        spec: (Speculate, &SpecOptions),
    ) -> Result<(), ServeError> {
        self.runner.add_shaped(seq, prompt, opts, shaping)?;
        if let Err(e) = self.runner.speculate(seq, spec.0, spec.1) {
            self.runner.release(seq);
            return Err(e.into());
        }
        let req = Request {
            seq,
            prompt_len: prompt.len(),
            max_new_tokens: opts.max_tokens,
        };
        if let Err(e) = self.sched.submit(now, req) {
            self.runner.release(seq);
            return Err(e.into());
        }
        Ok(())
    }

    /// The log-probabilities of `seq`'s tokens kept since the last call.
    pub fn take_logprobs(&mut self, seq: SeqId) -> Vec<crate::TokenLogprob> {
        self.runner.take_logprobs(seq)
    }

    /// Cancels `seq` (queued or running): its KV is freed at the next step, a
    /// [`SeqEvent::Cancelled`] follows. Returns whether it was known.
    pub fn cancel(&mut self, now: Time, seq: SeqId) -> bool {
        self.sched.cancel(now, seq)
    }

    /// One round: applies releases, admits, and runs the steps due (one on one device).
    /// `clock` gives the time at the start and at the end of each step.
    pub fn step(&mut self, clock: &mut dyn FnMut() -> Time) -> Result<Vec<SeqEvent>, ServeError> {
        let mut events = Vec::new();
        for (seq, drafts) in self.runner.drafts_ready(&self.cost) {
            self.sched.set_drafts(seq, drafts);
        }
        let mut t0 = clock(); // a step's start
        let actions = self.sched.poll(t0);
        for action in actions {
            match action {
                Action::Release { seq, reason, .. } => self.release(seq, reason, &mut events),
                Action::Run(step) => {
                    let feeds: Vec<Feed> = step
                        .items
                        .iter()
                        .map(|i| Feed {
                            seq: i.seq,
                            len: i.len,
                        })
                        .collect();
                    let ran = self.runner.run_step(&feeds);
                    let t1 = clock();
                    let results = match ran {
                        Ok(evs) => {
                            self.cost.observe(step.tokens(), t1 - t0);
                            let results = outcomes(&step.items, &evs);
                            events.extend(evs);
                            results
                        }
                        Err(e) => step
                            .items
                            .iter()
                            .map(|i| {
                                events.push(SeqEvent::Failed {
                                    seq: i.seq,
                                    error: e.to_string(),
                                });
                                self.runner.stop(i.seq);
                                SeqResult {
                                    seq: i.seq,
                                    outcome: Outcome::Failed,
                                }
                            })
                            .collect(),
                    };
                    self.sched.on_step_done(t1, step.id, &results)?;
                    t0 = t1;
                }
            }
        }
        // Sequences that ended in this step free their KV now.
        for action in self.sched.poll_releases() {
            if let Action::Release { seq, reason, .. } = action {
                self.release(seq, reason, &mut events);
            }
        }
        Ok(events)
    }

    fn release(&mut self, seq: SeqId, reason: EndReason, events: &mut Vec<SeqEvent>) {
        self.runner.release(seq);
        if reason == EndReason::Cancelled {
            events.push(SeqEvent::Cancelled { seq });
        }
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// The scheduler's numbers: queue, running, KV bytes per device.
    pub fn stats(&self) -> SchedStats {
        self.sched.stats()
    }

    /// What speculation drafted and kept so far, per source.
    pub fn spec_totals(&self) -> &[(Speculate, SpecStats)] {
        self.runner.spec_totals()
    }

    /// The KV devices of the limits.
    pub fn kv_devices(&self) -> &[KvDevice] {
        &self.sched.limits().devices
    }
}

/// The scheduler's view of a step's events: a sampled sequence goes on unless it ended by
/// EOS or a stop (reaching max tokens the scheduler counts itself), with as many new tokens
/// as it kept (several after a speculative step); no event is a failure.
fn outcomes(items: &[loip_plan::sched::StepItem], evs: &[SeqEvent]) -> Vec<SeqResult> {
    items
        .iter()
        .filter(|i| i.sample)
        .map(|i| {
            let mut outcome = Outcome::Failed;
            let mut kept = 0;
            for e in evs {
                match e {
                    SeqEvent::Token { seq, .. } if *seq == i.seq => {
                        kept += 1;
                        outcome = if kept == 1 {
                            Outcome::Continue
                        } else {
                            Outcome::Kept(kept)
                        };
                    }
                    SeqEvent::Done { seq, stop, .. }
                        if *seq == i.seq && *stop != StopReason::Length =>
                    {
                        outcome = Outcome::Stop
                    }
                    _ => {}
                }
            }
            SeqResult {
                seq: i.seq,
                outcome,
            }
        })
        .collect()
}
