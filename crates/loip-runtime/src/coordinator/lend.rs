//! KV lending's coordinator side (design §6). Where the lender's peer session to its
//! borrower is up ([`HopLinks::reach`](super::HopLinks)), the rows go on it and the lender
//! sends small notices: `KvSent` per put and `KvFetched` per fetch with the link's round
//! trip, which is the transfer rate lending is sized by (Eq. 8); the coordinator counts the
//! link's bytes and the device's fetches from them. Otherwise (`--relay`, relay pairs, a pair
//! that cannot reach each other) the coordinator relays: a lender's `Kv` put frames go to the
//! peer the adapter chose for it, named by the sender (a worker cannot pose as another
//! lender); its fetch requests go to that peer, whose data frames go back to the lender,
//! each only along a lend the adapter made, and the time from a fetch request to its data
//! is the rate. The borrower serves both off its compute thread, so neither rate includes
//! waiting behind steps.

use std::time::Instant;

use serde::Serialize;

use super::{lock, Sched};
use crate::wire::lend::{decode_kv, encode_kv, KvHeader, KvOp};
use crate::wire::{self, Frame, FrameKind, ToWorker};

/// Lent KV fetched back, as the coordinator saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LendTotals {
    /// fetches on peer sessions (timed by the lender)
    pub direct_fetches: u64,
    /// fetches relayed by the coordinator (timed here)
    pub relayed_fetches: u64,
    /// their round trips, request to last byte, summed  // seconds
    pub fetch_s: f64,
    /// their bytes  // bytes
    pub bytes: u64,
}

impl Sched {
    /// Adds a fetch to the totals.
    fn tally(&self, direct: bool, bytes: u64, secs: f64) {
        let mut t = lock(&self.shared.lend);
        if direct {
            t.direct_fetches += 1;
        } else {
            t.relayed_fetches += 1;
        }
        t.fetch_s += secs;
        t.bytes += bytes;
    }

    /// Whether lender `a`'s rows held by `b` go on their peer session.
    pub(super) fn lends_direct(&self, a: usize, b: usize) -> bool {
        let r = &self.links.reach;
        r.get(a).and_then(|x| x.get(b)).copied().unwrap_or(false)
    }

    /// Whether device `d`'s lent KV is held by `p` and goes on their peer session.
    pub(super) fn lending_on(&self, d: usize, p: usize) -> bool {
        let peer = self.adapt.as_ref().and_then(|a| a.adapter.lend_peer(d));
        peer == Some(p) && self.lends_direct(d, p)
    }

    /// The `via` of a `Lend` to `lender`: its borrower's peer index when the rows go direct.
    pub(super) fn lend_via(&self, lender: usize) -> Option<u16> {
        let a = self.adapt.as_ref()?;
        let p = a.adapter.lend_peer(lender)?;
        self.lends_direct(lender, p).then(|| self.peer_id(p))
    }

    /// The borrower of device `d`'s rows, when they go on their peer session; else marks
    /// `d` gone (`what` it sent does not fit a lend).
    fn direct_peer(&mut self, d: usize, what: &str) -> Option<usize> {
        let p = self.adapt.as_ref().and_then(|a| a.adapter.lend_peer(d));
        match p.filter(|&p| self.lends_direct(d, p)) {
            Some(p) => Some(p),
            None => {
                self.mark_gone(d, format!("sent {what} without a direct lend"));
                None
            }
        }
    }

    /// Device `d` put `bytes` of lent KV of a stage on its peer session.
    pub(super) fn on_kv_sent(&mut self, d: usize, _stage: u16, bytes: u64) {
        if let Some(p) = self.direct_peer(d, "a lent-KV notice") {
            self.count(Some(d), Some(p), bytes);
        }
    }

    /// Device `d` got `bytes` of its lent KV back on its peer session, `secs` after asking.
    pub(super) fn on_kv_fetched(&mut self, d: usize, _stage: u16, bytes: u64, secs: f64) {
        let Some(p) = self.direct_peer(d, "a lent-KV notice") else {
            return;
        };
        self.count(Some(p), Some(d), bytes);
        let secs = if secs.is_finite() { secs.max(0.0) } else { 0.0 };
        self.tally(true, bytes, secs);
        if let Some(a) = self.adapt.as_mut() {
            a.adapter.on_fetched(d, bytes, secs);
        }
    }

    fn forward(&mut self, to: usize, kind: FrameKind, payload: Vec<u8>) {
        if self.alive.get(to).is_some_and(|a| a.is_none())
            && self.writers[to].send((kind, payload)).is_err()
        {
            self.mark_gone(to, "its connection closed".into());
        }
    }

    /// A `Kv` frame from device `d`.
    pub(super) fn on_kv(&mut self, d: usize, f: Frame) {
        let Some(a) = self.adapt.as_mut() else {
            return self.mark_gone(d, "sent lent KV without adaptation".into());
        };
        let (h, blob) = match decode_kv(&f.payload) {
            Ok(x) => x,
            Err(e) => return self.mark_gone(d, e.to_string()),
        };
        match h.op {
            KvOp::Put => {
                let Some(peer) = a.adapter.lend_peer(d) else {
                    return self.mark_gone(d, "sent lent KV without a lend".into());
                };
                let h = KvHeader {
                    lender: d as u16,
                    ..h
                };
                let p = encode_kv(h, blob);
                self.count(Some(d), None, blob.len() as u64);
                self.count(None, Some(peer), blob.len() as u64);
                self.forward(peer, FrameKind::Kv, p);
            }
            KvOp::Data => {
                let l = h.lender as usize;
                if a.adapter.lend_peer(l) != Some(d) {
                    return self
                        .mark_gone(d, format!("returned KV of device {l} it does not hold"));
                }
                if let Some(t) = a.fetch_at.remove(&(l, h.stage)) {
                    let secs = t.elapsed().as_secs_f64();
                    a.adapter.on_fetched(l, blob.len() as u64, secs);
                    self.tally(false, blob.len() as u64, secs);
                }
                let p = encode_kv(h, blob);
                self.count(Some(d), None, blob.len() as u64);
                self.count(None, Some(l), blob.len() as u64);
                self.forward(l, FrameKind::Kv, p);
            }
            KvOp::Fetch => self.mark_gone(d, "sent a lent-KV fetch frame".into()),
        }
    }

    /// Device `d` asks its lent KV of `stage` back.
    pub(super) fn on_kv_fetch(&mut self, d: usize, stage: u16) {
        let Some(a) = self.adapt.as_mut() else {
            return self.mark_gone(d, "asked lent KV back without adaptation".into());
        };
        let Some(peer) = a.adapter.lend_peer(d) else {
            return self.mark_gone(d, "asked lent KV back without a lend".into());
        };
        a.fetch_at.insert((d, stage), Instant::now());
        let msg = ToWorker::KvFetch {
            lender: d as u16,
            stage,
        };
        if let Ok(p) = wire::control_payload(&msg) {
            self.forward(peer, FrameKind::Control, p);
        }
    }
}
