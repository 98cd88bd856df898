//! The serving seam of loip: an OpenAI-compatible HTTP API over one [`Backend`].
//!
//! - [`app`]: the router and handlers, request validation from raw JSON to a checked job, SSE;
//! - [`options`]: a request's sampling fields to the engine's options (shared with the CLI);
//! - `logprobs`: token log-probabilities in the OpenAI shapes;
//! - [`wire`]: the OpenAI shapes and the one error type, mapped to status codes;
//! - [`http`]: connections, header and body timeouts, body limits, the API key;
//! - [`backend`]: what runs the forward passes (this machine, slice files, or a cluster);
//! - [`metrics`]: `GET /metrics` (Prometheus text);
//! - [`serving`]: the one-device batched serving loop (continuous batching);
//! - `tokens`: `/tokenize`, `/detokenize` and `/v1/models/{id}`.
//!
//! Invariants: nothing a client sends panics the server or is answered with a 5xx; error
//! bodies name no file or address; a greedy request gives exactly the tokens of the
//! single-device engine (see [`app`]).

#![deny(missing_docs)]

mod app;
pub mod backend;
mod dashboard;
mod error;
mod grammar;
pub mod http;
mod logprobs;
mod metrics;
pub mod options;
pub mod serving;
mod slots;
mod state;
mod stats;
mod text;
mod tokens;
mod tool_stream;
mod tools;
mod wire;

#[cfg(test)]
mod tests;

use std::future::Future;
use std::sync::Arc;

use loip_model::chat::ChatTemplate;
use loip_model::tokenizer::Tokenizer;
use loip_model::ModelConfig;

pub use backend::{Backend, BackendError, ClusterServing};
pub use http::Limits;

/// Limits and identity of a server (no command-line types).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// the model id the API reports
    pub name: String,
    /// other ids a request's `model` may name (any other is 404 `model_not_found`)
    pub aliases: Vec<String>,
    /// generations run at once; further requests wait in a queue
    pub parallel: usize,
    /// most requests waiting in that queue (tokenizing included); one more is answered 429
    pub max_queue: usize,
    /// longest prompt accepted  // tokens
    pub max_prompt: usize,
    /// largest `max_tokens` a request may ask for; also what a request without one gets
    pub max_tokens_limit: usize,
    /// one request's prompt + max_tokens  // tokens
    pub context: usize,
    /// the key `/v1/*` requires as `Authorization: Bearer KEY`, if any
    pub api_key: Option<String>,
    /// an origin browsers may call the API from (`*` for any), if any
    pub cors: Option<String>,
    /// connections and timeouts
    pub limits: Limits,
    /// the speculation of a request without a `speculate` field (prompt lookup, or off)
    pub speculate: loip_engine::Speculate,
    /// most drafts a speculative step verifies (at most [`serving::MAX_DRAFTS`])
    pub speculate_k: usize,
}

/// What requests need besides the weights.
pub struct ServedModel {
    /// hyper-parameters (vocabulary, end-of-sequence ids)
    pub config: ModelConfig,
    /// the tokenizer; without one only token-id prompts are accepted
    pub tokenizer: Option<Tokenizer>,
    /// the chat template; without one chat requests are refused
    pub chat: Option<ChatTemplate>,
}

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The configuration is unusable.
    #[error("{0}")]
    Config(String),
    /// The runtime could not start.
    #[error("starting the HTTP runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The address could not be bound.
    #[error("listening on {addr}: {source}")]
    Bind {
        /// the address asked for
        addr: String,
        /// the OS error
        #[source]
        source: std::io::Error,
    },
}

/// Parses and checks a request body as `/v1/completions` (or, with `chat`, the chat
/// endpoint) does before any model work: the JSON shape, unknown and unsupported fields,
/// `stop`, prompt ids or message contents, penalties, bias and log-probabilities against a
/// vocabulary of `vocab` tokens. `Err` holds the 4xx message. Never panics: the fuzz target
/// `api_request` feeds it.
pub fn check_request(body: &[u8], chat: bool, vocab: usize) -> Result<(), String> {
    wire::check_body(body, chat, vocab).map_err(|e| e.message().to_string())
}

/// Binds `listen`, prints `listening on http://ADDR` on stderr and serves until Ctrl-C or
/// SIGTERM; then shuts the backend down (a cluster's workers are told goodbye).
pub fn serve(
    listen: &str,
    cfg: ServerConfig,
    model: ServedModel,
    backend: Backend,
) -> Result<(), ServerError> {
    if cfg.parallel == 0 || cfg.max_prompt == 0 || cfg.max_tokens_limit == 0 {
        return Err(ServerError::Config(
            "parallel, max_prompt and max_tokens_limit must be at least 1".into(),
        ));
    }
    if cfg.limits.max_connections == 0
        || cfg.limits.max_connections_per_addr == 0
        || cfg.max_queue == 0
    {
        return Err(ServerError::Config(
            "max_connections, max_connections_per_addr and max_queue must be at least 1".into(),
        ));
    }
    if cfg.speculate_k > serving::MAX_DRAFTS || cfg.speculate == loip_engine::Speculate::Draft {
        return Err(ServerError::Config(format!(
            "requests speculate with prompt lookup of at most {} drafts a step (a draft model is \
             not served)",
            serving::MAX_DRAFTS
        )));
    }
    if let Some(o) = &cfg.cors {
        if o.parse::<axum::http::HeaderValue>().is_err() || o.is_empty() {
            return Err(ServerError::Config(format!(
                "the CORS origin {o:?} is not a valid header value"
            )));
        }
    }
    let backend = Arc::new(backend);
    let served = serve_until(listen, &cfg, model, backend.clone(), shutdown_signal());
    if let Ok(b) = Arc::try_unwrap(backend) {
        b.shutdown();
    }
    served
}

fn serve_until(
    listen: &str,
    cfg: &ServerConfig,
    model: ServedModel,
    backend: Arc<Backend>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("loip-api")
        .build()
        .map_err(ServerError::Runtime)?;
    let app = Arc::new(app::App::new(cfg, model, backend));
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|source| ServerError::Bind {
                addr: listen.to_string(),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| ServerError::Bind {
            addr: listen.to_string(),
            source,
        })?;
        eprintln!(
            "serving {} ({}), {} generations at once",
            app.name,
            app.backend.describe(),
            app.parallel
        );
        if app.api_key.is_some() {
            eprintln!("an API key is required on /v1/*");
        }
        eprintln!("listening on http://{addr}");
        http::serve(listener, app::router(app.clone()), cfg.limits, shutdown).await;
        Ok(())
    });
    drop(app);
    // Generations still running stop at their next token once their client is gone.
    rt.shutdown_timeout(std::time::Duration::from_secs(5));
    served
}

/// Resolves on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
    eprintln!("shutting down");
}
