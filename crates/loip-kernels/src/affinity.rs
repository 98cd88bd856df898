//! Pinning a step's team threads to cores, one thread per core.
//!
//! Why: a step's helpers are woken by its leader ([`crate::team`]). On a busy machine the
//! scheduler places a woken thread on the waker's core (cache affinity) and moves it only when
//! its load balancer runs; meanwhile the leader and the helper take turns on one core. With two
//! threads on this project's 2-core machine under other work, a layer's prefill matmuls ran at
//! 1.0–1.6× the one-thread speed unpinned and 2.0× pinned (`prefill_bench --scaling` and
//! `--scaling --unpinned`); a Gemma 3 prefill went from 1.63× to 1.88×. Pinned, each thread
//! has its own core from the first region.
//!
//! Policy: a pool thread of index `i` pins itself to the `i`-th core of the set the process
//! was allowed when the first thread pinned, only when the pool has exactly as many threads
//! as that set has cores (a process that leaves cores to others, e.g. several workers on one
//! machine with `--threads`, keeps the scheduler's placement). `LOIP_PIN=0` (or
//! [`set_pin_off`]) turns pinning off. Results do not depend on it: only where chunks run.

use std::cell::Cell;
use std::sync::OnceLock;

use crate::simd::Switch;

/// `LOIP_PIN=0` (or [`set_pin_off`]): no pinning.
static PIN_OFF: Switch = Switch::new("LOIP_PIN", "0");

/// The cores the process may run on, as first seen (before any thread pinned itself).
static ALLOWED: OnceLock<Vec<usize>> = OnceLock::new();

thread_local! {
    /// Whether this thread has tried to pin itself already.
    static TRIED: Cell<bool> = const { Cell::new(false) };
}

/// Turns pinning off (`true`) or back on (`false`, unless `LOIP_PIN=0` turns it off for the
/// whole process). Threads already pinned stay pinned.
pub(crate) fn set_off(off: bool) {
    PIN_OFF.set(off);
}

/// Pins the calling rayon pool thread to its core (see the module docs), once per thread.
pub(crate) fn pin_pool_thread() {
    if TRIED.get() || PIN_OFF.on() {
        return;
    }
    TRIED.set(true);
    let Some(index) = rayon::current_thread_index() else {
        return;
    };
    let cores = ALLOWED.get_or_init(allowed_cores);
    if cores.len() < 2 || rayon::current_num_threads() != cores.len() {
        return;
    }
    if let Some(&core) = cores.get(index) {
        pin_to(core);
    }
}

/// The cores in the calling thread's affinity mask (empty where unknown).
#[cfg(target_os = "linux")]
fn allowed_cores() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data (zeroed: the empty set); sched_getaffinity writes at
    // most `size_of` bytes into it; CPU_ISSET reads inside it for indices below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

#[cfg(not(target_os = "linux"))]
fn allowed_cores() -> Vec<usize> {
    Vec::new()
}

/// Pins the calling thread to `core` (best effort: a failure leaves it where it was).
#[cfg(target_os = "linux")]
fn pin_to(core: usize) {
    if core >= libc::CPU_SETSIZE as usize {
        return;
    }
    // SAFETY: as in `allowed_cores`; CPU_SET writes inside the set (core < CPU_SETSIZE,
    // checked), sched_setaffinity reads `size_of` bytes of it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_to(_core: usize) {}
