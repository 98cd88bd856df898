//! Direct forwarding on the wire: hidden rows go from worker to worker, the coordinator only
//! steers.
//!
//! Setup: the coordinator sends every worker [`PeersMsg`] twice over its own session — first
//! with `connect` empty (the worker now accepts peer sessions from `expect`, proved by the
//! pipeline's random `key`), then with the workers it hands rows to. Each [`PeerRef`] carries
//! the device's static key as the coordinator's own handshake with it proved it. The worker
//! connects to each, runs the Noise handshake as role `peer` (its hello says so, and both
//! hellos are bound into the handshake), checks that the accepting side proved the static key
//! the coordinator gave before it says anything, says [`ToPeer::Hello`] with the key and its
//! index, checks the name in [`FromPeer::Welcome`] against the one the coordinator gave,
//! optionally measures the link, and answers `PeersReady` with a [`PeerLinkReport`] per link.
//! The accepting worker admits a session claiming device `from` only when the static key the
//! session proved is the one the coordinator gave for `from`: holding the token and the
//! pipeline's key is not enough to pose as another device.
//!
//! Steps: the coordinator sends each device of a step's route a `Routed` frame: a
//! [`Routed`] prefix (hop index, where the input comes from, where the output goes) before a
//! normal `Step` payload (header, then the input when it comes from the coordinator). A
//! device whose output goes to a peer sends it there in a `Hand` frame (`[u64 step][u16
//! hop][rows]`, the hop the rows are the input of) and sends the coordinator a `Notice` (`[u64 step][u16 hop][u64 bytes]` and the
//! hop's [`JobTimes`]), so the coordinator still knows where each step is and where its time
//! went. The last device returns an `Output` to the coordinator as without forwarding.
//!
//! Invariants: a peer may send rows only for a hop that the coordinator announced to the
//! receiving worker as coming from that very peer; rows that arrive before their
//! announcement wait (one frame per peer session, under the inbox budget) for at most
//! [`ANNOUNCE_WAIT`]; everything else closes the peer session. Device indices are the
//! coordinator's, the same in every message of one pipeline.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::wire::error::WireError;
use crate::wire::step::JobTimes;

/// How long rows from a peer may wait for the coordinator's announcement of their hop.
pub const ANNOUNCE_WAIT: Duration = Duration::from_secs(10);
/// "No device": the input comes from, or the output goes to, the coordinator.
const NONE: u16 = u16::MAX;
/// Bytes of a [`Routed`] prefix.
pub const ROUTED_BYTES: usize = 6;
/// Bytes of a `Hand` prefix.
pub const HAND_BYTES: usize = 10;
/// Bytes of a `Notice` payload.
pub const NOTICE_BYTES: usize = 8 + 2 + 8 + 4 * 8 + 8;

/// A device of the pipeline, as another worker should know it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRef {
    /// its index in the pipeline's devices
    pub device: u16,
    /// its name (checked against what it says about itself)
    pub name: String,
    /// where it listens (`host:port`); empty when only expected
    #[serde(default)]
    pub addr: String,
    /// its static public key (hex), as it proved it to the coordinator; a peer session from
    /// or to this device must prove the same
    #[serde(default)]
    pub key: String,
}

impl PeerRef {
    /// Whether `proved` (a static key a peer session proved) is this device's.
    pub fn proves(&self, proved: &[u8; 32]) -> bool {
        same_secret(
            &self.key.to_ascii_lowercase(),
            &crate::wire::step::hex(proved),
        )
    }
}

/// [`crate::wire::ToWorker::Peers`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeersMsg {
    /// the pipeline's secret: 32 random bytes, hex, the same for every worker
    pub key: String,
    /// this worker's index
    pub me: u16,
    /// devices that may hand rows to this worker
    pub expect: Vec<PeerRef>,
    /// devices this worker hands rows to: connect now
    pub connect: Vec<PeerRef>,
    /// measure each new link (latency, bulk bandwidth)
    pub measure: bool,
}

/// One link of `PeersReady`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerLinkReport {
    /// the device connected to
    pub device: u16,
    /// the session is up
    pub reachable: bool,
    /// why not
    pub error: Option<String>,
    /// one-way latency, half the median round trip (0 when not measured)  // seconds
    pub latency_s: f64,
    /// bulk bandwidth towards the peer (0 when not measured)  // bytes/s
    pub bps: f64,
}

/// Control messages from the connecting worker on a peer session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToPeer {
    /// the first sealed message: the pipeline's key and the sender's index
    Hello {
        /// [`PeersMsg::key`]
        key: String,
        /// the sender's device index
        from: u16,
    },
    /// keeps an idle link open
    KeepAlive,
    /// answered with `Pong`
    Ping {
        /// echoed
        id: u64,
    },
    /// `bytes` follow in `Bulk` frames; answered with `BulkReceived`
    BulkSend {
        /// bytes that follow
        bytes: u64,
    },
}

/// Control messages from the accepting worker on a peer session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromPeer {
    /// the session is open
    Welcome {
        /// the accepting worker's name
        name: String,
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
}

/// Where a routed hop's input comes from and its output goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Routed {
    /// the hop's index in the step's route
    pub hop: u16,
    /// the device that hands the input; None: it is in this frame
    pub from: Option<u16>,
    /// the device to hand the output to; None: back to the coordinator
    pub to: Option<u16>,
}

fn opt(v: Option<u16>) -> u16 {
    v.unwrap_or(NONE)
}

fn unopt(v: u16) -> Option<u16> {
    (v != NONE).then_some(v)
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(a)
}

fn short(what: &str, len: usize) -> WireError {
    WireError::Protocol(format!("a {what} frame of {len} bytes is too short"))
}

/// A `Routed` payload: the prefix, then a `Step` payload ([`crate::wire::encode_step`]).
pub fn encode_routed(r: &Routed, step_payload: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(ROUTED_BYTES + step_payload.len());
    for v in [r.hop, opt(r.from), opt(r.to)] {
        p.extend_from_slice(&v.to_le_bytes());
    }
    p.extend_from_slice(step_payload);
    p
}

/// Parses a `Routed` payload's prefix; returns it and the `Step` payload.
pub fn decode_routed(p: &[u8]) -> Result<(Routed, &[u8]), WireError> {
    if p.len() < ROUTED_BYTES {
        return Err(short("routed", p.len()));
    }
    let r = Routed {
        hop: u16_at(p, 0),
        from: unopt(u16_at(p, 2)),
        to: unopt(u16_at(p, 4)),
    };
    Ok((r, &p[ROUTED_BYTES..]))
}

/// A `Hand` payload: step, hop, then the rows.
pub fn encode_hand(step: u64, hop: u16, rows: &[u8]) -> Vec<u8> {
    let mut p = Vec::with_capacity(HAND_BYTES + rows.len());
    p.extend_from_slice(&step.to_le_bytes());
    p.extend_from_slice(&hop.to_le_bytes());
    p.extend_from_slice(rows);
    p
}

/// Parses a `Hand` payload: (step, hop, rows).
pub fn decode_hand(p: &[u8]) -> Result<(u64, u16, &[u8]), WireError> {
    if p.len() < HAND_BYTES {
        return Err(short("hand", p.len()));
    }
    Ok((u64_at(p, 0), u16_at(p, 8), &p[HAND_BYTES..]))
}

/// A hop's receipt: the rows went to the next device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Notice {
    /// the step
    pub step: u64,
    /// its hop that ran here
    pub hop: u16,
    /// payload bytes handed to the next device  // bytes
    pub bytes: u64,
    /// where the hop's time went on this worker
    pub times: JobTimes,
}

/// A `Notice` payload.
pub fn encode_notice(n: &Notice) -> Vec<u8> {
    let mut p = Vec::with_capacity(NOTICE_BYTES);
    p.extend_from_slice(&n.step.to_le_bytes());
    p.extend_from_slice(&n.hop.to_le_bytes());
    p.extend_from_slice(&n.bytes.to_le_bytes());
    let t = &n.times;
    for v in [t.queued_s, t.compute_s, t.stall_s, t.total_s] {
        p.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    p.extend_from_slice(&t.loaded_bytes.to_le_bytes());
    p
}

/// Parses a `Notice` payload (exactly [`NOTICE_BYTES`]).
pub fn decode_notice(p: &[u8]) -> Result<Notice, WireError> {
    if p.len() != NOTICE_BYTES {
        return Err(WireError::Protocol(format!(
            "a notice of {} bytes (expected {NOTICE_BYTES})",
            p.len()
        )));
    }
    let f = |i: usize| f64::from_bits(u64_at(p, i));
    Ok(Notice {
        step: u64_at(p, 0),
        hop: u16_at(p, 8),
        bytes: u64_at(p, 10),
        times: JobTimes {
            queued_s: f(18),
            compute_s: f(26),
            stall_s: f(34),
            total_s: f(42),
            loaded_bytes: u64_at(p, 50),
        },
    })
}

/// Compares two secrets in time independent of where they differ.
pub fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_round_trip_and_short_frames_are_refused() {
        let r = Routed {
            hop: 3,
            from: Some(1),
            to: None,
        };
        let p = encode_routed(&r, b"xyz");
        assert_eq!(decode_routed(&p).unwrap(), (r, &b"xyz"[..]));
        assert!(decode_routed(&p[..5]).is_err());
        let h = encode_hand(7, 2, &[1, 2, 3, 4]);
        assert_eq!(decode_hand(&h).unwrap(), (7, 2, &[1u8, 2, 3, 4][..]));
        assert!(decode_hand(&h[..9]).is_err());
        let n = Notice {
            step: 9,
            hop: 1,
            bytes: 2304,
            times: JobTimes {
                queued_s: 0.5,
                compute_s: 1.5,
                stall_s: 0.25,
                total_s: 2.0,
                loaded_bytes: 77,
            },
        };
        let p = encode_notice(&n);
        assert_eq!(decode_notice(&p).unwrap(), n);
        assert!(decode_notice(&p[1..]).is_err());
        assert!(same_secret("abcd", "abcd") && !same_secret("abcd", "abce"));
        assert!(!same_secret("abc", "abcd"));
    }
}
