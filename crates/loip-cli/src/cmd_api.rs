//! `loip api`: an OpenAI-compatible HTTP server for one model, run by this machine's engine
//! or, with `--cluster FILE`, by a cluster of workers.
//!
//! Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions` and
//! `POST /v1/chat/completions` (with `stream: true`, server-sent events: one `data: {chunk}`
//! per piece of text, then `data: [DONE]`).
//!
//! Invariants:
//! - A request runs what `loip generate` runs for the same prompt and options: the same
//!   tokenization (`encode(text, true)`; chat messages rendered with the model's template and
//!   the generation prompt), the same [`cmd_generate::options`], the same generation loop and
//!   engine. Greedy output is therefore identical to `loip generate` (lossless).
//! - The generation loop blocks: it runs on tokio's blocking pool, never on an async worker,
//!   at most `--parallel` at once; further requests wait for a permit in arrival order.
//! - Every client mistake is a JSON `{"error": {...}}` with a 4xx status, checked before any
//!   generation starts; nothing a client sends panics the server. Engine failures are 500, a
//!   lost cluster device (or a stopped pipeline) 503; neither names files or addresses.
//! - Chat message contents are plain text: only the template's own text can make control
//!   tokens ([`ChatTemplate::encode`]).
//! - A prompt's size is checked before it is tokenized: text longer than `--max-prompt`
//!   tokens of the vocabulary's longest spelling could hold is refused unread.
//! - A client that goes away stops its generation at the next token, streaming or not, and
//!   a request still queued for a permit never starts.
//! - Connections, header and body times, body sizes and the API key: see [`http`].

mod http;
mod text;
mod wire;

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args;
use loip_engine::{generate, Flow, Generator, Model, StopReason};
use loip_model::chat::{ChatError, ChatMessage, ChatTemplate};
use loip_model::tokenizer::Tokenizer;
use loip_model::{Checkpoint, ModelConfig};
use loip_plan::Pattern;
use loip_runtime::cluster_run::{generate_on, Session};
use loip_runtime::local::LocalModel;
use loip_runtime::LoaderKind;
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::cmd_generate::{self, PromptArgs};
use crate::cmd_serve::ClusterArgs;
use crate::model_load;
use text::TextStream;
use wire::{
    content_text, parse_request, request_id, stop_strings, token_ids, usage, ApiError, ApiRequest,
    Finished, InMessage, Job, Kind, Meta, MAX_BODY,
};

/// Arguments of `loip api`.
#[derive(Args, Debug)]
#[command(after_long_help = "\
Endpoints:
  GET  /health               ok and the model (with --cluster: each device's state; 503 when one is gone)
  GET  /v1/models            the served model
  POST /v1/completions       prompt: text or token ids; max_tokens, temperature, top_p, top_k,
                             seed, stop, stream, ignore_eos, min_tokens, return_token_ids
  POST /v1/chat/completions  messages [{role, content}] rendered with the model's chat template;
                             the same sampling fields

Greedy requests (temperature 0) give exactly the tokens of `loip generate`. Bad requests get
HTTP 400 with {\"error\": {\"message\", \"type\"}}, bodies over 1 MiB 413, unknown paths 404.
With an API key (--api-key, --api-key-file or LOIP_API_KEY), /v1/* needs
`Authorization: Bearer KEY` (401 otherwise); /health stays open.

Example:
  loip api --listen 127.0.0.1:8080 --model smollm2 &
  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 32}'")]
pub struct ApiArgs {
    /// Address to listen on; port 0 picks a free one. The bound address is printed on stderr
    /// as `listening on http://ADDR`.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Model: `smollm2`, an HF directory, or a GGUF file (with --cluster also a slice directory).
    #[arg(long, short = 'm', default_value = "smollm2")]
    pub model: String,
    /// Model id the API reports (default: the model's file or directory name).
    #[arg(long)]
    pub name: Option<String>,
    /// Generations run at once; further requests wait in a queue.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Longest prompt accepted, tokens (with --cluster it also sizes the working buffers).
    #[arg(long, default_value_t = 2048)]
    pub max_prompt: usize,
    /// Largest `max_tokens` a request may ask for; also the most a request without one gets.
    #[arg(long, default_value_t = 4096)]
    pub max_tokens_limit: usize,
    /// With --cluster: do not re-plan over the remaining devices when one fails (requests
    /// then fail with 503 until a restart).
    #[arg(long)]
    pub no_replan: bool,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Require `Authorization: Bearer KEY` on /v1/*. Visible in `ps`: prefer --api-key-file
    /// or the LOIP_API_KEY environment variable.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Read the API key from the first line of this file.
    #[arg(long, conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// Most HTTP connections open at once; one more is closed at once.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's headers; an idle keep-alive connection is
    /// closed after as long.
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// Seconds a client has to send a request's body.
    #[arg(long, default_value_t = 30)]
    pub body_timeout: u64,
    /// With --cluster or --mem: planned context, KV tokens held summed over the sequences in
    /// flight; it also bounds one request's prompt + max_tokens.
    #[arg(long, default_value_t = 4096)]
    pub context: u64,
    /// On this machine: a memory budget, e.g. `300MiB`; what does not fit is streamed from
    /// slice files (as `loip generate --mem`). The KV cache of all requests in flight shares
    /// what is left.
    #[arg(long)]
    pub mem: Option<String>,
    /// On this machine: which blocks to offload (auto, none, mlp, attn, all, alternate, plan;
    /// see `loip generate --help`). Anything but auto, or --mem, serves from slice files.
    #[arg(long, default_value = "auto")]
    pub offload_blocks: loip_runtime::local::OffloadRule,
    /// Loading path for offloaded blocks (on the workers with --cluster): direct or
    /// conventional.
    #[arg(long, default_value = "direct")]
    pub loader: LoaderKind,
    /// With --cluster: plan for this request pattern, sporadic or bursty.
    #[arg(long, default_value = "sporadic")]
    pub pattern: Pattern,
    /// With --cluster: sequences in flight for bursty traffic (default: number of devices).
    #[arg(long)]
    pub micro_batches: Option<u32>,
}

/// `loip api`: load the model (or bring the cluster up), then serve until Ctrl-C or SIGTERM.
pub fn run(a: ApiArgs) -> Result<()> {
    if a.parallel == 0 || a.max_prompt == 0 || a.max_tokens_limit == 0 {
        bail!("--parallel, --max-prompt and --max-tokens-limit must be at least 1");
    }
    if a.max_connections == 0 || a.header_timeout == 0 || a.body_timeout == 0 {
        bail!("--max-connections, --header-timeout and --body-timeout must be at least 1");
    }
    let key = http::api_key(a.api_key.as_deref(), a.api_key_file.as_deref())?;
    let limits = http::Limits {
        max_connections: a.max_connections,
        header_timeout: Duration::from_secs(a.header_timeout),
    };
    let name = a.name.clone().unwrap_or_else(|| default_name(&a.model));
    if a.cluster.cluster.is_some() {
        let (session, dir) = crate::cmd_serve::start(
            &a.model,
            &a.cluster,
            a.loader,
            a.pattern,
            a.micro_batches,
            a.context,
            a.max_prompt,
            false,
        )?;
        crate::cmd_serve::print_setup(&session);
        let info = match model_load::info(&dir.to_string_lossy()) {
            Ok(info) => info,
            Err(e) => {
                session.shutdown();
                return Err(e);
            }
        };
        let context = info
            .config
            .max_position_embeddings
            .min(usize::try_from(a.context).unwrap_or(usize::MAX));
        let session = Arc::new(Mutex::new(session));
        let app = App::new(
            &a,
            name,
            info,
            Engine::Cluster(session.clone()),
            context,
            key,
        );
        let served = serve_http(&a.listen, app, limits);
        // the last owner of the session says goodbye to the workers
        if let Ok(s) = Arc::try_unwrap(session) {
            s.into_inner().unwrap_or_else(|p| p.into_inner()).shutdown();
        }
        return served;
    }
    if a.mem.is_some() || a.offload_blocks != loip_runtime::local::OffloadRule::Auto {
        return run_sliced(&a, name, key, limits);
    }
    // The server lives until the process ends, so the checkpoint and the model bound to it are
    // leaked: the blocking generation threads share them as `'static`.
    let ckpt: &'static Checkpoint = Box::leak(Box::new(model_load::open(&a.model)?));
    let model: &'static Model<'static> = Box::leak(Box::new(Model::from_checkpoint(ckpt)?));
    let info = model_load::ModelInfo {
        config: ckpt.config.clone(),
        tokenizer: model_load::tokenizer(ckpt),
        chat: model_load::chat_template(ckpt),
    };
    let context = ckpt.config.max_position_embeddings;
    let app = App::new(&a, name, info, Engine::Local(model), context, key);
    serve_http(&a.listen, app, limits)
}

/// `loip api --mem …`: one device running from slice files under a memory budget.
fn run_sliced(a: &ApiArgs, name: String, key: Option<String>, limits: http::Limits) -> Result<()> {
    use loip_runtime::local::{LocalModel, LocalOptions};
    let dir = crate::cmd_split::slices_for(&a.model)?;
    let info = model_load::info(&dir.to_string_lossy())?;
    let context = info
        .config
        .max_position_embeddings
        .min(usize::try_from(a.context).unwrap_or(usize::MAX));
    let opts = LocalOptions {
        mem_budget: a.mem.as_deref().map(loip_plan::parse_bytes).transpose()?,
        rule: a.offload_blocks,
        loader: a.loader,
        overlap: true,
        context,
        max_step_tokens: a.max_prompt,
    };
    let model = LocalModel::open(&dir, &opts)?;
    let m = model.device.memory();
    eprintln!(
        "memory: budget {} B, resident {} B, slot {} B, working {} B, KV budget {} B",
        m.budget, m.resident, m.slot, m.working, m.kv_budget
    );
    let engine = Engine::Sliced(Arc::new(Mutex::new(model)));
    serve_http(
        &a.listen,
        App::new(a, name, info, engine, context, key),
        limits,
    )
}

/// The device of `loip api --mem`, shared step by step: each request's steps take the lock in
/// turn, so requests interleave token by token, each its own sequence in the device's cache.
struct SlicedBackend<'m> {
    model: &'m Mutex<LocalModel>,
}

impl loip_engine::generate::StepBackend for SlicedBackend<'_> {
    fn step(
        &mut self,
        seq: u64,
        ids: &[u32],
        start_pos: usize,
    ) -> Result<Vec<f32>, loip_engine::EngineError> {
        lock(self.model).step(seq, ids, start_pos)
    }
}

/// The model id for `model`: its file stem, or directory name.
fn default_name(model: &str) -> String {
    let p = Path::new(model.trim_end_matches('/'));
    let part = if p.is_dir() {
        p.file_name()
    } else {
        p.file_stem()
    };
    part.map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| model.to_string())
}

/// Binds `listen`, prints the address and serves `app` until a shutdown signal.
fn serve_http(listen: &str, app: App, limits: http::Limits) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("loip-api")
        .build()
        .context("starting the HTTP runtime")?;
    let served = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("listening on {listen}"))?;
        let addr = listener.local_addr()?;
        eprintln!(
            "serving {} ({}), {} generations at once",
            app.name,
            app.engine.describe(),
            app.parallel
        );
        if app.api_key.is_some() {
            eprintln!("an API key is required on /v1/*");
        }
        eprintln!("listening on http://{addr}");
        http::serve(listener, router(Arc::new(app)), limits, shutdown_signal()).await
    });
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

/// The routes over a shared [`App`].
fn router(app: Arc<App>) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            http::require_key,
        ));
    Router::new()
        .route("/health", get(health))
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(app)
}

/// What runs the forward passes.
enum Engine {
    /// this machine's in-memory engine; each request gets its own KV cache
    Local(&'static Model<'static>),
    /// a cluster; requests are concurrent sequences on its pipeline. Locked only to take the
    /// pipeline, to read the devices' health, and to re-plan when one is gone.
    Cluster(Arc<Mutex<Session>>),
    /// this machine, from slice files under a memory budget (`--mem`)
    Sliced(Arc<Mutex<LocalModel>>),
}

impl Engine {
    fn describe(&self) -> String {
        match self {
            Engine::Local(_) => "this machine".into(),
            Engine::Sliced(_) => "this machine, from slice files".into(),
            Engine::Cluster(s) => format!("a cluster of {} devices", lock(s).health().len()),
        }
    }
}

/// The server's state: the model, its tokenizer and template, limits, and the queue.
struct App {
    name: String,
    created: u64, // unix seconds
    config: ModelConfig,
    tokenizer: Result<Tokenizer, String>,
    chat: Result<ChatTemplate, String>,
    engine: Engine,
    permits: Arc<Semaphore>,
    parallel: usize,
    max_prompt: usize,       // tokens
    max_tokens_limit: usize, // tokens
    context: usize,          // tokens: one request's prompt + max_tokens
    /// keep a failed cluster as it is (`--no-replan`)
    no_replan: bool,
    /// SHA-256 of the API key `/v1/*` requires, if any
    api_key: Option<[u8; 32]>,
    body_timeout: Duration,
    /// most text one prompt may have before tokenizing: `--max-prompt` tokens of the longest
    /// spelling in the vocabulary, doubled (a normalizer may shorten text)  // bytes
    max_prompt_bytes: usize,
}

/// The session (or device), also after a thread panicked while holding it (its state stays
/// usable: every change to it is one call).
fn lock<T>(s: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// After a failed request: when a device is gone, re-plans over the remaining ones (as
/// `loip serve` does), so the next requests run again; the failed request still answers 503.
/// Several requests failing at once re-plan once: the others find every device alive.
fn replan_if_gone(session: &Mutex<Session>) {
    let mut s = lock(session);
    let gone = s.gone();
    if gone.is_empty() {
        return;
    }
    match s.replan() {
        Ok(left_out) => eprintln!(
            "loip api: {} gone; re-planned without {}",
            gone.join(", "),
            left_out.join(", ")
        ),
        Err(e) => eprintln!(
            "loip api: {} gone and the model does not fit the rest ({e}); requests will fail",
            gone.join(", ")
        ),
    }
}

impl App {
    fn new(
        a: &ApiArgs,
        name: String,
        info: model_load::ModelInfo,
        engine: Engine,
        context: usize,
        api_key: Option<String>,
    ) -> App {
        // what a client is told stays generic; the reason (with paths) is logged here
        let tokenizer = info.tokenizer.map_err(|e| {
            eprintln!("warning: no tokenizer ({e:#}); only token-id prompts are accepted");
            "the model has no tokenizer".to_string()
        });
        let chat = match info.chat {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err("the model has no chat template".to_string()),
            Err(e) => {
                eprintln!("warning: the model's chat template did not load: {e:#}");
                Err("the model's chat template did not load".to_string())
            }
        };
        let longest = tokenizer.as_ref().map_or(1, |t| {
            (0..u32::try_from(t.vocab_size()).unwrap_or(u32::MAX))
                .filter_map(|id| t.id_to_token(id))
                .map(|s| s.len())
                .max()
                .unwrap_or(1)
        });
        App {
            name,
            created: unix_now(),
            config: info.config,
            tokenizer,
            chat,
            engine,
            permits: Arc::new(Semaphore::new(a.parallel)),
            parallel: a.parallel,
            max_prompt: a.max_prompt,
            max_tokens_limit: a.max_tokens_limit,
            context,
            no_replan: a.no_replan,
            api_key: api_key.as_deref().map(http::key_digest),
            body_timeout: Duration::from_secs(a.body_timeout),
            max_prompt_bytes: a
                .max_prompt
                .saturating_mul(longest.max(1))
                .saturating_mul(2),
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no such endpoint: {method} {}", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}", uri.path()),
    )
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let busy = app.parallel - app.permits.available_permits().min(app.parallel);
    let (status, devices) = match &app.engine {
        Engine::Local(_) | Engine::Sliced(_) => (StatusCode::OK, None),
        Engine::Cluster(s) => {
            // a re-plan holds the session for seconds: do not wait for it here
            let Ok(session) = s.try_lock() else {
                let body = json!({"status": "replanning", "model": app.name});
                return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
            };
            let h = session.health();
            drop(session);
            let ok = h.iter().all(|d| d.alive);
            let devices: Vec<Value> = h
                .iter()
                .map(|d| {
                    json!({"name": d.endpoint.name, "addr": d.endpoint.addr,
                           "alive": d.alive, "reason": d.reason})
                })
                .collect();
            let status = if ok {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, Some(devices))
        }
    };
    let body = json!({
        "status": if status == StatusCode::OK { "ok" } else { "degraded" },
        "model": app.name,
        "generating": busy,
        "parallel": app.parallel,
        "devices": devices,
    });
    (status, Json(body)).into_response()
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{"id": app.name, "object": "model", "created": app.created, "owned_by": "loip",
                  "context_length": app.context}],
    }))
}

async fn completions(State(app): State<Arc<App>>, req: Request) -> Result<Response, ApiError> {
    handle(app, Kind::Completion, req).await
}

async fn chat_completions(State(app): State<Arc<App>>, req: Request) -> Result<Response, ApiError> {
    handle(app, Kind::Chat, req).await
}

/// Sets its flag when dropped: the handler's future is dropped when its client goes away.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Checks, queues and runs one request.
async fn handle(app: Arc<App>, kind: Kind, req: Request) -> Result<Response, ApiError> {
    let body = http::read_body(req, app.body_timeout).await?;
    let req = parse_request(&body)?;
    drop(body);
    // Tokenizing a long prompt takes a while: off the async workers too.
    let checker = app.clone();
    let job = tokio::task::spawn_blocking(move || checker.job(kind, req))
        .await
        .map_err(ApiError::from_join)??;
    let permit = app.permits.clone().acquire_owned().await.map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        )
    })?;
    let meta = Meta {
        kind,
        id: request_id(kind),
        created: unix_now(),
        model: app.name.clone(),
    };
    if job.stream {
        return Ok(stream(app, job, meta, permit));
    }
    let gone = Arc::new(AtomicBool::new(false));
    let _cancel = CancelOnDrop(gone.clone());
    let id = meta.id.clone();
    let (job, done) = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let done = app.run(&job, &mut |_| !gone.load(Ordering::Relaxed));
        if let (true, Ok(f)) = (gone.load(Ordering::Relaxed), &done) {
            log_gone(&id, f);
        }
        (job, done)
    })
    .await
    .map_err(ApiError::from_join)?;
    Ok(Json(meta.full(&job, &done?)).into_response())
}

/// Streams `job` as server-sent events; the generation stops when the client goes away.
fn stream(app: Arc<App>, job: Job, meta: Meta, permit: OwnedSemaphorePermit) -> Response {
    let (tx, rx) = mpsc::unbounded_channel::<String>();
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        if meta.kind == Kind::Chat {
            let _ = tx.send(meta.role_chunk().to_string());
        }
        let done = app.run(&job, &mut |piece| {
            if piece.is_empty() {
                return !tx.is_closed();
            }
            tx.send(meta.chunk(piece, None).to_string()).is_ok()
        });
        match done {
            Ok(f) if tx.is_closed() => log_gone(&meta.id, &f),
            Ok(f) => {
                let _ = tx.send(meta.chunk("", Some(f.finish_reason)).to_string());
                if job.include_usage {
                    let usage = usage(job.prompt_ids.len(), f.new_ids.len());
                    let _ = tx.send(meta.usage_chunk(usage).to_string());
                }
            }
            Err(e) => {
                let _ = tx.send(e.body().to_string());
            }
        }
        let _ = tx.send("[DONE]".to_string());
    });
    let events = futures_util::stream::unfold(rx, |mut rx| async move {
        let data = rx.recv().await?;
        Some((Ok::<_, Infallible>(Event::default().data(data)), rx))
    });
    Sse::new(events).into_response()
}

/// Logs a generation its client left.
fn log_gone(id: &str, f: &Finished) {
    eprintln!(
        "loip api: {id}: the client went away; stopped after {} tokens",
        f.new_ids.len()
    );
}

impl App {
    /// Checks a request and tokenizes its prompt (blocking).
    fn job(&self, kind: Kind, r: ApiRequest) -> Result<Job, ApiError> {
        if r.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad("only n = 1 is supported"));
        }
        let temperature = r.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::bad(format!(
                "temperature must be between 0 and 2, got {temperature}"
            )));
        }
        let top_p = r.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::bad(format!(
                "top_p must be in (0, 1], got {top_p}"
            )));
        }
        let stops = stop_strings(r.stop)?;
        let prompt_ids = match kind {
            Kind::Completion => self.completion_ids(r.prompt)?,
            Kind::Chat => self.chat_ids(r.messages)?,
        };
        let n = prompt_ids.len();
        if n > self.max_prompt {
            return Err(self.too_long(n));
        }
        if n >= self.context {
            return Err(ApiError::bad(format!(
                "the prompt has {n} tokens; the context limit is {} tokens",
                self.context
            )));
        }
        let max_tokens = match r.max_tokens.or(r.max_completion_tokens) {
            Some(m) if m > self.max_tokens_limit as u64 => {
                return Err(ApiError::bad(format!(
                    "max_tokens is {m}, more than the limit of {} (--max-tokens-limit)",
                    self.max_tokens_limit
                )))
            }
            Some(m) if n as u64 + m > self.context as u64 => {
                return Err(ApiError::bad(format!(
                    "the prompt ({n} tokens) plus max_tokens ({m}) exceeds the context limit of {} tokens",
                    self.context
                )))
            }
            Some(m) => m as usize,
            None => self.max_tokens_limit.min(self.context - n),
        };
        let p = PromptArgs {
            prompt: String::new(),
            prompt_ids: None,
            chat: false,
            max_tokens,
            temperature: temperature as f32,
            top_k: r
                .top_k
                .map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX)),
            top_p: top_p as f32,
            seed: r.seed.unwrap_or(0),
            stop: stops.clone(),
            ignore_eos: r.ignore_eos.unwrap_or(false),
            min_tokens: r
                .min_tokens
                .map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX)),
        };
        let opts = cmd_generate::options(&self.config, &prompt_ids, &p)
            .map_err(|e| ApiError::bad(format!("{e:#}")))?;
        Ok(Job {
            prompt_ids,
            opts,
            stops,
            stream: r.stream.unwrap_or(false),
            include_usage: r.stream_options.and_then(|o| o.include_usage) == Some(true),
            return_token_ids: r.return_token_ids.unwrap_or(false),
        })
    }

    /// `prompt`: a string, an array of token ids, or a one-element array of either.
    fn completion_ids(&self, prompt: Option<Value>) -> Result<Vec<u32>, ApiError> {
        const SHAPE: &str = "`prompt` must be a string or an array of token ids (one prompt)";
        match prompt {
            None | Some(Value::Null) => Err(ApiError::bad("`prompt` is required")),
            Some(Value::String(s)) => self.encode(&s),
            Some(Value::Array(items)) => match items.as_slice() {
                [] => Err(ApiError::bad("`prompt` is empty")),
                _ if items.len() > self.max_prompt => Err(self.too_long(items.len())),
                [Value::String(s)] => self.encode(s),
                [Value::Array(ids)] if ids.len() > self.max_prompt => Err(self.too_long(ids.len())),
                [Value::Array(ids)] => token_ids(ids),
                ids if ids.iter().all(Value::is_number) => token_ids(ids),
                _ => Err(ApiError::bad(SHAPE)),
            },
            Some(_) => Err(ApiError::bad(SHAPE)),
        }
    }

    /// `messages` rendered with the chat template (with the generation prompt), tokenized.
    fn chat_ids(&self, messages: Option<Vec<InMessage>>) -> Result<Vec<u32>, ApiError> {
        let messages = messages.ok_or_else(|| ApiError::bad("`messages` is required"))?;
        if messages.is_empty() {
            return Err(ApiError::bad("`messages` is empty"));
        }
        let messages = messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                Ok(ChatMessage {
                    role: m.role,
                    content: content_text(m.content)
                        .map_err(|e| ApiError::bad(format!("messages[{i}].content: {e}")))?,
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        let template = self.chat.as_ref().map_err(|e| ApiError::bad(e.clone()))?;
        self.check_text(messages.iter().map(|m| m.content.len()).sum())?;
        let tok = self.tokenizer()?;
        template.encode(tok, &messages, true).map_err(|e| match e {
            ChatError::Tokenize(e) => ApiError::bad(format!("tokenizing the prompt: {e}")),
            e => ApiError::bad(format!("the chat template refused the messages: {e}")),
        })
    }

    fn tokenizer(&self) -> Result<&Tokenizer, ApiError> {
        self.tokenizer
            .as_ref()
            .map_err(|e| ApiError::bad(format!("{e}; send the prompt as token ids")))
    }

    /// Refuses text too long for `--max-prompt` tokens without tokenizing it.
    fn check_text(&self, bytes: usize) -> Result<(), ApiError> {
        if bytes > self.max_prompt_bytes {
            return Err(ApiError::bad(format!(
                "the prompt has {bytes} bytes of text, more than {} tokens (--max-prompt) can hold",
                self.max_prompt
            )));
        }
        Ok(())
    }

    fn too_long(&self, n: usize) -> ApiError {
        ApiError::bad(format!(
            "the prompt has {n} tokens, more than the limit of {} (--max-prompt)",
            self.max_prompt
        ))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        let tok = self.tokenizer()?;
        self.check_text(text.len())?;
        tok.encode(text, true)
            .map_err(|e| ApiError::bad(format!("tokenizing the prompt: {e}")))
    }

    /// Runs `job` to its end (blocking). `emit` gets the text as it becomes final (possibly
    /// empty) and returns `false` when nobody listens any more, which stops the generation.
    fn run(&self, job: &Job, emit: &mut dyn FnMut(&str) -> bool) -> Result<Finished, ApiError> {
        let mut text = TextStream::new(self.tokenizer.as_ref().ok(), &job.stops);
        let mut on_token = |id: u32| {
            let (piece, hit_stop) = text.push(id);
            if !emit(&piece) || hit_stop {
                Flow::Stop
            } else {
                Flow::Continue
            }
        };
        let out = match &self.engine {
            Engine::Local(model) => {
                let mut gen = Generator::new(model, None);
                generate(&mut gen, 0, &job.prompt_ids, &job.opts, &mut on_token)
                    .map_err(ApiError::from_engine)?
            }
            Engine::Sliced(model) => {
                let seq = loip_runtime::coordinator::next_seq_id();
                let mut backend = SlicedBackend { model };
                let out = generate(&mut backend, seq, &job.prompt_ids, &job.opts, &mut on_token);
                lock(model).device.kv.remove(seq);
                out.map_err(ApiError::from_engine)?
            }
            Engine::Cluster(session) => {
                let pipe = lock(session).pipeline().clone();
                match generate_on(&pipe, &job.prompt_ids, &job.opts, &mut on_token) {
                    Ok(out) => out,
                    Err(e) => {
                        if !self.no_replan {
                            replan_if_gone(session);
                        }
                        return Err(ApiError::from_cluster(e));
                    }
                }
            }
        };
        let (rest, text) = text.finish();
        emit(&rest);
        Ok(Finished {
            text,
            new_ids: out.new_ids,
            finish_reason: match out.stop {
                StopReason::Length => "length",
                _ => "stop",
            },
        })
    }
}

#[cfg(test)]
mod tests;
