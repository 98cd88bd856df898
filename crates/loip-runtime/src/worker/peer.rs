//! The worker's side of direct forwarding ([`crate::net::direct`]): the pipeline state of one
//! coordinator session ([`Direct`]), the peer sessions this worker accepts (rows from the
//! device before it) and opens (rows to the device after it), and routed steps.
//!
//! Invariants:
//! - A [`Direct`] lives as long as its coordinator session; [`Direct::close`] drops every
//!   sender it holds (job queue, coordinator output, links), so the session's compute thread
//!   and writer end, and ends its peer sessions.
//! - Rows from a peer become a job only for a hop the coordinator announced on this worker as
//!   coming from that very peer; they wait for the announcement at most
//!   [`ANNOUNCE_WAIT`], holding their inbox bytes (one frame per peer session at a time).
//!   Rows for a step the coordinator told this worker to forget are dropped. Anything else
//!   closes that peer session with an `Error` frame; the coordinator session stays up.
//! - A peer session is admitted only with the pipeline's key, from a device the coordinator
//!   said to expect whose static key the session proved in its handshake (a token holder
//!   cannot claim another device's index), one session per such device; frames obey the
//!   session's frame limit and inbox budget, as the coordinator's do.
//! - A link this worker hands rows to that fails is reported to the coordinator
//!   (`PeerGone`), which fails the steps in flight naming that device; nothing waits on it.
//! - KV lending ([`super::lend`]) uses the same sessions: the lender's puts and fetch
//!   requests go on its outgoing session to the borrower, which holds the rows within what
//!   it reserved for that very peer (a larger frame is refused before it is read) and sends
//!   them back on the same session. The lender reads back only `Kv` data frames no larger
//!   than what it has out there; a failed session also wakes a lender waiting for its rows.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, watch, Notify};

use super::lend::{Borrower, KvBack};
use super::{lock, ComputeCtx, Job, Out, Shared, MAX_BULK};
use crate::net::direct::{
    self, FromPeer, Notice, PeerLinkReport, PeerRef, PeersMsg, ToPeer, ANNOUNCE_WAIT,
};
use crate::net::handshake::Handshake;
use crate::net::handshake::PRE_AUTH_FRAME;
use crate::net::peer::{self, PeerAuth, PeerConn};
use crate::net::queue::{ByteBudget, BytePermit};
use crate::net::session::{SealedReader, SealedWriter};
use crate::wire::lend::{decode_kv, KvOp, KV_HEADER_BYTES};
use crate::wire::{self, FrameKind, JobTimes, Role, StepHeader, ToCoordinator, WireError};

/// Steps remembered as forgotten (their late rows are dropped quietly).
const FORGET_MAX: usize = 4096;
/// Frames queued towards one peer before the compute thread waits.
const LINK_QUEUE: usize = 64;

/// Where a routed hop's output goes.
#[derive(Debug, Clone, Copy)]
pub(super) struct HopRoute {
    /// the hop's index in its step's route
    pub hop: u16,
    /// the peer to hand the output to; None: the coordinator
    pub to: Option<u16>,
}

/// A hop announced by the coordinator whose rows come from a peer.
struct Pending {
    header: StepHeader,
    from: u16,
    to: Option<u16>,
    _permit: BytePermit, // the header frame's inbox bytes
}

struct State {
    open: bool,
    jobs: Option<std::sync::mpsc::Sender<(Job, BytePermit)>>,
    out: Option<mpsc::Sender<Out>>, // to the coordinator
    key: Option<String>,
    name: String,
    expect: Vec<PeerRef>,
    incoming: HashSet<u16>,
    links: HashMap<u16, mpsc::Sender<Out>>,
    pending: HashMap<(u64, u16), Pending>,
    forgotten: VecDeque<u64>,
    /// lent KV coming back, to the compute thread
    kv_back: Option<std::sync::mpsc::Sender<KvBack>>,
    /// lent KV out on each link (peer → bytes): the most a data frame from it may carry
    lent: HashMap<u16, usize>,
}

/// The direct-forwarding state of one coordinator session.
pub(super) struct Direct {
    /// lent KV this worker holds for its peers (puts and fetches are served on the session
    /// tasks, the coordinator's and the peers')
    pub(super) held: Borrower,
    /// lent KV this worker asked back and has not received: stage → most blob bytes. A
    /// `Data` frame for a stage not here, or larger, is refused before it is held, so at
    /// most one blob per asked stage waits for the compute thread (bytes the lend took out
    /// of the KV budget)
    asked: Mutex<HashMap<u16, usize>>,
    inbox: ByteBudget,
    frame_limit: Arc<AtomicUsize>,
    state: Mutex<State>,
    announced: Notify,
    closed: watch::Sender<bool>,
}

/// What a coordinator is told of a peer link that could not be made (the reason is logged
/// here only).
pub(super) const UNREACHABLE: &str = "unreachable (this worker's log says why)";

fn gone() -> WireError {
    WireError::Protocol("the compute thread stopped".into())
}

impl Direct {
    /// The state of a new coordinator session.
    pub(super) fn new(
        name: String,
        jobs: std::sync::mpsc::Sender<(Job, BytePermit)>,
        out: mpsc::Sender<Out>,
        inbox: ByteBudget,
        frame_limit: Arc<AtomicUsize>,
        kv_back: std::sync::mpsc::Sender<KvBack>,
    ) -> Arc<Direct> {
        Arc::new(Direct {
            held: Borrower::default(),
            asked: Mutex::new(HashMap::new()),
            inbox,
            frame_limit,
            state: Mutex::new(State {
                open: true,
                jobs: Some(jobs),
                out: Some(out),
                key: None,
                name,
                expect: Vec::new(),
                incoming: HashSet::new(),
                links: HashMap::new(),
                pending: HashMap::new(),
                forgotten: VecDeque::new(),
                kv_back: Some(kv_back),
                lent: HashMap::new(),
            }),
            announced: Notify::new(),
            closed: watch::channel(false).0,
        })
    }

    /// Ends the session's forwarding: drops every sender and ends the peer sessions.
    pub(super) fn close(&self) {
        {
            let mut st = lock(&self.state);
            st.open = false;
            st.jobs = None;
            st.out = None;
            st.links.clear();
            st.pending.clear();
            st.kv_back = None;
            st.lent.clear();
        }
        lock(&self.held).clear();
        self.closed.send_replace(true);
        self.announced.notify_waiters();
    }

    fn push(st: &State, job: Job, permit: BytePermit) -> Result<(), WireError> {
        match &st.jobs {
            Some(j) => j.send((job, permit)).map_err(|_| gone()),
            None => Err(gone()),
        }
    }

    /// A `Routed` frame from the coordinator.
    pub(super) fn on_routed(&self, payload: &[u8], permit: BytePermit) -> Result<(), WireError> {
        let arrived = Instant::now();
        let (r, rest) = direct::decode_routed(payload)?;
        let (header, data) = wire::decode_step(rest)?;
        let mut st = lock(&self.state);
        let route = Some(HopRoute {
            hop: r.hop,
            to: r.to,
        });
        let Some(from) = r.from else {
            let job = Job::Step {
                header,
                data: data.to_vec(),
                arrived,
                route,
            };
            return Self::push(&st, job, permit);
        };
        if !st.expect.iter().any(|p| p.device == from) {
            return Err(WireError::Protocol(format!(
                "step {} announced from device {from}, which this worker does not expect",
                header.step
            )));
        }
        if !data.is_empty() {
            return Err(WireError::Protocol(
                "a step announced from a peer carries its own input".into(),
            ));
        }
        let k = (header.step, r.hop);
        if st.pending.contains_key(&k) {
            return Err(WireError::Protocol(format!(
                "step {} hop {} announced twice",
                k.0, k.1
            )));
        }
        st.pending.insert(
            k,
            Pending {
                header,
                from,
                to: r.to,
                _permit: permit,
            },
        );
        drop(st);
        self.announced.notify_waiters();
        Ok(())
    }

    /// The coordinator failed these steps: drop what waits for them.
    pub(super) fn forget(&self, steps: &[u64]) {
        let mut st = lock(&self.state);
        st.pending.retain(|(s, _), _| !steps.contains(s));
        for &s in steps {
            if st.forgotten.len() >= FORGET_MAX {
                st.forgotten.pop_front();
            }
            st.forgotten.push_back(s);
        }
    }

    /// Rows from peer `from` for `hop` of `step`.
    async fn on_hand(
        &self,
        from: u16,
        step: u64,
        hop: u16,
        rows: Vec<u8>,
        permit: BytePermit,
    ) -> Result<(), WireError> {
        let deadline = tokio::time::Instant::now() + ANNOUNCE_WAIT;
        let mut permit = Some(permit);
        let mut rows = Some(rows);
        loop {
            let notified = self.announced.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = lock(&self.state);
                if !st.open {
                    return Err(WireError::Closed);
                }
                if let Some(p) = st.pending.get(&(step, hop)) {
                    if p.from != from {
                        return Err(WireError::Protocol(format!(
                            "rows for step {step} hop {hop} from device {from}; they come from device {}",
                            p.from
                        )));
                    }
                    if let (Some(p), Some(data), Some(permit)) =
                        (st.pending.remove(&(step, hop)), rows.take(), permit.take())
                    {
                        let job = Job::Step {
                            header: p.header,
                            data,
                            arrived: Instant::now(),
                            route: Some(HopRoute { hop, to: p.to }),
                        };
                        return Self::push(&st, job, permit);
                    }
                    return Err(gone());
                }
                if st.forgotten.contains(&step) {
                    return Ok(());
                }
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(WireError::Protocol(format!(
                        "rows for step {step} hop {hop} that the coordinator did not announce here"
                    )));
                }
            }
        }
    }

    /// Admits a peer session's hello: the key, an expected device whose static key the
    /// session proved (`proved`), one session each.
    fn admit(&self, key: &str, from: u16, proved: &[u8; 32]) -> Result<String, String> {
        let mut st = lock(&self.state);
        let ok_key = st
            .key
            .as_deref()
            .is_some_and(|k| direct::same_secret(k, key));
        if !st.open || !ok_key {
            return Err("refused: no pipeline of this worker has that key".into());
        }
        let Some(dev) = st.expect.iter().find(|p| p.device == from) else {
            return Err(format!(
                "refused: device {from} does not hand rows to this worker"
            ));
        };
        if !dev.proves(proved) {
            return Err(format!(
                "refused: this session proved another static key than device {from}'s"
            ));
        }
        if !st.incoming.insert(from) {
            return Err(format!("refused: device {from} already has a session here"));
        }
        Ok(st.name.clone())
    }

    fn leave(&self, from: u16) {
        lock(&self.state).incoming.remove(&from);
    }

    /// `Peers` from the coordinator: expect `msg.expect`, then open and measure the links to
    /// `msg.connect`.
    pub(super) async fn on_peers(
        self: &Arc<Self>,
        shared: &Shared,
        msg: PeersMsg,
    ) -> Vec<PeerLinkReport> {
        {
            let mut st = lock(&self.state);
            st.key = Some(msg.key.clone());
            st.expect = msg.expect.clone();
        }
        let token = shared.opts.token.clone().unwrap_or_default();
        let to = shared.opts.handshake_timeout;
        let mut reports = Vec::new();
        for target in &msg.connect {
            let auth = PeerAuth {
                me: msg.me,
                key: &msg.key,
                identity: &shared.identity,
                token: &token,
            };
            let r = async {
                let mut c = peer::connect(target, &auth, to, shared.throttle.clone()).await?;
                let m = if msg.measure {
                    c.measure().await?
                } else {
                    (0.0, 0.0)
                };
                Ok::<_, WireError>((c, m))
            }
            .await;
            match r {
                Ok((c, (latency_s, bps))) => {
                    let tx = self.spawn_link(target.device, c);
                    lock(&self.state).links.insert(target.device, tx);
                    reports.push(PeerLinkReport {
                        device: target.device,
                        reachable: true,
                        error: None,
                        latency_s,
                        bps,
                    });
                }
                Err(e) => {
                    tracing::warn!("no peer session to {} ({}): {e}", target.name, target.addr);
                    // only "unreachable" goes back: the reason (refused, a banner read as a
                    // frame length) would map this worker's network for the token holder
                    reports.push(PeerLinkReport {
                        device: target.device,
                        reachable: false,
                        error: Some(UNREACHABLE.into()),
                        latency_s: 0.0,
                        bps: 0.0,
                    });
                }
            }
        }
        reports
    }

    /// Reports a failed link to the coordinator (once; nothing waits for the answer).
    fn peer_gone(&self, device: u16, reason: String) {
        let mut st = lock(&self.state);
        if !st.open || st.links.remove(&device).is_none() {
            return;
        }
        if let Some(k) = &st.kv_back {
            let reason = reason.clone();
            let _ = k.send(KvBack::Gone { device, reason });
        }
        if let Some(out) = &st.out {
            if let Ok(p) = wire::control_payload(&ToCoordinator::PeerGone { device, reason }) {
                let _ = out.try_send((FrameKind::Control, p, None));
            }
        }
    }

    /// The writer (keepalives when idle) and the watcher of one outgoing peer session.
    fn spawn_link(self: &Arc<Self>, device: u16, c: PeerConn) -> mpsc::Sender<Out> {
        let (tx, mut rx) = mpsc::channel::<Out>(LINK_QUEUE);
        let PeerConn { mut rd, mut wr, .. } = c;
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let ka = wire::control_payload(&ToPeer::KeepAlive).unwrap_or_default();
            loop {
                let next = tokio::time::timeout(crate::coordinator::KEEPALIVE, rx.recv()).await;
                let r = match next {
                    Ok(Some((kind, payload, permit))) => {
                        let r = wr.write(kind, &payload).await;
                        drop(permit);
                        r
                    }
                    Ok(None) => return,
                    Err(_) => wr.write(FrameKind::Control, &ka).await,
                };
                if let Err(e) = r {
                    if let Some(d) = me.upgrade() {
                        d.peer_gone(device, format!("sending to it failed: {e}"));
                    }
                    return;
                }
            }
        });
        let me = Arc::downgrade(self);
        let mut closed = self.closed.subscribe();
        tokio::spawn(async move {
            let why = loop {
                let r = tokio::select! {
                    r = read_back(&mut rd, &me, device) => r,
                    _ = closed.changed() => return,
                };
                match (r, me.upgrade()) {
                    (Ok((stage, blob)), Some(d)) => {
                        if let Err(why) = d.data_back(stage, &blob) {
                            break why;
                        }
                    }
                    (Ok(_), None) => return,
                    (Err(why), _) => break why,
                }
            };
            if let Some(d) = me.upgrade() {
                d.peer_gone(device, why);
            }
        });
        tx
    }

    fn kv_back(&self, back: KvBack) {
        if let Some(k) = &lock(&self.state).kv_back {
            let _ = k.send(back);
        }
    }

    /// The lender asked `stage`'s rows back: one blob of at most `bytes` may come.
    pub(super) fn expect_back(&self, stage: u16, bytes: usize) {
        lock(&self.asked).insert(stage, bytes);
    }

    /// Lent KV of `stage` arrived (on the coordinator's session or a peer's): handed to the
    /// compute thread when it was asked for and is no larger than what was lent; else refused
    /// (why), and nothing is held.
    pub(super) fn data_back(&self, stage: u16, blob: &[u8]) -> Result<(), String> {
        let most = lock(&self.asked).remove(&stage).ok_or_else(|| {
            format!("lent KV of stage {stage} that this worker did not ask back was refused")
        })?;
        if blob.len() > most {
            return Err(format!(
                "lent KV of stage {stage} of {} bytes was refused: at most {most} were lent",
                blob.len()
            ));
        }
        self.kv_back(KvBack::Data {
            stage,
            blob: blob.to_vec(),
            at: Instant::now(),
        });
        Ok(())
    }

    /// Whether this worker's session to peer `to` is up.
    pub(super) fn has_link(&self, to: u16) -> bool {
        lock(&self.state).links.contains_key(&to)
    }

    /// Peer `device`'s name (its index when unknown).
    pub(super) fn peer_name(&self, device: u16) -> String {
        let st = lock(&self.state);
        match st.expect.iter().find(|p| p.device == device) {
            Some(p) => p.name.clone(),
            None => device.to_string(),
        }
    }

    /// `bytes` of lent KV go out to peer `to` (a data frame from it may carry them back).
    pub(super) fn lending(&self, to: u16, bytes: usize) {
        *lock(&self.state).lent.entry(to).or_insert(0) += bytes;
    }

    /// `bytes` of lent KV came back from peer `to`.
    pub(super) fn returned(&self, to: u16, bytes: usize) {
        if let Some(n) = lock(&self.state).lent.get_mut(&to) {
            *n = n.saturating_sub(bytes);
        }
    }

    /// On the compute thread: a `Kv` frame to peer `to` on this worker's session to it.
    /// False when that session is closed.
    pub(super) fn send_kv(&self, ctx: &ComputeCtx, to: u16, payload: Vec<u8>) -> bool {
        let Some(l) = lock(&self.state).links.get(&to).cloned() else {
            return false;
        };
        let permit = ctx.outbox.blocking_acquire(payload.len(), &ctx.rt);
        l.blocking_send((FrameKind::Kv, payload, Some(permit)))
            .is_ok()
    }

    /// On the compute thread: hands a hop's output to peer `to`, then tells the coordinator.
    /// False when the coordinator session is gone.
    pub(super) fn hand_on(
        &self,
        ctx: &ComputeCtx,
        step: u64,
        route: HopRoute,
        to: u16,
        rows: Vec<u8>,
        times: JobTimes,
    ) -> bool {
        // the rows are the input of the next hop
        let payload = direct::encode_hand(step, route.hop.saturating_add(1), &rows);
        drop(rows);
        let bytes = payload.len() as u64;
        let link = lock(&self.state).links.get(&to).cloned();
        let sent = match link {
            Some(l) => {
                let permit = ctx.outbox.blocking_acquire(payload.len(), &ctx.rt);
                l.blocking_send((FrameKind::Hand, payload, Some(permit)))
                    .is_ok()
            }
            None => false,
        };
        if !sent {
            // Tell the coordinator (once per link); it fails the steps in flight.
            let reason = "the session to it is closed".to_string();
            return ctx.send(ToCoordinator::PeerGone { device: to, reason });
        }
        let n = Notice {
            step,
            hop: route.hop,
            bytes,
            times,
        };
        ctx.send_frame(FrameKind::Notice, direct::encode_notice(&n))
    }
}

/// Serves a peer session this worker accepted (after the handshake as role `peer`).
pub(super) async fn serve_peer(
    hs: Handshake,
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
    shared: Arc<Shared>,
) -> Result<(), WireError> {
    let (mut rd, mut wr) = hs.keys.seal(Role::Worker, rd, wr, shared.throttle.clone());
    rd.set_idle_timeout(Some(shared.opts.idle_timeout));
    let r = peer_session(&mut rd, &mut wr, &shared, &hs.remote).await;
    if let Err(e) = &r {
        let msg = super::scrub(&e.to_string(), &shared);
        let _ = wr.write(FrameKind::Error, msg.as_bytes()).await;
    }
    r
}

async fn peer_session(
    rd: &mut SealedReader<OwnedReadHalf>,
    wr: &mut SealedWriter<OwnedWriteHalf>,
    shared: &Shared,
    proved: &[u8; 32],
) -> Result<(), WireError> {
    let to = shared.opts.handshake_timeout;
    let f = rd
        .read_timeout(PRE_AUTH_FRAME, to, "the peer's hello")
        .await?;
    let (key, from) = match wire::parse_control::<ToPeer>(&f)? {
        ToPeer::Hello { key, from } => (key, from),
        _ => return Err(WireError::Protocol("expected the peer's hello".into())),
    };
    let Some(d) = lock(&shared.direct).clone() else {
        return Err(WireError::AuthRefused(
            "no pipeline of this worker expects peers".into(),
        ));
    };
    let name = d
        .admit(&key, from, proved)
        .map_err(WireError::AuthRefused)?;
    let r = peer_frames(rd, wr, &d, from, name).await;
    d.leave(from);
    r
}

async fn send(wr: &mut SealedWriter<OwnedWriteHalf>, m: &FromPeer) -> Result<(), WireError> {
    wr.write(FrameKind::Control, &wire::control_payload(m)?)
        .await
}

async fn peer_frames(
    rd: &mut SealedReader<OwnedReadHalf>,
    wr: &mut SealedWriter<OwnedWriteHalf>,
    d: &Direct,
    from: u16,
    name: String,
) -> Result<(), WireError> {
    send(wr, &FromPeer::Welcome { name }).await?;
    let mut closed = d.closed.subscribe();
    if *closed.borrow() {
        return Ok(());
    }
    loop {
        let (kind, len) = tokio::select! {
            r = rd.read_header(wire::MAX_FRAME) => match r {
                Ok(x) => x,
                Err(WireError::Closed) => return Ok(()),
                Err(e) => return Err(e),
            },
            _ = closed.changed() => return Ok(()),
        };
        // the limit of this kind, now (before the body is read): lent KV may be larger than
        // a step's rows, up to a put of all the peer's reservation
        let cap = match kind {
            FrameKind::Kv => lock(&d.held).frame_cap(from),
            _ => d.frame_limit.load(Ordering::Relaxed),
        };
        if len > cap {
            return Err(WireError::TooLarge {
                len: len as u64,
                max: cap,
            });
        }
        let permit = tokio::select! {
            p = d.inbox.acquire(len) => p,
            _ = closed.changed() => return Ok(()),
        };
        let f = rd.read_body(kind, len).await?;
        match f.kind {
            FrameKind::Hand => {
                let (step, hop, rows) = direct::decode_hand(&f.payload)?;
                let rows = rows.to_vec();
                drop(f);
                tokio::select! {
                    r = d.on_hand(from, step, hop, rows, permit) => r?,
                    _ = closed.changed() => return Ok(()),
                }
            }
            FrameKind::Kv => {
                let back = lock(&d.held)
                    .on_peer_frame(from, &f.payload)
                    .map_err(|e| WireError::Protocol(e.to_string()))?;
                drop(f);
                drop(permit);
                if let Some(p) = back {
                    wr.write(FrameKind::Kv, &p).await?;
                }
            }
            FrameKind::Control => match wire::parse_control::<ToPeer>(&f)? {
                ToPeer::KeepAlive => {}
                ToPeer::Ping { id } => send(wr, &FromPeer::Pong { id }).await?,
                ToPeer::BulkSend { bytes } => {
                    if bytes > MAX_BULK {
                        return Err(WireError::Protocol(format!(
                            "bulk of {bytes} bytes is over the limit"
                        )));
                    }
                    drop(permit);
                    let mut got = 0u64;
                    while got < bytes {
                        let b = rd.read(super::BULK_CHUNK).await?;
                        if b.kind != FrameKind::Bulk {
                            return Err(WireError::Protocol(format!(
                                "expected bulk data, got {:?}",
                                b.kind
                            )));
                        }
                        got += b.payload.len() as u64;
                    }
                    send(wr, &FromPeer::BulkReceived { bytes: got }).await?;
                }
                ToPeer::Hello { .. } => return Err(WireError::Protocol("a second hello".into())),
            },
            FrameKind::Error => {
                return Err(WireError::Remote(
                    String::from_utf8_lossy(&f.payload).into_owned(),
                ))
            }
            k => {
                return Err(WireError::Protocol(format!(
                    "unexpected {k:?} frame from a peer"
                )))
            }
        }
    }
}

/// Reads the next frame a peer sends back on this worker's session to it (`device`): lent KV
/// coming back (stage and blob), no larger than what is out there; anything else ends the
/// session (why).
async fn read_back(
    rd: &mut SealedReader<OwnedReadHalf>,
    me: &std::sync::Weak<Direct>,
    device: u16,
) -> Result<(u16, Vec<u8>), String> {
    let (kind, len) = match rd.read_header(wire::MAX_FRAME).await {
        Ok(x) => x,
        Err(WireError::Closed) => return Err("it closed the session".into()),
        Err(e) => return Err(e.to_string()),
    };
    let cap = match kind {
        FrameKind::Kv => me.upgrade().map_or(0, |d| {
            let out = lock(&d.state).lent.get(&device).copied().unwrap_or(0);
            out.saturating_add(KV_HEADER_BYTES)
        }),
        FrameKind::Error => PRE_AUTH_FRAME,
        k => return Err(format!("it sent an unexpected {k:?} frame")),
    };
    if len > cap {
        return Err(format!(
            "it sent a {kind:?} frame of {len} bytes; at most {cap} are expected"
        ));
    }
    let f = rd.read_body(kind, len).await.map_err(|e| e.to_string())?;
    if kind == FrameKind::Error {
        return Err(format!(
            "it reported: {}",
            String::from_utf8_lossy(&f.payload)
        ));
    }
    match decode_kv(&f.payload) {
        Ok((h, blob)) if h.op == KvOp::Data => Ok((h.stage, blob.to_vec())),
        Ok((h, _)) => Err(format!("it sent a lent-KV frame of op {:?}", h.op)),
        Err(e) => Err(e.to_string()),
    }
}
