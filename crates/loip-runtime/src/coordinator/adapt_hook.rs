//! Where the pipeline's scheduler meets online adaptation ([`crate::adapt`]): before a step
//! enters, the adapter may send plan switches to devices (ahead of the step on the same
//! connection, so they apply between steps) or hold a step back until others finish or
//! sequences are released; releases and the workers' answers update it.
//!
//! A switch is not assumed applied: the step that needs it (and every step after it) waits
//! until each device switched answers `Switched` or `SwitchRefused`. After a refusal the
//! step is decided again with the device's kept layout (and the refused one excluded):
//! another switch, or holding it back, never failing an admitted sequence for it.
//!
//! The last resort ([`crate::adapt`]'s eviction): sequences evicted are released on every
//! device (their ids stay with the adapter); an evicted sequence's next step enters behind
//! steps that re-prefill it, in order on the same connections.

use std::collections::{BTreeSet, VecDeque};

use super::{InFlight, Sched};
use crate::adapt::{switch_payload, Action, Adapter, Verdict};
use loip_engine::TokenPos;

use crate::wire::{self, DeviceMemory, FrameKind, ToWorker};

/// A step and its input, waiting to enter.
type Waiting = (u64, InFlight, Vec<u8>);

/// The positions and token ids of a step that prefills evicted sequences again.
type Refeed = (Vec<TokenPos>, Vec<u32>);

/// The adapter and the steps it holds back.
pub(super) struct AdaptState {
    pub(super) adapter: Adapter,
    /// steps held until sequences are released or steps finish
    pub(super) held_back: Vec<Waiting>,
    /// devices sent a switch that have not answered yet
    pending: BTreeSet<usize>,
    /// steps waiting for those answers, in order; the first was admitted by the adapter
    /// when `admitted` is its id
    waiting: VecDeque<Waiting>,
    admitted: Option<u64>,
    /// a switch was refused since the waiting step was admitted
    refused: bool,
    /// when the first of the `pending` switches was sent (the step behind them parks)
    parked_at: Option<std::time::Instant>,
    /// lent KV asked back and not yet here: (lender, stage) → when asked
    pub(super) fetch_at: std::collections::BTreeMap<(usize, u16), std::time::Instant>,
    /// steps that re-prefill evicted sequences, to enter right before the step keyed
    recompute: std::collections::BTreeMap<u64, Vec<Refeed>>,
    /// the pipeline's own command queue: a split step's sub-steps enter through it
    cmd: tokio::sync::mpsc::WeakUnboundedSender<super::Cmd>,
}

impl AdaptState {
    pub(super) fn new(
        adapter: Adapter,
        cmd: tokio::sync::mpsc::WeakUnboundedSender<super::Cmd>,
    ) -> AdaptState {
        AdaptState {
            adapter,
            held_back: Vec::new(),
            pending: BTreeSet::new(),
            waiting: VecDeque::new(),
            admitted: None,
            refused: false,
            parked_at: None,
            fetch_at: Default::default(),
            recompute: Default::default(),
            cmd,
        }
    }
}

impl Sched {
    /// A new step: through the adapter when there is one, then into the pipeline.
    pub(super) fn enter(&mut self, step: u64, f: InFlight, data: Vec<u8>) {
        let others = !self.inflight.is_empty();
        let Some(a) = self.adapt.as_mut() else {
            self.inflight.insert(step, f);
            self.admit(step, data);
            return;
        };
        if !a.pending.is_empty() {
            a.waiting.push_back((step, f, data));
            return;
        }
        match a.adapter.before_step(&f.batch, others) {
            Verdict::Go(sw) => {
                let ids: Vec<u32> = data
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                a.adapter.record(&f.batch, &ids);
                let mut actions = Vec::new();
                for act in sw {
                    match act {
                        Action::Recompute(steps) => {
                            a.recompute.insert(step, steps);
                        }
                        act => actions.push(act),
                    }
                }
                if actions.iter().any(Action::answered) {
                    a.admitted = Some(step);
                    a.refused = false;
                    a.waiting.push_front((step, f, data));
                    self.send_switches(actions);
                } else {
                    self.send_switches(actions);
                    self.adapt_go(step, f, data);
                }
            }
            Verdict::Hold(sw) => {
                a.held_back.push((step, f, data));
                self.send_switches(sw);
            }
            Verdict::Split(groups) => {
                super::split::run(a.cmd.clone(), f, data, groups);
            }
        }
    }

    /// Sends the adapter's actions; those answered (switches, reservations) hold the steps
    /// behind them until the answer.
    fn send_switches(&mut self, actions: Vec<Action>) {
        for act in actions {
            let (d, p, answered) = match act {
                Action::Switch(d, stages) => (d, switch_payload(stages), true),
                Action::Borrow {
                    peer,
                    lender,
                    bytes,
                    ..
                } => {
                    let direct = self.lends_direct(lender, peer);
                    let msg = ToWorker::Borrow {
                        lender: lender as u16,
                        bytes,
                        via: direct.then(|| self.peer_id(lender)),
                    };
                    (peer, wire::control_payload(&msg).ok(), true)
                }
                Action::Lend { device, tokens } => {
                    let msg = ToWorker::Lend {
                        tokens,
                        via: self.lend_via(device),
                    };
                    (device, wire::control_payload(&msg).ok(), false)
                }
                Action::Evict(seqs) => {
                    // released on every device; the adapter keeps them to recompute
                    self.release_kv(&seqs);
                    continue;
                }
                Action::Recompute(_) => continue,
            };
            let Some(p) = p else {
                continue;
            };
            if self.alive.get(d).is_some_and(|a| a.is_none()) {
                if answered {
                    if let Some(a) = self.adapt.as_mut() {
                        a.pending.insert(d);
                        a.parked_at.get_or_insert_with(std::time::Instant::now);
                    }
                }
                if self.writers[d].send((FrameKind::Control, p)).is_err() {
                    self.mark_gone(d, "its connection closed".into());
                }
            }
        }
    }

    /// A peer answered a reservation for `lender`'s KV: the lender is told to lend (ahead
    /// of the next step on its connection), or the step is decided again.
    pub(super) fn adapt_borrowed(&mut self, d: usize, lender: u16, ok: bool) {
        let Some(a) = self.adapt.as_mut() else {
            return;
        };
        if a.adapter.lend_peer(lender as usize) != Some(d) {
            self.mark_gone(
                d,
                format!("answered a reservation for device {lender} it was not asked"),
            );
            return;
        }
        let act = a.adapter.on_borrowed(lender as usize, ok);
        a.pending.remove(&d);
        if !ok {
            a.refused = true;
        }
        if let Some(act) = act {
            self.send_switches(vec![act]);
        }
        self.adapt_resume();
    }

    /// Once every switch is answered: the step that needed them enters (or, after a
    /// refusal, is decided again), then the steps behind it.
    fn adapt_resume(&mut self) {
        let Some(a) = self.adapt.as_mut() else {
            return;
        };
        if !a.pending.is_empty() {
            return;
        }
        let parked = a.parked_at.take().map(|at| {
            let mut t = super::lock(&self.shared.totals);
            t.switch_parks += 1;
            t.switch_s += at.elapsed().as_secs_f64();
        });
        let mut waiting = std::mem::take(&mut a.waiting);
        if let Some(id) = a.admitted.take() {
            if let Some((step, mut f, data)) = waiting.pop_front().filter(|w| w.0 == id) {
                f.parked = parked.is_some();
                if a.refused {
                    a.adapter.undo_step();
                    a.recompute.remove(&step);
                    self.enter(step, f, data);
                } else {
                    self.adapt_go(step, f, data);
                }
            }
        }
        for (step, f, data) in waiting {
            self.enter(step, f, data);
        }
    }

    /// A step the adapter let through enters the pipeline, behind the steps that re-prefill
    /// its evicted sequences (if any): same connections, same order.
    fn adapt_go(&mut self, step: u64, f: InFlight, data: Vec<u8>) {
        let pre = self
            .adapt
            .as_mut()
            .and_then(|a| a.recompute.remove(&step))
            .unwrap_or_default();
        for (batch, ids) in pre {
            let id = self.next_step;
            self.next_step += 1;
            let seqs: Vec<u64> = batch.first().map(|t| t.seq).into_iter().collect();
            super::lock(&self.shared.devices).step(&batch);
            // nobody waits for its output (no rows); a failure fails the sequence's step
            // behind it on the device
            let (reply, _) = tokio::sync::oneshot::channel();
            let now = std::time::Instant::now();
            let fl = InFlight {
                seqs,
                rewind: Vec::new(),
                batch,
                rows: Vec::new(),
                argmax: None,
                row_masks: Vec::new(),
                hop: 0,
                reply,
                started: now,
                sent: now,
                stats: Default::default(),
                worker_s: 0.0,
                progress: Default::default(),
                parked: false,
            };
            self.inflight.insert(id, fl);
            self.admit(id, wire::u32_bytes(&ids));
        }
        self.inflight.insert(step, f);
        self.admit(step, data);
    }

    /// Sequences released: the adapter forgets their KV and held-back steps try again.
    pub(super) fn adapt_released(&mut self, seqs: &[u64]) {
        let Some(a) = self.adapt.as_mut() else {
            return;
        };
        a.adapter.release(seqs);
        self.adapt_retry();
    }

    /// Held-back steps try again (a sequence was released, or a step finished).
    pub(super) fn adapt_retry(&mut self) {
        let Some(a) = self.adapt.as_mut() else {
            return;
        };
        if a.held_back.is_empty() {
            return;
        }
        let held = std::mem::take(&mut a.held_back);
        for (step, f, data) in held {
            self.enter(step, f, data);
        }
    }

    /// A worker applied a switch.
    pub(super) fn adapt_switched(&mut self, d: usize, memory: DeviceMemory) {
        if let Some(a) = self.adapt.as_mut() {
            a.adapter.on_switched(d, memory);
            a.pending.remove(&d);
        }
        self.adapt_resume();
    }

    /// A worker refused a switch: it kept its layout.
    pub(super) fn adapt_refused(&mut self, d: usize, memory: DeviceMemory, message: &str) {
        if let Some(a) = self.adapt.as_mut() {
            a.adapter.on_refused(d, memory, message);
            a.pending.remove(&d);
            a.refused = true;
        }
        self.adapt_resume();
    }

    /// A device is gone: its switches will not be answered (the steps waiting fail with
    /// the pipeline's error when they enter).
    pub(super) fn adapt_gone(&mut self, d: usize) {
        if let Some(a) = self.adapt.as_mut() {
            a.pending.remove(&d);
        }
    }

    /// Steps waiting in the adapter, failed with `e` (the pipeline is broken).
    pub(super) fn adapt_fail_waiting(&mut self, e: impl Fn() -> super::ClusterError) {
        let Some(a) = self.adapt.as_mut() else {
            return;
        };
        let mut all: Vec<Waiting> = a.waiting.drain(..).collect();
        all.append(&mut a.held_back);
        a.admitted = None;
        for (_, f, _) in all {
            let _ = f.reply.send(Err(e()));
        }
    }
}
