//! Per-hop timestamps inside a worker, for finding where a hop's time goes: with
//! `LOIP_HOP_TRACE=1` in a worker's environment each step it runs prints one line to stderr
//! (`loip-hop-trace …`, microseconds) splitting the hop from its frame's arrival to its output
//! handed to the writer, with the loads it collected (`load`: the loader's reading time,
//! `loaded`: bytes); the coordinator marks the warm-up's start and end ([`mark`]). Off by
//! default; when off the hot path reads one flag per step and per stage and takes no
//! timestamps.

use std::sync::OnceLock;
use std::time::Instant;

/// Whether `LOIP_HOP_TRACE` is set (to anything but `0` or empty), read once.
pub fn on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("LOIP_HOP_TRACE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// A hop's marks on the compute thread (`None` fields: not reached).
#[derive(Debug, Clone, Copy)]
pub struct Marks {
    /// the step frame decoded and queued for the compute thread
    pub arrived: Instant,
    /// the compute thread took it
    pub begun: Instant,
    /// the step's closure started on the compute pool
    pub pooled: Option<Instant>,
    /// the input decoded, KV reserved: the first stage starts
    pub stages: Option<Instant>,
    /// the last stage returned
    pub stages_done: Option<Instant>,
    /// the step's result (head and argmax included) is ready
    pub ran: Option<Instant>,
}

impl Marks {
    /// Marks of a step that arrived at `arrived` and is taken now.
    pub fn new(arrived: Instant) -> Marks {
        Marks {
            arrived,
            begun: Instant::now(),
            pooled: None,
            stages: None,
            stages_done: None,
            ran: None,
        }
    }
}

/// What the device timed inside a hop, seconds (its `StepTimes` and pool calls).
#[derive(Debug, Clone, Copy, Default)]
pub struct Inside {
    /// blocks and head
    pub compute_s: f64,
    /// waiting for the loader
    pub stall_s: f64,
    /// the stages' and head's calls to the compute pool, from the call to its return
    pub pool_call_s: f64,
    /// the same calls, inside the pool's closure
    pub pool_in_s: f64,
    /// `Loader::start` calls (the next stage's reads asked for)
    pub start_s: f64,
    /// stages run
    pub stages: usize,
    /// the loader's reading time of the loads collected in the hop
    pub load_s: f64,
    /// their bytes
    pub loaded_bytes: u64,
}

impl Inside {
    /// Adds one pool call's times.
    pub fn add_pool(&mut self, call_s: f64, in_s: f64) {
        self.pool_call_s += call_s;
        self.pool_in_s += in_s;
    }
}

/// `f` on the compute pool (`loip_kernels::on_pool`), with the call's time from the call to
/// its return and inside the pool's closure, seconds.
pub fn timed_on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> (R, f64, f64) {
    let called = Instant::now();
    let (r, in_s) = loip_kernels::on_pool(|| {
        let t = Instant::now();
        let r = f();
        (r, t.elapsed().as_secs_f64())
    });
    (r, called.elapsed().as_secs_f64(), in_s)
}

/// Prints one hop's line to stderr; `sent`: its output handed to the writer (or the peer).
pub fn print(step: u64, m: &Marks, t: &Inside, sent: Instant) {
    let us = |a: Instant, b: Option<Instant>| {
        b.map_or(-1.0, |b| b.duration_since(a).as_secs_f64() * 1e6)
    };
    let stages = m.stages.unwrap_or(m.begun);
    let ran = m.ran.unwrap_or(sent);
    let line = format!(
        "loip-hop-trace pid={} step={step} stages={} queued={:.1} pre={:.1} stages_wall={:.1} \
         pool_call={:.1} pool_in={:.1} compute={:.1} stall={:.1} start={:.1} post={:.1} send={:.1} \
         total={:.1} hand_in={:.1} load={:.1} loaded={}",
        std::process::id(),
        t.stages,
        us(m.arrived, Some(m.begun)),
        us(m.begun, m.stages),
        us(stages, m.stages_done),
        t.pool_call_s * 1e6,
        t.pool_in_s * 1e6,
        t.compute_s * 1e6,
        t.stall_s * 1e6,
        t.start_s * 1e6,
        us(m.stages_done.unwrap_or(stages), Some(ran)),
        us(ran, Some(sent)),
        us(m.arrived, Some(sent)),
        us(m.begun, m.pooled),
        t.load_s * 1e6,
        t.loaded_bytes,
    );
    // one write: the workers of `loip local` share one stderr
    let _ = std::io::Write::write_all(
        &mut std::io::stderr().lock(),
        format!("{line}\n").as_bytes(),
    );
}

/// With `LOIP_HOP_TRACE`: prints one line naming the moment `what` (the warm-up's start and
/// end: the run's steps follow) with the page cache's dirty and writeback kilobytes (`/proc/meminfo`; -1 where it
/// cannot be read), to relate the hops' load stall to the disk's writeback.
pub fn mark(what: &str) {
    if !on() {
        return;
    }
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kb = |key: &str| {
        info.lines()
            .find_map(|l| {
                l.strip_prefix(key)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<i64>()
                    .ok()
            })
            .unwrap_or(-1)
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let line = format!(
        "loip-hop-trace mark={what} pid={} dirty_kb={} writeback_kb={} load={}\n",
        std::process::id(),
        kb("Dirty:"),
        kb("Writeback:"),
        load.split_whitespace().next().unwrap_or("-"),
    );
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}
