//! The OpenAI-compatible routes over one [`App`]: health, models, completions and chat
//! completions (with `stream: true`, server-sent events: one `data: {chunk}` per piece of
//! text, then `data: [DONE]`).
//!
//! Invariants:
//! - A request runs what `loip generate` runs for the same prompt and options: the same
//!   tokenization (`encode(text, true)`; chat messages through [`ChatTemplate::encode`] with
//!   the generation prompt), the same [`generate_options`], the same generation loop and
//!   engine. Greedy output is therefore identical to `loip generate` (lossless).
//! - The generation loop blocks: it runs on tokio's blocking pool, never on an async worker,
//!   at most `parallel` at once; further requests wait for a permit in arrival order.
//! - Every client mistake is a JSON `{"error": {...}}` with a 4xx status, checked before any
//!   generation starts; nothing a client sends panics the server. Engine failures are 500, a
//!   lost cluster device (or a stopped pipeline) 503; neither names files or addresses.
//! - Chat message contents are plain text: only the template's own text can make control
//!   tokens; a role is one of [`ROLES`] (checked, with the contents' size, before anything
//!   is tokenized), so a role cannot spell one either.
//! - At most `max_queue` requests wait (tokenizing, or for a generation's place) at once;
//!   one more is answered 429 with `Retry-After` at once; while the device is under memory
//!   pressure with nothing left to shed ([`loip_runtime::memory::pressure::exhausted`]), a
//!   new request is answered 503 with `Retry-After` (the running ones go on).
//! - `/health` names devices, addresses and failure reasons only to a client that gives the
//!   API key (or when the server has none); `/metrics` needs the key like `/v1/*`.
//! - A prompt's size is checked before it is tokenized: text longer than `max_prompt` tokens
//!   of the vocabulary's longest spelling could hold (doubled) is refused unread.
//! - A client that goes away stops its generation at the next token, streaming or not, and a
//!   request still queued for a permit never starts.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use loip_engine::{Flow, StopReason, TokenLogprob};
use loip_model::chat::{ChatError, ChatMessage};

use crate::tool_stream::{delta_json, Delta};
use crate::tools::{self, Tools};
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use crate::backend::{BackendError, Health};
use crate::http;
use crate::logprobs::Logprobs;
use crate::options::{generate_options, Sampling};
use crate::serving::Speculation;
pub(crate) use crate::state::{unix_now, App};
use crate::text::TextStream;
use crate::wire::{
    content_text, fresh_seed, parse_request, request_id, stop_strings, token_ids, usage, ApiError,
    ApiRequest, Finished, InMessage, Job, Kind, Meta, MAX_BODY,
};
use loip_runtime::coordinator::DeviceHealth;

/// The routes over a shared [`App`].
pub(crate) fn router(app: Arc<App>) -> Router {
    let v1 = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(crate::tokens::model))
        .route("/tokenize", post(crate::tokens::tokenize))
        .route("/detokenize", post(crate::tokens::detokenize))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/metrics", get(metrics_text))
        .route("/slots", get(slots))
        .route_layer(axum::middleware::from_fn_with_state(
            app.clone(),
            http::require_key,
        ));
    Router::new()
        .route("/health", get(health))
        .merge(crate::dashboard::routes(app.clone()))
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            http::cors,
        ))
        .layer(axum::middleware::from_fn(http::log_request))
        .with_state(app)
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

/// The roles a chat message may have.
const ROLES: &[&str] = &["system", "user", "assistant", "tool", "developer"];

/// A device as `/health` shows it: with its name, address and failure reason only when
/// `full` (the client gave the API key, or the server has none).
pub(crate) fn device_json(d: &DeviceHealth, full: bool) -> Value {
    if full {
        json!({"name": d.endpoint.name, "addr": d.endpoint.addr, "alive": d.alive,
               "reason": d.reason})
    } else {
        json!({"alive": d.alive})
    }
}

async fn health(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let full = app
        .api_key
        .as_ref()
        .is_none_or(|digest| http::key_given(digest, &headers));
    let busy = app.parallel - app.permits.available_permits().min(app.parallel);
    let (status, devices) = match app.backend.health() {
        Health::Ready => (StatusCode::OK, None),
        Health::Serving(st) => {
            let body = json!({
                "status": "ok",
                "model": app.name,
                "generating": busy,
                "parallel": app.parallel,
                "scheduler": {"running": st.running, "waiting": st.queued,
                              "kv_used_bytes": st.kv_used, "kv_reserved_bytes": st.kv_reserved,
                              "kv_budget_bytes": (st.kv_budget != u64::MAX).then_some(st.kv_budget),
                              "last_batch": st.last_batch, "steps": st.steps},
                "devices": null,
                "memory": loip_runtime::memory::report(),
            });
            return (StatusCode::OK, Json(body)).into_response();
        }
        Health::Replanning => {
            // a re-plan holds the session for seconds: /health does not wait for it
            let body = json!({"status": "replanning", "model": app.name});
            return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
        }
        Health::Devices(h) => {
            let ok = h.iter().all(|d| d.alive);
            let devices: Vec<Value> = h.iter().map(|d| device_json(d, full)).collect();
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

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let backend = app.backend.clone();
    // The session's lock is only tried, but reading it is still blocking work.
    let devices = tokio::task::spawn_blocking(move || backend.device_stats())
        .await
        .unwrap_or_default();
    crate::metrics::cluster_devices(&devices);
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::render(),
    )
        .into_response()
}

/// `GET /slots`: what each generation place is doing ([`crate::slots`]).
async fn slots(State(app): State<Arc<App>>) -> Json<Value> {
    Json(app.slots.json())
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [app.model_entry(&app.name)]}))
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

/// A request's place in the queue (tokenizing, or waiting for a generation's place); given
/// back when dropped.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl App {
    /// Requests waiting now (tests).
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Takes a generation's place, as a request does (tests).
    #[cfg(test)]
    pub(crate) async fn take_place(&self) -> Option<OwnedSemaphorePermit> {
        self.permits.clone().acquire_owned().await.ok()
    }

    /// A place in the queue, or 429 when `max_queue` requests wait already (503 while the
    /// device is under memory pressure with nothing left to shed).
    fn enqueue(&self) -> Result<Queued<'_>, ApiError> {
        if loip_runtime::memory::pressure::exhausted() {
            return Err(ApiError::under_pressure());
        }
        self.waiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_queue).then_some(n + 1)
            })
            .map_err(|n| {
                ApiError::busy(format!(
                    "the server is busy: {n} requests wait already (--max-queue); retry later"
                ))
            })?;
        Ok(Queued(&self.waiting))
    }
}

/// Checks, queues and runs one request.
async fn handle(app: Arc<App>, kind: Kind, req: Request) -> Result<Response, ApiError> {
    let body = http::read_body(req, app.body_timeout).await?;
    let req = parse_request(&body)?;
    drop(body);
    let queued_app = app.clone();
    let queued = queued_app.enqueue()?;
    // Tokenizing a long prompt takes a while: off the async workers too.
    let checker = app.clone();
    let job = tokio::task::spawn_blocking(move || checker.job(kind, req))
        .await
        .map_err(ApiError::from_join)??;
    // all `n` places at once (one at a time, two requests could each hold a part)
    let places = u32::try_from(job.n).unwrap_or(u32::MAX);
    let permit = app.permits.clone().acquire_many_owned(places).await;
    let permit = Arc::new(permit.map_err(|_| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        )
    })?);
    drop(queued);
    let meta = Meta {
        kind,
        id: request_id(kind),
        created: unix_now(),
        model: app.name.clone(),
        seed: job.seed,
    };
    if job.stream {
        return Ok(stream(app, job, Arc::new(meta), permit));
    }
    let gone = Arc::new(AtomicBool::new(false));
    let _cancel = CancelOnDrop(gone.clone());
    let job = Arc::new(job);
    let tasks: Vec<_> = (0..job.n)
        .map(|i| {
            let (app, job, permit, gone) = (app.clone(), job.clone(), permit.clone(), gone.clone());
            let id = meta.id.clone();
            tokio::task::spawn_blocking(move || {
                let _permit = permit;
                let done = app.run(&job.choice(i), &mut |_, _| !gone.load(Ordering::Relaxed));
                if let (true, Ok(f)) = (gone.load(Ordering::Relaxed), &done) {
                    log_gone(&id, f);
                }
                done
            })
        })
        .collect();
    let mut done = Vec::with_capacity(tasks.len());
    for t in tasks {
        done.push(t.await.map_err(ApiError::from_join)??);
    }
    let mut resp = Json(meta.full(&job, &done)).into_response();
    resp.extensions_mut().insert(http::Tokens {
        prompt: job.prompt_ids.len(),
        completion: done.iter().map(|f| f.new_ids.len()).sum(),
    });
    Ok(resp)
}

/// Streams `job`'s `n` choices as server-sent events (each chunk names its choice); the
/// generations stop when the client goes away. After the last choice's end: the usage chunk
/// when asked for, then `[DONE]`.
fn stream(app: Arc<App>, job: Job, meta: Arc<Meta>, permit: Arc<OwnedSemaphorePermit>) -> Response {
    let (tx, rx) = mpsc::unbounded_channel::<String>();
    let left = Arc::new(AtomicUsize::new(job.n));
    let completion = Arc::new(AtomicUsize::new(0));
    let job = Arc::new(job);
    for i in 0..job.n {
        let (app, job, meta, permit) = (app.clone(), job.clone(), meta.clone(), permit.clone());
        let (tx, left, completion) = (tx.clone(), left.clone(), completion.clone());
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            if meta.kind == Kind::Chat {
                let _ = tx.send(meta.role_chunk(i).to_string());
            }
            // with tools, the answer's text goes through the calls' reader: content, then
            // each call's name and its arguments as they come
            let mut calls = job.tools.as_ref().map(|t| t.stream(&call_ids()));
            let send_calls = |deltas: Vec<Delta>, mut logprobs: Value| {
                for d in deltas {
                    let lps = std::mem::take(&mut logprobs);
                    let chunk = meta.delta_chunk(i, delta_json(&d), lps);
                    if tx.send(chunk.to_string()).is_err() {
                        return false;
                    }
                }
                // log-probabilities of tokens whose text is held back go out alone
                logprobs.is_null()
                    || tx
                        .send(meta.chunk(i, "", None, logprobs).to_string())
                        .is_ok()
            };
            let done = app.run(&job.choice(i), &mut |piece, logprobs| {
                if piece.is_empty() && logprobs.is_null() {
                    return !tx.is_closed();
                }
                match calls.as_mut() {
                    Some(c) => send_calls(c.push(piece), logprobs),
                    None => tx
                        .send(meta.chunk(i, piece, None, logprobs).to_string())
                        .is_ok(),
                }
            });
            match done {
                Ok(f) if tx.is_closed() => log_gone(&meta.id, &f),
                Ok(f) => {
                    completion.fetch_add(f.new_ids.len(), Ordering::Relaxed);
                    if let Some(c) = calls.as_mut() {
                        send_calls(c.finish(), Value::Null);
                    }
                    let last = meta.chunk(i, "", Some(f.finish_reason), Value::Null);
                    let _ = tx.send(last.to_string());
                }
                Err(e) => {
                    let _ = tx.send(e.body().to_string());
                }
            }
            if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                if job.include_usage {
                    let done = completion.load(Ordering::Relaxed);
                    let usage = usage(job.prompt_ids.len(), done);
                    let _ = tx.send(meta.usage_chunk(usage).to_string());
                }
                let _ = tx.send("[DONE]".to_string());
            }
        });
    }
    drop(tx);
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
    fn job(&self, kind: Kind, mut r: ApiRequest) -> Result<Job, ApiError> {
        r.refuse_unsupported()?;
        if let Some(m) = &r.model {
            if !self.serves(m) {
                return Err(ApiError::model_not_found(m, &self.name));
            }
        }
        let choices = match r.n.unwrap_or(1) {
            n @ 1.. if n <= self.parallel as u64 => n as usize,
            n => {
                return Err(ApiError::bad(format!(
                    "n must be from 1 to {} (--parallel), got {n}",
                    self.parallel
                )))
            }
        };
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
        let stops = stop_strings(r.stop.take())?;
        let mut shaping = r.shaping(kind, self.config.vocab_size)?;
        let mut speculate = r.speculation(self.speculation.source)?;
        let tools = match kind {
            Kind::Chat => Tools::from_request(r.tools.as_ref(), r.tool_choice.as_ref())?,
            Kind::Completion => {
                let asks = |v: &Option<Value>| v.as_ref().is_some_and(|v| !is_neutral_tool(v));
                if asks(&r.tools) || asks(&r.tool_choice) {
                    return Err(ApiError::bad(
                        "`tools` and `tool_choice` are chat fields (/v1/chat/completions)",
                    ));
                }
                None
            }
        };
        let mut ask = r.grammar_ask()?;
        if let Some(t) = &tools {
            let template = self.chat.as_ref().map_err(|e| ApiError::bad(e.clone()))?;
            if !template.supports_tools() {
                return Err(ApiError::bad(
                    "`tools`: this model's chat template does not describe tools",
                ));
            }
            if let Some(forced) = t.forced(template.tool_call_tags()) {
                if ask.is_some() {
                    return Err(ApiError::bad(
                        "a forced `tool_choice` cannot be combined with `response_format` or \
                         `grammar`",
                    ));
                }
                ask = Some((forced, "tools"));
            }
        }
        if let Some((ask, field)) = ask {
            let tok = self.tokenizer.as_ref().map_err(|e| {
                ApiError::bad(format!("`{field}` needs the model's tokenizer: {e}"))
            })?;
            shaping.constraint = Some(self.grammars.constraint(tok, &ask, field)?);
            // a constrained step samples from the masked logits: no drafts to check
            speculate = loip_engine::Speculate::Off;
        }
        let prompt_ids = match kind {
            Kind::Completion => self.completion_ids(r.prompt)?,
            Kind::Chat => self.chat_ids(r.messages, tools.as_ref())?,
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
        let seed = r.seed.unwrap_or_else(fresh_seed);
        let s = Sampling {
            max_tokens,
            temperature: temperature as f32,
            top_k: r
                .top_k
                .map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX)),
            top_p: top_p as f32,
            seed,
            ignore_eos: r.ignore_eos.unwrap_or(false),
            min_tokens: r
                .min_tokens
                .map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX)),
        };
        let opts = generate_options(&self.config, &prompt_ids, &s)
            .map_err(|e| ApiError::bad(e.to_string()))?;
        Ok(Job {
            n: choices,
            kind,
            prompt_ids,
            seed,
            shaping,
            speculate,
            tools: tools.map(Arc::new),
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
    fn chat_ids(
        &self,
        messages: Option<Vec<InMessage>>,
        tools: Option<&Tools>,
    ) -> Result<Vec<u32>, ApiError> {
        let messages = messages.ok_or_else(|| ApiError::bad("`messages` is required"))?;
        if messages.is_empty() {
            return Err(ApiError::bad("`messages` is empty"));
        }
        let messages = messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                if !ROLES.contains(&m.role.as_str()) {
                    return Err(ApiError::bad(format!(
                        "messages[{i}].role must be one of {}",
                        ROLES.join(", ")
                    )));
                }
                let text = |field: &str, v: Option<Value>| match v {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::String(s)) => Ok(Some(s)),
                    Some(_) => Err(ApiError::bad(format!(
                        "messages[{i}].{field} must be a string"
                    ))),
                };
                let tool_calls = match m.tool_calls {
                    None | Some(Value::Null) => None,
                    Some(Value::Array(a)) if a.is_empty() => None,
                    Some(c) if m.role == "assistant" => Some(tools::calls_for_template(&c, i)?),
                    Some(_) => {
                        return Err(ApiError::bad(format!(
                            "messages[{i}].tool_calls: only assistant messages have tool calls"
                        )))
                    }
                };
                Ok(ChatMessage {
                    role: m.role,
                    content: content_text(m.content)
                        .map_err(|e| ApiError::bad(format!("messages[{i}].content: {e}")))?,
                    tool_calls,
                    tool_call_id: text("tool_call_id", m.tool_call_id)?,
                    name: text("name", m.name)?,
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        let template = self.chat.as_ref().map_err(|e| ApiError::bad(e.clone()))?;
        let described = tools.map_or(0, |t| t.list.to_string().len());
        self.check_text(
            messages
                .iter()
                .map(|m| {
                    m.content.len()
                        + m.role.len()
                        + m.tool_calls.as_ref().map_or(0, |c| c.to_string().len())
                })
                .sum::<usize>()
                + described,
        )?;
        let tok = self.tokenizer()?;
        let list = tools.map(|t| &t.list);
        template
            .encode_tools(tok, &messages, list, true)
            .map_err(|e| match e {
                ChatError::Tokenize(e) => ApiError::bad(format!("tokenizing the prompt: {e}")),
                e => ApiError::bad(format!("the chat template refused the messages: {e}")),
            })
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
    /// empty) with, for a streamed request that asked for them, the log-probabilities of
    /// the tokens not yet sent (`null` otherwise), and returns `false` when nobody listens
    /// any more, which stops the generation.
    fn run(
        &self,
        job: &Job,
        emit: &mut dyn FnMut(&str, Value) -> bool,
    ) -> Result<Finished, ApiError> {
        let tok = self.tokenizer.as_ref().ok();
        let mut text = TextStream::new(tok, &job.stops);
        let mut chunk_logprobs = Logprobs::new(job.kind, tok);
        let mut all: Vec<TokenLogprob> = Vec::new();
        let mut pending: Vec<TokenLogprob> = Vec::new(); // streamed: not yet sent
        let t0 = std::time::Instant::now();
        let mut last: Option<std::time::Instant> = None;
        // `emit("", null)` asks whether anybody listens: also while the request waits for
        // its first token, so that a client gone from the queue frees its place.
        let emit = std::cell::RefCell::new(emit);
        let slot = self.slots.take(crate::slots::Task {
            id: job.opts.sampling.seed,
            prompt_tokens: job.prompt_ids.len(),
            max_tokens: job.opts.max_tokens,
            temperature: job.opts.sampling.temperature,
            constrained: job.shaping.constraint.is_some(),
            tools: job.tools.is_some(),
        });
        let mut on_token = |id: u32, lp: Option<&TokenLogprob>| {
            slot.decoded();
            let now = std::time::Instant::now();
            match last {
                None => crate::metrics::first_token((now - t0).as_secs_f64()),
                Some(l) => crate::metrics::inter_token((now - l).as_secs_f64()),
            }
            last = Some(now);
            if let Some(lp) = lp {
                all.push(lp.clone());
                if job.stream {
                    pending.push(lp.clone());
                }
            }
            let (piece, hit_stop) = text.push(id);
            let lps = if piece.is_empty() || pending.is_empty() {
                Value::Null
            } else {
                chunk_logprobs.object(&std::mem::take(&mut pending))
            };
            if !(*emit.borrow_mut())(&piece, lps) || hit_stop {
                Flow::Stop
            } else {
                Flow::Continue
            }
        };
        let mut alive = || (*emit.borrow_mut())("", Value::Null);
        let spec = Speculation {
            source: job.speculate,
            opts: self.speculation.opts.clone(),
        };
        let out = self
            .backend
            .generate_shaped(
                &job.prompt_ids,
                &job.opts,
                &job.shaping,
                &spec,
                &mut on_token,
                &mut alive,
            )
            .map_err(|e| match e {
                BackendError::Cluster(e) => ApiError::from_cluster(e),
                BackendError::Engine(e) => ApiError::from_engine(e),
                BackendError::Batch(e) => ApiError::from_batch(e),
            })?;
        crate::metrics::request_done(job.prompt_ids.len(), out.new_ids.len());
        let (rest, text) = text.finish();
        let lps = if pending.is_empty() {
            Value::Null
        } else {
            chunk_logprobs.object(&pending)
        };
        (*emit.borrow_mut())(&rest, lps);
        let found = job.tools.as_ref().and_then(|t| t.parse(&text, &call_ids()));
        let (text, tool_calls) = match found {
            Some((before, calls)) => (before.unwrap_or_default(), Some(calls)),
            None => (text, None),
        };
        Ok(Finished {
            text,
            new_ids: out.new_ids,
            finish_reason: match out.stop {
                _ if tool_calls.is_some() => "tool_calls",
                StopReason::Length => "length",
                _ => "stop",
            },
            tool_calls,
            logprobs: job
                .shaping
                .logprobs
                .map(|_| Logprobs::new(job.kind, tok).object(&all)),
        })
    }
}

/// A request's part of its call ids ([`crate::tool_stream::call_id`]): fresh each time.
fn call_ids() -> String {
    crate::tool_stream::request_part(fresh_seed())
}

/// A `tools` or `tool_choice` value that asks for nothing (`[]`, `"none"`, `null`).
fn is_neutral_tool(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::String(s) => s == "none",
        _ => false,
    }
}
