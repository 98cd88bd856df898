//! A team of the rayon pool's threads held together for a whole forward step.
//!
//! Why: a decode step of a small model is a few hundred parallel regions (every matmul splits
//! its rows) of 10–40 µs each. Under plain rayon each region is a fork and join: idle workers
//! go to sleep between regions and are woken through a futex for the next one, a cost that
//! does not shrink with the region. llama.cpp instead keeps its threads spinning during a
//! graph's compute; this module does the same for one step.
//!
//! Shape: [`lead`] (entered through `ops::on_pool`) runs a step on a pool thread, the
//! *leader*, after spawning `threads − 1` *helper* tasks into the same pool (so the step uses
//! the pool's threads, no others, and pays one wake-up). A helper polls the team's job word
//! while the step runs (pausing for [`PAUSE`], then yielding its core between polls); after
//! [`SPIN`] without work it parks on a condvar (woken by the next region), and it leaves when
//! the step ends, so an idle process uses no CPU. A parallel
//! region inside the step ([`par_for`], [`par_chunks_mut`], [`par_drain`]) publishes its
//! closure and its chunk count; the leader and the helpers claim chunks from one atomic
//! counter. Outside a step (or with `LOIP_TEAM=0`, [`set_off`]) the same functions are
//! rayon's parallel iterators, as before. The team's threads pin themselves one per core
//! where the pool has a thread per core (`crate::affinity`).
//!
//! Results do not depend on the path: a chunk is the same computation whichever thread
//! claims it.
//!
//! Progress: the leader claims chunks too and waits only for chunks that a helper has
//! *claimed*; a helper that was never scheduled, is parked, or is preempted between regions
//! holds nothing up. A step finishes even if no helper ever runs (a busy pool).
//!
//! Soundness: a region's closure lives on the leader's stack; its lifetime is erased while it
//! is published. A runner dereferences it only after claiming a chunk of that region, and the
//! leader returns from the region only after every claimed chunk has finished (`done` reaches
//! the region's target), so no runner touches the closure after it dies. A panic in a chunk is
//! caught where it happens and resumed by the leader once the region has drained: the leader
//! never unwinds while a helper still runs the closure. The team itself lives in the leader's
//! `rayon::scope`, which outlives every helper task.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use crate::simd::Switch;

/// How long a waiting thread pauses (`spin_loop`) before it yields its core between polls
/// (`sched_yield`): longer than most gaps between a step's regions (norms, rope, cache
/// appends: a few µs), so those cost no system call. Yielding after it keeps a helper
/// responsive within about a µs on a quiet machine, while on a loaded one (more runnable
/// threads than cores) the spinning helper gives its time slices to the others, the leader
/// included: pure spinning there made decode 17–42 % slower than plain rayon
/// (docs/benchmarks.md, "A team of threads per step").
const PAUSE: Duration = Duration::from_micros(10);
/// How long a helper waits without work before it parks (longer than any gap inside a decode
/// step, far shorter than a scheduler tick).
const SPIN: Duration = Duration::from_micros(300);
/// Most chunks of one region (the job word keeps the count in 32 bits and the next chunk in
/// 32 bits, which overshoot the count by at most one per runner).
const MAX_CHUNKS: usize = 1 << 24;

/// `LOIP_TEAM=0` (or [`set_off`]): steps use plain rayon fork-join, as before the team.
static TEAM_OFF: Switch = Switch::new("LOIP_TEAM", "0");

/// Makes steps use plain rayon fork-join instead of a team (`false` restores the team, unless
/// the environment variable `LOIP_TEAM=0` turns it off for the whole process). Results are
/// bit-identical either way; only speed changes. Meant for side-by-side benchmarks.
pub(crate) fn set_off(off: bool) {
    TEAM_OFF.set(off);
}

/// A region's work: called once for each chunk index.
type Job<'a> = dyn Fn(usize) + Sync + 'a;

struct Team {
    /// The current region: `(chunks << 32) | next`, `next` the first unclaimed chunk. A runner
    /// claims chunk `next` with one `fetch_add`; `next >= chunks` means nothing is left.
    word: AtomicU64,
    /// `*const &Job` of the current region (a reference on the leader's stack), stored before
    /// the region's `word`.
    job: AtomicPtr<()>,
    /// Chunks finished since the team formed; a region is over when it reaches the target
    /// the leader set when publishing it.
    done: AtomicU64,
    /// Set by the leader while it runs a region (only the leader reads it): a region nested
    /// in a chunk runs serially on the leader instead of overwriting the current one.
    in_region: AtomicBool,
    /// The step is over: helpers leave.
    stop: AtomicBool,
    /// Helpers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// The first panic of a chunk, resumed by the leader after the region drained.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

thread_local! {
    /// The team this thread leads (null when none).
    static LEADING: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether a job word has an unclaimed chunk.
fn claimable(word: u64) -> bool {
    (word & u64::from(u32::MAX)) < word >> 32
}

impl Team {
    fn new() -> Team {
        Team {
            word: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicU64::new(0),
            in_region: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
        }
    }

    /// Runs `f(i)` for each `i < chunks`, each exactly once, on the leader and the helpers;
    /// returns when all have finished. Called by the leader only.
    fn run(&self, chunks: usize, f: &Job<'_>) {
        if chunks <= 1 || chunks > MAX_CHUNKS || self.in_region.load(Ordering::Relaxed) {
            (0..chunks).for_each(f);
            return;
        }
        self.in_region.store(true, Ordering::Relaxed);
        // every chunk of the previous region has finished: no runner adds to `done` now
        let target = self.done.load(Ordering::Acquire) + chunks as u64;
        let job: &Job<'_> = f;
        self.job
            .store(&job as *const &Job<'_> as *mut (), Ordering::Relaxed);
        // publishes the job pointer too (release; SeqCst for the sleepers handshake)
        self.word.store((chunks as u64) << 32, Ordering::SeqCst);
        self.notify();
        self.work();
        let since = Instant::now();
        let mut spins = 0u32;
        while self.done.load(Ordering::Acquire) < target {
            // a helper holds a chunk; if it was preempted, let it run
            spins = spins.wrapping_add(1);
            if spins < 64 || since.elapsed() < PAUSE {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        self.in_region.store(false, Ordering::Relaxed);
        if let Some(p) = lock(&self.panic).take() {
            resume_unwind(p);
        }
    }

    /// Claims and runs chunks of the current region until none is left; whether it ran any.
    fn work(&self) -> bool {
        let mut ran = false;
        loop {
            // Acquire: synchronizes with the leader's store of this region's word (a claim
            // reads from that store's release sequence), so the job pointer is this region's.
            let w = self.word.fetch_add(1, Ordering::Acquire);
            let (chunks, i) = (w >> 32, w & u64::from(u32::MAX));
            if i >= chunks {
                return ran;
            }
            // SAFETY: chunk `i` of the current region is claimed by this runner and not yet
            // counted in `done`, so the leader is inside `run` for this region and its `job`
            // reference (stored before the word this claim read from) is alive; a later
            // region's pointer is stored only after this chunk is counted. The lifetime is
            // erased only for this call.
            let f: &Job<'static> =
                unsafe { *(self.job.load(Ordering::Acquire) as *const &Job<'static>) };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(i as usize))) {
                lock(&self.panic).get_or_insert(p);
            }
            self.done.fetch_add(1, Ordering::Release);
            ran = true;
        }
    }

    /// A helper's loop: runs chunks while the step lasts.
    fn help(&self) {
        if !LEADING.get().is_null() {
            // This pool thread leads a team and only waits inside its step (rayon ran this
            // task while the leader waited for a join): spinning here would stall that step.
            return;
        }
        crate::affinity::pin_pool_thread();
        let mut idle = Instant::now();
        let mut spins = 0u32;
        loop {
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if claimable(self.word.load(Ordering::Relaxed)) {
                if self.work() {
                    idle = Instant::now();
                }
                continue;
            }
            if spins >= 64 && idle.elapsed() > PAUSE {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 && idle.elapsed() > SPIN {
                self.park();
                idle = Instant::now();
                spins = 0;
            }
        }
    }

    /// Sleeps until a region is published or the step ends.
    fn park(&self) {
        let mut g = lock(&self.lock);
        // SeqCst pairs with `notify`: either the leader sees this sleeper, or this check sees
        // the leader's store
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        while !self.stop.load(Ordering::SeqCst) && !claimable(self.word.load(Ordering::SeqCst)) {
            g = self.wake.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Wakes parked helpers (after a SeqCst store of `word` or `stop`).
    fn notify(&self) {
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&self.lock);
            self.wake.notify_all();
        }
    }
}

/// This thread's leadership of a team for the duration of a step; on drop (also when the step
/// panics) the team is dismissed and the previous leadership restored.
struct Lead<'a> {
    team: &'a Team,
    prev: *const Team,
}

impl<'a> Lead<'a> {
    fn enter(team: &'a Team) -> Lead<'a> {
        let prev = LEADING.replace(team);
        Lead { team, prev }
    }
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        LEADING.set(self.prev);
        self.team.stop.store(true, Ordering::SeqCst);
        self.team.notify();
    }
}

/// Runs `f` (a whole step) on a thread of the current rayon pool with a team of the pool's
/// threads; a step already inside a team runs as it is. With one thread or the team off, as
/// before: on the caller's thread when it is a pool thread, else one hand-off to the pool.
pub(crate) fn lead<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if !LEADING.get().is_null() {
        return f();
    }
    let threads = rayon::current_num_threads();
    if threads <= 1 || TEAM_OFF.on() {
        return if rayon::current_thread_index().is_some() {
            f()
        } else {
            rayon::scope(|_| f())
        };
    }
    let team = Team::new();
    rayon::scope(|s| {
        for _ in 1..threads {
            s.spawn(|_| team.help());
        }
        crate::affinity::pin_pool_thread();
        let _lead = Lead::enter(&team);
        f()
    })
}

/// Runs `f` with the team this thread leads, if any.
fn with_team<R>(f: impl FnOnce(Option<&Team>) -> R) -> R {
    let p = LEADING.get();
    // SAFETY: `LEADING` is non-null only between `Lead::enter` and the guard's drop, on the
    // thread that runs the step inside the `rayon::scope` owning the team; this call is
    // nested in that step, so the team outlives it.
    f(unsafe { p.as_ref() })
}

/// `f(i)` for each `i < n`, in parallel: on the team inside a step, else on rayon.
pub(crate) fn par_for(n: usize, f: impl Fn(usize) + Sync) {
    with_team(|team| match team {
        Some(team) => team.run(n, &f),
        None => (0..n).into_par_iter().for_each(&f),
    })
}

/// A pointer that crosses threads; see [`par_chunks_mut`].
struct SharedMut<T>(*mut T);
// SAFETY: used only to hand disjoint sub-slices of a `&mut [T]` to other threads, which is
// what `T: Send` allows (as `<[T]>::par_chunks_mut` does).
unsafe impl<T: Send> Sync for SharedMut<T> {}

/// `f(i, chunk i)` for the chunks of `chunk` elements of `data` (the last may be shorter), in
/// parallel: on the team inside a step, else on rayon.
pub(crate) fn par_chunks_mut<T: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk = chunk.max(1);
    with_team(|team| match team {
        Some(team) => {
            let len = data.len();
            let base = SharedMut(data.as_mut_ptr());
            let base = &base;
            team.run(len.div_ceil(chunk), &|i| {
                let a = i * chunk;
                let b = (a + chunk).min(len);
                // SAFETY: `run` calls each index once, so the sub-slices are disjoint; `data`
                // is borrowed mutably for this whole call and `run` returns only after every
                // chunk finished.
                let s = unsafe { std::slice::from_raw_parts_mut(base.0.add(a), b - a) };
                f(i, s)
            })
        }
        None => data
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, s)| f(i, s)),
    })
}

/// `f(&mut scratch, item)` for each item, in parallel: on the team inside a step (a fresh
/// `init()` per item), else on rayon (`for_each_init`: one per rayon split).
pub(crate) fn par_drain<T: Send, S>(
    items: Vec<T>,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, T) + Sync + Send,
) {
    if LEADING.get().is_null() {
        items.into_par_iter().for_each_init(init, f);
        return;
    }
    let mut slots: Vec<Option<T>> = items.into_iter().map(Some).collect();
    par_chunks_mut(&mut slots, 1, |_, s| {
        if let Some(t) = s.first_mut().and_then(Option::take) {
            f(&mut init(), t)
        }
    });
}
