//! The connecting side of a peer session (direct forwarding, [`crate::net::direct`]): TCP,
//! the Noise handshake as role `peer` over the shared token with this device's static key,
//! the accepting worker's static key and then its name checked against the ones the
//! coordinator gave, the pipeline's key, and the link measurement.
//! Every wait is bounded by the caller's timeout.

use std::time::{Duration, Instant};

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::net::direct::{FromPeer, PeerRef, ToPeer};
use crate::net::handshake::{self, PRE_AUTH_FRAME};
use crate::net::identity::Identity;
use crate::net::session::{self, SealedReader, SealedWriter};
use crate::net::throttle::Throttle;
use crate::wire::{self, FrameKind, Role, WireError};

/// Bulk frame size of a link measurement, bytes.
const CHUNK: usize = 1 << 20;
/// Largest bulk measurement of a peer link, bytes.
const MAX_MEASURE: u64 = 16 << 20;

/// An open peer session, this side connecting.
pub struct PeerConn {
    /// from the accepting worker
    pub rd: SealedReader<OwnedReadHalf>,
    /// to the accepting worker
    pub wr: SealedWriter<OwnedWriteHalf>,
    timeout: Duration,
}

/// Who opens a peer session: this device's index in the pipeline, the pipeline's key, this
/// device's static key pair, the shared token.
pub struct PeerAuth<'a> {
    /// this device's index
    pub me: u16,
    /// the pipeline's key ([`crate::net::direct::PeersMsg::key`])
    pub key: &'a str,
    /// this device's static key pair
    pub identity: &'a Identity,
    /// the shared token
    pub token: &'a str,
}

/// Opens a peer session to `target` as `auth`.
pub async fn connect(
    target: &PeerRef,
    auth: &PeerAuth<'_>,
    timeout: Duration,
    throttle: Option<Throttle>,
) -> Result<PeerConn, WireError> {
    let stream = tokio::time::timeout(timeout, TcpStream::connect(&target.addr))
        .await
        .map_err(|_| WireError::Timeout(timeout, "the TCP connection"))??;
    session::keepalive(&stream);
    let (mut rd, mut wr) = stream.into_split();
    let hs = tokio::time::timeout(
        timeout,
        handshake::connect_as(&mut rd, &mut wr, auth.token, auth.identity, Role::Peer),
    )
    .await
    .map_err(|_| WireError::Timeout(timeout, "the handshake"))??;
    // before the pipeline's key goes out: the device there is the one the coordinator knows
    if !target.proves(&hs.remote) {
        return Err(WireError::AuthRefused(format!(
            "the worker at {} is not device {}: it proved another static key than the coordinator's",
            target.addr, target.name
        )));
    }
    let (mut rd, mut wr) = hs.keys.seal(Role::Peer, rd, wr, throttle);
    let hello = wire::control_payload(&ToPeer::Hello {
        key: auth.key.to_string(),
        from: auth.me,
    })?;
    wr.write(FrameKind::Control, &hello).await?;
    let f = rd
        .read_timeout(PRE_AUTH_FRAME, timeout, "the peer's welcome")
        .await?;
    match wire::parse_control::<FromPeer>(&f)? {
        FromPeer::Welcome { name } if name == target.name => Ok(PeerConn { rd, wr, timeout }),
        FromPeer::Welcome { name } => Err(WireError::Protocol(format!(
            "expected device {} at {}, found {name}",
            target.name, target.addr
        ))),
        other => Err(WireError::Protocol(format!(
            "expected the peer's welcome, got {other:?}"
        ))),
    }
}

impl PeerConn {
    async fn send(&mut self, m: &ToPeer) -> Result<(), WireError> {
        let p = wire::control_payload(m)?;
        self.wr.write(FrameKind::Control, &p).await
    }

    async fn recv(&mut self, what: &'static str) -> Result<FromPeer, WireError> {
        let f = self
            .rd
            .read_timeout(PRE_AUTH_FRAME, self.timeout, what)
            .await?;
        wire::parse_control::<FromPeer>(&f)
    }

    /// Measures the link towards the peer: (one-way latency = half the fastest of 5 round
    /// trips  // seconds, bulk bandwidth  // bytes/s). Transfers grow ×4 from 256 KiB until
    /// one takes 0.1 s (at most 16 MiB).
    pub async fn measure(&mut self) -> Result<(f64, f64), WireError> {
        let mut rtts = Vec::new();
        for id in 0..5 {
            let t = Instant::now();
            self.send(&ToPeer::Ping { id }).await?;
            match self.recv("a pong").await? {
                FromPeer::Pong { id: got } if got == id => rtts.push(t.elapsed().as_secs_f64()),
                other => {
                    return Err(WireError::Protocol(format!(
                        "expected pong {id}, got {other:?}"
                    )))
                }
            }
        }
        // the fastest round trip: a slower one waited for a core (a busy peer, other work
        // on the machine), which the link does not add to every hop
        let rtt = rtts.iter().copied().fold(f64::INFINITY, f64::min);
        let chunk = vec![0u8; CHUNK];
        let mut size: u64 = 256 << 10;
        loop {
            let t = Instant::now();
            self.send(&ToPeer::BulkSend { bytes: size }).await?;
            let mut left = size;
            while left > 0 {
                let n = left.min(CHUNK as u64) as usize;
                self.wr.write(FrameKind::Bulk, &chunk[..n]).await?;
                left -= n as u64;
            }
            match self.recv("the bulk acknowledgement").await? {
                FromPeer::BulkReceived { .. } => {}
                other => {
                    return Err(WireError::Protocol(format!(
                        "expected a bulk receipt, got {other:?}"
                    )))
                }
            }
            let dt = (t.elapsed().as_secs_f64() - rtt).max(1e-6);
            if dt >= 0.1 || size >= MAX_MEASURE {
                return Ok((rtt / 2.0, size as f64 / dt));
            }
            size *= 4;
        }
    }
}
