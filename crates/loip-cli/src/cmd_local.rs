//! `loip local`: the whole system on this machine. Starts N `loip worker` processes on
//! loopback with the given memory budgets (by default budgets that force offloading), the
//! coordinator, and one generation; prints the plan, the output, ms/token and its breakdown
//! (compute, network, load stall). `--bandwidth` emulates a link limit in the transport.
//!
//! `--bench FILE` instead runs the end-to-end benchmark matrix (patterns × link limits ×
//! planners) on the same devices, prints a table of measured vs predicted ms/token and
//! writes the rows as JSON. Its default budgets hold 60% of the model together, split 2:1:2
//! ([`bench_budgets`]); the worker stores it keeps (several GB for llama-1b) are reported
//! with their size at the end.
//!
//! `--concurrent N --micro-batch-seqs 0,3` instead compares, in one session, the N bursty
//! sequences as today (`0`: one sequence a step, N steps in flight) with micro-batches of
//! `q` sequences a step (`N/q` micro-batches in flight, each driven by the engine's
//! `Serving` over the pipeline), and prints aggregate tokens/s side by side.
//!
//! Ctrl-C (SIGINT) or SIGTERM kills the worker children and removes the temp stores
//! (`/tmp/loip-local-PID`) before exiting with status 130.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use loip_engine::generate::Flow;
use loip_model::slice::Manifest;
use loip_plan::{DeviceProfile, Pattern};
use loip_runtime::cluster_run::{Breakdown, Session, SessionOptions};
use loip_runtime::local_cluster::{
    bench_budgets, default_budgets, install_interrupt_cleanup, keep_scratch, scratch_size,
    CgroupReport, LocalWorkerOptions, LocalWorkers,
};
use loip_runtime::LoaderKind;
use serde::Serialize;

use crate::backend::{print_breakdown, print_setup};
use crate::model_load;
use crate::request::{prepare, report, Printer, PromptArgs};

/// Arguments of `loip local`.
#[derive(Args, Debug)]
pub struct LocalArgs {
    /// Model: a known name (`smollm2`, `gemma3-270m`), an HF directory, a GGUF file or a slice directory.
    #[arg(long, short = 'm', default_value = "smollm2")]
    pub model: String,
    /// Number of worker processes (devices).
    #[arg(long, default_value_t = 3)]
    pub devices: usize,
    /// Memory budget per device, e.g. `300MiB,200MiB,150MiB` (one value: all devices).
    /// Default: budgets that hold only about 60% of the layers, so offloading is used; with
    /// `--bench`, budgets that together hold 60% of the model, split 2:1:2.
    #[arg(long, value_delimiter = ',')]
    pub mem: Option<Vec<String>>,
    /// Emulated link limit between the coordinator and each device, e.g. `100mbit`.
    #[arg(long)]
    pub bandwidth: Option<String>,
    /// Planner: loip, loip-paper, loip-uniform, pp, pp-offload, edgeshard, …
    #[arg(long, default_value = "loip")]
    pub planner: String,
    /// Loading path on the workers: direct or conventional.
    #[arg(long, default_value = "direct")]
    pub loader: LoaderKind,
    /// Sequences generated at once (bursty traffic) from the same prompt.
    #[arg(long, default_value_t = 1)]
    pub concurrent: usize,
    /// Run each worker in a fresh memory cgroup whose limit is exactly its `--mem` (v2 or v1;
    /// needs root or a delegated cgroup): the kernel itself holds every worker to its budget,
    /// and the run ends with each worker's peak charge (`memory.peak`) and OOM kills.
    #[arg(long)]
    pub cgroup: bool,
    /// Keep the workers' slice stores here (reused by later runs) instead of a temp dir.
    #[arg(long)]
    pub store_root: Option<PathBuf>,
    /// Print one JSON object (as `loip generate --json`, plus "plan", "breakdown" and the
    /// bytes each link carried, "links").
    #[arg(long)]
    pub json: bool,
    /// Relay every hop through the coordinator instead of handing the rows from worker to
    /// worker (for comparison, and for networks where workers cannot reach each other).
    #[arg(long)]
    pub relay: bool,
    /// Online adaptation may lend KV: a device about to cross a memory threshold sends the
    /// oldest rows of each stage's KV to the peer with the most spare memory after the stage
    /// runs, and fetches them back before it runs again, sized to the link's measured rate
    /// (off by default; output is identical either way).
    #[arg(long)]
    pub lend: bool,
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Speculative decoding of the one sequence (`--concurrent 1`) through the pipeline.
    #[command(flatten)]
    pub spec: crate::speculate::SpecArgs,
    /// Measure the devices' loaders all at the same time (they share this machine's disk)
    /// instead of one after another.
    #[arg(long)]
    pub probe_loads_together: bool,
    /// Price the devices' loads as sharing one disk (cluster-file `disk`): in a round their
    /// loads share the rate each measured alone. For a disk that reads no faster for several
    /// readers than for one (an SD card, a USB disk); off by default.
    #[arg(long)]
    pub shared_disk: bool,
    /// With `--concurrent N`: compare micro-batch sizes side by side (`0`: one sequence a
    /// step as without this flag; `q`: micro-batches of `q` sequences, `N/q` in flight).
    #[arg(long, value_delimiter = ',')]
    pub micro_batch_seqs: Vec<usize>,
    /// A device profile (JSON, as `loip profile --out` writes it, or a device's `profile` in a
    /// `--json` run's `cluster`) for every worker instead of measuring them: the plan no
    /// longer depends on how busy this machine is while it measures (reproducible runs and
    /// tests). Each device keeps its own `--mem` budget.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Draw memory per device over the run into this file (PNG, or SVG when it ends in
    /// `.svg`): KV + weights/slot/buffers against the budget, one sample per step, with the
    /// threshold crossings (plan switches) and KV lending marked.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Plan for the whole context (prompt + --max-tokens) up front instead of for the
    /// prompt's KV with online adaptation (for comparison).
    #[arg(long)]
    pub whole_context: bool,
    /// Online adaptation without plan switches or lending: a device near its budget only
    /// evicts other sequences and recomputes them later (the last resort alone, for
    /// comparison; output is identical).
    #[arg(long, conflicts_with = "whole_context")]
    pub evict_only: bool,
    /// Let online adaptation evict (and later recompute) other sequences instead of switching
    /// a device's layout where the cost model prices eviction lower. Off by default: eviction
    /// is the last resort, since the price leaves out the evicted sequences' wait.
    #[arg(long, conflicts_with_all = ["whole_context", "evict_only"])]
    pub evict_when_cheaper: bool,
    /// Run the benchmark matrix instead and write its rows to this JSON file.
    #[arg(long)]
    pub bench: Option<PathBuf>,
    /// Benchmark link limits (`unlimited` or a bandwidth).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "unlimited,200mbit,100mbit"
    )]
    pub bench_bandwidths: Vec<String>,
    /// Benchmark planners.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "loip,pp-offload,pp,edgeshard"
    )]
    pub bench_planners: Vec<String>,
    /// Benchmark patterns.
    #[arg(long, value_delimiter = ',', default_value = "sporadic,bursty")]
    pub bench_patterns: Vec<String>,
}

fn budgets(a: &LocalArgs, m: &Manifest, context: u64) -> Result<Vec<u64>> {
    match &a.mem {
        None => Ok(default_budgets(m, a.devices, context)),
        Some(v) if v.len() == 1 || v.len() == a.devices => {
            let parsed = v
                .iter()
                .map(|s| loip_plan::parse_bytes(s).with_context(|| format!("--mem {s}")))
                .collect::<Result<Vec<_>>>()?;
            Ok((0..a.devices)
                .map(|i| parsed[i.min(parsed.len() - 1)])
                .collect())
        }
        Some(v) => bail!("--mem has {} values for {} devices", v.len(), a.devices),
    }
}

fn parse_bw(s: &str) -> Result<Option<f64>> {
    if s == "unlimited" || s == "none" {
        return Ok(None);
    }
    Ok(Some(
        loip_plan::parse_bandwidth(s).with_context(|| format!("bandwidth {s}"))?,
    ))
}

fn session_options(
    a: &LocalArgs,
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
        micro_batches: (pattern == Pattern::Bursty).then_some(a.concurrent.max(1) as u32),
        context,
        max_step_tokens: max_step,
        loader: a.loader,
        shape_name: a.model.clone(),
        // The emulated devices share this machine's one disk. Probing their loaders all at
        // once (each device's direct and conventional loader against the others') measured
        // 0.43 GB/s per device on llama-1b where the run then moved 1.0 GB/s per device:
        // in the pipeline the devices' loads are staggered by their stages, and only the
        // planned devices load. One at a time is what the run sees (0.9–1.0 GB/s).
        probe_loads_together: a.probe_loads_together,
        // ... and with --shared-disk the cost model shares its rate among their loads of a
        // round (off by default: this VM's disk serves concurrent readers at ~1.6 GB/s in
        // all against ~0.9 for one, so fair sharing of one reader's rate is too pessimistic).
        shared_disk: a.shared_disk,
        greedy: a.prompt.greedy(),
        relay: a.relay,
        lending: a.lend,
        evict_only: a.evict_only,
        adapt: loip_plan::adapt::AdaptConfig {
            evict_over_switch: a.evict_when_cheaper,
            ..Default::default()
        },
        ..Default::default()
    };
    o.connect.token = Some(token.to_string());
    o.connect.bandwidth = bandwidth;
    let q = a.micro_batch_seqs.iter().copied().max().unwrap_or(1).max(1);
    o.max_step_seqs = q;
    o.max_step_tokens = max_step * q;
    o
}

/// Generates `prompts` in micro-batches of `q` sequences: one thread per micro-batch, each
/// running the engine's `Serving` over the pipeline (so the micro-batches are in flight
/// together). Returns (new tokens, wall seconds).
fn serve_batched(
    s: &Session,
    prompts: &[Vec<u32>],
    opts: &loip_engine::GenerateOptions,
    q: usize,
) -> Result<(usize, f64)> {
    let t = Instant::now();
    let counts: Vec<Result<usize>> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .chunks(q.max(1))
            .map(|group| {
                let backend = s.pipeline().backend();
                sc.spawn(move || -> Result<usize> {
                    let longest = group.iter().map(Vec::len).max().unwrap_or(1);
                    let mut limits = loip_plan::sched::Limits::one_device(u64::MAX, 1);
                    limits.max_step_seqs = group.len();
                    limits.max_seqs = group.len();
                    limits.prefill_chunk = longest;
                    limits.max_batch_tokens = longest * group.len();
                    let mut serving = loip_engine::Serving::new(limits, backend)?;
                    let t0 = Instant::now();
                    let mut clock = || t0.elapsed().as_secs_f64();
                    for p in group {
                        let seq = loip_runtime::coordinator::next_seq_id();
                        serving.submit(clock(), seq, p, opts)?;
                    }
                    let mut tokens = 0;
                    // bounded: every round advances each running sequence by a token
                    for _ in 0..(opts.max_tokens + 2) * group.len() + 16 {
                        for e in serving.step(&mut clock)? {
                            match e {
                                loip_engine::SeqEvent::Token { .. } => tokens += 1,
                                loip_engine::SeqEvent::Failed { error, .. } => bail!(error),
                                _ => {}
                            }
                        }
                        if serving.is_idle() {
                            return Ok(tokens);
                        }
                    }
                    bail!("the micro-batch did not finish")
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a micro-batch thread panicked")))
            })
            .collect()
    });
    let tokens = counts.into_iter().sum::<Result<usize>>()?;
    Ok((tokens, t.elapsed().as_secs_f64()))
}

/// `--micro-batch-seqs`: each size on the same session, side by side.
fn compare_micro_batches(
    s: &Session,
    prompt: &[u32],
    opts: &loip_engine::GenerateOptions,
    n: usize,
    sizes: &[usize],
) -> Result<()> {
    let prompts = vec![prompt.to_vec(); n];
    // The cost model's price of this session's layout run as micro-batches of q.
    let predict = |q: usize| {
        loip_plan::planners::batching::price_layout(
            &s.plan, &s.shape, &s.cluster, n as u32, q as u32,
        )
        .map_or(f64::NAN, |(ms, _)| ms)
    };
    let best = loip_plan::planners::batching::candidates(n as u32)
        .into_iter()
        .map(|(_, q)| (q, predict(q as usize)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((q, ms)) = best {
        println!(
            "cost model's choice: {q} sequences per micro-batch, {} in flight ({ms:.1} ms/token)",
            n.div_ceil(q as usize)
        );
    }
    // Offloaded bytes of every stage of the plan: what one round reads when each stage's
    // blocks are read once for all the micro-batches in flight.  // bytes
    let per_round: u64 = s
        .plan
        .devices
        .iter()
        .flat_map(|d| &d.stages)
        .map(|st| st.offloaded_bytes(&s.shape))
        .sum();
    println!("| sequences | sequences per step | steps in flight | tokens | wall s | tokens/s | ms/token | predicted ms/token | stage loads per round |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for &q in sizes {
        let _ = s.take_totals();
        let (tokens, wall) = if q == 0 {
            let t = Instant::now();
            let outs = s.generate_many(&prompts, opts);
            let outs = outs.into_iter().collect::<Result<Vec<_>, _>>()?;
            let tokens = outs.iter().map(|o| o.new_ids.len()).sum();
            (tokens, t.elapsed().as_secs_f64())
        } else {
            serve_batched(s, &prompts, opts, q)?
        };
        let per = q.max(1);
        // loads per stage and round: decode bytes read over (rounds × one read of each stage)
        let t = s.take_totals();
        let rounds = t.decode_steps as f64 / n.div_ceil(per) as f64;
        let loads = t.decode.loaded_bytes as f64 / (rounds * per_round as f64).max(1.0);
        println!(
            "| {n} | {per} | {} | {tokens} | {wall:.2} | {:.1} | {:.1} | {:.1} | {loads:.2} |",
            n.div_ceil(per),
            tokens as f64 / wall.max(1e-9),
            wall * 1e3 / tokens.max(1) as f64,
            predict(per)
        );
    }
    Ok(())
}

/// `--profile`: the file's profile for each of `n` devices (`None`: measure them).
fn fixed_profiles(a: &LocalArgs, n: usize) -> Result<Option<Vec<DeviceProfile>>> {
    let Some(path) = &a.profile else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--profile {}: cannot read it", path.display()))?;
    let p = DeviceProfile::from_json(&text)
        .with_context(|| format!("--profile {}: not a device profile", path.display()))?;
    Ok(Some(vec![p; n]))
}

/// `loip local`.
pub fn run(a: LocalArgs) -> Result<()> {
    if a.devices == 0 {
        bail!("--devices must be at least 1");
    }
    let dir = crate::cmd_split::slices_for(&a.model)?;
    let manifest = Manifest::load(&dir)?;
    let prep = prepare(model_load::info(&dir.to_string_lossy())?, &a.prompt)?;
    let n = a.concurrent.max(1);
    // a verify step holds its k rejected positions until the next step drops them
    let slack = if a.spec.on() { a.spec.speculate_k } else { 0 };
    let context = ((prep.prompt_ids.len() + prep.opts.max_tokens) * n + slack) as u64;
    install_interrupt_cleanup();
    if a.bench.is_some() {
        let budgets = match &a.mem {
            None => bench_budgets(&manifest, a.devices),
            Some(_) => budgets(&a, &manifest, context)?,
        };
        return bench(&a, &dir, &budgets, &prep.prompt_ids, &prep.opts);
    }
    let budgets = budgets(&a, &manifest, context)?;
    let bandwidth = a.bandwidth.as_deref().map(parse_bw).transpose()?.flatten();
    let token = crate::cmd_local::random_token();
    let workers = LocalWorkers::spawn(&LocalWorkerOptions {
        exe: std::env::current_exe().context("locating the loip binary")?,
        budgets: budgets.clone(),
        bandwidth,
        token: token.clone(),
        store_root: a.store_root.clone(),
        cgroup: a.cgroup,
    })?;
    if !a.json {
        let b: Vec<String> = budgets
            .iter()
            .map(|&b| loip_plan::units::format_bytes(b))
            .collect();
        eprintln!(
            "{} workers on loopback, budgets {}",
            a.devices,
            b.join(", ")
        );
    }
    let pattern = if n > 1 {
        Pattern::Bursty
    } else {
        Pattern::Sporadic
    };
    if a.spec.on() && n > 1 {
        bail!("--speculate runs one sequence (--concurrent 1)");
    }
    // a verify step carries k + 1 positions
    let max_step = prep.prompt_ids.len().max(a.spec.speculate_k + 1);
    let mut opts = session_options(
        &a, &a.planner, pattern, bandwidth, context, max_step, &token,
    );
    // Plan for the prompts' KV and adapt online as it grows (design §6).
    if !a.whole_context {
        opts.admitted = Some((prep.prompt_ids.len() * n) as u64);
    }
    opts.on_ship = crate::backend::ship_bars(a.json);
    let fixed = fixed_profiles(&a, workers.procs.len())?;
    let s = Session::start(&dir, workers.specs(fixed.as_deref()), opts)?;
    if !a.json {
        print_setup(&s);
    }
    if !a.micro_batch_seqs.is_empty() {
        compare_micro_batches(&s, &prep.prompt_ids, &prep.opts, n, &a.micro_batch_seqs)?;
        s.shutdown();
        drop(workers);
        return Ok(());
    }
    let mut extra = serde_json::Map::new();
    extra.insert("plan".into(), serde_json::to_value(&s.plan)?);
    extra.insert("devices".into(), serde_json::to_value(&s.reports)?);
    let (out, text, measured) = if n == 1 {
        let mut printer = Printer::new(prep.tokenizer.as_ref(), a.prompt.stop.clone(), a.json);
        let mut on_token = |id| printer.on_token(id);
        let out = if a.spec.on() {
            let target = (&manifest.config, prep.tokenizer.as_ref());
            let (ids, opts) = (&prep.prompt_ids, &prep.opts);
            let run = crate::speculate::on_pipeline(
                s.pipeline(),
                target,
                ids,
                opts,
                &a.spec,
                &mut on_token,
            )?;
            let st = run.stats;
            if !a.json {
                eprintln!(
                    "speculation: {} steps, {} of {} drafts kept",
                    st.steps, st.accepted, st.drafted
                );
            }
            extra.insert("speculation".into(), serde_json::to_value(st)?);
            run.out
        } else {
            s.generate(&prep.prompt_ids, &prep.opts, &mut on_token)?
        };
        let ms = out.decode_ms_per_token;
        (out, printer.finish(), ms)
    } else {
        let prompts = vec![prep.prompt_ids.clone(); n];
        let t = Instant::now();
        let outs = s.generate_many(&prompts, &prep.opts);
        let wall = t.elapsed().as_secs_f64();
        let outs = outs.into_iter().collect::<Result<Vec<_>, _>>()?;
        let tokens: usize = outs.iter().map(|o| o.new_ids.len()).sum();
        let ms = outs.iter().map(|o| o.decode_ms_per_token).sum::<f64>() / (n * n) as f64;
        extra.insert(
            "sequences".into(),
            outs.iter()
                .map(|o| o.new_ids.clone())
                .collect::<Vec<_>>()
                .into(),
        );
        extra.insert(
            "bursty_wall_ms_per_token".into(),
            (wall * 1e3 / tokens.max(1) as f64).into(),
        );
        let out = outs.into_iter().next().context("no sequence")?;
        let mut printer = Printer::new(prep.tokenizer.as_ref(), vec![], a.json);
        for &id in &out.new_ids {
            if printer.on_token(id) == Flow::Stop {
                break;
            }
        }
        (out, printer.finish(), ms)
    };
    let b = Breakdown::of(&s.take_totals());
    extra.insert("breakdown".into(), serde_json::to_value(b)?);
    extra.insert("links".into(), serde_json::to_value(s.link_bytes())?);
    let adaptation = s.adaptation();
    if let Some(ad) = &adaptation {
        extra.insert("adaptation".into(), serde_json::to_value(ad)?);
    }
    // What the simulator needs to replay the run (`loip simulate --from-local`).
    extra.insert("shape".into(), serde_json::to_value(&s.shape)?);
    extra.insert("cluster".into(), serde_json::to_value(&s.cluster)?);
    if let Some(path) = &a.plot {
        let Some(ad) = &adaptation else {
            bail!("--plot: this run has no adaptation report");
        };
        let title = format!("loip local {} ({} new tokens)", a.model, out.new_ids.len());
        crate::cmd_local_plot::write(path, ad, &title)?;
    }
    extra.insert("ms_per_token".into(), measured.into());
    extra.insert(
        "predicted_ms_per_token".into(),
        s.plan.predicted_ms_per_token.into(),
    );
    let charged = workers.cgroup_reports();
    if a.cgroup {
        extra.insert("cgroups".into(), serde_json::to_value(&charged)?);
    }
    report(&prep.prompt_ids, &out, text, a.json, Some(extra))?;
    if !a.json {
        print_breakdown(&b, measured, s.plan.predicted_ms_per_token);
        print_cgroups(&charged);
    }
    s.shutdown();
    drop(workers);
    let killed: u64 = charged.iter().map(|c| c.oom_kills).sum();
    if killed > 0 {
        bail!("the kernel killed {killed} worker(s) for going over their memory cgroup's limit");
    }
    Ok(())
}

fn print_cgroups(c: &[CgroupReport]) {
    for r in c {
        eprintln!("{r}");
    }
}

/// A random shared secret for the local workers (given to them in `LOIP_TOKEN`, never on a
/// command line).
pub fn random_token() -> String {
    loip_runtime::net::token::generate()
}

/// One row of the benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// sporadic or bursty
    pub pattern: String,
    /// link limit (`unlimited` or bytes/s)
    pub bandwidth: String,
    /// planner
    pub planner: String,
    /// measured decode time per generated token  // milliseconds
    pub measured_ms: Option<f64>,
    /// the cost model's prediction for the plan  // milliseconds
    pub predicted_ms: Option<f64>,
    /// per decode step, from the pipeline
    pub breakdown: Option<Breakdown>,
    /// the last device's full logits (vocab × 4 bytes) crossing its link to the coordinator
    /// once per generated token, at the measured link: part of the measured network time,
    /// not of the cost model's `predicted_ms`  // milliseconds
    pub logits_ms: Option<f64>,
    /// the cost model's breakdown of `predicted_ms`
    pub predicted_breakdown: Option<loip_plan::CostBreakdown>,
    /// devices of the plan (the planner may leave some out)
    pub plan_devices: Option<Vec<String>>,
    /// stages per device of the plan
    pub stages_per_device: Option<u32>,
    /// planner or runtime error (OOM for planners that cannot place the model)
    pub error: Option<String>,
}

fn bench(
    a: &LocalArgs,
    dir: &Path,
    budgets: &[u64],
    prompt: &[u32],
    gen: &loip_engine::GenerateOptions,
) -> Result<()> {
    let out = a.bench.clone().context("--bench")?;
    let n = a.concurrent.max(3);
    let token = random_token();
    let mut rows = Vec::new();
    let mut profiles: Option<Vec<DeviceProfile>> = fixed_profiles(a, budgets.len())?;
    let store_root = a
        .store_root
        .clone()
        .unwrap_or_else(|| loip_model::fetch::cache_dir().join("bench-stores"));
    keep_scratch(&store_root);
    let total: u64 = budgets.iter().sum();
    let model: u64 = Manifest::load(dir)?.slices.iter().map(|s| s.size).sum();
    eprintln!(
        "budgets: {} (together {}, {:.0}% of the model's {})",
        budgets
            .iter()
            .map(|&b| loip_plan::units::format_bytes(b))
            .collect::<Vec<_>>()
            .join(", "),
        loip_plan::units::format_bytes(total),
        100.0 * total as f64 / model.max(1) as f64,
        loip_plan::units::format_bytes(model)
    );
    for bw_s in &a.bench_bandwidths {
        let bw = parse_bw(bw_s)?;
        let workers = LocalWorkers::spawn(&LocalWorkerOptions {
            exe: std::env::current_exe().context("locating the loip binary")?,
            budgets: budgets.to_vec(),
            bandwidth: bw,
            token: token.clone(),
            store_root: Some(store_root.clone()),
            cgroup: a.cgroup,
        })?;
        for pat_s in &a.bench_patterns {
            let pattern: Pattern = pat_s.parse().map_err(anyhow::Error::msg)?;
            let seqs = if pattern == Pattern::Bursty { n } else { 1 };
            let context = ((prompt.len() + gen.max_tokens) * seqs) as u64;
            for planner in &a.bench_planners {
                let mut row = BenchRow {
                    pattern: pat_s.clone(),
                    bandwidth: bw_s.clone(),
                    planner: planner.clone(),
                    measured_ms: None,
                    predicted_ms: None,
                    breakdown: None,
                    predicted_breakdown: None,
                    logits_ms: None,
                    plan_devices: None,
                    stages_per_device: None,
                    error: None,
                };
                let mut la = LocalArgs {
                    concurrent: seqs,
                    ..clone_args(a)
                };
                la.model = a.model.clone();
                let opts =
                    session_options(&la, planner, pattern, bw, context, prompt.len(), &token);
                match Session::start(dir, workers.specs(profiles.as_deref()), opts) {
                    Err(e) => row.error = Some(e.to_string()),
                    Ok(s) => {
                        if profiles.is_none() {
                            profiles = Some(
                                s.cluster
                                    .devices
                                    .iter()
                                    .map(|d| d.profile.clone())
                                    .collect(),
                            );
                        }
                        row.predicted_ms = Some(s.plan.predicted_ms_per_token);
                        row.stages_per_device = Some(s.plan.stages_per_device);
                        row.predicted_breakdown = Some(s.plan.breakdown);
                        row.logits_ms = logits_ms(&s);
                        row.plan_devices =
                            Some(s.plan.devices.iter().map(|d| d.name.clone()).collect());
                        let prompts = vec![prompt.to_vec(); seqs];
                        let outs = if seqs == 1 {
                            vec![s.generate(prompt, gen, &mut |_| Flow::Continue)]
                        } else {
                            s.generate_many(&prompts, gen)
                        };
                        match outs.into_iter().collect::<Result<Vec<_>, _>>() {
                            Ok(o) => {
                                let ms = o.iter().map(|o| o.decode_ms_per_token).sum::<f64>()
                                    / (seqs * seqs) as f64;
                                row.measured_ms = Some(ms);
                                row.breakdown = Some(Breakdown::of(&s.take_totals()));
                            }
                            Err(e) => row.error = Some(e.to_string()),
                        }
                        s.shutdown();
                    }
                }
                eprintln!(
                    "{:>9} {:>10} {:>11}: measured {:>9} predicted {:>9} {}",
                    row.pattern,
                    row.bandwidth,
                    row.planner,
                    row.measured_ms.map_or("-".into(), |v| format!("{v:.1} ms")),
                    row.predicted_ms
                        .map_or("-".into(), |v| format!("{v:.1} ms")),
                    row.error
                        .as_deref()
                        .map(|e| format!("({e})"))
                        .unwrap_or_default()
                );
                rows.push(row);
            }
        }
    }
    std::fs::write(&out, serde_json::to_string_pretty(&rows)?)
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "worker stores kept for later runs in {} ({}); remove it with `rm -rf {}`",
        store_root.display(),
        scratch_size(&store_root),
        store_root.display()
    );
    println!("| pattern | link | planner | devices×stages | measured ms/token | predicted ms/token | measured/predicted | network ms (logits) | load stall ms (pred.) | error |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    for r in &rows {
        let ratio = match (r.measured_ms, r.predicted_ms) {
            (Some(m), Some(p)) if p > 0.0 => format!("{:.2}", m / p),
            _ => "-".into(),
        };
        let devs = match (&r.plan_devices, r.stages_per_device) {
            (Some(d), Some(s)) => format!("{}×{s}", d.len()),
            _ => "-".into(),
        };
        println!(
            "| {} | {} | {} | {devs} | {} | {} | {ratio} | {} ({}) | {} ({}) | {} |",
            r.pattern,
            r.bandwidth,
            r.planner,
            f(r.measured_ms),
            f(r.predicted_ms),
            f(r.breakdown.map(|b| b.network_ms)),
            f(r.logits_ms),
            f(r.breakdown.map(|b| b.load_stall_ms)),
            f(r.predicted_breakdown.map(|b| b.uncovered_load_ms)),
            r.error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

/// Time of the last plan device's logits (vocab × f32) on its measured link.  // milliseconds
fn logits_ms(s: &Session) -> Option<f64> {
    let last = s.plan.devices.last()?;
    let link = s
        .reports
        .iter()
        .find(|r| r.endpoint.name == last.name)?
        .link?;
    let bw = link.up_bps.min(link.down_bps);
    (bw > 0.0).then(|| (s.manifest.config.vocab_size as f64 * 4.0 / bw + link.latency_s) * 1e3)
}

fn clone_args(a: &LocalArgs) -> LocalArgs {
    LocalArgs {
        model: a.model.clone(),
        devices: a.devices,
        mem: a.mem.clone(),
        bandwidth: a.bandwidth.clone(),
        planner: a.planner.clone(),
        loader: a.loader,
        concurrent: a.concurrent,
        cgroup: a.cgroup,
        store_root: a.store_root.clone(),
        json: a.json,
        relay: a.relay,
        lend: a.lend,
        prompt: a.prompt.clone(),
        spec: a.spec.clone(),
        probe_loads_together: a.probe_loads_together,
        shared_disk: a.shared_disk,
        micro_batch_seqs: a.micro_batch_seqs.clone(),
        plot: None,
        profile: a.profile.clone(),
        whole_context: a.whole_context,
        evict_only: a.evict_only,
        evict_when_cheaper: a.evict_when_cheaper,
        bench: None,
        bench_bandwidths: vec![],
        bench_planners: vec![],
        bench_patterns: vec![],
    }
}
