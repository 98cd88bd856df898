//! `loip generate`, `loip logits`, `loip fetch`: the single-device engine.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::Args;
use loip_engine::generate::{generate as run_generate, Flow};
use loip_engine::{GenerateOptions, Generator, Model, SamplingParams};
use loip_model::chat::ChatMessage;
use loip_model::tokenizer::StreamDecoder;

use crate::model_load;

/// Prompt and sampling options shared by `generate`, `local` and the server.
#[derive(Args, Debug, Clone)]
pub struct PromptArgs {
    /// Prompt text.
    #[arg(
        long,
        short = 'p',
        default_value = "Once upon a time, there was a little"
    )]
    pub prompt: String,
    /// Token ids instead of text, e.g. `1,5,42` (bypasses the tokenizer).
    #[arg(long, value_delimiter = ',', conflicts_with = "chat")]
    pub prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most new tokens.
    #[arg(long, short = 'n', default_value_t = 32)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling threshold (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// RNG seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when the output contains this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Generate at least this many tokens: end-of-sequence tokens are masked out until then.
    #[arg(long, default_value_t = 0)]
    pub min_tokens: usize,
}

impl PromptArgs {
    /// Greedy sampling (temperature 0 or top-k 1): the last device can pick the token.
    pub fn greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

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

/// A tokenized request: prompt ids, how to decode, and options.
pub struct Prepared {
    /// prompt token ids
    pub prompt_ids: Vec<u32>,
    /// tokenizer (absent only when the model has none and ids were given)
    pub tokenizer: Option<loip_model::tokenizer::Tokenizer>,
    /// generation options
    pub opts: GenerateOptions,
}

/// Tokenizes the prompt (or takes its ids) and builds the generation options.
pub fn prepare(info: model_load::ModelInfo, p: &PromptArgs) -> Result<Prepared> {
    let model_load::ModelInfo {
        config,
        tokenizer,
        chat,
    } = info;
    let tokenizer = match tokenizer {
        Ok(t) => Some(t),
        Err(e) if p.prompt_ids.is_some() => {
            tracing::warn!("no tokenizer ({e:#}); output is ids only");
            None
        }
        Err(e) => return Err(e),
    };
    let prompt_ids = match (&p.prompt_ids, &tokenizer) {
        (Some(ids), _) => ids.clone(),
        (None, Some(tok)) => {
            let text = if p.chat {
                let tpl = chat?.context("the model has no chat template")?;
                tpl.render(
                    &[ChatMessage {
                        role: "user".into(),
                        content: p.prompt.clone(),
                    }],
                    true,
                )?
            } else {
                p.prompt.clone()
            };
            tok.encode(&text, true)?
        }
        (None, None) => bail!("no tokenizer"),
    };
    let opts = options(&config, &prompt_ids, p)?;
    Ok(Prepared {
        prompt_ids,
        tokenizer,
        opts,
    })
}

/// Checks `prompt_ids` against the vocabulary and builds `p`'s generation options (shared
/// with `loip api`, so both run the same request the same way).
pub fn options(
    config: &loip_model::ModelConfig,
    prompt_ids: &[u32],
    p: &PromptArgs,
) -> Result<GenerateOptions> {
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let vocab = config.vocab_size;
    if let Some(bad) = prompt_ids.iter().find(|&&id| id as usize >= vocab) {
        bail!("prompt id {bad} is outside the vocabulary of {vocab} tokens");
    }
    let eos_ids = if p.ignore_eos {
        vec![]
    } else {
        config.eos_token_ids.clone()
    };
    let sampling = SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        seed: p.seed,
    };
    sampling.validate()?;
    Ok(GenerateOptions {
        max_tokens: p.max_tokens,
        sampling,
        eos_ids,
        min_tokens: p.min_tokens,
    })
}

/// Streams text to stdout (unless `quiet`) and stops on a stop string.
pub struct Printer<'t> {
    decoder: Option<StreamDecoder<'t>>,
    stops: Vec<String>,
    text: String,
    quiet: bool,
}

impl<'t> Printer<'t> {
    /// A printer for `tok`'s tokens.
    pub fn new(
        tok: Option<&'t loip_model::tokenizer::Tokenizer>,
        stops: Vec<String>,
        quiet: bool,
    ) -> Self {
        Printer {
            decoder: tok.map(StreamDecoder::new),
            stops,
            text: String::new(),
            quiet,
        }
    }

    /// Handles one new token.
    pub fn on_token(&mut self, id: u32) -> Flow {
        let piece = match &mut self.decoder {
            Some(d) => d.push(id).ok().flatten().unwrap_or_default(),
            None => format!("[{id}]"),
        };
        self.text.push_str(&piece);
        if !self.quiet {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        }
        if self
            .stops
            .iter()
            .any(|s| !s.is_empty() && self.text.contains(s.as_str()))
        {
            Flow::Stop
        } else {
            Flow::Continue
        }
    }

    /// The text so far, cut before the first stop string.
    pub fn finish(mut self) -> String {
        if let Some(d) = self.decoder.take() {
            if let Ok(rest) = d.finish() {
                self.text.push_str(&rest);
                if !self.quiet {
                    print!("{rest}");
                }
            }
        }
        if let Some(cut) = self
            .stops
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min()
        {
            self.text.truncate(cut);
        }
        self.text
    }
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

/// Prints the JSON object or the timing lines of a finished generation; `extra` adds fields.
pub fn report(
    prompt_ids: &[u32],
    out: &loip_engine::GenerateOutput,
    text: String,
    json: bool,
    extra: Option<serde_json::Map<String, serde_json::Value>>,
) -> Result<()> {
    if json {
        let mut obj = serde_json::json!({
            "prompt_ids": prompt_ids,
            "new_ids": out.new_ids,
            "text": text,
            "decode_ms_per_token": out.decode_ms_per_token,
            "prompt_ms_per_token": out.prompt_ms / prompt_ids.len().max(1) as f64,
            "stop": out.stop,
        });
        if let (Some(extra), Some(map)) = (extra, obj.as_object_mut()) {
            map.extend(extra);
        }
        println!("{}", serde_json::to_string(&obj)?);
    } else {
        println!();
        let tps = if out.decode_ms_per_token > 0.0 {
            1e3 / out.decode_ms_per_token
        } else {
            0.0
        };
        eprintln!(
            "prompt: {} tokens, {:.2} ms/token | decode: {} tokens, {:.2} ms/token, {:.1} tokens/s",
            prompt_ids.len(),
            out.prompt_ms / prompt_ids.len().max(1) as f64,
            out.new_ids.len(),
            out.decode_ms_per_token,
            tps
        );
    }
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
