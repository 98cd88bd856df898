//! The whole system on this machine: N worker processes on loopback with memory budgets (by
//! default budgets that force offloading), the coordinator's session over them, and what
//! `loip local` runs on it: one generation or a burst of them, micro-batch sizes side by
//! side, and the benchmark matrix (patterns × link limits × planners).

mod batches;
mod bench;
mod run;

pub use batches::{compare_micro_batches, micro_batch_choice, MicroBatchRow};
pub use bench::{bench, bench_store_root, BenchMatrix, BenchRow};
pub use run::{prepared, run, start, Event, Generated, Job, Outcome};

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use loip_engine::generate::Flow;
use loip_engine::{GenerateOptions, GenerateOutput};
use loip_model::slice::Manifest;
use loip_plan::{DeviceProfile, Pattern};
use loip_runtime::cluster_run::{Preview, Session, SessionOptions};
use loip_runtime::coordinator::OnShip;
pub use loip_runtime::local_cluster::{bench_budgets, scratch_size, CgroupReport};
use loip_runtime::local_cluster::{default_budgets, LocalWorkerOptions, LocalWorkers};
use loip_runtime::LoaderKind;

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

    /// One budget per device: the given ones, or budgets that force offloading for
    /// `context` tokens.
    pub fn budgets(&self, m: &Manifest, context: u64) -> Result<Vec<u64>> {
        match &self.mem {
            None => Ok(default_budgets(m, self.devices, context)),
            Some(v) if v.len() == 1 || v.len() == self.devices => {
                Ok((0..self.devices).map(|i| v[i.min(v.len() - 1)]).collect())
            }
            Some(v) => bail!("--mem has {} values for {} devices", v.len(), self.devices),
        }
    }

    fn session_options(
        &self,
        planner: &str,
        pattern: Pattern,
        bandwidth: Option<f64>,
        context: u64,
        max_step: usize,
        token: &str,
    ) -> SessionOptions {
        let mut o = SessionOptions {
            planner: planner.to_string(),
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
            // a round (off by default: this VM's disk serves concurrent readers at ~1.6 GB/s
            // in all against ~0.9 for one, so fair sharing of one reader's rate is too
            // pessimistic).
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
        o.connect.bandwidth = bandwidth;
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

    fn profiles(&self, n: usize) -> Option<Vec<DeviceProfile>> {
        self.profile.clone().map(|p| vec![p; n])
    }
}

/// A link limit: `unlimited`/`none` or a bandwidth (`100mbit`), bytes/s.
pub fn parse_bandwidth(s: &str) -> Result<Option<f64>> {
    if s == "unlimited" || s == "none" {
        return Ok(None);
    }
    Ok(Some(
        loip_plan::parse_bandwidth(s).with_context(|| format!("bandwidth {s}"))?,
    ))
}

/// Local workers and the coordinator's session over them, planned for a prompt.
pub struct LocalCluster {
    /// the worker processes (killed, stores removed, on drop)
    pub workers: LocalWorkers,
    /// the session: plan, devices, pipeline
    pub session: Session,
    /// each worker's budget, bytes
    pub budgets: Vec<u64>,
    /// each worker runs in a memory cgroup of its budget
    pub cgroup: bool,
}

impl LocalCluster {
    /// Spawns the workers and starts a session for the slice files in `dir`, planned for
    /// [`LocalOptions::sequences`] sequences of `prompt_len` + `max_tokens` tokens (the
    /// prompts' KV only, adapting online, unless `whole_context`). `on_spawned` sees the
    /// budgets before the session starts.
    pub fn start(
        dir: &Path,
        o: &LocalOptions,
        prompt_len: usize,
        max_tokens: usize,
        on_spawned: &mut dyn FnMut(&[u64]),
    ) -> Result<LocalCluster> {
        let (workers, budgets, opts) = spawn(dir, o, prompt_len, max_tokens, on_spawned)?;
        let fixed = o.profiles(workers.procs.len());
        let session = Session::start(dir, workers.specs(fixed.as_deref()), opts)?;
        Ok(LocalCluster {
            workers,
            session,
            budgets,
            cgroup: o.cgroup,
        })
    }

    /// Spawns the workers as [`LocalCluster::start`] does and plans on them as it would,
    /// then stops them: the plan without loading anything (`loip local --preview`).
    pub fn preview(
        dir: &Path,
        o: &LocalOptions,
        prompt_len: usize,
        max_tokens: usize,
        on_spawned: &mut dyn FnMut(&[u64]),
    ) -> Result<Preview> {
        let (workers, _, opts) = spawn(dir, o, prompt_len, max_tokens, on_spawned)?;
        let fixed = o.profiles(workers.procs.len());
        Ok(Session::preview(
            dir,
            &workers.specs(fixed.as_deref()),
            &opts,
        )?)
    }

    /// Generates `n` sequences of `prompt` (one: streamed to `on_token`; several: at once,
    /// as a burst). Returns the first sequence, every sequence's ids when several, the mean
    /// decode ms/token per sequence and the burst's wall ms/token.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        n: usize,
        on_token: &mut dyn FnMut(u32) -> Flow,
    ) -> Result<Burst> {
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
        let first = outs.into_iter().next().context("no sequence")?;
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

/// The workers of a local cluster for `prompt_len` + `max_tokens` tokens per sequence, their
/// budgets and the session's options (the prompts' KV only, adapting online, unless
/// `whole_context`). `on_spawned` sees the budgets.
fn spawn(
    dir: &Path,
    o: &LocalOptions,
    prompt_len: usize,
    max_tokens: usize,
    on_spawned: &mut dyn FnMut(&[u64]),
) -> Result<(LocalWorkers, Vec<u64>, SessionOptions)> {
    if o.devices == 0 {
        bail!("--devices must be at least 1");
    }
    let n = o.sequences();
    let manifest = Manifest::load(dir)?;
    let context = ((prompt_len + max_tokens) * n + o.step_slack) as u64;
    let budgets = o.budgets(&manifest, context)?;
    let token = loip_runtime::net::token::generate();
    let workers = LocalWorkers::spawn(&LocalWorkerOptions {
        exe: std::env::current_exe().context("locating the loip binary")?,
        budgets: budgets.clone(),
        bandwidth: o.bandwidth,
        token: token.clone(),
        store_root: o.store_root.clone(),
        cgroup: o.cgroup,
    })?;
    on_spawned(&budgets);
    let pattern = if n > 1 {
        Pattern::Bursty
    } else {
        Pattern::Sporadic
    };
    let max_step = prompt_len.max(o.step_slack + 1);
    let mut opts = o.session_options(&o.planner, pattern, o.bandwidth, context, max_step, &token);
    // Plan for the prompts' KV and adapt online as it grows (design §6).
    if !o.whole_context {
        opts.admitted = Some((prompt_len * n) as u64);
    }
    opts.on_ship = o.on_ship.clone();
    Ok((workers, budgets, opts))
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
