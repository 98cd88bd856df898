//! `loip serve` and `loip generate --cluster`: the coordinator. It connects to the workers
//! of a cluster file, authenticates them, measures each link, profiles the devices the file
//! gives no profile for, plans, ships each worker only the slices it lacks, and runs
//! requests. `loip serve` reads prompts from stdin, one per line (text, or a JSON array of
//! token ids; the HTTP API is a separate command); a device that fails is reported by name and the cluster is re-planned over the
//! remaining devices when the model still fits.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use loip_plan::cluster::RawCluster;
use loip_plan::{render, Cluster, Pattern};
use loip_runtime::cluster_run::{Breakdown, Session, SessionOptions, WorkerSpec};
use loip_runtime::coordinator::Endpoint;
use loip_runtime::LoaderKind;

use crate::model_load;
use crate::request::{prepare, report, Printer, PromptArgs};

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
    /// Write the plan as JSON to this file.
    #[arg(long)]
    pub plan_out: Option<PathBuf>,
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
    for r in &s.reports {
        let link = r
            .link
            .map(|l| {
                format!(
                    "latency {:.3} ms, up {}, down {}",
                    l.latency_s * 1e3,
                    loip_plan::units::format_bandwidth(l.up_bps),
                    loip_plan::units::format_bandwidth(l.down_bps)
                )
            })
            .unwrap_or_default();
        let probe = r
            .probe
            .as_ref()
            .map(|p| {
                format!(
                    "; t^A(1,{}) {:.3} ms, t^P {:.3} ms, load {}",
                    p.attn.first().map_or(0, |a| a.0),
                    p.attn.first().map_or(0.0, |a| a.1) * 1e3,
                    p.mlp_s * 1e3,
                    loip_plan::units::format_bandwidth(p.direct.bandwidth)
                )
            })
            .unwrap_or_default();
        eprintln!(
            "device {} ({}): budget {}, {link}{probe}; slices sent {} ({}), reused {}",
            r.endpoint.name,
            r.endpoint.addr,
            loip_plan::units::format_bytes(r.mem_budget),
            r.shipped.sent.len(),
            loip_plan::units::format_bytes(r.shipped.sent_bytes),
            r.shipped.reused
        );
    }
    eprint!("{}", render::plan_table(&s.plan));
    eprintln!("setup took {:.2} s", s.setup_s);
}

/// Prints ms/token and its breakdown (stderr).
pub fn print_breakdown(b: &Breakdown, measured_ms: f64, predicted_ms: f64) {
    eprintln!(
        "{measured_ms:.2} ms/token (plan predicted {predicted_ms:.2}): compute {:.2}, network {:.2}, load stall {:.2}, queued {:.2} ms/step",
        b.compute_ms, b.network_ms, b.load_stall_ms, b.queued_ms
    );
}

/// Brings a cluster up for `model` (a path or `smollm2`), planning for `context` tokens
/// (and for greedy generations' 8-byte token return when `greedy`).
#[allow(clippy::too_many_arguments)]
pub fn start(
    model: &str,
    c: &ClusterArgs,
    loader: LoaderKind,
    pattern: Pattern,
    micro_batches: Option<u32>,
    context: u64,
    max_step_tokens: usize,
    greedy: bool,
) -> Result<(Session, PathBuf)> {
    let file = c.cluster.as_deref().context("--cluster FILE is required")?;
    let (workers, cluster) = read_workers(file)?;
    let dir = crate::cmd_split::slices_for(model)?;
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
        ..Default::default()
    };
    opts.connect.token =
        loip_runtime::net::token::from_sources(c.token_file.as_deref(), c.token.as_deref())?;
    let s = Session::start(&dir, workers, opts)?;
    if let Some(p) = &c.plan_out {
        std::fs::write(p, s.plan.to_json()).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok((s, dir))
}

/// `loip generate --cluster FILE`: one generation on the cluster, printed like `generate`.
pub fn generate_on_cluster(
    model: &str,
    prompt: &PromptArgs,
    json: bool,
    loader: LoaderKind,
    c: &ClusterArgs,
) -> Result<()> {
    let dir = crate::cmd_split::slices_for(model)?;
    let prep = prepare(model_load::info(&dir.to_string_lossy())?, prompt)?;
    let context = (prep.prompt_ids.len() + prep.opts.max_tokens) as u64;
    let (s, _) = start(
        model,
        c,
        loader,
        Pattern::Sporadic,
        None,
        context,
        prep.prompt_ids.len(),
        prompt.greedy(),
    )?;
    if !json {
        print_setup(&s);
    }
    let mut printer = Printer::new(prep.tokenizer.as_ref(), prompt.stop.clone(), json);
    let out = s.generate(&prep.prompt_ids, &prep.opts, &mut |id| printer.on_token(id))?;
    let text = printer.finish();
    let b = Breakdown::of(&s.take_totals());
    let mut extra = serde_json::Map::new();
    extra.insert("plan".into(), serde_json::to_value(&s.plan)?);
    extra.insert("breakdown".into(), serde_json::to_value(b)?);
    report(&prep.prompt_ids, &out, text, json, Some(extra))?;
    if !json {
        print_breakdown(&b, out.decode_ms_per_token, s.plan.predicted_ms_per_token);
    }
    s.shutdown();
    Ok(())
}

/// Arguments of `loip serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model: `smollm2`, an HF directory, a GGUF file or a slice directory.
    #[arg(long, short = 'm', default_value = "smollm2")]
    pub model: String,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Loading path on the workers: direct or conventional.
    #[arg(long, default_value = "direct")]
    pub loader: LoaderKind,
    /// Plan for this pattern: sporadic or bursty.
    #[arg(long, default_value = "sporadic")]
    pub pattern: Pattern,
    /// Sequences in flight for bursty traffic (default: number of devices).
    #[arg(long)]
    pub micro_batches: Option<u32>,
    /// Planned context: KV tokens held, summed over sequences in flight.
    #[arg(long, default_value_t = 2048)]
    pub context: u64,
    /// Longest prompt, tokens (sizes the working buffers).
    #[arg(long, default_value_t = 512)]
    pub max_prompt: usize,
    /// Do not re-plan over the remaining devices when one fails.
    #[arg(long)]
    pub no_replan: bool,
    /// Print one JSON object per request instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Sampling options for every request (`--prompt` is ignored: prompts come from stdin).
    #[command(flatten)]
    pub sampling: PromptArgs,
}

/// `loip serve`: set the cluster up, then generate for every line of stdin.
pub fn serve(a: ServeArgs) -> Result<()> {
    let (mut s, dir) = start(
        &a.model,
        &a.cluster,
        a.loader,
        a.pattern,
        a.micro_batches,
        a.context,
        a.max_prompt,
        a.sampling.greedy(),
    )?;
    print_setup(&s);
    eprintln!("ready: one prompt per line on stdin");
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let mut p = a.sampling.clone();
        // `[1, 2, 3]` is a prompt of token ids; anything else is text.
        p.prompt_ids = serde_json::from_str::<Vec<u32>>(line.trim()).ok();
        p.prompt = line;
        if let Err(e) = serve_one(&s, &dir, &p, a.json) {
            eprintln!("error: {e:#}");
            let gone: Vec<_> = s.health().into_iter().filter(|h| !h.alive).collect();
            for h in &gone {
                eprintln!(
                    "device {} ({}) is gone: {}",
                    h.endpoint.name,
                    h.endpoint.addr,
                    h.reason.as_deref().unwrap_or("unknown")
                );
            }
            if !gone.is_empty() {
                if a.no_replan {
                    bail!("a device is gone and --no-replan is set");
                }
                match s.replan() {
                    Ok(left_out) => {
                        eprintln!("re-planned without {}", left_out.join(", "));
                        print_setup(&s);
                    }
                    Err(e) => eprintln!("cannot re-plan over the remaining devices: {e}; still serving, requests will fail"),
                }
            }
        }
    }
    s.shutdown();
    Ok(())
}

fn serve_one(s: &Session, dir: &Path, p: &PromptArgs, json: bool) -> Result<()> {
    let prep = prepare(model_load::info(&dir.to_string_lossy())?, p)?;
    let mut printer = Printer::new(prep.tokenizer.as_ref(), p.stop.clone(), json);
    let out = s.generate(&prep.prompt_ids, &prep.opts, &mut |id| printer.on_token(id))?;
    let text = printer.finish();
    let b = Breakdown::of(&s.take_totals());
    let mut extra = serde_json::Map::new();
    extra.insert("breakdown".into(), serde_json::to_value(b)?);
    report(&prep.prompt_ids, &out, text, json, Some(extra))?;
    if !json {
        print_breakdown(&b, out.decode_ms_per_token, s.plan.predicted_ms_per_token);
    }
    Ok(())
}
