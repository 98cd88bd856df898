//! KV lending through the coordinator (design §6): a lender's `Kv` put frames go to the
//! peer the adapter chose for it, named by the sender (a worker cannot pose as another
//! lender); its fetch requests go to that peer, whose data frames go back to the lender,
//! each only along a lend the adapter made. The time from a fetch request to its data is
//! the transfer rate lending is sized by (Eq. 8).

use std::time::Instant;

use super::Sched;
use crate::wire::lend::{decode_kv, encode_kv, KvHeader, KvOp};
use crate::wire::{self, Frame, FrameKind, ToWorker};

impl Sched {
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
                }
                let p = encode_kv(h, blob);
                self.forward(l, FrameKind::Kv, p);
            }
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
