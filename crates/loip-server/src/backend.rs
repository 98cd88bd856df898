//! What runs the forward passes behind the API: one type for this machine's in-memory engine,
//! this machine from slice files under a memory budget, or a cluster.
//!
//! The interface is per sequence: [`Backend::generate`] runs one request's prompt and
//! decoding loop to its end, calling back with each token, and may be called from several
//! threads at once (each call is its own sequence). On one device (in memory or from slice
//! files) a [`Batcher`] sits behind it: one thread owns the model, its KV cache and the step
//! scheduler, and concurrent requests share one batched forward per step. A cluster runs one
//! generation loop per request; a batched pipeline backend plugs in as another [`Batcher`].
//!
//! Invariants:
//! - Every variant gives each request exactly the tokens of the engine's own generation loop
//!   ([`loip_engine::generate`]) alone with the caller's options (the batch runner's
//!   invariant on one device), so a greedy request gives the single-device engine's tokens.
//! - The in-memory loop owns its checkpoint; the model's weight views are bound once on the
//!   loop's thread (binding only records views into the mapped file), so nothing is leaked.
//! - A cluster failure leaves the session usable: when a device is gone the session is
//!   re-planned over the others (unless `no_replan`), and the request still fails.

use std::sync::{Arc, Mutex, MutexGuard};

use loip_engine::{
    one_device_limits, EngineError, Flow, GenerateOptions, GenerateOutput, Generator, Model,
};
use loip_model::Checkpoint;
use loip_runtime::cluster_run::{generate_on, Session};
use loip_runtime::coordinator::{ClusterError, DeviceHealth};
use loip_runtime::local::LocalModel;

use crate::serving::{BatchError, Batcher, LoopStats};

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
    /// A cluster; requests are concurrent sequences on its pipeline. Locked only to take the
    /// pipeline, to read the devices' health, and to re-plan when one is gone.
    Cluster {
        /// the session with the workers
        session: Arc<Mutex<Session>>,
        /// keep a failed cluster as it is instead of re-planning
        no_replan: bool,
    },
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

/// The session (or device), also after a thread panicked while holding it (its state stays
/// usable: every change to it is one call).
pub(crate) fn lock<T>(s: &Mutex<T>) -> MutexGuard<'_, T> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

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
                run(limits, &mut m);
            }
        })
        .map_err(|e| EngineError::Backend(format!("starting the serving loop: {e}")))?;
        Ok(Backend::Batched {
            batcher,
            what: "this machine, from slice files",
        })
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
        match self {
            Backend::Batched { batcher, .. } => Ok(batcher.generate(prompt, opts, on_token)?),
            Backend::Cluster { session, no_replan } => {
                let pipe = lock(session).pipeline().clone();
                generate_on(&pipe, prompt, opts, on_token).map_err(|e| {
                    if !no_replan {
                        replan_if_gone(session);
                    }
                    BackendError::Cluster(e)
                })
            }
        }
    }

    /// Ends the backend: a cluster's last owner says goodbye to the workers.
    pub fn shutdown(self) {
        if let Backend::Cluster { session, .. } = self {
            if let Ok(s) = Arc::try_unwrap(session) {
                s.into_inner().unwrap_or_else(|p| p.into_inner()).shutdown();
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
            "loip api: {} gone; re-planned without {}",
            gone.join(", "),
            left_out.join(", ")
        ),
        Err(e) => eprintln!(
            "loip api: {} gone and the model does not fit the rest ({e}); requests will fail",
            gone.join(", ")
        ),
    }
}
