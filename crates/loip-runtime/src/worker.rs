//! `loip worker`: one device. It keeps the slices it was given in its store (checked by
//! checksum, reused after a restart), serves one coordinator at a time, and runs the steps
//! it is sent on its [`Device`].
//!
//! Per connection: `Hello` both ways (another version is refused, naming both), the
//! Noise handshake of [`crate::net::handshake`] within `handshake_timeout` (a wrong token is
//! refused; the worker proves its static key, kept in its store), then sealed requests until the coordinator says `Bye`, goes away, or sends
//! nothing for `idle_timeout` (TCP keepalive notices a vanished host too). At most
//! `max_unauthenticated` connections may be in their handshake at once, at most a quarter of
//! them (and at least 2) from one host; the worker turns
//! busy only once a coordinator is authenticated, so strangers cannot lock it out.
//!
//! The socket is read by one task and written by another; everything that touches the model
//! (probe, opening the device, steps, KV release) runs in order on one compute thread, so
//! steps are processed first come, first served. Frames read and outputs waiting to be
//! written each hold bytes of a budget ([`crate::net::queue`]) sized from `--mem`, and a frame
//! is never larger than what the loaded device can use, so a peer cannot make the worker hold
//! more than its budget plus the stated overhead. Every manifest is checked
//! ([`crate::net::validate`]) before anything is opened. A malformed frame closes that
//! connection with an `Error` frame; a step that cannot run (bad stage, too many tokens, KV
//! budget) is answered at once with `Failed` and the connection stays up. Nothing a peer
//! sends can panic the process, and no message sent to a peer carries a path of this
//! machine.
//!
//! Direct forwarding ([`crate::net::direct`], `worker/peer.rs`): a connection whose hello says
//! `peer` is another worker of the coordinator's pipeline; it goes through the same
//! handshake slots, then hands this worker rows for steps the coordinator announced here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use loip_engine::TokenPos;
use loip_model::slice::Manifest;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};

use crate::executor::{Device, DeviceSpec};
use crate::net::identity::Identity;
use crate::net::queue::{queue_bytes, ByteBudget, BytePermit};
use crate::net::session::{SealedReader, SealedWriter};
use crate::net::store::Store;
use crate::net::throttle::Throttle;
use crate::net::{handshake, session, validate};
use crate::wire::{
    self, FrameKind, JobTimes, OutputHeader, OutputKind, Role, StepHeader, ToCoordinator, ToWorker,
    WireError, WorkerInfo,
};
use crate::RuntimeError;

mod admit;
mod compute;
mod lend;
mod peer;

use admit::{PreAuth, FAST_LANE};
use compute::{compute_thread, ComputeCtx, Job};

/// Options of one worker.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// address to listen on, e.g. `0.0.0.0:7001` or `127.0.0.1:0`
    pub listen: String,
    /// memory budget, bytes: with [`WorkerOptions::whole_process`], the whole process as the
    /// kernel counts it; else the engine's alone
    pub mem_budget: u64,
    /// the process's own share of `mem_budget` (bytes); the engine gets the rest. 0 for a
    /// worker inside a process that accounts for itself (tests, an embedding program)
    pub process_overhead: u64,
    /// slice store directory
    pub store: PathBuf,
    /// most bytes of slices the store may hold (`None`: its free disk space, see
    /// [`crate::net::store`])
    pub store_quota: Option<u64>,
    /// shared secret; `None` (allowed on loopback only, see [`crate::net::token`]) accepts
    /// any coordinator
    pub token: Option<String>,
    /// name reported to the coordinator
    pub name: Option<String>,
    /// emulated outgoing bandwidth limit, bytes/s
    pub bandwidth: Option<f64>,
    /// limit for the whole hello and authentication exchange
    pub handshake_timeout: Duration,
    /// an authenticated session that receives nothing for this long ends (the coordinator
    /// sends a keepalive every few seconds when it has nothing else to say)
    pub idle_timeout: Duration,
    /// connections allowed in their handshake at once; more are closed at once
    pub max_unauthenticated: usize,
    /// fault injection (tests of the coordinator's fallback): refuse the first this many
    /// plan switches as if they did not fit; 0 otherwise
    pub refuse_switches: u32,
    /// accept connections (coordinators and peers) only from these networks; empty: from
    /// anywhere (`--peer-allow`)
    pub peer_allow: Vec<crate::net::allow::Cidr>,
    /// the coordinator this worker was paired with: a coordinator session proving another
    /// static key is refused (`None`: any holder of the token)
    pub coordinator_key: Option<[u8; 32]>,
}

impl WorkerOptions {
    /// Defaults for `listen`, `mem_budget` and `store`.
    pub fn new(
        listen: impl Into<String>,
        mem_budget: u64,
        store: impl Into<PathBuf>,
    ) -> WorkerOptions {
        WorkerOptions {
            listen: listen.into(),
            mem_budget,
            process_overhead: 0,
            store: store.into(),
            store_quota: None,
            token: None,
            name: None,
            bandwidth: None,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_unauthenticated: 16,
            refuse_switches: 0,
            peer_allow: Vec::new(),
            coordinator_key: None,
        }
    }
}

impl WorkerOptions {
    /// Makes `mem_budget` the whole process's budget (`loip worker`): measures what this
    /// process costs beside its engine (its resident set now, thread stacks, the peer
    /// queues, page cache and socket buffers in flight) and leaves the engine the rest;
    /// refused when no engine would fit, naming the smallest budget that works.
    pub fn whole_process(mut self) -> Result<WorkerOptions, crate::memory::TooSmall> {
        let threads = 4 + std::thread::available_parallelism().map_or(1, |n| n.get());
        let queues = 2 * (queue_bytes(self.mem_budget) as usize).max(BASE_FRAME) as u64;
        let b = crate::memory::split_this_process(self.mem_budget, threads, queues, MIN_ENGINE)?;
        crate::memory::set_budget(b);
        self.process_overhead = b.process;
        Ok(self)
    }

    /// The budget split between the engine and the process.
    pub fn budget(&self) -> crate::memory::Budget {
        let process = self.process_overhead.min(self.mem_budget);
        crate::memory::Budget {
            total: self.mem_budget,
            engine: self.mem_budget - process,
            process,
        }
    }
}

/// The smallest engine share a worker starts with (a model is then checked against it when
/// loaded), bytes.
const MIN_ENGINE: u64 = 4 << 20;
/// Largest frame of a session before a device is loaded (manifests, slice data), bytes.
const BASE_FRAME: usize = 4 << 20;
/// Largest bulk measurement, bytes.
const MAX_BULK: u64 = 1 << 30;
/// Bulk frame size, bytes.
pub const BULK_CHUNK: usize = 1 << 20;

struct Shared {
    opts: WorkerOptions,
    store: Mutex<Store>,
    busy: AtomicBool,
    throttle: Option<Throttle>,
    addr: SocketAddr,
    preauth: Arc<Semaphore>,
    fast_lane: Arc<Semaphore>,
    preauth_by_host: Arc<Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>,
    /// the forwarding state of the coordinator session being served
    direct: Mutex<Option<Arc<peer::Direct>>>,
    /// this device's static key pair (kept in the store)
    identity: Identity,
}

/// A bound worker, ready to serve.
pub struct Worker {
    listener: TcpListener,
    shared: Arc<Shared>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Worker {
    /// Opens and verifies the store, then binds the listening socket.
    pub async fn bind(opts: WorkerOptions) -> Result<Worker, RuntimeError> {
        if opts.token.is_none() && !crate::net::token::is_loopback(&opts.listen) {
            return Err(RuntimeError::Invalid(format!(
                "a worker listening on {} needs a token (--token-file FILE or LOIP_TOKEN); \
                 only a loopback address may run without one",
                opts.listen
            )));
        }
        let (identity, _) = Identity::load_or_create(&opts.store)?;
        let store = {
            let (dir, quota) = (opts.store.clone(), opts.store_quota);
            tokio::task::spawn_blocking(move || Store::open_with_quota(&dir, quota))
                .await
                .map_err(|e| RuntimeError::Invalid(format!("store verification failed: {e}")))??
        };
        let listener = TcpListener::bind(&opts.listen)
            .await
            .map_err(|e| RuntimeError::Io {
                path: PathBuf::from(&opts.listen),
                source: e,
            })?;
        let addr = listener.local_addr().map_err(|e| RuntimeError::Io {
            path: PathBuf::from(&opts.listen),
            source: e,
        })?;
        let throttle = opts.bandwidth.map(Throttle::new);
        let opts_preauth = opts.max_unauthenticated.max(1);
        Ok(Worker {
            listener,
            shared: Arc::new(Shared {
                opts,
                store: Mutex::new(store),
                busy: AtomicBool::new(false),
                throttle,
                addr,
                preauth: Arc::new(Semaphore::new(opts_preauth)),
                fast_lane: Arc::new(Semaphore::new(FAST_LANE)),
                preauth_by_host: Arc::default(),
                direct: Mutex::new(None),
                identity,
            }),
        })
    }

    /// The bound address (with the real port when listening on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// Slices held and verified.
    pub fn inventory(&self) -> Vec<wire::StoredSlice> {
        lock(&self.shared.store).inventory()
    }

    /// Accepts connections until the process ends.
    pub async fn serve(self) -> Result<(), RuntimeError> {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let permit = match self.shared.admit(peer.ip()) {
                Ok(p) => p,
                Err(why) => {
                    tracing::warn!("closing {peer}: {why}");
                    continue;
                }
            };
            let shared = self.shared.clone();
            tokio::spawn(async move {
                match connection(stream, shared, permit).await {
                    Ok(()) => tracing::info!("session with {peer} ended"),
                    Err(e) => tracing::warn!("session with {peer}: {e}"),
                }
            });
        }
    }
}

/// Exits the process when its parent dies (workers started by `loip local`).
pub fn exit_when_parent_dies() {
    let parent = std::os::unix::process::parent_id();
    let _ = std::thread::Builder::new()
        .name("loip-parent-watch".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_millis(300));
            if std::os::unix::process::parent_id() != parent {
                std::process::exit(0);
            }
        });
}

/// Clears the busy flag when a session ends, however it ends.
struct BusyGuard<'a>(&'a AtomicBool);

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// What the writer task sends: a frame, and the output-budget bytes it holds until written.
type Out = (FrameKind, Vec<u8>, Option<BytePermit>);

async fn connection(
    stream: TcpStream,
    shared: Arc<Shared>,
    preauth: PreAuth,
) -> Result<(), WireError> {
    session::keepalive(&stream);
    let (mut rd, mut wr) = stream.into_split();
    let to = preauth.deadline(&shared.opts);
    let token = shared.opts.token.clone().unwrap_or_default();
    let accept = handshake::accept_role(&mut rd, &mut wr, &token, &shared.identity);
    let (hs, role) = tokio::time::timeout(to, accept)
        .await
        .map_err(|_| WireError::Timeout(to, "the handshake"))??;
    drop(preauth);
    if role == Role::Peer {
        return peer::serve_peer(hs, rd, wr, shared).await;
    }
    let remote = hs.remote;
    let (mut rd, mut wr) = hs.keys.seal(Role::Worker, rd, wr, shared.throttle.clone());
    rd.set_idle_timeout(Some(shared.opts.idle_timeout));
    if let Some(pinned) = shared.opts.coordinator_key.filter(|k| *k != remote) {
        let why = format!(
            "refused a coordinator with key {}…: this worker is paired with the coordinator \
             {}… (pair again with `loip worker --pair` and `loip pair CODE` to change it)",
            wire::hex(&remote[..8]),
            wire::hex(&pinned[..8])
        );
        let _ = wr.write(FrameKind::Error, why.as_bytes()).await;
        return Err(WireError::Protocol(why));
    }
    if shared.busy.swap(true, Ordering::SeqCst) {
        let _ = wr
            .write(
                FrameKind::Error,
                b"busy: this worker already serves a coordinator",
            )
            .await;
        return Err(WireError::Protocol("refused a second coordinator".into()));
    }
    let _busy = BusyGuard(&shared.busy);
    let info = WorkerInfo {
        name: shared
            .opts
            .name
            .clone()
            .unwrap_or_else(|| format!("worker@{}", shared.addr)),
        version: env!("CARGO_PKG_VERSION").to_string(),
        // the planner plans with the engine's share
        mem_budget: shared.opts.budget().engine,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        bandwidth_limit: shared.opts.bandwidth,
        store: lock(&shared.store).inventory(),
    };
    let welcome = wire::control_payload(&ToCoordinator::Welcome { info: info.clone() })?;
    wr.write(FrameKind::Control, &welcome).await?;

    // Authenticated: one writer task, one compute thread, this task reads.
    let qbytes = queue_bytes(shared.opts.mem_budget);
    let (out_tx, out_rx) = mpsc::channel::<Out>(256);
    let writer = tokio::spawn(write_loop(wr, out_rx));
    let (job_tx, job_rx) = std::sync::mpsc::channel::<(Job, BytePermit)>();
    let (inbox, frame_limit) = (
        ByteBudget::new(qbytes),
        Arc::new(AtomicUsize::new(BASE_FRAME)),
    );
    let (kv_tx, kv_rx) = std::sync::mpsc::channel::<lend::KvBack>();
    let direct = peer::Direct::new(
        info.name.clone(),
        job_tx.clone(),
        out_tx.clone(),
        inbox.clone(),
        frame_limit.clone(),
        kv_tx.clone(),
    );
    *lock(&shared.direct) = Some(direct.clone());
    let q = Queues {
        inbox,
        outbox: ByteBudget::new(qbytes),
        frame_limit,
        direct: direct.clone(),
    };
    let compute = {
        let ctx = ComputeCtx {
            out: out_tx.clone(),
            outbox: q.outbox.clone(),
            rt: tokio::runtime::Handle::current(),
            dir: lock(&shared.store).dir().to_path_buf(),
            budget: shared.opts.budget().engine,
            frame_limit: q.frame_limit.clone(),
            direct: direct.clone(),
            refuse_switches: shared.opts.refuse_switches,
        };
        std::thread::Builder::new()
            .name("loip-compute".into())
            .spawn(move || compute_thread(job_rx, ctx, lend::Lender::new(kv_rx)))
            .map_err(WireError::Io)?
    };
    let result = session(&mut rd, &shared, &out_tx, &job_tx, &q).await;
    if let Err(e) = &result {
        let msg = scrub(&e.to_string(), &shared);
        let _ = out_tx
            .send((FrameKind::Error, msg.into_bytes(), None))
            .await;
    }
    direct.close();
    *lock(&shared.direct) = None;
    drop(q);
    drop(job_tx);
    drop(out_tx);
    // The device (and its memory) is gone before the next coordinator is accepted.
    let _ = tokio::task::spawn_blocking(move || compute.join()).await;
    let _ = writer.await;
    result
}

async fn write_loop(
    mut wr: SealedWriter<OwnedWriteHalf>,
    mut out: mpsc::Receiver<Out>,
) -> Result<(), WireError> {
    while let Some((kind, payload, permit)) = out.recv().await {
        let fatal = kind == FrameKind::Error;
        wr.write(kind, &payload).await?;
        drop(permit);
        if fatal {
            break;
        }
    }
    Ok(())
}

/// A session's byte budgets and its current frame limit.
struct Queues {
    /// frames read and not yet done with
    inbox: ByteBudget,
    /// outputs not yet written
    outbox: ByteBudget,
    /// largest frame accepted now, bytes (raised when a device is loaded)
    frame_limit: Arc<AtomicUsize>,
    /// direct forwarding, and lent KV coming back to the compute thread
    direct: Arc<peer::Direct>,
}

/// Removes this machine's store path from a message meant for a peer.
fn scrub(msg: &str, shared: &Shared) -> String {
    scrub_path(msg, &shared.opts.store)
}

fn scrub_path(msg: &str, dir: &std::path::Path) -> String {
    let d = dir.to_string_lossy();
    if d.is_empty() {
        return crate::net::store::without_file_details(msg);
    }
    let msg = msg.replace(&format!("{d}/"), "").replace(&*d, "the store");
    crate::net::store::without_file_details(&msg)
}

/// Answers a request that cannot be served with `Failed` (the session goes on).
async fn refuse(out: &mpsc::Sender<Out>, message: String) -> Result<(), WireError> {
    reply(
        out,
        &ToCoordinator::Failed {
            step: None,
            message,
        },
    )
    .await
}

async fn reply(out: &mpsc::Sender<Out>, msg: &ToCoordinator) -> Result<(), WireError> {
    out.send((FrameKind::Control, wire::control_payload(msg)?, None))
        .await
        .map_err(|_| WireError::Closed)
}

/// Reads requests until `Bye`, the end of the connection, idleness, or a protocol error.
async fn session(
    rd: &mut SealedReader<OwnedReadHalf>,
    shared: &Shared,
    out: &mpsc::Sender<Out>,
    jobs: &std::sync::mpsc::Sender<(Job, BytePermit)>,
    q: &Queues,
) -> Result<(), WireError> {
    let gone = || WireError::Protocol("the compute thread stopped".into());
    loop {
        // The header first: the frame's bytes are taken from the inbox budget (waiting, and
        // so slowing the peer, while it is spent) before its payload is allocated.
        let limit = q.frame_limit.load(Ordering::Relaxed);
        let (kind, len) = match rd.read_header(limit).await {
            Ok(x) => x,
            Err(WireError::Closed) => return Ok(()),
            Err(WireError::Timeout(t, _)) => {
                return Err(WireError::Protocol(format!(
                    "the coordinator sent nothing for {} s; closing the session",
                    t.as_secs()
                )))
            }
            Err(e) => return Err(e),
        };
        let permit = q.inbox.acquire(len).await;
        let f = rd.read_body(kind, len).await?;
        match f.kind {
            FrameKind::Step => {
                let arrived = Instant::now();
                let (header, data) = wire::decode_step(&f.payload)?;
                let data = data.to_vec();
                drop(f);
                let job = Job::Step {
                    header,
                    data,
                    arrived,
                    route: None,
                };
                jobs.send((job, permit)).map_err(|_| gone())?;
            }
            FrameKind::Routed => q.direct.on_routed(&f.payload, permit)?,
            FrameKind::Kv => {
                // lent KV through the coordinator: held or handed back here, never queued
                // behind steps
                let (h, blob) = wire::lend::decode_kv(&f.payload)
                    .map_err(|e| WireError::Protocol(e.to_string()))?;
                match h.op {
                    wire::lend::KvOp::Put => {
                        let r = lock(&q.direct.held).put(h.lender, h.stage, blob.to_vec());
                        if let Err(e) = r {
                            let message = e.to_string();
                            refuse(out, message).await?
                        }
                    }
                    wire::lend::KvOp::Data => {
                        if let Err(message) = q.direct.data_back(h.stage, blob) {
                            refuse(out, message).await?
                        }
                    }
                    wire::lend::KvOp::Fetch => {
                        return Err(WireError::Protocol(
                            "a lent-KV fetch frame from the coordinator".into(),
                        ))
                    }
                }
            }
            FrameKind::Control => match wire::parse_control::<ToWorker>(&f)? {
                ToWorker::Ping { id } => reply(out, &ToCoordinator::Pong { id }).await?,
                ToWorker::Echo { id } => jobs.send((Job::Echo(id), permit)).map_err(|_| gone())?,
                ToWorker::Peers(m) => {
                    let links = q.direct.on_peers(shared, m).await;
                    reply(out, &ToCoordinator::PeersReady { links }).await?
                }
                ToWorker::Forget { steps } => q.direct.forget(&steps),
                ToWorker::KeepAlive => {}
                ToWorker::BulkSend { bytes } => {
                    if bytes > MAX_BULK {
                        return Err(WireError::Protocol(format!(
                            "bulk of {bytes} bytes is over the limit"
                        )));
                    }
                    let mut got = 0u64;
                    while got < bytes {
                        let b = read_data(rd, BULK_CHUNK, FrameKind::Bulk, "bulk data").await?;
                        got += b.payload.len() as u64;
                    }
                    reply(out, &ToCoordinator::BulkReceived { bytes: got }).await?;
                }
                ToWorker::BulkFetch { bytes } => {
                    if bytes > MAX_BULK {
                        return Err(WireError::Protocol(format!(
                            "bulk of {bytes} bytes is over the limit"
                        )));
                    }
                    let mut left = bytes;
                    while left > 0 {
                        let n = left.min(BULK_CHUNK as u64) as usize;
                        let p = q.outbox.acquire(n).await;
                        out.send((FrameKind::Bulk, vec![0u8; n], Some(p)))
                            .await
                            .map_err(|_| WireError::Closed)?;
                        left -= n as u64;
                    }
                    reply(out, &ToCoordinator::BulkSent { bytes }).await?;
                }
                ToWorker::PutSlice { entry } => {
                    let begun = lock(&shared.store).begin(&entry);
                    let mut w = match begun {
                        Ok(w) => w,
                        Err(e) => return Err(WireError::Protocol(scrub(&e.to_string(), shared))),
                    };
                    while w.remaining() > 0 {
                        let b =
                            read_data(rd, wire::SLICE_CHUNK, FrameKind::SliceData, "slice data")
                                .await?;
                        w.write(&b.payload)
                            .map_err(|e| WireError::Protocol(scrub(&e.to_string(), shared)))?;
                    }
                    let done = {
                        let mut store = lock(&shared.store);
                        w.finish(&mut store)
                    };
                    match done {
                        Ok(()) => reply(out, &ToCoordinator::Stored { file: entry.file }).await?,
                        Err(e) => {
                            let message = scrub(&e.to_string(), shared);
                            refuse(out, message).await?
                        }
                    }
                }
                ToWorker::Probe {
                    manifest,
                    compute,
                    loads,
                } => match validate::check_manifest(&manifest) {
                    Ok(()) => jobs
                        .send((Job::Probe(Box::new(manifest), compute, loads), permit))
                        .map_err(|_| gone())?,
                    Err(message) => {
                        let message = format!("probe refused: {message}");
                        refuse(out, message).await?
                    }
                },
                ToWorker::Load { manifest, spec } => match validate::check_manifest(&manifest) {
                    Ok(()) => {
                        let _ = lock(&shared.store).save_manifest(&manifest);
                        jobs.send((Job::Load(Box::new(manifest), Box::new(spec)), permit))
                            .map_err(|_| gone())?
                    }
                    Err(message) => {
                        let message = format!("cannot open the device: {message}");
                        refuse(out, message).await?
                    }
                },
                ToWorker::Release { seqs } => jobs
                    .send((Job::Release(seqs), permit))
                    .map_err(|_| gone())?,
                ToWorker::Switch { stages } => jobs
                    .send((Job::Switch(stages), permit))
                    .map_err(|_| gone())?,
                ToWorker::Lend { tokens, via } => jobs
                    .send((Job::Lend(tokens, via), permit))
                    .map_err(|_| gone())?,
                ToWorker::Borrow { lender, bytes, via } => jobs
                    .send((Job::Borrow(lender, bytes, via), permit))
                    .map_err(|_| gone())?,
                ToWorker::KvFetch { lender, stage } => {
                    let p = lock(&q.direct.held).fetch(lender, stage);
                    out.send((FrameKind::Kv, p, None))
                        .await
                        .map_err(|_| WireError::Closed)?
                }
                ToWorker::Bye => return Ok(()),
            },
            FrameKind::Error => {
                return Err(WireError::Remote(
                    String::from_utf8_lossy(&f.payload).into_owned(),
                ));
            }
            k => return Err(WireError::Protocol(format!("unexpected {k:?} frame"))),
        }
    }
}

/// Reads the next frame, which must be of `kind` (keepalives in between are skipped).
async fn read_data(
    rd: &mut SealedReader<OwnedReadHalf>,
    max: usize,
    kind: FrameKind,
    what: &str,
) -> Result<wire::Frame, WireError> {
    loop {
        let f = rd.read(max).await?;
        if f.kind == kind {
            return Ok(f);
        }
        if f.kind == FrameKind::Control
            && matches!(wire::parse_control::<ToWorker>(&f), Ok(ToWorker::KeepAlive))
        {
            continue;
        }
        return Err(WireError::Protocol(format!(
            "expected {what}, got {:?}",
            f.kind
        )));
    }
}

/// Runs a worker on a fresh multi-threaded runtime until the process ends; `on_listening`
/// is called with the bound address once the store is verified.
pub fn run_blocking(
    opts: WorkerOptions,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), RuntimeError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("loip-worker-io")
        .build()
        .map_err(|e| RuntimeError::Io {
            path: PathBuf::from("<tokio runtime>"),
            source: e,
        })?;
    rt.block_on(async move {
        let w = Worker::bind(opts).await?;
        on_listening(w.local_addr());
        w.serve().await
    })
}
