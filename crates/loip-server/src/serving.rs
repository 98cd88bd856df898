//! The one-device serving loop behind the API: one thread owns a [`Serving`] (the model, its
//! KV cache and the step scheduler) and advances every running request by one batched step at
//! a time; requests reach it over a channel and get their tokens back on their own channel.
//!
//! Invariants:
//! - Each sequence's tokens are those of [`loip_engine::generate`] alone (the batch runner's
//!   invariant): the caller's side of [`Batcher::generate`] sees the same tokens in the same
//!   order and stops where `generate` would (a `Flow::Stop` keeps the current token).
//! - A caller that stops (a stop string, a client gone) cancels its sequence: the scheduler
//!   frees its KV at the next step; tokens the loop made after the stop are dropped. A client
//!   gone before its first token (queued, or in prefill) is noticed within [`WATCH`].
//! - The loop never panics on a request: refusals and step failures go back to the caller
//!   as typed errors, and the loop keeps serving the others.
//! - The loop ends when every [`Batcher`] handle is dropped and nothing is running.
//! - Sequence ids are unique in the process (loops sharing a pipeline never collide).
//! - Requests with the same prompt (the `n` choices of one API request) share its KV where
//!   the backend can fork (the in-memory engine; not yet a device run from slice files or a
//!   cluster): the prompt is computed once, each sequence's tokens are unchanged (see
//!   [`Serving`]).
//! - A request may speculate (prompt lookup, [`Speculation`]): its decode steps carry its
//!   drafts beside the other sequences' tokens, within the step-token limit; its tokens are
//!   still those of `generate` alone without speculation (the engine's batched speculation
//!   invariant), several may come from one step.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use loip_engine::speculate::{SpecOptions, Speculate};
use loip_engine::{
    BatchBackend, EngineError, Flow, GenerateOptions, GenerateOutput, PromptCacheOptions, SeqEvent,
    SeqId, ServeError, Serving, Shaping, StopReason, TokenLogprob,
};
use loip_plan::sched::{Limits, RejectReason};

pub use crate::stats::{DeviceTotals, LoopStats};

/// The session (or device), also after a thread panicked while holding it (its state stays
/// usable: every change to it is one call).
pub fn lock<T>(s: &Mutex<T>) -> MutexGuard<'_, T> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// How often a request waiting for its next token asks whether its client is still there.
pub const WATCH: Duration = Duration::from_millis(50);

/// When a request reaches an idle loop, how long the loop waits for another before its
/// first step: requests arriving within this of each other share that step.
pub const GATHER_GAP: Duration = Duration::from_millis(5);
/// The most an idle loop's first step waits for such a burst.
pub const GATHER_MAX: Duration = Duration::from_millis(30);

/// Most drafts one speculative step may verify (`--speculate-k`): a sliding-window layer of a
/// served model keeps this many positions more than its window, so a rewind never cuts into
/// it.
pub const MAX_DRAFTS: usize = 16;

/// How a request speculates.
#[derive(Debug, Clone, Default)]
pub struct Speculation {
    /// where drafts come from (prompt lookup, or off)
    pub source: Speculate,
    /// draft length and adaptation
    pub opts: SpecOptions,
}

/// What the loop tells one request.
enum Reply {
    /// a new token, with its log-probabilities when asked for
    Token(u32, Option<TokenLogprob>),
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
    /// a device of the cluster is gone or unreachable (the client may retry; the cluster is
    /// re-planned over the others unless told not to)
    #[error("{0}; retry later")]
    Unavailable(String),
    /// the serving loop is gone (it failed to start or stopped)
    #[error("the serving loop stopped")]
    Stopped,
}

/// A request to the serving loop; a few per request, so `Submit` is not boxed.
#[allow(clippy::large_enum_variant)]
enum Cmd {
    Submit {
        seq: SeqId,
        prompt: Vec<u32>,
        opts: GenerateOptions,
        shaping: Shaping,
        spec: Speculation,
        reply: Sender<Reply>,
    },
    Cancel(SeqId),
    PromptCache(PromptCacheOptions),
}

impl DeviceTotals {
    fn add(&mut self, o: &DeviceTotals) {
        self.compute_s += o.compute_s;
        self.load_stall_s += o.load_stall_s;
        self.loaded_bytes += o.loaded_bytes;
    }
}

/// A handle on the serving loop; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct Batcher {
    tx: Sender<Cmd>,
    stats: Arc<Mutex<LoopStats>>,
    /// requests inside [`Batcher::generate`] now
    outstanding: Arc<AtomicUsize>,
    /// the loop's thread, joined by [`Batcher::finish`]
    thread: Arc<Mutex<Option<JoinHandle<()>>>>,
}

/// Counts a request as outstanding while it lives.
struct Outstanding<'a>(&'a AtomicUsize);

impl Drop for Outstanding<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
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
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let mut rx = Some(rx);
                make(&mut |limits, backend| {
                    if let Some(rx) = rx.take() {
                        let side = Rc::new(RefCell::new(Side::default()));
                        let backend = DynBackend {
                            inner: backend,
                            side: side.clone(),
                        };
                        run_loop(limits, backend, &side, rx, &st);
                    }
                });
                // `make` failed before running: callers see `Stopped` (their replies drop).
            })?;
        Ok(Batcher {
            tx,
            stats,
            outstanding: Arc::new(AtomicUsize::new(0)),
            thread: Arc::new(Mutex::new(Some(thread))),
        })
    }

    /// Requests inside [`Batcher::generate`] now (queued or running).
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Drops this handle and, when it was the last one, waits for the loop to end (it ends
    /// once nothing is running), so that what the backend holds is dropped.
    pub fn finish(self) {
        let last = Arc::strong_count(&self.thread) == 1;
        let thread = lock(&self.thread).take();
        drop(self);
        if let (true, Some(t)) = (last, thread) {
            let _ = t.join();
        }
    }

    /// Sets how many finished sequences' KV the loop keeps for later prompts that begin
    /// alike (by default as many as it runs at once; see [`loip_engine::prompt_cache`]).
    pub fn set_prompt_cache(&self, opts: PromptCacheOptions) {
        let _ = self.tx.send(Cmd::PromptCache(opts)); // a stopped loop keeps nothing
    }

    /// The loop's numbers after its last step.
    pub fn stats(&self) -> LoopStats {
        lock(&self.stats).clone()
    }

    /// Runs `prompt` to its end with `opts` as one sequence of the batch (blocking), calling
    /// `on_token` with each new id; `Flow::Stop` ends it there (the token is kept).
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Flow,
    ) -> Result<GenerateOutput, BatchError> {
        self.generate_watched(prompt, opts, on_token, &mut || true)
    }

    /// [`Batcher::generate`] that also asks `alive` every [`WATCH`] while no token comes
    /// (queued, or in a long prefill): once it says no (the client is gone), the sequence is
    /// cancelled and its KV freed, and the output so far is returned (stop reason `Stop`).
    pub fn generate_watched(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Flow,
        alive: &mut dyn FnMut() -> bool,
    ) -> Result<GenerateOutput, BatchError> {
        let mut on_token = |id, _: Option<&TokenLogprob>| on_token(id);
        let plain = Speculation::default();
        self.generate_shaped(
            prompt,
            opts,
            &Shaping::default(),
            &plain,
            &mut on_token,
            alive,
        )
    }

    /// [`Batcher::generate_watched`] with the tokens shaped as `shaping` asks (penalties,
    /// bias) and speculating as `spec` says; `on_token` also gets each token's
    /// log-probabilities when `shaping` asks for them.
    pub fn generate_shaped(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        shaping: &Shaping,
        spec: &Speculation,
        on_token: &mut dyn FnMut(u32, Option<&TokenLogprob>) -> Flow,
        alive: &mut dyn FnMut() -> bool,
    ) -> Result<GenerateOutput, BatchError> {
        // Process-wide ids: several loops (a cluster's micro-batches) share one pipeline,
        // whose devices key the KV cache by sequence id.
        let seq = loip_runtime::coordinator::next_seq_id();
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        let _outstanding = Outstanding(&self.outstanding);
        let (reply, rx) = channel();
        let t0 = Instant::now();
        self.tx
            .send(Cmd::Submit {
                seq,
                prompt: prompt.to_vec(),
                opts: opts.clone(),
                shaping: shaping.clone(),
                spec: spec.clone(),
                reply,
            })
            .map_err(|_| BatchError::Stopped)?;
        let mut new_ids = Vec::new();
        let mut first: Option<Instant> = None;
        let stop = loop {
            match rx.recv_timeout(WATCH) {
                Err(RecvTimeoutError::Timeout) => {
                    if !alive() {
                        let _ = self.tx.send(Cmd::Cancel(seq));
                        break StopReason::Stop;
                    }
                }
                Ok(Reply::Token(id, logprob)) => {
                    first.get_or_insert_with(Instant::now);
                    new_ids.push(id);
                    if on_token(id, logprob.as_ref()) == Flow::Stop {
                        let _ = self.tx.send(Cmd::Cancel(seq));
                        break StopReason::Stop;
                    }
                }
                Ok(Reply::Done(stop)) => break stop,
                Ok(Reply::Failed(e)) => return Err(e),
                Err(RecvTimeoutError::Disconnected) => return Err(BatchError::Stopped),
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

/// [`BatchBackend`] as an object, so one loop serves any backend type, with what the loop
/// reads of a backend besides its steps.
pub trait BatchBackendDyn: BatchBackend {
    /// What the device did since the last call (nothing for a backend that keeps no times).
    fn take_device(&mut self) -> DeviceTotals {
        DeviceTotals::default()
    }
    /// After a failed step: why, when it is that a device is unavailable (the client may
    /// retry), as the client may read it (no addresses).
    fn unavailable(&mut self) -> Option<String> {
        None
    }
}

impl BatchBackendDyn for loip_engine::Generator<'_, '_> {}

impl BatchBackendDyn for loip_runtime::local::LocalModel {
    fn take_device(&mut self) -> DeviceTotals {
        let t = self.device.take_times();
        DeviceTotals {
            compute_s: t.compute_s,
            load_stall_s: t.stall_s,
            loaded_bytes: t.loaded_bytes,
        }
    }
}

/// What a step told the loop besides its events.
#[derive(Default)]
struct Side {
    /// the device's totals since the loop started
    device: DeviceTotals,
    /// a failed step's device-unavailable reason, taken by the loop
    unavailable: Option<String>,
}

/// The backend object as the serving loop's backend; after each step it notes the device's
/// times and a failure's reason in `side` (same thread).
struct DynBackend<'b> {
    inner: &'b mut dyn BatchBackendDyn,
    side: Rc<RefCell<Side>>,
}

impl DynBackend<'_> {
    fn note<T>(&mut self, r: Result<T, EngineError>) -> Result<T, EngineError> {
        let d = self.inner.take_device();
        let mut side = self.side.borrow_mut();
        side.device.add(&d);
        if r.is_err() {
            side.unavailable = self.inner.unavailable();
        }
        r
    }
}

impl BatchBackend for DynBackend<'_> {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[loip_engine::TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let r = self.inner.forward_rows(ids, batch, rows);
        self.note(r)
    }
    fn forward_pick(
        &mut self,
        ids: &[u32],
        batch: &[loip_engine::TokenPos],
        picks: &[loip_engine::RowPick<'_>],
    ) -> Result<Vec<loip_engine::Next>, EngineError> {
        let r = self.inner.forward_pick(ids, batch, picks);
        self.note(r)
    }
    fn release(&mut self, seq: SeqId) {
        self.inner.release(seq)
    }
    fn rewind(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        let r = self.inner.rewind(seq, len);
        self.note(r)
    }
    fn can_rewind(&self) -> bool {
        self.inner.can_rewind()
    }
    fn fork(&mut self, from: SeqId, to: SeqId, len: usize) -> Result<(), EngineError> {
        self.inner.fork(from, to, len) // a refused fork only means a prefill of its own
    }
    fn can_fork(&self) -> bool {
        self.inner.can_fork()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
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
    side: &RefCell<Side>,
    rx: Receiver<Cmd>,
    stats: &Mutex<LoopStats>,
) {
    let kv_budget = limits.devices.first().map_or(u64::MAX, |d| d.budget);
    let keep = PromptCacheOptions::keep(limits.max_seqs);
    let mut serving = match Serving::new(limits, backend) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("loip api: the serving loop cannot start: {e}");
            return;
        }
    };
    serving.set_prompt_cache(keep);
    let start = Instant::now();
    let mut clock = move || start.elapsed().as_secs_f64();
    let mut replies: HashMap<SeqId, Sender<Reply>> = HashMap::new();
    let mut open = true;
    let handle = |cmd: Cmd, serving: &mut Serving<B>, replies: &mut HashMap<_, _>, now| match cmd {
        Cmd::Submit {
            seq,
            prompt,
            opts,
            shaping,
            spec,
            reply,
        } => match serving.submit_speculative(
            now,
            seq,
            &prompt,
            &opts,
            &shaping,
            (spec.source, &spec.opts),
        ) {
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
        Cmd::PromptCache(opts) => serving.set_prompt_cache(opts),
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
            // a burst of requests (clients starting together) runs its prompts in one
            // first step, rather than the first alone and the others a step later
            let t = Instant::now();
            while !serving.is_idle() {
                let left = GATHER_MAX.saturating_sub(t.elapsed());
                if left.is_zero() {
                    break;
                }
                match rx.recv_timeout(GATHER_GAP.min(left)) {
                    Ok(cmd) => handle(cmd, &mut serving, &mut replies, clock()),
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
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
        tracing::trace!(
            at_s = clock(),
            step_ms = step_s * 1e3,
            events = events.len(),
            "serving step"
        );
        // The numbers first, so that a caller who got its last token reads them whole.
        let batch: std::collections::BTreeSet<SeqId> = events
            .iter()
            .filter_map(|ev| match ev {
                SeqEvent::Token { seq, .. } | SeqEvent::Done { seq, .. } => Some(*seq),
                _ => None,
            })
            .collect();
        let unavailable = {
            let mut side = side.borrow_mut();
            let mut s = lock(stats);
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
            s.device = side.device;
            s.spec = serving.spec_totals().to_vec();
            s.shared_tokens = serving.shared_tokens();
            (_, s.prompt_cache_sequences, s.prompt_cache_tokens) = serving.prompt_cache();
            crate::metrics::step(&s, (!batch.is_empty()).then_some(step_s));
            side.unavailable.take()
        };
        for ev in events {
            match ev {
                SeqEvent::Token { seq, id } => {
                    let logprob = serving.take_logprobs(seq).pop();
                    if let Some(r) = replies.get(&seq) {
                        if r.send(Reply::Token(id, logprob)).is_err() {
                            // its caller is gone: free the sequence
                            replies.remove(&seq);
                            serving.cancel(clock(), seq);
                        }
                    }
                }
                SeqEvent::Done { seq, stop, .. } => {
                    if let Some(r) = replies.remove(&seq) {
                        let _ = r.send(Reply::Done(stop));
                    }
                }
                SeqEvent::Failed { seq, error } => {
                    if let Some(r) = replies.remove(&seq) {
                        let e = match &unavailable {
                            Some(why) => BatchError::Unavailable(why.clone()),
                            None => BatchError::Step(error),
                        };
                        let _ = r.send(Reply::Failed(e));
                    }
                }
                SeqEvent::Cancelled { seq } => {
                    replies.remove(&seq);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use loip_engine::{Generator, Model, Next, RowPick, SamplingParams, TokenPos};

    /// The engine, 20 ms a step: a request behind another waits in the queue.
    struct Slow<'m, 'a>(Generator<'m, 'a>);

    impl BatchBackend for Slow<'_, '_> {
        fn forward_rows(
            &mut self,
            ids: &[u32],
            batch: &[TokenPos],
            rows: &[usize],
        ) -> Result<Vec<f32>, EngineError> {
            std::thread::sleep(Duration::from_millis(20));
            self.0.forward_rows(ids, batch, rows)
        }
        fn forward_pick(
            &mut self,
            ids: &[u32],
            batch: &[TokenPos],
            picks: &[RowPick<'_>],
        ) -> Result<Vec<Next>, EngineError> {
            std::thread::sleep(Duration::from_millis(20));
            self.0.forward_pick(ids, batch, picks)
        }
        fn release(&mut self, seq: SeqId) {
            self.0.release(seq)
        }
        fn vocab_size(&self) -> usize {
            self.0.vocab_size()
        }
    }

    impl BatchBackendDyn for Slow<'_, '_> {}

    fn opts(n: usize) -> GenerateOptions {
        GenerateOptions {
            max_tokens: n,
            sampling: SamplingParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                seed: 0,
            },
            eos_ids: Vec::new(),
            min_tokens: n,
        }
    }

    #[test]
    fn a_queued_request_whose_client_left_is_cancelled_before_its_first_token() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny-llama"
        );
        let ckpt = Arc::new(loip_model::Checkpoint::open(std::path::Path::new(dir)).unwrap());
        let batcher = Batcher::start("test-loop", move |run| {
            let model = Model::from_checkpoint(&ckpt).unwrap();
            let mut limits = Limits::one_device(u64::MAX, 1);
            limits.max_seqs = 1;
            limits.max_step_seqs = 1;
            let mut slow = Slow(Generator::new(&model, None));
            run(limits, &mut slow);
        })
        .unwrap();
        let first = batcher.clone();
        let a = std::thread::spawn(move || {
            first.generate(&[1, 2, 3], &opts(20), &mut |_| Flow::Continue)
        });
        // wait until the first request runs, so that the second one queues behind it
        let t = Instant::now();
        while batcher.stats().running == 0 && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(2));
        }
        let t = Instant::now();
        let b = batcher
            .generate_watched(&[4, 5], &opts(20), &mut |_| Flow::Stop, &mut || false)
            .unwrap();
        let waited = t.elapsed();
        assert!(b.new_ids.is_empty(), "{:?}", b.new_ids);
        assert_eq!(b.stop, StopReason::Stop);
        let a = a.join().unwrap().unwrap();
        assert_eq!(a.new_ids.len(), 20);
        assert!(waited < Duration::from_millis(400), "{waited:?}");
        let st = batcher.stats();
        assert_eq!((st.queued, st.running), (0, 0), "{st:?}");
    }
}
