//! The server's state ([`App`]): the model, its tokenizer and template, limits, the queue,
//! and what the handlers ask of it. Below the router, the handlers and the middleware.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use loip_engine::speculate::SpecOptions;
use loip_model::chat::ChatTemplate;
use loip_model::tokenizer::Tokenizer;
use loip_model::ModelConfig;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;

use crate::backend::Backend;
use crate::error::ApiError;
use crate::serving::Speculation;
use crate::{ServedModel, ServerConfig};

/// What the server keeps of an API key: its SHA-256 digest.
pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The server's state: the model, its tokenizer and template, limits, and the queue.
pub(crate) struct App {
    pub(crate) name: String,
    /// other ids a request's `model` may name
    pub(crate) aliases: Vec<String>,
    pub(crate) created: u64, // unix seconds
    pub(crate) config: ModelConfig,
    pub(crate) tokenizer: Result<Tokenizer, String>,
    pub(crate) chat: Result<ChatTemplate, String>,
    pub(crate) backend: Arc<Backend>,
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) parallel: usize,
    /// requests past parsing that have no generation place yet
    pub(crate) waiting: AtomicUsize,
    /// most requests `waiting` at once; one more is 429
    pub(crate) max_queue: usize,
    pub(crate) max_prompt: usize,       // tokens
    pub(crate) max_tokens_limit: usize, // tokens
    pub(crate) context: usize,          // tokens: one request's prompt + max_tokens
    /// SHA-256 of the API key `/v1/*` requires, if any
    pub(crate) api_key: Option<[u8; 32]>,
    /// the origin `--cors` allows, if any
    pub(crate) cors: Option<axum::http::HeaderValue>,
    pub(crate) body_timeout: Duration,
    /// most text one prompt may have before tokenizing: `--max-prompt` tokens of the longest
    /// spelling in the vocabulary, doubled (a normalizer may shorten text)  // bytes
    pub(crate) max_prompt_bytes: usize,
    /// how requests speculate: the source of those without a `speculate` field, and the
    /// draft length of all
    pub(crate) speculation: Speculation,
    /// `response_format` and `grammar`: compiled grammars over the tokenizer's vocabulary
    pub(crate) grammars: crate::grammar::Grammars,
    /// `/slots`: what each generation place is doing
    pub(crate) slots: crate::slots::Slots,
}

impl App {
    pub(crate) fn new(cfg: &ServerConfig, model: ServedModel, backend: Arc<Backend>) -> App {
        crate::metrics::init();
        let vocab = model.config.vocab_size;
        let tokenizer = model
            .tokenizer
            .ok_or_else(|| "the model has no tokenizer".to_string());
        let chat = model
            .chat
            .ok_or_else(|| "the model has no chat template".to_string());
        let longest = tokenizer.as_ref().map_or(1, |t| {
            (0..u32::try_from(t.vocab_size()).unwrap_or(u32::MAX))
                .filter_map(|id| t.id_to_token(id))
                .map(|s| s.len())
                .max()
                .unwrap_or(1)
        });
        App {
            name: cfg.name.clone(),
            aliases: cfg.aliases.clone(),
            created: unix_now(),
            config: model.config,
            tokenizer,
            chat,
            backend,
            permits: Arc::new(Semaphore::new(cfg.parallel)),
            parallel: cfg.parallel,
            waiting: AtomicUsize::new(0),
            max_queue: cfg.max_queue,
            max_prompt: cfg.max_prompt,
            max_tokens_limit: cfg.max_tokens_limit,
            context: cfg.context,
            speculation: Speculation {
                source: cfg.speculate,
                opts: SpecOptions {
                    k_max: cfg.speculate_k,
                    ..SpecOptions::default()
                },
            },
            grammars: crate::grammar::Grammars::new(vocab),
            slots: crate::slots::Slots::new(cfg.parallel, cfg.context),
            api_key: cfg.api_key.as_deref().map(key_digest),
            cors: cfg.cors.as_deref().and_then(|o| o.parse().ok()),
            body_timeout: cfg.limits.body_timeout,
            max_prompt_bytes: cfg
                .max_prompt
                .saturating_mul(longest.max(1))
                .saturating_mul(2),
        }
    }
    /// Whether `id` names the served model (its name or an alias).
    pub(crate) fn serves(&self, id: &str) -> bool {
        id == self.name || self.aliases.iter().any(|a| a == id)
    }

    /// The served model as `/v1/models` lists it, under `id`.
    pub(crate) fn model_entry(&self, id: &str) -> Value {
        json!({"id": id, "object": "model", "created": self.created, "owned_by": "loip",
               "context_length": self.context, "max_prompt_tokens": self.max_prompt,
               "max_completion_tokens": self.max_tokens_limit,
               "placement": self.backend.describe()})
    }

    /// The model's vocabulary.
    pub(crate) fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    pub(crate) fn tokenizer(&self) -> Result<&Tokenizer, ApiError> {
        self.tokenizer
            .as_ref()
            .map_err(|e| ApiError::bad(format!("{e}; send the prompt as token ids")))
    }

    /// Refuses text too long for `--max-prompt` tokens without tokenizing it.
    pub(crate) fn check_text(&self, bytes: usize) -> Result<(), ApiError> {
        if bytes > self.max_prompt_bytes {
            return Err(ApiError::bad(format!(
                "the prompt has {bytes} bytes of text, more than {} tokens (--max-prompt) can hold",
                self.max_prompt
            )));
        }
        Ok(())
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
