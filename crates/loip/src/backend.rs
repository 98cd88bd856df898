//! The one backend behind `generate`, `serve`, `api`, `local` and the benches: a model and a
//! placement (this machine in memory, from slice files under a budget, or a cluster) to a
//! [`Backend`], so that every command runs every request on the same batched serving path.
//!
//! Invariant: which backend a caller gets depends only on its options and the model
//! directory (a slice directory runs from slice files), the same way for every caller.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use loip_model::Checkpoint;
use loip_plan::cluster::RawCluster;
use loip_plan::{Cluster, Pattern};
use loip_runtime::cluster_run::{Breakdown, Session, SessionOptions, WorkerSpec};
use loip_runtime::coordinator::{Endpoint, OnShip};
use loip_runtime::local::OffloadRule;
use loip_runtime::memory::Budget;
use loip_runtime::{LoaderKind, MemoryReport};
use loip_server::{Backend, ClusterServing};

use crate::model::{self, ModelInfo};
use crate::slices::{self, OnSplit};

/// Memory budget and offloading on this machine.
#[derive(Debug, Clone)]
pub struct OffloadOptions {
    /// the whole process's budget, bytes: what fits stays resident, the rest streams from
    /// slice files
    pub mem: Option<u64>,
    /// which blocks to offload
    pub rule: OffloadRule,
    /// loading path for offloaded blocks
    pub loader: LoaderKind,
    /// overlap loads with compute
    pub overlap: bool,
}

impl Default for OffloadOptions {
    fn default() -> Self {
        OffloadOptions {
            mem: None,
            rule: OffloadRule::Auto,
            loader: LoaderKind::Direct,
            overlap: true,
        }
    }
}

impl OffloadOptions {
    /// Whether the run goes through slice files (any offloading option set).
    pub fn sliced(&self) -> bool {
        self.mem.is_some() || self.rule != OffloadRule::Auto
    }
}

/// A cluster of workers named in a cluster file, and how to reach and plan it.
#[derive(Clone, Default)]
pub struct ClusterOptions {
    /// the cluster file (TOML `[[device]]` entries)
    pub file: PathBuf,
    /// file holding the workers' shared secret (else `$LOIP_TOKEN`)
    pub token_file: Option<PathBuf>,
    /// the shared secret itself
    pub token: Option<String>,
    /// file of the devices' pinned keys (default beside the cluster file)
    pub known_devices: Option<PathBuf>,
    /// devices whose new key is accepted (and pinned)
    pub accept_new_key: Vec<String>,
    /// planner name (`loip`, `pp`, `edgeshard`, …)
    pub planner: String,
    /// plan with the cluster file's `[link]` instead of the measured links
    pub file_link: bool,
    /// relay every hop through the coordinator
    pub relay: bool,
    /// online adaptation may lend KV to a roomier peer
    pub lend: bool,
    /// write the plan as JSON here
    pub plan_out: Option<PathBuf>,
    /// at start, try a worker that refuses or does not answer again for this long
    pub connect_retry: std::time::Duration,
    /// told of the slices going out to each device
    pub on_ship: Option<OnShip>,
}

/// Where a model runs.
#[derive(Clone, Default)]
pub enum Placement {
    /// this machine, the whole checkpoint in memory (unless the model is a slice directory)
    #[default]
    Memory,
    /// this machine, from slice files under a budget
    Offload(OffloadOptions),
    /// a cluster of workers
    Cluster(ClusterOptions),
}

impl Placement {
    /// This machine's offloading options (the defaults on a cluster or in memory).
    pub fn offload(&self) -> OffloadOptions {
        match self {
            Placement::Offload(o) => o.clone(),
            _ => OffloadOptions::default(),
        }
    }
}

/// Reads and validates a cluster file; profile paths in it are relative to the file.
pub fn read_cluster(path: &Path) -> Result<Cluster> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading cluster file {}", path.display()))?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut load = |p: &str| std::fs::read_to_string(base.join(p)).map_err(|e| e.to_string());
    Cluster::from_toml_str(&text, &mut load)
        .with_context(|| format!("in cluster file {}", path.display()))
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

/// What a backend is sized and planned for, wherever it runs.
#[derive(Debug, Clone)]
pub struct Sizes<'a> {
    /// the model as given (a cluster plan's shape name)
    pub model: &'a str,
    /// sequences at once (`loip api --parallel`)
    pub parallel: usize,
    /// most tokens in one step (sizes the working buffers)  // tokens
    pub max_step_tokens: usize,
    /// one sequence's prompt + new tokens at most  // tokens
    pub context: usize,
    /// loading path of offloaded blocks (on the workers for a cluster)
    pub loader: LoaderKind,
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
    /// most drafts a speculating sequence's step verifies (0: none speculates)  // tokens
    pub speculate_k: usize,
}

impl<'a> Sizes<'a> {
    /// One sequence at a time of up to `context` tokens, sampled, steps of up to `context`
    /// tokens, no speculation.
    pub fn one_sequence(model: &'a str, context: usize, loader: LoaderKind) -> Sizes<'a> {
        Sizes {
            model,
            parallel: 1,
            max_step_tokens: context,
            context,
            loader,
            pattern: Pattern::Sporadic,
            micro_batches: None,
            planned_context: context as u64,
            greedy: false,
            no_replan: false,
            speculate_k: 0,
        }
    }
}

/// Brings a cluster up for the slice files in `dir`: connect, authenticate, measure, plan,
/// ship slices, load.
pub fn start_cluster(dir: &Path, c: &ClusterOptions, s: &Sizes<'_>) -> Result<Session> {
    let (workers, opts) = session_options(c, s)?;
    let session = Session::start(dir, workers, opts)?;
    if let Some(p) = &c.plan_out {
        std::fs::write(p, session.plan.to_json())
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(session)
}

/// The cluster file's workers and how [`start_cluster`] (or a preview) brings them up.
pub fn session_options(
    c: &ClusterOptions,
    s: &Sizes<'_>,
) -> Result<(Vec<WorkerSpec>, SessionOptions)> {
    let (workers, cluster) = read_workers(&c.file)?;
    let (seqs, k) = (s.parallel.max(1), s.speculate_k);
    let mut opts = SessionOptions {
        planner: c.planner.clone(),
        pattern: s.pattern,
        micro_batches: s.micro_batches,
        // a speculating sequence holds its rejected drafts' KV until its next step drops
        // them, and the workers' sliding windows keep as many positions more
        context: s
            .planned_context
            .saturating_add(seqs.saturating_mul(k) as u64),
        max_step_tokens: s.max_step_tokens,
        // a sampled verify step returns the logits of its k + 1 rows (a greedy one, each
        // row's argmax)
        max_step_seqs: if k > 0 && !s.greedy {
            seqs.saturating_mul(k + 1)
        } else {
            1
        },
        loader: s.loader,
        link: c.file_link.then_some(cluster.link),
        shape_name: s.model.to_string(),
        greedy: s.greedy,
        relay: c.relay,
        lending: c.lend,
        connect_retry: c.connect_retry,
        ..Default::default()
    };
    opts.connect.token =
        loip_runtime::net::token::from_sources(c.token_file.as_deref(), c.token.as_deref())?;
    let known = loip_runtime::net::known::resolve_path(c.known_devices.as_deref(), &c.file);
    opts.connect.known_devices = Some(std::sync::Arc::new(
        loip_runtime::net::known::KnownDevices::new(known, c.accept_new_key.clone()),
    ));
    opts.on_ship = c.on_ship.clone();
    Ok((workers, opts))
}

/// Peak resident set size of this process (`VmHWM`), bytes.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Where a model runs, resolved from its placement. One per process, so the checkpoint
/// is held inline.
#[allow(clippy::large_enum_variant)]
pub enum Source {
    /// this machine, the whole checkpoint in memory
    Memory(Checkpoint),
    /// this machine, from the slice files in this directory
    Slices(PathBuf),
    /// a cluster; the slice files to ship are in this directory
    Cluster(PathBuf),
}

/// Whether `model` under `placement` runs from slice files (a cluster, a budget or an
/// offloading rule, or a slice directory given as the model).
pub fn needs_slices(model: &str, placement: &Placement) -> bool {
    matches!(placement, Placement::Cluster(_))
        || placement.offload().sliced()
        || Path::new(model).join(loip_model::slice::MANIFEST).is_file()
}

/// Refuses a `--mem` too small for this process before anything is split or loaded.
pub fn check_budget(placement: &Placement) -> Result<()> {
    if let Placement::Offload(OffloadOptions { mem: Some(m), .. }) = placement {
        budget_split(*m, 1)?;
    }
    Ok(())
}

/// The source for `model` (a known name, a checkpoint path or a slice directory) under
/// `placement`, and what requests need of the model. Splitting into the slice cache, when
/// the placement needs slice files, tells `on_split`.
pub fn source(
    model: &str,
    placement: &Placement,
    on_split: OnSplit<'_>,
) -> Result<(Source, ModelInfo)> {
    let cluster = matches!(placement, Placement::Cluster(_));
    if needs_slices(model, placement) {
        check_budget(placement)?;
        let dir = slices::slices_for(model, on_split)?;
        // The slice directory carries the config and tokenizer; the checkpoint is not opened.
        let info = model::info(&dir.to_string_lossy())?;
        let src = if cluster {
            Source::Cluster(dir)
        } else {
            Source::Slices(dir)
        };
        return Ok((src, info));
    }
    let ckpt = model::open(model)?;
    // The whole checkpoint serves from memory: map its pages now, not one fault at a time in
    // the first request's forward pass.
    ckpt.populate();
    let info = ModelInfo {
        config: ckpt.config.clone(),
        tokenizer: model::tokenizer(&ckpt),
        chat: model::chat_template(&ckpt),
    };
    Ok((Source::Memory(ckpt), info))
}

/// An opened backend.
pub struct Opened {
    /// the backend
    pub backend: Backend,
    /// how the device's budget is spent (from slice files)
    pub memory: Option<MemoryReport>,
    /// how `--mem` was split between the process and the engine (from slice files)
    pub budget: Option<Budget>,
}

/// `--mem` is the whole process's budget, as the kernel counts it: the engine gets what this
/// process (its code, tokenizer, runtime, `parallel` requests' buffers and threads) leaves.
pub fn engine_share(total: u64, parallel: usize) -> Result<Budget> {
    loip_runtime::memory::return_freed_memory();
    let b = budget_split(total, parallel)?;
    loip_runtime::memory::set_budget(b);
    Ok(b)
}

/// `total` split between this process as it is now, with `parallel` requests in flight, and
/// an engine of at least 4 MiB.
pub fn budget_split(total: u64, parallel: usize) -> Result<Budget> {
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

/// Opens `src` on `placement` as a batched backend sized as `how` says.
pub fn open(src: Source, placement: &Placement, how: &Sizes<'_>) -> Result<Opened> {
    match src {
        Source::Memory(ckpt) => Ok(Opened {
            backend: Backend::local(ckpt, how.parallel)?,
            memory: None,
            budget: None,
        }),
        Source::Slices(dir) => {
            use loip_runtime::local::{LocalModel, LocalOptions};
            let offload = placement.offload();
            let budget = offload
                .mem
                .map(|m| engine_share(m, how.parallel))
                .transpose()?;
            let opts = LocalOptions {
                mem_budget: budget.map(|b| b.engine),
                rule: offload.rule,
                loader: offload.loader,
                overlap: offload.overlap,
                context: how.context,
                max_step_tokens: how.max_step_tokens,
            };
            let model = LocalModel::open_batched(&dir, &opts, how.parallel)?;
            let memory = model.device.memory();
            Ok(Opened {
                backend: Backend::sliced(model, how.parallel, how.max_step_tokens)?,
                memory: Some(memory),
                budget,
            })
        }
        Source::Cluster(dir) => {
            let Placement::Cluster(c) = placement else {
                anyhow::bail!("a cluster source needs a cluster placement");
            };
            let session = start_cluster(&dir, c, how)?;
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
                budget: None,
            })
        }
    }
}

/// What [`cluster_report`] returns: the breakdown, the plan's predicted ms/token, and the
/// JSON fields.
pub type ClusterReport = (Breakdown, f64, serde_json::Map<String, serde_json::Value>);

/// A cluster's plan and the pipeline's per-token breakdown since the last call, as `--json`
/// reports them.
pub fn cluster_report(backend: &Backend, with_plan: bool) -> Result<Option<ClusterReport>> {
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

/// This coordinator's static key pair, kept in its directory (`device_key`, made by the
/// first `loip pair` when `create`), made this process's: the workers paired with it pin
/// its public key, which is returned. `None` when there is none and `create` is false.
pub fn use_paired_identity(create: bool) -> Result<Option<[u8; 32]>> {
    use loip_runtime::net::identity::{store_key_path, Identity};
    let dir = loip_runtime::net::pairing::config_dir()?;
    if !create && !store_key_path(&dir).is_file() {
        return Ok(None);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (id, _) = Identity::load_or_create(&dir)?;
    let key = id.public();
    if !loip_runtime::coordinator::use_coordinator_identity(id)
        && loip_runtime::coordinator::coordinator_identity().public() != key
    {
        anyhow::bail!("this process already uses another coordinator key");
    }
    Ok(Some(key))
}
