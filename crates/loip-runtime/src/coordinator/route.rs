//! Hop routing of the scheduler: sending a step's hops, taking each hop's answer, and
//! finishing the step.
//!
//! Two ways a hop gets its input ([`HopLinks`]):
//! - relayed: the coordinator sends the hop a `Step` frame with the rows the hop before
//!   returned to it (the star; `--relay` routes every hop so);
//! - direct: the hop's header goes to its device when the hop before is sent, and the
//!   device before hands it the rows itself (a `Hand` frame on their peer session), then
//!   sends the coordinator a small `Notice` with its times ([`crate::net::direct`]).
//!
//! A step is finished when every hop has answered (outputs and notices may arrive in any
//! order over the devices' connections) and the last hop's output is here; its wall time
//! ends when that output arrives. The breakdown stays exact: every hop reports its
//! worker-side times, so `network = wall − Σ time inside the workers` as without forwarding.
//! The step is at its first hop that has not answered: a timeout names that hop's device.

use std::time::Instant;

use serde::Serialize;

use super::{lock, Sched, StepOutput};
use crate::net::direct::{self, Routed};
use crate::wire::{self, Frame, FrameKind, JobTimes, OutputKind, StepHeader, ToWorker};

/// How each hop of a route gets its input.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HopLinks {
    /// per hop: its rows come straight from the previous hop's device (hop 0: never); empty:
    /// every hop is relayed
    pub direct: Vec<bool>,
    /// per pipeline device: its index in the workers' `Peers` messages
    pub peer_ids: Vec<u16>,
    /// per pipeline device pair `[a][b]`: `a`'s peer session to `b` is up (lent KV of `a`
    /// held by `b` goes on it); empty: none (everything relayed)
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub reach: Vec<Vec<bool>>,
}

/// Bytes one link carried, counted by the coordinator: its own sends and receipts, and the
/// rows each worker reported handing to the next.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LinkBytes {
    /// sending side: a device name, or `coordinator`
    pub from: String,
    /// receiving side
    pub to: String,
    /// payload bytes  // bytes
    pub bytes: u64,
}

/// Where a step stands on its route.
#[derive(Debug, Default)]
pub(super) struct Progress {
    /// per hop: it answered (empty until the first answer)
    done: Vec<bool>,
    /// the last hop's result and when it arrived
    head: Option<HeadOut>,
}

/// The last hop's logits (or argmax picks) and when they arrived.
type HeadOut = (Vec<f32>, Vec<(u32, f32)>, Instant);

/// The coordinator's name in [`LinkBytes`].
const COORDINATOR: &str = "coordinator";

impl Sched {
    fn is_direct(&self, h: usize) -> bool {
        self.links.direct.get(h).copied().unwrap_or(false)
    }

    fn routed(&self) -> bool {
        self.links.direct.iter().any(|&d| d)
    }

    pub(super) fn peer_id(&self, d: usize) -> u16 {
        self.links.peer_ids.get(d).copied().unwrap_or(d as u16)
    }

    fn name(&self, d: Option<usize>) -> String {
        match d {
            Some(d) => self.endpoints[d].name.clone(),
            None => COORDINATOR.to_string(),
        }
    }

    /// Adds `bytes` to the link `from` → `to` (None: the coordinator).
    pub(super) fn count(&self, from: Option<usize>, to: Option<usize>, bytes: u64) {
        let k = (self.name(from), self.name(to));
        *lock(&self.shared.links).entry(k).or_insert(0) += bytes;
    }

    /// Sends a step that enters the pipeline (its first hop, input `data`).
    pub(super) fn dispatch(&mut self, step: u64, data: Vec<u8>) {
        let Some(f) = self.inflight.get(&step) else {
            return;
        };
        let h = f.hop;
        self.send_from(step, h, data);
    }

    /// Sends hop `h` of `step` with its input `data`, then the header of every following hop
    /// whose rows come straight from the hop before.
    fn send_from(&mut self, step: u64, h: usize, data: Vec<u8>) {
        let n_hops = self.route.hops.len();
        let mut data = Some(data);
        let mut k = h;
        while k < n_hops {
            let hop = &self.route.hops[k];
            let d = hop.device;
            if self.alive[d].is_some() {
                let e = self.gone_error(d);
                self.fail(step, e);
                return;
            }
            let Some(f) = self.inflight.get(&step) else {
                return;
            };
            let header = StepHeader {
                step,
                embed: hop.embed,
                head: hop.head,
                keep: self.keep(step, k, k != h),
                stages: hop.stages.clone(),
                batch: f.batch.clone(),
                rows: if hop.head { f.rows.clone() } else { Vec::new() },
                argmax: if hop.head { f.argmax.clone() } else { None },
                row_masks: if hop.head {
                    f.row_masks.clone()
                } else {
                    Vec::new()
                },
                rewind: f.rewind.clone(),
            };
            let input = if k == h {
                data.take().unwrap_or_default()
            } else {
                Vec::new()
            };
            let (kind, payload) = if self.routed() {
                let r = Routed {
                    hop: k as u16,
                    from: (k != h).then(|| self.peer_id(self.route.hops[k - 1].device)),
                    to: (self.is_direct(k + 1))
                        .then(|| self.peer_id(self.route.hops[k + 1].device)),
                };
                let p = direct::encode_routed(&r, &wire::encode_step(&header, &input));
                (FrameKind::Routed, p)
            } else {
                (FrameKind::Step, wire::encode_step(&header, &input))
            };
            let n = payload.len() as u64;
            if self.writers[d].send((kind, payload)).is_err() {
                self.mark_gone(d, "its connection closed".into());
                return;
            }
            self.count(None, Some(d), n);
            if let Some(f) = self.inflight.get_mut(&step) {
                f.stats.bytes += n;
                if k == h {
                    f.sent = Instant::now();
                }
            }
            k += 1;
            if !self.is_direct(k) {
                return;
            }
        }
    }

    /// The hop of `step` whose output device `d` sent: the first one not answered, at `d`,
    /// whose output comes back here, and that its input could have reached (only direct
    /// hops between it and the first hop not answered).
    fn output_hop(&self, step: u64, d: usize) -> Option<usize> {
        let f = self.inflight.get(&step)?;
        let n = self.route.hops.len();
        let mut k = f.hop;
        while k < n {
            let hop = &self.route.hops[k];
            let done = f.progress.done.get(k).copied().unwrap_or(false);
            if !done && hop.device == d && (hop.head || !self.is_direct(k + 1)) {
                return Some(k);
            }
            if !self.is_direct(k + 1) {
                return None;
            }
            k += 1;
        }
        None
    }

    /// Records hop `k` of `step` as answered with `times`; `bytes` came from its device.
    fn hop_done(&mut self, step: u64, k: usize, times: &JobTimes, bytes: u64) {
        let n = self.route.hops.len();
        let Some(f) = self.inflight.get_mut(&step) else {
            return;
        };
        if f.progress.done.len() != n {
            f.progress.done = vec![false; n];
        }
        f.progress.done[k] = true;
        let waited_s = f.sent.elapsed().as_secs_f64();
        lock(&self.shared.devices).hop(self.route.hops[k].device, times, waited_s);
        f.stats.compute_s += times.compute_s;
        f.stats.stall_s += times.stall_s;
        f.stats.queued_s += times.queued_s;
        f.stats.loaded_bytes += times.loaded_bytes;
        f.stats.bytes += bytes;
        f.worker_s += times.total_s;
        while f.hop < n && f.progress.done[f.hop] {
            f.hop += 1;
        }
        f.sent = Instant::now();
    }

    /// An `Output` frame from device `d`.
    pub(super) fn on_output(&mut self, d: usize, f: Frame) {
        let (h, data) = match wire::decode_output(&f.payload) {
            Ok(x) => x,
            Err(e) => return self.mark_gone(d, format!("sent a malformed output: {e}")),
        };
        if !self.inflight.contains_key(&h.step) {
            return; // a failed step
        }
        let Some(k) = self.output_hop(h.step, d) else {
            return self.mark_gone(
                d,
                format!("answered step {} that is not at this device", h.step),
            );
        };
        let Some(fl) = self.inflight.get(&h.step) else {
            return;
        };
        let head = self.route.hops[k].head;
        let (want_kind, want_rows, want_cols) = match (head, fl.argmax.is_some()) {
            (true, true) => (OutputKind::Argmax, fl.rows.len() as u32, 2),
            (true, false) => (
                OutputKind::Logits,
                fl.rows.len() as u32,
                self.opts.vocab as u32,
            ),
            (false, _) => (
                OutputKind::Hidden,
                fl.batch.len() as u32,
                self.opts.hidden as u32,
            ),
        };
        if h.kind != want_kind || h.rows != want_rows || h.cols != want_cols {
            return self.mark_gone(
                d,
                format!(
                    "answered with {:?} {}×{}, expected {want_kind:?} {want_rows}×{want_cols}",
                    h.kind, h.rows, h.cols
                ),
            );
        }
        let len = f.payload.len() as u64;
        self.count(Some(d), None, len);
        if !head {
            let data = data.to_vec();
            self.hop_done(h.step, k, &h.times, len);
            return self.send_from(h.step, k + 1, data);
        }
        let (logits, argmax) = if h.kind == OutputKind::Argmax {
            match wire::bytes_argmax(data) {
                Ok(a) if a.iter().all(|&(id, _)| (id as usize) < self.opts.vocab) => {
                    (Vec::new(), a)
                }
                Ok(_) => {
                    return self.mark_gone(d, "returned a token id outside the vocabulary".into())
                }
                Err(e) => return self.mark_gone(d, e.to_string()),
            }
        } else {
            match wire::bytes_f32(data) {
                Ok(l) => (l, Vec::new()),
                Err(e) => return self.mark_gone(d, e.to_string()),
            }
        };
        self.hop_done(h.step, k, &h.times, len);
        if let Some(fl) = self.inflight.get_mut(&h.step) {
            fl.progress.head = Some((logits, argmax, Instant::now()));
        }
        self.try_finish(h.step);
    }

    /// A `Notice` frame from device `d`: a hop handed its rows to the next device.
    pub(super) fn on_notice(&mut self, d: usize, f: Frame) {
        let n = match direct::decode_notice(&f.payload) {
            Ok(n) => n,
            Err(e) => return self.mark_gone(d, format!("sent a malformed notice: {e}")),
        };
        let Some(fl) = self.inflight.get(&n.step) else {
            return; // a failed step
        };
        let k = n.hop as usize;
        let valid = k < self.route.hops.len()
            && k >= fl.hop
            && self.route.hops[k].device == d
            && self.is_direct(k + 1)
            && !fl.progress.done.get(k).copied().unwrap_or(false);
        if !valid {
            return self.mark_gone(
                d,
                format!(
                    "sent a notice for step {} hop {k}, which is not at this device",
                    n.step
                ),
            );
        }
        let len = f.payload.len() as u64;
        self.count(Some(d), None, len);
        self.count(Some(d), Some(self.route.hops[k + 1].device), n.bytes);
        self.hop_done(n.step, k, &n.times, len);
        self.try_finish(n.step);
    }

    /// Device `d` reports that its session to the device with peer index `peer` failed:
    /// that device is declared gone (the steps in flight fail, naming it).
    pub(super) fn on_peer_gone(&mut self, d: usize, peer: u16, reason: String) {
        let p = self.links.peer_ids.iter().position(|&id| id == peer);
        // Only a link a hop uses matters (setup opens links between every two workers).
        let used = p.is_some_and(|p| {
            (1..self.route.hops.len()).any(|k| {
                self.is_direct(k)
                    && self.route.hops[k - 1].device == d
                    && self.route.hops[k].device == p
            }) || self.lending_on(d, p)
        });
        let from = self.endpoints[d].name.clone();
        let Some(p) = p.filter(|_| used) else {
            tracing::debug!("device {from}: an unused peer link ({peer}) closed: {reason}");
            return;
        };
        self.mark_gone(p, format!("device {from} cannot hand it rows: {reason}"));
    }

    /// Tells the devices to drop what they hold for a failed step (direct forwarding only).
    pub(super) fn forget(&self, step: u64) {
        if !self.routed() {
            return;
        }
        let Ok(p) = wire::control_payload(&ToWorker::Forget { steps: vec![step] }) else {
            return;
        };
        for (d, w) in self.writers.iter().enumerate() {
            if self.alive[d].is_none() {
                let _ = w.send((FrameKind::Control, p.clone()));
            }
        }
    }

    /// Replies to a step once every hop has answered and the last hop's output is here.
    fn try_finish(&mut self, step: u64) {
        let n = self.route.hops.len();
        let ready = self
            .inflight
            .get(&step)
            .is_some_and(|f| f.hop >= n && f.progress.head.is_some());
        if !ready {
            return;
        }
        let Some(mut fl) = self.inflight.remove(&step) else {
            return;
        };
        let Some((logits, argmax, ended)) = fl.progress.head.take() else {
            return;
        };
        fl.stats.wall_s = ended.duration_since(fl.started).as_secs_f64();
        fl.stats.network_s = (fl.stats.wall_s - fl.worker_s).max(0.0);
        fl.stats.tokens = fl.batch.len() as u64;
        {
            let mut t = lock(&self.shared.totals);
            // one token per sequence: a decode step (of a micro-batch)
            if fl.seqs.len() == fl.batch.len() {
                let k = t.early_steps as usize;
                if k < t.early.len() {
                    t.early_span += 1;
                    t.span.add(&fl.stats);
                    if !fl.parked && t.early_span > u64::from(loip_plan::calibrate::REPRICE_SKIP) {
                        t.early[k] = fl.stats;
                        t.early_steps += 1;
                    }
                }
                t.decode_steps += 1;
                t.decode.add(&fl.stats);
            } else {
                t.prompt_steps += 1;
                t.prompt.add(&fl.stats);
            }
        }
        // its sequences' next steps are due: the next wave waits for them (`wave`)
        self.waves.returned(&fl.seqs, fl.stats.wall_s);
        for &q in &fl.seqs {
            self.returned.insert(q, ended);
        }
        self.waves.forget(step);
        let _ = fl.reply.send(Ok(StepOutput {
            logits,
            argmax,
            stats: fl.stats,
        }));
        self.step_left();
    }
}

/// The link counters of a pipeline, in name order.
pub(super) fn link_bytes(m: &std::collections::BTreeMap<(String, String), u64>) -> Vec<LinkBytes> {
    m.iter()
        .map(|((from, to), &bytes)| LinkBytes {
            from: from.clone(),
            to: to.clone(),
            bytes,
        })
        .collect()
}
