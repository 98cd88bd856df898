//! Surviving memory pressure instead of being killed: when the kernel says the memory this
//! process lives in is at its limit, the engine sheds what it can (offloads resident blocks,
//! [`crate::executor::Device::shed`]) and says so in the log, `/health` and `/metrics`.
//!
//! The decision is a pure function of samples ([`Watch::observe`]), so a test (or the
//! simulator) can drive it with made-up figures; [`Sampler`] takes the samples from the
//! kernel at the edge. A sample is under pressure when
//! - what the cgroup is charged that the kernel cannot reclaim (its charge less the clean
//!   page cache, [`Split`](super::cgroup::Split): anonymous, shared, locked, dirty and
//!   kernel memory) is within [`margin`] of its limit: 1/16 of it, at most the room the
//!   process's code needs ([`CODE_ALLOWANCE`]; a process within its budget leaves that and
//!   the I/O allowance to page cache), so others in the cgroup grew or the process outgrew
//!   its budget: the device's memory shrank under the process, or
//! - the kernel reported new pressure events (v2 `memory.events` `max`/`high`, v1
//!   `failcnt`) while that is within twice the margin and less than half the margin is
//!   clean page cache: the kernel is reclaiming with little left to reclaim.
//!
//! Clean page cache — the executable's code, files read at start, a slice being written
//! once it is written back — is the kernel's to reclaim at the limit, and it does so instead
//! of failing a charge: a charge at the limit made of it, and the events its reclaim counts,
//! are the budget working, and shedding engine memory for them would slow the engine for
//! nothing.
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

use super::cgroup::{Split, Version};
use super::{Cgroup, CODE_ALLOWANCE};

/// How close to `limit` (bytes) what cannot be reclaimed may come before the process sheds:
/// 1/16 of the limit, at most the room its code needs ([`CODE_ALLOWANCE`]). Closer than
/// that, the kernel has only the pages of running code left to reclaim and re-reads them on
/// every step; before it, page cache is the kernel's to reclaim (a process that fills its
/// budget leaves [`CODE_ALLOWANCE`] + [`IO_ALLOWANCE`](super::IO_ALLOWANCE) of its cgroup
/// to page cache), bytes.
pub fn margin(limit: u64) -> u64 {
    (limit / 16).min(CODE_ALLOWANCE)
}

/// One look at the memory the process lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// what counts against `limit` now, bytes (what the cgroup is charged that the kernel
    /// cannot reclaim; or this process's charge)
    pub charge: u64,
    /// clean page cache charged beside `charge`, which the kernel reclaims first, bytes
    pub reclaimable: u64,
    /// the limit it counts against, bytes (the cgroup's, or the `--mem` budget)
    pub limit: u64,
    /// pressure events so far (0 without a cgroup)
    pub events: u64,
    /// whether `limit` is a cgroup's (a shared one: others' growth counts)
    pub cgroup: bool,
}

impl Sample {
    /// A cgroup's sample from its figures: the charge `current` and its `memory.stat` text
    /// (split by [`Split::of`]), its `limit` and pressure `events` so far, bytes.
    pub fn of_cgroup(
        current: u64,
        stat: &str,
        version: Version,
        limit: u64,
        events: u64,
    ) -> Sample {
        let split = Split::of(current, stat, version);
        Sample {
            charge: split.unreclaimable,
            reclaimable: split.reclaimable,
            limit,
            events,
            cgroup: true,
        }
    }
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
    /// Whether `s` is within [`margin`] of its limit (pressure that shedding must answer).
    pub fn near(s: &Sample) -> bool {
        s.limit > 0 && s.charge >= s.limit - margin(s.limit)
    }

    /// Whether `s`, taken at `now`, asks for a shed (see the module docs): 1/16 of the limit
    /// (at least 1 MiB), at most once a [`COOLDOWN`].
    pub fn observe(&mut self, s: Sample, now: Instant) -> Option<Shed> {
        let new_events = s.events.saturating_sub(self.events.unwrap_or(s.events));
        self.events = Some(s.events);
        if s.limit == 0 || self.last_shed.is_some_and(|t| now < t + COOLDOWN) {
            return None;
        }
        let m = margin(s.limit);
        let why = if Watch::near(&s) {
            let whose = if s.cgroup {
                "the cgroup's"
            } else {
                "the budget's"
            };
            format!(
                "charge {} that cannot be reclaimed within {} of {whose} limit {}",
                mib(s.charge),
                mib(m),
                mib(s.limit)
            )
        } else if s.cgroup
            && new_events > 0
            && s.charge >= s.limit.saturating_sub(2 * m)
            && s.reclaimable < m / 2
        {
            format!(
                "{new_events} pressure event(s) from the kernel, charge {} of {} with {} of \
                 page cache left to reclaim",
                mib(s.charge),
                mib(s.limit),
                mib(s.reclaimable)
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
            Some(c) => Some(Sample::of_cgroup(
                c.current()?,
                &c.stat()?,
                c.version(),
                c.limit()?,
                c.pressure_events(),
            )),
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
            reclaimable: 0,
            limit: 160 * MIB,
            events,
            cgroup: true,
        }
    }

    /// `memory.stat` of the 320 MiB v1 cgroup of `loip api -m smollm2 --mem 320MiB
    /// --parallel 8 --context 512` at its highest charge (319.7 MiB) under 8 concurrent
    /// 250-word prompts (`bench/api_cgroup.sh`, 7 December 2026): 293.2 MiB anonymous (the
    /// engine at its budget), 24.4 MiB page cache — the executable's mapped pages and files
    /// read at start, reclaimed by the kernel at the limit.
    const API_AT_LIMIT_V1: &str = include_str!("testdata/api_at_limit.v1.stat");
    const API_CHARGE: u64 = 335_261_696;
    const LIMIT: u64 = 320 * MIB;

    /// The same figures in v2's keys.
    fn api_at_limit_v2() -> String {
        "anon 307421184\nfile 25575424\nkernel 2240512\nshmem 0\nfile_mapped 14655488\n\
         file_dirty 45056\nfile_writeback 0\ninactive_anon 307417088\nactive_anon 4096\n\
         inactive_file 11907072\nactive_file 13668352\nunevictable 0\n"
            .to_string()
    }

    #[test]
    fn page_cache_at_the_limit_is_the_kernels_to_reclaim_not_pressure() {
        for (stat, v) in [
            (API_AT_LIMIT_V1.to_string(), Version::V1),
            (api_at_limit_v2(), Version::V2),
        ] {
            let split = Split::of(API_CHARGE, &stat, v);
            // clean file pages: inactive + active less dirty
            assert_eq!(split.reclaimable, 11_907_072 + 13_668_352 - 45_056);
            assert_eq!(split.unreclaimable + split.reclaimable, API_CHARGE);
            let mut w = Watch::default();
            let t = Instant::now();
            let sample = Sample::of_cgroup(API_CHARGE, &stat, v, LIMIT, 0);
            assert!(!Watch::near(&sample), "{v:?}: {sample:?}");
            assert_eq!(w.observe(sample, t), None);
            // the kernel reclaiming it counts events: still the budget working
            let later = Sample::of_cgroup(API_CHARGE, &stat, v, LIMIT, 2215);
            assert_eq!(w.observe(later, t + COOLDOWN), None);
        }
        // what the previous rule judged by (the charge less inactive_file alone) was within
        // 1/16 of the limit: it shed 20.7 MiB of blocks here
        const { assert!(API_CHARGE - 11_907_072 >= LIMIT - LIMIT / 16) };
    }

    #[test]
    fn anonymous_memory_near_the_limit_sheds() {
        // another program in the cgroup grew: 16 MiB more anonymous memory, the page cache
        // reclaimed down to 8 MiB
        let stat = API_AT_LIMIT_V1
            .replace("total_rss 307421184", "total_rss 324198400")
            .replace(
                "total_inactive_file 11907072",
                "total_inactive_file 3000000",
            )
            .replace("total_active_file 13668352", "total_active_file 5433664");
        let charge = LIMIT - 100 * 4096;
        let sample = Sample::of_cgroup(charge, &stat, Version::V1, LIMIT, 0);
        assert_eq!(sample.reclaimable, 8 * MIB);
        let shed = Watch::default()
            .observe(sample, Instant::now())
            .expect("within the margin");
        assert_eq!(shed.bytes, 20 * MIB);
        assert!(
            shed.why.contains("cannot be reclaimed within 13.0 MiB"),
            "{}",
            shed.why
        );
        // dirty pages cannot be dropped at once: they count against the limit
        let dirty = API_AT_LIMIT_V1.replace("total_dirty 45056", "total_dirty 16777216");
        let sample = Sample::of_cgroup(API_CHARGE, &dirty, Version::V1, LIMIT, 0);
        assert!(Watch::near(&sample), "{sample:?}");
    }

    #[test]
    fn the_margin_is_a_sixteenth_at_most_the_room_of_the_code() {
        assert_eq!(margin(64 * MIB), 4 * MIB);
        assert_eq!(margin(LIMIT), CODE_ALLOWANCE);
        assert_eq!(margin(4096 * MIB), CODE_ALLOWANCE);
        assert_eq!(margin(0), 0);
    }

    #[test]
    fn a_charge_near_the_limit_sheds_a_sixteenth_once_a_second() {
        let mut w = Watch::default();
        let t = Instant::now();
        assert_eq!(w.observe(s(100, 0), t), None);
        let shed = w.observe(s(151, 0), t).expect("within 1/16");
        assert_eq!(shed.bytes, 10 * MIB);
        assert!(shed.why.contains("within 10.0 MiB"), "{}", shed.why);
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
    fn kernel_events_count_only_near_the_limit_with_little_to_reclaim() {
        let mut w = Watch::default();
        let t = Instant::now();
        // the first sample sets the baseline: old events are not new pressure
        assert_eq!(w.observe(s(145, 40), t), None);
        // new events far from the limit: page cache reclaimed, harmless
        assert_eq!(w.observe(s(100, 45), t), None);
        // new events within twice the margin, but page cache left to reclaim
        let cached = Sample {
            reclaimable: 8 * MIB,
            ..s(145, 46)
        };
        assert_eq!(w.observe(cached, t), None);
        // new events within twice the margin, little left to reclaim
        let shed = w.observe(s(145, 48), t).expect("events near the limit");
        assert!(shed.why.contains("2 pressure event(s)"), "{}", shed.why);
    }

    #[test]
    fn without_a_cgroup_the_budget_is_the_limit_and_events_do_not_exist() {
        let mut w = Watch::default();
        let t = Instant::now();
        let b = |charge| Sample {
            charge: charge * MIB,
            reclaimable: 0,
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
            reclaimable: 0,
            limit: 8 * MIB,
            events: 0,
            cgroup: false,
        };
        assert_eq!(w.observe(tiny, t).unwrap().bytes, MIB);
        let none = Sample {
            charge: 9,
            reclaimable: 0,
            limit: 0,
            events: 9,
            cgroup: false,
        };
        assert_eq!(Watch::default().observe(none, t), None);
    }
}
