//! What `--mem` means: the most memory the whole process may be charged, as the kernel
//! counts it — resident anonymous memory, the page cache the process causes, and kernel
//! buffers — not only the engine's weights and KV.
//!
//! A budget is split once, at start ([`Budget::split`]): the **process** share is what the
//! process costs beside the engine (measured: the resident set after start-up; allowed: the
//! peer queues, thread stacks, socket buffers, and the page cache of a file being written or
//! read before it is dropped), and the **engine** share is the rest — the only figure the
//! engine, the planner and the coordinator ever see as this device's memory. A budget with
//! no room for an engine is refused at start with the smallest that works.
//!
//! With no `--mem`, [`default_budget`] takes the device's: the smaller of the cgroup limit
//! (what others in the cgroup already use deducted) and `MemAvailable`, less a stated margin.
//!
//! [`charge_now`] is the live figure `/health`, `/metrics` and the worker's log report: the
//! cgroup's `memory.current` where this process is confined alone, else its RSS plus the page
//! cache its cgroup holds. Under pressure the engine sheds memory ([`pressure`]).

pub mod cgroup;
pub mod pressure;

use std::fmt;

use loip_plan::units::format_bytes;
use serde::Serialize;

pub use cgroup::Cgroup;

/// A `--mem` budget split between the process and the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Budget {
    /// the whole process, as the kernel counts it, bytes
    pub total: u64,
    /// what the engine may use (weights, slot, working buffers, KV), bytes
    pub engine: u64,
    /// the process's own overhead, bytes
    pub process: u64,
}

/// A budget that cannot hold the process and an engine.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "a budget of {} leaves nothing for the engine: the process itself needs {}; the smallest \
     budget that works is {}",
    format_bytes(*total), format_bytes(*process), format_bytes(*smallest)
)]
pub struct TooSmall {
    /// the budget asked for, bytes
    pub total: u64,
    /// the process's overhead, bytes
    pub process: u64,
    /// the smallest budget that works, bytes
    pub smallest: u64,
}

impl Budget {
    /// Splits `total` into `process` bytes of overhead and the engine's share, which must be
    /// at least `min_engine` bytes.
    pub fn split(total: u64, process: u64, min_engine: u64) -> Result<Budget, TooSmall> {
        let smallest = process.saturating_add(min_engine);
        if total < smallest {
            return Err(TooSmall {
                total,
                process,
                smallest: round_up_mib(smallest),
            });
        }
        Ok(Budget {
            total,
            engine: total - process,
            process,
        })
    }
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "budget {} = engine {} + process {}",
            format_bytes(self.total),
            format_bytes(self.engine),
            format_bytes(self.process)
        )
    }
}

fn round_up_mib(b: u64) -> u64 {
    b.div_ceil(1 << 20) << 20
}

/// What a process costs beside its engine, bytes: the pieces of [`Budget::process`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Overhead {
    /// anonymous resident memory measured after start-up (runtime, allocator, what is loaded
    /// so far; `RssAnon` + `RssShmem`), bytes
    pub baseline: u64,
    /// the code the process maps ([`CODE_ALLOWANCE`]: stated, not measured, so that it does
    /// not move with the page cache), bytes
    pub code: u64,
    /// byte budgets of the peer queues (frames read, outputs to write), bytes
    pub queues: u64,
    /// stacks of the threads and the allocator's per-thread arenas, bytes
    pub threads: u64,
    /// page cache of a file being written or read before it is dropped, socket buffers and
    /// other kernel memory the process is charged for, bytes
    pub io: u64,
}

impl Overhead {
    /// The sum, bytes.
    pub fn total(&self) -> u64 {
        self.baseline + self.code + self.queues + self.threads + self.io
    }
}

/// Thread stacks as charged (touched pages, not the reserved size) plus the allocator's
/// arena slack per thread, bytes.
pub const PER_THREAD: u64 = 512 << 10;
/// Page cache and kernel buffers allowed at once: a slice chunk being written (dropped after
/// each chunk), the conventional loader's window, socket buffers of a few links, bytes.
pub const IO_ALLOWANCE: u64 = 6 << 20;

/// The executable's code and read-only data as the kernel maps them, bytes: a stated
/// allowance in place of the file-backed resident set, which moves with the page cache (each
/// fault maps whatever of its 64 KiB neighbourhood is cached: the same binary mapped 8.0 MB one
/// second after start from a warm cache and 10.4 MB freshly copied, so an engine got 45.8 MiB
/// in one run and 48.2 in the next). Derivation (7 December 2026, x86-64, release build,
/// `loip local -m smollm2 --devices 3 -n 64 --ignore-eos`, each worker's `/proc/PID/smaps`
/// after the generation): the executable's resident pages are 10.0–10.4 MiB from the build's
/// own binary and 12.2–12.5 MiB from a fresh copy (wholly in the page cache: the most the
/// kernel maps), rounded up. Shared libraries (libc, libm, ld.so: 2.3 MiB) are not counted:
/// every process on the device maps them, and the page cache is charged to whoever read it
/// first.
pub const CODE_ALLOWANCE: u64 = 13 << 20;

/// What a `loip worker` process typically takes beside its engine with a small budget:
/// 32.8 MiB on a 2-core x86-64 with a 75 MiB budget (1.4 MiB anonymous after start, the code
/// allowance, 9.4 MiB of peer queues, 3 MiB for threads, the I/O allowance), plus a margin.
/// `loip local` adds it to the engine budgets it picks, bytes.
pub const WORKER_PROCESS_ESTIMATE: u64 = 34 << 20;

/// The overhead of a process whose anonymous resident memory after start-up is `baseline`,
/// with `threads` threads and peer queues of `queues` bytes (its code: [`CODE_ALLOWANCE`]).
pub fn overhead(baseline: u64, threads: usize, queues: u64) -> Overhead {
    Overhead {
        baseline,
        code: CODE_ALLOWANCE,
        queues,
        threads: threads as u64 * PER_THREAD,
        io: IO_ALLOWANCE,
    }
}

/// What a process whose `/proc/PID/status` reads `status` costs beside its engine, with
/// `threads` threads and `queues` bytes of peer queues: its anonymous resident memory, its
/// code ([`CODE_ALLOWANCE`]) and the allowances of [`overhead`]. The file-backed resident set
/// is not counted (the code allowance stands for it), so the figure does not move with the
/// page cache. Where the text has no `RssAnon` (kernels before 4.5), its whole `VmRSS` counts
/// beside the allowance.
pub fn process_overhead(status: &str, threads: usize, queues: u64) -> Overhead {
    let baseline = match Resident::parse(status) {
        Some(r) => r.anon + r.shmem,
        None => kib_line(status, "VmRSS:").unwrap_or(0),
    };
    overhead(baseline, threads, queues)
}

/// Splits `total` for this process as it is now ([`process_overhead`] of its
/// `/proc/self/status`); the engine, at least `min_engine` bytes, gets the rest.
pub fn split_this_process(
    total: u64,
    threads: usize,
    queues: u64,
    min_engine: u64,
) -> Result<Budget, TooSmall> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let o = process_overhead(&status, threads, queues);
    Budget::split(total, o.total(), min_engine)
}

static BUDGET: std::sync::OnceLock<Budget> = std::sync::OnceLock::new();

/// Records this process's budget split (once, at start) for [`report`], and drops the
/// executable's pages the process does not map from the page cache ([`drop_unmapped_code`]).
pub fn set_budget(b: Budget) {
    if BUDGET.set(b).is_ok() {
        drop_unmapped_code();
    }
}

/// Asks the kernel to drop this process's executable from the page cache, but for the pages
/// mapped (the code that has run: the advice keeps mapped pages). Starting reads about twice
/// the code it maps (each fault reads ahead around it), charged to the process's cgroup as
/// page cache beside the code allowance; code that runs later reads its pages again.
pub fn drop_unmapped_code() {
    #[cfg(target_os = "linux")]
    loip_model::checkpoint::drop_from_page_cache(std::path::Path::new("/proc/self/exe"));
}

/// The process's budget split as recorded by [`set_budget`], and the live charge: what
/// `/health` and `/metrics` report.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct MemoryNow {
    /// the split, when a budget was given
    pub budget: Option<Budget>,
    /// what the kernel charges now
    pub charge: Charge,
    /// what pressure made the process shed so far ([`pressure`])
    pub shed: pressure::ShedTotals,
}

/// [`MemoryNow`] of this process.
pub fn report() -> MemoryNow {
    MemoryNow {
        budget: BUDGET.get().copied(),
        charge: charge_now(),
        shed: pressure::totals(),
    }
}

/// How the default budget was chosen: the bytes and the reason, for the start-up line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefaultBudget {
    /// the budget, bytes
    pub bytes: u64,
    /// why (printed at start)
    pub why: String,
}

/// Margin left below what the device offers: 5 %, at least 8 MiB.
fn margin(b: u64) -> u64 {
    (b / 20).max(8 << 20)
}

/// The default budget (pure core of [`default_budget`]): the smaller of the cgroup's limit
/// less what the rest of the cgroup is charged (`others`), and `available` (`MemAvailable`),
/// less a margin. `None` when neither is known or nothing is left.
pub fn choose_default(
    limit: Option<u64>,
    others: u64,
    available: Option<u64>,
) -> Option<DefaultBudget> {
    let room = limit.map(|l| l.saturating_sub(others));
    let (b, from) = match (room, available) {
        (Some(r), Some(a)) if r <= a => (r, "the cgroup's memory limit"),
        (Some(r), None) => (r, "the cgroup's memory limit"),
        (_, Some(a)) => (a, "MemAvailable"),
        (None, None) => return None,
    };
    let m = margin(b);
    let bytes = b.checked_sub(m).filter(|&x| x > 0)? >> 20 << 20;
    let mut why = format!("{} from {from}", format_bytes(b));
    if let (Some(l), Some(a)) = (limit, available) {
        why = format!(
            "{why} (cgroup limit {}{}, MemAvailable {})",
            format_bytes(l),
            if others > 0 {
                format!(" less {} used by others in it", format_bytes(others))
            } else {
                String::new()
            },
            format_bytes(a)
        );
    }
    why.push_str(&format!(", less a margin of {}", format_bytes(m)));
    Some(DefaultBudget { bytes, why })
}

/// The default budget of this device: [`choose_default`] over this process's cgroup and
/// `/proc/meminfo`.
pub fn default_budget() -> Option<DefaultBudget> {
    let cg = Cgroup::of_self();
    let limit = cg.as_ref().and_then(|c| c.limit());
    let others = match (&cg, limit) {
        (Some(c), Some(_)) => c.current().unwrap_or(0).saturating_sub(rss().unwrap_or(0)),
        _ => 0,
    };
    choose_default(limit, others, mem_available())
}

/// Allocations of at least this many bytes get their own mapping, returned to the kernel
/// when freed.
const MMAP_THRESHOLD: i32 = 1 << 20;

/// Makes the C allocator give freed memory back to the kernel, so what a process is charged
/// follows what it holds: large buffers (≥ 1 MiB) are their own mappings whatever was
/// freed before (glibc otherwise raises that threshold to 32 MiB after the first large free
/// and keeps later large buffers in its heaps, where freeing them returns nothing), the heap
/// is trimmed past 1 MiB free, and at most two arenas serve the threads. Call once at start,
/// before other threads allocate; a no-op where the allocator is not glibc's.
pub fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; called before threads allocate.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// The `KEY: N kB` line of a `/proc` file's text, bytes.
fn kib_line(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib << 10)
}

/// The `KEY: N kB` line of a `/proc` file, bytes.
fn proc_kib(file: &str, key: &str) -> Option<u64> {
    kib_line(&std::fs::read_to_string(file).ok()?, key)
}

/// A process's resident set by kind, from `/proc/PID/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resident {
    /// anonymous memory (`RssAnon`), bytes
    pub anon: u64,
    /// file-backed pages mapped (`RssFile`: code, mapped files), bytes
    pub file: u64,
    /// shared memory (`RssShmem`), bytes
    pub shmem: u64,
}

impl Resident {
    /// Parses a `/proc/PID/status` text; `None` without `RssAnon` and `RssFile` (kernels
    /// before 4.5).
    pub fn parse(status: &str) -> Option<Resident> {
        Some(Resident {
            anon: kib_line(status, "RssAnon:")?,
            file: kib_line(status, "RssFile:")?,
            shmem: kib_line(status, "RssShmem:").unwrap_or(0),
        })
    }
}

fn status_kib(key: &str) -> Option<u64> {
    proc_kib("/proc/self/status", key)
}

/// This process's resident set now (`VmRSS`), bytes.
pub fn rss() -> Option<u64> {
    status_kib("VmRSS:")
}

/// This process's highest resident set (`VmHWM`), bytes.
pub fn rss_peak() -> Option<u64> {
    status_kib("VmHWM:")
}

/// `MemAvailable` from `/proc/meminfo`, bytes.
pub fn mem_available() -> Option<u64> {
    proc_kib("/proc/meminfo", "MemAvailable:")
}

/// Where a [`Charge`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChargeSource {
    /// the process's own cgroup (`memory.current` / `memory.usage_in_bytes`)
    Cgroup,
    /// resident set plus the page cache its cgroup holds (the cgroup is shared or unlimited)
    Rss,
}

/// What the kernel charges this process now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Charge {
    /// bytes
    pub bytes: u64,
    /// how it was measured
    pub source: ChargeSource,
    /// times the cgroup met its limit (0 without one)
    pub pressure_events: u64,
}

/// The live charge: the cgroup's when this process is alone in a cgroup with a limit, else
/// RSS plus (at most) the page cache of its cgroup.
pub fn charge_now() -> Charge {
    let cg = Cgroup::of_self();
    if let Some(c) = &cg {
        if c.limit().is_some() && c.pids().len() <= 1 {
            if let Some(bytes) = c.current() {
                return Charge {
                    bytes,
                    source: ChargeSource::Cgroup,
                    pressure_events: c.pressure_events(),
                };
            }
        }
    }
    let rss = rss().unwrap_or(0);
    let cache = cg.as_ref().and_then(|c| c.page_cache()).unwrap_or(0);
    Charge {
        bytes: rss + cache.min(IO_ALLOWANCE),
        source: ChargeSource::Rss,
        pressure_events: cg.map_or(0, |c| c.pressure_events()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_budget_splits_into_engine_and_process() {
        let b = Budget::split(66 * MIB, 25 * MIB, 4 * MIB).unwrap();
        assert_eq!((b.engine, b.process), (41 * MIB, 25 * MIB));
        assert_eq!(
            b.to_string(),
            "budget 66.0 MiB = engine 41.0 MiB + process 25.0 MiB"
        );
    }

    #[test]
    fn a_budget_too_small_names_the_smallest_that_works() {
        let e = Budget::split(20 * MIB, 25 * MIB + 5, 4 * MIB).unwrap_err();
        assert_eq!(e.smallest, 30 * MIB);
        assert!(
            e.to_string()
                .contains("the smallest budget that works is 30.0 MiB"),
            "{e}"
        );
    }

    #[test]
    fn the_default_is_the_smaller_of_cgroup_and_available_less_a_margin() {
        let d = choose_default(Some(300 * MIB), 0, Some(20_000 * MIB)).unwrap();
        assert!(d.bytes < 300 * MIB && d.bytes >= 280 * MIB, "{}", d.bytes);
        assert!(d.why.contains("cgroup's memory limit"), "{}", d.why);
        let d = choose_default(None, 0, Some(1000 * MIB)).unwrap();
        assert_eq!(d.bytes, 950 * MIB);
        assert!(d.why.contains("MemAvailable"), "{}", d.why);
        // others in the cgroup leave less room
        let d = choose_default(Some(300 * MIB), 100 * MIB, Some(20_000 * MIB)).unwrap();
        assert!(d.bytes < 200 * MIB, "{}", d.bytes);
        assert!(choose_default(None, 0, None).is_none());
        assert!(choose_default(Some(4 * MIB), 0, None).is_none());
    }

    /// `/proc/PID/status` of a `loip worker` one second after start (7 December 2026), with
    /// its executable's pages mapped from a warm page cache (`RssFile` 8.0 MB) and from a
    /// fresh copy (10.4 MB).
    fn status(rss_file_kib: u64) -> String {
        format!(
            "Name:\tloip\nVmPeak:\t  563324 kB\nVmHWM:\t   {} kB\nVmRSS:\t   {} kB\n\
             RssAnon:\t    1436 kB\nRssFile:\t    {rss_file_kib} kB\nRssShmem:\t       0 kB\n\
             VmData:\t  102400 kB\nThreads:\t6\n",
            1436 + rss_file_kib,
            1436 + rss_file_kib
        )
    }

    #[test]
    fn the_process_share_does_not_move_with_the_page_cache() {
        let warm = process_overhead(&status(7812), 6, 8 * MIB);
        let fresh = process_overhead(&status(10156), 6, 8 * MIB);
        assert_eq!(warm, fresh);
        assert_eq!(warm.baseline, 1436 << 10);
        assert_eq!(warm.code, CODE_ALLOWANCE);
        assert_eq!(
            warm.total(),
            (1436 << 10) + CODE_ALLOWANCE + 8 * MIB + 6 * PER_THREAD + IO_ALLOWANCE
        );
        // the allowance covers the most the executable was seen to map
        const { assert!(CODE_ALLOWANCE >= 12_788 << 10) };
        let r = Resident::parse(&status(7812)).unwrap();
        assert_eq!((r.anon, r.file, r.shmem), (1436 << 10, 7812 << 10, 0));
    }

    #[test]
    fn without_rss_anon_the_whole_resident_set_counts() {
        let old = "Name:\tloip\nVmRSS:\t   9248 kB\nThreads:\t6\n";
        assert_eq!(Resident::parse(old), None);
        let o = process_overhead(old, 6, 0);
        assert_eq!((o.baseline, o.code), (9248 << 10, CODE_ALLOWANCE));
        assert_eq!(process_overhead("", 1, 0).baseline, 0);
    }

    #[test]
    fn this_process_has_a_resident_set_and_a_charge() {
        assert!(rss().unwrap_or(0) > 0);
        assert!(charge_now().bytes > 0);
    }
}
