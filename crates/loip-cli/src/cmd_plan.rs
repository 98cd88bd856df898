//! `loip plan`: plan a model on a cluster and print the allocation and its prediction.
//!
//! Reads the cluster file (and any profile files it names, relative to the cluster file),
//! resolves the model shape, runs a planner from `loip-plan` and prints a table, the plan as
//! JSON (`--json`), or every planner side by side (`--compare`); `--acceptance A` adds the
//! price of speculative decoding for each number of drafts per step
//! ([`loip_plan::speculate`]).

use anyhow::{bail, Context, Result};
use loip_plan::planners::{plan_all, PlanRequest};
use loip_plan::{render, LoaderKind, Pattern};
use std::path::PathBuf;

/// Arguments of `loip plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// Model: a checkpoint directory / GGUF file or a known model name.
    #[arg(long, conflicts_with = "shape")]
    pub model: Option<String>,
    /// Model shape preset instead of a checkpoint (e.g. `llama3.3-70b`, `qwen3-32b`).
    #[arg(long)]
    pub shape: Option<String>,
    /// Cluster file (TOML; see examples/clusters/).
    #[arg(long)]
    pub cluster: PathBuf,
    /// Planner (default: the cluster file's `[plan] planner`, else `loip`).
    #[arg(long)]
    pub planner: Option<String>,
    /// Planned context: KV tokens held, summed over sequences in flight.
    #[arg(long)]
    pub context: Option<u64>,
    /// Request pattern: `sporadic` or `bursty`.
    #[arg(long)]
    pub pattern: Option<String>,
    /// Sequences in flight for bursty traffic (default: number of devices).
    #[arg(long)]
    pub micro_batches: Option<u32>,
    /// Loading path: `direct` or `conventional`.
    #[arg(long)]
    pub loader: Option<String>,
    /// Override the link bandwidth (e.g. `200mbit`, `50MB/s`).
    #[arg(long)]
    pub bandwidth: Option<String>,
    /// Never leave a device out (`loip` otherwise tries every subset).
    #[arg(long)]
    pub no_drop: bool,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Print every planner's prediction side by side.
    #[arg(long)]
    pub compare: bool,
    /// Also price speculative decoding at this acceptance rate (0–1: the chance that a draft
    /// equals the model's own token, given the drafts before it did): for k = 0..=--max-k
    /// drafts per step, the time of a step of k + 1 positions (the profiles' batch grid on
    /// each device), the expected tokens per step and ms/token, and the best k.
    #[arg(long)]
    pub acceptance: Option<f64>,
    /// Most drafts per step priced with --acceptance.
    #[arg(long, default_value_t = 8, requires = "acceptance")]
    pub max_k: u32,
    /// Also write the plan JSON to this file.
    #[arg(long, short)]
    pub out: Option<PathBuf>,
}

/// Runs `loip plan`.
pub fn run(args: PlanArgs) -> Result<()> {
    if args.model.is_none() && args.shape.is_none() {
        bail!("give --model PATH|NAME or --shape NAME");
    }
    let mut cluster = loip::backend::read_cluster(&args.cluster)?;
    if let Some(bw) = &args.bandwidth {
        cluster.link.bandwidth =
            loip_plan::parse_bandwidth(bw).with_context(|| format!("--bandwidth {bw}"))?;
    }
    let shape = crate::model_shape::resolve_shape(args.model.as_deref(), args.shape.as_deref())?;
    let d = &cluster.defaults;
    let pattern = match &args.pattern {
        Some(p) => p
            .parse::<Pattern>()
            .map_err(anyhow::Error::msg)
            .context("--pattern")?,
        None => d.pattern.unwrap_or_default(),
    };
    let loader = match args.loader.as_deref() {
        Some("direct") => LoaderKind::Direct,
        Some("conventional") => LoaderKind::Conventional,
        Some(other) => bail!("--loader {other}: must be `direct` or `conventional`"),
        None => d.loader.unwrap_or_default(),
    };
    let req = PlanRequest {
        context: args
            .context
            .or(d.context)
            .unwrap_or(PlanRequest::default().context),
        pattern,
        micro_batches: args.micro_batches.or(d.micro_batches),
        loader,
        allow_drop: !args.no_drop,
    };
    if args.compare {
        let results = plan_all(&shape, &cluster, &req);
        if args.json {
            let items: Vec<serde_json::Value> = results
                .iter()
                .map(|(name, r)| match r {
                    Ok(p) => serde_json::json!({ "planner": name, "plan": p }),
                    Err(e) => serde_json::json!({ "planner": name, "error": e.to_string() }),
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&items)?);
        } else {
            println!(
                "{} on {} device(s), {} context {} tokens, link {}",
                shape.name,
                cluster.devices.len(),
                req.pattern,
                req.context,
                loip_plan::units::format_bandwidth(cluster.link.bandwidth)
            );
            print!("{}", render::compare_table(&results));
        }
        return Ok(());
    }
    let name = args
        .planner
        .as_deref()
        .or(d.planner.as_deref())
        .unwrap_or("loip");
    let plan = loip_plan::plan(name, &shape, &cluster, &req)?;
    if let Some(out) = &args.out {
        std::fs::write(out, plan.to_json())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    let speculation = match args.acceptance {
        Some(a) if !(0.0..=1.0).contains(&a) => {
            bail!("--acceptance {a}: must be between 0 and 1")
        }
        Some(a) => Some(loip_plan::speculate::price_ks(
            &plan, &shape, &cluster, 1, a, args.max_k,
        )?),
        None => None,
    };
    match (args.json, &speculation) {
        (true, None) => println!("{}", plan.to_json()),
        (true, Some((ks, best))) => {
            let v = serde_json::json!({ "plan": plan, "speculation": ks, "best_k": ks.get(*best).map(|c| c.k) });
            println!("{}", serde_json::to_string_pretty(&v)?);
        }
        (false, _) => {
            print!("{}", render::plan_table(&plan));
            if let Some((ks, best)) = &speculation {
                println!();
                print!("{}", render::speculation_table(ks, *best));
            }
        }
    }
    Ok(())
}
