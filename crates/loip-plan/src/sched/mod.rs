//! The step scheduler of continuous batching, as a pure core: requests, step results and a
//! clock go in, decisions come out (raft-rs's `Ready`). No sockets, threads or wall clock:
//! the runtime and the simulator are two drivers of this one type.
//!
//! ```text
//! sched.submit(now, request)?;              // joins the FIFO queue (or is refused with a reason)
//! for action in sched.poll(now) {           // decisions out
//!     Action::Run(step)        => backend runs one forward over step.items, samples the rows
//!                                 with `sample`, then sched.on_step_done(now, step.id, &results)
//!     Action::Release { seq, .. } => backend frees seq's KV (after any step of it in flight)
//! }
//! ```
//!
//! Policy:
//! - Admission is FIFO at step boundaries: the head of the queue is admitted once a sequence
//!   slot is free and its worst-case KV (`prompt + max_new_tokens − 1` tokens) fits every
//!   device. A request that could never fit, even alone, is refused at `submit`; so the head
//!   always fits once the running sequences end, and every running sequence ends within
//!   `max_new_tokens` of its steps: nothing starves and KV never runs out mid-sequence.
//! - A step (one micro-batch) advances a set of sequences that are not in another step in
//!   flight: one decode token for each decoding sequence, a prompt chunk of at most
//!   `prefill_chunk` tokens for each prefilling one (chunked prefill: a long prompt never
//!   holds back another sequence's decode). Sequences are picked least recently served first
//!   (then in admission order), so no running sequence waits more than a bounded number of
//!   steps; prompt tokens are shared out in admission order.
//! - Speculative decoding: a decoding sequence whose driver has `n` drafts ready
//!   ([`Scheduler::set_drafts`]) gets a decode item of up to `1 + n` positions (the pending
//!   token and the drafts to verify), the extra positions taken from the step's spare tokens
//!   like prompt chunks and capped so the step never feeds past the sequence's last wanted
//!   token (`drafts ≤ max_new_tokens − generated − 1`): every position it writes is within
//!   its worst-case reservation, rejected positions included, before the driver drops them.
//!   The driver reports how many new tokens it kept ([`Outcome::Kept`]); the KV then holds
//!   that many more positions.
//! - Up to `max_in_flight` steps are out at once, each of at most `max_step_seqs` sequences
//!   and `max_batch_tokens` tokens (the pipeline's bursty pattern; 1 on one device).
//!
//! Invariants (checked by the tests): no step exceeds its token and sequence limits, running
//! sequences ≤ `max_seqs`, steps in flight ≤ `max_in_flight`, reserved KV ≤ budget on every
//! device, a sequence is in at most one step in flight, and a released sequence holds no KV.

mod kv;

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use kv::{KvDevice, KvLedger, KvUsage};

/// Seconds since the driver's start (a virtual clock in the simulator and the tests).
pub type Time = f64;
/// A sequence (request) id, chosen by the driver.
pub type SeqId = u64;
/// A step id, chosen by the scheduler (1, 2, …).
pub type StepId = u64;

/// The scheduler's limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// most tokens in one step (micro-batch) // tokens
    pub max_batch_tokens: usize,
    /// most sequences in one step
    pub max_step_seqs: usize,
    /// most admitted (running) sequences
    pub max_seqs: usize,
    /// most prompt tokens of one sequence in one step // tokens
    pub prefill_chunk: usize,
    /// most steps in flight at once (1 on one device; the pipeline's micro-batches)
    pub max_in_flight: usize,
    /// most queued requests; more are refused
    pub max_queue: usize,
    /// the model's context limit: a sequence feeds positions `0..prompt + max_new − 1` // tokens
    pub max_seq_len: Option<usize>,
    /// the KV devices (one for a single device; one per pipeline device)
    pub devices: Vec<KvDevice>,
}

impl Limits {
    /// Limits for one device with a KV budget (bytes) and cost (bytes per token).
    pub fn one_device(budget: u64, bytes_per_token: u64) -> Limits {
        Limits {
            max_batch_tokens: 512,
            max_step_seqs: 8,
            max_seqs: 8,
            prefill_chunk: 256,
            max_in_flight: 1,
            max_queue: 1024,
            max_seq_len: None,
            devices: vec![KvDevice {
                budget,
                bytes_per_token,
            }],
        }
    }

    /// Rejects a zero limit, naming it.
    pub fn validate(&self) -> Result<(), SchedError> {
        let fields = [
            ("max_batch_tokens", self.max_batch_tokens),
            ("max_step_seqs", self.max_step_seqs),
            ("max_seqs", self.max_seqs),
            ("prefill_chunk", self.prefill_chunk),
            ("max_in_flight", self.max_in_flight),
        ];
        for (field, v) in fields {
            if v == 0 {
                return Err(SchedError::BadLimit(field));
            }
        }
        if self.max_seq_len == Some(0) {
            return Err(SchedError::BadLimit("max_seq_len"));
        }
        Ok(())
    }
}

/// A request as the scheduler sees it: lengths only (the driver keeps the tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// the driver's id for it
    pub seq: SeqId,
    /// prompt tokens // tokens
    pub prompt_len: usize,
    /// most new tokens // tokens
    pub max_new_tokens: usize,
}

impl Request {
    /// The most tokens this sequence can cache: every prompt token and every sampled token
    /// but the last.
    pub fn kv_tokens(&self) -> u64 {
        (self.prompt_len as u64 + self.max_new_tokens as u64).saturating_sub(1)
    }
}

/// One sequence's part of a step: feed its tokens at positions `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepItem {
    /// the sequence
    pub seq: SeqId,
    /// position of the first token fed
    pub start: usize,
    /// tokens fed // tokens
    pub len: usize,
    /// whether the last fed token's logits are sampled for a new token (a decode token, or
    /// the last chunk of the prompt)
    pub sample: bool,
}

/// One step (micro-batch): a set of sequences advanced by one forward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// the step's id, for [`Scheduler::on_step_done`]
    pub id: StepId,
    /// its sequences, each at most once
    pub items: Vec<StepItem>,
}

impl Step {
    /// Tokens fed in this step.
    pub fn tokens(&self) -> usize {
        self.items.iter().map(|i| i.len).sum()
    }
}

/// What the driver made of a sampled row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// a new token was kept: the sequence goes on (unless it reached `max_new_tokens`)
    Continue,
    /// a decode item of several positions (speculative) kept this many new tokens (at least
    /// 1: the pending token's successor, after any accepted drafts); its KV holds that many
    /// more positions, the rejected ones dropped by the driver
    Kept(usize),
    /// the sequence ended (EOS, a stop string, the caller hung up)
    Stop,
    /// running the sequence failed
    Failed,
}

/// One sampled row's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqResult {
    /// the sequence
    pub seq: SeqId,
    /// what happened
    pub outcome: Outcome,
}

/// Why a sequence was released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EndReason {
    /// it produced `max_new_tokens`
    Length,
    /// the driver reported [`Outcome::Stop`]
    Stopped,
    /// the driver reported [`Outcome::Failed`], or no outcome for a sampled row
    Failed,
    /// [`Scheduler::cancel`]
    Cancelled,
}

/// A decision for the driver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Action {
    /// run this step, then report it with [`Scheduler::on_step_done`]
    Run(Step),
    /// the sequence is over: free its KV (its reservation is already free here)
    Release {
        /// the sequence
        seq: SeqId,
        /// why
        reason: EndReason,
        /// tokens it produced
        generated: usize,
    },
}

/// Why a request was refused at [`Scheduler::submit`].
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum RejectReason {
    /// the prompt has no tokens
    #[error("the prompt has no tokens")]
    EmptyPrompt,
    /// `max_new_tokens` is 0
    #[error("max_new_tokens must be at least 1")]
    NoNewTokens,
    /// the sequence id is queued or running already
    #[error("sequence {0} is already queued or running")]
    Duplicate(SeqId),
    /// the context limit
    #[error("prompt and new tokens need {needed} positions, the model allows {limit}")]
    TooLong {
        /// positions needed
        needed: u64,
        /// the limit
        limit: usize,
    },
    /// its KV would not fit a device even alone
    #[error("its KV cache of {tokens} tokens would exceed a device's KV budget even alone")]
    NeverFits {
        /// tokens it could cache
        tokens: u64,
    },
    /// the queue is full
    #[error("the queue is full ({0} requests)")]
    QueueFull(usize),
}

/// Errors of the scheduler's inputs.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SchedError {
    /// a limit is zero
    #[error("scheduler limit `{0}` must be at least 1")]
    BadLimit(&'static str),
    /// a step that is not in flight
    #[error("step {0} is not in flight")]
    UnknownStep(StepId),
}

/// One admitted sequence.
#[derive(Debug, Clone)]
struct Running {
    req: Request,
    order: u64,                // admission order
    fed: usize,                // tokens in the KV cache // tokens
    generated: usize,          // tokens sampled and kept // tokens
    busy: bool,                // in a step in flight
    last_served: StepId,       // last step it was in (0: none)
    arrived: Time,             // seconds
    first_token: Option<Time>, // seconds
    drafts: usize,             // drafts ready for the next decode item
}

/// What the scheduler knows of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SeqInfo {
    /// when it was submitted // seconds
    pub arrived: Time,
    /// when its first token was reported // seconds
    pub first_token: Option<Time>,
    /// prompt tokens fed so far // tokens
    pub fed: usize,
    /// tokens produced so far // tokens
    pub generated: usize,
}

/// The scheduler's state in numbers (for `/health` and metrics).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedStats {
    /// requests waiting for admission
    pub queued: usize,
    /// admitted sequences
    pub running: usize,
    /// steps in flight
    pub in_flight: usize,
    /// per device KV bytes
    pub kv: Vec<KvUsage>,
}

/// The step scheduler (see the module docs).
#[derive(Debug, Clone)]
pub struct Scheduler {
    limits: Limits,
    queue: VecDeque<(Request, Time)>,
    running: BTreeMap<SeqId, Running>,
    in_flight: BTreeMap<StepId, Step>,
    ledger: KvLedger,
    pending: Vec<Action>, // releases decided since the last poll
    next_step: StepId,
    next_order: u64,
    now: Time, // latest time seen // seconds
}

impl Scheduler {
    /// A scheduler under validated `limits`.
    pub fn new(limits: Limits) -> Result<Scheduler, SchedError> {
        limits.validate()?;
        Ok(Scheduler {
            ledger: KvLedger::new(limits.devices.clone()),
            limits,
            queue: VecDeque::new(),
            running: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            pending: Vec::new(),
            next_step: 1,
            next_order: 0,
            now: 0.0,
        })
    }

    /// The limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    fn tick(&mut self, now: Time) {
        if now.is_finite() && now > self.now {
            self.now = now;
        }
    }

    /// Queues a request at `now`, or refuses it with the reason.
    pub fn submit(&mut self, now: Time, req: Request) -> Result<(), RejectReason> {
        self.tick(now);
        if req.prompt_len == 0 {
            return Err(RejectReason::EmptyPrompt);
        }
        if req.max_new_tokens == 0 {
            return Err(RejectReason::NoNewTokens);
        }
        let in_flight = |s: &Step| s.items.iter().any(|i| i.seq == req.seq);
        if self.running.contains_key(&req.seq)
            || self.queue.iter().any(|(r, _)| r.seq == req.seq)
            || self.in_flight.values().any(in_flight)
        {
            return Err(RejectReason::Duplicate(req.seq));
        }
        let tokens = req.kv_tokens();
        if let Some(limit) = self.limits.max_seq_len {
            if tokens > limit as u64 {
                return Err(RejectReason::TooLong {
                    needed: tokens,
                    limit,
                });
            }
        }
        if !self.ledger.could_fit(tokens) {
            return Err(RejectReason::NeverFits { tokens });
        }
        if self.queue.len() >= self.limits.max_queue {
            return Err(RejectReason::QueueFull(self.limits.max_queue));
        }
        self.queue.push_back((req, self.now));
        Ok(())
    }

    /// Ends `seq` at once, queued or running: its KV is free now, and a [`Action::Release`]
    /// follows at the next poll. Its part of a step in flight is ignored when that step is
    /// reported. Returns whether the sequence was known.
    pub fn cancel(&mut self, now: Time, seq: SeqId) -> bool {
        self.tick(now);
        if let Some(i) = self.queue.iter().position(|(r, _)| r.seq == seq) {
            self.queue.remove(i);
            self.release(seq, EndReason::Cancelled, 0);
            return true;
        }
        match self.running.remove(&seq) {
            Some(r) => {
                self.release(seq, EndReason::Cancelled, r.generated);
                true
            }
            None => false,
        }
    }

    fn release(&mut self, seq: SeqId, reason: EndReason, generated: usize) {
        self.running.remove(&seq);
        self.ledger.release(seq);
        self.pending.push(Action::Release {
            seq,
            reason,
            generated,
        });
    }

    /// Reports step `step` done at `now`, with the outcome of each sampled row.
    pub fn on_step_done(
        &mut self,
        now: Time,
        step: StepId,
        results: &[SeqResult],
    ) -> Result<(), SchedError> {
        self.tick(now);
        let step = self
            .in_flight
            .remove(&step)
            .ok_or(SchedError::UnknownStep(step))?;
        for item in &step.items {
            let Some(r) = self.running.get_mut(&item.seq) else {
                continue; // cancelled meanwhile
            };
            r.busy = false;
            let outcome = results
                .iter()
                .find(|x| x.seq == item.seq)
                .map_or(Outcome::Failed, |x| x.outcome);
            // a decode item keeps one position per new token (rejected drafts are dropped)
            let decode = item.start >= r.req.prompt_len;
            let kept = match outcome {
                Outcome::Kept(n) => n.max(1),
                _ => 1,
            };
            let cached = if decode && item.sample {
                kept.min(item.len)
            } else {
                item.len
            };
            r.fed += cached;
            self.ledger.cache(item.seq, cached as u64);
            if !item.sample {
                continue;
            }
            let generated = r.generated + kept;
            match outcome {
                Outcome::Continue | Outcome::Kept(_) => {
                    r.generated = generated;
                    r.first_token.get_or_insert(self.now);
                    if generated >= r.req.max_new_tokens {
                        self.release(item.seq, EndReason::Length, generated);
                    }
                }
                Outcome::Stop => {
                    let kept = r.generated;
                    self.release(item.seq, EndReason::Stopped, kept);
                }
                Outcome::Failed => {
                    let kept = r.generated;
                    self.release(item.seq, EndReason::Failed, kept);
                }
            }
        }
        Ok(())
    }

    /// The decisions due at `now`: releases decided since the last poll, then new steps
    /// (after admitting what fits), as many as the in-flight limit allows.
    pub fn poll(&mut self, now: Time) -> Vec<Action> {
        self.tick(now);
        let mut out = std::mem::take(&mut self.pending);
        self.admit();
        while self.in_flight.len() < self.limits.max_in_flight {
            let Some(step) = self.next_step() else {
                break;
            };
            self.in_flight.insert(step.id, step.clone());
            out.push(Action::Run(step));
        }
        out
    }

    /// Only the releases decided since the last poll (no admission, no new step): lets a
    /// driver free KV right after a step without starting the next one.
    pub fn poll_releases(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.pending)
    }

    fn admit(&mut self) {
        while let Some(&(req, arrived)) = self.queue.front() {
            if self.running.len() >= self.limits.max_seqs || !self.ledger.fits(req.kv_tokens()) {
                break; // FIFO: the head waits, nobody overtakes it
            }
            self.queue.pop_front();
            self.ledger.reserve(req.seq, req.kv_tokens());
            self.running.insert(
                req.seq,
                Running {
                    req,
                    order: self.next_order,
                    fed: 0,
                    generated: 0,
                    busy: false,
                    last_served: 0,
                    arrived,
                    first_token: None,
                    drafts: 0,
                },
            );
            self.next_order += 1;
        }
    }

    /// Builds the next step from the sequences not in flight, or `None` when there are none.
    fn next_step(&mut self) -> Option<Step> {
        let l = &self.limits;
        let mut ready: Vec<&Running> = self.running.values().filter(|r| !r.busy).collect();
        ready.sort_by_key(|r| (r.last_served, r.order));
        // Every picked sequence gets at least one token.
        let picked = ready.len().min(l.max_step_seqs).min(l.max_batch_tokens);
        if picked == 0 {
            return None;
        }
        let mut picked: Vec<&Running> = ready.into_iter().take(picked).collect();
        picked.sort_by_key(|r| r.order);
        let mut spare = l.max_batch_tokens - picked.len(); // tokens beyond one each
        let items: Vec<StepItem> = picked
            .iter()
            .map(|r| {
                let left = r.req.prompt_len.saturating_sub(r.fed);
                let len = if left == 0 {
                    // decode: the last sampled token, and drafts up to the last wanted token
                    let wanted = r.req.max_new_tokens.saturating_sub(r.generated + 1);
                    let extra = r.drafts.min(wanted).min(spare);
                    spare -= extra;
                    1 + extra
                } else {
                    let extra = (left - 1).min(l.prefill_chunk - 1).min(spare);
                    spare -= extra;
                    1 + extra
                };
                StepItem {
                    seq: r.req.seq,
                    start: r.fed,
                    len,
                    sample: left == 0 || len == left,
                }
            })
            .collect();
        let id = self.next_step;
        self.next_step += 1;
        for item in &items {
            if let Some(r) = self.running.get_mut(&item.seq) {
                r.busy = true;
                r.last_served = id;
                r.drafts = 0;
            }
        }
        Some(Step { id, items })
    }

    /// The driver has `drafts` draft tokens ready for running `seq`'s next decode item
    /// (speculative decoding): that item may carry up to as many more positions (see the
    /// module docs). Holds until the item is built; returns whether `seq` is running.
    pub fn set_drafts(&mut self, seq: SeqId, drafts: usize) -> bool {
        match self.running.get_mut(&seq) {
            Some(r) => {
                r.drafts = drafts;
                true
            }
            None => false,
        }
    }

    /// What the scheduler knows of a queued or running sequence.
    pub fn seq_info(&self, seq: SeqId) -> Option<SeqInfo> {
        if let Some(r) = self.running.get(&seq) {
            return Some(SeqInfo {
                arrived: r.arrived,
                first_token: r.first_token,
                fed: r.fed,
                generated: r.generated,
            });
        }
        self.queue
            .iter()
            .find(|(r, _)| r.seq == seq)
            .map(|&(_, arrived)| SeqInfo {
                arrived,
                first_token: None,
                fed: 0,
                generated: 0,
            })
    }

    /// Queue depth, running sequences, steps in flight and KV bytes per device.
    pub fn stats(&self) -> SchedStats {
        SchedStats {
            queued: self.queue.len(),
            running: self.running.len(),
            in_flight: self.in_flight.len(),
            kv: self.ledger.usage(),
        }
    }

    /// Whether nothing is queued, running or in flight.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty() && self.in_flight.is_empty()
    }
}
