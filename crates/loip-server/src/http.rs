//! The HTTP edge of `loip api`: connections, timeouts, the API key and request bodies.
//!
//! Invariants (each one closes a way for a stranger to hold the server):
//! - At most `max_connections` connections are open; one more is closed at once, so file
//!   descriptors and tasks are bounded whatever clients do.
//! - A client has `header_timeout` to send a request's head (hyper's header read timer, which
//!   also runs while a keep-alive connection is idle); a half-sent head (slowloris) is closed.
//! - A body is read within `body_timeout` and never past [`MAX_BODY`]; a `Content-Length`
//!   over the limit is answered 413 before one byte of the body is read.
//! - With an API key, every `/v1/*` route needs `Authorization: Bearer KEY`; the key is
//!   compared through its SHA-256 digest in constant time, and a miss is 401 in OpenAI's shape.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_LENGTH};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::app::App;
use crate::wire::{ApiError, MAX_BODY};

/// Connection limits of the server.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// most connections open at once
    pub max_connections: usize,
    /// time to send a request's head; also how long an idle keep-alive connection lives
    pub header_timeout: Duration,
    /// time to send a request's body
    pub body_timeout: Duration,
}

/// Accepts connections on `listener` and serves `app` on each until `shutdown` resolves;
/// then stops accepting and gives open connections up to 5 s to finish.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let open = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // out of descriptors, or a connection reset before accept: wait a little
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            tracing::warn!(
                "closing a connection from {peer}: {} are open (--max-connections)",
                limits.max_connections
            );
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = conn.await {
                tracing::debug!("connection from {peer}: {e}");
            }
        });
    }
    drop(listener);
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(Duration::from_secs(5)) => {}
    }
}

/// What the server keeps of an API key: its SHA-256 digest.
pub fn key_digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Whether `given` is the key of `digest`, in time independent of where they differ.
fn key_matches(digest: &[u8; 32], given: &str) -> bool {
    let got = key_digest(given);
    let diff = digest
        .iter()
        .zip(got.iter())
        .fold(0u8, |d, (a, b)| d | (a ^ b));
    std::hint::black_box(diff) == 0
}

/// Middleware of the `/v1/*` routes: with an API key set, `Authorization: Bearer KEY`.
pub(crate) async fn require_key(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(digest) = &app.api_key {
        let given = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if !given.is_some_and(|k| key_matches(digest, k)) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// The body of `req`: refused with 413 from its `Content-Length` alone when that is over
/// [`MAX_BODY`], and with 408 when it does not arrive within `timeout`.
pub(crate) async fn read_body(req: Request, timeout: Duration) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is over {MAX_BODY} bytes"),
        )
    };
    if let Some(v) = req.headers().get(CONTENT_LENGTH) {
        let len = v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .ok_or_else(|| ApiError::bad("invalid Content-Length header"))?;
        if len > MAX_BODY as u64 {
            return Err(too_large());
        }
    }
    let read = async {
        let mut frames = Body::into_data_stream(req.into_body());
        let mut body = Vec::new();
        while let Some(chunk) = frames.next().await {
            let chunk = chunk.map_err(|_| ApiError::bad("reading the request body failed"))?;
            if body.len() + chunk.len() > MAX_BODY {
                return Err(too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(body))
    };
    tokio::time::timeout(timeout, read).await.map_err(|_| {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                timeout.as_secs()
            ),
        )
    })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_by_digest() {
        let d = key_digest("secret");
        assert!(key_matches(&d, "secret"));
        assert!(!key_matches(&d, "secreT"));
        assert!(!key_matches(&d, ""));
    }
}
