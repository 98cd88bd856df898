//! What runs the forward passes behind the API, `loip generate` and `loip serve`: one type
//! for this machine's in-memory engine, this machine from slice files under a memory budget,
//! or a cluster.
//!
//! The interface is per sequence: [`Backend::generate`] runs one request's prompt and
//! decoding loop to its end, calling back with each token, and may be called from several
//! threads at once (each call is its own sequence). Behind it sit [`Batcher`]s: one thread
//! owns the model (its KV cache) and the step scheduler, and concurrent requests share one
//! batched forward per step. One device has one loop; a cluster has one loop per
//! micro-batch in flight (each a [`PipelineBackend`] over the same pipeline), and a request
//! joins the loop with the fewest requests.
//!
//! Invariants:
//! - Every variant gives each request exactly the tokens of the engine's own generation loop
//!   ([`loip_engine::generate`]) alone with the caller's options (the batch runner's
//!   invariant), so a greedy request gives the single-device engine's tokens.
//! - The in-memory loop owns its checkpoint; the model's weight views are bound once on the
//!   loop's thread (binding only records views into the mapped file), so nothing is leaked.
//! - A cluster failure leaves the session usable: when a device is gone the session is
//!   re-planned over the others (unless `no_replan`) before the failed requests hear of it,
//!   and each loop moves to the new pipeline after its next failed step. A re-plan that takes
//!   a device back bumps the session's pipeline generation: a loop holding no sequence moves
//!   to the new pipeline before its next step, so the request after a re-admission runs.

use std::sync::{Arc, Mutex};

use loip_engine::speculate::Rewind;
use loip_engine::{
    one_device_limits, BatchBackend, EngineError, Flow, GenerateOptions, GenerateOutput, Generator,
    Model, Next, RowPick, SeqId, Shaping, TokenLogprob, TokenPos,
};
use loip_model::Checkpoint;
use loip_runtime::cluster_run::{DeviceStats, Session};
use loip_runtime::coordinator::{ClusterError, DeviceHealth, Pipeline, PipelineBackend, Totals};
use loip_runtime::local::LocalModel;

use crate::serving::{BatchBackendDyn, BatchError, Batcher, LoopStats, Speculation, MAX_DRAFTS};

/// Why a generation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The engine refused or failed (this machine).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The serving loop refused or failed the request (this machine).
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// The cluster failed (a device gone, the pipeline stopped, a step refused).
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// The engine behind the server.
pub enum Backend {
    /// One device (this machine in memory, or from slice files): requests are sequences of
    /// one batched serving loop.
    Batched {
        /// the loop
        batcher: Batcher,
        /// where it runs, for the startup line
        what: &'static str,
    },
    /// A cluster: one batched loop per micro-batch in flight over its pipeline.
    Cluster {
        /// the loops
        lanes: Vec<Batcher>,
        /// the session with the workers; locked to take the pipeline, to read the devices'
        /// health, and to re-plan when one is gone
        session: Arc<Mutex<Session>>,
    },
}

/// How a cluster backend serves.
#[derive(Debug, Clone, Copy)]
pub struct ClusterServing {
    /// micro-batches in flight (one serving loop each)
    pub micro_batches: usize,
    /// sequences at once, over all micro-batches
    pub parallel: usize,
    /// most tokens in one step (the workers' buffers)  // tokens
    pub max_step_tokens: usize,
    /// one sequence's prompt + new tokens at most  // tokens
    pub context: usize,
    /// keep a failed cluster as it is instead of re-planning
    pub no_replan: bool,
}

/// What `/health` reports of the backend.
pub enum Health {
    /// One machine: always ready.
    Ready,
    /// One device's serving loop: its scheduler's state.
    Serving(LoopStats),
    /// A cluster re-plan holds the session.
    Replanning,
    /// Each device of the cluster.
    Devices(Vec<DeviceHealth>),
}

pub use crate::serving::lock;

impl Backend {
    /// A batched in-memory backend over `ckpt` for up to `parallel` sequences at once,
    /// checking once that the model binds.
    pub fn local(ckpt: Checkpoint, parallel: usize) -> Result<Backend, BackendError> {
        Model::from_checkpoint(&ckpt)?;
        let ckpt = Arc::new(ckpt);
        let batcher = Batcher::start("loip-batch", move |run| {
            let model = match Model::from_checkpoint(&ckpt) {
                Ok(m) => m,
                Err(e) => return eprintln!("loip api: binding the model: {e}"),
            };
            let mut limits = one_device_limits(&model, None);
            set_parallel(&mut limits, parallel, usize::MAX);
            let mut gen = Generator::new(&model, None);
            gen.allow_rewind(MAX_DRAFTS); // speculating requests' rejected positions
            run(limits, &mut gen);
        })
        .map_err(|e| EngineError::Backend(format!("starting the serving loop: {e}")))?;
        Ok(Backend::Batched {
            batcher,
            what: "this machine",
        })
    }

    /// A batched backend over a device opened from slice files (for `parallel` sequences,
    /// see [`LocalModel::open_batched`]); steps take at most `max_step_tokens` tokens.
    pub fn sliced(
        model: LocalModel,
        parallel: usize,
        max_step_tokens: usize,
    ) -> Result<Backend, BackendError> {
        let dev = &model.device;
        let bytes_per_token = dev.kv.bytes_per_token_layer() * dev.tf.cfg.num_layers as u64;
        let budget = match dev.memory() {
            m if m.budget == 0 => u64::MAX,
            m => m.kv_budget,
        };
        let mut limits = loip_plan::sched::Limits::one_device(budget, bytes_per_token);
        limits.max_seq_len = Some(dev.tf.cfg.max_position_embeddings);
        set_parallel(&mut limits, parallel, max_step_tokens);
        let mut model = Some(model);
        let batcher = Batcher::start("loip-batch", move |run| {
            if let Some(mut m) = model.take() {
                m.allow_rewind(MAX_DRAFTS); // speculating requests' rejected positions
                run(limits, &mut m);
            }
        })
        .map_err(|e| EngineError::Backend(format!("starting the serving loop: {e}")))?;
        Ok(Backend::Batched {
            batcher,
            what: "this machine, from slice files",
        })
    }

    /// A cluster backend over `session`: `how.micro_batches` serving loops over its pipeline.
    pub fn cluster(session: Session, how: ClusterServing) -> Result<Backend, BackendError> {
        let lanes_n = how.micro_batches.clamp(1, how.parallel.max(1));
        let per_lane = how.parallel.max(1).div_ceil(lanes_n);
        let pipeline = session.pipeline().clone();
        let generation = session.generation();
        let session = Arc::new(Mutex::new(session));
        let mut lanes = Vec::with_capacity(lanes_n);
        for i in 0..lanes_n {
            // The workers hold the KV; the scheduler only bounds a sequence's length.
            let mut limits = loip_plan::sched::Limits::one_device(u64::MAX, 1);
            limits.max_seq_len = Some(how.context.max(1));
            set_parallel(&mut limits, per_lane, how.max_step_tokens);
            let mut lane = Some(ClusterLane {
                be: pipeline.backend(),
                pipe: pipeline.clone(),
                gen: generation.load(std::sync::atomic::Ordering::SeqCst),
                generation: generation.clone(),
                live: Default::default(),
                session: session.clone(),
                no_replan: how.no_replan,
                failed: None,
            });
            let batcher = Batcher::start(&format!("loip-lane-{i}"), move |run| {
                if let Some(mut l) = lane.take() {
                    run(limits, &mut l);
                }
            })
            .map_err(|e| EngineError::Backend(format!("starting the serving loop: {e}")))?;
            lanes.push(batcher);
        }
        Ok(Backend::Cluster { lanes, session })
    }

    /// Where it runs, for the startup line.
    pub fn describe(&self) -> String {
        match self {
            Backend::Batched { what, .. } => (*what).into(),
            Backend::Cluster { session, .. } => {
                format!("a cluster of {} devices", lock(session).health().len())
            }
        }
    }

    /// The devices' state, without waiting for a re-plan.
    pub fn health(&self) -> Health {
        match self {
            Backend::Batched { batcher, .. } => Health::Serving(batcher.stats()),
            Backend::Cluster { session, .. } => match session.try_lock() {
                Ok(s) => Health::Devices(s.health()),
                Err(_) => Health::Replanning,
            },
        }
    }

    /// Runs `prompt` to its end with `opts` (blocking), calling `on_token` with each new id.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Flow,
    ) -> Result<GenerateOutput, BackendError> {
        let mut on_token = |id, _: Option<&TokenLogprob>| on_token(id);
        self.generate_shaped(
            prompt,
            opts,
            &Shaping::default(),
            &Speculation::default(),
            &mut on_token,
            &mut || true,
        )
    }

    /// [`Backend::generate`] with the tokens shaped as `shaping` asks (penalties, bias),
    /// speculating as `spec` says, `on_token` also getting each
    /// token's log-probabilities when asked for; the request is cancelled once `alive` says
    /// its client is gone, also before its first token (see [`Batcher::generate_shaped`]).
    pub fn generate_shaped(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        shaping: &Shaping,
        spec: &Speculation,
        on_token: &mut dyn FnMut(u32, Option<&TokenLogprob>) -> Flow,
        alive: &mut dyn FnMut() -> bool,
    ) -> Result<GenerateOutput, BackendError> {
        let batcher = match self {
            Backend::Batched { batcher, .. } => batcher,
            Backend::Cluster { lanes, .. } => lanes
                .iter()
                .min_by_key(|l| l.outstanding())
                .ok_or(BatchError::Stopped)?,
        };
        Ok(batcher.generate_shaped(prompt, opts, shaping, spec, on_token, alive)?)
    }

    /// The serving loop's numbers (a cluster's loops summed; the last batch is the largest).
    pub fn stats(&self) -> LoopStats {
        match self {
            Backend::Batched { batcher, .. } => batcher.stats(),
            Backend::Cluster { lanes, .. } => {
                let mut all = LoopStats::default();
                for l in lanes {
                    let s = l.stats();
                    all.queued += s.queued;
                    all.running += s.running;
                    all.kv_used += s.kv_used;
                    all.kv_reserved += s.kv_reserved;
                    all.last_batch = all.last_batch.max(s.last_batch);
                    all.steps += s.steps;
                    all.step_s += s.step_s;
                    all.kv_budget = s.kv_budget;
                    all.shared_tokens += s.shared_tokens;
                    all.prompt_cache_sequences += s.prompt_cache_sequences;
                    all.prompt_cache_tokens += s.prompt_cache_tokens;
                }
                all
            }
        }
    }

    /// How many finished sequences' KV each serving loop keeps for later prompts that begin
    /// alike (a loop whose backend cannot copy KV keeps none).
    pub fn set_prompt_cache(&self, opts: loip_engine::PromptCacheOptions) {
        match self {
            Backend::Batched { batcher, .. } => batcher.set_prompt_cache(opts),
            Backend::Cluster { lanes, .. } => lanes.iter().for_each(|l| l.set_prompt_cache(opts)),
        }
    }

    /// The cluster session (`None` on one device).
    pub fn session(&self) -> Option<&Arc<Mutex<Session>>> {
        match self {
            Backend::Batched { .. } => None,
            Backend::Cluster { session, .. } => Some(session),
        }
    }

    /// A cluster's numbers per plan device (empty on one device, and while a re-plan holds
    /// the session).
    pub fn device_stats(&self) -> Vec<DeviceStats> {
        match self {
            Backend::Batched { .. } => Vec::new(),
            Backend::Cluster { session, .. } => match session.try_lock() {
                Ok(s) => s.device_stats(),
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().device_stats(),
                Err(std::sync::TryLockError::WouldBlock) => Vec::new(),
            },
        }
    }

    /// A cluster's pipeline step times since the last call (then reset); zero on one device.
    pub fn take_totals(&self) -> Totals {
        match self {
            Backend::Batched { .. } => Totals::default(),
            Backend::Cluster { session, .. } => lock(session).take_totals(),
        }
    }

    /// Ends the backend: its loops stop once nothing runs, and a cluster's last owner says
    /// goodbye to the workers.
    pub fn shutdown(self) {
        match self {
            Backend::Batched { batcher, .. } => batcher.finish(),
            Backend::Cluster { lanes, session, .. } => {
                for l in lanes {
                    l.finish();
                }
                if let Ok(s) = Arc::try_unwrap(session) {
                    s.into_inner().unwrap_or_else(|p| p.into_inner()).shutdown();
                }
            }
        }
    }
}

/// `parallel` sequences at once, in steps of at most `max_step_tokens` tokens.
fn set_parallel(limits: &mut loip_plan::sched::Limits, parallel: usize, max_step_tokens: usize) {
    let parallel = parallel.max(1);
    limits.max_seqs = parallel;
    limits.max_step_seqs = parallel;
    limits.max_batch_tokens = limits.max_batch_tokens.min(max_step_tokens.max(1));
    limits.prefill_chunk = limits.prefill_chunk.min(limits.max_batch_tokens);
}

/// After a failed request: when a device is gone, re-plans over the remaining ones (as
/// `loip serve` does), so the next requests run again; the failed request still answers 503.
/// Several requests failing at once re-plan once: the others find every device alive.
fn replan_if_gone(session: &Mutex<Session>) {
    let mut s = lock(session);
    let gone = s.gone();
    if gone.is_empty() {
        return;
    }
    match s.replan() {
        Ok(left_out) => eprintln!(
            "loip: {} gone; re-planned without {}",
            gone.join(", "),
            left_out.join(", ")
        ),
        Err(e) => eprintln!(
            "loip: {} gone and the model does not fit the rest ({e}); requests will fail",
            gone.join(", ")
        ),
    }
}

/// One serving loop's backend on a cluster: the pipeline, moved to the session's current
/// pipeline (a re-plan builds a new one) before a step when the pipeline's generation changed
/// and the loop holds no sequence on the old one, or after a failed step.
struct ClusterLane {
    be: PipelineBackend,
    /// the pipeline `be` runs on
    pipe: Pipeline,
    /// the session's pipeline generation `pipe` belongs to
    gen: u64,
    /// the session's generation counter
    generation: Arc<std::sync::atomic::AtomicU64>,
    /// sequences that ran a step on `pipe` and were not released (they hold KV there)
    live: std::collections::HashSet<SeqId>,
    session: Arc<Mutex<Session>>,
    no_replan: bool,
    /// the last failed step's error
    failed: Option<ClusterError>,
}

impl ClusterLane {
    /// Before a step: a re-plan replaced the pipeline and no sequence holds KV on the old
    /// one: take the session's (its lock waits for a re-plan in progress).
    fn before(&mut self, batch: &[TokenPos]) {
        use std::sync::atomic::Ordering;
        if self.generation.load(Ordering::SeqCst) != self.gen && self.live.is_empty() {
            let s = lock(&self.session);
            self.gen = self.generation.load(Ordering::SeqCst);
            self.pipe = s.pipeline().clone();
            self.be = self.pipe.backend();
        }
        self.live.extend(batch.iter().map(|t| t.seq));
    }

    /// After a step: a failure re-plans when a device is gone (before the failed requests
    /// hear of it) and takes the session's current pipeline. (The devices' times reach
    /// `/metrics` from the session, per device, see [`Backend::device_stats`].)
    fn after<T>(&mut self, r: Result<T, EngineError>) -> Result<T, EngineError> {
        if r.is_err() {
            self.failed = self.be.error.take();
            if !self.no_replan {
                replan_if_gone(&self.session);
            }
            let s = lock(&self.session);
            self.gen = self.generation.load(std::sync::atomic::Ordering::SeqCst);
            self.pipe = s.pipeline().clone();
            self.be = self.pipe.backend();
            self.live.clear();
        }
        r
    }
}

impl BatchBackend for ClusterLane {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        self.before(batch);
        let r = self.be.forward_rows(ids, batch, rows);
        self.after(r)
    }

    fn forward_pick(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        picks: &[RowPick<'_>],
    ) -> Result<Vec<Next>, EngineError> {
        self.before(batch);
        let r = self.be.forward_pick(ids, batch, picks);
        self.after(r)
    }

    fn release(&mut self, seq: SeqId) {
        self.live.remove(&seq);
        self.be.release(seq)
    }

    /// Speculating requests' rejected positions, dropped on every device with the
    /// sequence's next step.
    fn rewind(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        self.be.rewind(seq, len)
    }

    fn can_rewind(&self) -> bool {
        self.be.can_rewind()
    }

    fn vocab_size(&self) -> usize {
        self.be.vocab_size()
    }
}

impl BatchBackendDyn for ClusterLane {
    /// A device gone or unreachable: 503 naming it, the full error logged (it names
    /// addresses).
    fn unavailable(&mut self) -> Option<String> {
        let e = self.failed.take()?;
        let which = match &e {
            ClusterError::DeviceGone { device, .. } => format!("device {device} is gone"),
            ClusterError::Stopped | ClusterError::Net(_) => "a device is unavailable".into(),
            _ => return None,
        };
        eprintln!("loip: a step failed: {e}");
        Some(which)
    }
}
