//! `loip worker`: one device. It keeps the slices it was given in its store (checked by
//! checksum, reused after a restart), serves one coordinator at a time, and runs the steps
//! it is sent on its [`Device`].
//!
//! Per connection: `Hello` both ways (another version is refused, naming both), the token
//! challenge (a wrong token is refused), then requests until the coordinator says `Bye` or
//! goes away. The socket is read by one task and written by another; everything that touches
//! the model (probe, opening the device, steps, KV release) runs in order on one compute
//! thread, so steps are processed first come, first served. A malformed frame closes that
//! connection with an `Error` frame; a step that fails (bad stage, KV budget) is answered
//! with `Failed` and the connection stays up. Nothing a peer sends can panic the process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use loip_engine::TokenPos;
use loip_model::slice::Manifest;
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use crate::executor::{Device, DeviceSpec};
use crate::net::store::Store;
use crate::net::throttle::Throttle;
use crate::wire::{
    self, FrameKind, JobTimes, OutputHeader, OutputKind, Role, StepHeader, ToCoordinator, ToWorker,
    WireError, WorkerInfo,
};
use crate::RuntimeError;

/// Options of one worker.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// address to listen on, e.g. `0.0.0.0:7001` or `127.0.0.1:0`
    pub listen: String,
    /// memory budget, bytes
    pub mem_budget: u64,
    /// slice store directory
    pub store: PathBuf,
    /// shared secret; `None` accepts any coordinator
    pub token: Option<String>,
    /// name reported to the coordinator
    pub name: Option<String>,
    /// emulated outgoing bandwidth limit, bytes/s
    pub bandwidth: Option<f64>,
    /// limit for the hello and authentication exchange
    pub handshake_timeout: Duration,
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
            store: store.into(),
            token: None,
            name: None,
            bandwidth: None,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// Largest frame accepted before authentication, bytes.
const PRE_AUTH_FRAME: usize = 64 << 10;
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
        let store = {
            let dir = opts.store.clone();
            tokio::task::spawn_blocking(move || Store::open(&dir))
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
        Ok(Worker {
            listener,
            shared: Arc::new(Shared {
                opts,
                store: Mutex::new(store),
                busy: AtomicBool::new(false),
                throttle,
                addr,
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
            let shared = self.shared.clone();
            tokio::spawn(async move {
                match connection(stream, shared).await {
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

async fn send_error(w: &mut tokio::net::tcp::OwnedWriteHalf, msg: &str) {
    let _ = wire::write_frame(w, FrameKind::Error, msg.as_bytes(), None).await;
}

async fn connection(stream: TcpStream, shared: Arc<Shared>) -> Result<(), WireError> {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let to = shared.opts.handshake_timeout;
    wire::write_frame(
        &mut wr,
        FrameKind::Hello,
        &wire::hello_payload(Role::Worker, wire::PROTOCOL_VERSION),
        None,
    )
    .await?;
    let hello =
        wire::read_frame_timeout(&mut rd, PRE_AUTH_FRAME, to, "the coordinator's hello").await;
    let checked = hello.and_then(|f| wire::check_hello(&f));
    if let Err(e) = checked {
        let msg = match &e {
            WireError::VersionMismatch { ours, theirs } => {
                format!("protocol version mismatch: this worker speaks LOIP v{ours}, the coordinator v{theirs}")
            }
            other => format!("refused: {other}"),
        };
        send_error(&mut wr, &msg).await;
        return Err(e);
    }
    if shared.busy.swap(true, Ordering::SeqCst) {
        send_error(&mut wr, "busy: this worker already serves a coordinator").await;
        return Err(WireError::Protocol("refused a second coordinator".into()));
    }
    let _busy = BusyGuard(&shared.busy);
    let token = shared.opts.token.as_deref();
    let nonce = wire::nonce();
    let challenge = wire::control_payload(&ToCoordinator::Challenge {
        nonce: nonce.clone(),
    })?;
    wire::write_frame(&mut wr, FrameKind::Control, &challenge, None).await?;
    let f = wire::read_frame_timeout(&mut rd, PRE_AUTH_FRAME, to, "authentication").await?;
    let their_nonce = match wire::parse_control::<ToWorker>(&f) {
        Ok(ToWorker::Auth { mac, nonce: theirs }) => {
            if token.is_some() && !wire::ct_eq(&mac, &wire::auth_mac(token, &nonce)) {
                send_error(&mut wr, "authentication failed: wrong token").await;
                return Err(WireError::AuthRefused(
                    "a coordinator gave a wrong token".into(),
                ));
            }
            theirs
        }
        Ok(other) => {
            send_error(&mut wr, "expected authentication").await;
            return Err(WireError::Protocol(format!("expected auth, got {other:?}")));
        }
        Err(e) => {
            send_error(&mut wr, &format!("bad authentication message: {e}")).await;
            return Err(e);
        }
    };
    if their_nonce.len() > 256 {
        send_error(&mut wr, "nonce too long").await;
        return Err(WireError::Protocol("nonce too long".into()));
    }
    let info = WorkerInfo {
        name: shared
            .opts
            .name
            .clone()
            .unwrap_or_else(|| format!("worker@{}", shared.addr)),
        version: env!("CARGO_PKG_VERSION").to_string(),
        mem_budget: shared.opts.mem_budget,
        threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        bandwidth_limit: shared.opts.bandwidth,
        store: lock(&shared.store).inventory(),
    };
    let welcome = wire::control_payload(&ToCoordinator::Welcome {
        mac: wire::auth_mac(token, &their_nonce),
        info,
    })?;
    wire::write_frame(&mut wr, FrameKind::Control, &welcome, None).await?;

    // Authenticated: one writer task, one compute thread, this task reads.
    let (out_tx, mut out_rx) = mpsc::channel::<(FrameKind, Vec<u8>)>(64);
    let throttle = shared.throttle.clone();
    let writer = tokio::spawn(async move {
        while let Some((kind, payload)) = out_rx.recv().await {
            let fatal = kind == FrameKind::Error;
            wire::write_frame(&mut wr, kind, &payload, throttle.as_ref()).await?;
            if fatal {
                break;
            }
        }
        Ok::<(), WireError>(())
    });
    let (job_tx, job_rx) = std::sync::mpsc::channel::<Job>();
    let compute = {
        let out = out_tx.clone();
        let dir = lock(&shared.store).dir().to_path_buf();
        let budget = shared.opts.mem_budget;
        std::thread::Builder::new()
            .name("loip-compute".into())
            .spawn(move || compute_thread(job_rx, out, dir, budget))
            .map_err(WireError::Io)?
    };
    let result = session(&mut rd, &shared, &out_tx, &job_tx).await;
    if let Err(e) = &result {
        let _ = out_tx
            .send((FrameKind::Error, e.to_string().into_bytes()))
            .await;
    }
    drop(job_tx);
    drop(out_tx);
    // The device (and its memory) is gone before the next coordinator is accepted.
    let _ = tokio::task::spawn_blocking(move || compute.join()).await;
    let _ = writer.await;
    result
}

async fn reply(
    out: &mpsc::Sender<(FrameKind, Vec<u8>)>,
    msg: &ToCoordinator,
) -> Result<(), WireError> {
    out.send((FrameKind::Control, wire::control_payload(msg)?))
        .await
        .map_err(|_| WireError::Closed)
}

/// Reads requests until `Bye`, the end of the connection, or a protocol error.
async fn session(
    rd: &mut OwnedReadHalf,
    shared: &Shared,
    out: &mpsc::Sender<(FrameKind, Vec<u8>)>,
    jobs: &std::sync::mpsc::Sender<Job>,
) -> Result<(), WireError> {
    let gone = || WireError::Protocol("the compute thread stopped".into());
    loop {
        let f = match wire::read_frame(rd, wire::MAX_FRAME).await {
            Ok(f) => f,
            Err(WireError::Closed) => return Ok(()),
            Err(e) => return Err(e),
        };
        match f.kind {
            FrameKind::Step => {
                let arrived = Instant::now();
                let (header, data) = wire::decode_step(&f.payload)?;
                let data = data.to_vec();
                jobs.send(Job::Step {
                    header,
                    data,
                    arrived,
                })
                .map_err(|_| gone())?;
            }
            FrameKind::Control => match wire::parse_control::<ToWorker>(&f)? {
                ToWorker::Ping { id } => reply(out, &ToCoordinator::Pong { id }).await?,
                ToWorker::BulkSend { bytes } => {
                    if bytes > MAX_BULK {
                        return Err(WireError::Protocol(format!(
                            "bulk of {bytes} bytes is over the limit"
                        )));
                    }
                    let mut got = 0u64;
                    while got < bytes {
                        let b = wire::read_frame(rd, wire::MAX_FRAME).await?;
                        if b.kind != FrameKind::Bulk {
                            return Err(WireError::Protocol(format!(
                                "expected bulk data, got {:?}",
                                b.kind
                            )));
                        }
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
                        out.send((FrameKind::Bulk, vec![0u8; n]))
                            .await
                            .map_err(|_| WireError::Closed)?;
                        left -= n as u64;
                    }
                    reply(out, &ToCoordinator::BulkSent { bytes }).await?;
                }
                ToWorker::PutSlice { entry } => {
                    let mut w = match lock(&shared.store).begin(&entry) {
                        Ok(w) => w,
                        Err(e) => return Err(WireError::Protocol(e.to_string())),
                    };
                    while w.remaining() > 0 {
                        let b = wire::read_frame(rd, wire::MAX_FRAME).await?;
                        if b.kind != FrameKind::SliceData || b.payload.len() > wire::SLICE_CHUNK {
                            return Err(WireError::Protocol(format!(
                                "expected slice data for {}, got {:?}",
                                entry.file, b.kind
                            )));
                        }
                        w.write(&b.payload)
                            .map_err(|e| WireError::Protocol(e.to_string()))?;
                    }
                    let done = {
                        let mut store = lock(&shared.store);
                        w.finish(&mut store)
                    };
                    match done {
                        Ok(()) => reply(out, &ToCoordinator::Stored { file: entry.file }).await?,
                        Err(e) => {
                            reply(
                                out,
                                &ToCoordinator::Failed {
                                    step: None,
                                    message: e.to_string(),
                                },
                            )
                            .await?
                        }
                    }
                }
                ToWorker::Probe {
                    manifest,
                    compute,
                    loads,
                } => jobs
                    .send(Job::Probe(Box::new(manifest), compute, loads))
                    .map_err(|_| gone())?,
                ToWorker::Load { manifest, spec } => {
                    let _ = lock(&shared.store).save_manifest(&manifest);
                    jobs.send(Job::Load(Box::new(manifest), Box::new(spec)))
                        .map_err(|_| gone())?
                }
                ToWorker::Release { seqs } => jobs.send(Job::Release(seqs)).map_err(|_| gone())?,
                ToWorker::Bye => return Ok(()),
                ToWorker::Auth { .. } => {
                    return Err(WireError::Protocol("authentication twice".into()))
                }
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

enum Job {
    Probe(Box<Manifest>, bool, bool),
    Load(Box<Manifest>, Box<DeviceSpec>),
    Step {
        header: StepHeader,
        data: Vec<u8>,
        arrived: Instant,
    },
    Release(Vec<u64>),
}

fn compute_thread(
    jobs: std::sync::mpsc::Receiver<Job>,
    out: mpsc::Sender<(FrameKind, Vec<u8>)>,
    dir: PathBuf,
    budget: u64,
) {
    let mut device: Option<Device> = None;
    let send = |msg: ToCoordinator| match wire::control_payload(&msg) {
        Ok(p) => out.blocking_send((FrameKind::Control, p)).is_ok(),
        Err(_) => false,
    };
    while let Ok(job) = jobs.recv() {
        let ok = match job {
            Job::Probe(m, compute, loads) => {
                match crate::net::probe::probe(&dir, &m, compute, loads) {
                    Ok(r) => send(ToCoordinator::Probed(r)),
                    Err(e) => send(ToCoordinator::Failed {
                        step: None,
                        message: format!("probe failed: {e}"),
                    }),
                }
            }
            Job::Load(m, spec) => {
                device = None; // free the old device's memory first
                let mut spec = *spec;
                // The worker's own budget is the truth, whatever the plan assumed.
                spec.mem_budget = Some(budget);
                match Device::open(&dir, &m, spec) {
                    Ok(d) => {
                        let memory = d.memory().into();
                        device = Some(d);
                        send(ToCoordinator::Loaded { memory })
                    }
                    Err(e) => send(ToCoordinator::Failed {
                        step: None,
                        message: format!("cannot open the device: {e}"),
                    }),
                }
            }
            Job::Release(seqs) => {
                if let Some(d) = device.as_mut() {
                    for s in seqs {
                        d.kv.remove(s);
                    }
                }
                true
            }
            Job::Step {
                header,
                data,
                arrived,
            } => {
                let queued_s = arrived.elapsed().as_secs_f64();
                let result = match device.as_mut() {
                    Some(d) => run_step(d, &header, &data),
                    None => Err(RuntimeError::Invalid("no device is loaded".into())),
                };
                match result {
                    Ok((kind, cols, rows_out, bytes)) => {
                        let t = device.as_mut().map(|d| d.take_times()).unwrap_or_default();
                        let times = JobTimes {
                            queued_s,
                            compute_s: t.compute_s,
                            stall_s: t.stall_s,
                            total_s: arrived.elapsed().as_secs_f64(),
                            loaded_bytes: t.loaded_bytes,
                        };
                        let h = OutputHeader {
                            step: header.step,
                            kind,
                            rows: rows_out,
                            cols,
                            times,
                        };
                        out.blocking_send((FrameKind::Output, wire::encode_output(&h, &bytes)))
                            .is_ok()
                    }
                    Err(e) => {
                        if let Some(d) = device.as_mut() {
                            let _ = d.take_times();
                        }
                        send(ToCoordinator::Failed {
                            step: Some(header.step),
                            message: e.to_string(),
                        })
                    }
                }
            }
        };
        if !ok {
            return;
        }
    }
}

/// Runs one step on the device: embed, stages, head. Returns (what the rows hold, values per
/// row, rows, bytes). On error, rolls this device's KV of the step's sequences back to where
/// the step began.
fn run_step(
    d: &mut Device,
    h: &StepHeader,
    data: &[u8],
) -> Result<(OutputKind, u32, u32, Vec<u8>), RuntimeError> {
    let bad = |m: String| RuntimeError::Invalid(m);
    let (hidden, max_pos) = (d.tf.cfg.hidden_size, d.tf.cfg.max_position_embeddings);
    let n = h.batch.len();
    if n == 0 {
        return Err(bad("a step without tokens".into()));
    }
    if let Some(t) = h.batch.iter().find(|t| t.pos >= max_pos) {
        return Err(bad(format!(
            "position {} is beyond the model's {max_pos} positions",
            t.pos
        )));
    }
    if let Some(&k) = h.stages.iter().find(|&&k| k as usize >= d.stages()) {
        return Err(bad(format!(
            "stage {k} of a device with {} stages",
            d.stages()
        )));
    }
    let mut x = if h.embed {
        let ids = wire::bytes_u32(data).map_err(|e| bad(e.to_string()))?;
        if ids.len() != n {
            return Err(bad(format!("{} ids for {n} tokens", ids.len())));
        }
        d.embed(&ids)?
    } else {
        if data.len() != n * hidden * 4 {
            return Err(bad(format!(
                "{} bytes of hidden state for {n} tokens of {hidden} floats",
                data.len()
            )));
        }
        wire::bytes_f32(data).map_err(|e| bad(e.to_string()))?
    };
    // Where each sequence of the step starts, for a rollback.
    let mut starts: Vec<TokenPos> = Vec::new();
    for t in &h.batch {
        match starts.iter_mut().find(|s| s.seq == t.seq) {
            Some(s) => s.pos = s.pos.min(t.pos),
            None => starts.push(*t),
        }
    }
    if h.stages.first() == Some(&0) {
        // A sequence starting over at position 0 drops what it had cached.
        for s in starts.iter().filter(|s| s.pos == 0) {
            d.kv.remove(s.seq);
        }
        d.reserve(n)?;
    }
    let last = h.stages.len().saturating_sub(1);
    let run = |d: &mut Device, x: &mut Vec<f32>| -> Result<(), RuntimeError> {
        for (i, &k) in h.stages.iter().enumerate() {
            if h.keep && i == last {
                d.run_stage_keep(k as usize, x, &h.batch)?;
            } else {
                d.run_stage(k as usize, x, &h.batch)?;
            }
        }
        Ok(())
    };
    if let Err(e) = run(d, &mut x) {
        for s in &starts {
            d.kv.truncate(s.seq, s.pos);
        }
        return Err(e);
    }
    if h.head {
        let rows: Vec<usize> = h.rows.iter().map(|&r| r as usize).collect();
        let mut logits = d.head(&x, &rows)?;
        let vocab = d.tf.cfg.vocab_size;
        let Some(masked) = &h.argmax else {
            let bytes = wire::f32_bytes(&logits);
            return Ok((OutputKind::Logits, vocab as u32, rows.len() as u32, bytes));
        };
        // the coordinator's greedy sampler, here: mask, then the same argmax
        let picks: Vec<(u32, f32)> = logits
            .chunks_exact_mut(vocab.max(1))
            .map(|row| {
                loip_engine::sampling::mask(row, masked);
                let id = loip_engine::sampling::argmax(row);
                (id, row[id as usize])
            })
            .collect();
        let bytes = wire::argmax_bytes(&picks);
        return Ok((OutputKind::Argmax, 2, rows.len() as u32, bytes));
    }
    Ok((
        OutputKind::Hidden,
        hidden as u32,
        n as u32,
        wire::f32_bytes(&x),
    ))
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
