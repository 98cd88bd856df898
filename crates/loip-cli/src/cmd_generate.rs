//! `loip generate`, `loip logits`, `loip fetch`: the single-device engine.

use std::path::Path;

use anyhow::Result;
use clap::Args;
use loip_engine::generate::generate as run_generate;
use loip_engine::{Generator, Model};

use crate::model_load;
pub use crate::request::{prepare, report, Printer, PromptArgs};

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
    pub cluster: crate::cmd_serve::ClusterArgs,
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

/// `loip generate`.
pub fn generate(a: GenerateArgs) -> Result<()> {
    if a.cluster.cluster.is_some() {
        return crate::cmd_serve::generate_on_cluster(
            &a.model,
            &a.prompt,
            a.json,
            a.offload.loader,
            &a.cluster,
        );
    }
    if a.offload.sliced()
        || Path::new(&a.model)
            .join(loip_model::slice::MANIFEST)
            .is_file()
    {
        return generate_sliced(a);
    }
    let ckpt = model_load::open(&a.model)?;
    let model = Model::from_checkpoint(&ckpt)?;
    let info = model_load::ModelInfo {
        config: ckpt.config.clone(),
        tokenizer: model_load::tokenizer(&ckpt),
        chat: model_load::chat_template(&ckpt),
    };
    let prep = prepare(info, &a.prompt)?;
    let mut printer = Printer::new(prep.tokenizer.as_ref(), a.prompt.stop.clone(), a.json);
    let mut gen = Generator::new(&model, None);
    let out = run_generate(&mut gen, 0, &prep.prompt_ids, &prep.opts, &mut |id| {
        printer.on_token(id)
    })?;
    let text = printer.finish();
    let mut extra = serde_json::Map::new();
    extra.insert("peak_rss_bytes".into(), peak_rss().into());
    report(&prep.prompt_ids, &out, text, a.json, Some(extra))
}

/// `loip generate --mem …`: the model runs from slice files under a memory budget.
fn generate_sliced(a: GenerateArgs) -> Result<()> {
    use loip_runtime::local::{LocalModel, LocalOptions};
    let dir = crate::cmd_split::slices_for(&a.model)?;
    // The slice directory carries the config and tokenizer; the checkpoint is not opened.
    let prep = prepare(model_load::info(&dir.to_string_lossy())?, &a.prompt)?;
    let mem_budget = a
        .offload
        .mem
        .as_deref()
        .map(loip_plan::parse_bytes)
        .transpose()?;
    let opts = LocalOptions {
        mem_budget,
        rule: a.offload.offload_blocks,
        loader: a.offload.loader,
        overlap: !a.offload.no_overlap,
        context: prep.prompt_ids.len() + prep.opts.max_tokens,
        max_step_tokens: prep.prompt_ids.len(),
    };
    let mut model = LocalModel::open(&dir, &opts)?;
    let memory = model.device.memory();
    let mut printer = Printer::new(prep.tokenizer.as_ref(), a.prompt.stop.clone(), a.json);
    let out = run_generate(&mut model, 0, &prep.prompt_ids, &prep.opts, &mut |id| {
        printer.on_token(id)
    })?;
    let text = printer.finish();
    let times = model.device.take_times();
    let steps = out.new_ids.len().max(1) as f64;
    let mut extra = serde_json::Map::new();
    extra.insert("peak_rss_bytes".into(), peak_rss().into());
    extra.insert("memory".into(), serde_json::to_value(memory)?);
    extra.insert(
        "load_stall_ms_per_token".into(),
        (times.stall_s * 1e3 / steps).into(),
    );
    extra.insert("loaded_bytes".into(), times.loaded_bytes.into());
    if !a.json {
        eprintln!(
            "memory: budget {} B, resident {} B, slot {} B, working {} B, KV budget {} B; load stall {:.2} ms/token",
            memory.budget, memory.resident, memory.slot, memory.working, memory.kv_budget, times.stall_s * 1e3 / steps
        );
    }
    report(&prep.prompt_ids, &out, text, a.json, Some(extra))
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
