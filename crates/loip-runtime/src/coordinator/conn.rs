//! The coordinator's authenticated, sealed connection to one worker ([`Conn`]) and what it
//! does during setup: link measurement, slice shipping, probing, loading. A keepalive task
//! says [`ToWorker::KeepAlive`] every [`KEEPALIVE`] while the connection lives, so a worker's
//! idle timeout never ends the session of a coordinator that is busy elsewhere. Each worker's
//! static key, proved in the Noise handshake, is checked against the pins of
//! [`ConnectOptions::known_devices`] (recorded on first contact, refused when changed).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use loip_model::slice::{Manifest, SliceKind};
use serde::Serialize;
use tokio::io::AsyncReadExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::executor::DeviceSpec;
use crate::net::handshake;
use crate::net::identity::Identity;
use crate::net::known::{KnownDevices, Pin};
use crate::net::probe::median;
use crate::net::session::{self, SealedReader, SealedWriter};
use crate::net::throttle::Throttle;
use crate::wire::{
    self, DeviceMemory, Frame, FrameKind, NetError, ProbeResult, Role, ToCoordinator, ToWorker,
    WireError, WorkerInfo,
};
use crate::worker::BULK_CHUNK;

/// Where a worker listens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Endpoint {
    /// device name (as in the cluster and the plan)
    pub name: String,
    /// `host:port`
    pub addr: String,
}

/// How to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// shared secret
    pub token: Option<String>,
    /// limit for TCP connect plus handshake (a busy worker is retried until then)
    pub connect_timeout: Duration,
    /// limit for a setup request (probe, load, one slice)
    pub request_timeout: Duration,
    /// emulated limit of the coordinator → worker direction, bytes/s
    pub bandwidth: Option<f64>,
    /// the pins of the devices' static keys; None: not pinned (workers this process started,
    /// tests)
    pub known_devices: Option<Arc<KnownDevices>>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            token: None,
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(600),
            bandwidth: None,
            known_devices: None,
        }
    }
}

/// A measured link between the coordinator and one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LinkStats {
    /// one-way latency, half the median round trip  // seconds
    pub latency_s: f64,
    /// coordinator → worker bulk bandwidth  // bytes/s
    pub up_bps: f64,
    /// worker → coordinator bulk bandwidth  // bytes/s
    pub down_bps: f64,
    /// what a hop into the worker costs beyond the link as a step pays it: the median round
    /// trip of a ping answered from its compute thread (queued like a step, the thread
    /// woken, a hand-off to the compute pool and back as a stage makes, the answer handed
    /// to the writer) less the median plain ping's
    /// (`Conn::echo_rtts`)  // seconds
    pub wake_s: f64,
}

/// What shipping a plan's slices to one worker did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ShipStats {
    /// files sent
    pub sent: Vec<String>,
    /// bytes sent  // bytes
    pub sent_bytes: u64,
    /// files the worker already held (same size and CRC)
    pub reused: usize,
}

/// Slices being sent to one device: bytes sent so far of the bytes to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShipProgress<'a> {
    /// the device
    pub device: &'a str,
    /// bytes sent so far (of this call)
    pub sent: u64,
    /// bytes this call sends (slices the device already holds are not counted)
    pub total: u64,
}

/// Called as slices go out (after each chunk), e.g. to draw a progress bar.
#[derive(Clone)]
pub struct OnShip(pub Arc<dyn Fn(ShipProgress<'_>) + Send + Sync>);

impl std::fmt::Debug for OnShip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnShip(..)")
    }
}

/// The writing half of a session, shared by its user and its keepalive task.
pub(super) type SharedWriter = Arc<tokio::sync::Mutex<SealedWriter<OwnedWriteHalf>>>;

/// How often an open session says [`ToWorker::KeepAlive`], so that a worker's idle timeout
/// never ends a session whose coordinator is alive but busy elsewhere.  // seconds
pub const KEEPALIVE: Duration = Duration::from_secs(10);
/// Round trips of each kind in [`Conn::echo_rtts`].
const ECHO_ROUNDS: u64 = 21;

/// With several workers on one machine, each link's wake-up ([`LinkStats::wake_s`]) as a
/// step sees it: its worker's echo while the worker before it in `conns` (the one that would
/// have sent the hop) answers one too ([`Conn::echo_beside`]), less the plain round trip;
/// the larger of that and the echo alone. `links[i]` is `conns[i]`'s.
pub async fn wakes_beside(conns: &mut [Conn], links: &mut [LinkStats]) -> Result<(), NetError> {
    let n = conns.len().min(links.len());
    if n < 2 {
        return Ok(());
    }
    for i in 0..n {
        let j = (i + n - 1) % n;
        let (a, b) = if i < j {
            let (lo, hi) = conns.split_at_mut(j);
            (&mut lo[i], &mut hi[0])
        } else {
            let (lo, hi) = conns.split_at_mut(i);
            (&mut hi[0], &mut lo[j])
        };
        let e = a.echo_beside(b).await?;
        let l = &mut links[i];
        l.wake_s = l.wake_s.max(e - 2.0 * l.latency_s);
    }
    Ok(())
}

/// Stops a session's keepalive task when dropped.
pub(super) struct KeepAliveTask(tokio::task::JoinHandle<()>);

impl Drop for KeepAliveTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn spawn_keepalive(wr: &SharedWriter) -> KeepAliveTask {
    let wr = Arc::downgrade(wr);
    KeepAliveTask(tokio::spawn(async move {
        let Ok(p) = wire::control_payload(&ToWorker::KeepAlive) else {
            return;
        };
        loop {
            tokio::time::sleep(KEEPALIVE).await;
            let Some(w) = wr.upgrade() else { return };
            if w.lock().await.write(FrameKind::Control, &p).await.is_err() {
                return;
            }
        }
    }))
}

/// An authenticated, sealed connection to one worker, used for setup.
pub struct Conn {
    /// who
    pub endpoint: Endpoint,
    /// what the worker said about itself
    pub info: WorkerInfo,
    /// the worker's static public key, proved in the handshake
    pub device_key: [u8; 32],
    pub(super) rd: SealedReader<OwnedReadHalf>,
    pub(super) wr: SharedWriter,
    pub(super) keepalive: KeepAliveTask,
    request_timeout: Duration,
}

async fn handshake(
    stream: TcpStream,
    ep: &Endpoint,
    opts: &ConnectOptions,
) -> Result<Conn, WireError> {
    session::keepalive(&stream);
    let (mut rd, mut wr) = stream.into_split();
    let to = opts.connect_timeout;
    let token = opts.token.clone().unwrap_or_default();
    let hs = handshake::connect(&mut rd, &mut wr, &token, coordinator_identity());
    let hs = tokio::time::timeout(to, hs)
        .await
        .map_err(|_| WireError::Timeout(to, "the handshake"))?
        .map_err(|e| match e {
            WireError::AuthRefused(m) if opts.token.is_none() => WireError::AuthRefused(format!(
                "{m} (this side has no token: pass --token-file or set LOIP_TOKEN)"
            )),
            e => e,
        })?;
    if let Some(known) = &opts.known_devices {
        match known.check(&ep.name, &hs.remote) {
            Ok(Pin::New) => tracing::info!(
                "device {}: pinned its key {} in {}",
                ep.name,
                crate::wire::hex(&hs.remote),
                known.path().display()
            ),
            Ok(Pin::Replaced) => tracing::warn!(
                "device {}: accepted its new key {} in {}",
                ep.name,
                crate::wire::hex(&hs.remote),
                known.path().display()
            ),
            Ok(Pin::Known) => {}
            Err(m) => return Err(WireError::AuthRefused(m)),
        }
    }
    let device_key = hs.remote;
    let throttle = opts.bandwidth.map(Throttle::new);
    let (mut rd, wr) = hs.keys.seal(Role::Coordinator, rd, wr, throttle);
    // Authenticated both ways: only now may the worker send a large frame.
    let f = rd
        .read_timeout(wire::MAX_FRAME, to, "the worker's welcome")
        .await?;
    let info = match wire::parse_control::<ToCoordinator>(&f)? {
        ToCoordinator::Welcome { info } => info,
        _ => return Err(WireError::Protocol("expected the worker's welcome".into())),
    };
    let wr = Arc::new(tokio::sync::Mutex::new(wr));
    Ok(Conn {
        endpoint: ep.clone(),
        info,
        device_key,
        rd,
        keepalive: spawn_keepalive(&wr),
        wr,
        request_timeout: opts.request_timeout,
    })
}

static COORDINATOR_ID: std::sync::OnceLock<Identity> = std::sync::OnceLock::new();

/// The coordinator's static key pair: the one [`use_coordinator_identity`] set (a paired
/// coordinator's, which its workers pin), else one made for this process.
pub fn coordinator_identity() -> &'static Identity {
    COORDINATOR_ID.get_or_init(Identity::generate)
}

/// Makes `id` this process's coordinator key pair; false when one was already in use.
pub fn use_coordinator_identity(id: Identity) -> bool {
    COORDINATOR_ID.set(id).is_ok()
}

impl Conn {
    /// Connects, checks the protocol version and authenticates both ways. A worker busy with
    /// another coordinator, or one that closed the connection before its hello (its handshake
    /// slots full), is retried until `connect_timeout`.
    pub async fn connect(ep: &Endpoint, opts: &ConnectOptions) -> Result<Conn, NetError> {
        let err = |e: WireError| NetError::new(&ep.name, &ep.addr, e);
        let deadline = Instant::now() + opts.connect_timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let stream = match tokio::time::timeout(left, TcpStream::connect(&ep.addr)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Err(err(WireError::Io(e))),
                Err(_) => {
                    return Err(err(WireError::Timeout(
                        opts.connect_timeout,
                        "the TCP connection",
                    )))
                }
            };
            match handshake(stream, ep, opts).await {
                Err(WireError::Remote(m)) if m.starts_with("busy") && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                // closed before its hello: the worker's handshake slots were full (strangers
                // holding them); a slot comes free within the worker's hello wait
                Err(WireError::Closed | WireError::Io(_)) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                r => return r.map_err(err),
            }
        }
    }

    fn err(&self, e: WireError) -> NetError {
        NetError::new(&self.endpoint.name, &self.endpoint.addr, e)
    }

    async fn send(&mut self, msg: &ToWorker) -> Result<(), NetError> {
        let p = wire::control_payload(msg).map_err(|e| self.err(e))?;
        self.send_frame(FrameKind::Control, &p).await
    }

    async fn send_frame(&mut self, kind: FrameKind, payload: &[u8]) -> Result<(), NetError> {
        let r = self.wr.lock().await.write(kind, payload).await;
        r.map_err(|e| self.err(e))
    }

    async fn read(&mut self, what: &'static str) -> Result<Frame, NetError> {
        let r = self
            .rd
            .read_timeout(wire::MAX_FRAME, self.request_timeout, what)
            .await;
        r.map_err(|e| self.err(e))
    }

    async fn recv(&mut self, what: &'static str) -> Result<ToCoordinator, NetError> {
        let f = self.read(what).await?;
        match wire::parse_control::<ToCoordinator>(&f) {
            Ok(ToCoordinator::Failed { message, .. }) => Err(self.err(WireError::Remote(message))),
            r => r.map_err(|e| self.err(e)),
        }
    }

    /// Median round trip of a few pings.  // seconds
    pub async fn rtt(&mut self) -> Result<f64, NetError> {
        let mut v = Vec::new();
        for id in 0..5 {
            v.push(self.ping(ToWorker::Ping { id }, id).await?);
        }
        Ok(median(v))
    }

    /// Medians of [`ECHO_ROUNDS`] plain pings and as many answered from the worker's compute
    /// thread ([`ToWorker::Echo`]), interleaved: (plain, through the compute thread).
    /// // seconds
    pub async fn echo_rtts(&mut self) -> Result<(f64, f64), NetError> {
        let (mut plain, mut echo) = (Vec::new(), Vec::new());
        for id in 0..ECHO_ROUNDS {
            plain.push(self.ping(ToWorker::Ping { id }, id).await?);
            echo.push(self.ping(ToWorker::Echo { id }, id).await?);
        }
        Ok((median(plain), median(echo)))
    }

    /// Median round trip of [`ECHO_ROUNDS`] pings answered from this worker's compute thread
    /// ([`ToWorker::Echo`]) while `beside` answers one sent just before: as in a step, where a
    /// hop arrives while the worker that sent it is still busy with its own hand-offs and
    /// pool, the two share the machine's cores.  // seconds
    pub async fn echo_beside(&mut self, beside: &mut Conn) -> Result<f64, NetError> {
        let mut v = Vec::new();
        for id in 0..ECHO_ROUNDS {
            beside.send(&ToWorker::Echo { id }).await?;
            v.push(self.ping(ToWorker::Echo { id }, id).await?);
            beside.pong(id).await?;
        }
        Ok(median(v))
    }

    /// One round trip of `msg`, answered with pong `id`.  // seconds
    async fn ping(&mut self, msg: ToWorker, id: u64) -> Result<f64, NetError> {
        let t = Instant::now();
        self.send(&msg).await?;
        self.pong(id).await?;
        Ok(t.elapsed().as_secs_f64())
    }

    /// Receives pong `id` (anything else is a protocol error).
    async fn pong(&mut self, id: u64) -> Result<(), NetError> {
        match self.recv("a pong").await? {
            ToCoordinator::Pong { id: got } if got == id => Ok(()),
            other => Err(self.err(WireError::Protocol(format!(
                "expected pong {id}, got {other:?}"
            )))),
        }
    }

    /// Measures latency, the compute thread's wake-up ([`LinkStats::wake_s`]) and bulk
    /// bandwidth both ways. Transfers grow ×4 from 256 KiB until
    /// one takes at least 0.2 s (at most 64 MiB).
    pub async fn measure(&mut self) -> Result<LinkStats, NetError> {
        let rtt = self.rtt().await?;
        #[allow(unused_assignments)]
        let mut up = 0.0;
        let mut size: u64 = 256 << 10;
        loop {
            let t = Instant::now();
            self.send(&ToWorker::BulkSend { bytes: size }).await?;
            let chunk = vec![0u8; BULK_CHUNK];
            let mut left = size;
            while left > 0 {
                let n = left.min(BULK_CHUNK as u64) as usize;
                self.send_frame(FrameKind::Bulk, &chunk[..n]).await?;
                left -= n as u64;
            }
            match self.recv("the bulk acknowledgement").await? {
                ToCoordinator::BulkReceived { .. } => {}
                other => {
                    return Err(self.err(WireError::Protocol(format!(
                        "expected bulk receipt, got {other:?}"
                    ))))
                }
            }
            let dt = (t.elapsed().as_secs_f64() - rtt).max(1e-6);
            up = size as f64 / dt;
            if dt >= 0.2 || size >= 64 << 20 {
                break;
            }
            size *= 4;
        }
        #[allow(unused_assignments)]
        let mut down = 0.0;
        let mut size: u64 = 256 << 10;
        loop {
            let t = Instant::now();
            self.send(&ToWorker::BulkFetch { bytes: size }).await?;
            let mut got = 0u64;
            loop {
                let f = self.read("bulk data").await?;
                match f.kind {
                    FrameKind::Bulk => got += f.payload.len() as u64,
                    _ => match wire::parse_control::<ToCoordinator>(&f).map_err(|e| self.err(e))? {
                        ToCoordinator::BulkSent { .. } => break,
                        other => {
                            return Err(self.err(WireError::Protocol(format!(
                                "expected bulk data, got {other:?}"
                            ))))
                        }
                    },
                }
            }
            let dt = (t.elapsed().as_secs_f64() - rtt).max(1e-6);
            down = got as f64 / dt;
            if dt >= 0.2 || size >= 64 << 20 {
                break;
            }
            size *= 4;
        }
        // after the bulk transfers, which an interrupted setup is usually in
        let (plain, echo) = self.echo_rtts().await?;
        Ok(LinkStats {
            latency_s: rtt / 2.0,
            up_bps: up,
            down_bps: down,
            wake_s: (echo - plain).max(0.0),
        })
    }

    /// Sends the slices of `kinds` from `dir` that the worker does not hold with the same
    /// size and CRC; the worker checks each one's CRC before keeping it.
    pub async fn ship(
        &mut self,
        dir: &Path,
        manifest: &Manifest,
        kinds: &[SliceKind],
        on_ship: Option<&OnShip>,
    ) -> Result<ShipStats, NetError> {
        let held: HashMap<String, (u64, String)> = self
            .info
            .store
            .iter()
            .map(|s| (s.file.clone(), (s.size, s.crc32.clone())))
            .collect();
        let total: u64 = kinds
            .iter()
            .filter_map(|&k| manifest.slice(k))
            .filter(|e| held.get(&e.file) != Some(&(e.size, e.crc32.clone())))
            .map(|e| e.size)
            .sum();
        let name = self.endpoint.name.clone();
        let mut sent = 0u64;
        let tell = |sent: u64| {
            if let Some(f) = on_ship {
                (f.0)(ShipProgress {
                    device: &name,
                    sent,
                    total,
                });
            }
        };
        let mut stats = ShipStats::default();
        for &k in kinds {
            let entry = manifest.slice(k).cloned().ok_or_else(|| {
                self.err(WireError::Protocol(format!(
                    "slice {} is not in the manifest",
                    k.id()
                )))
            })?;
            if held.get(&entry.file) == Some(&(entry.size, entry.crc32.clone())) {
                stats.reused += 1;
                continue;
            }
            let path = dir.join(&entry.file);
            let mut file = tokio::fs::File::open(&path)
                .await
                .map_err(|e| self.err(WireError::Io(e)))?;
            self.send(&ToWorker::PutSlice {
                entry: entry.clone(),
            })
            .await?;
            let mut left = entry.size;
            let mut buf = vec![0u8; wire::SLICE_CHUNK];
            while left > 0 {
                let n = left.min(wire::SLICE_CHUNK as u64) as usize;
                file.read_exact(&mut buf[..n])
                    .await
                    .map_err(|e| self.err(WireError::Io(e)))?;
                self.send_frame(FrameKind::SliceData, &buf[..n]).await?;
                left -= n as u64;
                sent += n as u64;
                tell(sent);
            }
            match self.recv("the slice receipt").await? {
                ToCoordinator::Stored { file } if file == entry.file => {}
                other => {
                    return Err(self.err(WireError::Protocol(format!(
                        "expected the receipt of {}, got {other:?}",
                        entry.file
                    ))))
                }
            }
            self.info.store.retain(|s| s.file != entry.file);
            self.info.store.push(wire::StoredSlice {
                file: entry.file.clone(),
                size: entry.size,
                crc32: entry.crc32.clone(),
            });
            stats.sent_bytes += entry.size;
            stats.sent.push(entry.file);
        }
        Ok(stats)
    }

    /// Asks the worker to time layer 0's blocks (`compute`) and loads (`loads`); it must hold
    /// those slices.
    pub async fn probe(
        &mut self,
        manifest: &Manifest,
        compute: bool,
        loads: bool,
    ) -> Result<ProbeResult, NetError> {
        self.send(&ToWorker::Probe {
            manifest: manifest.clone(),
            compute,
            loads,
        })
        .await?;
        match self.recv("probe results").await? {
            ToCoordinator::Probed(r) => Ok(r),
            other => Err(self.err(WireError::Protocol(format!(
                "expected probe results, got {other:?}"
            )))),
        }
    }

    /// Opens the device for `spec`.
    pub async fn load(
        &mut self,
        manifest: &Manifest,
        spec: &DeviceSpec,
    ) -> Result<DeviceMemory, NetError> {
        self.send(&ToWorker::Load {
            manifest: manifest.clone(),
            spec: spec.clone(),
        })
        .await?;
        match self.recv("the device to open").await? {
            ToCoordinator::Loaded { memory } => Ok(memory),
            other => Err(self.err(WireError::Protocol(format!(
                "expected loaded, got {other:?}"
            )))),
        }
    }

    /// Direct forwarding: sends the worker `Peers` and returns its report of each link asked
    /// (reachable or not, measured figures).
    pub async fn peers(
        &mut self,
        msg: crate::net::direct::PeersMsg,
    ) -> Result<Vec<crate::net::direct::PeerLinkReport>, NetError> {
        let asked = msg.connect.len();
        self.send(&ToWorker::Peers(msg)).await?;
        match self.recv("the peer links").await? {
            ToCoordinator::PeersReady { links } if links.len() == asked => Ok(links),
            other => Err(self.err(WireError::Protocol(format!(
                "expected {asked} peer link reports, got {other:?}"
            )))),
        }
    }

    /// Ends the session politely.
    pub async fn bye(mut self) {
        let _ = self.send(&ToWorker::Bye).await;
    }
}
