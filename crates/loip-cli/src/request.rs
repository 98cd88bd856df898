//! A request from the command line: prompt and sampling flags, tokenizing them into a
//! prompt and the engine's options, printing the text as it is generated, and the final
//! report. Shared by `loip generate`, `loip serve` and `loip local`, so that every command
//! runs the same request the same way (and none of them imports another).

use std::io::Write;

use anyhow::{bail, Context, Result};
use clap::Args;
use loip_engine::generate::Flow;
use loip_engine::GenerateOptions;
use loip_model::chat::ChatMessage;
use loip_model::tokenizer::StreamDecoder;

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
        self.temperature == 0.0 || self.top_k == 1
    }
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
pub fn prepare(info: loip::model::ModelInfo, p: &PromptArgs) -> Result<Prepared> {
    let loip::model::ModelInfo {
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
        (None, Some(tok)) if p.chat => {
            let tpl = chat?.context("the model has no chat template")?;
            // the prompt is the message's plain text, as `loip api` tokenizes it
            tpl.encode(tok, &[ChatMessage::new("user", p.prompt.clone())], true)?
        }
        (None, Some(tok)) => tok.encode(&p.prompt, true)?,
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
    Ok(loip_server::options::generate_options(
        config,
        prompt_ids,
        &p.sampling(),
    )?)
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
