//! KV lending on a worker (design §6), both sides.
//!
//! Lender: after stage `k` runs, it asks back the next stage's rows, so they are here before
//! that stage runs, then the oldest rows of `k`'s layers (up to `tokens`, summed over
//! sequences in id order) leave the KV cache (their bytes are freed) in a `Kv` put frame to
//! the borrower (one stage's lent rows are held here at a time). Before a stage with rows out runs, they
//! are put back exactly as they left, or the step fails with a typed error ([`LendError`])
//! when what came back is not what was lent, nothing came back within [`FETCH_WAIT`], or
//! the borrower holding them is gone (named).
//!
//! Two paths: where the coordinator says this worker's peer session to the borrower is up
//! (`Lend { via }`), puts and fetch requests go on that session and the rows come back on it
//! in the reverse direction; the coordinator gets a small notice per transfer (`KvSent`,
//! `KvFetched` with the link's round trip, which sizes lending by Eq. 8). Otherwise
//! everything goes through the coordinator, which times the fetch itself.
//!
//! Borrower: holds each lender's blobs (opaque bytes) within the bytes it reserved, which
//! count against its own KV budget. The held blobs are shared state ([`Borrower`]): puts and
//! fetches are served by the session tasks that read them (the coordinator's and the peer
//! sessions'), never queued behind steps on the compute thread; only a reservation, which
//! changes the device's KV budget, runs there.

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::executor::Device;
use crate::wire::lend::{
    decode_blob, encode_blob, encode_kv, KvHeader, KvOp, LendError, LentRows, KV_HEADER_BYTES,
};
use crate::wire::{FrameKind, ToCoordinator};
use crate::RuntimeError;

use super::{lock, ComputeCtx};

/// How long a stage waits for its lent rows.
pub(super) const FETCH_WAIT: Duration = Duration::from_secs(30);

/// What comes back to the lender's compute thread.
#[derive(Debug)]
pub(super) enum KvBack {
    /// a stage's blob, and when its last byte arrived
    Data {
        stage: u16,
        blob: Vec<u8>,
        at: Instant,
    },
    /// the peer session to a borrower (peer index) failed
    Gone { device: u16, reason: String },
}

/// One stage's rows out.
struct Lent {
    rows: LentRows,
    /// the borrower's peer index when they went on the peer session
    via: Option<u16>,
    /// blob bytes  // bytes
    bytes: usize,
    /// the lend (rows per stage) they went out under  // tokens
    target: u64,
}

/// The lender's side.
pub(super) struct Lender {
    tokens: u64,                            // rows to lend per stage  // tokens
    via: Option<u16>, // the borrower's peer index, when lending over the peer session
    out: HashMap<u16, Lent>, // stage → rows out
    asked: HashMap<u16, Instant>, // stages whose rows were asked back → when
    back: HashMap<u16, (Vec<u8>, Instant)>, // blobs back, not yet put in
    gone: HashMap<u16, String>, // borrowers whose peer session failed → why
    rx: Receiver<KvBack>,
}

fn lend_err(e: LendError) -> RuntimeError {
    RuntimeError::Invalid(e.to_string())
}

impl Lender {
    pub(super) fn new(rx: Receiver<KvBack>) -> Lender {
        Lender {
            tokens: 0,
            via: None,
            out: HashMap::new(),
            asked: HashMap::new(),
            back: HashMap::new(),
            gone: HashMap::new(),
            rx,
        }
    }

    /// Lend `tokens` rows per stage from the next stage that runs (0: stop; rows out come
    /// back as their stages run), over the peer session to `via` when given.
    pub(super) fn set(&mut self, tokens: u64, via: Option<u16>) {
        let path = match via {
            Some(p) => format!("on the peer session to device {p}"),
            None => "through the coordinator".into(),
        };
        tracing::info!("KV lending: {tokens} tokens per stage, {path}");
        self.tokens = tokens;
        self.via = via;
    }

    /// The error of rows of `stage` held by peer `device`, which is gone.
    fn gone_err(ctx: &ComputeCtx, stage: u16, device: u16, reason: &str) -> RuntimeError {
        lend_err(LendError::PeerGone {
            stage,
            device: ctx.direct.peer_name(device),
            reason: reason.to_string(),
        })
    }

    fn ask(&mut self, ctx: &ComputeCtx, stage: u16) -> Result<(), RuntimeError> {
        let Some(l) = self.out.get(&stage) else {
            return Ok(());
        };
        if self.asked.contains_key(&stage) {
            return Ok(());
        }
        // before the request: the rows may come back before `send` returns
        ctx.direct.expect_back(stage, l.bytes);
        let sent = match l.via {
            Some(to) => {
                let h = KvHeader {
                    op: KvOp::Fetch,
                    lender: 0, // the borrower knows the sender
                    stage,
                };
                if !ctx.direct.send_kv(ctx, to, encode_kv(h, &[])) {
                    return Err(Self::gone_err(ctx, stage, to, "its peer session is closed"));
                }
                true
            }
            None => ctx.send(ToCoordinator::KvFetch { stage }),
        };
        if !sent {
            return Err(lend_err(LendError::Gone(stage)));
        }
        self.asked.insert(stage, Instant::now());
        Ok(())
    }

    /// Waits (at most [`FETCH_WAIT`]) for the blob of `stage`, lent via `via`.
    fn wait(
        &mut self,
        ctx: &ComputeCtx,
        stage: u16,
        via: Option<u16>,
    ) -> Result<(Vec<u8>, Instant), RuntimeError> {
        let deadline = Instant::now() + FETCH_WAIT;
        loop {
            if let Some(b) = self.back.remove(&stage) {
                return Ok(b);
            }
            if let Some((&d, why)) = self.gone.iter().find(|(d, _)| via == Some(**d)) {
                return Err(Self::gone_err(ctx, stage, d, why));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(KvBack::Data { stage: s, blob, at }) => {
                    self.back.insert(s, (blob, at));
                }
                Ok(KvBack::Gone { device, reason }) => {
                    self.gone.insert(device, reason);
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(lend_err(LendError::Timeout {
                        stage,
                        secs: FETCH_WAIT.as_secs(),
                    }))
                }
                Err(_) => return Err(lend_err(LendError::Gone(stage))),
            }
        }
    }

    /// Before stage `k` runs: every other stage holds out the rows the current lend asks
    /// ([`Self::top_up`]), then `k`'s rows out come back into the cache.
    pub(super) fn before_stage(
        &mut self,
        d: &mut Device,
        ctx: &ComputeCtx,
        k: usize,
    ) -> Result<(), RuntimeError> {
        self.top_up(d, ctx, k)?;
        self.bring_back(d, ctx, k)
    }

    /// A lend grown since the other stages last ran (a `Lend` arrives between steps, and a
    /// stage lends only after it runs): their rows go out now, before stage `k` runs, so `k`
    /// runs with the room the coordinator counted on (the KV of every stage but the running
    /// one lent). A stage that lent under a smaller lend, with fewer rows out than it could
    /// lend now, is brought back first and lent again: a round trip only when the lend grows
    /// (a stage that lent all the lend allowed then grows its rows as it runs). Called too
    /// before a step's KV is reserved, which counts on the same room.
    pub(super) fn top_up(
        &mut self,
        d: &mut Device,
        ctx: &ComputeCtx,
        k: usize,
    ) -> Result<(), RuntimeError> {
        if !self.lending(d) {
            return Ok(());
        }
        let stages = d.stages();
        for p in (1..stages).map(|i| (k + i) % stages) {
            let out = match self.out.get(&(p as u16)) {
                Some(l) if l.target >= self.tokens => continue,
                Some(l) => l.rows.iter().map(|r| r.1 as u64).sum(),
                None => 0,
            };
            let lendable: u64 = Self::plan(d, p, self.tokens, false)
                .iter()
                .map(|r| r.1 as u64)
                .sum();
            if out >= lendable {
                continue;
            }
            self.bring_back(d, ctx, p)?;
            self.put_out(d, ctx, p)?;
        }
        Ok(())
    }

    /// Rows per sequence stage `k` lends under a lend of `tokens`, in sequence id order: every
    /// row but the newest of each sequence (a sliding layer holds only its window), rows
    /// already out counted as held; with `skip_out`, a sequence with rows out lends none.
    fn plan(d: &Device, k: usize, tokens: u64, skip_out: bool) -> LentRows {
        let layers = &d.spec().stages[k].layers;
        let mut left = tokens;
        let mut rows: LentRows = Vec::new();
        for seq in d.kv.seq_ids() {
            let held = layers
                .iter()
                .map(|l| d.kv.len(seq, l.layer))
                .min()
                .unwrap_or(0);
            let n = (held.saturating_sub(1) as u64).min(left);
            let out = layers.first().is_some_and(|l| d.kv.lent(seq, l.layer) > 0);
            if n > 0 && !(skip_out && out) {
                rows.push((seq, n as u32));
                left -= n;
            }
        }
        rows
    }

    /// Whether rows are lent at all: a lend is set and the device has stages to lend between.
    fn lending(&self, d: &Device) -> bool {
        self.tokens > 0 && d.stages() >= 2
    }

    /// Stage `k`'s rows out (if any) come back into the cache.
    fn bring_back(
        &mut self,
        d: &mut Device,
        ctx: &ComputeCtx,
        k: usize,
    ) -> Result<(), RuntimeError> {
        let stage = k as u16;
        let Some(via) = self.out.get(&stage).map(|l| l.via) else {
            return Ok(());
        };
        self.ask(ctx, stage)?;
        let (blob, at) = self.wait(ctx, stage, via)?;
        let asked = self.asked.remove(&stage);
        let Some(lent) = self.out.remove(&stage) else {
            return Ok(());
        };
        if let Some(to) = via {
            ctx.direct.returned(to, lent.bytes);
            // the coordinator's notice: the link's round trip sizes lending (Eq. 8)
            let secs = asked.map_or(0.0, |t| at.saturating_duration_since(t).as_secs_f64());
            let bytes = blob.len() as u64;
            if !ctx.send(ToCoordinator::KvFetched { stage, bytes, secs }) {
                return Err(lend_err(LendError::Gone(stage)));
            }
        }
        let layers: Vec<usize> = d.spec().stages[k].layers.iter().map(|l| l.layer).collect();
        let kv_dim = d.tf.cfg.num_kv_heads * d.tf.cfg.head_dim;
        let rows = &lent.rows;
        let floats = decode_blob(stage, &blob, rows, layers.len(), kv_dim).map_err(lend_err)?;
        drop(blob);
        let mut o = 0;
        for &layer in &layers {
            for &(seq, n) in rows {
                let w = n as usize * kv_dim;
                let (kr, vr) = (&floats[o..o + w], &floats[o + w..o + 2 * w]);
                o += 2 * w;
                // a sequence released (or restarted) meanwhile: its rows are dropped
                if d.kv.lent(seq, layer) == n as usize {
                    d.kv.return_rows(seq, layer, kr, vr)?;
                }
            }
        }
        Ok(())
    }

    /// After stage `k` of a device with `stages` stages ran: the next stage's rows are asked
    /// back, then `k`'s oldest rows go out (the request goes ahead of the put on the link, so
    /// the rows come back while the put travels, and the round trip times the rows alone).
    pub(super) fn after_stage(
        &mut self,
        d: &mut Device,
        ctx: &ComputeCtx,
        k: usize,
    ) -> Result<(), RuntimeError> {
        if !self.lending(d) {
            return Ok(());
        }
        self.ask(ctx, ((k + 1) % d.stages()) as u16)?;
        self.put_out(d, ctx, k)
    }

    /// Stage `k`'s oldest rows (up to the lend, the newest of each sequence kept) go out.
    fn put_out(&mut self, d: &mut Device, ctx: &ComputeCtx, k: usize) -> Result<(), RuntimeError> {
        let stage = k as u16;
        let layers: Vec<usize> = d.spec().stages[k].layers.iter().map(|l| l.layer).collect();
        let rows = Self::plan(d, k, self.tokens, true);
        if !rows.is_empty() {
            let mut data = Vec::new();
            for &layer in &layers {
                for &(seq, n) in &rows {
                    let (k, v) = d.kv.lend_rows(seq, layer, n as usize)?;
                    data.extend_from_slice(&k);
                    data.extend_from_slice(&v);
                }
            }
            let blob = encode_blob(&rows, &data);
            drop(data);
            let bytes = blob.len();
            let h = KvHeader {
                op: KvOp::Put,
                lender: 0, // the coordinator (or the peer session) names the sender
                stage,
            };
            // the peer session when it is up; else (setup found none, or it closed before
            // anything was lent on it) the coordinator
            let via = self.via.filter(|&to| ctx.direct.has_link(to));
            let sent = match via {
                Some(to) => {
                    ctx.direct.lending(to, bytes);
                    if !ctx.direct.send_kv(ctx, to, encode_kv(h, &blob)) {
                        return Err(Self::gone_err(ctx, stage, to, "its peer session is closed"));
                    }
                    ctx.send(ToCoordinator::KvSent {
                        stage,
                        bytes: bytes as u64,
                    })
                }
                None => ctx.send_frame(FrameKind::Kv, encode_kv(h, &blob)),
            };
            if !sent {
                return Err(lend_err(LendError::Gone(stage)));
            }
            self.out.insert(
                stage,
                Lent {
                    rows,
                    via,
                    bytes,
                    target: self.tokens,
                },
            );
        }
        Ok(())
    }
}

/// The borrower's held blobs, shared by the compute thread and the session tasks.
#[derive(Default)]
pub(super) struct Held {
    reserved: BTreeMap<u16, u64>,        // lender → bytes
    peer_of: BTreeMap<u16, u16>,         // lender → its peer index, when it lends directly
    held: BTreeMap<(u16, u16), Vec<u8>>, // (lender, stage) → blob
}

/// [`Held`], shared.
pub(super) type Borrower = Arc<Mutex<Held>>;

impl Held {
    fn held_by(&self, lender: u16) -> u64 {
        self.held
            .range((lender, 0)..=(lender, u16::MAX))
            .map(|(_, b)| b.len() as u64)
            .sum()
    }

    /// The lender whose rows come on the peer session of peer `from`, if any.
    pub(super) fn lender_of(&self, from: u16) -> Option<u16> {
        self.peer_of
            .iter()
            .find(|(_, &p)| p == from)
            .map(|(&l, _)| l)
    }

    /// The largest `Kv` frame peer `from` may send (a put of all it reserved).  // bytes
    pub(super) fn frame_cap(&self, from: u16) -> usize {
        let r = self
            .lender_of(from)
            .and_then(|l| self.reserved.get(&l).copied())
            .unwrap_or(0);
        usize::try_from(r)
            .unwrap_or(usize::MAX)
            .saturating_add(KV_HEADER_BYTES)
    }

    /// Holds a put blob; refused (typed error) past the reservation.
    pub(super) fn put(&mut self, lender: u16, stage: u16, blob: Vec<u8>) -> Result<(), LendError> {
        let old = self
            .held
            .get(&(lender, stage))
            .map_or(0, |b| b.len() as u64);
        let after = self.held_by(lender) - old + blob.len() as u64;
        let reserved = self.reserved.get(&lender).copied().unwrap_or(0);
        if after > reserved {
            return Err(LendError::OverReserved {
                lender,
                bytes: after,
                reserved,
            });
        }
        self.held.insert((lender, stage), blob);
        Ok(())
    }

    /// The data frame returning `lender`'s blob of `stage` (empty when none is held: the
    /// lender sees a short blob).
    pub(super) fn fetch(&mut self, lender: u16, stage: u16) -> Vec<u8> {
        let blob = self.held.remove(&(lender, stage)).unwrap_or_default();
        let h = KvHeader {
            op: KvOp::Data,
            lender,
            stage,
        };
        encode_kv(h, &blob)
    }

    /// A `Kv` frame from peer `from`'s session: a put (held; None back) or a fetch request
    /// (the data frame to send back). Anything else, a peer that lends nothing here, or a
    /// put past the reservation is a typed error.
    pub(super) fn on_peer_frame(
        &mut self,
        from: u16,
        payload: &[u8],
    ) -> Result<Option<Vec<u8>>, LendError> {
        let (h, blob) = crate::wire::lend::decode_kv(payload)?;
        let lender = self.lender_of(from).ok_or(LendError::NotLending(from))?;
        match h.op {
            KvOp::Put => self.put(lender, h.stage, blob.to_vec()).map(|()| None),
            KvOp::Fetch => Ok(Some(self.fetch(lender, h.stage))),
            KvOp::Data => Err(LendError::BadOp(KvOp::Data as u8)),
        }
    }

    /// Forgets everything (the session ended).
    pub(super) fn clear(&mut self) {
        *self = Held::default();
    }
}

/// Reserve `bytes` for `lender` (never under what it holds), within the KV budget; its rows
/// come on peer `via`'s session too when given.
pub(super) fn borrow(
    b: &Borrower,
    d: Option<&mut Device>,
    lender: u16,
    bytes: u64,
    via: Option<u16>,
) -> ToCoordinator {
    let mut h = lock(b);
    let want = bytes.max(h.held_by(lender));
    let old = h.reserved.get(&lender).copied().unwrap_or(0);
    let others: u64 = h
        .reserved
        .iter()
        .filter(|(l, _)| **l != lender)
        .map(|(_, b)| *b)
        .sum();
    let ok = match d {
        Some(d) => d.kv.set_held_for_peers(others + want).is_ok(),
        None => false,
    };
    if ok {
        h.reserved.insert(lender, want);
        match via {
            Some(p) => h.peer_of.insert(lender, p),
            None => h.peer_of.remove(&lender),
        };
    }
    tracing::info!("KV borrowing for device {lender}: {want} bytes, reserved: {ok}");
    ToCoordinator::Borrowed {
        lender,
        bytes: if ok { want } else { old },
        ok,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put_frame(stage: u16, blob: &[u8]) -> Vec<u8> {
        let h = KvHeader {
            op: KvOp::Put,
            lender: 9, // ignored: the session names the sender
            stage,
        };
        encode_kv(h, blob)
    }

    #[test]
    fn peer_frames_are_held_within_the_reservation_and_nothing_else_is_accepted() {
        let mut h = Held::default();
        h.reserved.insert(2, 100);
        h.peer_of.insert(2, 5);
        assert_eq!(h.frame_cap(5), 100 + KV_HEADER_BYTES);
        assert_eq!(h.frame_cap(6), KV_HEADER_BYTES);
        // a peer that lends nothing here
        assert_eq!(
            h.on_peer_frame(6, &put_frame(0, &[1; 10])),
            Err(LendError::NotLending(6))
        );
        // within the reservation, then past it (summed over stages)
        assert_eq!(h.on_peer_frame(5, &put_frame(0, &[1; 60])), Ok(None));
        assert_eq!(
            h.on_peer_frame(5, &put_frame(1, &[2; 41])),
            Err(LendError::OverReserved {
                lender: 2,
                bytes: 101,
                reserved: 100
            })
        );
        // a stage put again replaces its blob
        assert_eq!(h.on_peer_frame(5, &put_frame(0, &[3; 100])), Ok(None));
        // data frames only go the other way; short and unknown frames are errors
        let data = encode_kv(
            KvHeader {
                op: KvOp::Data,
                lender: 2,
                stage: 0,
            },
            &[],
        );
        assert_eq!(h.on_peer_frame(5, &data), Err(LendError::BadOp(2)));
        assert!(h.on_peer_frame(5, &[1, 0]).is_err());
        assert_eq!(
            h.on_peer_frame(5, &[7, 0, 0, 0, 0]),
            Err(LendError::BadOp(7))
        );
        // a fetch returns the blob once, then an empty one
        let fetch = encode_kv(
            KvHeader {
                op: KvOp::Fetch,
                lender: 0,
                stage: 0,
            },
            &[],
        );
        let back = h.on_peer_frame(5, &fetch).unwrap().unwrap();
        let (hb, blob) = crate::wire::lend::decode_kv(&back).unwrap();
        assert_eq!((hb.op, hb.lender, hb.stage), (KvOp::Data, 2, 0));
        assert_eq!(blob, &[3u8; 100][..]);
        let back = h.on_peer_frame(5, &fetch).unwrap().unwrap();
        assert_eq!(back.len(), KV_HEADER_BYTES);
    }
}
