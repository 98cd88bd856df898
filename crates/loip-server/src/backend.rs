//! What runs the forward passes behind the API: one type for this machine's in-memory engine,
//! this machine from slice files under a memory budget, or a cluster.
//!
//! The interface is per sequence: [`Backend::generate`] runs one request's prompt and
//! decoding loop to its end, calling back with each token, and may be called from several
//! threads at once (each call is its own sequence). A step scheduler can later sit in front
//! of it, turning requests into per-sequence steps, without the HTTP layer changing.
//!
//! Invariants:
//! - Every variant runs the engine's own generation loop ([`loip_engine::generate`]) with the
//!   caller's options, so a greedy request gives exactly the single-device engine's tokens.
//! - `Local` owns its checkpoint; the model's weight views are bound per request (binding
//!   only records views into the mapped file, nothing is copied), so nothing is leaked.
//! - A cluster failure leaves the session usable: when a device is gone the session is
//!   re-planned over the others (unless `no_replan`), and the request still fails.

use std::sync::{Arc, Mutex, MutexGuard};

use loip_engine::generate::StepBackend;
use loip_engine::{generate, EngineError, Flow, GenerateOptions, GenerateOutput, Generator, Model};
use loip_model::Checkpoint;
use loip_runtime::cluster_run::{generate_on, Session};
use loip_runtime::coordinator::{ClusterError, DeviceHealth};
use loip_runtime::local::LocalModel;

/// Why a generation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The engine refused or failed (this machine).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The cluster failed (a device gone, the pipeline stopped, a step refused).
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// The engine behind the server.
pub enum Backend {
    /// This machine's in-memory engine; each request gets its own KV cache.
    Local(Arc<Checkpoint>),
    /// This machine from slice files under a memory budget: requests take the device step by
    /// step, each its own sequence in the device's cache.
    Sliced(Arc<Mutex<LocalModel>>),
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
    /// A local backend over `ckpt`, checking once that the model binds.
    pub fn local(ckpt: Checkpoint) -> Result<Backend, EngineError> {
        Model::from_checkpoint(&ckpt)?;
        Ok(Backend::Local(Arc::new(ckpt)))
    }

    /// Where it runs, for the startup line.
    pub fn describe(&self) -> String {
        match self {
            Backend::Local(_) => "this machine".into(),
            Backend::Sliced(_) => "this machine, from slice files".into(),
            Backend::Cluster { session, .. } => {
                format!("a cluster of {} devices", lock(session).health().len())
            }
        }
    }

    /// The devices' state, without waiting for a re-plan.
    pub fn health(&self) -> Health {
        match self {
            Backend::Local(_) | Backend::Sliced(_) => Health::Ready,
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
            Backend::Local(ckpt) => {
                let model = Model::from_checkpoint(ckpt)?;
                let mut gen = Generator::new(&model, None);
                Ok(generate(&mut gen, 0, prompt, opts, on_token)?)
            }
            Backend::Sliced(model) => {
                let seq = loip_runtime::coordinator::next_seq_id();
                let mut backend = SlicedSteps { model };
                let out = generate(&mut backend, seq, prompt, opts, on_token);
                lock(model).device.kv.remove(seq);
                Ok(out?)
            }
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

/// The device of [`Backend::Sliced`], shared step by step: each request's steps take the lock
/// in turn, so requests interleave token by token.
struct SlicedSteps<'m> {
    model: &'m Mutex<LocalModel>,
}

impl StepBackend for SlicedSteps<'_> {
    fn step(&mut self, seq: u64, ids: &[u32], start_pos: usize) -> Result<Vec<f32>, EngineError> {
        lock(self.model).step(seq, ids, start_pos)
    }
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
