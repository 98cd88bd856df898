//! Waves: the steps of the sequences in flight enter the pipeline together, back to back,
//! and each device keeps a stage's offloaded blocks in its slot until the last step of the
//! wave has passed that stage (the bursty pattern of the cost model, design §3: each
//! offloaded block is read once per stage per round for all `b` micro-batches in flight).
//!
//! - **Admission.** A new step enters at once unless a wave is past the pipeline's first
//!   hop; then it is parked until the wave has come back, and the parked steps enter as the
//!   next wave. When a wave's last step comes back, its sequence's next step is not here yet
//!   (its driver is only now told): the parked steps wait for every sequence of the finished
//!   steps to come back or be released, at most a short grace ([`grace`]), so the new wave
//!   is whole. Without this the last sequence trails each round and reloads every stage.
//! - **Keep.** Steps are numbered in dispatch order, and every device runs steps in the
//!   order they reach it (FIFO), so a step dispatched later passes each hop later. A hop
//!   keeps its stage's blocks when a later-dispatched step has not passed that hop yet but
//!   has reached the device's previous hop (so nothing needs another stage of that device in
//!   between). The last step of a wave does not keep: it releases the slot and the device
//!   starts loading its next stage at once. Headers sent ahead (direct forwarding decides
//!   every hop at dispatch) look ahead too: a later step of the same wave trails by less than
//!   a hop, so by the time this step reaches the device's later stage the other has passed
//!   the device's earlier one; it counts wherever it is before the hop.
//!
//! Keeping is a hint for the loaders only: whatever it says, a device reads the blocks a
//! stage needs, so tokens never depend on it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::Sched;

/// Longest wait for a wave's missing sequences.  // seconds
const GRACE_MAX: Duration = Duration::from_millis(30);
/// The wait as a share of the last step's wall time (a short step waits less).
const GRACE_SHARE: f64 = 0.2;

/// How long parked steps wait for the sequences of a finished step whose wall time was
/// `wall_s` seconds.
pub(super) fn grace(wall_s: f64) -> Duration {
    Duration::from_secs_f64((wall_s * GRACE_SHARE).max(0.0)).min(GRACE_MAX)
}

/// The wave state of the coordinator's scheduler.
#[derive(Debug, Default)]
pub(super) struct Waves {
    /// steps held at the pipeline's entry until the current wave has left it, with their input
    pub(super) parked: Vec<(u64, Vec<u8>)>,
    /// dispatch number and wave of each step sent into the pipeline (step → (number, wave))
    order: BTreeMap<u64, (u64, u64)>,
    next_order: u64,
    next_wave: u64,
    /// sequences whose step came back and whose next step has not arrived (nor were they
    /// released): the parked wave waits for them until `deadline`
    returning: BTreeSet<u64>,
    /// when the parked wave stops waiting for `returning`
    deadline: Option<Instant>,
    /// the grace of the last finished step
    grace: Duration,
}

impl Waves {
    /// A step of `seqs` finished after `wall_s` seconds: its sequences are expected back.
    pub(super) fn returned(&mut self, seqs: &[u64], wall_s: f64) {
        self.returning.extend(seqs.iter().copied());
        self.grace = grace(wall_s);
    }

    /// A new step of `seqs` arrived (before the adapter sees it).
    pub(super) fn back(&mut self, seqs: &[u64]) {
        for s in seqs {
            self.returning.remove(s);
        }
    }

    /// `seqs` were released: nothing more comes from them.
    pub(super) fn released(&mut self, seqs: &[u64]) {
        self.back(seqs);
    }

    /// When the scheduler must wake to admit a waiting wave (None: no wait).
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether `step` is parked.
    pub(super) fn is_parked(&self, step: u64) -> bool {
        self.parked.iter().any(|(p, _)| *p == step)
    }

    /// Forgets a finished or failed step.
    pub(super) fn forget(&mut self, step: u64) {
        self.order.remove(&step);
        self.parked.retain(|(s, _)| *s != step);
    }

    fn number(&mut self, step: u64) {
        self.order.insert(step, (self.next_order, self.next_wave));
        self.next_order += 1;
    }

    /// Whether the parked wave waits for returning sequences at `now` (setting the deadline
    /// on the first ask).
    fn waiting(&mut self, now: Instant) -> bool {
        if self.returning.is_empty() {
            self.deadline = None;
            return false;
        }
        let deadline = *self.deadline.get_or_insert(now + self.grace);
        if now < deadline {
            return true;
        }
        // the missing sequences are late: go without them, and do not wait for them again
        self.returning.clear();
        self.deadline = None;
        false
    }
}

impl Sched {
    /// Whether another sequence will pass hop `h`'s device at this same stage before the
    /// device's next stage: then the device keeps the stage's blocks in the slot (module
    /// docs: a later-dispatched step that has reached the device's previous hop and not
    /// passed `h`; with `ahead`, a header decided before the step reaches the hop, a later
    /// step of the same wave wherever it is before `h`).
    pub(super) fn keep(&self, step: u64, h: usize, ahead: bool) -> bool {
        let d = self.route.hops[h].device;
        let prev = self.route.hops[..h].iter().rposition(|x| x.device == d);
        let Some(&(mine, wave)) = self.waves.order.get(&step) else {
            return false;
        };
        self.inflight.iter().any(|(&id, f)| {
            let Some(&(o, w)) = self.waves.order.get(&id) else {
                return false;
            };
            id != step
                && o > mine
                && f.hop <= h
                && ((ahead && w == wave) || prev.is_none_or(|p| f.hop >= p))
        })
    }

    /// Whether a step is in the pipeline past its first hop.
    pub(super) fn wave_in_flight(&self) -> bool {
        self.inflight
            .iter()
            .any(|(id, f)| f.hop > 0 && !self.waves.is_parked(*id))
    }

    /// A new step enters the pipeline at once, unless a wave is past its first hop or a
    /// parked wave is forming: then it waits with the others (module docs).
    pub(super) fn admit(&mut self, step: u64, data: Vec<u8>) {
        self.waves.parked.push((step, data));
        self.admit_parked();
    }

    /// Sends the parked steps in as one wave when no wave is past the first hop and no
    /// sequence of the last wave is still expected (or its grace is over).
    pub(super) fn admit_parked(&mut self) {
        if self.waves.parked.is_empty() || self.wave_in_flight() {
            return;
        }
        if self.waves.waiting(Instant::now()) {
            return;
        }
        self.waves.deadline = None;
        let now = Instant::now();
        let wave = std::mem::take(&mut self.waves.parked);
        // number the whole wave first: each step's hops see the ones behind it
        for (step, _) in &wave {
            self.waves.number(*step);
        }
        self.waves.next_wave += 1;
        for (step, data) in wave {
            if let Some(f) = self.inflight.get_mut(&step) {
                // Time waiting for the wave counts as queueing, not as network.
                let waited = f.started.elapsed().as_secs_f64();
                f.stats.queued_s += waited;
                f.worker_s += waited;
                f.sent = now;
                self.dispatch(step, data);
            }
        }
    }

    /// A step finished or failed: steps held for room try again, then the parked wave.
    pub(super) fn step_left(&mut self) {
        self.adapt_retry();
        self.admit_parked();
    }

    /// The scheduler woke at the waves' deadline: the missing sequences are not waited for.
    pub(super) fn on_wave_deadline(&mut self) {
        self.waves.returning.clear();
        self.waves.deadline = None;
        self.admit_parked();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grace_is_a_share_of_the_step_capped() {
        assert!((grace(0.01).as_secs_f64() - 0.002).abs() < 1e-9);
        assert_eq!(grace(5.0), GRACE_MAX);
        assert_eq!(grace(-1.0), Duration::ZERO);
    }

    #[test]
    fn a_wave_waits_for_returning_sequences_until_its_deadline() {
        let mut w = Waves::default();
        let t0 = Instant::now();
        w.returned(&[7], 0.025); // 5 ms grace
        assert!(w.waiting(t0));
        assert!(w.waiting(t0 + Duration::from_millis(4)));
        assert!(!w.waiting(t0 + Duration::from_millis(6)));
        // late sequences are not waited for again
        assert!(!w.waiting(t0 + Duration::from_millis(7)));
        w.returned(&[8, 9], 0.025);
        w.back(&[8]);
        assert!(w.waiting(t0));
        w.released(&[9]);
        assert!(!w.waiting(t0));
    }
}
