//! The OpenAI wire format: request bodies (parsed with errors naming the field), response and
//! stream-chunk shapes, and the error object every failure is sent as.
//!
//! Invariant: an error sent to a client says what the client did wrong, or that the server
//! failed; it never carries a file path, a device address or an internal error's text. Those
//! go to the server's log ([`ApiError::internal`], [`ApiError::from_cluster`], in
//! `error.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use loip_engine::sampling::MAX_TOP_LOGPROBS;
use loip_engine::{EngineError, GenerateOptions, Shaping, Speculate};
use serde::Deserialize;
use serde_json::{json, Value};

pub(crate) use crate::error::ApiError;
use crate::grammar::Ask;

/// Largest request body accepted; larger ones get 413.  // bytes
pub(crate) const MAX_BODY: usize = 1 << 20;
/// Most stop strings in one request.
const MAX_STOPS: usize = 16;

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

/// The body of a completion or chat request. A field this server does not know is refused
/// (400 naming it); a field it knows but does not implement is refused unless it has its
/// neutral value (see [`ApiRequest::refuse_unsupported`]); none is silently ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct ApiRequest {
    pub(crate) model: Option<String>,
    pub(crate) prompt: Option<Value>,
    pub(crate) messages: Option<Vec<InMessage>>,
    pub(crate) max_tokens: Option<u64>,
    pub(crate) max_completion_tokens: Option<u64>,
    pub(crate) temperature: Option<f64>,
    pub(crate) top_p: Option<f64>,
    pub(crate) top_k: Option<u64>,
    pub(crate) seed: Option<u64>,
    pub(crate) stop: Option<Value>,
    pub(crate) stream: Option<bool>,
    pub(crate) stream_options: Option<StreamOptions>,
    pub(crate) n: Option<u64>,
    /// extension: keep generating past end-of-sequence tokens
    pub(crate) ignore_eos: Option<bool>,
    /// extension: mask end-of-sequence tokens until this many were generated
    pub(crate) min_tokens: Option<u64>,
    /// extension: return the prompt's and the completion's token ids
    pub(crate) return_token_ids: Option<bool>,
    /// extension: speculative decoding, `"lookup"` or `"off"` (`"draft"` names a draft
    /// model, which this server does not serve); default: `loip api --speculate`
    pub(crate) speculate: Option<String>,
    /// completions: report this many alternatives' log-probabilities (0: the chosen token's
    /// only); chat: `true` to report them
    pub(crate) logprobs: Option<Value>,
    /// chat: this many alternatives with `logprobs: true`
    pub(crate) top_logprobs: Option<u64>,
    pub(crate) frequency_penalty: Option<f64>,
    pub(crate) presence_penalty: Option<f64>,
    /// extension (Hugging Face's): 1 is off
    pub(crate) repetition_penalty: Option<f64>,
    /// token id (as a string) to a bias added to its logit
    pub(crate) logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// accepted and ignored on purpose: it changes no output (OpenAI's end-user id)
    #[allow(dead_code)]
    pub(crate) user: Option<Value>,
    /// `{"type": "text" | "json_object" | "json_schema", ...}`: the output follows it
    pub(crate) response_format: Option<Value>,
    /// extension: a Lark grammar (`llguidance`'s dialect) the output follows
    pub(crate) grammar: Option<Value>,
    /// chat: functions the model may call, described to it by its chat template
    pub(crate) tools: Option<Value>,
    /// chat: `"none"`, `"auto"`, `"required"` or one named function
    pub(crate) tool_choice: Option<Value>,
    /// accepted and ignored on purpose: a model may write several calls in one answer, a
    /// forced call is always one
    #[allow(dead_code)]
    pub(crate) parallel_tool_calls: Option<Value>,
    // OpenAI fields known but not implemented: each is refused with a 400 naming it unless
    // it has its neutral value (absent, `null`, or the value that asks for nothing: `false`,
    // `0`, `{}`, `[]`, `"none"`, `{"type": "text"}`), see `refuse_unsupported`
    echo: Option<Value>,
    best_of: Option<Value>,
    suffix: Option<Value>,
    functions: Option<Value>,
    function_call: Option<Value>,
}

impl ApiRequest {
    /// 400 naming the first known-but-unimplemented field with a value that asks for
    /// something.
    pub(crate) fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let u = self;
        let fields: [(&str, &Option<Value>); 5] = [
            ("echo", &u.echo),
            ("best_of", &u.best_of),
            ("suffix", &u.suffix),
            ("functions", &u.functions),
            ("function_call", &u.function_call),
        ];
        for (name, v) in fields {
            if let Some(v) = v {
                if !neutral(name, v) {
                    return Err(unsupported(name));
                }
            }
        }
        Ok(())
    }
}

impl ApiRequest {
    /// The request's speculation, `default` when it names none: `lookup` or `off`; any other
    /// value is refused naming the field.
    pub(crate) fn speculation(&self, default: Speculate) -> Result<Speculate, ApiError> {
        let Some(v) = self.speculate.as_deref() else {
            return Ok(default);
        };
        match v {
            "lookup" => Ok(Speculate::Lookup),
            "off" => Ok(Speculate::Off),
            "draft" => Err(ApiError::bad(
                "`speculate`: this server has no draft model; use \"lookup\" or \"off\"",
            )),
            _ => Err(ApiError::bad(format!(
                "`speculate` must be \"lookup\", \"draft\" or \"off\", got {:?}",
                v.chars().take(32).collect::<String>()
            ))),
        }
    }
}

/// Most `logit_bias` entries one request may have.
const MAX_BIASES: usize = 1024;

impl Job {
    /// The job of choice `index`: the same request, seeded `seed + index`.
    pub(crate) fn choice(&self, index: usize) -> Job {
        let mut job = self.clone();
        job.opts.sampling.seed = self.seed.wrapping_add(index as u64);
        job
    }
}

impl ApiRequest {
    /// The penalties, bias and log-probabilities asked for, checked against a vocabulary of
    /// `vocab` tokens: `logprobs` is a count (0–20) on completions, `true`/`false` with
    /// `top_logprobs` (0–20) on chat.
    pub(crate) fn shaping(&self, kind: Kind, vocab: usize) -> Result<Shaping, ApiError> {
        let top = self.top_logprobs;
        let logprobs = match (kind, &self.logprobs) {
            (Kind::Completion, _) if top.is_some() => {
                return Err(ApiError::bad(
                    "`top_logprobs` is a chat field; on completions `logprobs` is the count",
                ))
            }
            (Kind::Completion, None | Some(Value::Null)) => None,
            (Kind::Completion, Some(v)) => Some(
                v.as_u64()
                    .filter(|&n| n <= MAX_TOP_LOGPROBS as u64)
                    .ok_or_else(|| {
                        ApiError::bad(format!(
                            "`logprobs` must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {v}"
                        ))
                    })? as usize,
            ),
            (Kind::Chat, None | Some(Value::Null) | Some(Value::Bool(false))) => {
                if top.is_some_and(|n| n > 0) {
                    return Err(ApiError::bad("`top_logprobs` needs `logprobs: true`"));
                }
                None
            }
            (Kind::Chat, Some(Value::Bool(true))) => match top.unwrap_or(0) {
                n if n <= MAX_TOP_LOGPROBS as u64 => Some(n as usize),
                n => {
                    return Err(ApiError::bad(format!(
                        "`top_logprobs` must be from 0 to {MAX_TOP_LOGPROBS}, got {n}"
                    )))
                }
            },
            (Kind::Chat, Some(v)) => {
                return Err(ApiError::bad(format!(
                    "`logprobs` must be true or false, got {v}"
                )))
            }
        };
        let biases = self.logit_bias.as_ref();
        if biases.is_some_and(|b| b.len() > MAX_BIASES) {
            return Err(ApiError::bad(format!(
                "`logit_bias` may have at most {MAX_BIASES} entries"
            )));
        }
        let logit_bias = biases
            .into_iter()
            .flatten()
            .map(|(k, &v)| match k.parse::<u32>() {
                Ok(id) => Ok((id, v as f32)),
                Err(_) => Err(ApiError::bad(format!(
                    "`logit_bias` keys must be token ids, got {:?}",
                    k.chars().take(32).collect::<String>()
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let shaping = Shaping {
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            repetition_penalty: self
                .repetition_penalty
                .filter(|&p| p != 1.0)
                .map(|p| p as f32),
            logit_bias,
            logprobs,
            constraint: None,
        };
        shaping.validate(vocab).map_err(|e| match e {
            EngineError::Invalid(m) => ApiError::bad(m),
            e => ApiError::bad(e.to_string()),
        })?;
        Ok(shaping)
    }
}

/// Whether `v` asks for nothing: what a client sends for a field it does not use.
fn neutral(name: &str, v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        // `best_of` is neutral at 1
        Value::Number(n) => name == "best_of" && n.as_f64() == Some(1.0),
        Value::Object(o) if o.is_empty() => true,
        Value::Array(a) if a.is_empty() => true,
        Value::String(s) => match name {
            "tool_choice" | "function_call" => s == "none",
            "suffix" => s.is_empty(),
            _ => false,
        },
        _ => false,
    }
}

fn unsupported(name: &str) -> ApiError {
    ApiError {
        code: Some("unsupported_parameter"),
        ..ApiError::bad(format!(
            "`{name}` is not supported by this server (send it without a value, or leave it \
             out)"
        ))
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct StreamOptions {
    pub(crate) include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct InMessage {
    pub(crate) role: String,
    #[serde(default)]
    pub(crate) content: Option<Value>,
    /// not implemented: refused unless null (tool calls, named participants)
    #[serde(default)]
    pub(crate) name: Option<Value>,
    #[serde(default)]
    pub(crate) tool_calls: Option<Value>,
    #[serde(default)]
    pub(crate) tool_call_id: Option<Value>,
}

/// A checked request, ready to run.
#[derive(Clone)]
pub(crate) struct Job {
    /// choices to generate (`n`), each its own sequence seeded `seed + index`
    pub(crate) n: usize,
    pub(crate) kind: Kind,
    pub(crate) prompt_ids: Vec<u32>,
    /// the sampling seed: the request's, or a fresh one (reported in the response)
    pub(crate) seed: u64,
    pub(crate) opts: GenerateOptions,
    pub(crate) stops: Vec<String>,
    pub(crate) stream: bool,
    /// penalties, bias, log-probabilities
    pub(crate) shaping: loip_engine::Shaping,
    /// speculative decoding (prompt lookup, or off)
    pub(crate) speculate: Speculate,
    /// chat: the tools the model may call (its answer is parsed for calls)
    pub(crate) tools: Option<std::sync::Arc<crate::tools::Tools>>,
    pub(crate) include_usage: bool,
    pub(crate) return_token_ids: bool,
}

/// How a generation ended.
pub(crate) struct Finished {
    pub(crate) text: String,
    pub(crate) new_ids: Vec<u32>,
    pub(crate) finish_reason: &'static str,
    /// the tokens' log-probabilities in the endpoint's shape, when asked for
    pub(crate) logprobs: Option<Value>,
    /// the calls found in the answer (then `text` is what came before them)
    pub(crate) tool_calls: Option<Value>,
}

/// The request body: a JSON object; a field of the wrong type is named.
pub(crate) fn parse_request(body: &[u8]) -> Result<ApiRequest, ApiError> {
    parse_body(body)
}

/// A JSON object body as `T`: a field of the wrong type is named, an unknown field is
/// refused naming it.
pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::bad(
            "invalid JSON body: the request body must be a JSON object",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let req: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let e = e.into_inner();
        let text = e.to_string();
        if let Some(field) = text
            .strip_prefix("unknown field `")
            .and_then(|r| r.split('`').next())
        {
            let at = match path.rsplit_once('.') {
                Some((parent, _)) if !parent.is_empty() => format!(" in `{parent}`"),
                _ => String::new(),
            };
            return ApiError {
                code: Some("unsupported_parameter"),
                ..ApiError::bad(format!(
                    "unknown field `{field}`{at}: this server refuses fields it does not \
                     implement"
                ))
            };
        }
        if e.is_syntax() || e.is_eof() || path == "." {
            ApiError::bad(format!("invalid JSON body: {e}"))
        } else {
            ApiError::bad(format!("invalid `{path}`: {e}"))
        }
    })?;
    de.end()
        .map_err(|e| ApiError::bad(format!("invalid JSON body: {e}")))?;
    Ok(req)
}

/// Parses and checks `body` as the completion (or chat) endpoint does before any model work:
/// the JSON shape, unknown and unsupported fields, `stop`, prompt ids or message contents,
/// penalties, bias and log-probabilities against a vocabulary of `vocab` tokens.
pub(crate) fn check_body(body: &[u8], chat: bool, vocab: usize) -> Result<(), ApiError> {
    let mut r = parse_request(body)?;
    let kind = if chat { Kind::Chat } else { Kind::Completion };
    r.refuse_unsupported()?;
    stop_strings(r.stop.take())?;
    r.shaping(kind, vocab)?;
    for m in r.messages.take().into_iter().flatten() {
        content_text(m.content).map_err(ApiError::bad)?;
    }
    if let Some(Value::Array(items)) = &r.prompt {
        if items.iter().all(Value::is_number) {
            token_ids(items)?;
        }
    }
    Ok(())
}

/// Token ids of a prompt array.
pub(crate) fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| {
                    ApiError::bad(format!(
                        "prompt token ids must be unsigned integers, got {v}"
                    ))
                })
        })
        .collect()
}

/// A message's content: a string, or an array of `{"type": "text", "text": ...}` parts.
pub(crate) fn content_text(content: Option<Value>) -> Result<String, String> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in &parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => return Err(format!("only text parts are supported, got {p}")),
                }
            }
            Ok(text)
        }
        Some(other) => Err(format!(
            "must be a string or an array of parts, got {other}"
        )),
    }
}

/// `stop`: a string or an array of strings; empty strings are dropped.
pub(crate) fn stop_strings(stop: Option<Value>) -> Result<Vec<String>, ApiError> {
    let stops = match stop {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                other => Err(ApiError::bad(format!(
                    "`stop` must hold strings, got {other}"
                ))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::bad(format!(
                "`stop` must be a string or an array of strings, got {other}"
            )))
        }
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::bad(format!(
            "at most {MAX_STOPS} stop strings, got {}",
            stops.len()
        )));
    }
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// A fresh sampling seed for a request that gave none: SipHash under the process's random
/// keys of the time and a counter, so two requests never share one by accident.
pub(crate) fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.write_u64(NEXT_ID.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

pub(crate) fn request_id(kind: Kind) -> String {
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}-{:x}{nanos:08x}",
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    )
}

pub(crate) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion})
}

/// A chat answer's message: its text, or the text before its tool calls (`null` when none)
/// and the calls.
fn message(f: &Finished) -> Value {
    match &f.tool_calls {
        None => json!({"role": "assistant", "content": f.text}),
        Some(calls) => {
            let content = (!f.text.is_empty()).then_some(f.text.as_str());
            json!({"role": "assistant", "content": content, "tool_calls": calls})
        }
    }
}

/// A response's identity, and the OpenAI shapes built from it.
pub(crate) struct Meta {
    pub(crate) kind: Kind,
    pub(crate) id: String,
    pub(crate) created: u64, // unix seconds
    pub(crate) model: String,
    /// the sampling seed, reported so that a response can be reproduced
    pub(crate) seed: u64,
}

impl Meta {
    fn object(&self, stream: bool) -> &'static str {
        match (self.kind, stream) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, stream: bool, choices: Value) -> Value {
        json!({"id": self.id, "object": self.object(stream), "created": self.created,
               "model": self.model, "seed": self.seed, "choices": choices})
    }

    /// A streamed piece of choice `index`'s text (with its tokens' log-probabilities when
    /// asked for), or its last chunk with its finish reason.
    pub(crate) fn chunk(
        &self,
        index: usize,
        text: &str,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": index, "text": text, "logprobs": logprobs,
                       "finish_reason": finish})
            }
            Kind::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": index, "delta": delta, "logprobs": logprobs,
                       "finish_reason": finish})
            }
        };
        self.envelope(true, json!([choice]))
    }

    /// A chat stream's chunk of a tool-call answer: `delta` (content, or a call's name or
    /// arguments, see [`crate::tool_stream::delta_json`]) with the log-probabilities of the
    /// tokens it ends.
    pub(crate) fn delta_chunk(&self, index: usize, delta: Value, logprobs: Value) -> Value {
        let choice = json!({"index": index, "delta": delta, "logprobs": logprobs,
                            "finish_reason": null});
        self.envelope(true, json!([choice]))
    }

    /// A chat stream's first chunk: the assistant role.
    pub(crate) fn role_chunk(&self, index: usize) -> Value {
        let choice = json!({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": null, "finish_reason": null});
        self.envelope(true, json!([choice]))
    }

    /// `stream_options.include_usage`: a last chunk with no choices and the usage.
    pub(crate) fn usage_chunk(&self, usage: Value) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created,
               "model": self.model, "seed": self.seed, "choices": [], "usage": usage})
    }

    /// The whole response of a request that did not stream: one choice per `done`.
    pub(crate) fn full(&self, job: &Job, done: &[Finished]) -> Value {
        let choices: Vec<Value> = done
            .iter()
            .enumerate()
            .map(|(index, f)| {
                let logprobs = f.logprobs.clone().unwrap_or(Value::Null);
                let mut choice = match self.kind {
                    Kind::Completion => json!({"index": index, "text": f.text,
                                               "logprobs": logprobs,
                                               "finish_reason": f.finish_reason}),
                    Kind::Chat => json!({"index": index, "message": message(f),
                                         "logprobs": logprobs,
                                         "finish_reason": f.finish_reason}),
                };
                if let (true, Some(c)) = (job.return_token_ids, choice.as_object_mut()) {
                    c.insert("token_ids".into(), json!(f.new_ids));
                }
                choice
            })
            .collect();
        let completion: usize = done.iter().map(|f| f.new_ids.len()).sum();
        let mut out = self.envelope(false, json!(choices));
        if let Some(o) = out.as_object_mut() {
            o.insert("usage".into(), usage(job.prompt_ids.len(), completion));
            if job.return_token_ids {
                o.insert("prompt_token_ids".into(), json!(job.prompt_ids));
            }
        }
        out
    }
}

impl ApiRequest {
    /// The grammar the output must follow, and the field that asked for it: `grammar` (a
    /// Lark grammar), or `response_format` `json_object` (any JSON object) or `json_schema`
    /// (`{"json_schema": {"name": .., "schema": {..}, "strict": ..}}`); `text` asks for none.
    pub(crate) fn grammar_ask(&self) -> Result<Option<(Ask, &'static str)>, ApiError> {
        let format = match &self.response_format {
            None | Some(Value::Null) => None,
            Some(v) => response_format(v)?,
        };
        let grammar = match &self.grammar {
            None | Some(Value::Null) => None,
            Some(Value::String(g)) if g.trim().is_empty() => None,
            Some(Value::String(g)) => Some(Ask::Lark(g.clone())),
            Some(_) => return Err(ApiError::bad("`grammar` must be a string (a Lark grammar)")),
        };
        match (format, grammar) {
            (Some(_), Some(_)) => Err(ApiError::bad(
                "send either `response_format` or `grammar`, not both",
            )),
            (Some(f), None) => Ok(Some((f, "response_format"))),
            (None, Some(g)) => Ok(Some((g, "grammar"))),
            (None, None) => Ok(None),
        }
    }
}

/// `response_format`'s grammar: none for `text`.
fn response_format(v: &Value) -> Result<Option<Ask>, ApiError> {
    let bad = |m: &str| Err(ApiError::bad(format!("`response_format`: {m}")));
    let Some(o) = v.as_object() else {
        return bad("must be an object with a `type`");
    };
    let kind = o.get("type").and_then(Value::as_str);
    let allowed: &[&str] = match kind {
        Some("text") => &["type"],
        Some("json_object") => &["type", "schema"],
        Some("json_schema") => &["type", "json_schema"],
        _ => return bad("`type` must be \"text\", \"json_object\" or \"json_schema\""),
    };
    if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
        let k = k.chars().take(32).collect::<String>();
        return bad(&format!("unknown field `{k}` for this type"));
    }
    match kind {
        Some("json_object") => Ok(Some(Ask::Json(match o.get("schema") {
            // llama-server's form: a schema beside the type
            Some(s @ Value::Object(_)) => s.clone(),
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(_) => return bad("`schema` must be an object"),
        }))),
        Some("json_schema") => {
            let Some(js) = o.get("json_schema").and_then(Value::as_object) else {
                return bad("`json_schema` must be an object with a `schema`");
            };
            const KNOWN: [&str; 4] = ["name", "schema", "strict", "description"];
            if let Some(k) = js.keys().find(|k| !KNOWN.contains(&k.as_str())) {
                let k = k.chars().take(32).collect::<String>();
                return bad(&format!("unknown field `json_schema.{k}`"));
            }
            match js.get("schema") {
                Some(s @ (Value::Object(_) | Value::Bool(true))) => Ok(Some(Ask::Json(s.clone()))),
                None | Some(Value::Null) => Ok(Some(Ask::Json(json!({})))),
                Some(_) => bad("`json_schema.schema` must be a JSON Schema object"),
            }
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_and_content_shapes() {
        assert_eq!(stop_strings(Some(json!("x"))).ok(), Some(vec!["x".into()]));
        assert_eq!(
            stop_strings(Some(json!(["a", ""]))).ok(),
            Some(vec!["a".into()])
        );
        assert!(stop_strings(Some(json!(3))).is_err());
        assert!(stop_strings(Some(json!([1]))).is_err());
        assert_eq!(
            content_text(Some(
                json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
            )),
            Ok("ab".into())
        );
        assert!(content_text(Some(json!([{"type": "image_url"}]))).is_err());
    }
}
