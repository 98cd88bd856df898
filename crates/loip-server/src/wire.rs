//! The OpenAI wire format: request bodies (parsed with errors naming the field), response and
//! stream-chunk shapes, and the error object every failure is sent as.
//!
//! Invariant: an error sent to a client says what the client did wrong, or that the server
//! failed; it never carries a file path, a device address or an internal error's text. Those
//! go to the server's log ([`ApiError::internal`], [`ApiError::from_cluster`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use loip_engine::{EngineError, GenerateOptions};
use loip_runtime::coordinator::ClusterError;
use serde::Deserialize;
use serde_json::{json, Value};

/// Largest request body accepted; larger ones get 413.  // bytes
pub(crate) const MAX_BODY: usize = 1 << 20;
/// Most stop strings in one request.
const MAX_STOPS: usize = 16;

/// An HTTP error: a status and a message for the client, as OpenAI's error object.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
    /// OpenAI's machine-readable `code` (e.g. `invalid_api_key`)
    code: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            code: None,
        }
    }

    /// 401: no API key, or not the server's.
    pub(crate) fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "a valid API key is required: send `Authorization: Bearer KEY`",
            )
        }
    }

    /// 500 with a generic message; `detail` (which may name files or addresses) is logged.
    pub(crate) fn internal(detail: impl std::fmt::Display) -> ApiError {
        eprintln!("loip api: request failed: {detail}");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "generation failed on the server (see its log)",
        )
    }

    /// 400: the request is wrong.
    pub(crate) fn bad(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }

    pub(crate) fn body(&self) -> Value {
        let kind = if self.status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        json!({"error": {"message": self.message, "type": kind, "param": null,
                         "code": self.code}})
    }

    pub(crate) fn from_engine(e: EngineError) -> ApiError {
        ApiError::internal(e)
    }

    /// 429 when the scheduler's queue is full, 400 for a request the device can never
    /// hold, 503 when the serving loop stopped or a cluster device is unavailable, else 500
    /// (logged).
    pub(crate) fn from_batch(e: crate::serving::BatchError) -> ApiError {
        use crate::serving::BatchError;
        match e {
            BatchError::Busy(m) => ApiError {
                code: Some("rate_limit_exceeded"),
                ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, format!("{m}; retry later"))
            },
            BatchError::Refused(m) => ApiError::bad(m),
            BatchError::Stopped => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the serving loop stopped")
            }
            e @ BatchError::Unavailable(_) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            e => ApiError::internal(e),
        }
    }

    /// 503 when a device is gone or the pipeline stopped (the client may retry), else 500;
    /// the cluster's error (device names and addresses) is logged, not sent.
    pub(crate) fn from_cluster(e: ClusterError) -> ApiError {
        let which = match &e {
            ClusterError::DeviceGone { device, .. } => format!("device {device} is gone"),
            ClusterError::Stopped | ClusterError::Net(_) => "a device is unavailable".into(),
            _ => return ApiError::internal(e),
        };
        eprintln!("loip api: request failed: {e}");
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{which}; retry later"),
        )
    }

    pub(crate) fn from_join(e: tokio::task::JoinError) -> ApiError {
        ApiError::internal(format!("the generation task failed: {e}"))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

/// The body of a completion or chat request; unknown fields are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct ApiRequest {
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
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct StreamOptions {
    pub(crate) include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct InMessage {
    pub(crate) role: String,
    #[serde(default)]
    pub(crate) content: Option<Value>,
}

/// A checked request, ready to run.
pub(crate) struct Job {
    pub(crate) prompt_ids: Vec<u32>,
    pub(crate) opts: GenerateOptions,
    pub(crate) stops: Vec<String>,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) return_token_ids: bool,
}

/// How a generation ended.
pub(crate) struct Finished {
    pub(crate) text: String,
    pub(crate) new_ids: Vec<u32>,
    pub(crate) finish_reason: &'static str,
}

/// The request body: a JSON object; a field of the wrong type is named.
pub(crate) fn parse_request(body: &[u8]) -> Result<ApiRequest, ApiError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::bad(
            "invalid JSON body: the request body must be a JSON object",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let req: ApiRequest = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let e = e.into_inner();
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

/// A response's identity, and the OpenAI shapes built from it.
pub(crate) struct Meta {
    pub(crate) kind: Kind,
    pub(crate) id: String,
    pub(crate) created: u64, // unix seconds
    pub(crate) model: String,
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
               "model": self.model, "choices": choices})
    }

    /// A streamed piece of text, or the last chunk with its finish reason.
    pub(crate) fn chunk(&self, text: &str, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        self.envelope(true, json!([choice]))
    }

    /// A chat stream's first chunk: the assistant role.
    pub(crate) fn role_chunk(&self) -> Value {
        let choice = json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": null, "finish_reason": null});
        self.envelope(true, json!([choice]))
    }

    /// `stream_options.include_usage`: a last chunk with no choices and the usage.
    pub(crate) fn usage_chunk(&self, usage: Value) -> Value {
        json!({"id": self.id, "object": self.object(true), "created": self.created,
               "model": self.model, "choices": [], "usage": usage})
    }

    /// The whole response of a request that did not stream.
    pub(crate) fn full(&self, job: &Job, f: &Finished) -> Value {
        let mut choice = match self.kind {
            Kind::Completion => json!({"index": 0, "text": f.text, "logprobs": null,
                                       "finish_reason": f.finish_reason}),
            Kind::Chat => json!({"index": 0,
                                 "message": {"role": "assistant", "content": f.text},
                                 "logprobs": null, "finish_reason": f.finish_reason}),
        };
        if let (true, Some(c)) = (job.return_token_ids, choice.as_object_mut()) {
            c.insert("token_ids".into(), json!(f.new_ids));
        }
        let mut out = self.envelope(false, json!([choice]));
        if let Some(o) = out.as_object_mut() {
            o.insert("usage".into(), usage(job.prompt_ids.len(), f.new_ids.len()));
            if job.return_token_ids {
                o.insert("prompt_token_ids".into(), json!(job.prompt_ids));
            }
        }
        out
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
