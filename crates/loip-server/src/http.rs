//! The HTTP edge of `loip api`: connections, timeouts, the API key and request bodies.
//!
//! Invariants (each one closes a way for a stranger to hold the server):
//! - At most `max_connections` connections are open, and at most `max_connections_per_addr`
//!   from one address (an IPv6 /64 counts as one address): one more is answered 503 and
//!   closed at once, so file descriptors and tasks are bounded whatever clients do, and one
//!   stranger cannot take every connection (`/health` stays reachable from elsewhere).
//! - A client has `header_timeout` to send a request's head (hyper's header read timer, which
//!   also runs while a keep-alive connection is idle); a half-sent head (slowloris) is closed.
//! - A body is read within `body_timeout` and never past [`MAX_BODY`]; a `Content-Length`
//!   over the limit is answered 413 before one byte of the body is read.
//! - Every request is logged in one line at info (method, path, status, tokens, ms to the
//!   response head), never with its prompt; with `--cors ORIGIN` every response allows that
//!   origin and a preflight `OPTIONS` is answered 204 before any route or key check.
//! - With an API key, every `/v1/*` route and `/metrics` need `Authorization: Bearer KEY`; the key is
//!   compared through its SHA-256 digest in constant time, and a miss is 401 in OpenAI's shape.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
use tokio::net::{TcpListener, TcpStream};

use crate::state::App;
use crate::wire::{ApiError, MAX_BODY};

/// Connection limits of the server.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// most connections open at once
    pub max_connections: usize,
    /// most connections open at once from one address (an IPv6 /64 is one address)
    pub max_connections_per_addr: usize,
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
    let shares = Shares::new(limits.max_connections, limits.max_connections_per_addr);
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
        let permit = match shares.admit(peer.ip()) {
            Ok(p) => p,
            Err(over) => {
                tracing::debug!("refusing a connection from {peer}: {over}");
                refuse(&stream, over);
                continue;
            }
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

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Over {
    /// `max_connections` are open
    Total(usize),
    /// `max_connections_per_addr` are open from this address
    Share(usize),
}

impl std::fmt::Display for Over {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Over::Total(n) => write!(f, "{n} connections are open (--max-connections)"),
            Over::Share(n) => write!(
                f,
                "{n} connections are open from this address (--max-connections-per-addr)"
            ),
        }
    }
}

/// The open connections, in total and per address (pure: no sockets).
#[derive(Clone)]
pub(crate) struct Shares {
    max_total: usize,
    max_per_addr: usize,
    /// open connections per address key, and in total
    open: Arc<Mutex<(HashMap<IpAddr, usize>, usize)>>,
}

/// One admitted connection; its place is given back when dropped.
pub(crate) struct Share {
    key: IpAddr,
    open: Arc<Mutex<(HashMap<IpAddr, usize>, usize)>>,
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut open = crate::backend::lock(&self.open);
        let (per, total) = &mut *open;
        *total = total.saturating_sub(1);
        if let Some(n) = per.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                per.remove(&self.key);
            }
        }
    }
}

impl Shares {
    pub(crate) fn new(max_total: usize, max_per_addr: usize) -> Shares {
        Shares {
            max_total,
            max_per_addr: max_per_addr.max(1),
            open: Arc::new(Mutex::new((HashMap::new(), 0))),
        }
    }

    /// A place for a connection from `ip`, unless the server or that address is full.
    pub(crate) fn admit(&self, ip: IpAddr) -> Result<Share, Over> {
        let key = addr_key(ip);
        let mut open = crate::backend::lock(&self.open);
        let (per, total) = &mut *open;
        if *total >= self.max_total {
            return Err(Over::Total(self.max_total));
        }
        let n = per.entry(key).or_insert(0);
        if *n >= self.max_per_addr {
            return Err(Over::Share(self.max_per_addr));
        }
        *n += 1;
        *total += 1;
        Ok(Share {
            key,
            open: self.open.clone(),
        })
    }
}

/// The address a connection counts against: an IPv4 address, or an IPv6 address's /64
/// (one host usually holds a whole /64); an IPv4-mapped IPv6 address is its IPv4 address.
fn addr_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut seg = v6.segments();
                seg[4..].fill(0);
                IpAddr::V6(seg.into())
            }
        },
    }
}

/// Answers a refused connection 503 (as far as the socket takes it without waiting) and
/// closes it.
fn refuse(stream: &TcpStream, over: Over) {
    let body = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("too many connections: {over}; retry later"),
    )
    .body()
    .to_string();
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(reply.as_bytes());
}

/// A finished request's token counts, put on its response for the request log.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tokens {
    pub(crate) prompt: usize,     // tokens
    pub(crate) completion: usize, // tokens
}

/// Middleware: one line per request at info: method, path (at most 128 characters), status,
/// tokens when the handler put them on the response, and ms to the response head.
pub(crate) async fn log_request(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path: String = req.uri().path().chars().take(128).collect();
    let t0 = Instant::now();
    let resp = next.run(req).await;
    let tokens = resp
        .extensions()
        .get::<Tokens>()
        .map_or(String::new(), |t| {
            format!(" {} + {} tokens", t.prompt, t.completion)
        });
    tracing::info!(
        target: "loip::api",
        "{method} {path} {}{tokens} {} ms",
        resp.status().as_u16(),
        t0.elapsed().as_millis()
    );
    resp
}

/// Middleware of `--cors ORIGIN`: a preflight `OPTIONS` is answered 204 with the methods and
/// headers the API takes; every response allows the origin.
pub(crate) async fn cors(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    use axum::http::header;
    let Some(origin) = app.cors.clone() else {
        return next.run(req).await;
    };
    let preflight = req.method() == axum::http::Method::OPTIONS;
    let mut resp = if preflight {
        StatusCode::NO_CONTENT.into_response()
    } else {
        next.run(req).await
    };
    let h = resp.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(header::VARY, axum::http::HeaderValue::from_static("origin"));
    if preflight {
        let allow = |s: &'static str| axum::http::HeaderValue::from_static(s);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            allow("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            allow("authorization, content-type"),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, allow("600"));
    }
    resp
}

pub use crate::state::key_digest;

/// Whether `given` is the key of `digest`, in time independent of where they differ.
fn key_matches(digest: &[u8; 32], given: &str) -> bool {
    let got = key_digest(given);
    let diff = digest
        .iter()
        .zip(got.iter())
        .fold(0u8, |d, (a, b)| d | (a ^ b));
    std::hint::black_box(diff) == 0
}

/// Middleware of the `/v1/*` routes and `/metrics`: with an API key set, `Authorization: Bearer KEY`.
pub(crate) async fn require_key(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(digest) = &app.api_key {
        if !key_given(digest, req.headers()) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// Whether `headers` carry `Authorization: Bearer KEY` with the key of `digest`.
pub(crate) fn key_given(digest: &[u8; 32], headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .is_some_and(|k| key_matches(digest, k))
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

    /// Issue 37 (2): one address holding its share of connections leaves the others their
    /// places; a place comes back when its connection closes.
    #[test]
    fn finding_2_one_address_has_a_share_of_the_connections() {
        let shares = Shares::new(5, 2);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let held: Vec<Share> = (0..2).map(|_| shares.admit(a).unwrap()).collect();
        assert_eq!(shares.admit(a).err(), Some(Over::Share(2)));
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert_eq!(shares.admit(mapped).err(), Some(Over::Share(2)));
        let other = shares.admit(b).unwrap();
        drop(held);
        let again = shares.admit(a).unwrap();
        // one IPv6 /64 is one address
        let v6 = |s: &str| s.parse::<IpAddr>().unwrap();
        let x = shares.admit(v6("2001:db8::1")).unwrap();
        let y = shares.admit(v6("2001:db8::ffff:2")).unwrap();
        assert_eq!(shares.admit(v6("2001:db8::3")).err(), Some(Over::Share(2)));
        // and the total still holds
        let z = shares.admit(v6("2001:db9::1")).unwrap();
        assert_eq!(shares.admit(v6("2001:db9::2")).err(), Some(Over::Total(5)));
        drop((other, again, x, y, z));
        assert_eq!(crate::backend::lock(&shares.open).1, 0);
        assert!(crate::backend::lock(&shares.open).0.is_empty());
    }
}
