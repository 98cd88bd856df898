//! A cluster of worker processes on this machine (`loip local`): their budgets, spawning
//! them on loopback (each in its own memory cgroup if asked), the specs a session connects
//! to, and cleaning up — killed with their temporary stores on drop, and on Ctrl-C.
//!
//! The remote cluster is [`crate::cluster_run`]; this is the same cluster with the workers
//! started here, one way for every job ([`LocalCluster::start_as`]: workers spawned for a
//! request or shared by a benchmark's rows, planned over one opened slice directory, then
//! started or, for a preview, only planned), so the CLI only maps flags onto it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use loip_engine::generate::Flow;
use loip_engine::{GenerateOptions, GenerateOutput};
use loip_model::slice::{Manifest, SliceKind, Slices};
use loip_plan::{DeviceProfile, Pattern};
use serde::Serialize;

pub use crate::cluster_run::Until;
use crate::cluster_run::{
    kill_pid, on_interrupt, Opened, Preview, Session, SessionOptions, WorkerProcess, WorkerSpec,
};
use crate::coordinator::{ClusterError, OnShip};
use crate::loader::LoaderKind;
use crate::memory::Cgroup;
use crate::RuntimeError;

/// Budgets that make every device stream blocks: the worker process itself
/// ([`crate::memory::WORKER_PROCESS_ESTIMATE`]), `working` (the working buffers the planner
/// counts for a step), the embedding / head where they live, the KV cache of `context`
/// tokens, one streaming slot (the largest layer's two blocks) and 60 % of an even share of
/// the layers. With a few layers a device or more, the slot stays below the other 40 % of a
/// share, so no device can keep its share resident, together they cannot keep every layer,
/// and the plan streams blocks (SmolLM2 on 3 workers, 64 tokens: 81.3, 52.6, 81.3 MiB).  // bytes
pub fn default_budgets(m: &Manifest, devices: usize, context: u64, working: u64) -> Vec<u64> {
    let size = |k: SliceKind| m.slice(k).map_or(0, |s| s.size);
    let layer = |l: usize| size(SliceKind::Attn(l)) + size(SliceKind::Mlp(l));
    let layers: u64 = (0..m.config.num_layers).map(layer).sum();
    let slot = (0..m.config.num_layers).map(layer).max().unwrap_or(0);
    let kv = context
        * m.config.num_layers as u64
        * 2
        * (m.config.num_kv_heads * m.config.head_dim) as u64
        * 4;
    let base = crate::memory::WORKER_PROCESS_ESTIMATE + working + kv + slot;
    (0..devices)
        .map(|i| {
            let mut b = base + layers * 6 / 10 / devices as u64;
            if i == 0 {
                b += size(SliceKind::Embed);
            }
            if i + 1 == devices {
                b += size(SliceKind::Head)
                    + if m.config.tie_word_embeddings && i != 0 {
                        size(SliceKind::Embed)
                    } else {
                        0
                    };
            }
            b
        })
        .collect()
}

/// The benchmark's budgets: engines that together get 60 % of the model's bytes (all
/// slices), split 2:1:2:1… so that the devices differ and rounded down to MiB, each plus a
/// worker process's own share ([`WORKER_PROCESS_ESTIMATE`](crate::memory::WORKER_PROCESS_ESTIMATE),
/// since `--mem` is the whole process's budget). On llama-1b (2.1 GB) and 3 devices: 531, 279,
/// 531 MiB. No single-stage pipeline fits (`pp`, `edgeshard` report OOM); the interleaved
/// plans offload.  // bytes
pub fn bench_budgets(m: &Manifest, devices: usize) -> Vec<u64> {
    let total: u64 = m.slices.iter().map(|s| s.size).sum();
    let w: Vec<u64> = (0..devices)
        .map(|i| if i % 2 == 0 { 2 } else { 1 })
        .collect();
    let sum: u64 = w.iter().sum();
    w.iter()
        .map(|&wi| {
            let engine = (total * 6 / 10 * wi / sum) >> 20 << 20;
            engine + crate::memory::WORKER_PROCESS_ESTIMATE
        })
        .collect()
}

/// Worker children and temp dirs alive now, for the Ctrl-C handler.
static LIVE: Mutex<(Vec<u32>, Vec<PathBuf>)> = Mutex::new((Vec::new(), Vec::new()));
/// Scratch kept on purpose (the benchmark's stores), reported when interrupted.
static KEPT: Mutex<Option<PathBuf>> = Mutex::new(None);

fn live() -> std::sync::MutexGuard<'static, (Vec<u32>, Vec<PathBuf>)> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// On SIGINT / SIGTERM: kills the worker children, removes the temp stores, says where kept
/// scratch is, exits 130.
pub fn install_interrupt_cleanup() {
    let r = on_interrupt(|| {
        let (pids, dirs) = std::mem::take(&mut *live());
        for pid in pids {
            kill_pid(pid);
        }
        for d in dirs {
            let _ = std::fs::remove_dir_all(&d);
        }
        let kept = KEPT.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match kept {
            Some(k) => eprintln!(
                "interrupted: workers stopped; stores kept in {} ({})",
                k.display(),
                scratch_size(&k)
            ),
            None => eprintln!("interrupted: workers stopped, temp stores removed"),
        }
    });
    if let Err(e) = r {
        tracing::warn!("no Ctrl-C handler: {e}");
    }
}

/// Scratch under `dir` is kept on purpose (reported when interrupted).
pub fn keep_scratch(dir: &Path) {
    *KEPT.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir.to_path_buf());
}

/// Bytes under `dir`, formatted.
pub fn scratch_size(dir: &Path) -> String {
    fn walk(p: &Path) -> u64 {
        let Ok(rd) = std::fs::read_dir(p) else {
            return 0;
        };
        rd.flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() => walk(&e.path()),
                Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
                _ => 0,
            })
            .sum()
    }
    loip_plan::units::format_bytes(walk(dir))
}

/// How to start the workers.
#[derive(Debug, Clone, Default)]
pub struct LocalWorkerOptions {
    /// the `loip` binary to run (`loip worker …`)
    pub exe: PathBuf,
    /// each worker's `--mem`, bytes
    pub budgets: Vec<u64>,
    /// emulated outgoing bandwidth of every worker, bytes/s
    pub bandwidth: Option<f64>,
    /// the shared secret (given in `LOIP_TOKEN`, never on a command line)
    pub token: String,
    /// where the stores live (kept); `None`: a temporary directory removed on drop
    pub store_root: Option<PathBuf>,
    /// each worker in a fresh memory cgroup of exactly its `--mem`
    pub cgroup: bool,
}

/// Name of a local cluster's temp stores, before the owning process's id.
const SCRATCH_PREFIX: &str = "loip-local-";

/// Removes the temp stores (`loip-local-PID` in `tmp`) of local clusters whose process is
/// gone: a run killed with SIGKILL cannot remove its own (about 126 MB for SmolLM2 on three
/// workers). Only where `/proc` tells which processes live; logged with the bytes freed.
pub fn sweep_stale_scratch(tmp: &Path) {
    let proc = Path::new("/proc");
    if !proc.join("self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(SCRATCH_PREFIX))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if proc.join(pid.to_string()).exists() {
            continue;
        }
        let dir = e.path();
        let size = scratch_size(&dir);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => tracing::info!(
                "removed {} ({size}), left by local workers of process {pid}, which is gone",
                dir.display()
            ),
            Err(err) => tracing::warn!("cannot remove {}: {err}", dir.display()),
        }
    }
}

/// Worker processes of this binary on loopback; killed (and their temp stores removed) on
/// drop.
pub struct LocalWorkers {
    /// the workers, `dev1`, `dev2`, … in order
    pub procs: Vec<WorkerProcess>,
    /// each worker's `--mem`, bytes
    pub budgets: Vec<u64>,
    /// the shared secret they were started with
    token: String,
    temp: Option<PathBuf>,
}

impl LocalWorkers {
    /// Starts one `loip worker` per budget and waits for each to listen.
    pub fn spawn(o: &LocalWorkerOptions) -> Result<LocalWorkers, ClusterError> {
        let (root, temp) = match &o.store_root {
            Some(r) => (r.clone(), None),
            None => {
                sweep_stale_scratch(&std::env::temp_dir());
                let t =
                    std::env::temp_dir().join(format!("{SCRATCH_PREFIX}{}", std::process::id()));
                live().1.push(t.clone());
                (t.clone(), Some(t))
            }
        };
        // dropped on an error: the workers started so far are killed
        let mut w = LocalWorkers {
            procs: Vec::new(),
            budgets: o.budgets.clone(),
            token: o.token.clone(),
            temp,
        };
        for (i, b) in o.budgets.iter().enumerate() {
            let name = format!("dev{}", i + 1);
            let mut cmd = Command::new(&o.exe);
            cmd.args(["worker", "--listen", "127.0.0.1:0", "--exit-with-parent"])
                .args(["--name", &name])
                .arg("--mem")
                .arg(b.to_string())
                .arg("--store")
                .arg(root.join(&name))
                .env("LOIP_TOKEN", &o.token);
            if let Some(bw) = o.bandwidth {
                cmd.arg("--bandwidth").arg(format!("{bw}"));
            }
            let cg = if o.cgroup {
                let cg_name = format!("loip-local-{}-{name}", std::process::id());
                let cg = Cgroup::create(&cg_name, *b).map_err(|e| {
                    RuntimeError::Invalid(format!(
                        "creating memory cgroup {cg_name} (--cgroup needs root or a delegated \
                         cgroup): {e}"
                    ))
                })?;
                Some(cg)
            } else {
                None
            };
            let p = WorkerProcess::spawn_in(cmd, Duration::from_secs(120), cg)?;
            live().0.push(p.pid);
            w.procs.push(p);
        }
        Ok(w)
    }

    /// `o.devices` workers with `o`'s budgets ([`default_budgets`] for `context` tokens and
    /// steps of up to `step_tokens` unless given),
    /// link limit, stores and cgroups, sharing a fresh secret.
    pub fn for_options(
        o: &LocalOptions,
        manifest: &Manifest,
        context: u64,
        step_tokens: usize,
    ) -> Result<LocalWorkers, ClusterError> {
        if o.devices == 0 {
            return Err(ClusterError::Invalid("--devices must be at least 1".into()));
        }
        let exe = std::env::current_exe().map_err(|e| RuntimeError::Io {
            path: PathBuf::from("<the loip binary>"),
            source: e,
        })?;
        LocalWorkers::spawn(&LocalWorkerOptions {
            exe,
            budgets: o.budgets(|| {
                let working = o.planned_working(manifest, context, step_tokens);
                default_budgets(manifest, o.devices, context, working)
            })?,
            bandwidth: o.bandwidth,
            token: crate::net::token::generate(),
            store_root: o.store_root.clone(),
            cgroup: o.cgroup,
        })
    }

    /// What a session connects to: `dev1`, `dev2`, … at their addresses, with `profiles`
    /// (one per worker) or measured.
    pub fn specs(&self, profiles: Option<&[DeviceProfile]>) -> Vec<WorkerSpec> {
        self.procs
            .iter()
            .enumerate()
            .map(|(i, p)| WorkerSpec {
                profile: profiles.and_then(|ps| ps.get(i).cloned()),
                ..WorkerSpec::new(format!("dev{}", i + 1), &p.addr)
            })
            .collect()
    }

    /// Each worker's memory cgroup as the kernel saw it (empty without cgroups).
    pub fn cgroup_reports(&self) -> Vec<CgroupReport> {
        self.procs
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.memory().map(|m| (i, m)))
            .map(|(i, m)| CgroupReport {
                device: format!("dev{}", i + 1),
                limit: m.limit.unwrap_or(0),
                peak: m.peak.unwrap_or(0),
                oom_kills: m.oom_kills,
                pressure_events: m.pressure_events,
            })
            .collect()
    }
}

impl Drop for LocalWorkers {
    fn drop(&mut self) {
        let pids: Vec<u32> = self.procs.iter().map(|p| p.pid).collect();
        self.procs.clear();
        if let Some(t) = &self.temp {
            let _ = std::fs::remove_dir_all(t);
        }
        let mut live = live();
        live.0.retain(|p| !pids.contains(p));
        if let Some(t) = &self.temp {
            live.1.retain(|d| d != t);
        }
    }
}

/// One worker's memory cgroup at the end of a run.
#[derive(Debug, Clone, Serialize)]
pub struct CgroupReport {
    /// `devN`
    pub device: String,
    /// bytes (= its --mem)
    pub limit: u64,
    /// highest charge, bytes
    pub peak: u64,
    /// processes the kernel killed for the limit
    pub oom_kills: u64,
    /// times the charge met the limit
    pub pressure_events: u64,
}

impl std::fmt::Display for CgroupReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use loip_plan::units::format_bytes;
        write!(
            f,
            "{}: memory cgroup limit {}, peak charge {} ({:.0}%), OOM kills {}, limit reached {} \
             times",
            self.device,
            format_bytes(self.limit),
            format_bytes(self.peak),
            100.0 * self.peak as f64 / self.limit.max(1) as f64,
            self.oom_kills,
            self.pressure_events
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweeps_only_the_scratch_of_processes_that_are_gone() {
        let root = std::env::temp_dir().join(format!("loip-sweep-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // pid_max is at most 2^22 on Linux: this process cannot exist
        let gone = root.join(format!("{SCRATCH_PREFIX}{}", 1u32 << 30));
        let alive = root.join(format!("{SCRATCH_PREFIX}{}", std::process::id()));
        let other = root.join("loip-local-notapid");
        for d in [&gone, &alive, &other] {
            std::fs::create_dir_all(d.join("dev1")).unwrap();
            std::fs::write(d.join("dev1/slice"), [0u8; 16]).unwrap();
        }
        sweep_stale_scratch(&root);
        assert!(!gone.exists());
        assert!(alive.exists() && other.exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}

/// How a local cluster is made and planned.
#[derive(Clone)]
pub struct LocalOptions {
    /// the model as given (the plan's shape name)
    pub model: String,
    /// worker processes (devices)
    pub devices: usize,
    /// each device's budget, bytes (one value: every device); `None`: budgets that force
    /// offloading ([`default_budgets`]; with the benchmark, [`bench_budgets`])
    pub mem: Option<Vec<u64>>,
    /// emulated link limit between the coordinator and each device, bytes/s
    pub bandwidth: Option<f64>,
    /// planner name
    pub planner: String,
    /// loading path on the workers
    pub loader: LoaderKind,
    /// sequences generated at once from the same prompt (bursty traffic)
    pub concurrent: usize,
    /// each worker in a memory cgroup of exactly its budget
    pub cgroup: bool,
    /// keep the workers' stores here instead of a temp dir
    pub store_root: Option<PathBuf>,
    /// relay every hop through the coordinator
    pub relay: bool,
    /// online adaptation may lend KV
    pub lend: bool,
    /// measure the devices' loaders at the same time
    pub probe_loads_together: bool,
    /// price the devices' loads as sharing one disk
    pub shared_disk: bool,
    /// micro-batch sizes to compare (the largest sizes the steps)
    pub micro_batch_seqs: Vec<usize>,
    /// one profile for every device instead of measuring them
    pub profile: Option<DeviceProfile>,
    /// plan for the whole context up front instead of adapting online
    pub whole_context: bool,
    /// adapt by evicting only
    pub evict_only: bool,
    /// evict where the cost model prices it lower than a switch
    pub evict_when_cheaper: bool,
    /// every request is greedy (the last device returns token ids)
    pub greedy: bool,
    /// positions a step may carry beyond one (a speculative verify step's k drafts), planned
    /// for in the context and the step size
    pub step_slack: usize,
    /// told of the slices going out to each device
    pub on_ship: Option<OnShip>,
}

impl LocalOptions {
    /// Sequences at once (at least one).
    pub fn sequences(&self) -> usize {
        self.concurrent.max(1)
    }

    /// One budget per device: the given ones (one value: every device), or `default()`.
    pub fn budgets(&self, default: impl FnOnce() -> Vec<u64>) -> Result<Vec<u64>, ClusterError> {
        match &self.mem {
            None => Ok(default()),
            Some(v) if v.len() == 1 || v.len() == self.devices => {
                Ok((0..self.devices).map(|i| v[i.min(v.len() - 1)]).collect())
            }
            Some(v) => Err(ClusterError::Invalid(format!(
                "--mem has {} values for {} devices",
                v.len(),
                self.devices
            ))),
        }
    }

    /// The working buffers the planner counts on a device for steps of up to `step_tokens`
    /// tokens per sequence over `context` tokens: the step's, as the runtime accounts them,
    /// when planning for admission; with `whole_context`, the planner's allowance
    /// ([`loip_plan::ModelShape::working_bytes`]).  // bytes
    fn planned_working(&self, m: &Manifest, context: u64, step_tokens: usize) -> u64 {
        let mut shape = crate::shape::shape_from_manifest(&self.model, m);
        let seqs = self.sequences() as u64;
        shape.step_tokens = Some(step_tokens as u64 * seqs);
        if self.whole_context {
            shape.working_bytes(seqs as u32)
        } else {
            shape.step_working_bytes(step_tokens as u64 * seqs, seqs, context.div_ceil(seqs))
        }
    }

    /// The session's options for one plan: `pattern`, `context` tokens, prompts of up to
    /// `max_step` tokens a step, workers that know `token`.
    fn session_options(
        &self,
        pattern: Pattern,
        context: u64,
        max_step: usize,
        token: &str,
    ) -> SessionOptions {
        let mut o = SessionOptions {
            planner: self.planner.clone(),
            pattern,
            micro_batches: (pattern == Pattern::Bursty).then_some(self.sequences() as u32),
            context,
            max_step_tokens: max_step,
            loader: self.loader,
            shape_name: self.model.clone(),
            // The emulated devices share this machine's one disk. Probing their loaders all
            // at once (each device's direct and conventional loader against the others')
            // measured 0.43 GB/s per device on llama-1b where the run then moved 1.0 GB/s
            // per device: in the pipeline the devices' loads are staggered by their stages,
            // and only the planned devices load. One at a time is what the run sees.
            probe_loads_together: self.probe_loads_together,
            // ... and with `shared_disk` the cost model shares its rate among their loads of
            // a round. Off by default; with it, the 3-worker streaming runs' prediction over
            // their threshold switches is 0.85-1.07 of the measured ms/token, without it
            // 0.51-0.74 (CHANGELOG.md, "History of benchmark runs": the shared disk).
            shared_disk: self.shared_disk,
            greedy: self.greedy,
            relay: self.relay,
            lending: self.lend,
            evict_only: self.evict_only,
            adapt: loip_plan::adapt::AdaptConfig {
                evict_over_switch: self.evict_when_cheaper,
                ..Default::default()
            },
            ..Default::default()
        };
        o.connect.token = Some(token.to_string());
        o.connect.bandwidth = self.bandwidth;
        let q = self
            .micro_batch_seqs
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .max(1);
        // a sampled verify step returns the logits of its k + 1 rows (a greedy one, each
        // row's argmax)
        o.max_step_seqs = if self.step_slack > 0 && !self.greedy {
            q.saturating_mul(self.step_slack + 1)
        } else {
            q
        };
        o.max_step_tokens = max_step * q;
        o
    }

    /// `n` copies of the fixed profile, when one is given.
    pub fn profiles(&self, n: usize) -> Option<Vec<DeviceProfile>> {
        self.profile.clone().map(|p| vec![p; n])
    }
}

/// Local workers and the coordinator's session over them, planned for a prompt.
pub struct LocalCluster {
    /// the worker processes (killed, stores removed, when the last holder drops them)
    pub workers: Arc<LocalWorkers>,
    /// the session: plan, devices, pipeline
    pub session: Session,
    /// each worker's budget, bytes
    pub budgets: Vec<u64>,
    /// each worker runs in a memory cgroup of its budget
    pub cgroup: bool,
    /// sequences at once it is planned for ([`LocalOptions::sequences`])
    pub sequences: usize,
}

impl LocalCluster {
    /// The one way a local cluster starts (`loip local`'s generation, micro-batch sizes,
    /// preview and each benchmark row): the workers (`start.workers`, or spawned with `o`'s
    /// budgets, told to `on_spawned`), then `o`'s plan on them for [`LocalOptions::sequences`]
    /// sequences of `prompt_len` + `max_tokens` tokens (the prompts' KV only, adapting online,
    /// unless `whole_context`), started or, with [`Until::Planned`], only made.
    pub fn start_as(
        slices: &Slices,
        o: &LocalOptions,
        start: Start<'_>,
        on_spawned: &mut dyn FnMut(&[u64]),
    ) -> Result<Started, ClusterError> {
        let n = o.sequences();
        let context = ((start.prompt_len + start.max_tokens) * n + o.step_slack) as u64;
        let max_step = start.prompt_len.max(o.step_slack + 1);
        let workers = match start.workers {
            Some(w) => w,
            None => {
                let w = LocalWorkers::for_options(o, &slices.manifest, context, max_step)?;
                on_spawned(&w.budgets);
                Arc::new(w)
            }
        };
        let pattern = if n > 1 {
            Pattern::Bursty
        } else {
            Pattern::Sporadic
        };
        let mut opts = o.session_options(pattern, context, max_step, &workers.token);
        // Plan for the prompts' KV and adapt online as it grows (design §6).
        if !o.whole_context {
            opts.admitted = Some((start.prompt_len * n) as u64);
        }
        opts.on_ship = o.on_ship.clone();
        let profiles = match start.profiles {
            Some(p) => Some(p.to_vec()),
            None => o.profiles(workers.procs.len()),
        };
        let specs = workers.specs(profiles.as_deref());
        Ok(match Session::open(slices, specs, opts, start.until)? {
            Opened::Running(session) => Started::Running(Box::new(LocalCluster {
                session: *session,
                budgets: workers.budgets.clone(),
                workers,
                cgroup: o.cgroup,
                sequences: n,
            })),
            // the workers lived until the plan was made
            Opened::Planned(p) => Started::Planned(p),
        })
    }

    /// [`LocalCluster::start_as`] with workers spawned for it, to a running session.
    pub fn start(
        slices: &Slices,
        o: &LocalOptions,
        prompt_len: usize,
        max_tokens: usize,
        on_spawned: &mut dyn FnMut(&[u64]),
    ) -> Result<LocalCluster, ClusterError> {
        let start = Start::new(prompt_len, max_tokens, Until::Running);
        match LocalCluster::start_as(slices, o, start, on_spawned)? {
            Started::Running(c) => Ok(*c),
            Started::Planned(_) => Err(ClusterError::Invalid("planned, not started".into())),
        }
    }

    /// Generates `n` sequences of `prompt` (one: streamed to `on_token`; several: at once,
    /// as a burst, the first one's tokens told to `on_token` when it ends). Returns the first sequence, every sequence's ids when several, the mean
    /// decode ms/token per sequence and the burst's wall ms/token.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        n: usize,
        on_token: &mut dyn FnMut(u32) -> Flow,
    ) -> Result<Burst, ClusterError> {
        let s = &self.session;
        if n <= 1 {
            let out = s.generate(prompt, opts, on_token)?;
            return Ok(Burst {
                ms_per_token: out.decode_ms_per_token,
                first: out,
                sequences: None,
                wall_ms_per_token: None,
            });
        }
        let prompts = vec![prompt.to_vec(); n];
        let t = Instant::now();
        let outs = s.generate_many(&prompts, opts);
        let wall = t.elapsed().as_secs_f64();
        let outs = outs.into_iter().collect::<Result<Vec<_>, _>>()?;
        let tokens: usize = outs.iter().map(|o| o.new_ids.len()).sum();
        let ms = outs.iter().map(|o| o.decode_ms_per_token).sum::<f64>() / (n * n) as f64;
        let sequences = outs.iter().map(|o| o.new_ids.clone()).collect();
        let first = outs
            .into_iter()
            .next()
            .ok_or_else(|| ClusterError::Invalid("no sequence".into()))?;
        for &id in &first.new_ids {
            if on_token(id) == Flow::Stop {
                break;
            }
        }
        Ok(Burst {
            first,
            sequences: Some(sequences),
            ms_per_token: ms,
            wall_ms_per_token: Some(wall * 1e3 / tokens.max(1) as f64),
        })
    }

    /// Stops the session and the workers.
    pub fn shutdown(self) {
        self.session.shutdown();
        drop(self.workers);
    }
}

/// One start of a local cluster: the request it plans for, how far it goes, and what an
/// earlier start left to reuse.
pub struct Start<'a> {
    /// prompt tokens of each sequence
    pub prompt_len: usize,
    /// tokens generated for each sequence
    pub max_tokens: usize,
    /// how far it goes
    pub until: Until,
    /// workers to run on (the benchmark's, shared by the rows of one link limit); `None`:
    /// spawned for this start
    pub workers: Option<Arc<LocalWorkers>>,
    /// each worker's profile (measured by an earlier start); `None`: `--profile`'s, or
    /// measured
    pub profiles: Option<&'a [DeviceProfile]>,
}

impl Start<'_> {
    /// A start on workers of its own, measured unless `--profile` is given.
    pub fn new(prompt_len: usize, max_tokens: usize, until: Until) -> Start<'static> {
        Start {
            prompt_len,
            max_tokens,
            until,
            workers: None,
            profiles: None,
        }
    }
}

/// What [`LocalCluster::start_as`] made.
pub enum Started {
    /// the workers and the session over them
    Running(Box<LocalCluster>),
    /// the plan of [`Until::Planned`] (its workers stopped)
    Planned(Box<Preview>),
}

/// What [`LocalCluster::generate`] made.
pub struct Burst {
    /// the first sequence
    pub first: GenerateOutput,
    /// every sequence's new ids, when there were several
    pub sequences: Option<Vec<Vec<u32>>>,
    /// decode ms per token of one sequence
    pub ms_per_token: f64,
    /// a burst's wall time per generated token, ms
    pub wall_ms_per_token: Option<f64>,
}
