//! `loip generate`, `loip logits`, `loip fetch`.

use anyhow::Result;
use clap::Args;
use loip_engine::Model;
use loip_plan::Pattern;

use crate::backend::{self, ClusterArgs, OffloadArgs};
use crate::model_load;
use crate::request::{prepare, report, Printer, PromptArgs};

/// Arguments of `loip generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model: `smollm2`, an HF directory, or a GGUF file.
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
}

/// Arguments of `loip logits`.
#[derive(Args, Debug)]
pub struct LogitsArgs {
    /// Model: `smollm2`, an HF directory, or a GGUF file.
    #[arg(long, short = 'm')]
    pub model: String,
    /// Token ids, e.g. `1,5,42`.
    #[arg(long, value_delimiter = ',', required = true)]
    pub ids: Vec<u32>,
}

/// Arguments of `loip fetch`.
#[derive(Args, Debug)]
pub struct FetchArgs {
    /// Model name; only `smollm2` is known.
    #[arg(default_value = "smollm2")]
    pub name: String,
}

/// `loip generate`: one request on the same batched backend as `loip api` (in memory, from
/// slice files, or a cluster), printed as it is produced.
pub fn generate(a: GenerateArgs) -> Result<()> {
    let (src, info) = backend::source(&a.model, &a.offload, &a.cluster)?;
    let on_cluster = matches!(src, backend::Source::Cluster(_));
    let prep = prepare(info, &a.prompt)?;
    let context = prep.prompt_ids.len() + prep.opts.max_tokens;
    let how = backend::How {
        model: &a.model,
        offload: &a.offload,
        cluster: &a.cluster,
        loader: a.offload.loader,
        parallel: 1,
        max_step_tokens: prep.prompt_ids.len(),
        context,
        pattern: Pattern::Sporadic,
        micro_batches: None,
        planned_context: context as u64,
        greedy: a.prompt.greedy(),
        no_replan: true,
        quiet: a.json,
    };
    let opened = backend::open(src, &how)?;
    let mut printer = Printer::new(prep.tokenizer.as_ref(), a.prompt.stop.clone(), a.json);
    let out = opened
        .backend
        .generate(&prep.prompt_ids, &prep.opts, &mut |id| printer.on_token(id));
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
        let steps = out.new_ids.len().max(1) as f64;
        extra.insert("memory".into(), serde_json::to_value(memory)?);
        extra.insert(
            "load_stall_ms_per_token".into(),
            (dev.load_stall_s * 1e3 / steps).into(),
        );
        extra.insert("loaded_bytes".into(), dev.loaded_bytes.into());
        if !a.json {
            backend::print_memory(memory);
            eprintln!(
                "; load stall {:.2} ms/token",
                dev.load_stall_s * 1e3 / steps
            );
        }
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

/// `loip logits`.
pub fn logits(a: LogitsArgs) -> Result<()> {
    let ckpt = model_load::open(&a.model)?;
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
