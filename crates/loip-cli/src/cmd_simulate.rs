//! `loip simulate`: run the paper-scale experiments in the discrete-event simulator, or replay
//! one plan.
//!
//! - `loip simulate --experiment NAME --out DIR [--json]` runs `memory-constrained`,
//!   `end-to-end`, `dynamic-bandwidth`, `ablation`, `long-context`, `memory-sweep`,
//!   `context-sweep`, `reserve-sweep` or `all` (`--reserve 3GB`: that much more reserved on
//!   every device), writes
//!   `results.md`, `results.csv`, `speedups.csv`, `results.json` and the figures (SVG + PNG)
//!   into DIR, and prints the markdown tables (or, with `--json`, the JSON array: one record
//!   per experiment, setup, method, pattern and bandwidth).
//! - `loip simulate --plan plan.json --cluster cluster.toml` replays a plan written by
//!   `loip plan --out`, so the cost model's prediction and the simulation of the same plan
//!   can be compared.
//! - `loip simulate --from-local run.json` replays a `loip local --json` run (its plan, the
//!   profiles it measured, the same request; [`loip_sim::replay`]) and prints the threshold
//!   switches and ms/token of the runtime and of the simulator side by side.
//! - `loip simulate --plan plan.json --cluster cluster.toml --acceptance 0.7 [--speculate-k 4]
//!   [--trace requests.json]` also serves the plan's sequences (or the trace) without and
//!   with speculative decoding on the cost model's step times ([`loip_sim::speculate`]).

mod from_local;
mod speculate;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use loip_plan::{Plan, PlanError, PlanInvalid};
use loip_sim::experiments::{experiments, run_experiments, ExperimentConfig, EXPERIMENT_NAMES};
use loip_sim::experiments_long::LONG_EXPERIMENT_NAMES;
use loip_sim::{plot, report, Bandwidth, KvPolicy, SimConfig, SimReport};
use std::path::{Path, PathBuf};

/// Arguments of `loip simulate`.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// Experiment: memory-constrained, end-to-end, dynamic-bandwidth, ablation, long-context,
    /// memory-sweep, context-sweep, reserve-sweep, all (every one of these), or long-context-adapt (by name
    /// only: budgets at 0.80×/0.85× the weights and a 4096-token prompt, so thresholds are
    /// crossed and KV lending runs; compares loip, loip-no-kvtransfer, loip-recompute
    /// (eviction and recomputation only) and pp-offload).
    #[arg(
        long,
        conflicts_with_all = ["plan", "cluster", "from_local"],
        required_unless_present_any = ["plan", "from_local"]
    )]
    pub experiment: Option<String>,
    /// Replay a run of `loip local --json` (the JSON it printed, in this file) and compare
    /// its threshold switches and ms/token with the simulator's.
    #[arg(long, conflicts_with_all = ["plan", "cluster"])]
    pub from_local: Option<PathBuf>,
    /// With `--from-local`: the weights `COMPUTE,LOADS` the re-priced prediction applies
    /// the factors the run's first decode steps measured with (`factor^weight`; default
    /// `loip_plan::calibrate::REPRICE_WEIGHTS`), to price a kept run again.
    #[arg(long, requires = "from_local")]
    pub reprice_weights: Option<String>,
    /// Directory for tables (markdown, CSV, JSON) and figures (SVG, PNG).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the results as JSON on stdout instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Replay this plan (JSON from `loip plan --out`).
    #[arg(long, requires = "cluster")]
    pub plan: Option<PathBuf>,
    /// Cluster file the plan was made for (TOML; see examples/clusters/).
    #[arg(long, requires = "plan")]
    pub cluster: Option<PathBuf>,
    /// Prompt tokens per sequence (experiments: 512; replay: the plan's context minus the
    /// output).
    #[arg(long)]
    pub prompt_tokens: Option<u32>,
    /// Tokens decoded per sequence (experiments: 512; replay: 64).
    #[arg(long)]
    pub output_tokens: Option<u32>,
    /// Seed of the dynamic bandwidth traces.
    #[arg(long, default_value_t = 2024)]
    pub seed: u64,
    /// Link latency of the experiments (e.g. `2ms`).
    #[arg(long, default_value = "2ms")]
    pub latency: String,
    /// Replay: link bandwidth (e.g. `200mbit`, or `dynamic` for 50–250 Mbit/s); default the
    /// cluster file's.
    #[arg(long)]
    pub bandwidth: Option<String>,
    /// Replay: KV overflow handling: `auto` (adaptive with lending for LOIP plans, recompute
    /// otherwise), `adaptive`, `no-lending` or `recompute`.
    #[arg(long, default_value = "auto")]
    pub kv_policy: String,
    /// Experiments: memory reserved on every device of every setup besides the setup's own
    /// reservations (e.g. `3GB`): where each method goes OOM (see also `reserve-sweep`).
    #[arg(long)]
    pub reserve: Option<String>,
    /// Replay: also serve the plan's sequences (or --trace) on the runtime's step scheduler
    /// without and with speculative decoding, a draft accepted with this probability (0–1,
    /// given the drafts before it were), each step priced by the cost model for its rows;
    /// prints decode ms/token of both and the cost model's expectation S(k)/E(k, α).
    #[arg(long, requires = "plan")]
    pub acceptance: Option<f64>,
    /// Drafts per step with --acceptance (default: the cost model's best k, at most 8).
    #[arg(long, requires = "acceptance")]
    pub speculate_k: Option<u32>,
    /// With --acceptance: the requests to serve, a JSON array of objects
    /// `{"arrival": s, "prompt_len": n, "output_len": n, "k": n, "acceptance": a}` (`k` and
    /// `acceptance` optional: --speculate-k and --acceptance). Default: the plan's sequences,
    /// all at time 0, with --prompt-tokens and --output-tokens.
    #[arg(long, requires = "acceptance")]
    pub trace: Option<PathBuf>,
    /// Do not draw figures.
    #[arg(long)]
    pub no_plots: bool,
}

/// Runs `loip simulate`.
pub fn run(args: SimulateArgs) -> Result<()> {
    if let Some(path) = &args.from_local {
        return from_local::from_local(&args, path);
    }
    match (&args.experiment, &args.plan, &args.cluster) {
        (Some(name), None, None) => run_experiment(&args, name),
        (None, Some(plan), Some(cluster)) => replay(&args, plan, cluster),
        _ => bail!("give --experiment NAME, or --plan FILE with --cluster FILE"),
    }
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn run_experiment(args: &SimulateArgs, name: &str) -> Result<()> {
    let exps = experiments(name).with_context(|| {
        format!(
            "valid experiments: {}, {}",
            EXPERIMENT_NAMES.join(", "),
            LONG_EXPERIMENT_NAMES.join(", ")
        )
    })?;
    let defaults = ExperimentConfig::default();
    let cfg = ExperimentConfig {
        prompt_tokens: args.prompt_tokens.unwrap_or(defaults.prompt_tokens),
        output_tokens: args.output_tokens.unwrap_or(defaults.output_tokens),
        latency: loip_plan::parse_duration(&args.latency)
            .with_context(|| format!("--latency {}", args.latency))?,
        seed: args.seed,
        reserve: match &args.reserve {
            Some(r) => loip_plan::parse_bytes(r).with_context(|| format!("--reserve {r}"))?,
            None => 0,
        },
    };
    if cfg.output_tokens == 0 {
        bail!("--output-tokens must be at least 1");
    }
    let total: usize = exps.iter().map(|e| e.runs()).sum();
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{spinner} simulating [{bar:30}] {pos}/{len} runs, {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = std::time::Instant::now();
    let results = run_experiments(exps, &cfg, &|done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    let markdown = report::markdown(&results);
    let json = serde_json::to_string_pretty(&report::json_records(&results.records))?;
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        write(&dir.join("results.md"), &markdown)?;
        write(&dir.join("results.csv"), &report::csv(&results.records))?;
        write(
            &dir.join("speedups.csv"),
            &report::speedups_csv(&report::speedups(&results.records)),
        )?;
        write(&dir.join("results.json"), &json)?;
        if !args.no_plots {
            plot::write_plots(&results, dir)?;
        }
    }
    if args.json {
        println!("{json}");
    } else {
        print!("{markdown}");
    }
    eprintln!(
        "{} runs in {:.1} s{}",
        results.records.len(),
        elapsed.as_secs_f64(),
        args.out
            .as_ref()
            .map(|d| format!("; wrote {}", d.display()))
            .unwrap_or_default()
    );
    Ok(())
}

fn replay(args: &SimulateArgs, plan_path: &Path, cluster_path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(plan_path)
        .with_context(|| format!("reading plan {}", plan_path.display()))?;
    let plan =
        Plan::from_json(&text).with_context(|| format!("parsing plan {}", plan_path.display()))?;
    let cluster = loip::backend::read_cluster(cluster_path)?;
    let shape = loip_sim::shape(&plan.shape)?;
    match plan.validate(&shape, &cluster) {
        // Over budget is what the simulator reports as OOM; anything else is a broken plan.
        Ok(()) | Err(PlanError::Invalid(PlanInvalid::OverBudget { .. })) => {}
        Err(e) => return Err(e).context("the plan does not match the cluster"),
    }
    let b = plan.micro_batches.max(1);
    let output = args.output_tokens.unwrap_or(64).max(1);
    let prompt = args.prompt_tokens.unwrap_or_else(|| {
        (plan
            .context
            .div_ceil(b as u64)
            .saturating_sub(output as u64))
        .max(1) as u32
    });
    let bandwidth = match args.bandwidth.as_deref() {
        None => Bandwidth::Mbps(cluster.link.bandwidth * 8.0 / 1e6),
        Some("dynamic") => Bandwidth::PAPER_DYNAMIC,
        Some(s) => Bandwidth::Mbps(
            loip_plan::parse_bandwidth(s).with_context(|| format!("--bandwidth {s}"))? * 8.0 / 1e6,
        ),
    };
    let mut cfg = SimConfig::new(
        plan.pattern,
        b,
        bandwidth.trace(output, args.seed),
        cluster.link.latency,
    );
    cfg.prompt_tokens = prompt;
    cfg.output_tokens = output;
    cfg.record_memory = true;
    cfg.stop_when_oot = false;
    cfg.kv_policy = match args.kv_policy.as_str() {
        "auto" if plan.planner.starts_with("loip") => KvPolicy::Adaptive { lending: true },
        "auto" | "recompute" => KvPolicy::Recompute,
        "adaptive" => KvPolicy::Adaptive { lending: true },
        "no-lending" => KvPolicy::Adaptive { lending: false },
        other => bail!("--kv-policy {other}: must be auto, adaptive, no-lending or recompute"),
    };
    let report = loip_sim::simulate_pipeline(&plan, &shape, &cluster, &cfg)?;
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        write(
            &dir.join("replay.json"),
            &serde_json::to_string_pretty(&report)?,
        )?;
    }
    let speculation = match args.acceptance {
        Some(a) => Some(speculate::speculative(
            args, a, &plan, &shape, &cluster, prompt, output,
        )?),
        None => None,
    };
    if args.json {
        let out = serde_json::json!({
            "speculation": speculation,
            "plan": plan_path.display().to_string(),
            "planner": plan.planner,
            "shape": plan.shape,
            "pattern": plan.pattern.to_string(),
            "sequences": b,
            "prompt_tokens": prompt,
            "output_tokens": output,
            "predicted_ms_per_token": plan.predicted_ms_per_token,
            "report": report,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", replay_table(&plan, &report, prompt, output));
        if let Some(r) = &speculation {
            print!("{}", speculate::speculation_table(r));
        }
    }
    Ok(())
}

fn replay_table(plan: &Plan, r: &SimReport, prompt: u32, output: u32) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    let mut s = format!(
        "{} plan of {} ({} stage(s)/device, {}, {} sequence(s)), {} + {} tokens per sequence\n",
        plan.planner,
        plan.shape,
        plan.stages_per_device,
        plan.pattern,
        plan.micro_batches,
        prompt,
        output
    );
    s += &format!(
        "cost model   {:>10.1} ms/token (at {} tokens of context)\n",
        plan.predicted_ms_per_token, plan.context
    );
    if r.status == loip_sim::Status::Oom {
        s += &format!("simulated    OOM: {}\n", r.note.as_deref().unwrap_or(""));
        return s;
    }
    s += &format!(
        "simulated    {:>10.1} ms/token (second half {:.1}), status {}\n",
        r.ms_per_token, r.steady_ms_per_token, r.status
    );
    s += "device            compute s    load s    sent MB   peak GB  budget GB\n";
    for d in &r.devices {
        s += &format!(
            "{:<16} {:>9.2} {:>9.2} {:>10.1} {:>9.2} {:>10.2}\n",
            d.name,
            d.compute_s,
            d.load_s,
            d.bytes_sent / 1e6,
            gb(d.peak_memory),
            gb(d.budget)
        );
    }
    if !r.events.is_empty() {
        s += &format!("{} adaptation event(s):\n", r.events.len());
        for e in r.events.iter().take(20) {
            s += &format!("  {}\n", serde_json::to_string(e).unwrap_or_default());
        }
    }
    s
}
