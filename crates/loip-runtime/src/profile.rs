//! `loip profile` on a quiet machine (issue 36): the probe ([`crate::net::probe`]) repeated and
//! reduced to its element-wise median, optionally on a pinned set of cores chosen by the
//! user or as the least busy ones.
//!
//! A single probe on a shared machine measures whatever else ran at that moment: profiles
//! taken under load planned 25 ms of compute against 11 measured for `loip local` with three
//! workers. The median of several probes drops the outliers a burst of other work causes,
//! and pinning keeps the probe off cores that are busy (and its threads from migrating).
//!
//! [`loopback_latency`] measures the software cost of one small message on this machine
//! (TCP over loopback, so no wire): the profile's `collective_latency`, which the simulator
//! charges per tensor-parallel collective call besides the link's own latency.
//!
//! [`time_head`] times the final norm + LM head as the probe times a block (caches flushed,
//! inside a team of compute threads, the median), for the profile's `head` grid: scaling the
//! MLP's time by `H / P` priced SmolLM2's Q8_0 head from its Q4_1 MLP blocks.
//!
//! [`median_probe`] and [`busy_fractions`] are pure; [`pin_to_cpus`], [`quiet_cpus`],
//! [`loopback_latency`] and [`time_head`] are the edges (a syscall, `/proc/stat`, a socket
//! pair, the slice files).

use std::time::Duration;

use crate::wire::{BatchProbe, ProbeResult};
use crate::RuntimeError;

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}

/// Median of `(context, seconds)` rows: for each context of `template`, the median of the
/// runs' times at that context (runs lacking it are skipped).
fn median_rows(template: &[(u64, f64)], runs: &[&[(u64, f64)]]) -> Vec<(u64, f64)> {
    template
        .iter()
        .map(|&(n, _)| {
            let at: Vec<f64> = runs
                .iter()
                .filter_map(|r| r.iter().find(|x| x.0 == n).map(|x| x.1))
                .collect();
            (n, median(at))
        })
        .collect()
}

/// Element-wise median of repeated probes of one machine: every block time, each loader's
/// bandwidth and per-read overhead; `took_s` is their sum. The grid (contexts, micro-batch
/// sizes) is the first run's. `None` for no runs.
pub fn median_probe(runs: &[ProbeResult]) -> Option<ProbeResult> {
    let first = runs.first()?;
    let attn_runs: Vec<&[(u64, f64)]> = runs.iter().map(|r| r.attn.as_slice()).collect();
    let loader = |pick: fn(&ProbeResult) -> loip_plan::LoaderProfile| loip_plan::LoaderProfile {
        bandwidth: median(runs.iter().map(|r| pick(r).bandwidth).collect()),
        per_read_overhead: median(runs.iter().map(|r| pick(r).per_read_overhead).collect()),
    };
    let batched = first
        .batched
        .iter()
        .map(|g| {
            let same_b: Vec<&BatchProbe> = runs
                .iter()
                .filter_map(|r| r.batched.iter().find(|x| x.b == g.b))
                .collect();
            let rows: Vec<&[(u64, f64)]> = same_b.iter().map(|x| x.attn.as_slice()).collect();
            BatchProbe {
                b: g.b,
                attn: median_rows(&g.attn, &rows),
                mlp_s: median(same_b.iter().map(|x| x.mlp_s).collect()),
            }
        })
        .collect();
    Some(ProbeResult {
        attn: median_rows(&first.attn, &attn_runs),
        mlp_s: median(runs.iter().map(|r| r.mlp_s).collect()),
        direct: loader(|r| r.direct),
        conventional: loader(|r| r.conventional),
        took_s: runs.iter().map(|r| r.took_s).sum(),
        batched,
        load_slowdown: median(runs.iter().map(|r| r.load_slowdown).collect()),
    })
}

/// Times the final norm + LM head of the model in `dir` for each micro-batch of
/// [`crate::net::probe::BATCH_GRID`] (one token per sequence): the median of
/// [`crate::net::probe::REPS`] runs, the caches flushed before each, as the probe times a
/// block. Loads the head's slices (for a tied head, the embedding: 30 MB for SmolLM2).
pub fn time_head(
    dir: &std::path::Path,
    m: &loip_model::slice::Manifest,
) -> Result<loip_plan::profile::HeadGrid, RuntimeError> {
    use crate::net::probe::{entry, time_median, BATCH_GRID, FLUSH_BYTES, REPS};
    use loip_model::slice::SliceKind;
    let cfg = &m.config;
    let mut slices = vec![entry(m, SliceKind::Head)?];
    if cfg.tie_word_embeddings {
        slices.push(entry(m, SliceKind::Embed)?);
    }
    let bytes = slices.iter().map(|s| s.size).sum();
    let resident = crate::resident::Resident::load(dir, &slices)?;
    let tf = crate::executor::transformer_of(m)?;
    let w = loip_engine::HeadWeights::bind(&resident, cfg)?;
    let h = cfg.hidden_size;
    let x0: Vec<f32> = (0..h).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let mut cold = crate::net::probe::Cold {
        buf: vec![0u8; FLUSH_BYTES],
        weights: &resident,
    };
    let mut seconds = Vec::new();
    for &b in &BATCH_GRID {
        let mut logits = vec![0f32; b as usize * cfg.vocab_size];
        seconds.push(time_median(&x0.repeat(b as usize), &mut cold, REPS, |x| {
            Ok(tf.head(&w, x, &mut logits)?)
        })?);
    }
    Ok(loip_plan::profile::HeadGrid {
        bytes,
        b: BATCH_GRID.to_vec(),
        seconds,
    })
}

/// Parses a core list as `taskset -c` takes it: `0,2-3`.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, RuntimeError> {
    let bad = || RuntimeError::Invalid(format!("core list `{s}`: expected e.g. `2,3` or `0-3`"));
    let mut cpus = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let (a, b): (usize, usize) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        if a > b || b >= libc::CPU_SETSIZE as usize {
            return Err(bad());
        }
        cpus.extend(a..=b);
    }
    cpus.sort_unstable();
    cpus.dedup();
    if cpus.is_empty() {
        return Err(bad());
    }
    Ok(cpus)
}

/// Pins the calling thread, and every thread it starts afterwards (they inherit the mask,
/// and `std::thread::available_parallelism` then counts these cores), to `cpus`.
pub fn pin_to_cpus(cpus: &[usize]) -> Result<(), RuntimeError> {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set, CPU_SET writes within it for
    // indices below CPU_SETSIZE (checked), and sched_setaffinity reads `size_of` bytes of it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c >= libc::CPU_SETSIZE as usize {
            return Err(RuntimeError::Invalid(format!("core {c} is out of range")));
        }
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(RuntimeError::Invalid(format!(
            "cannot pin to cores {cpus:?}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// Per-core busy fraction between two readings of `/proc/stat`: `(core, busy)` for every
/// `cpuN` line in both, busy = 1 − (idle + iowait) / total over the interval.
pub fn busy_fractions(before: &str, after: &str) -> Vec<(usize, f64)> {
    let parse = |text: &str| -> Vec<(usize, u64, u64)> {
        text.lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                let cpu: usize = it.next()?.strip_prefix("cpu")?.parse().ok()?;
                let v: Vec<u64> = it.filter_map(|x| x.parse().ok()).collect();
                let total: u64 = v.iter().sum();
                let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
                Some((cpu, total, idle))
            })
            .collect()
    };
    let a = parse(before);
    parse(after)
        .into_iter()
        .filter_map(|(cpu, total, idle)| {
            let &(_, t0, i0) = a.iter().find(|x| x.0 == cpu)?;
            let dt = total.saturating_sub(t0);
            let di = idle.saturating_sub(i0).min(dt);
            Some((
                cpu,
                if dt == 0 {
                    0.0
                } else {
                    1.0 - di as f64 / dt as f64
                },
            ))
        })
        .collect()
}

/// The `n` least busy cores over `sample` (read from `/proc/stat`), in core order.
pub fn quiet_cpus(n: usize, sample: Duration) -> Result<Vec<usize>, RuntimeError> {
    let read = || {
        std::fs::read_to_string("/proc/stat").map_err(|source| RuntimeError::Io {
            path: "/proc/stat".into(),
            source,
        })
    };
    let before = read()?;
    std::thread::sleep(sample);
    let after = read()?;
    let mut busy = busy_fractions(&before, &after);
    if busy.is_empty() {
        return Err(RuntimeError::Invalid("no cpuN lines in /proc/stat".into()));
    }
    busy.sort_by(|x, y| x.1.total_cmp(&y.1).then(x.0.cmp(&y.0)));
    let mut cpus: Vec<usize> = busy.into_iter().take(n.max(1)).map(|x| x.0).collect();
    cpus.sort_unstable();
    Ok(cpus)
}

/// One-way software latency of a `bytes`-byte message over TCP on loopback: half the median
/// round trip of `rounds` ping-pongs (`TCP_NODELAY`, one echo thread), after `rounds / 10`
/// warm-up rounds. Both ends run on this machine, so it is the cost of the system calls, the
/// kernel's TCP path and a thread wake-up per message, the part of a collective call that
/// does not depend on the link.  // seconds
pub fn loopback_latency(rounds: u32, bytes: usize) -> Result<f64, RuntimeError> {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let io = |source: std::io::Error| RuntimeError::Io {
        path: "127.0.0.1 (loopback latency)".into(),
        source,
    };
    let rounds = rounds.clamp(1, 100_000);
    let bytes = bytes.clamp(1, 1 << 20);
    let warm = rounds / 10;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(io)?;
    let addr = listener.local_addr().map_err(io)?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; bytes];
        for _ in 0..warm + rounds {
            s.read_exact(&mut buf)?;
            s.write_all(&buf)?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr).map_err(io)?;
    s.set_nodelay(true).map_err(io)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    let msg = vec![7u8; bytes];
    let mut back = vec![0u8; bytes];
    let mut rtt = Vec::with_capacity(rounds as usize);
    for i in 0..warm + rounds {
        let t = std::time::Instant::now();
        s.write_all(&msg).map_err(io)?;
        s.read_exact(&mut back).map_err(io)?;
        if i >= warm {
            rtt.push(t.elapsed().as_secs_f64());
        }
    }
    drop(s);
    match echo.join() {
        Ok(r) => r.map_err(io)?,
        Err(_) => {
            return Err(RuntimeError::Invalid(
                "loopback echo thread panicked".into(),
            ))
        }
    }
    Ok(median(rtt) / 2.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(attn: &[(u64, f64)], mlp: f64, bw: f64) -> ProbeResult {
        let l = loip_plan::LoaderProfile {
            bandwidth: bw,
            per_read_overhead: 1e-4,
        };
        ProbeResult {
            attn: attn.to_vec(),
            mlp_s: mlp,
            direct: l,
            conventional: l,
            took_s: 1.0,
            batched: vec![BatchProbe {
                b: 2,
                attn: attn.iter().map(|&(n, s)| (n, 2.0 * s)).collect(),
                mlp_s: 2.0 * mlp,
            }],
            load_slowdown: 0.1,
        }
    }

    #[test]
    fn the_median_drops_a_run_slowed_by_other_work() {
        let runs = [
            run(&[(1, 1.0), (256, 2.0)], 3.0, 1e9),
            run(&[(1, 9.0), (256, 9.0)], 9.0, 1e8), // a burst of other work
            run(&[(1, 1.2), (256, 2.2)], 3.2, 1.1e9),
        ];
        let m = median_probe(&runs).unwrap();
        assert_eq!(m.attn, vec![(1, 1.2), (256, 2.2)]);
        assert_eq!(m.mlp_s, 3.2);
        assert_eq!(m.direct.bandwidth, 1e9);
        assert_eq!(m.batched[0].attn, vec![(1, 2.4), (256, 4.4)]);
        assert_eq!(m.took_s, 3.0);
        assert!(median_probe(&[]).is_none());
    }

    #[test]
    fn loopback_latency_is_a_small_positive_time() {
        let s = loopback_latency(50, 4096).unwrap();
        assert!(s > 0.0 && s < 0.1, "{s}");
    }

    #[test]
    fn core_lists_and_busy_cores() {
        assert_eq!(parse_cpu_list("0,2-3").unwrap(), vec![0, 2, 3]);
        assert_eq!(parse_cpu_list("3, 1").unwrap(), vec![1, 3]);
        for bad in ["", "a", "3-1", "99999", "-"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad}");
        }
        let before = "cpu  10 0 10 80 0 0 0\ncpu0 5 0 5 40 0\ncpu1 5 0 5 40 0\n";
        let after = "cpu  60 0 10 130 0 0 0\ncpu0 55 0 5 40 0\ncpu1 5 0 5 90 0\n";
        let b = busy_fractions(before, after);
        assert_eq!(b, vec![(0, 1.0), (1, 0.0)]);
    }
}
