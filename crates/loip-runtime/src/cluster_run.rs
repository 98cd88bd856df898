//! Bringing a cluster up and running requests on it: connect and authenticate every worker,
//! measure the links, profile the devices that have no profile, plan, ship each worker only
//! the slices it lacks, open the devices, then run generations over the [`Pipeline`].
//!
//! [`Session`] is the request path `loip serve`, `loip generate --cluster` and `loip local`
//! share (and the HTTP server will call): [`Session::generate`] runs the engine's own
//! generation loop over the pipeline, [`Session::generate_many`] several sequences at once
//! (the bursty pattern), [`Session::replan`] rebuilds the pipeline over the devices still
//! alive after a fault. Also here: plan → [`crate::executor::DeviceSpec`] ([`device_spec`]) and spawning `loip worker` child
//! processes.
//!
//! A worker that cannot be reached at start (refused, reset, no answer in time) is left out
//! when the planner chooses the devices (no fixed plan, `allow_drop`): the plan is made over
//! the others and lists it in `Plan::dropped` with the reason; a worker that answers but
//! refuses (wrong token) is still an error.
//!
//! Direct forwarding ([`crate::net::direct`]): after connecting, every worker opens (and, with
//! `measure_links`, measures) a peer session to every other; a hop whose two devices reach
//! each other gets its rows device to device, any other hop is relayed by the coordinator,
//! and `relay` relays every hop (the star).
//!
//! The cost model's link is what a pipeline hop sees: over peer links, the slowest measured
//! peer bandwidth and the largest peer latency (a pair that cannot reach each other counts as
//! relayed); relaying (star), one hop crosses two measured links, so the planner gets half
//! the slowest measured bandwidth and twice the largest one-way latency.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use loip_engine::generate::{generate, Flow};
use loip_engine::{GenerateOptions, GenerateOutput};
use loip_model::slice::{Manifest, Slices};
use loip_plan::{Cluster, DeviceProfile, LinkProfile, Pattern, Plan};
use serde::Serialize;

use crate::coordinator::{
    next_seq_id, ClusterError, ConnectOptions, DeviceHealth, Endpoint, HopLinks, LinkBytes,
    LinkStats, Pipeline, ShipStats, StepStats, Totals,
};
use crate::loader::LoaderKind;
use crate::wire::{DeviceMemory, ProbeResult};
use crate::RuntimeError;

mod peers;
mod process;
mod rejoin;
mod setup;
mod stats;

use setup::setup;
pub use setup::{device_slices, device_spec, star_link};

pub use peers::{direct_link, PeerLinkStats};
pub use process::{kill_pid, on_interrupt, uniform_plan, WorkerProcess};
pub use rejoin::watch_rejoin;
pub use stats::{DeviceAdaptStats, DeviceStats};

/// One worker of the cluster.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// name and address
    pub endpoint: Endpoint,
    /// its profile; `None`: measure it (a second or so, on layer 0 of the model)
    pub profile: Option<DeviceProfile>,
    /// memory budget the plan may use; `None`: what the worker reports (`--mem`)  // bytes
    pub mem: Option<u64>,
    /// memory kept free for other programs  // bytes
    pub reserve: u64,
}

impl WorkerSpec {
    /// A worker to profile, with the budget it reports.
    pub fn new(name: impl Into<String>, addr: impl Into<String>) -> WorkerSpec {
        WorkerSpec {
            endpoint: Endpoint {
                name: name.into(),
                addr: addr.into(),
            },
            profile: None,
            mem: None,
            reserve: 0,
        }
    }
}

/// Bytes of one row of an argmax output (token id and logit).
const ARGMAX_RETURN_BYTES: u64 = 8;

/// How to bring the cluster up.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// token, timeouts, emulated coordinator-side bandwidth
    pub connect: ConnectOptions,
    /// planner name (`loip`, `pp-offload`, …)
    pub planner: String,
    /// a fixed plan instead of planning (checked against the model and the cluster)
    pub plan: Option<Plan>,
    /// request pattern to plan for
    pub pattern: Pattern,
    /// sequences in flight (bursty)
    pub micro_batches: Option<u32>,
    /// planned context: KV tokens held, summed over sequences in flight  // tokens
    pub context: u64,
    /// most tokens in one step (the longest prompt; sizes working buffers)  // tokens
    pub max_step_tokens: usize,
    /// most sequences in one step (a micro-batch's sequences: sizes the last device's logits
    /// rows, which it accounts when it opens)
    pub max_step_seqs: usize,
    /// loading path on the workers
    pub loader: LoaderKind,
    /// the cost model's link; `None`: from the measured links (star-adjusted)
    pub link: Option<LinkProfile>,
    /// measure every link (latency, bandwidth both ways)
    pub measure_links: bool,
    /// let the planner leave devices out
    pub allow_drop: bool,
    /// a device that holds a step longer than this is declared gone
    pub step_timeout: Duration,
    /// the model's name in plans
    pub shape_name: String,
    /// measure the loaders of all probed devices at the same time (`loip local`: devices
    /// emulated on one machine share its SSD and load at the same time in the pipeline);
    /// block compute is always timed one device at a time
    pub probe_loads_together: bool,
    /// every device reads from the same disk (`loip local`: workers on one machine): the
    /// cost model shares the disk's rate among their loads in a round
    /// ([`loip_plan::Cluster::disks`])
    pub shared_disk: bool,
    /// the generations are greedy: the last device returns each token's argmax (8 bytes), and
    /// the plan costs the token's return trip so; else it returns the logits (vocabulary × 4
    /// bytes). Either way a step that asks for logits gets them.
    pub greedy: bool,
    /// relay every hop through the coordinator (no peer sessions): for networks where workers
    /// cannot reach each other, and for comparison (`--relay`)
    pub relay: bool,
    /// device name pairs whose hops are relayed even when they could reach each other (no
    /// peer session between them; tests of the fallback)
    pub relay_pairs: Vec<(String, String)>,
    /// plan for this many KV tokens held at admission (summed over sequences) and adapt
    /// online as the KV grows to `context` ([`crate::adapt`]); `None`: plan for `context`
    /// up front, no adaptation  // tokens
    pub admitted: Option<u64>,
    /// with adaptation: lend KV to a peer when a device nears its threshold (design §6)
    pub lending: bool,
    /// with adaptation: its knobs (`n_ts`, horizon, link fraction)
    pub adapt: loip_plan::adapt::AdaptConfig,
    /// with adaptation: no plan switches and no lending; a device near its budget only
    /// evicts and recomputes (the last resort alone, for comparison: `--evict-only`)
    pub evict_only: bool,
    /// told as slices go out to each device (a progress bar)
    pub on_ship: Option<crate::coordinator::OnShip>,
    /// at start, a worker nobody answers for (refused, reset, no answer in time) is tried
    /// again with backoff for this long (one window for all workers), each try logged;
    /// zero: once. Re-plans try once.
    pub connect_retry: Duration,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            connect: ConnectOptions::default(),
            planner: "loip".into(),
            plan: None,
            pattern: Pattern::Sporadic,
            micro_batches: None,
            context: 1024,
            max_step_tokens: 256,
            max_step_seqs: 1,
            loader: LoaderKind::Direct,
            link: None,
            measure_links: true,
            allow_drop: true,
            step_timeout: Duration::from_secs(300),
            shape_name: "model".into(),
            probe_loads_together: false,
            shared_disk: false,
            greedy: false,
            relay: false,
            relay_pairs: Vec::new(),
            admitted: None,
            lending: false,
            adapt: Default::default(),
            evict_only: false,
            on_ship: None,
            connect_retry: Duration::ZERO,
        }
    }
}

/// What setup did on one device.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceReport {
    /// who
    pub endpoint: Endpoint,
    /// the budget the worker reports  // bytes
    pub mem_budget: u64,
    /// measured link
    pub link: Option<LinkStats>,
    /// probe results, when it was profiled
    pub probe: Option<ProbeResult>,
    /// slices sent or reused
    pub shipped: ShipStats,
    /// how its budget is spent, when it runs part of the plan
    pub memory: Option<DeviceMemory>,
    /// its peer sessions to the other workers (direct forwarding)
    pub peers: Vec<PeerLinkStats>,
}

/// Per generated token, from the pipeline's decode steps.  // milliseconds
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// decode steps measured
    pub steps: u64,
    /// mean wall time of one decode step  // milliseconds
    pub step_ms: f64,
    /// block compute on the devices  // milliseconds
    pub compute_ms: f64,
    /// transfers, latency and relaying  // milliseconds
    pub network_ms: f64,
    /// waiting for SSD loads (uncovered)  // milliseconds
    pub load_stall_ms: f64,
    /// waiting behind other sequences in device queues (bursty)  // milliseconds
    pub queued_ms: f64,
    /// the coordinator's own part between a sequence's steps (sampling included)  // milliseconds
    pub coordinator_ms: f64,
    /// bytes read from SSDs per token  // bytes
    pub loaded_bytes: f64,
    /// steps parked for threshold switches (from the first switch sent to the last answer),
    /// spread over the decode steps; inside `queued_ms`  // milliseconds
    pub switch_ms: f64,
    /// how many times a step was parked for switches
    pub switch_parks: u64,
    /// the first decode steps not parked for a switch (after the run's first), which the
    /// re-priced prediction is fed from ([`loip_plan::calibrate::REPRICE_STEPS`]; fewer:
    /// not re-priced); the `early_*` figures below are their trimmed means
    /// ([`Totals::early_fed`])
    pub early_steps: u64,
    /// the decode steps up to the last of them (parked ones included)
    pub early_span: u64,
    /// their mean wall time and coordinator's part  // milliseconds
    pub early_span_ms: f64,
    /// their mean wall time  // milliseconds
    pub early_step_ms: f64,
    /// their compute  // milliseconds
    pub early_compute_ms: f64,
    /// their load stall  // milliseconds
    pub early_stall_ms: f64,
    /// their coordinator's part  // milliseconds
    pub early_coordinator_ms: f64,
    /// the cost model over the decode steps after them, fed the rates they measured
    /// (`loip_plan::calibrate::reprice`; 0: not re-priced)  // milliseconds
    pub repriced_ms: f64,
}

impl Breakdown {
    /// Means over the decode steps of `t`.
    pub fn of(t: &Totals) -> Breakdown {
        let n = t.decode_steps.max(1) as f64;
        let e = t.early_fed().unwrap_or_default();
        let d: &StepStats = &t.decode;
        Breakdown {
            steps: t.decode_steps,
            step_ms: d.wall_s * 1e3 / n,
            compute_ms: d.compute_s * 1e3 / n,
            network_ms: d.network_s * 1e3 / n,
            load_stall_ms: d.stall_s * 1e3 / n,
            queued_ms: d.queued_s * 1e3 / n,
            coordinator_ms: d.coordinator_s * 1e3 / n,
            loaded_bytes: d.loaded_bytes as f64 / n,
            switch_ms: t.switch_s * 1e3 / n,
            switch_parks: t.switch_parks,
            early_steps: t.early_steps,
            early_step_ms: e.wall_s * 1e3,
            early_compute_ms: e.compute_s * 1e3,
            early_stall_ms: e.stall_s * 1e3,
            early_coordinator_ms: e.coordinator_s * 1e3,
            early_span: t.early_span,
            early_span_ms: (t.span.wall_s + t.span.coordinator_s) * 1e3
                / t.early_span.max(1) as f64,
            repriced_ms: t.repriced_ms,
        }
    }
}

/// A measured profile from a worker's probe.
pub fn profile_from_probe(
    name: &str,
    mem_budget: u64,
    shape: &loip_plan::ModelShape,
    p: &ProbeResult,
) -> Result<DeviceProfile, ClusterError> {
    let mut attn: Vec<(u32, u64, f64)> = p.attn.iter().map(|&(n, s)| (1u32, n, s)).collect();
    let mut mlp = vec![(1, p.mlp_s)];
    // Micro-batches of b > 1 (absent from older workers): rows over b = 1's contexts only.
    for g in p.batched.iter().filter(|g| g.b > 1) {
        if g.attn.iter().map(|a| a.0).eq(p.attn.iter().map(|a| a.0)) {
            attn.extend(g.attn.iter().map(|&(n, s)| (g.b, n, s)));
            mlp.push((g.b, g.mlp_s));
        }
    }
    let mut prof = DeviceProfile::from_measurements(
        name,
        mem_budget,
        shape,
        attn,
        mlp,
        p.direct,
        p.conventional,
    )
    .map_err(|e| ClusterError::Invalid(format!("device {name}: bad probe results: {e}")))?;
    // a peer's figure: bounded
    prof.load_slowdown = if p.load_slowdown.is_finite() {
        p.load_slowdown.clamp(0.0, 10.0)
    } else {
        0.0
    };
    Ok(prof)
}

/// How far [`Session::open`] goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// the session running: slices shipped, devices open, pipeline started
    Running,
    /// the plan only: the workers measured and planned on, nothing loaded, then told goodbye
    /// (`--preview`)
    Planned,
}

/// What [`Session::open`] made.
pub enum Opened {
    /// the session, up
    Running(Box<Session>),
    /// the plan of [`Until::Planned`]
    Planned(Box<Preview>),
}

/// A cluster planned but not brought up ([`Session::preview`]).
#[derive(Debug, Clone)]
pub struct Preview {
    /// the plan it would run
    pub plan: Plan,
    /// the model's shape as planned
    pub shape: loip_plan::ModelShape,
    /// the cluster as planned (profiles, measured link)
    pub cluster: Cluster,
    /// what setup found per worker (links, probes)
    pub reports: Vec<DeviceReport>,
}

/// A cluster that is up: plan made, slices shipped, devices open, pipeline running.
pub struct Session {
    rt: tokio::runtime::Runtime,
    pipeline: Pipeline,
    hop_links: HopLinks,
    /// the plan it runs
    pub plan: Plan,
    /// the model's shape as planned
    pub shape: loip_plan::ModelShape,
    /// the cluster as planned (profiles, measured link)
    pub cluster: Cluster,
    /// the plan's one-sequence step in the parts its evaluation priced, kept to price verify
    /// steps of more positions ([`loip_plan::speculate::verify_step_times`])
    pub step: loip_plan::speculate::StepParts,
    /// the model
    pub manifest: Manifest,
    /// what setup did per worker
    pub reports: Vec<DeviceReport>,
    /// seconds setup took  // seconds
    pub setup_s: f64,
    model_dir: PathBuf,
    /// every worker the session was started with (profiles remembered once measured)
    workers: Vec<WorkerSpec>,
    /// the workers out of the running pipeline: unreachable at the last setup, or gone
    missing: Vec<String>,
    opts: SessionOptions,
    adapt: Option<std::sync::Arc<std::sync::Mutex<crate::adapt::AdaptReport>>>,
    /// bumped when a re-plan starts to replace the pipeline (see [`Session::generation`])
    generation: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Session {
    /// Brings the cluster up for the model in slice directory `model_dir`.
    pub fn start(
        model_dir: &Path,
        workers: Vec<WorkerSpec>,
        opts: SessionOptions,
    ) -> Result<Session, ClusterError> {
        let slices = Slices::open(model_dir).map_err(RuntimeError::from)?;
        Session::start_opened(slices, workers, opts)
    }

    /// [`Session::start`] for a slice directory already opened.
    pub fn start_opened(
        slices: Slices,
        workers: Vec<WorkerSpec>,
        opts: SessionOptions,
    ) -> Result<Session, ClusterError> {
        match Session::open(&slices, workers, opts, Until::Running)? {
            Opened::Running(s) => Ok(*s),
            Opened::Planned(_) => Err(ClusterError::Invalid("planned, not started".into())),
        }
    }

    /// Connects, measures, profiles and plans as [`Session::start`] does, then says goodbye
    /// to the workers: the plan without shipping a slice (beyond a profiled device's layer 0)
    /// or loading anything (`--preview`).
    pub fn preview(
        model_dir: &Path,
        workers: &[WorkerSpec],
        opts: &SessionOptions,
    ) -> Result<Preview, ClusterError> {
        let slices = Slices::open(model_dir).map_err(RuntimeError::from)?;
        Session::preview_opened(&slices, workers, opts)
    }

    /// [`Session::preview`] for a slice directory already opened.
    pub fn preview_opened(
        slices: &Slices,
        workers: &[WorkerSpec],
        opts: &SessionOptions,
    ) -> Result<Preview, ClusterError> {
        match Session::open(slices, workers.to_vec(), opts.clone(), Until::Planned)? {
            Opened::Planned(p) => Ok(*p),
            Opened::Running(s) => {
                s.shutdown();
                Err(ClusterError::Invalid("started, not planned".into()))
            }
        }
    }

    /// The one way a session starts: connect, measure, profile and plan over `workers` for
    /// the model in `slices`, then ([`Until::Running`]) ship, open and start the pipeline, or
    /// ([`Until::Planned`]) say goodbye to the workers with the plan made.
    pub fn open(
        slices: &Slices,
        workers: Vec<WorkerSpec>,
        opts: SessionOptions,
        until: Until,
    ) -> Result<Opened, ClusterError> {
        let rt = match until {
            Until::Running => tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .thread_name("loip-coord-io")
                .build(),
            Until::Planned => tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build(),
        }
        .map_err(|e| RuntimeError::Io {
            path: PathBuf::from("<tokio runtime>"),
            source: e,
        })?;
        let t = Instant::now();
        let planned = rt.block_on(setup::plan_cluster(slices, &workers, &opts))?;
        if until == Until::Planned {
            let p = rt.block_on(async {
                for c in planned.conns {
                    c.bye().await;
                }
                Preview {
                    plan: planned.plan,
                    shape: planned.shape,
                    cluster: planned.cluster,
                    reports: planned.reports,
                }
            });
            return Ok(Opened::Planned(Box::new(p)));
        }
        let s = rt.block_on(setup::bring_up(slices, planned, &opts))?;
        let mut workers = workers;
        remember_profiles(&mut workers, &s.profiles);
        Ok(Opened::Running(Box::new(Session {
            rt,
            pipeline: s.pipeline,
            generation: Default::default(),
            hop_links: s.hop_links,
            plan: s.plan,
            shape: s.shape,
            cluster: s.cluster,
            step: s.step,
            manifest: slices.manifest.clone(),
            reports: s.reports,
            setup_s: t.elapsed().as_secs_f64(),
            model_dir: slices.dir.clone(),
            workers,
            missing: s.unreachable,
            opts,
            adapt: s.adapt,
        })))
    }

    /// What online adaptation did so far (when planned for admission).
    pub fn adaptation(&self) -> Option<crate::adapt::AdaptReport> {
        self.adapt.as_ref().map(|a| match a.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        })
    }

    /// The running pipeline (clone it to submit from several threads).
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    /// The pipeline's generation: a counter bumped when a re-plan starts replacing the
    /// pipeline. A serving loop that sees it change while it holds no sequence takes the
    /// session's pipeline (under its lock, so after the re-plan) before its next step,
    /// instead of failing a step on the old one.
    pub fn generation(&self) -> std::sync::Arc<std::sync::atomic::AtomicU64> {
        self.generation.clone()
    }

    /// The tokio runtime the connections live on (for async callers).
    pub fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    /// Each plan device's state.
    pub fn health(&self) -> Vec<DeviceHealth> {
        self.pipeline.health()
    }

    /// Generates for `prompt` with the engine's loop over the pipeline; the sequence's KV is
    /// released on every device afterwards. Errors keep their device names.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> Flow,
    ) -> Result<GenerateOutput, ClusterError> {
        generate_on(&self.pipeline, prompt, opts, on_token)
    }

    /// Generates for several prompts at once, one thread each (the bursty pattern): their
    /// steps are in flight together and pass the stages one after another.
    pub fn generate_many(
        &self,
        prompts: &[Vec<u32>],
        opts: &GenerateOptions,
    ) -> Vec<Result<GenerateOutput, ClusterError>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .map(|p| {
                    let pipe = self.pipeline.clone();
                    s.spawn(move || generate_on(&pipe, p, opts, &mut |_| Flow::Continue))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(ClusterError::Invalid("a generation thread panicked".into()))
                    })
                })
                .collect()
        })
    }

    /// Bytes each link carried since the pipeline started (coordinator ↔ workers, and worker
    /// → worker as the workers reported).
    pub fn link_bytes(&self) -> Vec<LinkBytes> {
        self.pipeline.link_bytes()
    }

    /// Which hops go device to device.
    pub fn hop_links(&self) -> &HopLinks {
        &self.hop_links
    }

    /// Timing sums since the last call (then reset), with the re-priced prediction of the
    /// decode steps after the first few ([`Session::reprice`]).
    pub fn take_totals(&self) -> Totals {
        let mut t = self.pipeline.take_totals();
        if let Some(r) = self.reprice(&t) {
            t.repriced_ms = r.ms_per_token;
        }
        t
    }

    /// The cost model fed the rates that a run's first
    /// [`loip_plan::calibrate::REPRICE_STEPS`] decode steps measured (`t`'s `early`: compute,
    /// load stall, hops, the coordinator's part), pricing its remaining decode steps with
    /// the placements its threshold switches left in force
    /// ([`loip_plan::calibrate::reprice`]); `None` unless `t` is one sequence's run of more
    /// steps than those (one prompt step or a few, then decode steps, as `loip local`'s).
    /// The adapter numbers the steps after the warm-up from 1: the prompt's, then the
    /// decode steps'.
    pub fn reprice(&self, t: &Totals) -> Option<loip_plan::calibrate::Repriced> {
        let k = loip_plan::calibrate::REPRICE_STEPS;
        let fed = t.early_fed()?;
        if t.decode_steps <= t.early_span || t.prompt_steps == 0 {
            return None;
        }
        let events = self.adaptation().map(|a| a.events).unwrap_or_default();
        let probed: Vec<String> = self
            .reports
            .iter()
            .filter(|r| r.probe.is_some())
            .map(|r| r.endpoint.name.clone())
            .collect();
        let first = u32::try_from(t.prompt_steps + 1).ok()?;
        let steps = u32::try_from(t.decode_steps).ok()?;
        let span = u32::try_from(t.early_span).ok()?;
        let r = loip_plan::calibrate::reprice(
            &self.plan,
            &self.shape,
            &self.cluster,
            &events,
            first,
            span,
            steps,
            &fed,
            &probed,
            loip_plan::calibrate::REPRICE_WEIGHTS,
        )
        .ok()??;
        // the steps after the span: the decode sums less the span's
        let rest =
            (t.decode.wall_s + t.decode.coordinator_s - t.span.wall_s - t.span.coordinator_s)
                / (t.decode_steps - t.early_span) as f64;
        tracing::info!(
            "re-priced after the first {k} decode steps: {}; the remaining {} steps priced \
             {:.2} ms/token, their steps measured {:.2} (wall and coordinator; from {span} \
             decode steps on)",
            r.calibration.terms(),
            steps - span,
            r.ms_per_token,
            rest * 1e3
        );
        Some(r)
    }

    /// Names of the devices that are gone.
    pub fn gone(&self) -> Vec<String> {
        self.health()
            .into_iter()
            .filter(|h| !h.alive)
            .map(|h| h.endpoint.name)
            .collect()
    }

    /// Rebuilds the pipeline over the devices still alive (dropping the gone ones from the
    /// cluster) with the planner; fails if the model no longer fits. Returns the names of
    /// the devices left out.
    pub fn replan(&mut self) -> Result<Vec<String>, ClusterError> {
        let gone = self.gone();
        self.note_gone();
        let missing = self.missing.clone();
        self.rebuild(|w| !missing.contains(&w.endpoint.name))?;
        Ok(gone)
    }

    /// The workers out of the running pipeline (unreachable at the last setup, or gone),
    /// with their addresses: the ones [`Session::rejoin`] may take back.
    pub fn missing(&self) -> Vec<Endpoint> {
        self.workers
            .iter()
            .filter(|w| self.missing.contains(&w.endpoint.name))
            .map(|w| w.endpoint.clone())
            .collect()
    }

    /// Whether the running pipeline is idle: no sequence holds KV on it.
    pub fn idle(&self) -> bool {
        self.pipeline.held_tokens() == 0
    }

    /// Takes back the missing workers named in `back` (they answer again: restarted):
    /// re-plans over the workers in the pipeline and those, leaving out any that fails to
    /// connect again. Returns the names of the workers the new plan runs on. When that fails
    /// (a worker answers but refuses), re-plans without them and returns the error.
    pub fn rejoin(&mut self, back: &[String]) -> Result<Vec<String>, ClusterError> {
        self.note_gone();
        let out: Vec<String> = self
            .missing
            .iter()
            .filter(|m| !back.contains(m))
            .cloned()
            .collect();
        if let Err(e) = self.rebuild(|w| !out.contains(&w.endpoint.name)) {
            // back on the workers that ran before, so that a bad newcomer breaks nothing
            let missing = self.missing.clone();
            return Err(
                match self.rebuild(|w| !missing.contains(&w.endpoint.name)) {
                    Ok(()) => e,
                    Err(e2) => ClusterError::Invalid(format!("{e}; and without them: {e2}")),
                },
            );
        }
        Ok(self.plan.devices.iter().map(|d| d.name.clone()).collect())
    }

    /// Counts the gone devices among the missing ones.
    fn note_gone(&mut self) {
        for g in self.gone() {
            if !self.missing.contains(&g) {
                self.missing.push(g);
            }
        }
    }

    /// Stops the pipeline and sets the cluster up again over the workers `keep` keeps, with
    /// the planner, trying each worker once; the workers left out are the missing ones.
    fn rebuild(&mut self, keep: impl Fn(&WorkerSpec) -> bool) -> Result<(), ClusterError> {
        (self.generation).fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.rt.block_on(self.pipeline.shutdown());
        let workers: Vec<WorkerSpec> = self.workers.iter().filter(|w| keep(w)).cloned().collect();
        let mut opts = self.opts.clone();
        opts.plan = None;
        opts.connect_retry = Duration::ZERO;
        let t = Instant::now();
        let slices = Slices {
            dir: self.model_dir.clone(),
            manifest: self.manifest.clone(),
        };
        let s = self.rt.block_on(setup(&slices, &workers, &opts))?;
        self.pipeline = s.pipeline;
        self.hop_links = s.hop_links;
        self.plan = s.plan;
        self.shape = s.shape;
        self.cluster = s.cluster;
        self.step = s.step;
        self.reports = s.reports;
        self.adapt = s.adapt;
        self.setup_s = t.elapsed().as_secs_f64();
        self.missing = self
            .workers
            .iter()
            .filter(|w| !keep(w) || s.unreachable.contains(&w.endpoint.name))
            .map(|w| w.endpoint.name.clone())
            .collect();
        remember_profiles(&mut self.workers, &s.profiles);
        Ok(())
    }

    /// Says goodbye to every worker.
    pub fn shutdown(self) {
        self.rt.block_on(self.pipeline.shutdown());
    }
}

fn remember_profiles(workers: &mut [WorkerSpec], profiles: &[(String, DeviceProfile)]) {
    for w in workers {
        if let Some((_, p)) = profiles.iter().find(|(n, _)| *n == w.endpoint.name) {
            w.profile = Some(p.clone());
        }
    }
}

/// Generates on `pipe` (see [`Session::generate`]).
pub fn generate_on(
    pipe: &Pipeline,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<GenerateOutput, ClusterError> {
    let seq = next_seq_id();
    let mut be = pipe.backend();
    let r = generate(&mut be, seq, prompt, opts, on_token);
    pipe.release(&[seq]);
    match (r, be.error) {
        (Ok(o), _) => Ok(o),
        (Err(_), Some(e)) => Err(e),
        (Err(e), None) => Err(ClusterError::Runtime(RuntimeError::Engine(e))),
    }
}
