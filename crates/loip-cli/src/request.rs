//! A request from the command line: prompt and sampling flags, tokenizing them into a
//! prompt and the engine's options, printing the text as it is generated, and the final
//! report. Shared by `loip generate`, `loip serve` and `loip local`, so that every command
//! runs the same request the same way (and none of them imports another).

use anyhow::Result;
use clap::Args;
use loip_engine::GenerateOptions;

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
    /// The sampling fields, as the server's options take them.
    pub fn sampling(&self) -> loip_server::options::Sampling {
        loip_server::options::Sampling {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
        }
    }

    /// Greedy sampling (temperature 0 or top-k 1): the last device can pick the token.
    pub fn greedy(&self) -> bool {
        self.request().greedy()
    }

    /// The library's request for these flags.
    pub fn request(&self) -> loip::request::Request {
        loip::request::Request {
            prompt: self.prompt.clone(),
            prompt_ids: self.prompt_ids.clone(),
            chat: self.chat,
            sampling: self.sampling(),
            stop: self.stop.clone(),
        }
    }
}

pub use loip::request::{Prepared, Printer};

/// Tokenizes the prompt (or takes its ids) and builds the generation options.
pub fn prepare(info: loip::model::ModelInfo, p: &PromptArgs) -> Result<Prepared> {
    loip::request::prepare(info, &p.request())
}

/// Checks `prompt_ids` against the vocabulary and builds `p`'s generation options (shared
/// with `loip api`, so both run the same request the same way).
pub fn options(
    config: &loip_model::ModelConfig,
    prompt_ids: &[u32],
    p: &PromptArgs,
) -> Result<GenerateOptions> {
    loip::request::options(config, prompt_ids, &p.sampling())
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
