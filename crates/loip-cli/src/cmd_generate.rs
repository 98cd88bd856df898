//! `loip generate`, `loip logits`, `loip fetch`.

use anyhow::{bail, Result};
use clap::Args;
use loip_engine::{Model, Speculate};
use loip_model::Checkpoint;
use loip_plan::Pattern;

use crate::backend::{self, ClusterArgs, OffloadArgs};

use crate::request::{prepare, report, Prepared, Printer, PromptArgs};
use crate::speculate::SpecArgs;

/// Arguments of `loip generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model: a known name (`smollm2`, `gemma3-270m`), an HF directory, or a GGUF file.
    #[arg(long, short = 'm', default_value = "smollm2")]
    pub model: String,
    #[command(flatten)]
    pub prompt: PromptArgs,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub offload: OffloadArgs,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// Arguments of `loip logits`.
#[derive(Args, Debug)]
pub struct LogitsArgs {
    /// Model: a known name (`smollm2`, `gemma3-270m`), an HF directory, or a GGUF file.
    #[arg(long, short = 'm')]
    pub model: String,
    /// Token ids, e.g. `1,5,42`.
    #[arg(long, value_delimiter = ',', required = true)]
    pub ids: Vec<u32>,
}

/// Arguments of `loip fetch`.
#[derive(Args, Debug)]
pub struct FetchArgs {
    /// Model name: `smollm2` or `gemma3-270m`.
    #[arg(default_value = "smollm2")]
    pub name: String,
}

/// `loip generate`: one request on the same batched backend as `loip api` (in memory, from
/// slice files, or a cluster), printed as it is produced.
pub fn generate(mut a: GenerateArgs) -> Result<()> {
    crate::cluster_ux::discover(&mut a.cluster)?;
    let (src, info) = backend::source(&a.model, &a.offload, &a.cluster)?;
    let on_cluster = matches!(src, backend::Source::Cluster(_));
    let config = info.config.clone();
    let prep = prepare(info, &a.prompt)?;
    if a.spec.on() && on_cluster {
        // the cluster's serving loop speculates (prompt lookup), as `loip api` on it
        if a.spec.speculate == Speculate::Draft {
            bail!("on a cluster --speculate is lookup (a draft model is not served there)");
        }
        let max = loip_engine::speculate::MAX_REWIND;
        if a.spec.speculate_k > max {
            bail!("--speculate-k is at most {max} on a cluster");
        }
    } else if a.spec.on() {
        // a self-draft is the target's own layers: nothing to open
        let own = loip::speculate::self_draft_of(&a.spec.spec())?.is_some();
        let draft = (a.spec.speculate == Speculate::Draft && !own)
            .then(|| loip::speculate::open_draft(&a.spec.spec(), &config, prep.tokenizer.as_ref()))
            .transpose()?;
        return generate_speculative(a, src, prep, draft.as_ref());
    }
    let context = prep.prompt_ids.len() + prep.opts.max_tokens;
    let how = backend::How {
        offload: &a.offload,
        cluster: &a.cluster,
        sizes: backend::Sizes {
            model: &a.model,
            loader: a.offload.loader,
            parallel: 1,
            // a verify step carries k + 1 positions
            max_step_tokens: prep.prompt_ids.len().max(a.spec.speculate_k + 1),
            context,
            pattern: Pattern::Sporadic,
            micro_batches: None,
            planned_context: context as u64,
            greedy: a.prompt.greedy(),
            no_replan: true,
            speculate_k: if a.spec.on() { a.spec.speculate_k } else { 0 },
        },
        quiet: a.json,
    };
    let opened = backend::open(src, &how)?;
    let mut printer = Printer::new(prep.tokenizer.as_ref(), a.prompt.stop.clone(), a.json);
    let spec = loip_server::serving::Speculation {
        source: a.spec.speculate,
        opts: a.spec.options(true),
    };
    let out = opened.backend.generate_shaped(
        &prep.prompt_ids,
        &prep.opts,
        &loip_engine::Shaping::default(),
        &spec,
        &mut |id, _| printer.on_token(id),
        &mut || true,
    );
    let out = match out {
        Ok(out) => out,
        Err(e) => {
            opened.backend.shutdown();
            return Err(e.into());
        }
    };
    let text = printer.finish();
    let mut extra = serde_json::Map::new();
    if !on_cluster {
        extra.insert("peak_rss_bytes".into(), backend::peak_rss().into());
    }
    if let Some(memory) = &opened.memory {
        let dev = opened.backend.stats().device;
        let tokens = out.new_ids.len();
        memory_report(
            memory,
            dev.load_stall_s,
            dev.loaded_bytes,
            tokens,
            a.json,
            &mut extra,
        )?;
    }
    let cluster = backend::cluster_report(&opened.backend, true)?;
    if let Some((_, _, more)) = &cluster {
        extra.extend(more.clone());
    }
    report(&prep.prompt_ids, &out, text, a.json, Some(extra))?;
    if let (Some((b, predicted, _)), false) = (&cluster, a.json) {
        backend::print_breakdown(b, out.decode_ms_per_token, *predicted);
    }
    opened.backend.shutdown();
    Ok(())
}

/// A device's memory and loads (from slice files) into the JSON `extra`, and on stderr
/// unless `json`.
fn memory_report(
    memory: &loip_runtime::MemoryReport,
    stall_s: f64,
    loaded_bytes: u64,
    tokens: usize,
    json: bool,
    extra: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let stall_ms = stall_s * 1e3 / tokens.max(1) as f64;
    let shed = loip_runtime::memory::pressure::totals();
    extra.insert("memory".into(), serde_json::to_value(memory)?);
    extra.insert("shed".into(), serde_json::to_value(shed)?);
    extra.insert("load_stall_ms_per_token".into(), stall_ms.into());
    extra.insert("loaded_bytes".into(), loaded_bytes.into());
    if !json {
        backend::print_memory(memory);
        eprintln!("; load stall {stall_ms:.2} ms/token");
        if shed.sheds > 0 {
            eprintln!(
                "memory pressure: shed {} in {} step(s) by offloading blocks (the figures \
                 above are the budget at start)",
                loip_plan::units::format_bytes(shed.bytes),
                shed.sheds
            );
        }
    }
    Ok(())
}

/// `loip generate --speculate …`: the request on this machine with speculative decoding
/// (the same tokens; fewer forward steps when drafts are accepted).
fn generate_speculative(
    a: GenerateArgs,
    src: backend::Source,
    prep: Prepared,
    draft: Option<&Checkpoint>,
) -> Result<()> {
    let mut printer = Printer::new(prep.tokenizer.as_ref(), a.prompt.stop.clone(), a.json);
    let run = loip::speculate::run(
        src,
        &a.offload.options()?,
        &prep.prompt_ids,
        &prep.opts,
        &a.spec.spec(),
        draft,
        &mut |id| printer.on_token(id),
    )?;
    let text = printer.finish();
    let (out, stats) = (&run.out.out, run.out.stats);
    let mut extra = serde_json::Map::new();
    extra.insert("peak_rss_bytes".into(), backend::peak_rss().into());
    extra.insert("speculation".into(), serde_json::to_value(stats)?);
    if let (Some(memory), Some(t)) = (&run.memory, &run.times) {
        let tokens = out.new_ids.len();
        memory_report(
            memory,
            t.stall_s,
            t.loaded_bytes,
            tokens,
            a.json,
            &mut extra,
        )?;
    }
    if !a.json {
        eprintln!(
            "speculation: {} steps after the prompt, {} drafts, {} accepted ({:.0} %)",
            stats.steps,
            stats.drafted,
            stats.accepted,
            stats.acceptance() * 100.0
        );
    }
    report(&prep.prompt_ids, out, text, a.json, Some(extra))
}

/// `loip logits`.
pub fn logits(a: LogitsArgs) -> Result<()> {
    let ckpt = loip::model::open(&a.model)?;
    let model = Model::from_checkpoint(&ckpt)?;
    let vocab = ckpt.config.vocab_size;
    let logits = model.prompt_logits(&a.ids)?;
    let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
    println!(
        "{}",
        serde_json::to_string(&serde_json::json!({ "logits": rows }))?
    );
    Ok(())
}

/// `loip fetch`.
pub fn fetch(a: FetchArgs) -> Result<()> {
    println!("{}", loip_model::fetch::fetch_named(&a.name)?.display());
    Ok(())
}
