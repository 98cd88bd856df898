//! The error every failed request is answered with: a status and a message for the client,
//! as OpenAI's error object. Below the request parsing, the grammars and the tools that
//! return it.
//!
//! Invariant: the message says what the client did wrong, or that the server failed; it never
//! carries a file path, a device address or an internal error's text. Those go to the
//! server's log ([`ApiError::internal`], [`ApiError::from_cluster`]).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use loip_engine::EngineError;
use loip_runtime::coordinator::ClusterError;
use serde_json::{json, Value};

/// An HTTP error: a status and a message for the client, as OpenAI's error object.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    /// OpenAI's machine-readable `code` (e.g. `invalid_api_key`)
    pub(crate) code: Option<&'static str>,
    /// seconds after which a retry may succeed (the `Retry-After` header of a 429 or 503)
    pub(crate) retry_after: Option<u64>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            code: None,
            retry_after: None,
        }
    }

    /// 404 `model_not_found`: the request names a model this server does not serve.
    pub(crate) fn model_not_found(asked: &str, served: &str) -> ApiError {
        let asked: String = asked.chars().take(64).collect();
        ApiError {
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "the model `{asked}` does not exist; this server serves `{served}` (or \
                     leave `model` out)"
                ),
            )
        }
    }

    /// 429: the server is busy; `Retry-After: 1`.
    pub(crate) fn busy(message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some("rate_limit_exceeded"),
            retry_after: Some(1),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, message)
        }
    }

    /// 503: the device is under memory pressure with nothing left to shed; `Retry-After: 1`.
    pub(crate) fn under_pressure() -> ApiError {
        ApiError {
            code: Some("memory_pressure"),
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the device is under memory pressure with nothing left to shed: new requests \
                 wait until it eases; retry later",
            )
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

    /// The message for the client.
    pub(crate) fn message(&self) -> &str {
        &self.message
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
            BatchError::Busy(m) => ApiError::busy(format!("{m}; retry later")),
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
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}
