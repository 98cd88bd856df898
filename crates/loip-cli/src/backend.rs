//! The one backend behind `loip generate`, `loip serve` and `loip api`: flags to a
//! [`Backend`] (this machine in memory, from slice files with `--mem`, or a cluster), so
//! that the three commands run every request on the same batched serving path. Also the
//! cluster and offloading flags they share, and what they print of a cluster's setup.
//!
//! Invariant: which backend a command gets depends only on its flags and the model
//! directory (a slice directory runs from slice files), the same way for every command.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use loip_model::Checkpoint;
use loip_plan::cluster::RawCluster;
use loip_plan::{Cluster, Pattern};
use loip_runtime::cluster_run::{Breakdown, Session, SessionOptions, WorkerSpec};
use loip_runtime::coordinator::Endpoint;
use loip_runtime::{LoaderKind, MemoryReport};
use loip_server::{Backend, ClusterServing};

use crate::model_load;

/// Cluster options shared by `loip serve` and `loip generate --cluster`.
#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// Cluster file (TOML): `[[device]]` entries with `name` and `addr`, and optionally a
    /// `preset`/`profile`/inline profile and `mem` (devices without one are measured).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// File holding the workers' shared secret (first line; default: `$LOIP_TOKEN`).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The shared secret itself (visible to other users in `ps`: prefer --token-file or
    /// `$LOIP_TOKEN`).
    #[arg(long)]
    pub token: Option<String>,
    /// File of the devices' pinned keys (first contact records a device's key, a changed key
    /// is refused). Default: `$LOIP_KNOWN_DEVICES`, else `known_devices` beside the cluster file.
    #[arg(long, value_name = "FILE")]
    pub known_devices: Option<PathBuf>,
    /// Accept (and pin) a new key for this device, e.g. after its store was replaced
    /// (repeatable).
    #[arg(long, value_name = "DEVICE")]
    pub accept_new_key: Vec<String>,
    /// Planner: loip, loip-paper, loip-uniform, pp, pp-offload, edgeshard, …
    #[arg(long, default_value = "loip")]
    pub planner: String,
    /// Use the cluster file's `[link]` for planning instead of the measured links.
    #[arg(long)]
    pub file_link: bool,
    /// Relay every hop through the coordinator instead of handing the rows from worker to
    /// worker (for networks where workers cannot reach each other).
    #[arg(long)]
    pub relay: bool,
    /// Online adaptation may lend KV to the peer with the most spare memory when a device
    /// nears a memory threshold, fetched back before its stage runs again (off by default).
    #[arg(long)]
    pub lend: bool,
    /// Write the plan as JSON to this file.
    #[arg(long)]
    pub plan_out: Option<PathBuf>,
    /// At start, try a worker that refuses or does not answer again for this long (backoff
    /// from 0.25 s to 4 s, each try logged), then leave it out or fail naming its address.
    #[arg(long, default_value = "30s", value_parser = crate::cluster_ux::parse_retry)]
    pub connect_retry: std::time::Duration,
}

/// A cluster file's workers: devices with a profile keep it, the others are measured.
pub fn read_workers(path: &Path) -> Result<(Vec<WorkerSpec>, Cluster)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading cluster file {}", path.display()))?;
    let mut raw: RawCluster =
        toml::from_str(&text).with_context(|| format!("in cluster file {}", path.display()))?;
    let mut measure = Vec::new();
    for d in &mut raw.device {
        let has_profile = d.profile.is_some() || d.preset.is_some() || d.mem_bw.is_some();
        measure.push(!has_profile);
        if !has_profile {
            // A placeholder that passes validation; replaced by the measured profile.
            d.preset = Some("host-zen5-2c".into());
        }
    }
    if raw.link.is_none() {
        raw.link = Some(loip_plan::cluster::RawLink {
            bandwidth: Some(loip_plan::cluster::NumOrStr::Str("1gbit".into())),
            latency: Some(loip_plan::cluster::NumOrStr::Str("0.1ms".into())),
        });
    }
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut load = |p: &str| std::fs::read_to_string(base.join(p)).map_err(|e| e.to_string());
    let cluster = raw
        .validate(&mut load)
        .with_context(|| format!("in cluster file {}", path.display()))?;
    let mut workers = Vec::new();
    for (i, d) in cluster.devices.iter().enumerate() {
        let addr = d
            .addr
            .clone()
            .with_context(|| format!("device `{}` has no `addr`", d.name))?;
        workers.push(WorkerSpec {
            endpoint: Endpoint {
                name: d.name.clone(),
                addr,
            },
            profile: (!measure[i]).then(|| d.profile.clone()),
            mem: raw.device[i].mem.is_some().then_some(d.profile.mem_budget),
            reserve: d.reserve,
        });
    }
    Ok((workers, cluster))
}

/// Prints what setup found and decided (stderr).
pub fn print_setup(s: &Session) {
    crate::cluster_ux::print_plan(&s.reports, &s.plan);
    eprintln!("setup took {:.2} s", s.setup_s);
}

/// Prints ms/token and its breakdown (stderr).
pub fn print_breakdown(b: &Breakdown, measured_ms: f64, predicted_ms: f64) {
    eprintln!(
        "{measured_ms:.2} ms/token (plan predicted {predicted_ms:.2}): compute {:.2}, network {:.2}, load stall {:.2}, queued {:.2} ms/step",
        b.compute_ms, b.network_ms, b.load_stall_ms, b.queued_ms
    );
}

/// Brings a cluster up for `model` (a path or `smollm2`, split into `dir`), planning for `context` tokens
/// (and for greedy generations' 8-byte token return when `greedy`).
#[allow(clippy::too_many_arguments)]
pub fn start(
    dir: &Path,
    model: &str,
    c: &ClusterArgs,
    loader: LoaderKind,
    pattern: Pattern,
    micro_batches: Option<u32>,
    context: u64,
    max_step_tokens: usize,
    greedy: bool,
) -> Result<Session> {
    let (workers, opts) = session_options(
        model,
        c,
        loader,
        pattern,
        micro_batches,
        context,
        max_step_tokens,
        greedy,
    )?;
    let s = Session::start(dir, workers, opts)?;
    if let Some(p) = &c.plan_out {
        std::fs::write(p, s.plan.to_json()).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(s)
}

/// The cluster file's workers and how [`start`] brings them up.
#[allow(clippy::too_many_arguments)]
pub fn session_options(
    model: &str,
    c: &ClusterArgs,
    loader: LoaderKind,
    pattern: Pattern,
    micro_batches: Option<u32>,
    context: u64,
    max_step_tokens: usize,
    greedy: bool,
) -> Result<(Vec<WorkerSpec>, SessionOptions)> {
    let file = c.cluster.as_deref().context("--cluster FILE is required")?;
    let (workers, cluster) = read_workers(file)?;
    let mut opts = SessionOptions {
        planner: c.planner.clone(),
        pattern,
        micro_batches,
        context,
        max_step_tokens,
        loader,
        link: c.file_link.then_some(cluster.link),
        shape_name: model.to_string(),
        greedy,
        relay: c.relay,
        lending: c.lend,
        connect_retry: c.connect_retry,
        ..Default::default()
    };
    opts.connect.token =
        loip_runtime::net::token::from_sources(c.token_file.as_deref(), c.token.as_deref())?;
    let known = loip_runtime::net::known::resolve_path(c.known_devices.as_deref(), file);
    opts.connect.known_devices = Some(std::sync::Arc::new(
        loip_runtime::net::known::KnownDevices::new(known, c.accept_new_key.clone()),
    ));
    opts.on_ship = ship_bars(false);
    Ok((workers, opts))
}

/// Memory budget and offloading options of a single device.
#[derive(Args, Debug, Clone)]
pub struct OffloadArgs {
    /// Memory budget, e.g. `300MiB`: keep what fits resident, stream the rest from slice files.
    #[arg(long)]
    pub mem: Option<String>,
    /// Which blocks to offload: auto (what the budget needs, last layers first), none, mlp,
    /// attn, all, alternate (every other layer), or plan (the `loip` planner decides; needs --mem).
    #[arg(long, default_value = "auto")]
    pub offload_blocks: loip_runtime::local::OffloadRule,
    /// Loading path for offloaded blocks: direct (io_uring, O_DIRECT, one slot) or conventional.
    #[arg(long, default_value = "direct")]
    pub loader: loip_runtime::LoaderKind,
    /// Load offloaded blocks only when needed instead of overlapping loads with compute.
    #[arg(long)]
    pub no_overlap: bool,
}

impl OffloadArgs {
    /// Whether the run goes through slice files (any offloading option set).
    pub fn sliced(&self) -> bool {
        self.mem.is_some() || self.offload_blocks != loip_runtime::local::OffloadRule::Auto
    }
}

/// Peak resident set size of this process (`VmHWM`), bytes.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Where a command's model runs, resolved from its flags.
pub enum Source {
    /// this machine, the whole checkpoint in memory
    Memory(Checkpoint),
    /// this machine, from the slice files in this directory
    Slices(PathBuf),
    /// a cluster; the slice files to ship are in this directory
    Cluster(PathBuf),
}

/// The source for `model` under the flags, and what requests need of the model.
pub fn source(
    model: &str,
    offload: &OffloadArgs,
    cluster: &ClusterArgs,
) -> Result<(Source, model_load::ModelInfo)> {
    let sliced = offload.sliced() || Path::new(model).join(loip_model::slice::MANIFEST).is_file();
    if cluster.cluster.is_some() || sliced {
        if let (Some(m), None) = (offload.mem.as_deref(), &cluster.cluster) {
            // a budget too small for this process is refused before a slice is written
            split(loip_plan::parse_bytes(m)?, 1)?;
        }
        let dir = crate::cmd_split::slices_for(model)?;
        // The slice directory carries the config and tokenizer; the checkpoint is not opened.
        let info = model_load::info(&dir.to_string_lossy())?;
        let src = if cluster.cluster.is_some() {
            Source::Cluster(dir)
        } else {
            Source::Slices(dir)
        };
        return Ok((src, info));
    }
    let ckpt = model_load::open(model)?;
    let info = model_load::ModelInfo {
        config: ckpt.config.clone(),
        tokenizer: model_load::tokenizer(&ckpt),
        chat: model_load::chat_template(&ckpt),
    };
    Ok((Source::Memory(ckpt), info))
}

/// How a command serves: sizes, and how a cluster is planned.
pub struct How<'a> {
    /// the model as given (a cluster plan's shape name)
    pub model: &'a str,
    /// offloading options on this machine
    pub offload: &'a OffloadArgs,
    /// the cluster's flags
    pub cluster: &'a ClusterArgs,
    /// loading path of offloaded blocks (on the workers for a cluster)
    pub loader: LoaderKind,
    /// sequences at once
    pub parallel: usize,
    /// most tokens in one step (sizes the working buffers)  // tokens
    pub max_step_tokens: usize,
    /// one sequence's prompt + new tokens at most  // tokens
    pub context: usize,
    /// a cluster: plan for this pattern
    pub pattern: Pattern,
    /// a cluster: micro-batches in flight (default: one per plan device)
    pub micro_batches: Option<u32>,
    /// a cluster: planned KV tokens, summed over the sequences in flight  // tokens
    pub planned_context: u64,
    /// a cluster: every request is greedy (the last device returns token ids)
    pub greedy: bool,
    /// a cluster: keep a failed cluster as it is instead of re-planning
    pub no_replan: bool,
    /// print nothing of the setup
    pub quiet: bool,
}

/// An opened backend.
pub struct Opened {
    /// the backend
    pub backend: Backend,
    /// how the device's budget is spent (from slice files)
    pub memory: Option<MemoryReport>,
}

/// `--mem` is the whole process's budget, as the kernel counts it: the engine gets what this
/// process (its code, tokenizer, runtime, `parallel` requests' buffers and threads) leaves.
pub fn engine_share(total: u64, parallel: usize) -> Result<loip_runtime::memory::Budget> {
    loip_runtime::memory::return_freed_memory();
    let b = split(total, parallel)?;
    loip_runtime::memory::set_budget(b);
    Ok(b)
}

/// `total` split between this process as it is now, with `parallel` requests in flight, and
/// an engine of at least 4 MiB.
fn split(total: u64, parallel: usize) -> Result<loip_runtime::memory::Budget> {
    let threads = 4 + std::thread::available_parallelism().map_or(1, |n| n.get());
    // per request in flight: its prompt, logits and a response, bounded by the server
    let requests = parallel.max(1) as u64 * (1 << 20);
    Ok(loip_runtime::memory::split_this_process(
        total,
        threads,
        requests,
        4 << 20,
    )?)
}

/// Opens `src` as a batched backend.
pub fn open(src: Source, how: &How<'_>) -> Result<Opened> {
    match src {
        Source::Memory(ckpt) => Ok(Opened {
            backend: Backend::local(ckpt, how.parallel)?,
            memory: None,
        }),
        Source::Slices(dir) => {
            use loip_runtime::local::{LocalModel, LocalOptions};
            let mem_budget = match how.offload.mem.as_deref() {
                Some(m) => {
                    let b = engine_share(loip_plan::parse_bytes(m)?, how.parallel)?;
                    if !how.quiet {
                        eprintln!("{b}");
                    }
                    Some(b.engine)
                }
                None => None,
            };
            let opts = LocalOptions {
                mem_budget,
                rule: how.offload.offload_blocks,
                loader: how.offload.loader,
                overlap: !how.offload.no_overlap,
                context: how.context,
                max_step_tokens: how.max_step_tokens,
            };
            let model = LocalModel::open_batched(&dir, &opts, how.parallel)?;
            let memory = model.device.memory();
            Ok(Opened {
                backend: Backend::sliced(model, how.parallel, how.max_step_tokens)?,
                memory: Some(memory),
            })
        }
        Source::Cluster(dir) => {
            let session = start(
                &dir,
                how.model,
                how.cluster,
                how.loader,
                how.pattern,
                how.micro_batches,
                how.planned_context,
                how.max_step_tokens,
                how.greedy,
            )?;
            if !how.quiet {
                print_setup(&session);
            }
            let micro_batches = how
                .micro_batches
                .map_or(session.plan.devices.len(), |m| m as usize);
            let backend = Backend::cluster(
                session,
                ClusterServing {
                    micro_batches,
                    parallel: how.parallel,
                    max_step_tokens: how.max_step_tokens,
                    context: how.context,
                    no_replan: how.no_replan,
                },
            )?;
            Ok(Opened {
                backend,
                memory: None,
            })
        }
    }
}

/// The memory line of a device run from slice files (stderr).
pub fn print_memory(m: &MemoryReport) {
    let b = loip_plan::units::format_bytes;
    eprint!(
        "memory: budget {}, resident {}, slot {}, working {}, KV budget {}",
        b(m.budget),
        b(m.resident),
        b(m.slot),
        b(m.working),
        b(m.kv_budget)
    );
}

/// A cluster's plan and the pipeline's per-token breakdown since the last call, as `--json`
/// reports them.
pub fn cluster_report(
    backend: &Backend,
    with_plan: bool,
) -> Result<Option<(Breakdown, f64, serde_json::Map<String, serde_json::Value>)>> {
    let Some(session) = backend.session() else {
        return Ok(None);
    };
    let b = Breakdown::of(&backend.take_totals());
    let mut extra = serde_json::Map::new();
    let predicted = {
        let s = loip_server::backend::lock(session);
        if with_plan {
            extra.insert("plan".into(), serde_json::to_value(&s.plan)?);
        }
        s.plan.predicted_ms_per_token
    };
    extra.insert("breakdown".into(), serde_json::to_value(b)?);
    Ok(Some((b, predicted, extra)))
}

/// A progress bar per device for the slices going out to it (bytes, rate, time left), on a
/// terminal; `None` when `quiet` or stderr is not a terminal.
pub fn ship_bars(quiet: bool) -> Option<loip_runtime::coordinator::OnShip> {
    use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
    use loip_runtime::coordinator::{OnShip, ShipProgress};
    if quiet || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return None;
    }
    let multi = MultiProgress::new();
    let bars: std::sync::Mutex<std::collections::HashMap<String, ProgressBar>> = Default::default();
    Some(OnShip(std::sync::Arc::new(move |p: ShipProgress<'_>| {
        if p.total == 0 {
            return;
        }
        let mut bars = bars.lock().unwrap_or_else(|e| e.into_inner());
        let bar = bars.entry(p.device.to_string()).or_insert_with(|| {
            let b = multi.add(ProgressBar::new(p.total));
            let tpl = "{prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}";
            b.set_style(
                ProgressStyle::with_template(tpl).unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_prefix(format!("slices to {}", p.device));
            b
        });
        // a later call for the same device (the probe's layer first, then the rest)
        if bar.length() != Some(p.total) || p.sent < bar.position() {
            bar.reset();
            bar.set_length(p.total);
        }
        bar.set_position(p.sent);
        if p.sent >= p.total {
            bar.finish();
        }
    })))
}
