//! Both sides of the handshake of [`crate::net::session`], over plaintext frames of at most
//! [`PRE_AUTH_FRAME`] bytes. Each returns the session's keys; the caller seals the
//! connection with them. A failure sends the peer an `Error` frame saying why (never a
//! secret) where that helps, and returns the error.

use tokio::io::{AsyncRead, AsyncWrite};

use crate::net::session::{unhex, Ephemeral, SessionKeys, TranscriptParts};
use crate::wire::{
    self, hex, FrameKind, Role, ToCoordinator, ToWorker, WireError, PROTOCOL_VERSION,
};

/// Largest frame either side accepts before the peer is authenticated, bytes.
pub const PRE_AUTH_FRAME: usize = 64 << 10;
/// How long a worker waits for the connecting side's hello, the first message of a handshake.
pub const HELLO_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

async fn send_error<W: AsyncWrite + Unpin>(wr: &mut W, msg: &str) {
    let _ = wire::write_frame(wr, FrameKind::Error, msg.as_bytes(), None).await;
}

async fn control<W: AsyncWrite + Unpin, T: serde::Serialize>(
    wr: &mut W,
    msg: &T,
) -> Result<(), WireError> {
    wire::write_frame(wr, FrameKind::Control, &wire::control_payload(msg)?, None).await
}

fn key_of(s: &str, what: &str) -> Result<[u8; 32], WireError> {
    unhex::<32>(s).ok_or_else(|| WireError::Protocol(format!("{what} is not 32 bytes of hex")))
}

/// The worker's side for a coordinator only (see [`accept_role`]).
pub async fn accept<R, W>(rd: &mut R, wr: &mut W, token: &str) -> Result<SessionKeys, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    match accept_role(rd, wr, token).await? {
        (keys, Role::Coordinator) => Ok(keys),
        _ => Err(WireError::Protocol("a peer where a coordinator was expected".into())),
    }
}

/// The worker's side: hello, challenge, the proof of the role the hello names (coordinator
/// or peer) checked, our proof. Returns the keys and that role.
pub async fn accept_role<R, W>(
    rd: &mut R,
    wr: &mut W,
    token: &str,
) -> Result<(SessionKeys, Role), WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let hello_w = wire::hello_payload(Role::Worker, PROTOCOL_VERSION);
    wire::write_frame(wr, FrameKind::Hello, &hello_w, None).await?;
    // a connecting side sends its hello at once: a silent one gives its slot back early
    let hello = match tokio::time::timeout(HELLO_WAIT, wire::read_frame(rd, PRE_AUTH_FRAME)).await
    {
        Ok(r) => r,
        Err(_) => Err(WireError::Timeout(HELLO_WAIT, "the hello")),
    };
    let hello = match hello.and_then(|f| wire::check_hello(&f).map(|()| f)) {
        Ok(f) => f,
        Err(e) => {
            let msg = match &e {
                WireError::VersionMismatch { ours, theirs } => format!(
                    "protocol version mismatch: this worker speaks LOIP v{ours}, the coordinator v{theirs}"
                ),
                other => format!("refused: {other}"),
            };
            send_error(wr, &msg).await;
            return Err(e);
        }
    };
    let role = match wire::hello_role(&hello) {
        Some(r @ (Role::Coordinator | Role::Peer)) => r,
        _ => {
            send_error(wr, "refused: a hello with no connecting role").await;
            return Err(WireError::Protocol("a hello with no connecting role".into()));
        }
    };
    let ours = Ephemeral::new();
    let (nonce_w, key_w) = (ours.nonce, ours.public);
    control(
        wr,
        &ToCoordinator::Challenge {
            nonce: hex(&nonce_w),
            key: hex(&key_w),
        },
    )
    .await?;
    let f = wire::read_frame(rd, PRE_AUTH_FRAME).await?;
    let (nonce_c, key_c, mac) = match wire::parse_control::<ToWorker>(&f) {
        Ok(ToWorker::Auth { nonce, key, mac }) => {
            match (key_of(&nonce, "the nonce"), key_of(&key, "the key")) {
                (Ok(n), Ok(k)) => (n, k, mac),
                (Err(e), _) | (_, Err(e)) => {
                    send_error(wr, &format!("bad authentication message: {e}")).await;
                    return Err(e);
                }
            }
        }
        Ok(_) => {
            send_error(wr, "expected authentication").await;
            return Err(WireError::Protocol("expected authentication".into()));
        }
        Err(e) => {
            send_error(wr, &format!("bad authentication message: {e}")).await;
            return Err(e);
        }
    };
    let parts = TranscriptParts {
        hello_c: &hello.payload,
        hello_w: &hello_w,
        nonce_w: &nonce_w,
        key_w: &key_w,
        nonce_c: &nonce_c,
        key_c: &key_c,
    };
    let keys = SessionKeys::derive(token, ours, &key_c, &parts)?;
    if !keys.verify(role, &mac) {
        send_error(wr, "authentication failed: wrong token").await;
        let who = if role == Role::Peer { "peer" } else { "coordinator" };
        return Err(WireError::AuthRefused(format!("a {who} gave a wrong token")));
    }
    control(
        wr,
        &ToCoordinator::Proof {
            mac: keys.proof(Role::Worker),
        },
    )
    .await?;
    Ok((keys, role))
}

/// The coordinator's side: hello, the challenge answered with our proof, the worker's proof
/// checked.
pub async fn connect<R, W>(rd: &mut R, wr: &mut W, token: &str) -> Result<SessionKeys, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    connect_as(rd, wr, token, Role::Coordinator).await
}

/// [`connect`] as `role`: the coordinator, or a worker opening a peer session.
pub async fn connect_as<R, W>(
    rd: &mut R,
    wr: &mut W,
    token: &str,
    role: Role,
) -> Result<SessionKeys, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let hello_c = wire::hello_payload(role, PROTOCOL_VERSION);
    wire::write_frame(wr, FrameKind::Hello, &hello_c, None).await?;
    let hello = wire::read_frame(rd, PRE_AUTH_FRAME).await?;
    wire::check_hello(&hello)?;
    if wire::hello_role(&hello) != Some(Role::Worker) {
        return Err(WireError::Protocol("the peer does not answer as a worker".into()));
    }
    let f = wire::read_frame(rd, PRE_AUTH_FRAME).await?;
    let (nonce_w, key_w) = match wire::parse_control::<ToCoordinator>(&f)? {
        ToCoordinator::Challenge { nonce, key } => {
            (key_of(&nonce, "the nonce")?, key_of(&key, "the key")?)
        }
        other => {
            return Err(WireError::Protocol(format!(
                "expected a challenge, got {}",
                kind_of(&other)
            )))
        }
    };
    let ours = Ephemeral::new();
    let (nonce_c, key_c) = (ours.nonce, ours.public);
    let parts = TranscriptParts {
        hello_c: &hello_c,
        hello_w: &hello.payload,
        nonce_w: &nonce_w,
        key_w: &key_w,
        nonce_c: &nonce_c,
        key_c: &key_c,
    };
    let keys = SessionKeys::derive(token, ours, &key_w, &parts)?;
    control(
        wr,
        &ToWorker::Auth {
            nonce: hex(&nonce_c),
            key: hex(&key_c),
            mac: keys.proof(role),
        },
    )
    .await?;
    let f = wire::read_frame(rd, PRE_AUTH_FRAME).await?;
    match wire::parse_control::<ToCoordinator>(&f) {
        Ok(ToCoordinator::Proof { mac }) if keys.verify(Role::Worker, &mac) => Ok(keys),
        Ok(ToCoordinator::Proof { .. }) => Err(WireError::AuthRefused(
            "the worker does not hold the shared token".into(),
        )),
        Ok(other) => Err(WireError::Protocol(format!(
            "expected the worker's proof, got {}",
            kind_of(&other)
        ))),
        Err(WireError::Remote(m)) if m.contains("authentication") => {
            Err(WireError::AuthRefused(m))
        }
        Err(e) => Err(e),
    }
}

/// The name of a message, for errors (never its content, which may be large).
fn kind_of(m: &ToCoordinator) -> &'static str {
    match m {
        ToCoordinator::Challenge { .. } => "a challenge",
        ToCoordinator::Proof { .. } => "a proof",
        ToCoordinator::Welcome { .. } => "a welcome",
        ToCoordinator::Pong { .. } => "a pong",
        ToCoordinator::BulkReceived { .. } | ToCoordinator::BulkSent { .. } => "a bulk receipt",
        ToCoordinator::Stored { .. } => "a slice receipt",
        ToCoordinator::Probed(_) => "probe results",
        ToCoordinator::Loaded { .. } => "a load receipt",
        ToCoordinator::Switched { .. } => "a switch receipt",
        ToCoordinator::SwitchRefused { .. } => "a switch refusal",
        ToCoordinator::Borrowed { .. } => "a KV reservation receipt",
        ToCoordinator::KvFetch { .. } => "a lent-KV request",
        ToCoordinator::KvSent { .. } | ToCoordinator::KvFetched { .. } => "a lent-KV notice",
        ToCoordinator::Failed { .. } => "a failure",
        ToCoordinator::PeersReady { .. } => "a peer report",
        ToCoordinator::PeerGone { .. } => "a lost peer",
    }
}
