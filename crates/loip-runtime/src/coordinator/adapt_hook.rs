//! Where the pipeline's scheduler meets online adaptation ([`crate::adapt`]): before a step
//! enters, the adapter may send plan switches to devices (ahead of the step on the same
//! connection, so they apply between steps) or hold a new sequence back until others are
//! released; releases and the workers' `Switched` answers update it.

use super::{InFlight, Sched};
use crate::adapt::{switch_payload, Adapter, Verdict};
use crate::executor::StageSpec;
use crate::wire::{DeviceMemory, FrameKind};

/// The adapter and the steps it holds back (id, step, its input).
pub(super) struct AdaptState {
    pub(super) adapter: Adapter,
    pub(super) held_back: Vec<(u64, InFlight, Vec<u8>)>,
}

impl Sched {
    /// A new step: through the adapter when there is one, then into the pipeline.
    pub(super) fn enter(&mut self, step: u64, f: InFlight, data: Vec<u8>) {
        let verdict = match self.adapt.as_mut() {
            None => Verdict::Go(Vec::new()),
            Some(a) => a.adapter.before_step(&f.batch),
        };
        match verdict {
            Verdict::Go(sw) => {
                self.send_switches(sw);
                self.inflight.insert(step, f);
                self.admit(step, data);
            }
            Verdict::Hold(sw) => {
                self.send_switches(sw);
                if let Some(a) = self.adapt.as_mut() {
                    a.held_back.push((step, f, data));
                }
            }
        }
    }

    fn send_switches(&mut self, sw: Vec<(usize, Vec<StageSpec>)>) {
        for (d, stages) in sw {
            let Some(p) = switch_payload(stages) else {
                continue;
            };
            if self.alive.get(d).is_some_and(|a| a.is_none())
                && self.writers[d].send((FrameKind::Control, p)).is_err()
            {
                self.mark_gone(d, "its connection closed".into());
            }
        }
    }

    /// Sequences released: the adapter forgets their KV and held-back steps try again.
    pub(super) fn adapt_released(&mut self, seqs: &[u64]) {
        let Some(a) = self.adapt.as_mut() else {
            return;
        };
        a.adapter.release(seqs);
        let waiting = std::mem::take(&mut a.held_back);
        for (step, f, data) in waiting {
            self.enter(step, f, data);
        }
    }

    /// A worker applied a switch.
    pub(super) fn adapt_switched(&mut self, d: usize, memory: DeviceMemory) {
        if let Some(a) = self.adapt.as_mut() {
            a.adapter.on_switched(d, memory);
        }
    }
}
