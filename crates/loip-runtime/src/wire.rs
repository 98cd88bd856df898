//! The wire protocol between the coordinator and its workers.
//!
//! Every message is one frame: `[u32 LE payload_len][u8 kind][payload]`, with
//! `payload_len ≤ MAX_FRAME` (64 MiB). A reader never allocates more than the bound and
//! never trusts a length it has not checked; a malformed frame is an error for that
//! connection only (the caller closes it), never a panic.
//!
//! | kind | payload |
//! |---|---|
//! | `Hello` | `b"LOIP"`, u32 LE protocol version, u8 role (0 coordinator, 1 worker, 2 peer: a worker connecting to another) |
//! | `Control` | JSON of [`ToWorker`] or [`ToCoordinator`] |
//! | `Step` | binary [`StepHeader`] then the step's input: u32 LE token ids (embed) or f32 LE hidden rows |
//! | `Output` | binary [`OutputHeader`] then f32 LE rows (hidden states or logits), or (u32 LE id, f32 LE logit) per row (argmax) |
//! | `SliceData` | raw bytes of the slice announced by the last [`ToWorker::PutSlice`] (≤ 8 MiB each) |
//! | `Bulk` | filler bytes of a bandwidth measurement |
//! | `Error` | UTF-8 text; the sender closes the connection after it |
//! | `Routed` | a `Step` payload behind where its input comes from and its output goes ([`crate::net::direct`]) |
//! | `Hand` | a peer's hidden rows for one hop of a step, worker to worker ([`crate::net::direct`]) |
//! | `Notice` | a worker's small per-hop receipt after it handed rows to a peer ([`crate::net::direct`]) |
//!
//! | `Handshake` | a Noise handshake message, or the worker's sealed confirmation ([`crate::net::handshake`]) |
//!
//! Session: both sides send `Hello` first; a peer with another magic or version is refused
//! with an `Error` frame naming both versions. Then the Noise handshake of
//! [`crate::net::handshake`] (`Noise_XXpsk3_25519_ChaChaPoly_BLAKE2s`: static keys both ways,
//! the pre-shared key from the token, both hellos as the prologue) and every later frame is
//! sealed with ChaCha20-Poly1305 in the same `[len][kind][payload]` layout, `len` counting the
//! 16-byte tag ([`crate::net::session`]). Frames before authentication are at most 64 KiB.
//!
//! Lossless: activations travel as the exact bytes of little-endian f32 values; nothing on
//! the wire is ever rounded, quantized or compressed.

use std::time::Duration;

use loip_model::slice::{Manifest, SliceEntry};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::executor::{DeviceSpec, MemoryReport, StageSpec};
use crate::net::throttle::Throttle;

/// Magic of the `Hello` frame.
pub const MAGIC: [u8; 4] = *b"LOIP";
/// Version of this protocol; peers must match exactly.
pub const PROTOCOL_VERSION: u32 = 7;
/// Largest payload of one frame, bytes.
pub const MAX_FRAME: usize = 64 << 20;
/// Largest `SliceData` chunk, bytes.
pub const SLICE_CHUNK: usize = 1 << 20;
/// Bytes of a frame header (length + kind).
pub const HEADER_BYTES: usize = 5;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// version handshake
    Hello = 1,
    /// JSON control message
    Control = 2,
    /// a step for a worker: header + input rows
    Step = 3,
    /// a worker's result: header + output rows
    Output = 4,
    /// bytes of a slice file being shipped
    SliceData = 5,
    /// bandwidth-measurement filler
    Bulk = 6,
    /// a fatal error message; the connection closes after it
    Error = 7,
    /// a routed step for a worker (direct forwarding)
    Routed = 8,
    /// hidden rows from one worker to the next
    Hand = 9,
    /// a worker's per-hop receipt to the coordinator
    Notice = 10,
    /// lent KV rows (see [`lend`])
    Kv = 11,
    /// a Noise handshake message ([`crate::net::handshake`])
    Handshake = 12,
}

impl FrameKind {
    /// The kind of a header's kind byte, if it is one.
    pub fn from_u8(k: u8) -> Option<FrameKind> {
        Some(match k {
            1 => FrameKind::Hello,
            2 => FrameKind::Control,
            3 => FrameKind::Step,
            4 => FrameKind::Output,
            5 => FrameKind::SliceData,
            6 => FrameKind::Bulk,
            7 => FrameKind::Error,
            8 => FrameKind::Routed,
            9 => FrameKind::Hand,
            10 => FrameKind::Notice,
            11 => FrameKind::Kv,
            12 => FrameKind::Handshake,
            _ => return None,
        })
    }
}

/// One frame.
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    /// its kind
    pub kind: FrameKind,
    /// its payload (at most [`MAX_FRAME`] bytes)
    pub payload: Vec<u8>,
}

/// A connection error that names the device: every network failure the coordinator reports
/// is one of these.
#[derive(Debug, Error)]
#[error("device {device} ({addr}): {source}")]
pub struct NetError {
    /// device name
    pub device: String,
    /// its address
    pub addr: String,
    /// what went wrong
    #[source]
    pub source: WireError,
}

impl NetError {
    /// Wraps `source` with the device's identity.
    pub fn new(device: &str, addr: &str, source: WireError) -> NetError {
        NetError {
            device: device.to_string(),
            addr: addr.to_string(),
            source,
        }
    }
}

/// Reads one frame, refusing payloads over `max` bytes before allocating.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max: usize) -> Result<Frame, WireError> {
    let mut head = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        let n = r.read(&mut head[got..]).await?;
        if n == 0 {
            return Err(if got == 0 {
                WireError::Closed
            } else {
                WireError::Protocol("truncated frame header".into())
            });
        }
        got += n;
    }
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as u64;
    if len > max as u64 {
        return Err(WireError::TooLarge { len, max });
    }
    let kind = FrameKind::from_u8(head[4]).ok_or(WireError::BadKind(head[4]))?;
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)
        .await
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => {
                WireError::Protocol(format!("truncated frame: {len} bytes announced"))
            }
            _ => WireError::Io(e),
        })?;
    Ok(Frame { kind, payload })
}

/// Reads one frame within `timeout`.
pub async fn read_frame_timeout<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    timeout: Duration,
    what: &'static str,
) -> Result<Frame, WireError> {
    tokio::time::timeout(timeout, read_frame(r, max))
        .await
        .map_err(|_| WireError::Timeout(timeout, what))?
}

/// Writes one frame (after waiting for the throttle's budget, if any).
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    kind: FrameKind,
    payload: &[u8],
    throttle: Option<&Throttle>,
) -> Result<(), WireError> {
    if payload.len() > MAX_FRAME {
        return Err(WireError::TooLarge {
            len: payload.len() as u64,
            max: MAX_FRAME,
        });
    }
    if let Some(t) = throttle {
        t.take(HEADER_BYTES + payload.len()).await;
    }
    let mut head = [0u8; HEADER_BYTES];
    head[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    head[4] = kind as u8;
    if payload.len() <= 64 << 10 {
        let mut buf = Vec::with_capacity(HEADER_BYTES + payload.len());
        buf.extend_from_slice(&head);
        buf.extend_from_slice(payload);
        w.write_all(&buf).await?;
    } else {
        w.write_all(&head).await?;
        w.write_all(payload).await?;
    }
    w.flush().await?;
    Ok(())
}

/// Which end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// the coordinator
    Coordinator = 0,
    /// a worker
    Worker = 1,
    /// a worker connecting to another worker (direct forwarding)
    Peer = 2,
}

/// The role byte of a `Hello` frame checked by [`check_hello`].
pub fn hello_role(f: &Frame) -> Option<Role> {
    match f.payload.get(8) {
        Some(0) => Some(Role::Coordinator),
        Some(1) => Some(Role::Worker),
        Some(2) => Some(Role::Peer),
        _ => None,
    }
}

/// The `Hello` payload of `role` at `version`.
pub fn hello_payload(role: Role, version: u32) -> Vec<u8> {
    let mut p = MAGIC.to_vec();
    p.extend_from_slice(&version.to_le_bytes());
    p.push(role as u8);
    p
}

/// Checks a peer's `Hello` frame: magic and exact version.
pub fn check_hello(f: &Frame) -> Result<(), WireError> {
    if f.kind == FrameKind::Error {
        return Err(WireError::Remote(
            String::from_utf8_lossy(&f.payload).into_owned(),
        ));
    }
    if f.kind != FrameKind::Hello || f.payload.len() != 9 || f.payload[..4] != MAGIC {
        return Err(WireError::NotLoip);
    }
    let theirs = u32::from_le_bytes([f.payload[4], f.payload[5], f.payload[6], f.payload[7]]);
    if theirs != PROTOCOL_VERSION {
        return Err(WireError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs,
        });
    }
    Ok(())
}

/// A slice file a worker holds and has verified.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredSlice {
    /// file name in the store
    pub file: String,
    /// bytes
    pub size: u64,
    /// CRC-32 (IEEE), hex, as in the manifest
    pub crc32: String,
}

/// What a worker says about itself after authentication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// its name (`--name`, else the host name)
    pub name: String,
    /// build version of the worker
    pub version: String,
    /// its memory budget (`--mem`), bytes
    pub mem_budget: u64,
    /// compute threads
    pub threads: usize,
    /// its outgoing bandwidth limit, bytes/s (`--bandwidth`), if emulated
    pub bandwidth_limit: Option<f64>,
    /// verified slices in its store
    pub store: Vec<StoredSlice>,
}

/// Block timings a worker measured on its own hardware (see `net::profile`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeResult {
    /// `(context n, seconds)`: one attention block at micro-batch 1  // seconds
    pub attn: Vec<(u64, f64)>,
    /// one MLP block at micro-batch 1  // seconds
    pub mlp_s: f64,
    /// direct loader (β bytes/s, λ s)
    pub direct: loip_plan::LoaderProfile,
    /// conventional loader
    pub conventional: loip_plan::LoaderProfile,
    /// seconds the probe took
    pub took_s: f64,
    /// the same blocks for micro-batches of `b > 1` sequences (empty from older workers:
    /// the planner then takes the b = 1 times for every b)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batched: Vec<BatchProbe>,
    /// how much slower a block computes beside a load (0: not measured, older workers)  // fraction
    #[serde(default)]
    pub load_slowdown: f64,
}

/// Block times for one micro-batch of `b` sequences, one token each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchProbe {
    /// sequences in the micro-batch
    pub b: u32,
    /// `(context n per sequence, seconds)`: one attention block  // seconds
    pub attn: Vec<(u64, f64)>,
    /// one MLP block  // seconds
    pub mlp_s: f64,
}

fn yes() -> bool {
    true
}

/// Control messages from the coordinator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)]
pub enum ToWorker {
    /// nothing to do: keeps an idle session from timing out (no answer)
    KeepAlive,
    /// round-trip probe; answered with `Pong`
    Ping {
        /// echoed
        id: u64,
    },
    /// round-trip probe through the compute thread, as a step's hop goes (queued behind
    /// the device's jobs, the thread woken, a hand-off to the compute pool and back, the
    /// answer sent from it); answered with `Pong`
    Echo {
        /// echoed
        id: u64,
    },
    /// the coordinator now sends `bytes` in `Bulk` frames; answered with `BulkReceived`
    BulkSend {
        /// bytes that follow
        bytes: u64,
    },
    /// the worker sends `bytes` in `Bulk` frames, then `BulkSent`
    BulkFetch {
        /// bytes asked
        bytes: u64,
    },
    /// a slice file follows in `SliceData` frames; answered with `Stored`
    PutSlice {
        /// its manifest entry (name, size, CRC)
        entry: SliceEntry,
    },
    /// measure block and load times on layer 0's slices (which the worker must hold)
    Probe {
        /// the model
        manifest: Manifest,
        /// time the attention and MLP blocks
        #[serde(default = "yes")]
        compute: bool,
        /// time both loaders
        #[serde(default = "yes")]
        loads: bool,
    },
    /// open the device for a plan; answered with `Loaded`
    Load {
        /// the model
        manifest: Manifest,
        /// what this device runs
        spec: DeviceSpec,
    },
    /// between steps, change which blocks of the stages are resident and which offloaded
    /// (a plan switch, design §6); answered with `Switched` or `SwitchRefused`
    Switch {
        /// the device's stages with their new placements (same layers)
        stages: Vec<StageSpec>,
    },
    /// forget these sequences' KV cache
    Release {
        /// sequence ids
        seqs: Vec<u64>,
    },
    /// end of session (the worker keeps listening)
    Bye,
    /// direct forwarding: accept peer sessions from `expect`, then connect to `connect`
    /// (and measure those links); answered with `PeersReady`
    Peers(crate::net::direct::PeersMsg),
    /// KV lending: from now, lend the oldest `tokens` rows of each stage's KV after the stage
    /// runs, and fetch them back before it runs again (0: stop lending)
    Lend {
        /// rows per stage, summed over sequences  // tokens
        tokens: u64,
        /// the borrower's peer-session index (as in `Peers`) when this worker's session to
        /// it is up: the rows go there directly; None: through the coordinator
        #[serde(default)]
        via: Option<u16>,
    },
    /// KV lending: hold up to `bytes` of `lender`'s lent KV (counted in the budget);
    /// answered with `Borrowed`
    Borrow {
        /// the lending device's plan index
        lender: u16,
        /// bytes to reserve  // bytes
        bytes: u64,
        /// the lender's peer-session index (as in `Peers`) when it sends its rows on its own
        /// session to this worker; None: only through the coordinator
        #[serde(default)]
        via: Option<u16>,
    },
    /// KV lending: send `lender`'s lent KV of `stage` back (a `Kv` data frame)
    KvFetch {
        /// the lending device's plan index
        lender: u16,
        /// its stage
        stage: u16,
    },
    /// drop what is held for these steps (they failed); their rows may still arrive
    Forget {
        /// step ids
        steps: Vec<u64>,
    },
}

/// How a worker's budget is spent, bytes (the wire form of [`MemoryReport`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    /// the budget  // bytes
    pub budget: u64,
    /// resident blocks (incl. embedding / head)  // bytes
    pub resident: u64,
    /// the slot  // bytes
    pub slot: u64,
    /// working buffers  // bytes
    pub working: u64,
    /// left for the KV cache  // bytes
    pub kv_budget: u64,
}

impl From<MemoryReport> for DeviceMemory {
    fn from(m: MemoryReport) -> DeviceMemory {
        DeviceMemory {
            budget: m.budget,
            resident: m.resident,
            slot: m.slot,
            working: m.working,
            kv_budget: m.kv_budget,
        }
    }
}

/// Control messages from a worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToCoordinator {
    /// the first sealed frame: the session is open
    Welcome {
        /// about the worker
        info: WorkerInfo,
    },
    /// answer to `Ping`
    Pong {
        /// echoed
        id: u64,
    },
    /// all bulk bytes arrived
    BulkReceived {
        /// bytes counted
        bytes: u64,
    },
    /// all bulk bytes were sent
    BulkSent {
        /// bytes sent
        bytes: u64,
    },
    /// a slice is stored and verified
    Stored {
        /// its file name
        file: String,
    },
    /// probe results
    Probed(ProbeResult),
    /// the device is open
    Loaded {
        /// how its budget is spent
        memory: DeviceMemory,
    },
    /// the links asked by `Peers`: which are up, and what they measured
    PeersReady {
        /// one per link asked
        links: Vec<crate::net::direct::PeerLinkReport>,
    },
    /// the session to a peer this worker hands rows to has failed
    PeerGone {
        /// the peer's device index (as in `Peers`)
        device: u16,
        /// what happened
        reason: String,
    },
    /// a plan switch is applied
    Switched {
        /// how the budget is spent now
        memory: DeviceMemory,
    },
    /// answer to `Borrow`: whether the bytes are reserved
    Borrowed {
        /// the lending device's plan index
        lender: u16,
        /// bytes reserved now (the old reservation when refused)  // bytes
        bytes: u64,
        /// reserved
        ok: bool,
    },
    /// KV lending: the lender asks its lent KV of `stage` back
    KvFetch {
        /// its stage
        stage: u16,
    },
    /// KV lending over the peer session: `bytes` of lent KV of `stage` went to the borrower
    KvSent {
        /// its stage
        stage: u16,
        /// blob bytes  // bytes
        bytes: u64,
    },
    /// KV lending over the peer session: lent KV of `stage` came back, `secs` after it was
    /// asked (the link's round trip, what lending is sized by)
    KvFetched {
        /// its stage
        stage: u16,
        /// blob bytes  // bytes
        bytes: u64,
        /// from the request to the last byte  // seconds
        secs: f64,
    },
    /// a plan switch was refused: nothing changed
    SwitchRefused {
        /// why
        message: String,
        /// how the budget is spent (unchanged)
        memory: DeviceMemory,
    },
    /// a request failed; the connection stays usable
    Failed {
        /// the step it was about, if any
        step: Option<u64>,
        /// why
        message: String,
    },
}

/// Encodes a control message.
pub fn control_payload<T: Serialize>(msg: &T) -> Result<Vec<u8>, WireError> {
    serde_json::to_vec(msg)
        .map_err(|e| WireError::Protocol(format!("cannot encode a control message: {e}")))
}

/// Decodes a control frame's payload.
pub fn parse_control<T: for<'de> Deserialize<'de>>(f: &Frame) -> Result<T, WireError> {
    match f.kind {
        FrameKind::Control => serde_json::from_slice(&f.payload)
            .map_err(|e| WireError::Protocol(format!("bad control message: {e}"))),
        FrameKind::Error => Err(WireError::Remote(
            String::from_utf8_lossy(&f.payload).into_owned(),
        )),
        k => Err(WireError::Protocol(format!(
            "expected a control frame, got {k:?}"
        ))),
    }
}

pub(crate) mod error;
pub(crate) mod step;
pub use error::WireError;
pub use step::*;

pub mod lend;

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
