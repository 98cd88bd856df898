//! Sealed sessions between a coordinator and a worker, or between two workers (direct
//! forwarding), after the Noise handshake of [`crate::net::handshake`].
//!
//! The handshake (`Noise_XXpsk3_25519_ChaChaPoly_BLAKE2s`, the pre-shared key derived from the
//! token, both `Hello` frames as the prologue) ends in Noise's `Split()`: one ChaCha20-Poly1305
//! key per direction. Every later frame is sealed with them as a Noise `CipherState` would,
//! `EncryptWithAd(header, payload)`, in the frame layout of the wire protocol:
//! `[u32 LE len][u8 kind][ciphertext ‖ 16-byte tag]`, `len` = payload + 16, the nonce the
//! direction's frame counter (0, 1, 2, …, 32 zero bits then the u64 LE counter, as Noise's
//! ChaChaPoly) that is never sent, and the 5 header bytes as associated data. Unlike Noise's
//! transport messages a frame may be larger than 64 KiB (up to [`crate::wire::MAX_FRAME`]),
//! so the keys are taken from the split rather than from snow's transport state. A modified,
//! injected, dropped, replayed or reordered frame fails its tag ([`WireError::Tampered`]) and
//! the session closes.
//!
//! Without a token (allowed on loopback only) the pre-shared key is the empty token's: frames
//! are still encrypted against passive listeners and each side still proves its static key,
//! but anyone who can connect can authenticate.

use std::time::Duration;

use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce, Tag};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::net::throttle::Throttle;
use crate::wire::{Frame, FrameKind, Role, WireError, HEADER_BYTES};

/// Bytes of the AEAD tag appended to every sealed payload.
pub const TAG_BYTES: usize = 16;
/// Bytes of a session key.
pub const KEY_BYTES: usize = 32;

/// One direction of a session: its key and the frames it has used.
type Direction<'a> = (&'a [u8; KEY_BYTES], &'a mut u64);

/// The keys of one session: Noise's split, and how many frames each direction already used
/// during the handshake (the sealed confirmation), so the counters go on from there.
pub struct SessionKeys {
    i2r: [u8; KEY_BYTES], // the connecting side (coordinator or peer) → the accepting worker
    r2i: [u8; KEY_BYTES],
    i2r_used: u64,
    r2i_used: u64,
}

impl SessionKeys {
    /// The keys of Noise's `Split()`: initiator → responder, responder → initiator.
    pub(crate) fn from_split(i2r: [u8; KEY_BYTES], r2i: [u8; KEY_BYTES]) -> SessionKeys {
        SessionKeys {
            i2r,
            r2i,
            i2r_used: 0,
            r2i_used: 0,
        }
    }

    /// `role`'s sending key and counter, then its receiving key and counter.
    fn sides(&mut self, role: Role) -> (Direction<'_>, Direction<'_>) {
        match role {
            // the connecting side, coordinator or peer, sends with i2r
            Role::Coordinator | Role::Peer => (
                (&self.i2r, &mut self.i2r_used),
                (&self.r2i, &mut self.r2i_used),
            ),
            Role::Worker => (
                (&self.r2i, &mut self.r2i_used),
                (&self.i2r, &mut self.i2r_used),
            ),
        }
    }

    /// One whole sealed frame (header, ciphertext, tag) from `role`, for the handshake's
    /// confirmation; the session's writer goes on with the next counter.
    pub(crate) fn seal_frame(
        &mut self,
        role: Role,
        kind: FrameKind,
        payload: &[u8],
    ) -> Result<Vec<u8>, WireError> {
        let ((key, used), _) = self.sides(role);
        let aead = ChaCha20Poly1305::new(Key::from_slice(key));
        let mut buf = Vec::with_capacity(HEADER_BYTES + payload.len() + TAG_BYTES);
        seal_into(&aead, *used, kind, payload, &mut buf)?;
        *used += 1;
        Ok(buf)
    }

    /// Opens a sealed frame read as a plain one ([`crate::wire::read_frame`]) during the
    /// handshake; the session's reader goes on with the next counter.
    pub(crate) fn open_frame(&mut self, role: Role, f: Frame) -> Result<Frame, WireError> {
        let (_, (key, used)) = self.sides(role);
        let aead = ChaCha20Poly1305::new(Key::from_slice(key));
        let Frame { kind, mut payload } = f;
        if payload.len() < TAG_BYTES {
            return Err(WireError::Tampered);
        }
        let tag = payload.split_off(payload.len() - TAG_BYTES);
        open_in_place(&aead, *used, kind, &mut payload, &tag)?;
        *used += 1;
        Ok(Frame { kind, payload })
    }

    /// Seals this side's connection halves: `role` is this side.
    pub fn seal<R, W>(
        mut self,
        role: Role,
        rd: R,
        wr: W,
        throttle: Option<Throttle>,
    ) -> (SealedReader<R>, SealedWriter<W>) {
        let ((send, sent), (recv, received)) = self.sides(role);
        (
            SealedReader {
                inner: rd,
                aead: ChaCha20Poly1305::new(Key::from_slice(recv)),
                counter: *received,
                idle: None,
            },
            SealedWriter {
                inner: wr,
                aead: ChaCha20Poly1305::new(Key::from_slice(send)),
                counter: *sent,
                throttle,
                buf: Vec::new(),
            },
        )
    }
}

/// Appends the sealed frame of `payload` (header, ciphertext, tag) to `buf`.
fn seal_into(
    aead: &ChaCha20Poly1305,
    counter: u64,
    kind: FrameKind,
    payload: &[u8],
    buf: &mut Vec<u8>,
) -> Result<(), WireError> {
    if payload.len() > crate::wire::MAX_FRAME {
        return Err(WireError::TooLarge {
            len: payload.len() as u64,
            max: crate::wire::MAX_FRAME,
        });
    }
    let head = header(payload.len() + TAG_BYTES, kind);
    let at = buf.len();
    buf.extend_from_slice(&head);
    buf.extend_from_slice(payload);
    let tag = aead
        .encrypt_in_place_detached(&nonce_of(counter), &head, &mut buf[at + HEADER_BYTES..])
        .map_err(|_| WireError::Protocol("encryption failed".into()))?;
    buf.extend_from_slice(&tag);
    Ok(())
}

/// Opens `payload` (ciphertext of `kind`, its tag apart) in place.
fn open_in_place(
    aead: &ChaCha20Poly1305,
    counter: u64,
    kind: FrameKind,
    payload: &mut [u8],
    tag: &[u8],
) -> Result<(), WireError> {
    let aad = header(payload.len() + TAG_BYTES, kind);
    aead.decrypt_in_place_detached(&nonce_of(counter), &aad, payload, Tag::from_slice(tag))
        .map_err(|_| WireError::Tampered)
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
        open_in_place(&self.aead, self.counter, kind, &mut payload, &tag)?;
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
        if let Some(t) = &self.throttle {
            t.take(HEADER_BYTES + payload.len() + TAG_BYTES).await;
        }
        self.buf.clear();
        seal_into(&self.aead, self.counter, kind, payload, &mut self.buf)?;
        self.counter += 1;
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

    fn pair() -> (SessionKeys, SessionKeys) {
        let (a, b): ([u8; 32], [u8; 32]) = (rand::random(), rand::random());
        (SessionKeys::from_split(a, b), SessionKeys::from_split(a, b))
    }

    #[test]
    fn sealed_frames_round_trip_and_tampering_is_refused() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (mut c, w) = pair();
            // a frame sealed during the handshake moves the counter on
            let first = c
                .seal_frame(Role::Coordinator, FrameKind::Control, b"first")
                .unwrap();
            let (a, b) = tokio::io::duplex(1 << 20);
            let (ar, aw) = tokio::io::split(a);
            let (br, bw) = tokio::io::split(b);
            let (_cr, mut cw) = c.seal(Role::Coordinator, ar, aw, None);
            let (mut wr, _ww) = w.seal(Role::Worker, br, bw, None);
            cw.get_mut().write_all(&first).await.unwrap();
            assert_eq!(wr.read(1 << 20).await.unwrap().payload, b"first");
            for i in 0..3u8 {
                cw.write(FrameKind::Step, &[i; 1000]).await.unwrap();
                let f = wr.read(1 << 20).await.unwrap();
                assert_eq!((f.kind, f.payload), (FrameKind::Step, vec![i; 1000]));
            }
        });
        rt.block_on(async {
            // a flipped byte, a replayed frame and a changed kind are all refused
            for attack in 0..3 {
                let (c, w) = pair();
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

    #[test]
    fn a_frame_opened_in_the_handshake_is_checked() {
        let (mut c, mut w) = pair();
        let sealed = c
            .seal_frame(Role::Coordinator, FrameKind::Control, b"x")
            .unwrap();
        let mut f = crate::wire::Frame {
            kind: FrameKind::Control,
            payload: sealed[HEADER_BYTES..].to_vec(),
        };
        f.payload[0] ^= 1;
        assert!(matches!(
            w.open_frame(Role::Worker, f),
            Err(WireError::Tampered)
        ));
        let short = crate::wire::Frame {
            kind: FrameKind::Control,
            payload: vec![0; 3],
        };
        assert!(matches!(
            w.open_frame(Role::Worker, short),
            Err(WireError::Tampered)
        ));
    }
}
