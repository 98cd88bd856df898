//! Both sides of the handshake that opens a session ([`crate::net::session`]): the Noise
//! protocol framework's `Noise_XXpsk3_25519_ChaChaPoly_BLAKE2s` (the `snow` crate, pure-Rust
//! resolver), over plaintext frames of at most [`PRE_AUTH_FRAME`] bytes:
//!
//! ```text
//! W → I  Hello (LOIP, version, role worker)            plaintext; a version mismatch is refused
//! I → W  Hello (LOIP, version, role coordinator|peer)  here, readably, naming both versions
//! I → W  Handshake  -> e
//! W → I  Handshake  <- e, ee, s, es                    the worker's static key
//! I → W  Handshake  -> s, se, psk                      the connecting side's static key
//! W → I  Handshake  sealed, empty                      the worker holds the pre-shared key too
//! ```
//!
//! The prologue is `"loip noise v6"` ‖ the connecting side's hello ‖ the worker's, so both
//! hellos (versions and roles: a coordinator's session and a peer's are different transcripts)
//! are authenticated. The pre-shared key is SHA-256("loip psk v6" ‖ token): only a holder of
//! the token completes the third message (the worker checks it before anything past the
//! handshake) or seals the confirmation (the connecting side checks it before it reads a frame
//! larger than 64 KiB). The worker's second message comes before any proof of the token, so
//! anyone who connects learns the worker's static public key (it is not a secret). Each side
//! learns the other's static public key, proved by the DH
//! operations `es` and `se`: the coordinator pins the worker's ([`crate::net::known`]), and a
//! peer session names the device it comes from by it ([`crate::net::direct`]). Ephemeral keys
//! on both sides give forward secrecy (a token or static key leaked later does not decrypt
//! recorded sessions).
//!
//! A failure sends the peer an `Error` frame saying why (never a secret) where that helps,
//! and returns the error.

use snow::params::NoiseParams;
use snow::HandshakeState;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::net::identity::Identity;
use crate::net::session::SessionKeys;
use crate::wire::{self, Frame, FrameKind, Role, WireError, PROTOCOL_VERSION};

/// Largest frame either side accepts before the peer is authenticated, bytes.
pub const PRE_AUTH_FRAME: usize = 64 << 10;
/// How long a worker waits for the connecting side's hello, the first message of a handshake.
pub const HELLO_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// The Noise protocol of every session.
pub const NOISE: &str = "Noise_XXpsk3_25519_ChaChaPoly_BLAKE2s";
/// Largest Noise handshake message (the protocol's own bound), bytes.
const NOISE_MAX: usize = 65535;

/// What a handshake gives: the session's keys and the other side's static public key.
pub struct Handshake {
    /// the session's keys
    pub keys: SessionKeys,
    /// the other side's static X25519 public key, proved in the handshake
    pub remote: [u8; 32],
}

async fn send_error<W: AsyncWrite + Unpin>(wr: &mut W, msg: &str) {
    let _ = wire::write_frame(wr, FrameKind::Error, msg.as_bytes(), None).await;
}

/// The pre-shared key of a token.
fn psk(token: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"loip psk v6");
    h.update(token.as_bytes());
    h.finalize().into()
}

fn noise_err(what: &str, e: snow::Error) -> WireError {
    WireError::Protocol(format!("{what}: {e}"))
}

/// A Noise handshake state of this protocol for one side.
fn noise_state(
    token: &str,
    me: &Identity,
    hello_i: &[u8],
    hello_r: &[u8],
    initiator: bool,
) -> Result<HandshakeState, WireError> {
    let params: NoiseParams = NOISE
        .parse()
        .map_err(|e| noise_err("the Noise protocol name", e))?;
    let mut prologue = b"loip noise v6".to_vec();
    prologue.extend_from_slice(hello_i);
    prologue.extend_from_slice(hello_r);
    let key = psk(token);
    let b = snow::Builder::new(params)
        .local_private_key(me.private())
        .and_then(|b| b.psk(3, &key))
        .and_then(|b| b.prologue(&prologue))
        .map_err(|e| noise_err("the Noise handshake", e))?;
    let hs = if initiator {
        b.build_initiator()
    } else {
        b.build_responder()
    };
    hs.map_err(|e| noise_err("the Noise handshake", e))
}

/// Writes the next handshake message.
async fn write_msg<W: AsyncWrite + Unpin>(
    hs: &mut HandshakeState,
    wr: &mut W,
) -> Result<(), WireError> {
    let mut buf = vec![0u8; NOISE_MAX];
    let n = hs
        .write_message(&[], &mut buf)
        .map_err(|e| noise_err("writing a handshake message", e))?;
    wire::write_frame(wr, FrameKind::Handshake, &buf[..n], None).await
}

/// Reads a handshake message frame (an `Error` frame is the peer's refusal).
async fn read_msg<R: AsyncRead + Unpin>(rd: &mut R) -> Result<Frame, WireError> {
    let f = wire::read_frame(rd, PRE_AUTH_FRAME).await?;
    match f.kind {
        FrameKind::Handshake => Ok(f),
        FrameKind::Error => Err(WireError::Remote(
            String::from_utf8_lossy(&f.payload).into_owned(),
        )),
        k => Err(WireError::Protocol(format!(
            "expected a handshake message, got a {k:?} frame"
        ))),
    }
}

/// Feeds the peer's handshake message to the state. Noise messages carry no payload here:
/// one that does is refused.
pub fn read_noise(hs: &mut HandshakeState, msg: &[u8]) -> Result<(), WireError> {
    if msg.len() > NOISE_MAX {
        return Err(WireError::Protocol(
            "a handshake message over 64 KiB".into(),
        ));
    }
    let mut payload = vec![0u8; msg.len()];
    match hs.read_message(msg, &mut payload) {
        Ok(0) => Ok(()),
        Ok(_) => Err(WireError::Protocol(
            "a handshake message with a payload".into(),
        )),
        Err(e) => Err(noise_err("a bad handshake message", e)),
    }
}

/// The end of the handshake: the split and the remote static key.
fn finish(mut hs: HandshakeState) -> Result<Handshake, WireError> {
    let remote: [u8; 32] = hs
        .get_remote_static()
        .and_then(|k| k.try_into().ok())
        .ok_or_else(|| WireError::Protocol("the handshake gave no static key".into()))?;
    if !hs.is_handshake_finished() {
        return Err(WireError::Protocol("the handshake is not finished".into()));
    }
    let (i2r, r2i) = hs.dangerously_get_raw_split();
    Ok(Handshake {
        keys: SessionKeys::from_split(i2r, r2i),
        remote,
    })
}

/// The worker's side for a coordinator only (see [`accept_role`]).
pub async fn accept<R, W>(
    rd: &mut R,
    wr: &mut W,
    token: &str,
    me: &Identity,
) -> Result<Handshake, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    match accept_role(rd, wr, token, me).await? {
        (h, Role::Coordinator) => Ok(h),
        _ => Err(WireError::Protocol(
            "a peer where a coordinator was expected".into(),
        )),
    }
}

/// The worker's side: hellos, the three Noise messages (the third checked: the connecting
/// side holds the token), the sealed confirmation. Returns the session and the role the
/// connecting side's hello names (coordinator or peer).
pub async fn accept_role<R, W>(
    rd: &mut R,
    wr: &mut W,
    token: &str,
    me: &Identity,
) -> Result<(Handshake, Role), WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let hello_w = wire::hello_payload(Role::Worker, PROTOCOL_VERSION);
    wire::write_frame(wr, FrameKind::Hello, &hello_w, None).await?;
    // a connecting side sends its hello at once: a silent one gives its slot back early
    let hello = match tokio::time::timeout(HELLO_WAIT, wire::read_frame(rd, PRE_AUTH_FRAME)).await {
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
            return Err(WireError::Protocol(
                "a hello with no connecting role".into(),
            ));
        }
    };
    let mut hs = noise_state(token, me, &hello.payload, &hello_w, false)?;
    let first = read_msg(rd)
        .await
        .and_then(|m| read_noise(&mut hs, &m.payload));
    if let Err(e) = first {
        send_error(wr, &format!("refused: {e}")).await;
        return Err(e);
    }
    write_msg(&mut hs, wr).await?;
    let third = read_msg(rd).await?;
    if read_noise(&mut hs, &third.payload).is_err() {
        send_error(wr, "authentication failed: wrong token").await;
        let who = if role == Role::Peer {
            "peer"
        } else {
            "coordinator"
        };
        return Err(WireError::AuthRefused(format!(
            "a {who} gave a wrong token"
        )));
    }
    let mut h = finish(hs)?;
    let confirm = h.keys.seal_frame(Role::Worker, FrameKind::Handshake, &[])?;
    tokio::io::AsyncWriteExt::write_all(wr, &confirm).await?;
    tokio::io::AsyncWriteExt::flush(wr).await?;
    Ok((h, role))
}

/// The first frame's error from a server that is not a loip worker, said as such: its first
/// four bytes, read as a frame length, name what it speaks (`HTTP`, `SSH-`, text).
fn not_a_worker(e: WireError) -> WireError {
    let what = match e {
        WireError::TooLarge { len, .. } => match &(len as u32).to_le_bytes() {
            b"HTTP" => "it answered HTTP",
            b"SSH-" => "it answered SSH",
            b if b.iter().all(|c| c.is_ascii_graphic() || *c == b' ') => "it answered text",
            _ => "its first bytes are no loip frame",
        },
        WireError::BadKind(_) => "its first frame is of no loip kind",
        e => return e,
    };
    WireError::Protocol(format!(
        "not a loip worker ({what}): check the address and port"
    ))
}

/// The coordinator's side: hellos, the three Noise messages, the worker's sealed
/// confirmation checked.
pub async fn connect<R, W>(
    rd: &mut R,
    wr: &mut W,
    token: &str,
    me: &Identity,
) -> Result<Handshake, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    connect_as(rd, wr, token, me, Role::Coordinator).await
}

/// [`connect`] as `role`: the coordinator, or a worker opening a peer session.
pub async fn connect_as<R, W>(
    rd: &mut R,
    wr: &mut W,
    token: &str,
    me: &Identity,
    role: Role,
) -> Result<Handshake, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let hello_c = wire::hello_payload(role, PROTOCOL_VERSION);
    wire::write_frame(wr, FrameKind::Hello, &hello_c, None).await?;
    let hello = wire::read_frame(rd, PRE_AUTH_FRAME)
        .await
        .map_err(not_a_worker)?;
    wire::check_hello(&hello)?;
    if wire::hello_role(&hello) != Some(Role::Worker) {
        return Err(WireError::Protocol(
            "the peer does not answer as a worker".into(),
        ));
    }
    let mut hs = noise_state(token, me, &hello_c, &hello.payload, true)?;
    write_msg(&mut hs, wr).await?;
    let second = read_msg(rd).await?;
    read_noise(&mut hs, &second.payload)?;
    write_msg(&mut hs, wr).await?;
    let mut h = finish(hs)?;
    let confirm = match wire::read_frame(rd, PRE_AUTH_FRAME).await? {
        f if f.kind == FrameKind::Handshake => f,
        f if f.kind == FrameKind::Error => {
            let m = String::from_utf8_lossy(&f.payload).into_owned();
            return Err(if m.contains("authentication") {
                WireError::AuthRefused(m)
            } else {
                WireError::Remote(m)
            });
        }
        f => {
            return Err(WireError::Protocol(format!(
                "expected the worker's confirmation, got a {:?} frame",
                f.kind
            )))
        }
    };
    match h.keys.open_frame(role, confirm) {
        Ok(f) if f.payload.is_empty() => Ok(h),
        _ => Err(WireError::AuthRefused(
            "the worker does not hold the shared token".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn a_server_that_is_not_a_worker_is_named_for_what_it_speaks() {
        for (answer, says) in [
            (&b"HTTP/1.1 400 Bad Request\r\n\r\n"[..], "it answered HTTP"),
            (&b"SSH-2.0-OpenSSH_9.6\r\n"[..], "it answered SSH"),
            (&b"220 smtp ready\r\n"[..], "it answered text"),
        ] {
            let e = rt().block_on(async {
                use tokio::io::AsyncWriteExt;
                let (c_side, mut server) = tokio::io::duplex(1 << 16);
                server.write_all(answer).await.unwrap();
                let (mut rd, mut wr) = tokio::io::split(c_side);
                let me = Identity::generate();
                connect(&mut rd, &mut wr, "a-token-of-some-length", &me)
                    .await
                    .err()
                    .unwrap()
            });
            let msg = e.to_string();
            assert!(
                msg.contains("not a loip worker") && msg.contains(says),
                "{msg}"
            );
        }
    }

    /// Runs both sides over in-memory pipes, the connecting side's bytes passed through `edit`
    /// (a man in the middle).
    async fn run(
        token_c: &'static str,
        token_w: &'static str,
        role: Role,
        edit: fn(&mut Vec<u8>),
    ) -> (
        Result<Handshake, WireError>,
        Result<(Handshake, Role), WireError>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (c_side, mitm_c) = tokio::io::duplex(1 << 16);
        let (mitm_w, w_side) = tokio::io::duplex(1 << 16);
        let (mut from_c, mut to_c) = tokio::io::split(mitm_c);
        let (mut from_w, mut to_w) = tokio::io::split(mitm_w);
        // the connecting side's bytes go through frame by frame, each edited; the worker's
        // as they are
        let up = tokio::spawn(async move {
            loop {
                let mut f = vec![0u8; 5];
                if from_c.read_exact(&mut f).await.is_err() {
                    return;
                }
                let len = u32::from_le_bytes([f[0], f[1], f[2], f[3]]) as usize;
                f.resize(5 + len, 0);
                if from_c.read_exact(&mut f[5..]).await.is_err() {
                    return;
                }
                edit(&mut f);
                if to_w.write_all(&f).await.is_err() {
                    return;
                }
            }
        });
        let down = tokio::spawn(async move {
            let _ = tokio::io::copy(&mut from_w, &mut to_c).await;
        });
        let (ci, wi) = (Identity::generate(), Identity::generate());
        let (ci_pub, wi_pub) = (ci.public(), wi.public());
        let (mut cr, mut cw) = tokio::io::split(c_side);
        let (mut wr, mut ww) = tokio::io::split(w_side);
        // each side's pipe closes when it is done, so the other never waits for it
        let c = async move { connect_as(&mut cr, &mut cw, token_c, &ci, role).await };
        let w = async move { accept_role(&mut wr, &mut ww, token_w, &wi).await };
        let (c, w) = tokio::join!(c, w);
        up.abort();
        down.abort();
        if let (Ok(c), Ok((w, _))) = (&c, &w) {
            assert_eq!(c.remote, wi_pub);
            assert_eq!(w.remote, ci_pub);
        }
        (c, w)
    }

    #[test]
    fn the_token_is_proved_both_ways_and_static_keys_are_learnt() {
        rt().block_on(async {
            let (c, w) = run("t", "t", Role::Peer, |_| {}).await;
            assert!(c.is_ok(), "{:?}", c.err());
            assert_eq!(w.unwrap().1, Role::Peer);
            let (c, w) = run("t", "other", Role::Coordinator, |_| {}).await;
            let (c, w) = (c.err().unwrap().to_string(), w.err().unwrap().to_string());
            assert!(c.contains("wrong token"), "{c}");
            assert!(w.contains("wrong token"), "{w}");
        });
    }

    #[test]
    fn hellos_are_bound_a_rewritten_role_fails() {
        rt().block_on(async {
            // a man in the middle turns a peer's hello into a coordinator's
            let (c, w) = run("t", "t", Role::Peer, |f| {
                if f[4] == FrameKind::Hello as u8 {
                    f[5 + 8] = Role::Coordinator as u8;
                }
            })
            .await;
            assert!(c.is_err() && w.is_err(), "{:?} {:?}", c.err(), w.err());
        });
    }
}
