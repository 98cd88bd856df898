//! The coordinator's side of the cluster: authenticated connections to the workers (link
//! measurement, slice shipping, probing, loading) and the [`Pipeline`] that runs steps over
//! them.
//!
//! Topology: the coordinator steers, the rows go device to device where they can. Each hop of
//! a step (one device, one or more of its stages) goes to the device that owns it; with
//! direct forwarding ([`HopLinks`], `coordinator/route.rs`) the device before hands it the
//! hidden rows over their peer session and sends the coordinator a small notice, else the
//! coordinator relays (receives the rows and forwards the exact bytes, the star). The last
//! device returns the logits of the requested rows and sampling happens here. Several steps (different sequences) may be in flight at once:
//! each device processes its steps first come, first served, so steps traverse the
//! pipeline one after another (the bursty pattern). A step is a micro-batch: the tokens of
//! one or several sequences ([`Pipeline::step_batch_blocking`]), each row of the head with
//! its own argmax mask, so several micro-batches of several sequences each can be in flight.
//!
//! Faults: a device that closes, errs or stops answering fails every step in flight with an
//! error naming it; the pipeline then refuses new steps (the caller can re-plan over the
//! remaining devices) but the coordinator process keeps running.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use loip_engine::TokenPos;
use serde::Serialize;
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};

use crate::wire::{self, Frame, FrameKind, NetError, ToCoordinator, ToWorker, WireError};
use crate::RuntimeError;

mod adapt_hook;
mod backend;
mod conn;
mod device_stats;
mod handoff;
mod lend;
mod route;
mod split;
mod wave;

pub use backend::PipelineBackend;
pub use conn::{
    coordinator_identity, use_coordinator_identity, wakes_beside, Conn, ConnectOptions, Endpoint,
    LinkStats, OnShip, ShipProgress, ShipStats, KEEPALIVE,
};
pub use device_stats::DeviceStepTotals;
pub use handoff::handoff_s;
pub use lend::LendTotals;
pub use route::{HopLinks, LinkBytes};

/// Errors of the distributed runtime; every network failure names its device.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// Connecting to, talking to or authenticating a device failed.
    #[error(transparent)]
    Net(#[from] NetError),
    /// A device went away; the steps in flight failed.
    #[error("device {device} ({addr}) is gone: {reason}")]
    DeviceGone {
        /// device name
        device: String,
        /// its address
        addr: String,
        /// what happened
        reason: String,
    },
    /// A device could not run a step (the connection is fine).
    #[error("device {device} ({addr}) failed the step: {message}")]
    StepFailed {
        /// device name
        device: String,
        /// its address
        addr: String,
        /// its message
        message: String,
    },
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] loip_plan::PlanError),
    /// A local runtime error.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A bad request or configuration.
    #[error("{0}")]
    Invalid(String),
    /// The pipeline was shut down.
    #[error("the pipeline is shut down")]
    Stopped,
}

/// One visit of a step to a device: stages run back to back there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Hop {
    /// index into the pipeline's devices
    pub device: usize,
    /// the device's local stage indices, in order
    pub stages: Vec<u16>,
    /// embed first (the first hop)
    pub embed: bool,
    /// finish with the head (the last hop)
    pub head: bool,
}

/// The hops of one step, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Route {
    /// hops in execution order
    pub hops: Vec<Hop>,
}

impl Route {
    /// The route of a plan: its stages in round-robin order, consecutive stages on the same
    /// device merged into one hop.
    pub fn from_plan(plan: &loip_plan::Plan) -> Result<Route, ClusterError> {
        let mut hops: Vec<Hop> = Vec::new();
        for r in plan.stage_order() {
            match hops.last_mut() {
                Some(h) if h.device == r.device => h.stages.push(r.stage as u16),
                _ => hops.push(Hop {
                    device: r.device,
                    stages: vec![r.stage as u16],
                    embed: false,
                    head: false,
                }),
            }
        }
        let (Some(first), Some(last)) = (
            hops.first().map(|h| h.device),
            hops.last().map(|h| h.device),
        ) else {
            return Err(ClusterError::Invalid("the plan has no stage".into()));
        };
        if !plan.devices[first].holds_embedding || !plan.devices[last].holds_head {
            return Err(ClusterError::Invalid(
                "the plan's first stage must hold the embedding and its last the head".into(),
            ));
        }
        hops[0].embed = true;
        if let Some(h) = hops.last_mut() {
            h.head = true;
        }
        Ok(Route { hops })
    }
}

/// Time of one step, seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepStats {
    /// tokens in the step
    pub tokens: u64,
    /// from submission to logits  // seconds
    pub wall_s: f64,
    /// block compute on the devices  // seconds
    pub compute_s: f64,
    /// waiting for loads on the devices  // seconds
    pub stall_s: f64,
    /// waiting in device queues behind other sequences  // seconds
    pub queued_s: f64,
    /// everything else: transfers, latency, relaying (wall − time inside the workers)  // seconds
    pub network_s: f64,
    /// the coordinator's own part before the step: from its sequences' previous step's
    /// last hop arriving to this step's dispatch (the caller's wake-up and sampling, the
    /// submission; 0 for a sequence's first step)  // seconds
    pub coordinator_s: f64,
    /// bytes sent and received by the coordinator for this step  // bytes
    pub bytes: u64,
    /// bytes loaded from SSDs  // bytes
    pub loaded_bytes: u64,
}

impl Totals {
    /// What the re-priced prediction is fed: each figure of the `early` steps the mean
    /// without its largest and smallest value ([`loip_plan::calibrate::trimmed_mean`]; one
    /// step of 8 in a burst moves it little); `None` until they are all in.  // seconds
    pub fn early_fed(&self) -> Option<loip_plan::calibrate::WarmupStep> {
        if self.early_steps != u64::from(loip_plan::calibrate::REPRICE_STEPS) {
            return None;
        }
        let of = |f: fn(&StepStats) -> f64| {
            let v: Vec<f64> = self.early.iter().map(f).collect();
            loip_plan::calibrate::trimmed_mean(&v).unwrap_or(0.0)
        };
        Some(loip_plan::calibrate::WarmupStep {
            group: 0,
            wall_s: of(|s| s.wall_s),
            compute_s: of(|s| s.compute_s),
            stall_s: of(|s| s.stall_s),
            coordinator_s: of(|s| s.coordinator_s),
        })
    }
}

impl StepStats {
    fn add(&mut self, o: &StepStats) {
        self.tokens += o.tokens;
        self.wall_s += o.wall_s;
        self.compute_s += o.compute_s;
        self.stall_s += o.stall_s;
        self.queued_s += o.queued_s;
        self.network_s += o.network_s;
        self.coordinator_s += o.coordinator_s;
        self.bytes += o.bytes;
        self.loaded_bytes += o.loaded_bytes;
    }
}

/// Sums over steps, split into prompt steps and one-token (decode) steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Totals {
    /// prompt steps
    pub prompt_steps: u64,
    /// their sums
    pub prompt: StepStats,
    /// decode steps
    pub decode_steps: u64,
    /// their sums
    pub decode: StepStats,
    /// times a step was parked for answered switches (threshold switches, reservations)
    pub switch_parks: u64,
    /// how long those steps were parked: from the first switch sent to the last answer
    /// (inside the parked step's `wall_s`, counted in its `queued_s`: it waits from its
    /// creation to its dispatch)  // seconds
    pub switch_s: f64,
    /// the first [`loip_plan::calibrate::REPRICE_STEPS`] decode steps after the first
    /// [`loip_plan::calibrate::REPRICE_SKIP`] not parked for a switch (what the re-priced
    /// prediction is fed: [`crate::cluster_run::Session::take_totals`]; a parked step's
    /// loads ran on during its park, so its stall is not a step's; a sequence's first
    /// decode step runs about a tenth slower than the next ones)
    pub early_steps: u64,
    /// each of them
    pub early: [StepStats; loip_plan::calibrate::REPRICE_STEPS as usize],
    /// the decode steps up to the last of them, parked ones included
    pub early_span: u64,
    /// their sums (the remaining steps' are the decode sums less these)
    pub span: StepStats,
    /// the cost model's prediction of the decode steps after those, fed the rates they
    /// measured (0: not priced)  // milliseconds
    pub repriced_ms: f64,
}

/// The state of one device of the pipeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceHealth {
    /// who
    pub endpoint: Endpoint,
    /// still connected and answering
    pub alive: bool,
    /// why not
    pub reason: Option<String>,
}

/// Logits of one step and its timing.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// `(rows, vocab)`; empty for an argmax step
    pub logits: Vec<f32>,
    /// an argmax step's `(token id, logit)` per row (see [`Pipeline::step_argmax_blocking`])
    pub argmax: Vec<(u32, f32)>,
    /// timing
    pub stats: StepStats,
}

/// What the last device returns for the head rows of a step.
#[derive(Debug, Clone, Copy)]
pub enum RowsOut<'a> {
    /// each row's logits (`vocab` f32)
    Logits,
    /// each row's argmax after masking `masked` and, when `row_masks` is not empty (then one
    /// list per row), the row's own list: 8 bytes a row
    Argmax {
        /// ids masked in every row
        masked: &'a [u32],
        /// empty, or ids masked in row `i` only
        row_masks: &'a [Vec<u32>],
    },
}

enum Cmd {
    Step {
        batch: Vec<TokenPos>,
        ids: Vec<u32>,
        rows: Vec<u32>,
        argmax: Option<Vec<u32>>,
        row_masks: Vec<Vec<u32>>,
        /// sequences rewound (a split step's part carries its own)
        rewind: Vec<u64>,
        reply: oneshot::Sender<Result<StepOutput, ClusterError>>,
    },
    Release(Vec<u64>),
    /// a sequence keeps its first `len` positions (speculative decoding)
    Rewind(u64, usize),
    /// the session's warm-up is over ([`Pipeline::warmed`])
    Warmed,
    Shutdown(oneshot::Sender<()>),
}

struct Shared {
    health: Mutex<Vec<DeviceHealth>>,
    totals: Mutex<Totals>,
    /// bytes per link (from, to)  // bytes
    links: Mutex<BTreeMap<(String, String), u64>>,
    /// per-device sums and the KV tokens held (never reset)
    devices: Mutex<device_stats::DeviceLedger>,
    /// lent KV fetched back, since the start
    lend: Mutex<LendTotals>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// A running pipeline over connected, loaded workers. Cheap to clone; every clone submits
/// to the same scheduler, so several sequences can be in flight from several threads.
#[derive(Clone)]
pub struct Pipeline {
    tx: mpsc::UnboundedSender<Cmd>,
    shared: Arc<Shared>,
    vocab: usize,
    max_positions: Option<usize>,
}

/// Pipeline limits.
#[derive(Debug, Clone, Copy)]
pub struct PipelineOptions {
    /// a device that holds a step longer than this is declared gone
    pub step_timeout: Duration,
    /// hidden size (checks every hidden output)
    pub hidden: usize,
    /// vocabulary size (checks every logits output)
    pub vocab: usize,
    /// the model's position limit (`max_position_embeddings`), if any: a speculative step
    /// drafts no further // positions
    pub max_positions: Option<usize>,
}

impl Pipeline {
    /// Starts the scheduler on the current tokio runtime over `conns` (in plan device order),
    /// relaying every hop.
    pub fn start(conns: Vec<Conn>, route: Route, opts: PipelineOptions) -> Pipeline {
        Pipeline::start_with(conns, route, opts, HopLinks::default(), None)
    }

    /// [`Pipeline::start`] with each hop's input as `links` says (direct forwarding where the
    /// workers' peer sessions are up, see [`crate::net::direct`]), and online memory
    /// adaptation ([`crate::adapt`]) when `adapt`.
    pub fn start_with(
        conns: Vec<Conn>,
        route: Route,
        opts: PipelineOptions,
        links: HopLinks,
        adapt: Option<crate::adapt::Adapter>,
    ) -> Pipeline {
        let n_devices = conns.len();
        let health = conns
            .iter()
            .map(|c| DeviceHealth {
                endpoint: c.endpoint.clone(),
                alive: true,
                reason: None,
            })
            .collect();
        let shared = Arc::new(Shared {
            health: Mutex::new(health),
            totals: Mutex::new(Totals::default()),
            links: Mutex::new(BTreeMap::new()),
            devices: Mutex::new(device_stats::DeviceLedger::new(n_devices)),
            lend: Mutex::new(LendTotals::default()),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let adapt = adapt.map(|a| adapt_hook::AdaptState::new(a, tx.downgrade()));
        tokio::spawn(scheduler(
            conns,
            route,
            links,
            opts,
            rx,
            shared.clone(),
            adapt,
        ));
        Pipeline {
            tx,
            shared,
            vocab: opts.vocab,
            max_positions: opts.max_positions,
        }
    }

    /// Runs one step of sequence `seq`: `ids` at positions `start_pos..`; returns the logits
    /// of `rows` (indices into `ids`).
    pub async fn step(
        &self,
        seq: u64,
        ids: &[u32],
        start_pos: usize,
        rows: &[u32],
    ) -> Result<StepOutput, ClusterError> {
        let rx = self.submit(seq, ids, start_pos, rows, None)?;
        rx.await.map_err(|_| ClusterError::Stopped)?
    }

    /// [`Pipeline::step`] for a thread outside the runtime.
    pub fn step_blocking(
        &self,
        seq: u64,
        ids: &[u32],
        start_pos: usize,
        rows: &[u32],
    ) -> Result<StepOutput, ClusterError> {
        let rx = self.submit(seq, ids, start_pos, rows, None)?;
        rx.blocking_recv().map_err(|_| ClusterError::Stopped)?
    }

    /// [`Pipeline::step_blocking`] for greedy decoding: the last device returns each row's
    /// argmax after setting the `masked` ids to −∞ (in [`StepOutput::argmax`]), 8 bytes a
    /// row instead of the vocabulary's logits. The same argmax as the engine's sampler on the
    /// same logits, so the tokens are the same.
    pub fn step_argmax_blocking(
        &self,
        seq: u64,
        ids: &[u32],
        start_pos: usize,
        rows: &[u32],
        masked: &[u32],
    ) -> Result<StepOutput, ClusterError> {
        let rx = self.submit(seq, ids, start_pos, rows, Some(masked.to_vec()))?;
        rx.blocking_recv().map_err(|_| ClusterError::Stopped)?
    }

    fn submit(
        &self,
        seq: u64,
        ids: &[u32],
        start_pos: usize,
        rows: &[u32],
        argmax: Option<Vec<u32>>,
    ) -> Result<oneshot::Receiver<Result<StepOutput, ClusterError>>, ClusterError> {
        let batch: Vec<TokenPos> = (0..ids.len())
            .map(|i| TokenPos {
                seq,
                pos: start_pos + i,
            })
            .collect();
        let out = match &argmax {
            Some(m) => RowsOut::Argmax {
                masked: m,
                row_masks: &[],
            },
            None => RowsOut::Logits,
        };
        self.submit_batch(ids, &batch, rows, out)
    }

    /// Runs one micro-batch: `ids[t]` of sequence `batch[t].seq` at `batch[t].pos` (several
    /// sequences, each contiguous from its cached length), and returns `out` for `rows`
    /// (indices into `ids`, typically each sequence's last token).
    pub async fn step_batch(
        &self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[u32],
        out: RowsOut<'_>,
    ) -> Result<StepOutput, ClusterError> {
        let rx = self.submit_batch(ids, batch, rows, out)?;
        rx.await.map_err(|_| ClusterError::Stopped)?
    }

    /// [`Pipeline::step_batch`] for a thread outside the runtime.
    pub fn step_batch_blocking(
        &self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[u32],
        out: RowsOut<'_>,
    ) -> Result<StepOutput, ClusterError> {
        let rx = self.submit_batch(ids, batch, rows, out)?;
        rx.blocking_recv().map_err(|_| ClusterError::Stopped)?
    }

    fn submit_batch(
        &self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[u32],
        out: RowsOut<'_>,
    ) -> Result<oneshot::Receiver<Result<StepOutput, ClusterError>>, ClusterError> {
        if ids.is_empty() || ids.len() != batch.len() {
            return Err(ClusterError::Invalid(format!(
                "a step needs at least one token and a position per token ({} ids, {} positions)",
                ids.len(),
                batch.len()
            )));
        }
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= ids.len()) {
            return Err(ClusterError::Invalid(format!(
                "row {r} of a {}-token step",
                ids.len()
            )));
        }
        let (argmax, row_masks) = match out {
            RowsOut::Logits => (None, Vec::new()),
            RowsOut::Argmax { masked, row_masks } => {
                if !row_masks.is_empty() && row_masks.len() != rows.len() {
                    return Err(ClusterError::Invalid(format!(
                        "{} per-row masks for {} rows",
                        row_masks.len(),
                        rows.len()
                    )));
                }
                let n = masked.len() + row_masks.iter().map(Vec::len).sum::<usize>();
                if n > wire::MAX_MASKED {
                    return Err(ClusterError::Invalid(format!(
                        "{n} masked ids (at most {})",
                        wire::MAX_MASKED
                    )));
                }
                (Some(masked.to_vec()), row_masks.to_vec())
            }
        };
        let (reply, rx) = oneshot::channel();
        let cmd = Cmd::Step {
            batch: batch.to_vec(),
            ids: ids.to_vec(),
            rows: rows.to_vec(),
            argmax,
            row_masks,
            rewind: Vec::new(),
            reply,
        };
        self.tx.send(cmd).map_err(|_| ClusterError::Stopped)?;
        Ok(rx)
    }

    /// Drops the KV cache of finished sequences on every device.
    pub fn release(&self, seqs: &[u64]) {
        let _ = self.tx.send(Cmd::Release(seqs.to_vec()));
    }

    /// Sequence `seq` keeps only its first `len` positions (a speculative step's rejected
    /// drafts): the ledger and the adapter at once; each device when the sequence's next
    /// step (which starts at `len`) reaches it, per stage, in order with that step whatever
    /// the route. Nothing to send before: a sequence released meanwhile has nothing to drop.
    pub fn rewind(&self, seq: u64, len: usize) {
        let _ = self.tx.send(Cmd::Rewind(seq, len));
    }

    /// The session's warm-up steps are over: online adaptation counts steps from the next
    /// one ([`crate::adapt::Adapter::restart_count`]).
    pub fn warmed(&self) {
        let _ = self.tx.send(Cmd::Warmed);
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The model's position limit, if the pipeline was given one.
    pub fn max_positions(&self) -> Option<usize> {
        self.max_positions
    }

    /// Each device's state.
    pub fn health(&self) -> Vec<DeviceHealth> {
        lock(&self.shared.health).clone()
    }

    /// Bytes each link carried since the start, as the coordinator counts them.
    pub fn link_bytes(&self) -> Vec<LinkBytes> {
        route::link_bytes(&lock(&self.shared.links))
    }

    /// Each device's step sums since the pipeline started, in pipeline order.
    pub fn device_totals(&self) -> Vec<DeviceStepTotals> {
        lock(&self.shared.devices).devices()
    }

    /// Lent KV fetched back since the pipeline started (both paths).
    pub fn lend_totals(&self) -> LendTotals {
        *lock(&self.shared.lend)
    }

    /// KV tokens the pipeline's sequences hold now, summed over sequences (each device holds
    /// them for its own layers)  // tokens
    pub fn held_tokens(&self) -> u64 {
        lock(&self.shared.devices).held_tokens()
    }

    /// Timing sums since the last call, then resets them.
    pub fn take_totals(&self) -> Totals {
        std::mem::take(&mut *lock(&self.shared.totals))
    }

    /// Says goodbye to the workers and closes every connection.
    pub async fn shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Cmd::Shutdown(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

enum Event {
    Frame(usize, Frame),
    Gone(usize, String),
}

struct InFlight {
    seqs: Vec<u64>, // the step's distinct sequences
    /// sequences that drop their positions from the step's first on, on each device
    rewind: Vec<u64>,
    batch: Vec<TokenPos>,
    rows: Vec<u32>,
    argmax: Option<Vec<u32>>,
    row_masks: Vec<Vec<u32>>,
    hop: usize,
    reply: oneshot::Sender<Result<StepOutput, ClusterError>>,
    started: Instant,
    sent: Instant,
    stats: StepStats,
    worker_s: f64,
    progress: route::Progress,
    /// parked for threshold switches before it entered (its loads ran on meanwhile)
    parked: bool,
}

struct Sched {
    route: Route,
    links: HopLinks,
    opts: PipelineOptions,
    writers: Vec<mpsc::UnboundedSender<(FrameKind, Vec<u8>)>>,
    alive: Vec<Option<String>>, // None: alive; Some(reason): gone
    endpoints: Vec<Endpoint>,
    inflight: BTreeMap<u64, InFlight>,
    /// steps parked at the pipeline's entry, dispatch order, sequences expected back
    waves: wave::Waves,
    shared: Arc<Shared>,
    adapt: Option<adapt_hook::AdaptState>,
    /// the next step's id (steps the adapter adds to re-prefill evicted sequences included)
    next_step: u64,
    /// sequences rewound since their last step: their next step carries the rewind
    rewound: std::collections::BTreeSet<u64>,
    /// when each sequence's last step ended (its last hop arrived), until its next step
    returned: BTreeMap<u64, Instant>,
}

impl Sched {
    fn gone_error(&self, d: usize) -> ClusterError {
        let ep = &self.endpoints[d];
        ClusterError::DeviceGone {
            device: ep.name.clone(),
            addr: ep.addr.clone(),
            reason: self.alive[d].clone().unwrap_or_default(),
        }
    }

    fn fail(&mut self, step: u64, e: ClusterError) {
        if let Some(f) = self.inflight.remove(&step) {
            let _ = f.reply.send(Err(e));
            self.forget(step);
            self.release(&f.seqs);
        }
        self.waves.forget(step);
        self.step_left();
    }

    fn release(&mut self, seqs: &[u64]) {
        self.release_kv(seqs);
        self.adapt_released(seqs);
    }

    /// Drops the KV of `seqs` on every device (and in the ledger).
    fn release_kv(&mut self, seqs: &[u64]) {
        let Ok(p) = wire::control_payload(&ToWorker::Release {
            seqs: seqs.to_vec(),
        }) else {
            return;
        };
        for (d, w) in self.writers.iter().enumerate() {
            if self.alive[d].is_none() {
                let _ = w.send((FrameKind::Control, p.clone()));
            }
        }
        lock(&self.shared.devices).release(seqs);
        self.waves.released(seqs);
        for s in seqs {
            self.rewound.remove(s);
            self.returned.remove(s);
        }
    }

    /// `seq` keeps its first `len` positions: at once in the ledger and the adapter, on the
    /// devices with its next step.
    fn rewind(&mut self, seq: u64, len: usize) {
        lock(&self.shared.devices).rewind(seq, len);
        if let Some(a) = self.adapt.as_mut() {
            a.adapter.rewind(seq, len);
        }
        self.rewound.insert(seq);
    }

    fn mark_gone(&mut self, d: usize, reason: String) {
        if self.alive[d].is_some() {
            return;
        }
        tracing::warn!(
            "device {} ({}) is gone: {reason}",
            self.endpoints[d].name,
            self.endpoints[d].addr
        );
        self.alive[d] = Some(reason.clone());
        if let Some(h) = lock(&self.shared.health).get_mut(d) {
            h.alive = false;
            h.reason = Some(reason);
        }
        // Every step needs every device: fail them all.
        let steps: Vec<u64> = self.inflight.keys().copied().collect();
        for s in steps {
            let e = self.gone_error(d);
            self.fail(s, e);
        }
        self.adapt_gone(d);
        let ep = self.endpoints[d].clone();
        let why = self.alive[d].clone().unwrap_or_default();
        self.adapt_fail_waiting(|| ClusterError::DeviceGone {
            device: ep.name.clone(),
            addr: ep.addr.clone(),
            reason: why.clone(),
        });
    }

    fn on_frame(&mut self, d: usize, f: Frame) {
        match f.kind {
            FrameKind::Output => self.on_output(d, f),
            FrameKind::Notice => self.on_notice(d, f),
            FrameKind::Kv => self.on_kv(d, f),
            FrameKind::Control => match wire::parse_control::<ToCoordinator>(&f) {
                Ok(ToCoordinator::Failed {
                    step: Some(s),
                    message,
                }) => {
                    let ep = &self.endpoints[d];
                    let e = ClusterError::StepFailed {
                        device: ep.name.clone(),
                        addr: ep.addr.clone(),
                        message,
                    };
                    self.fail(s, e);
                }
                Ok(ToCoordinator::Failed {
                    step: None,
                    message,
                }) => tracing::warn!("device {}: {message}", self.endpoints[d].name),
                Ok(ToCoordinator::Pong { .. }) => {}
                Ok(ToCoordinator::PeerGone { device, reason }) => {
                    self.on_peer_gone(d, device, reason)
                }
                Ok(ToCoordinator::Switched { memory }) => self.adapt_switched(d, memory),
                Ok(ToCoordinator::SwitchRefused { message, memory }) => {
                    self.adapt_refused(d, memory, &message)
                }
                Ok(ToCoordinator::Borrowed { lender, ok, .. }) => {
                    self.adapt_borrowed(d, lender, ok)
                }
                Ok(ToCoordinator::KvFetch { stage }) => self.on_kv_fetch(d, stage),
                Ok(ToCoordinator::KvSent { stage, bytes }) => self.on_kv_sent(d, stage, bytes),
                Ok(ToCoordinator::KvFetched { stage, bytes, secs }) => {
                    self.on_kv_fetched(d, stage, bytes, secs)
                }
                Ok(other) => self.mark_gone(d, format!("sent an unexpected message: {other:?}")),
                Err(e) => self.mark_gone(d, e.to_string()),
            },
            FrameKind::Error => self.mark_gone(
                d,
                format!("it reported: {}", String::from_utf8_lossy(&f.payload)),
            ),
            k => self.mark_gone(d, format!("sent an unexpected {k:?} frame")),
        }
    }

    fn check_timeouts(&mut self) {
        let limit = self.opts.step_timeout;
        let late: Vec<usize> = self
            .inflight
            .iter()
            .filter(|(id, f)| f.sent.elapsed() > limit && !self.waves.is_parked(**id))
            .map(|(_, f)| f)
            .map(|f| self.route.hops[f.hop.min(self.route.hops.len() - 1)].device)
            .collect();
        for d in late {
            self.mark_gone(
                d,
                format!("did not answer a step within {} s", limit.as_secs_f64()),
            );
        }
    }
}

async fn scheduler(
    conns: Vec<Conn>,
    route: Route,
    links: HopLinks,
    opts: PipelineOptions,
    mut rx: mpsc::UnboundedReceiver<Cmd>,
    shared: Arc<Shared>,
    adapt: Option<adapt_hook::AdaptState>,
) {
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<Event>();
    let mut writers = Vec::new();
    let mut endpoints = Vec::new();
    let mut tasks = Vec::new();
    let mut keepalives = Vec::new();
    for (d, c) in conns.into_iter().enumerate() {
        let Conn {
            endpoint,
            mut rd,
            wr,
            keepalive,
            ..
        } = c;
        endpoints.push(endpoint);
        keepalives.push(keepalive);
        let (wtx, mut wrx) = mpsc::unbounded_channel::<(FrameKind, Vec<u8>)>();
        writers.push(wtx);
        let ev = ev_tx.clone();
        tasks.push(tokio::spawn(async move {
            while let Some((kind, p)) = wrx.recv().await {
                if let Err(e) = wr.lock().await.write(kind, &p).await {
                    let _ = ev.send(Event::Gone(d, format!("sending failed: {e}")));
                    return;
                }
            }
        }));
        let ev = ev_tx.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                match rd.read(wire::MAX_FRAME).await {
                    Ok(f) => {
                        if ev.send(Event::Frame(d, f)).is_err() {
                            return;
                        }
                    }
                    Err(WireError::Closed) => {
                        let _ = ev.send(Event::Gone(d, "it closed the connection".into()));
                        return;
                    }
                    Err(e) => {
                        let _ = ev.send(Event::Gone(d, e.to_string()));
                        return;
                    }
                }
            }
        }));
    }
    drop(ev_tx);
    let n = writers.len();
    let mut s = Sched {
        route,
        links,
        opts,
        writers,
        alive: vec![None; n],
        endpoints,
        inflight: BTreeMap::new(),
        waves: wave::Waves::default(),
        shared,
        adapt,
        next_step: 1,
        rewound: Default::default(),
        returned: BTreeMap::new(),
    };
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut done: Option<oneshot::Sender<()>> = None;
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(Cmd::Step { batch, ids, rows, argmax, row_masks, rewind, reply }) => {
                    if let Some(d) = s.alive.iter().position(|a| a.is_some()) {
                        let _ = reply.send(Err(s.gone_error(d)));
                        continue;
                    }
                    let step = s.next_step;
                    s.next_step += 1;
                    let mut seqs: Vec<u64> = Vec::new();
                    for t in &batch {
                        if !seqs.contains(&t.seq) {
                            seqs.push(t.seq);
                        }
                    }
                    lock(&s.shared.devices).step(&batch);
                    let rewind: Vec<u64> = seqs
                        .iter()
                        .copied()
                        .filter(|q| s.rewound.remove(q) | rewind.contains(q))
                        .collect();
                    let now = Instant::now();
                    let mut stats = StepStats::default();
                    if let Some(t) = seqs.iter().filter_map(|q| s.returned.remove(q)).max() {
                        stats.coordinator_s = now.duration_since(t).as_secs_f64();
                    }
                    let f = InFlight {
                        seqs, rewind, batch, rows, argmax, row_masks, hop: 0, reply, started: now, sent: now, stats, worker_s: 0.0, progress: Default::default(), parked: false,
                    };
                    s.waves.back(&f.seqs);
                    s.enter(step, f, wire::u32_bytes(&ids));
                }
                Some(Cmd::Release(seqs)) => {
                    s.release(&seqs);
                    s.admit_parked();
                }
                Some(Cmd::Rewind(seq, len)) => s.rewind(seq, len),
                Some(Cmd::Warmed) => {
                    if let Some(a) = s.adapt.as_mut() {
                        a.adapter.restart_count();
                    }
                }
                Some(Cmd::Shutdown(ack)) => { done = Some(ack); break; }
                None => break,
            },
            ev = ev_rx.recv() => match ev {
                Some(Event::Frame(d, f)) => s.on_frame(d, f),
                Some(Event::Gone(d, reason)) => s.mark_gone(d, reason),
                None => {}
            },
            _ = tick.tick() => s.check_timeouts(),
            _ = wave_wake(s.waves.deadline()) => s.on_wave_deadline(),
        }
    }
    let steps: Vec<u64> = s.inflight.keys().copied().collect();
    for st in steps {
        s.fail(st, ClusterError::Stopped);
    }
    if let Ok(p) = wire::control_payload(&ToWorker::Bye) {
        for w in &s.writers {
            let _ = w.send((FrameKind::Control, p.clone()));
        }
    }
    drop(s);
    // Let the writers flush `Bye`, then close everything.
    let deadline = tokio::time::sleep(Duration::from_secs(2));
    tokio::pin!(deadline);
    for t in tasks.iter_mut().step_by(2) {
        tokio::select! { _ = &mut *t => {}, _ = &mut deadline => break }
    }
    for t in &tasks {
        t.abort();
    }
    drop(keepalives);
    if let Some(ack) = done {
        let _ = ack.send(());
    }
}

/// Sleeps until the waves' deadline (forever when there is none).
async fn wave_wake(deadline: Option<Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

/// A process-wide counter for sequence ids.
pub fn next_seq_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
