//! One request as a program states it (prompt text or ids, chat or plain, sampling, stop
//! strings), tokenized into the prompt's ids and the engine's options; and a printer that
//! streams the text as it is generated. `loip generate`, `serve`, `local` and `chat` run every
//! request through here, so each runs it the same way.

use std::io::Write;

use anyhow::{bail, Context, Result};
use loip_engine::generate::Flow;
use loip_engine::GenerateOptions;
use loip_model::chat::ChatMessage;
use loip_model::tokenizer::{StreamDecoder, Tokenizer};
use loip_server::options::Sampling;

use crate::model::ModelInfo;

/// A request: what to generate from, and how.
#[derive(Debug, Clone)]
pub struct Request {
    /// prompt text (ignored when `prompt_ids` is given)
    pub prompt: String,
    /// token ids instead of text (bypasses the tokenizer)
    pub prompt_ids: Option<Vec<u32>>,
    /// wrap the prompt as a user message with the model's chat template
    pub chat: bool,
    /// sampling, length and end-of-sequence handling
    pub sampling: Sampling,
    /// stop when the text contains one of these
    pub stop: Vec<String>,
}

impl Request {
    /// Greedy sampling (temperature 0 or top-k 1): the last device can pick the token.
    pub fn greedy(&self) -> bool {
        self.sampling.temperature == 0.0 || self.sampling.top_k == 1
    }
}

/// A tokenized request: prompt ids, how to decode, and options.
pub struct Prepared {
    /// prompt token ids
    pub prompt_ids: Vec<u32>,
    /// tokenizer (absent only when the model has none and ids were given)
    pub tokenizer: Option<Tokenizer>,
    /// generation options
    pub opts: GenerateOptions,
}

/// Tokenizes the prompt (or takes its ids) and builds the generation options.
pub fn prepare(info: ModelInfo, r: &Request) -> Result<Prepared> {
    let ModelInfo {
        config,
        tokenizer,
        chat,
    } = info;
    let tokenizer = match tokenizer {
        Ok(t) => Some(t),
        Err(e) if r.prompt_ids.is_some() => {
            tracing::warn!("no tokenizer ({e:#}); output is ids only");
            None
        }
        Err(e) => return Err(e),
    };
    let prompt_ids = match (&r.prompt_ids, &tokenizer) {
        (Some(ids), _) => ids.clone(),
        (None, Some(tok)) if r.chat => {
            let tpl = chat?.context("the model has no chat template")?;
            // the prompt is the message's plain text, as `loip api` tokenizes it
            tpl.encode(tok, &[ChatMessage::new("user", r.prompt.clone())], true)?
        }
        (None, Some(tok)) => tok.encode(&r.prompt, true)?,
        (None, None) => bail!("no tokenizer"),
    };
    let opts = options(&config, &prompt_ids, &r.sampling)?;
    Ok(Prepared {
        prompt_ids,
        tokenizer,
        opts,
    })
}

/// Checks `prompt_ids` against the vocabulary and builds the generation options (the same
/// as `loip api`'s, so both run the same request the same way).
pub fn options(
    config: &loip_model::ModelConfig,
    prompt_ids: &[u32],
    sampling: &Sampling,
) -> Result<GenerateOptions> {
    Ok(loip_server::options::generate_options(
        config, prompt_ids, sampling,
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
    /// A printer for `tok`'s tokens (ids in brackets without one).
    pub fn new(tok: Option<&'t Tokenizer>, stops: Vec<String>, quiet: bool) -> Self {
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
