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
//! Sequences with the same prompt share its KV where the backend can fork
//! ([`BatchBackend::can_fork`]): a request whose prompt another held sequence has (the `n`
//! choices of one API request) waits until that one has prefilled it, then joins the
//! scheduler; at its first step it takes a copy of that KV for every prompt token but the
//! last and feeds that one itself, so it samples from its own row: the prompt is computed
//! once, and each sequence's tokens and logits stay those of `generate` alone (a token's K
//! and V depend only on the tokens before it). The scheduler counts the whole prompt for it:
//! the copy is made once it is admitted, within its reservation; the prefill tokens the
//! scheduler gives it that the copy holds are not fed. Where the backend cannot fork, or the
//! other sequence is gone by then, it prefills its own prompt.
//!
//! Finished sequences' KV may be kept for later prompts that begin alike
//! ([`Serving::set_prompt_cache`], [`crate::prompt_cache`]): a new prompt takes a copy of the
//! longest beginning a kept sequence shares with it, by the same fork, and the kept KV yields
//! to the scheduler's reservations after every admission.
//!
//! Invariant: the scheduler's KV reservation (worst case per sequence) is within the same
//! budget as the backend's cache, so an admitted sequence never fails for KV mid-way; and a
//! sequence's tokens are those of [`generate`](crate::generate()) alone (see [`crate::batch`]).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use loip_plan::sched::{
    Action, EndReason, KvDevice, Limits, Outcome, RejectReason, Request, SchedError, SchedStats,
    Scheduler, SeqResult, Time,
};
use thiserror::Error;

use crate::batch::{BatchBackend, BatchRunner, Feed, SeqEvent};
use crate::forward::Model;
use crate::generate::{GenerateOptions, StopReason};
use crate::kv::SeqId;
use crate::prompt_cache::{PromptCache, PromptCacheOptions};
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
    /// a hash of each held sequence's prompt (where the backend can fork)
    prompts: HashMap<SeqId, u64>,
    /// sequences waiting for the one whose prompt they share to prefill it, in arrival order
    waiting: Vec<Waiting>,
    /// sequences to fork from another at their first step: (sequence, from)
    fork_from: HashMap<SeqId, SeqId>,
    /// per forked sequence: prefill tokens the scheduler will still schedule that its KV
    /// already holds // tokens
    shared: HashMap<SeqId, usize>,
    /// waiting sequences cancelled, reported at the next step
    cancelled: Vec<SeqId>,
    /// prompt positions copied rather than computed, in all // tokens
    shared_total: u64,
    /// finished sequences whose KV is kept for later prompts
    cache: PromptCache,
}

/// A sequence waiting for `parent` to have prefilled the prompt they share.
struct Waiting {
    parent: SeqId,
    req: Request,
}

fn prompt_key(prompt: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    prompt.hash(&mut h);
    h.finish()
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
            prompts: HashMap::new(),
            waiting: Vec::new(),
            fork_from: HashMap::new(),
            shared: HashMap::new(),
            cancelled: Vec::new(),
            shared_total: 0,
            cache: PromptCache::new(PromptCacheOptions::OFF),
        })
    }

    /// Keeps the KV of finished sequences for later prompts that begin alike, as `opts` says
    /// (off by default; only where the backend can fork). Turning it off frees what it kept.
    pub fn set_prompt_cache(&mut self, opts: PromptCacheOptions) {
        let opts = if self.runner.can_fork() {
            opts
        } else {
            PromptCacheOptions::OFF
        };
        if opts.entries == 0 {
            while let Some(seq) = self.cache.evict_one(|_, _| false) {
                self.runner.release(seq);
            }
        }
        self.cache.set_options(opts);
        self.trim_cache();
    }

    /// The prompt cache's options, entries kept and tokens they hold.
    pub fn prompt_cache(&self) -> (PromptCacheOptions, usize, u64) {
        (self.cache.options(), self.cache.len(), self.cache.tokens())
    }

    /// Drops the oldest kept sequences until the rest fit beside the scheduler's
    /// reservations on every KV device, within the cache's entry count.
    fn trim_cache(&mut self) {
        if self.cache.len() == 0 {
            return;
        }
        let limits = self.sched.limits();
        let kv = self.sched.stats().kv;
        let rooms: Vec<(u64, u64, u64)> = limits
            .devices
            .iter()
            .zip(&kv)
            .map(|(d, k)| {
                // the KV room this loop was sized for: its budget, and no more than its
                // sequences could hold at full length
                let sized = limits.max_seq_len.map_or(u64::MAX, |len| {
                    (limits.max_seqs as u64)
                        .saturating_mul(len as u64)
                        .saturating_mul(d.bytes_per_token)
                });
                (d.budget.min(sized), k.reserved, d.bytes_per_token)
            })
            .collect();
        let max = self.cache.options().entries;
        let fits = |n: usize, tokens: u64| {
            n <= max
                && rooms.iter().all(|&(room, reserved, per)| {
                    reserved.saturating_add(tokens.saturating_mul(per)) <= room
                })
        };
        while let Some(seq) = self.cache.evict_one(fits) {
            self.runner.release(seq);
        }
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
        if self.cache.remove(seq) {
            self.runner.release(seq); // a kept sequence's id given again: its KV goes
        }
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
        if !self.runner.can_fork() || prompt.len() < 2 {
            return self.enqueue(now, req, None);
        }
        let key = prompt_key(prompt);
        let parent = self
            .prompts
            .iter()
            .filter(|&(&p, &k)| k == key && self.runner.knows(p))
            .map(|(&p, _)| p)
            .min();
        self.prompts.insert(seq, key);
        match parent {
            Some(parent) if self.prefilling(parent, prompt.len() - 1) => {
                self.waiting.push(Waiting { parent, req });
                Ok(())
            }
            Some(parent) => self.enqueue(now, req, Some(parent)),
            None => {
                let runner = &self.runner;
                let kept = self.cache.best(prompt, |s| runner.cached_tokens(s));
                self.enqueue(now, req, kept.map(|(s, _)| s))
            }
        }
    }

    /// Whether `parent` (queued, running or itself waiting) is still to cache its first `n`
    /// tokens.
    fn prefilling(&self, parent: SeqId, n: usize) -> bool {
        let held = self.sched.seq_info(parent).is_some()
            || self.waiting.iter().any(|w| w.req.seq == parent);
        held && self
            .runner
            .cached_tokens(parent)
            .is_some_and(|t| t.len() < n)
    }

    /// Hands `req` to the scheduler, to fork from `from` at its first step.
    fn enqueue(&mut self, now: Time, req: Request, from: Option<SeqId>) -> Result<(), ServeError> {
        let seq = req.seq;
        if let Err(e) = self.sched.submit(now, req) {
            self.runner.release(seq);
            self.prompts.remove(&seq);
            return Err(e.into());
        }
        if let Some(from) = from {
            self.fork_from.insert(seq, from);
        }
        Ok(())
    }

    /// The tokens of a step item to feed: none of those a forked sequence's KV holds. A
    /// sequence to fork forks now (it is admitted: the copy is within its reservation).
    fn take_feed(&mut self, seq: SeqId, len: usize) -> usize {
        if let Some(from) = self.fork_from.remove(&seq) {
            if let Ok(n) = self.runner.fork(from, seq) {
                self.shared.insert(seq, n);
                self.shared_total += n as u64;
            }
        }
        let skip = self.shared.get_mut(&seq).map_or(0, |held| {
            let skip = (*held).min(len);
            *held -= skip;
            skip
        });
        len - skip
    }

    /// Hands each waiting sequence whose parent has prefilled their prompt (or is gone) to
    /// the scheduler: with a fork of the parent's KV where it holds the prompt, else alone.
    fn start_waiting(&mut self, now: Time, events: &mut Vec<SeqEvent>) {
        let waiting = std::mem::take(&mut self.waiting);
        for w in waiting {
            let n = w.req.prompt_len - 1;
            if self.prefilling(w.parent, n) {
                self.waiting.push(w);
                continue;
            }
            let seq = w.req.seq;
            if let Err(e) = self.enqueue(now, w.req, Some(w.parent)) {
                events.push(SeqEvent::Failed {
                    seq,
                    error: e.to_string(),
                });
            }
        }
    }

    /// Prompt positions copied from another sequence's KV rather than computed, so far.
    pub fn shared_tokens(&self) -> u64 {
        self.shared_total
    }

    /// The log-probabilities of `seq`'s tokens kept since the last call.
    pub fn take_logprobs(&mut self, seq: SeqId) -> Vec<crate::TokenLogprob> {
        self.runner.take_logprobs(seq)
    }

    /// Cancels `seq` (queued or running): its KV is freed at the next step, a
    /// [`SeqEvent::Cancelled`] follows. Returns whether it was known.
    pub fn cancel(&mut self, now: Time, seq: SeqId) -> bool {
        if let Some(i) = self.waiting.iter().position(|w| w.req.seq == seq) {
            self.waiting.remove(i);
            self.runner.release(seq);
            self.prompts.remove(&seq);
            self.cancelled.push(seq);
            return true;
        }
        self.sched.cancel(now, seq)
    }

    /// One round: applies releases, admits, and runs the steps due (one on one device).
    /// `clock` gives the time at the start and at the end of each step.
    pub fn step(&mut self, clock: &mut dyn FnMut() -> Time) -> Result<Vec<SeqEvent>, ServeError> {
        let mut events: Vec<SeqEvent> = self
            .cancelled
            .drain(..)
            .map(|seq| SeqEvent::Cancelled { seq })
            .collect();
        for (seq, drafts) in self.runner.drafts_ready(&self.cost) {
            self.sched.set_drafts(seq, drafts);
        }
        let mut t0 = clock(); // a step's start
        let actions = self.sched.poll(t0);
        self.trim_cache(); // the kept KV yields to what was just admitted
        for action in actions {
            match action {
                Action::Release { seq, reason, .. } => self.release(seq, reason, &mut events),
                Action::Run(step) => {
                    // a forked sequence's prompt tokens its KV holds are not fed
                    let feeds: Vec<Feed> = step
                        .items
                        .iter()
                        .filter_map(|i| {
                            let len = self.take_feed(i.seq, i.len);
                            (len > 0).then_some(Feed { seq: i.seq, len })
                        })
                        .collect();
                    let ran = self.runner.run_step(&feeds);
                    let t1 = clock();
                    let results = match ran {
                        Ok(evs) => {
                            let fed = feeds.iter().map(|f| f.len).sum();
                            self.cost.observe(fed, t1 - t0);
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
                    self.start_waiting(t1, &mut events);
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
        if !self.waiting.is_empty() {
            // parents released before their prompt was cached: their waiters prefill alone
            let now = clock();
            self.start_waiting(now, &mut events);
        }
        Ok(events)
    }

    fn release(&mut self, seq: SeqId, reason: EndReason, events: &mut Vec<SeqEvent>) {
        self.prompts.remove(&seq);
        self.shared.remove(&seq);
        self.fork_from.remove(&seq);
        let finished = matches!(reason, EndReason::Length | EndReason::Stopped);
        let held = self.runner.cached_tokens(seq).map_or(0, <[u32]>::len);
        // (the cache is off where the backend cannot fork)
        if finished && self.cache.wants(held) {
            self.runner.retire(seq);
            self.cache.insert(seq, held);
            self.trim_cache();
        } else {
            self.runner.release(seq);
        }
        if reason == EndReason::Cancelled {
            events.push(SeqEvent::Cancelled { seq });
        }
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.sched.is_idle() && self.waiting.is_empty() && self.cancelled.is_empty()
    }

    /// The scheduler's numbers: queue (sequences waiting for a shared prompt included),
    /// running, KV bytes per device.
    pub fn stats(&self) -> SchedStats {
        let mut st = self.sched.stats();
        st.queued += self.waiting.len();
        st
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
