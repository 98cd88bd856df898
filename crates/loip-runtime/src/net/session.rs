//! Authenticated, encrypted sessions between a coordinator and a worker.
//!
//! After both `Hello` frames (plaintext, at most 64 KiB each, as every frame before
//! authentication), the two sides run this handshake:
//!
//! ```text
//! W → C  Challenge { nonce_w, key_w }        32 random bytes; an ephemeral X25519 public key
//! C → W  Auth { nonce_c, key_c, mac_c }      mac_c = HMAC(k_auth, "coordinator" ‖ transcript)
//! W → C  Proof { mac_w }                      mac_w = HMAC(k_auth, "worker" ‖ transcript)
//! ```
//!
//! with
//!
//! ```text
//! transcript = SHA-256(hello_c ‖ hello_w ‖ nonce_w ‖ key_w ‖ nonce_c ‖ key_c)
//! prk        = HKDF-Extract(salt = transcript, ikm = SHA-256(token) ‖ X25519(e_w, e_c))
//! k_auth, k_c→w, k_w→c = HKDF-Expand(prk, "loip v3 auth" | "loip v3 c2w" | "loip v3 w2c")
//! ```
//!
//! A worker connecting to another worker (direct forwarding) runs the same handshake in the
//! coordinator's place with role `peer`: its hello says so and its MAC is labelled "peer",
//! so a coordinator's proof cannot open a peer session nor a peer's a coordinator session.
//!
//! Each MAC binds both roles (different labels, so a reflected MAC is refused), both nonces,
//! both ephemeral keys and both hellos. Only a peer that holds the token can compute
//! `k_auth`; a man in the middle without it cannot complete either side, and the ephemeral
//! Diffie-Hellman gives forward secrecy (a token leaked later does not decrypt recorded
//! sessions). A worker checks the coordinator's MAC before it answers anything else; the
//! coordinator checks the worker's before it reads a frame larger than 64 KiB.
//!
//! Then every frame in both directions is sealed with ChaCha20-Poly1305:
//! `[u32 LE len][u8 kind][ciphertext ‖ 16-byte tag]`, `len` = payload + 16, one key per
//! direction, the nonce a per-direction frame counter (0, 1, 2, …) that is never sent, and
//! the 5 header bytes as associated data. A modified, injected, dropped, replayed or
//! reordered frame fails its tag ([`WireError::Tampered`]) and the session closes.
//!
//! Without a token (allowed on loopback only) the key schedule runs with the empty token:
//! frames are still encrypted against passive listeners, but anyone who can connect can
//! authenticate.

use std::time::Duration;

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce, Tag};
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::net::throttle::Throttle;
use crate::wire::{Frame, FrameKind, Role, WireError, HEADER_BYTES};

/// Bytes of the AEAD tag appended to every sealed payload.
pub const TAG_BYTES: usize = 16;
/// Bytes of a handshake nonce and of an X25519 public key.
pub const KEY_BYTES: usize = 32;

type HmacSha256 = Hmac<Sha256>;

/// One side's fresh handshake material: a random nonce and an ephemeral X25519 key.
pub struct Ephemeral {
    secret: x25519_dalek::EphemeralSecret,
    /// the public key sent to the peer
    pub public: [u8; KEY_BYTES],
    /// the nonce sent to the peer
    pub nonce: [u8; KEY_BYTES],
}

impl Ephemeral {
    /// Fresh material from the operating system's random source.
    pub fn new() -> Ephemeral {
        let secret = x25519_dalek::EphemeralSecret::random_from_rng(rand::rngs::OsRng);
        let public = x25519_dalek::PublicKey::from(&secret).to_bytes();
        Ephemeral {
            secret,
            public,
            nonce: rand::random(),
        }
    }
}

impl Default for Ephemeral {
    fn default() -> Self {
        Ephemeral::new()
    }
}

/// What both sides put into the transcript hash, in this order.
pub struct TranscriptParts<'a> {
    /// the coordinator's hello payload
    pub hello_c: &'a [u8],
    /// the worker's hello payload
    pub hello_w: &'a [u8],
    /// the worker's nonce
    pub nonce_w: &'a [u8; KEY_BYTES],
    /// the worker's ephemeral public key
    pub key_w: &'a [u8; KEY_BYTES],
    /// the coordinator's nonce
    pub nonce_c: &'a [u8; KEY_BYTES],
    /// the coordinator's ephemeral public key
    pub key_c: &'a [u8; KEY_BYTES],
}

/// The keys of one session.
pub struct SessionKeys {
    auth: [u8; 32],
    c2w: [u8; 32],
    w2c: [u8; 32],
    transcript: [u8; 32],
}

impl SessionKeys {
    /// Finishes the key schedule: `ours` is this side's ephemeral, `their_key` the peer's
    /// public key. A low-order peer key (all-zero shared secret) is refused.
    pub fn derive(
        token: &str,
        ours: Ephemeral,
        their_key: &[u8; KEY_BYTES],
        parts: &TranscriptParts<'_>,
    ) -> Result<SessionKeys, WireError> {
        let shared = ours
            .secret
            .diffie_hellman(&x25519_dalek::PublicKey::from(*their_key));
        if !shared.was_contributory() {
            return Err(WireError::AuthRefused(
                "the peer's key exchange value is invalid".into(),
            ));
        }
        let mut t = Sha256::new();
        for p in [
            parts.hello_c,
            parts.hello_w,
            &parts.nonce_w[..],
            &parts.key_w[..],
            &parts.nonce_c[..],
            &parts.key_c[..],
        ] {
            t.update((p.len() as u32).to_le_bytes());
            t.update(p);
        }
        let transcript: [u8; 32] = t.finalize().into();
        let mut ikm = Sha256::digest(token.as_bytes()).to_vec();
        ikm.extend_from_slice(shared.as_bytes());
        let hk = Hkdf::<Sha256>::new(Some(&transcript), &ikm);
        let mut keys = SessionKeys {
            auth: [0; 32],
            c2w: [0; 32],
            w2c: [0; 32],
            transcript,
        };
        for (label, out) in [
            (&b"loip v3 auth"[..], &mut keys.auth),
            (&b"loip v3 c2w"[..], &mut keys.c2w),
            (&b"loip v3 w2c"[..], &mut keys.w2c),
        ] {
            hk.expand(label, out)
                .map_err(|_| WireError::Protocol("key derivation failed".into()))?;
        }
        Ok(keys)
    }

    fn mac_of(&self, role: Role) -> HmacSha256 {
        let label: &[u8] = match role {
            Role::Coordinator => b"coordinator",
            Role::Worker => b"worker",
            Role::Peer => b"peer",
        };
        // HMAC takes keys of any length; 32 bytes cannot fail.
        let mut m = <HmacSha256 as Mac>::new_from_slice(&self.auth)
            .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
        m.update(label);
        m.update(&self.transcript);
        m
    }

    /// The proof `role` sends: HMAC(k_auth, role label ‖ transcript), hex.
    pub fn proof(&self, role: Role) -> String {
        crate::wire::hex(&self.mac_of(role).finalize().into_bytes())
    }

    /// Checks `role`'s proof in constant time.
    pub fn verify(&self, role: Role, proof_hex: &str) -> bool {
        match unhex::<32>(proof_hex) {
            Some(b) => self.mac_of(role).verify_slice(&b).is_ok(),
            None => false,
        }
    }

    /// Seals this side's connection halves: `role` is this side.
    pub fn seal<R, W>(
        &self,
        role: Role,
        rd: R,
        wr: W,
        throttle: Option<Throttle>,
    ) -> (SealedReader<R>, SealedWriter<W>) {
        let (send, recv) = match role {
            // the connecting side, coordinator or peer, sends with c2w
            Role::Coordinator | Role::Peer => (&self.c2w, &self.w2c),
            Role::Worker => (&self.w2c, &self.c2w),
        };
        (
            SealedReader {
                inner: rd,
                aead: ChaCha20Poly1305::new(Key::from_slice(recv)),
                counter: 0,
                idle: None,
            },
            SealedWriter {
                inner: wr,
                aead: ChaCha20Poly1305::new(Key::from_slice(send)),
                counter: 0,
                throttle,
                buf: Vec::new(),
            },
        )
    }
}

/// Decodes `N` bytes of lower-case or upper-case hex.
pub fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let b = s.as_bytes();
    if b.len() != 2 * N {
        return None;
    }
    let nib = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (nib(b[2 * i])? << 4) | nib(b[2 * i + 1])?;
    }
    Some(out)
}

fn nonce_of(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    *Nonce::from_slice(&n)
}

fn header(len: usize, kind: FrameKind) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(&(len as u32).to_le_bytes());
    h[4] = kind as u8;
    h
}

/// The reading half of a sealed session.
pub struct SealedReader<R> {
    inner: R,
    aead: ChaCha20Poly1305,
    counter: u64,
    idle: Option<Duration>,
}

impl<R: AsyncRead + Unpin> SealedReader<R> {
    /// Fails a read when no byte arrives for `idle` (None: wait forever). The limit applies
    /// to each read of the socket, so a slow but steady transfer never trips it.
    pub fn set_idle_timeout(&mut self, idle: Option<Duration>) {
        self.idle = idle;
    }

    async fn fill(&mut self, buf: &mut [u8], what: &'static str) -> Result<(), WireError> {
        let mut got = 0;
        while got < buf.len() {
            let read = self.inner.read(&mut buf[got..]);
            let n = match self.idle {
                Some(t) => tokio::time::timeout(t, read)
                    .await
                    .map_err(|_| WireError::Timeout(t, what))??,
                None => read.await?,
            };
            if n == 0 {
                return Err(if got == 0 && what == "the next frame" {
                    WireError::Closed
                } else {
                    WireError::Protocol(format!("truncated frame ({what})"))
                });
            }
            got += n;
        }
        Ok(())
    }

    /// Reads the next frame's header: its kind and plaintext payload length, which is at most
    /// `max` (checked before anything is allocated).
    pub async fn read_header(&mut self, max: usize) -> Result<(FrameKind, usize), WireError> {
        let mut head = [0u8; HEADER_BYTES];
        self.fill(&mut head, "the next frame").await?;
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let kind = FrameKind::from_u8(head[4]).ok_or(WireError::BadKind(head[4]))?;
        if len < TAG_BYTES {
            return Err(WireError::Tampered);
        }
        if len - TAG_BYTES > max {
            return Err(WireError::TooLarge {
                len: (len - TAG_BYTES) as u64,
                max,
            });
        }
        Ok((kind, len - TAG_BYTES))
    }

    /// Reads and opens the payload announced by [`SealedReader::read_header`].
    pub async fn read_body(&mut self, kind: FrameKind, len: usize) -> Result<Frame, WireError> {
        let mut payload = vec![0u8; len];
        self.fill(&mut payload, "a frame's payload").await?;
        let mut tag = [0u8; TAG_BYTES];
        self.fill(&mut tag, "a frame's tag").await?;
        let aad = header(len + TAG_BYTES, kind);
        self.aead
            .decrypt_in_place_detached(
                &nonce_of(self.counter),
                &aad,
                &mut payload,
                Tag::from_slice(&tag),
            )
            .map_err(|_| WireError::Tampered)?;
        self.counter += 1;
        Ok(Frame { kind, payload })
    }

    /// Reads one frame of at most `max` payload bytes.
    pub async fn read(&mut self, max: usize) -> Result<Frame, WireError> {
        let (kind, len) = self.read_header(max).await?;
        self.read_body(kind, len).await
    }

    /// [`SealedReader::read`] within `timeout`.
    pub async fn read_timeout(
        &mut self,
        max: usize,
        timeout: Duration,
        what: &'static str,
    ) -> Result<Frame, WireError> {
        tokio::time::timeout(timeout, self.read(max))
            .await
            .map_err(|_| WireError::Timeout(timeout, what))?
    }
}

/// The writing half of a sealed session.
pub struct SealedWriter<W> {
    inner: W,
    aead: ChaCha20Poly1305,
    counter: u64,
    throttle: Option<Throttle>,
    buf: Vec<u8>, // header + ciphertext + tag of the frame being written; reused
}

impl<W: AsyncWrite + Unpin> SealedWriter<W> {
    /// The socket underneath (bytes written here bypass the seal: tests inject with it).
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    /// Seals and writes one frame (after waiting for the throttle's budget, if any).
    pub async fn write(&mut self, kind: FrameKind, payload: &[u8]) -> Result<(), WireError> {
        if payload.len() > crate::wire::MAX_FRAME {
            return Err(WireError::TooLarge {
                len: payload.len() as u64,
                max: crate::wire::MAX_FRAME,
            });
        }
        let len = payload.len() + TAG_BYTES;
        if let Some(t) = &self.throttle {
            t.take(HEADER_BYTES + len).await;
        }
        let head = header(len, kind);
        self.buf.clear();
        self.buf.extend_from_slice(&head);
        self.buf.extend_from_slice(payload);
        let tag = self
            .aead
            .encrypt_in_place_detached(
                &nonce_of(self.counter),
                &head,
                &mut self.buf[HEADER_BYTES..],
            )
            .map_err(|_| WireError::Protocol("encryption failed".into()))?;
        self.counter += 1;
        self.buf.extend_from_slice(&tag);
        self.inner.write_all(&self.buf).await?;
        self.inner.flush().await?;
        if self.buf.capacity() > 1 << 20 {
            self.buf = Vec::new(); // do not keep a large frame's buffer between frames
        }
        Ok(())
    }
}

/// Turns on TCP keepalive (probes after 30 s of silence, every 10 s, 6 of them), so a peer
/// whose host vanished is noticed in about 90 s even while a request is pending.
pub fn keepalive(stream: &tokio::net::TcpStream) {
    let ka = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(30))
        .with_interval(Duration::from_secs(10))
        .with_retries(6);
    let s = socket2::SockRef::from(stream);
    if let Err(e) = s.set_tcp_keepalive(&ka) {
        tracing::debug!("TCP keepalive not set: {e}");
    }
    let _ = stream.set_nodelay(true);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(token_c: &str, token_w: &str) -> (SessionKeys, SessionKeys) {
        let (ec, ew) = (Ephemeral::new(), Ephemeral::new());
        let (nc, kc, nw, kw) = (ec.nonce, ec.public, ew.nonce, ew.public);
        let parts = TranscriptParts {
            hello_c: b"hc",
            hello_w: b"hw",
            nonce_w: &nw,
            key_w: &kw,
            nonce_c: &nc,
            key_c: &kc,
        };
        let c = SessionKeys::derive(token_c, ec, &kw, &parts).unwrap();
        let w = SessionKeys::derive(token_w, ew, &kc, &parts).unwrap();
        (c, w)
    }

    #[test]
    fn proofs_bind_the_token_and_the_role() {
        let (c, w) = pair("t", "t");
        assert!(w.verify(Role::Coordinator, &c.proof(Role::Coordinator)));
        assert!(c.verify(Role::Worker, &w.proof(Role::Worker)));
        // a reflected proof (the other role's) is refused
        assert!(!w.verify(Role::Worker, &c.proof(Role::Coordinator)));
        assert!(!c.verify(Role::Coordinator, &w.proof(Role::Worker)));
        let (c, w) = pair("t", "other");
        assert!(!w.verify(Role::Coordinator, &c.proof(Role::Coordinator)));
        assert!(!w.verify(Role::Coordinator, "zz"));
    }

    #[test]
    fn sealed_frames_round_trip_and_tampering_is_refused() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (c, w) = pair("t", "t");
            let (a, b) = tokio::io::duplex(1 << 20);
            let (ar, aw) = tokio::io::split(a);
            let (br, bw) = tokio::io::split(b);
            let (_cr, mut cw) = c.seal(Role::Coordinator, ar, aw, None);
            let (mut wr, _ww) = w.seal(Role::Worker, br, bw, None);
            for i in 0..3u8 {
                cw.write(FrameKind::Step, &[i; 1000]).await.unwrap();
                let f = wr.read(1 << 20).await.unwrap();
                assert_eq!((f.kind, f.payload), (FrameKind::Step, vec![i; 1000]));
            }
        });
        rt.block_on(async {
            // a flipped byte, a replayed frame and a changed kind are all refused
            for attack in 0..3 {
                let (c, w) = pair("t", "t");
                let (mut raw_w, raw_r) = tokio::io::duplex(1 << 20);
                let (mut buf_r, buf_w) = tokio::io::duplex(1 << 20);
                let (_u, mut cw) = c.seal(Role::Coordinator, tokio::io::empty(), buf_w, None);
                cw.write(FrameKind::Control, b"hello").await.unwrap();
                drop(cw);
                let mut bytes = Vec::new();
                buf_r.read_to_end(&mut bytes).await.unwrap();
                let mut stream = bytes.clone();
                match attack {
                    0 => stream[HEADER_BYTES + 1] ^= 1,
                    1 => stream.extend_from_slice(&bytes), // the same frame again
                    _ => stream[4] = FrameKind::Step as u8,
                }
                raw_w.write_all(&stream).await.unwrap();
                drop(raw_w);
                let (mut wr, _ww) = w.seal(Role::Worker, raw_r, tokio::io::sink(), None);
                let first = wr.read(1 << 20).await;
                if attack == 1 {
                    assert_eq!(first.unwrap().payload, b"hello");
                    assert!(matches!(wr.read(1 << 20).await, Err(WireError::Tampered)));
                } else {
                    assert!(matches!(first, Err(WireError::Tampered)), "{first:?}");
                }
            }
        });
    }
}
