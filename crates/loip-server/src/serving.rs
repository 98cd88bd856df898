//! The one-device serving loop behind the API: one thread owns a [`Serving`] (the model, its
//! KV cache and the step scheduler) and advances every running request by one batched step at
//! a time; requests reach it over a channel and get their tokens back on their own channel.
//!
//! Invariants:
//! - Each sequence's tokens are those of [`loip_engine::generate`] alone (the batch runner's
//!   invariant): the caller's side of [`Batcher::generate`] sees the same tokens in the same
//!   order and stops where `generate` would (a `Flow::Stop` keeps the current token).
//! - A caller that stops (a stop string, a client gone) cancels its sequence: the scheduler
//!   frees its KV at the next step; tokens the loop made after the stop are dropped.
//! - The loop never panics on a request: refusals and step failures go back to the caller
//!   as typed errors, and the loop keeps serving the others.
//! - The loop ends when every [`Batcher`] handle is dropped and nothing is running.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use loip_engine::{
    BatchBackend, EngineError, Flow, GenerateOptions, GenerateOutput, SeqEvent, SeqId, ServeError,
    Serving, StopReason,
};
use loip_plan::sched::{Limits, RejectReason};

/// What the loop tells one request.
enum Reply {
    /// a new token
    Token(u32),
    /// the sequence ended by itself
    Done(StopReason),
    /// refused or failed
    Failed(BatchError),
}

/// Why a batched request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// the scheduler refused it: its queue is full (retry later)
    #[error("the server is busy: {0}")]
    Busy(String),
    /// the request cannot run (too long for the KV budget, a bad token id, …)
    #[error("{0}")]
    Refused(String),
    /// a step failed
    #[error("the step failed: {0}")]
    Step(String),
    /// the serving loop is gone (it failed to start or stopped)
    #[error("the serving loop stopped")]
    Stopped,
}

enum Cmd {
    Submit {
        seq: SeqId,
        prompt: Vec<u32>,
        opts: GenerateOptions,
        reply: Sender<Reply>,
    },
    Cancel(SeqId),
}

/// What `/health` and `/metrics` read of the loop, updated after each step.
#[derive(Debug, Clone, Default)]
pub struct LoopStats {
    /// requests waiting for admission
    pub queued: usize,
    /// admitted sequences
    pub running: usize,
    /// KV bytes written by the running sequences  // bytes
    pub kv_used: u64,
    /// KV bytes promised to the running sequences (their worst case)  // bytes
    pub kv_reserved: u64,
    /// sequences in the last step
    pub last_batch: usize,
    /// steps run
    pub steps: u64,
    /// seconds spent in steps, all together  // s
    pub step_s: f64,
    /// the KV budget of the device  // bytes (u64::MAX: unlimited)
    pub kv_budget: u64,
}

/// A handle on the serving loop; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct Batcher {
    tx: Sender<Cmd>,
    stats: Arc<Mutex<LoopStats>>,
    next: Arc<AtomicU64>,
}

impl Batcher {
    /// Starts the loop on its own thread; `make` builds the backend there (it may borrow what
    /// the closure owns, e.g. a checkpoint) and hands it to `run` with the limits.
    pub fn start<F>(name: &str, make: F) -> Result<Batcher, std::io::Error>
    where
        F: FnOnce(&mut dyn FnMut(Limits, &mut dyn BatchBackendDyn)) + Send + 'static,
    {
        let (tx, rx) = channel::<Cmd>();
        let stats = Arc::new(Mutex::new(LoopStats::default()));
        let st = stats.clone();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let mut rx = Some(rx);
                make(&mut |limits, backend| {
                    if let Some(rx) = rx.take() {
                        run_loop(limits, DynBackend(backend), rx, &st);
                    }
                });
                // `make` failed before running: callers see `Stopped` (their replies drop).
            })?;
        Ok(Batcher {
            tx,
            stats,
            next: Arc::new(AtomicU64::new(1)),
        })
    }

    /// The loop's numbers after its last step.
    pub fn stats(&self) -> LoopStats {
        crate::backend::lock(&self.stats).clone()
    }

    /// Runs `prompt` to its end with `opts` as one sequence of the batch (blocking), calling
    /// `on_token` with each new id; `Flow::Stop` ends it there (the token is kept).
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Flow,
    ) -> Result<GenerateOutput, BatchError> {
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = channel();
        let t0 = Instant::now();
        self.tx
            .send(Cmd::Submit {
                seq,
                prompt: prompt.to_vec(),
                opts: opts.clone(),
                reply,
            })
            .map_err(|_| BatchError::Stopped)?;
        let mut new_ids = Vec::new();
        let mut first: Option<Instant> = None;
        let stop = loop {
            match rx.recv() {
                Ok(Reply::Token(id)) => {
                    first.get_or_insert_with(Instant::now);
                    new_ids.push(id);
                    if on_token(id) == Flow::Stop {
                        let _ = self.tx.send(Cmd::Cancel(seq));
                        break StopReason::Stop;
                    }
                }
                Ok(Reply::Done(stop)) => break stop,
                Ok(Reply::Failed(e)) => return Err(e),
                Err(_) => return Err(BatchError::Stopped),
            }
        };
        let first = first.unwrap_or_else(Instant::now);
        let decode = new_ids.len().saturating_sub(1);
        Ok(GenerateOutput {
            new_ids,
            stop,
            prompt_ms: (first - t0).as_secs_f64() * 1e3,
            decode_ms_per_token: if decode == 0 {
                0.0
            } else {
                first.elapsed().as_secs_f64() * 1e3 / decode as f64
            },
        })
    }
}

/// [`BatchBackend`] as an object, so one loop serves any backend type.
pub trait BatchBackendDyn {
    /// see [`BatchBackend::forward_pick`]
    fn pick(
        &mut self,
        ids: &[u32],
        batch: &[loip_engine::TokenPos],
        picks: &[loip_engine::RowPick<'_>],
    ) -> Result<Vec<loip_engine::Next>, EngineError>;
    /// see [`BatchBackend::release`]
    fn free(&mut self, seq: SeqId);
    /// see [`BatchBackend::vocab_size`]
    fn vocab(&self) -> usize;
}

impl<B: BatchBackend> BatchBackendDyn for B {
    fn pick(
        &mut self,
        ids: &[u32],
        batch: &[loip_engine::TokenPos],
        picks: &[loip_engine::RowPick<'_>],
    ) -> Result<Vec<loip_engine::Next>, EngineError> {
        self.forward_pick(ids, batch, picks)
    }
    fn free(&mut self, seq: SeqId) {
        self.release(seq)
    }
    fn vocab(&self) -> usize {
        self.vocab_size()
    }
}

struct DynBackend<'b>(&'b mut dyn BatchBackendDyn);

impl BatchBackend for DynBackend<'_> {
    fn forward_rows(
        &mut self,
        _ids: &[u32],
        _batch: &[loip_engine::TokenPos],
        _rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        Err(EngineError::Backend(
            "rows are picked by the backend".into(),
        ))
    }
    fn forward_pick(
        &mut self,
        ids: &[u32],
        batch: &[loip_engine::TokenPos],
        picks: &[loip_engine::RowPick<'_>],
    ) -> Result<Vec<loip_engine::Next>, EngineError> {
        self.0.pick(ids, batch, picks)
    }
    fn release(&mut self, seq: SeqId) {
        self.0.free(seq)
    }
    fn vocab_size(&self) -> usize {
        self.0.vocab()
    }
}

fn serve_error(e: ServeError) -> BatchError {
    match e {
        ServeError::Rejected(r @ RejectReason::QueueFull(_)) => BatchError::Busy(r.to_string()),
        ServeError::Rejected(r) => BatchError::Refused(r.to_string()),
        ServeError::Engine(e) => BatchError::Refused(e.to_string()),
        e => BatchError::Step(e.to_string()),
    }
}

fn run_loop<B: BatchBackend>(
    limits: Limits,
    backend: B,
    rx: Receiver<Cmd>,
    stats: &Mutex<LoopStats>,
) {
    let kv_budget = limits.devices.first().map_or(u64::MAX, |d| d.budget);
    let mut serving = match Serving::new(limits, backend) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("loip api: the serving loop cannot start: {e}");
            return;
        }
    };
    let start = Instant::now();
    let mut clock = move || start.elapsed().as_secs_f64();
    let mut replies: HashMap<SeqId, Sender<Reply>> = HashMap::new();
    let mut open = true;
    let handle = |cmd: Cmd, serving: &mut Serving<B>, replies: &mut HashMap<_, _>, now| match cmd {
        Cmd::Submit {
            seq,
            prompt,
            opts,
            reply,
        } => match serving.submit(now, seq, &prompt, &opts) {
            Ok(()) => {
                replies.insert(seq, reply);
            }
            Err(e) => {
                let _ = reply.send(Reply::Failed(serve_error(e)));
            }
        },
        Cmd::Cancel(seq) => {
            replies.remove(&seq);
            serving.cancel(now, seq);
        }
    };
    loop {
        if serving.is_idle() {
            if !open {
                return;
            }
            match rx.recv() {
                Ok(cmd) => handle(cmd, &mut serving, &mut replies, clock()),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(cmd) => handle(cmd, &mut serving, &mut replies, clock()),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let t = Instant::now();
        let events = match serving.step(&mut clock) {
            Ok(ev) => ev,
            Err(e) => {
                // The scheduler's state is broken: fail everyone and stop.
                eprintln!("loip api: the serving loop failed: {e}");
                for (_, r) in replies.drain() {
                    let _ = r.send(Reply::Failed(BatchError::Step(e.to_string())));
                }
                return;
            }
        };
        let step_s = t.elapsed().as_secs_f64();
        let mut batch = std::collections::BTreeSet::new();
        for ev in events {
            match ev {
                SeqEvent::Token { seq, id } => {
                    batch.insert(seq);
                    if let Some(r) = replies.get(&seq) {
                        if r.send(Reply::Token(id)).is_err() {
                            // its caller is gone: free the sequence
                            replies.remove(&seq);
                            serving.cancel(clock(), seq);
                        }
                    }
                }
                SeqEvent::Done { seq, stop, .. } => {
                    batch.insert(seq);
                    if let Some(r) = replies.remove(&seq) {
                        let _ = r.send(Reply::Done(stop));
                    }
                }
                SeqEvent::Failed { seq, error } => {
                    if let Some(r) = replies.remove(&seq) {
                        let _ = r.send(Reply::Failed(BatchError::Step(error)));
                    }
                }
                SeqEvent::Cancelled { seq } => {
                    replies.remove(&seq);
                }
            }
        }
        let mut s = crate::backend::lock(stats);
        let st = serving.stats();
        s.queued = st.queued;
        s.running = st.running;
        s.kv_used = st.kv.iter().map(|k| k.used).sum();
        s.kv_reserved = st.kv.iter().map(|k| k.reserved).sum();
        if !batch.is_empty() {
            s.last_batch = batch.len();
            s.steps += 1;
            s.step_s += step_s;
        }
        s.kv_budget = kv_budget;
        crate::metrics::step(&s, (!batch.is_empty()).then_some(step_s));
    }
}
