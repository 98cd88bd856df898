//! llama-server's `POST /tokenize` and `POST /detokenize`, and `GET /v1/models/{id}`: what
//! a client needs to count tokens and read ids without generating.
//!
//! Invariants: `/tokenize` tokenizes exactly as a completion's text prompt is tokenized
//! (`encode(text, add_special)`, special tokens matched unless `parse_special` is false),
//! with the same size check before any work; `/detokenize` refuses ids outside the
//! vocabulary. Both need the API key like `/v1/*`.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::http;
use crate::state::App;
use crate::wire::{parse_body, ApiError};

/// The body of `POST /tokenize`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct TokenizeRequest {
    content: String,
    /// add what the tokenizer adds at the start (e.g. bos); default true
    add_special: Option<bool>,
    /// match special-token text as special tokens; default true (as a completion's prompt)
    parse_special: Option<bool>,
    /// answer `[{id, piece}]` instead of ids
    with_pieces: bool,
}

/// The body of `POST /detokenize`.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct DetokenizeRequest {
    tokens: Vec<u32>,
}

pub(crate) async fn tokenize(
    State(app): State<Arc<App>>,
    req: Request,
) -> Result<Response, ApiError> {
    let body = http::read_body(req, app.body_timeout).await?;
    let r: TokenizeRequest = parse_body(&body)?;
    drop(body);
    let worker = app.clone();
    let out = tokio::task::spawn_blocking(move || -> Result<Value, ApiError> {
        let tok = worker.tokenizer()?;
        worker.check_text(r.content.len())?;
        let ids = if r.parse_special.unwrap_or(true) {
            tok.encode(&r.content, r.add_special.unwrap_or(true))
        } else {
            tok.encode_plain(&r.content)
        }
        .map_err(|e| ApiError::bad(format!("tokenizing the content: {e}")))?;
        if !r.with_pieces {
            return Ok(json!({ "tokens": ids }));
        }
        let pieces: Vec<Value> = ids
            .iter()
            .map(|&id| {
                let piece = tok.decode(&[id], false).unwrap_or_default();
                json!({"id": id, "piece": piece})
            })
            .collect();
        Ok(json!({ "tokens": pieces }))
    })
    .await
    .map_err(ApiError::from_join)??;
    Ok(Json(out).into_response())
}

pub(crate) async fn detokenize(
    State(app): State<Arc<App>>,
    req: Request,
) -> Result<Response, ApiError> {
    let body = http::read_body(req, app.body_timeout).await?;
    let r: DetokenizeRequest = parse_body(&body)?;
    drop(body);
    let tok = app.tokenizer()?;
    let vocab = app.vocab_size();
    if let Some(bad) = r.tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::bad(format!(
            "token id {bad} is outside the vocabulary of {vocab} tokens"
        )));
    }
    let content = tok
        .decode(&r.tokens, false)
        .map_err(|e| ApiError::bad(format!("decoding the tokens: {e}")))?;
    Ok(Json(json!({ "content": content })).into_response())
}

/// `GET /v1/models/{id}`: the served model under its name or an alias, else 404.
pub(crate) async fn model(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if !app.serves(&id) {
        return Err(ApiError::model_not_found(&id, &app.name));
    }
    Ok(Json(app.model_entry(&id)))
}
