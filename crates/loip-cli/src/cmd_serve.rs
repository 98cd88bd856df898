//! `loip serve`: the coordinator. It connects to the workers
//! of a cluster file, authenticates them, measures each link, profiles the devices the file
//! gives no profile for, plans, ships each worker only the slices it lacks, and runs
//! requests. `loip serve` reads prompts from stdin, one per line (text, or a JSON array of
//! token ids; the HTTP API is a separate command); a device that fails is reported by name and the cluster is re-planned over the
//! remaining devices when the model still fits.

use std::io::BufRead;
use std::path::Path;

use anyhow::{bail, Result};
use clap::Args;
use loip_plan::Pattern;
use loip_runtime::LoaderKind;
use loip_server::Backend;

use crate::backend::{self, print_breakdown, ClusterArgs, OffloadArgs};

use crate::request::{prepare, report, Printer, PromptArgs};

/// Arguments of `loip serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model: a known name (`smollm2`, `gemma3-270m`), an HF directory, a GGUF file or a slice directory.
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
    /// Connect, measure, profile and plan as a start does, print the plan
    /// (per device: stages, resident/offloaded blocks, memory, predicted ms/token and its
    /// breakdown) and stop before shipping or loading anything.
    #[arg(long)]
    pub preview: bool,
    /// Print one JSON object per request instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Sampling options for every request (`--prompt` is ignored: prompts come from stdin).
    #[command(flatten)]
    pub sampling: PromptArgs,
}

/// `loip serve`: set the cluster up, then generate for every line of stdin, on the same
/// batched cluster backend as `loip api`.
pub fn serve(mut a: ServeArgs) -> Result<()> {
    crate::cluster_ux::discover(&mut a.cluster)?;
    let dir = crate::progress::slices_for(&a.model)?;
    let offload = OffloadArgs {
        mem: None,
        offload_blocks: loip_runtime::local::OffloadRule::Auto,
        loader: a.loader,
        no_overlap: false,
    };
    let max_position = loip::model::info(&dir.to_string_lossy())?
        .config
        .max_position_embeddings;
    let how = backend::How {
        offload: &offload,
        cluster: &a.cluster,
        sizes: backend::Sizes {
            model: &a.model,
            loader: a.loader,
            parallel: 1,
            max_step_tokens: a.max_prompt,
            context: max_position.min(usize::try_from(a.context).unwrap_or(usize::MAX)),
            pattern: a.pattern,
            micro_batches: a.micro_batches,
            planned_context: a.context,
            greedy: a.sampling.greedy(),
            no_replan: a.no_replan,
            speculate_k: 0,
        },
        quiet: false,
    };
    if a.preview {
        return crate::cluster_ux::preview(&dir, &how);
    }
    let opened = backend::open(backend::Source::Cluster(dir.clone()), &how)?;
    let be = opened.backend;
    if !a.no_replan {
        crate::cluster_ux::watch_rejoin(&be);
    }
    eprintln!("ready: one prompt per line on stdin");
    let served = serve_lines(&be, &dir, &a);
    be.shutdown();
    served
}

fn serve_lines(be: &Backend, dir: &Path, a: &ServeArgs) -> Result<()> {
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let mut p = a.sampling.clone();
        // `[1, 2, 3]` is a prompt of token ids; anything else is text.
        p.prompt_ids = serde_json::from_str::<Vec<u32>>(line.trim()).ok();
        p.prompt = line;
        if let Err(e) = serve_one(be, dir, &p, a.json) {
            eprintln!("error: {e:#}");
            // The backend re-planned over the remaining devices when one was gone (unless
            // --no-replan): what is still gone stays gone.
            let gone = be
                .session()
                .map(|s| loip_server::backend::lock(s).gone())
                .unwrap_or_default();
            if !gone.is_empty() {
                if a.no_replan {
                    bail!("{} gone and --no-replan is set", gone.join(", "));
                }
                eprintln!(
                    "cannot re-plan over the remaining devices; still serving, requests will fail"
                );
            }
        }
    }
    Ok(())
}

fn serve_one(be: &Backend, dir: &Path, p: &PromptArgs, json: bool) -> Result<()> {
    let prep = prepare(loip::model::info(&dir.to_string_lossy())?, p)?;
    let mut printer = Printer::new(prep.tokenizer.as_ref(), p.stop.clone(), json);
    let out = be.generate(&prep.prompt_ids, &prep.opts, &mut |id| printer.on_token(id))?;
    let text = printer.finish();
    let cluster = backend::cluster_report(be, false)?;
    let extra = cluster.as_ref().map(|(_, _, e)| e.clone());
    report(&prep.prompt_ids, &out, text, json, extra)?;
    if let (Some((b, predicted, _)), false) = (&cluster, json) {
        print_breakdown(b, out.decode_ms_per_token, *predicted);
    }
    Ok(())
}
