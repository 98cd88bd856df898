//! Surviving memory pressure instead of being killed: when the kernel says the memory this
//! process lives in is at its limit, the engine sheds what it can (offloads resident blocks,
//! [`crate::executor::Device::shed`]) and says so in the log, `/health` and `/metrics`.
//!
//! The decision is a pure function of samples ([`Watch::observe`]), so a test (or the
//! simulator) can drive it with made-up figures; [`Sampler`] takes the samples from the
//! kernel at the edge. A sample is under pressure when
//! - the cgroup's working set (its charge less the page cache the kernel can drop at once)
//!   is within 1/16 of its limit (others in the cgroup may have grown:
//!   the device's memory shrank under the process), or
//! - the kernel reported new pressure events (v2 `memory.events` `max`/`high`, v1
//!   `failcnt`) while the charge is within 1/8 of the limit (events alone also count page
//!   cache being reclaimed, which is harmless).
//!
//! Without a cgroup limit there is no pressure the kernel reports for this process: nothing
//! is watched (the process's own estimate near its `--mem` is not pressure; its budget split
//! already holds it). [`Sample`]s with `cgroup: false` stay possible for the pure policy.
//!
//! Each answer is to shed 1/16 of the limit (at least 1 MiB), at most once a second, so a
//! brief spike costs one block and a lasting squeeze offloads block after block until it
//! stops or nothing is left. With nothing left, [`exhausted`] holds (for [`HOLD`] after each
//! look that finds it so): `loip api` answers new requests 503 "retry later" meanwhile
//! (running ones go on).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use loip_plan::units::format_bytes as mib;
use serde::Serialize;

use super::Cgroup;

/// One look at the memory the process lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// what counts against `limit` now, bytes (the cgroup's working set: its charge less the
    /// page cache the kernel drops at once; or this process's charge)
    pub charge: u64,
    /// the limit it counts against, bytes (the cgroup's, or the `--mem` budget)
    pub limit: u64,
    /// pressure events so far (0 without a cgroup)
    pub events: u64,
    /// whether `limit` is a cgroup's (a shared one: others' growth counts)
    pub cgroup: bool,
}

/// What to shed and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shed {
    /// bytes to free
    pub bytes: u64,
    /// why (for the log)
    pub why: String,
}

/// Least time between two sheds.
pub const COOLDOWN: Duration = Duration::from_secs(1);

/// The pressure policy's state: the events already answered and the last shed.
#[derive(Debug, Clone, Default)]
pub struct Watch {
    events: Option<u64>,
    last_shed: Option<Instant>,
}

impl Watch {
    /// Whether `s` is within 1/16 of its limit (pressure that shedding must answer).
    pub fn near(s: &Sample) -> bool {
        s.limit > 0 && s.charge >= s.limit - s.limit / 16
    }

    /// Whether `s`, taken at `now`, asks for a shed (see the module docs).
    pub fn observe(&mut self, s: Sample, now: Instant) -> Option<Shed> {
        let new_events = s.events.saturating_sub(self.events.unwrap_or(s.events));
        self.events = Some(s.events);
        if s.limit == 0 || self.last_shed.is_some_and(|t| now < t + COOLDOWN) {
            return None;
        }
        let near = |part: u64| s.charge >= s.limit - s.limit / part;
        let why = if Watch::near(&s) {
            let whose = if s.cgroup {
                "the cgroup's"
            } else {
                "the budget's"
            };
            format!(
                "charge {} within 1/16 of {whose} limit {}",
                mib(s.charge),
                mib(s.limit)
            )
        } else if s.cgroup && new_events > 0 && near(8) {
            format!(
                "{new_events} pressure event(s) from the kernel, charge {} of {}",
                mib(s.charge),
                mib(s.limit)
            )
        } else {
            return None;
        };
        self.last_shed = Some(now);
        Some(Shed {
            bytes: (s.limit / 16).max(1 << 20),
            why,
        })
    }
}

/// Takes [`Sample`]s of this process's memory from the kernel, at most every [`EVERY`].
#[derive(Debug)]
pub struct Sampler {
    cgroup: Option<Cgroup>,
    last: Option<Instant>,
}

/// How often the engine looks, at most (a look reads two or three small files).
pub const EVERY: Duration = Duration::from_millis(50);

impl Default for Sampler {
    fn default() -> Sampler {
        Sampler::new()
    }
}

impl Sampler {
    /// Samples against the process's cgroup limit where it has one; nothing without.
    pub fn new() -> Sampler {
        let cgroup = Cgroup::of_self().filter(|c| c.limit().is_some());
        Sampler { cgroup, last: None }
    }

    /// A sample, unless one was taken less than [`EVERY`] ago.
    pub fn sample(&mut self, now: Instant) -> Option<Sample> {
        if self.last.is_some_and(|t| now < t + EVERY) {
            return None;
        }
        self.last = Some(now);
        match &self.cgroup {
            Some(c) => Some(Sample {
                charge: c.working_set()?,
                limit: c.limit()?,
                events: c.pressure_events(),
                cgroup: true,
            }),
            None => None,
        }
    }
}

/// What the process has shed so far (reported by `/health` and `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ShedTotals {
    /// times it shed
    pub sheds: u64,
    /// bytes freed by shedding
    pub bytes: u64,
    /// times pressure found nothing left to shed
    pub nothing_left: u64,
}

/// When pressure last found nothing to shed: milliseconds after [`EPOCH`] (0: never).
static EXHAUSTED_AT: AtomicU64 = AtomicU64::new(0);
static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// How long "nothing left to shed" holds new sequences back after it was last seen: the
/// guard sees it again at most once a [`COOLDOWN`] while steps run; with none running it
/// lapses, so a request gets in, runs steps, and the guard looks again.
pub const HOLD: Duration = Duration::from_secs(2);

fn millis() -> u64 {
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// Whether the process is under memory pressure with nothing left to shed (seen within
/// [`HOLD`]): a server holds new sequences back (answers them "retry later") meanwhile.
pub fn exhausted() -> bool {
    let at = EXHAUSTED_AT.load(Ordering::Relaxed);
    at != 0 && millis().saturating_sub(at) < HOLD.as_millis() as u64
}

/// Records that pressure found nothing left to shed (`true`), or that it eased (`false`).
pub fn set_exhausted(on: bool) {
    EXHAUSTED_AT.store(if on { millis() } else { 0 }, Ordering::Relaxed);
}

static SHEDS: AtomicU64 = AtomicU64::new(0);
static SHED_BYTES: AtomicU64 = AtomicU64::new(0);
static NOTHING_LEFT: AtomicU64 = AtomicU64::new(0);

/// Counts a shed of `bytes` (0: nothing was left to shed).
pub fn record(bytes: u64) {
    if bytes == 0 {
        NOTHING_LEFT.fetch_add(1, Ordering::Relaxed);
    } else {
        SHEDS.fetch_add(1, Ordering::Relaxed);
        SHED_BYTES.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// The totals of [`record`].
pub fn totals() -> ShedTotals {
    ShedTotals {
        sheds: SHEDS.load(Ordering::Relaxed),
        bytes: SHED_BYTES.load(Ordering::Relaxed),
        nothing_left: NOTHING_LEFT.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn s(charge: u64, events: u64) -> Sample {
        Sample {
            charge: charge * MIB,
            limit: 160 * MIB,
            events,
            cgroup: true,
        }
    }

    #[test]
    fn a_charge_near_the_limit_sheds_a_sixteenth_once_a_second() {
        let mut w = Watch::default();
        let t = Instant::now();
        assert_eq!(w.observe(s(100, 0), t), None);
        let shed = w.observe(s(151, 0), t).expect("within 1/16");
        assert_eq!(shed.bytes, 10 * MIB);
        assert!(shed.why.contains("within 1/16"), "{}", shed.why);
        // cooldown
        assert_eq!(w.observe(s(155, 0), t + Duration::from_millis(500)), None);
        assert!(w
            .observe(s(155, 0), t + Duration::from_millis(1001))
            .is_some());
    }

    #[test]
    fn nothing_left_holds_new_sequences_for_a_while() {
        assert!(!exhausted());
        set_exhausted(true);
        assert!(exhausted());
        set_exhausted(false);
        assert!(!exhausted());
    }

    #[test]
    fn kernel_events_count_only_near_the_limit() {
        let mut w = Watch::default();
        let t = Instant::now();
        // the first sample sets the baseline: old events are not new pressure
        assert_eq!(w.observe(s(145, 40), t), None);
        // new events far from the limit: page cache reclaimed, harmless
        assert_eq!(w.observe(s(100, 45), t), None);
        // new events within 1/8
        let shed = w.observe(s(145, 47), t).expect("events near the limit");
        assert!(shed.why.contains("2 pressure event(s)"), "{}", shed.why);
    }

    #[test]
    fn without_a_cgroup_the_budget_is_the_limit_and_events_do_not_exist() {
        let mut w = Watch::default();
        let t = Instant::now();
        let b = |charge| Sample {
            charge: charge * MIB,
            limit: 64 * MIB,
            events: 0,
            cgroup: false,
        };
        assert_eq!(w.observe(b(56), t), None);
        let shed = w.observe(b(61), t).unwrap();
        assert_eq!(shed.bytes, 4 * MIB);
        assert!(shed.why.contains("budget's limit"), "{}", shed.why);
        // a tiny limit still sheds at least 1 MiB; no limit never sheds
        let mut w = Watch::default();
        let tiny = Sample {
            charge: 8 * MIB,
            limit: 8 * MIB,
            events: 0,
            cgroup: false,
        };
        assert_eq!(w.observe(tiny, t).unwrap().bytes, MIB);
        let none = Sample {
            charge: 9,
            limit: 0,
            events: 9,
            cgroup: false,
        };
        assert_eq!(Watch::default().observe(none, t), None);
    }
}
