//! `loip local`: the whole system on this machine. Starts N `loip worker` processes on
//! loopback with the given memory budgets (by default budgets in which no worker can keep its
//! even share of the layers resident, so the plan streams blocks), the coordinator, and one
//! generation; prints the plan, the output, ms/token and its breakdown (compute, network,
//! load stall). `--bandwidth` emulates a link limit in the transport.
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
//! (`/tmp/loip-local-PID`) before exiting with status 130; those of a run killed outright
//! (SIGKILL) are removed by the next `loip local`.

mod bench;
mod plot;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use loip::local::{BenchMatrix, Event, Generated, Job, LocalOptions, Outcome};
use loip_model::slice::Slices;
use loip_plan::units::format_bytes;
use loip_plan::DeviceProfile;
use loip_runtime::local_cluster::install_interrupt_cleanup;
use loip_runtime::LoaderKind;

use crate::backend::{print_breakdown, print_plan, print_setup};
use crate::request::{report, PromptArgs};

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
    /// Default: the process, the working buffers the planner counts, the KV cache, the
    /// embedding / head, one streaming slot and 60% of an even share of the layers, so no
    /// device keeps its share resident and the plan streams blocks; with `--bench`, budgets
    /// that together hold 60% of the model, split 2:1:2.
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
    /// Price the devices' loads as sharing one disk (cluster-file `disk`): the loaders are
    /// also probed all at once, and loads running at the same time share the disk's rate for
    /// several readers measured so (fairly, each its own rate over `n`, when not measured).
    /// The local workers do share this machine's disk (docs/simulator.md); off by default.
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
    /// Measure the workers and plan as a run would, print the plan (per device: stages,
    /// resident and offloaded blocks, memory against budget, predicted ms/token and its
    /// breakdown) and stop: nothing is shipped (but a profiled device's layer 0) or loaded.
    #[arg(long, conflicts_with_all = ["bench", "micro_batch_seqs"])]
    pub preview: bool,
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

impl LocalArgs {
    /// The library's options for these flags (`--mem`, `--bandwidth`, `--profile` parsed).
    fn options(&self) -> Result<LocalOptions> {
        let mem = self
            .mem
            .as_ref()
            .map(|v| {
                v.iter()
                    .map(|s| loip_plan::parse_bytes(s).with_context(|| format!("--mem {s}")))
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
        let bandwidth = self
            .bandwidth
            .as_deref()
            .map(loip::local::parse_bandwidth)
            .transpose()?
            .flatten();
        Ok(LocalOptions {
            model: self.model.clone(),
            devices: self.devices,
            mem,
            bandwidth,
            planner: self.planner.clone(),
            loader: self.loader,
            concurrent: self.concurrent,
            cgroup: self.cgroup,
            store_root: self.store_root.clone(),
            relay: self.relay,
            lend: self.lend,
            probe_loads_together: self.probe_loads_together,
            shared_disk: self.shared_disk,
            micro_batch_seqs: self.micro_batch_seqs.clone(),
            profile: fixed_profile(self.profile.as_deref())?,
            whole_context: self.whole_context,
            evict_only: self.evict_only,
            evict_when_cheaper: self.evict_when_cheaper,
            greedy: self.prompt.greedy(),
            // a verify step carries k + 1 positions and holds its k rejected ones until the
            // next step drops them
            step_slack: if self.spec.on() {
                self.spec.speculate_k
            } else {
                0
            },
            on_ship: None,
        })
    }
}

/// `--profile`: the device profile in the file.
fn fixed_profile(path: Option<&Path>) -> Result<Option<DeviceProfile>> {
    let Some(path) = path else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--profile {}: cannot read it", path.display()))?;
    let p = DeviceProfile::from_json(&text)
        .with_context(|| format!("--profile {}: not a device profile", path.display()))?;
    Ok(Some(p))
}

/// `loip local`.
pub fn run(a: LocalArgs) -> Result<()> {
    if a.devices == 0 {
        bail!("--devices must be at least 1");
    }
    if a.spec.on() && a.concurrent > 1 {
        bail!("--speculate runs one sequence (--concurrent 1)");
    }
    let job = a.job();
    let json = a.json;
    let on_event = &mut |e: Event<'_>| show(&e, json);
    let mut o = a.options()?;
    let req = a.prompt.request();
    o.on_ship = crate::progress::ship_bars(json);
    // split in a child process (see `progress::slices_for`)
    let dir = crate::progress::slices_for(&a.model)?;
    let slices = Slices::open(&dir)?;
    install_interrupt_cleanup();
    let outcome = loip::local::run(slices, &o, &req, job, on_event)?;
    match outcome {
        Outcome::Generated(g) => report_generation(&a, *g),
        Outcome::MicroBatches(_) => Ok(()),
        Outcome::Preview(p) => {
            print_plan(&p.reports, &p.plan);
            eprintln!("preview only: nothing loaded (drop --preview to run this plan)");
            Ok(())
        }
        Outcome::Bench { rows, store_root } => bench::finish(&a, &rows, &store_root),
    }
}

impl LocalArgs {
    /// What the flags ask to run.
    fn job(&self) -> Job {
        if let Some(_out) = &self.bench {
            Job::Bench(BenchMatrix {
                bandwidths: self.bench_bandwidths.clone(),
                patterns: self.bench_patterns.clone(),
                planners: self.bench_planners.clone(),
            })
        } else if self.preview {
            Job::Preview
        } else if !self.micro_batch_seqs.is_empty() {
            Job::MicroBatches(self.micro_batch_seqs.clone())
        } else {
            Job::Generate {
                quiet: self.json,
                speculate: self.spec.on().then(|| self.spec.spec()),
            }
        }
    }
}

/// Shows what happens while the run runs (stderr, and the tables' rows on stdout).
fn show(e: &Event<'_>, json: bool) {
    match e {
        Event::Spawned(budgets) if !json => {
            let b: Vec<String> = budgets.iter().map(|&b| format_bytes(b)).collect();
            eprintln!("{} workers on loopback, budgets {}", b.len(), b.join(", "));
        }
        Event::Planned(s) if !json => print_setup(s),
        Event::BenchBudgets {
            budgets,
            model_bytes,
        } => bench::show_budgets(budgets, *model_bytes),
        Event::BenchRow(row) => bench::show_row(row),
        Event::MicroBatchChoice {
            sequences,
            per_step,
            ms,
        } => {
            println!(
                "cost model's choice: {per_step} sequences per micro-batch, {} in flight ({ms:.1} ms/token)",
                sequences.div_ceil(*per_step as usize)
            );
            println!("| sequences | sequences per step | steps in flight | tokens | wall s | tokens/s | ms/token | predicted ms/token | stage loads per round |");
            println!("|---|---|---|---|---|---|---|---|---|");
        }
        Event::MicroBatchRow(r) => println!(
            "| {} | {} | {} | {} | {:.2} | {:.1} | {:.1} | {:.1} | {:.2} |",
            r.sequences,
            r.seqs_per_step,
            r.in_flight,
            r.tokens,
            r.wall_s,
            r.tokens as f64 / r.wall_s.max(1e-9),
            r.wall_s * 1e3 / r.tokens.max(1) as f64,
            r.predicted_ms,
            r.stage_loads_per_round
        ),
        _ => {}
    }
}

/// The report of a generation: JSON or the text's timing lines, the breakdown, the cgroups'
/// charges and `--plot`.
fn report_generation(a: &LocalArgs, g: Generated) -> Result<()> {
    if let Some(path) = &a.plot {
        let Some(ad) = &g.adaptation else {
            bail!("--plot: this run has no adaptation report");
        };
        let title = format!(
            "loip local {} ({} new tokens)",
            a.model,
            g.out.new_ids.len()
        );
        plot::write(path, ad, &title)?;
    }
    if let (Some(st), false) = (&g.speculation, a.json) {
        eprintln!(
            "speculation: {} steps, {} of {} drafts kept",
            st.steps, st.accepted, st.drafted
        );
    }
    report(&g.prompt_ids, &g.out, g.text, a.json, Some(g.fields))?;
    if !a.json {
        print_breakdown(&g.breakdown, g.ms_per_token, g.predicted_ms_per_token);
        for r in &g.cgroups {
            eprintln!("{r}");
        }
    }
    let killed: u64 = g.cgroups.iter().map(|c| c.oom_kills).sum();
    if killed > 0 {
        bail!("the kernel killed {killed} worker(s) for going over their memory cgroup's limit");
    }
    Ok(())
}
