//! A quick measurement of one device (about a second): attention and MLP block times of
//! the real model's layer 0 at a few context lengths, and both loaders' read bandwidth and
//! per-read overhead on the same slices. The coordinator turns the result into a measured
//! [`loip_plan::DeviceProfile`] for the planner (design §7: t^A(1, n), t^P(1), β, λ).
//!
//! Attention at context `n` is timed with `n` placeholder KV rows appended directly to the
//! cache (the time does not depend on their values), so no prefill is computed. Before each
//! timed run the CPU caches are flushed by writing a buffer larger than the last-level
//! cache: in a real decoding step every block's weights come from memory, not from a cache
//! warmed by the previous repetition (small models' blocks fit in L2/L3 otherwise).

use std::path::Path;
use std::time::Instant;

use loip_engine::{AttnWeights, KvCache, MlpWeights, TokenPos};
use loip_model::slice::{Manifest, SliceEntry, SliceKind};
use loip_plan::LoaderProfile;

use crate::loader::{Loader, LoaderKind};
use crate::resident::Resident;
use crate::wire::ProbeResult;
use crate::RuntimeError;

/// Timed repetitions per point (the median is kept).
const REPS: usize = 9;
/// Bytes written between repetitions to evict the weights from the CPU caches.
const FLUSH_BYTES: usize = 96 << 20;

/// Evicts the caches by writing every line of `buf`.
fn flush(buf: &mut [u8], round: u8) {
    for i in (0..buf.len()).step_by(64) {
        buf[i] = buf[i].wrapping_add(round);
    }
    std::hint::black_box(&buf);
}

fn entry(m: &Manifest, k: SliceKind) -> Result<SliceEntry, RuntimeError> {
    m.slice(k)
        .cloned()
        .ok_or_else(|| RuntimeError::Invalid(format!("slice {} is not in the manifest", k.id())))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Contexts at which attention is timed for a model of `max_pos` positions.  // tokens
pub fn probe_contexts(max_pos: usize) -> Vec<u64> {
    [1u64, 256, 1024, 4096]
        .into_iter()
        .filter(|&n| (n as usize) < max_pos)
        .collect()
}

/// Measures layer 0's blocks (`compute`) and both loaders (`loads`) from the slices in
/// `dir`; parts not measured are left at zero.
pub fn probe(
    dir: &Path,
    m: &Manifest,
    compute: bool,
    loads: bool,
) -> Result<ProbeResult, RuntimeError> {
    let t0 = Instant::now();
    let zero = LoaderProfile {
        bandwidth: 0.0,
        per_read_overhead: 0.0,
    };
    let (attn, mlp_s) = if compute {
        time_blocks(dir, m)?
    } else {
        (Vec::new(), 0.0)
    };
    let (direct, conventional) = if loads {
        let (attn0, mlp0) = (entry(m, SliceKind::Attn(0))?, entry(m, SliceKind::Mlp(0))?);
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
    })
}

/// `(context, seconds)` of attention and the seconds of the MLP block, layer 0.
fn time_blocks(dir: &Path, m: &Manifest) -> Result<(Vec<(u64, f64)>, f64), RuntimeError> {
    let cfg = &m.config;
    let (attn0, mlp0) = (entry(m, SliceKind::Attn(0))?, entry(m, SliceKind::Mlp(0))?);
    let resident = Resident::load(dir, &[attn0, mlp0])?;
    let tf = crate::executor::transformer_of(m)?;
    let aw = AttnWeights::bind(&resident, cfg, 0)?;
    let mw = MlpWeights::bind(&resident, cfg, 0)?;
    let h = cfg.hidden_size;
    let x0: Vec<f32> = (0..h).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let kv_dim = tf.kv_dim();
    let filler = vec![0.01f32; kv_dim];
    let mut cold = vec![0u8; FLUSH_BYTES];
    let mut attn = Vec::new();
    for n in probe_contexts(cfg.max_position_embeddings) {
        let mut kv = KvCache::new([0usize], kv_dim, None);
        for pos in 0..n as usize {
            kv.append(0, 0, pos, &filler, &filler)?;
        }
        let batch = [TokenPos {
            seq: 0,
            pos: n as usize,
        }];
        let mut times = Vec::new();
        for rep in 0..=REPS {
            let mut x = x0.clone();
            flush(&mut cold, rep as u8);
            let t = Instant::now();
            tf.attention(0, &aw, &mut x, &batch, &mut kv)?;
            if rep > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
            kv.truncate(0, n as usize);
        }
        attn.push((n, median(times)));
    }
    let mut times = Vec::new();
    for rep in 0..=REPS {
        let mut x = x0.clone();
        flush(&mut cold, rep as u8);
        let t = Instant::now();
        tf.mlp(&mw, &mut x)?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let mlp_s = median(times);
    Ok((attn, mlp_s))
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
