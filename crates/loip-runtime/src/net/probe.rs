//! A quick measurement of one device (a few seconds): attention and MLP block times of the
//! real model's layer 0 at a few context lengths, for micro-batches of b = 1, 2, 4 and 8
//! sequences ([`BATCH_GRID`], one token each), and both loaders' read bandwidth and
//! per-read overhead on the same slices. The coordinator turns the result into a measured
//! [`loip_plan::DeviceProfile`] for the planner (design §7 and §11: t^A(b, n), t^P(b), β, λ).
//!
//! Attention at context `n` is timed with `n` placeholder KV rows appended directly to the
//! cache (the time does not depend on their values), so no prefill is computed. Before each
//! timed run the CPU caches are flushed by writing a buffer larger than the last-level
//! cache: in a real decoding step every block's weights come from memory, not from a cache
//! warmed by the previous repetition (small models' blocks fit in L2/L3 otherwise).
//!
//! A micro-batch of `b` sequences at context `n` holds `b·n` KV rows; points with more than
//! 4,096 rows (the largest b = 1 point) are not timed but completed from the b = 1 row
//! ([`complete_row`]), so the probe's memory stays what it was.
//!
//! The MLP block is also timed while the direct loader reads layer 0's slices beside it
//! ([`slowdown_under_load`]): the fraction by which compute slows beside a load (memory
//! bandwidth and cores shared with the reads), which the cost model charges to the compute a
//! stage's next load overlaps.
//!
//! The probe runs within the engine's budget ([`ProbeBudget`]): layer 0's blocks, the cache
//! flush buffer (scaled down to a quarter of the budget), the KV rows of the attention points
//! (fewer rows, and so fewer contexts, where the budget is small) and the loader's slot are
//! counted before anything is allocated (the loader's slot for the slowdown only if it fits
//! besides them), and a probe that cannot fit is refused with what it
//! would need.

use std::path::Path;
use std::time::Instant;

use loip_engine::{AttnWeights, KvCache, MlpWeights, TokenPos};
use loip_model::slice::{Manifest, SliceEntry, SliceKind};
use loip_plan::LoaderProfile;

use crate::loader::{Loader, LoaderKind};
use crate::resident::Resident;
use crate::wire::{BatchProbe, ProbeResult};
use crate::RuntimeError;

/// Timed repetitions per point (the median is kept).
pub(crate) const REPS: usize = 9;
/// Passes over the b = 1 points (each the median of [`REPS`] runs); each point keeps the
/// median of its passes. One pass's median of a block still moved by a third from one
/// probe to the next on a shared machine, in both directions (SmolLM2 layer 0 at b = 1:
/// 0.162 ms among 0.213–0.235), so neither a single pass nor the fastest is the figure a
/// run sees: the middle of three passes spread over the probe is.
const PASSES_B1: usize = 3;
/// Timed repetitions per point for micro-batches of more than one sequence.
const REPS_BATCHED: usize = 5;
/// Micro-batch sizes (sequences, one token each) at which the blocks are timed.
pub const BATCH_GRID: [u32; 4] = [1, 2, 4, 8];
/// Most KV rows (summed over the micro-batch) a timed attention block holds: larger points
/// of the grid are completed by [`complete_row`] (the b = 1 row's largest context).  // tokens
const MAX_PROBE_ROWS: u64 = 4096;
/// Bytes written between repetitions to evict the weights from the CPU caches.
pub(crate) const FLUSH_BYTES: usize = 96 << 20;

/// What a probe may allocate: the engine's share of the worker's budget.
#[derive(Debug, Clone, Copy)]
pub struct ProbeBudget {
    /// bytes (0: unlimited)
    pub bytes: u64,
}

impl ProbeBudget {
    fn fits(&self, need: u64) -> bool {
        self.bytes == 0 || need <= self.bytes
    }
}

/// The cache flush buffer for a budget: [`FLUSH_BYTES`], at most a quarter of the budget.
fn flush_bytes(budget: ProbeBudget) -> usize {
    if budget.bytes == 0 {
        return FLUSH_BYTES;
    }
    (FLUSH_BYTES as u64).min(budget.bytes / 4) as usize
}

/// Most KV rows a timed attention block may hold within `room` bytes, for `kv_dim` floats a
/// row of K and of V.  // tokens
fn rows_within(room: u64, kv_dim: usize) -> u64 {
    let row = (kv_dim as u64).saturating_mul(8).max(1);
    (room / row).min(MAX_PROBE_ROWS)
}

fn refuse(what: &str, need: u64, budget: ProbeBudget) -> RuntimeError {
    RuntimeError::OverBudget {
        budget: budget.bytes,
        detail: format!(
            "the probe needs {need} bytes for {what}; this worker's engine budget is {}",
            budget.bytes
        ),
    }
}

/// Evicts the caches by writing every line of `buf`.
pub(crate) fn flush(buf: &mut [u8], round: u8) {
    for i in (0..buf.len()).step_by(64) {
        buf[i] = buf[i].wrapping_add(round);
    }
    std::hint::black_box(&buf);
}

/// Evicts `bytes` from every cache level, line by line (x86_64 `clflush`, aarch64
/// `dc civac`; elsewhere nothing, and the buffer flush alone evicts).
pub(crate) fn evict(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        for i in (0..bytes.len()).step_by(64) {
            // SAFETY: `clflush` (SSE2, part of x86_64) reads no memory; the address lies
            // within `bytes`.
            unsafe { core::arch::x86_64::_mm_clflush(bytes.as_ptr().add(i)) };
        }
        // SAFETY: a fence has no operands.
        unsafe { core::arch::x86_64::_mm_mfence() };
    }
    #[cfg(target_arch = "aarch64")]
    {
        for i in (0..bytes.len()).step_by(64) {
            // SAFETY: `dc civac` cleans and invalidates the line of an address within
            // `bytes` (user space may issue it on Linux); it writes no architectural state.
            unsafe {
                core::arch::asm!("dc civac, {p}", p = in(reg) bytes.as_ptr().add(i), options(nostack))
            };
        }
        // SAFETY: a barrier has no operands.
        unsafe { core::arch::asm!("dsb ish", options(nostack)) };
    }
    std::hint::black_box(bytes);
}

/// What is made cold before each timed run: `buf` written through (it evicts whatever it
/// displaces) and the timed block's own weights evicted line by line ([`evict`]). The
/// buffer alone fails on a small budget: a quarter of a 40 MiB engine budget is 10 MiB, less
/// than a 32 MiB last-level cache, so the block stayed partly cached and its time depended
/// on what else ran (worker probes of one SmolLM2 MLP block: 96–162 µs; cold: 174).
pub(crate) struct Cold<'a> {
    /// written through before each run
    pub buf: Vec<u8>,
    /// the timed blocks' weights
    pub weights: &'a Resident,
}

impl Cold<'_> {
    fn flush(&mut self, round: u8) {
        flush(&mut self.buf, round);
        for b in self.weights.buffers() {
            evict(b);
        }
    }
}

pub(crate) fn entry(m: &Manifest, k: SliceKind) -> Result<SliceEntry, RuntimeError> {
    m.slice(k)
        .cloned()
        .ok_or_else(|| RuntimeError::Invalid(format!("slice {} is not in the manifest", k.id())))
}

/// The upper median of `v` (its middle element after sorting; 0 when empty).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Per point, the median of the passes' times (every pass times the same points, in order).
fn median_of_passes(rows: &[Vec<(u64, f64)>]) -> Vec<(u64, f64)> {
    let Some(first) = rows.first() else {
        return Vec::new();
    };
    first
        .iter()
        .enumerate()
        .map(|(i, &(n, _))| {
            let at: Vec<f64> = rows.iter().filter_map(|r| r.get(i).map(|p| p.1)).collect();
            (n, median(at))
        })
        .collect()
}

/// Contexts at which attention is timed for a model of `max_pos` positions.  // tokens
pub fn probe_contexts(max_pos: usize) -> Vec<u64> {
    [1u64, 256, 1024, 4096]
        .into_iter()
        .filter(|&n| (n as usize) < max_pos)
        .collect()
}

/// Measures layer 0's blocks (`compute`) and both loaders (`loads`) from the slices in
/// `dir` within `budget`; parts not measured are left at zero.
pub fn probe(
    dir: &Path,
    m: &Manifest,
    compute: bool,
    loads: bool,
    budget: ProbeBudget,
) -> Result<ProbeResult, RuntimeError> {
    let t0 = Instant::now();
    let zero = LoaderProfile {
        bandwidth: 0.0,
        per_read_overhead: 0.0,
    };
    let (mut grid, load_slowdown) = if compute {
        time_blocks(dir, m, budget)?
    } else {
        (Vec::new(), 0.0)
    };
    let (attn, mlp_s) = match grid.first() {
        Some(one) if one.b == 1 => {
            let one = grid.remove(0);
            (one.attn, one.mlp_s)
        }
        _ => (Vec::new(), 0.0),
    };
    let (direct, conventional) = if loads {
        let (attn0, mlp0) = (entry(m, SliceKind::Attn(0))?, entry(m, SliceKind::Mlp(0))?);
        let slot = attn0.size.saturating_add(mlp0.size);
        if !budget.fits(slot) {
            return Err(refuse("the loader's slot (layer 0's blocks)", slot, budget));
        }
        let groups = vec![vec![attn0.clone()], vec![mlp0.clone()], vec![attn0, mlp0]];
        (
            loader_profile(LoaderKind::Direct, dir, &groups, 5)?,
            loader_profile(LoaderKind::Conventional, dir, &groups, 3)?,
        )
    } else {
        (zero, zero)
    };
    Ok(ProbeResult {
        attn,
        mlp_s,
        direct,
        conventional,
        took_s: t0.elapsed().as_secs_f64(),
        batched: grid,
        load_slowdown,
    })
}

/// Times one attention block for `b` sequences of `n` cached tokens each (the median of
/// `reps` runs after a warm-up).  // seconds
#[allow(clippy::too_many_arguments)]
fn time_attn(
    tf: &loip_engine::forward::Transformer,
    aw: &AttnWeights,
    x0: &[f32],
    kv_dim: usize,
    b: u32,
    n: u64,
    cold: &mut Cold<'_>,
    reps: usize,
) -> Result<f64, RuntimeError> {
    let filler = vec![0.01f32; kv_dim];
    let mut kv = KvCache::new([0usize], kv_dim, None);
    for seq in 0..b as u64 {
        for pos in 0..n as usize {
            kv.append(seq, 0, pos, &filler, &filler)?;
        }
    }
    let batch: Vec<TokenPos> = (0..b as u64)
        .map(|seq| TokenPos {
            seq,
            pos: n as usize,
        })
        .collect();
    time_median(&x0.repeat(b as usize), cold, reps, |x| {
        tf.attention(0, aw, x, &batch, &mut kv)?;
        for seq in 0..b as u64 {
            kv.truncate(seq, n as usize);
        }
        Ok(())
    })
}

/// The median time of `reps` runs of `run` on a fresh copy of `x` (after a warm-up run),
/// the caches flushed before each. Everything `run` does is timed (for attention that
/// includes dropping the one KV row per sequence it appended).  // seconds
pub(crate) fn time_median(
    x: &[f32],
    cold: &mut Cold<'_>,
    reps: usize,
    mut run: impl FnMut(&mut [f32]) -> Result<(), RuntimeError> + Send,
) -> Result<f64, RuntimeError> {
    let mut times = Vec::new();
    for rep in 0..=reps {
        let mut xr = x.to_vec();
        cold.flush(rep as u8);
        // As the runtime runs a block: inside a stage's team of compute threads
        // (`on_pool`), the helpers already awake. Outside it every matmul would hand its
        // rows to the pool and wait to be woken, which the run does not pay.
        let dt = loip_kernels::on_pool(|| {
            wake_team();
            let t = Instant::now();
            run(&mut xr).map(|()| t.elapsed().as_secs_f64())
        })?;
        if rep > 0 {
            times.push(dt);
        }
    }
    Ok(median(times))
}

/// One empty parallel region: wakes the team's helpers (parked during the cache flush), so
/// the timed block starts with them polling, as a block that follows another in a stage does.
fn wake_team() {
    let mut w = [0u8; 64];
    let _ = loip_kernels::try_par_chunks_mut(&mut w, 1, |_, c| {
        std::hint::black_box(c);
        Ok::<(), ()>(())
    });
}

/// Times one MLP block for `b` tokens (median of `reps` runs after a warm-up).  // seconds
fn time_mlp(
    tf: &loip_engine::forward::Transformer,
    mw: &MlpWeights,
    x0: &[f32],
    b: u32,
    cold: &mut Cold<'_>,
    reps: usize,
) -> Result<f64, RuntimeError> {
    time_median(&x0.repeat(b as usize), cold, reps, |x| Ok(tf.mlp(mw, x)?))
}

/// Completes micro-batch `b`'s attention row over `contexts` from the points measured
/// (`measured`, ascending, the contexts with `b·n ≤ MAX_PROBE_ROWS`) and the b = 1 row
/// `one`: a context beyond the largest measured one, `n*`, adds `b` times what it adds at
/// b = 1, `t(b, n) = t(b, n*) + b·(t(1, n) − t(1, n*))` (each sequence attends over its own
/// cache; the projections do not depend on the context).  // seconds
pub fn complete_row(
    contexts: &[u64],
    measured: &[(u64, f64)],
    one: &[(u64, f64)],
    b: u32,
) -> Vec<(u64, f64)> {
    let at_one = |n: u64| one.iter().find(|p| p.0 == n).map(|p| p.1);
    let Some(&(top_n, top_t)) = measured.last() else {
        return Vec::new();
    };
    contexts
        .iter()
        .map(|&n| {
            if let Some(&p) = measured.iter().find(|p| p.0 == n) {
                return p;
            }
            let grow = match (at_one(n), at_one(top_n)) {
                (Some(a), Some(a_top)) if n > top_n => b as f64 * (a - a_top).max(0.0),
                _ => 0.0,
            };
            (n, top_t + grow)
        })
        .collect()
}

/// Layer 0's attention at every probe context and its MLP block, for every micro-batch size
/// of [`BATCH_GRID`] (b = 1 first), and how much slower the MLP block computes beside a load
/// ([`slowdown_under_load`]; 0 where the loader's slot does not fit the budget).
fn time_blocks(
    dir: &Path,
    m: &Manifest,
    budget: ProbeBudget,
) -> Result<(Vec<BatchProbe>, f64), RuntimeError> {
    let cfg = &m.config;
    let (attn0, mlp0) = (entry(m, SliceKind::Attn(0))?, entry(m, SliceKind::Mlp(0))?);
    // layer 0, the flush buffer and the activations of the largest micro-batch first
    let flush_len = flush_bytes(budget);
    let max_b = *BATCH_GRID.last().unwrap_or(&1) as u64;
    let acts = (cfg.hidden_size as u64)
        .saturating_add(cfg.intermediate_size as u64)
        .saturating_mul(4 * 4 * max_b);
    let fixed = attn0
        .size
        .saturating_add(mlp0.size)
        .saturating_add(flush_len as u64)
        .saturating_add(acts);
    if !budget.fits(fixed) {
        return Err(refuse("layer 0's blocks and buffers", fixed, budget));
    }
    let kv_dim = cfg.num_kv_heads.saturating_mul(cfg.head_dim);
    let max_rows = if budget.bytes == 0 {
        MAX_PROBE_ROWS
    } else {
        rows_within(budget.bytes - fixed, kv_dim)
    };
    let resident = Resident::load(dir, &[attn0.clone(), mlp0.clone()])?;
    let tf = crate::executor::transformer_of(m)?;
    let aw = AttnWeights::bind(&resident, cfg, 0)?;
    let mw = MlpWeights::bind(&resident, cfg, 0)?;
    let h = cfg.hidden_size;
    let x0: Vec<f32> = (0..h).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let kv_dim = tf.kv_dim();
    let mut cold = Cold {
        buf: vec![0u8; flush_len],
        weights: &resident,
    };
    let contexts: Vec<u64> = probe_contexts(cfg.max_position_embeddings)
        .into_iter()
        .filter(|&n| n == 1 || n <= max_rows)
        .collect();
    let mut out: Vec<BatchProbe> = Vec::new();
    for &b in &BATCH_GRID {
        let (reps, passes) = if b == 1 {
            (REPS, PASSES_B1)
        } else {
            (REPS_BATCHED, 1)
        };
        let (mut rows, mut mlps) = (Vec::new(), Vec::new());
        for _ in 0..passes {
            let mut measured = Vec::new();
            for &n in &contexts {
                if n == 1 || b as u64 * n <= max_rows {
                    measured.push((n, time_attn(&tf, &aw, &x0, kv_dim, b, n, &mut cold, reps)?));
                }
            }
            rows.push(measured);
            mlps.push(time_mlp(&tf, &mw, &x0, b, &mut cold, reps)?);
        }
        let measured = median_of_passes(&rows);
        let attn = match out.first() {
            Some(one) if b > 1 => complete_row(&contexts, &measured, &one.attn, b),
            _ => measured,
        };
        out.push(BatchProbe {
            b,
            attn,
            mlp_s: median(mlps),
        });
    }
    let slot = attn0.size.saturating_add(mlp0.size);
    let slowdown = if budget.fits(fixed.saturating_add(slot)) {
        let group = [vec![attn0, mlp0]];
        slowdown_under_load(dir, &group, &tf, &mw, &x0, &mut cold, REPS_UNDER_LOAD)?
    } else {
        0.0
    };
    Ok((out, slowdown))
}

/// Timed repetitions of the MLP block alone and beside a load ([`slowdown_under_load`]).
const REPS_UNDER_LOAD: usize = 15;

/// How much slower the MLP block (b = 1) computes while the direct loader reads `group`
/// (layer 0's slices) beside it, as a stage's next load runs beside the blocks that follow
/// its offloaded run: the median time of `reps` runs under a load over the median of `reps`
/// runs alone (interleaved, the caches flushed before each, the load started just before the
/// timed block and longer than it), less 1, at least 0. `group` is read into the loader's own
/// slot, so the budget must hold it besides the probe's blocks.  // fraction
fn slowdown_under_load(
    dir: &Path,
    group: &[Vec<SliceEntry>],
    tf: &loip_engine::forward::Transformer,
    mw: &MlpWeights,
    x0: &[f32],
    cold: &mut Cold<'_>,
    reps: usize,
) -> Result<f64, RuntimeError> {
    let mut ld = Loader::new(LoaderKind::Direct, dir, group)?;
    ld.start(0)?; // touches the slot's pages and sets the ring up
    ld.wait(0)?;
    let (mut alone, mut loaded) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        for under in [false, true] {
            let mut x = x0.to_vec();
            cold.flush(rep as u8);
            if under {
                ld.start(0)?;
            }
            let dt = loip_kernels::on_pool(|| {
                wake_team();
                let t = Instant::now();
                tf.mlp(mw, &mut x).map(|()| t.elapsed().as_secs_f64())
            });
            if under {
                ld.wait(0)?;
            }
            let dt = dt?;
            match (rep > 0, under) {
                (true, false) => alone.push(dt),
                (true, true) => loaded.push(dt),
                _ => {}
            }
        }
    }
    Ok(slowdown(&alone, &loaded))
}

/// `median(loaded) / median(alone) − 1`, at least 0 (0 without samples).  // fraction
pub fn slowdown(alone: &[f64], loaded: &[f64]) -> f64 {
    let (a, l) = (median(alone.to_vec()), median(loaded.to_vec()));
    if a > 0.0 && l.is_finite() {
        (l / a - 1.0).clamp(0.0, 10.0)
    } else {
        0.0
    }
}

/// Fits `time = bytes / β + reads · λ` to loads of `groups` (least squares over the median
/// time of each group; λ ≥ 0).
///
/// The run reuses one warm slot and one io_uring for every load, so the probe does too: one
/// untimed pass over all groups first touches the slot's pages (the first write into a fresh
/// slot page-faults on every page, tens of ms for a 70 MB MLP block, which the least-squares
/// fit would otherwise book as a per-read overhead λ) and sets the ring up. Each group is then
/// timed `reps` times and only its median enters the fit, so one slow read (another device
/// probing the same disk, a writeback flush) does not turn into a large λ.
fn loader_profile(
    kind: LoaderKind,
    dir: &Path,
    groups: &[Vec<SliceEntry>],
    reps: usize,
) -> Result<LoaderProfile, RuntimeError> {
    let mut ld = Loader::new(kind, dir, groups)?;
    for g in 0..groups.len() {
        ld.start(g)?;
        ld.wait(g)?;
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); groups.len()];
    let mut bytes = vec![0f64; groups.len()];
    for _ in 0..reps {
        for g in 0..groups.len() {
            ld.start(g)?;
            ld.wait(g)?;
            bytes[g] = ld.last.bytes as f64;
            times[g].push(ld.last.load_s.max(1e-9));
        }
    }
    let samples: Vec<(f64, f64, f64)> = groups
        .iter()
        .enumerate()
        .map(|(g, slices)| (bytes[g], slices.len() as f64, median(times[g].clone())))
        .collect();
    Ok(fit_loader(&samples))
}

/// Least-squares fit of `t = x/β + r·λ` over `(x bytes, r reads, t seconds)` samples.
pub fn fit_loader(samples: &[(f64, f64, f64)]) -> LoaderProfile {
    let (mut sxx, mut sxr, mut srr, mut sxt, mut srt) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, r, t) in samples {
        sxx += x * x;
        sxr += x * r;
        srr += r * r;
        sxt += x * t;
        srt += r * t;
    }
    let det = sxx * srr - sxr * sxr;
    if det.abs() > 1e-12 * sxx * srr {
        let inv_beta = (sxt * srr - srt * sxr) / det;
        let lambda = (sxx * srt - sxr * sxt) / det;
        if inv_beta > 0.0 && lambda >= 0.0 && inv_beta.is_finite() && lambda.is_finite() {
            return LoaderProfile {
                bandwidth: 1.0 / inv_beta,
                per_read_overhead: lambda,
            };
        }
    }
    let bytes: f64 = samples.iter().map(|s| s.0).sum();
    let secs: f64 = samples.iter().map(|s| s.2).sum();
    LoaderProfile {
        bandwidth: if secs > 0.0 { bytes / secs } else { 1e9 },
        per_read_overhead: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batched_row_beyond_the_measured_rows_grows_b_fold() {
        let contexts = [1, 256, 1024, 4096];
        let one = [(1, 1.0), (256, 2.0), (1024, 4.0), (4096, 10.0)];
        let measured = [(1, 1.5), (256, 3.0)];
        let row = complete_row(&contexts, &measured, &one, 8);
        assert_eq!(
            row,
            vec![
                (1, 1.5),
                (256, 3.0),
                (1024, 3.0 + 8.0 * 2.0),
                (4096, 3.0 + 8.0 * 8.0)
            ]
        );
        assert_eq!(complete_row(&contexts, &one, &one, 1), one.to_vec());
        assert!(complete_row(&contexts, &[], &one, 2).is_empty());
    }

    #[test]
    fn each_point_keeps_the_median_of_its_passes() {
        let rows = vec![
            vec![(1, 1.0), (256, 5.0)],
            vec![(1, 0.6), (256, 2.0)], // fast outlier
            vec![(1, 1.1), (256, 2.2)],
        ];
        assert_eq!(median_of_passes(&rows), vec![(1, 1.0), (256, 2.2)]);
        assert!(median_of_passes(&[]).is_empty());
    }

    #[test]
    fn slowdown_is_the_ratio_of_medians_less_one() {
        let alone = [1.0, 1.1, 9.0];
        let loaded = [1.5, 1.6, 1.7];
        assert!((slowdown(&alone, &loaded) - (1.6 / 1.1 - 1.0)).abs() < 1e-12);
        assert_eq!(slowdown(&loaded, &alone), 0.0); // faster under a load: none
        assert_eq!(slowdown(&[], &loaded), 0.0);
    }

    #[test]
    fn loader_fit_recovers_bandwidth_and_overhead() {
        let (beta, lambda) = (2e9, 1e-4);
        let s: Vec<_> = [(1e6, 1.0), (3e6, 1.0), (4e6, 2.0)]
            .iter()
            .map(|&(x, r)| (x, r, x / beta + r * lambda))
            .collect();
        let p = fit_loader(&s);
        assert!(
            (p.bandwidth / beta - 1.0).abs() < 1e-6 && (p.per_read_overhead - lambda).abs() < 1e-9,
            "{p:?}"
        );
    }
}
