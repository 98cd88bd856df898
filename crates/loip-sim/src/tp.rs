//! Tensor-parallel baselines: Galaxy and TPI-LLM (design §9). The planner crate has no TP
//! planners, so their placements are built here.
//!
//! **Sharding.** Every layer is split over all devices by speed (layers per second at one
//! token): device `i` gets a fraction `f_i` of the attention heads, of the MLP columns and of
//! the KV cache. Fractions are continuous; a real split rounds to whole KV-head groups (8 for
//! the GQA models), which would only make TP slower. The first device also holds the
//! embedding and the LM head, runs the head and broadcasts the next input.
//!
//! **Synchronisation.** Each layer syncs twice (after attention, after MLP):
//! - Galaxy: ring reduce-scatter + all-gather, `2(N−1)` hops of `T·h/N` bytes;
//! - TPI-LLM: star all-reduce through device 1, gather (`T·h` per worker, in parallel) then
//!   broadcast (`(N−1)·T·h` on device 1's port), 2 hops;
//!
//! with `T` the tokens in the batch (`b` sequences × (1 + recomputed)). A sync starts when the
//! slowest shard is done. Galaxy's overlap of communication with compute is not modelled.
//!
//! **Memory.** Galaxy needs every shard resident (fractions capped by memory, water-filled).
//! TPI-LLM runs its paper's sliding-window scheduler: each device keeps a window of `W` layer
//! shards in memory, `W` = what its budget holds after the KV cache, the embedding/head and
//! the working buffers ([`tpi_window`]). `W − s` shards stay resident and the other `L − W +
//! s` stream from SSD through `s` sliding slots (`s` = the configured window, 2: the next
//! layer loads while the current one computes; 1 when only one fits, and then loads do not
//! overlap compute), with the conventional loader (TPI-LLM has no O_DIRECT slot path): the
//! load of a streamed layer waits for the slot of the layer `s` before it, so a token takes
//! about `max(compute, load of the streamed shards)`. As the KV cache grows the window shrinks
//! (more shards stream) instead of evicting KV; only when not even a one-layer window fits
//! beside the KV does TPI-LLM evict and recompute (every device runs the evicted tokens again,
//! from the embedding), and it is OOM when that holds for the prompt's KV. `tpi-llm-offload`
//! is now the same model (kept so that tables keep their columns). Galaxy evicts and
//! recomputes on KV overflow.

use crate::compute::DeviceModel;
use crate::engine::{Engine, TaskId, Work};
use crate::error::SimError;
use crate::sim::{AdaptEvent, DeviceReport, SimConfig, SimReport, Status};
use loip_plan::{Cluster, LoaderKind, ModelShape};
use serde::{Deserialize, Serialize};

/// Which tensor-parallel system.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TpKind {
    /// Galaxy: all shards resident, ring collectives.
    Galaxy,
    /// TPI-LLM: sliding window from disk that shrinks as the KV cache grows, star
    /// all-reduce.
    TpiLlm,
    /// The same model as [`TpKind::TpiLlm`] (the window already streams more layers instead
    /// of recomputing); kept for the tables' columns.
    TpiLlmOffload,
}

/// A tensor-parallel placement over all cluster devices (in cluster order).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TpPlacement {
    /// System.
    pub kind: TpKind,
    /// Fraction of every layer on each device; sums to 1.
    pub frac: Vec<f64>,
    /// Layer shards kept resident on each device (the rest are streamed).
    pub resident: Vec<u32>,
    /// Sliding slots of streamed layer shards on each device (0: nothing streams); the
    /// device's window is `resident + slots`.
    pub slots: Vec<u32>,
    /// Sliding slots asked for (TPI-LLM's prefetch depth).
    pub window: u32,
    /// KV tokens (all sequences) the placement was sized for.  // tokens
    pub planned_tokens: u64,
}

/// Memory of device `i` holding fraction `f`, `r` resident layer shards.  // bytes
fn tp_mem(shape: &ModelShape, i: usize, f: f64, r: u32, window: u32, tokens: u64, b: u32) -> u64 {
    let l = shape.layers;
    let layer = f * shape.layer_bytes() as f64;
    let held = if r >= l { l } else { r + window };
    let fixed = if i == 0 {
        shape.embed_bytes + shape.head_bytes_on(true)
    } else {
        0
    };
    let kv = f * shape.kv_bytes(l as u64, tokens) as f64;
    (layer * held as f64 + kv) as u64 + fixed + shape.working_bytes(b)
}

/// TPI-LLM's window on device `i` at `tokens` KV tokens: `(resident, slots)`, the shards that
/// stay and the sliding slots the others stream through — `slots` = `window` when that fits,
/// else 1; `(L, 0)` when the whole slice fits. `None`: not even a one-layer window fits
/// beside the KV.
pub fn tpi_window(
    shape: &ModelShape,
    i: usize,
    f: f64,
    window: u32,
    tokens: u64,
    b: u32,
    budget: u64,
) -> Option<(u32, u32)> {
    let l = shape.layers;
    let fits = |r: u32, w: u32| tp_mem(shape, i, f, r, w, tokens, b) <= budget;
    if fits(l, 0) {
        return Some((l, 0));
    }
    // The most resident shards beside `w` sliding slots (resident + slots < L here, since
    // the whole slice does not fit).
    [window.max(1), 1]
        .into_iter()
        .find_map(|w| (0..l).rev().find(|&r| fits(r, w)).map(|r| (r, w)))
}

/// Largest fraction of every layer each device can hold resident with `tokens` KV tokens
/// (its share of them), the embedding and head on the first.
fn shard_caps(shape: &ModelShape, budgets: &[u64], tokens: u64, b: u32) -> Vec<f64> {
    let l = shape.layers;
    (0..budgets.len())
        .map(|i| {
            let fixed = tp_mem(shape, i, 0.0, l, 0, tokens, b);
            let per_frac = tp_mem(shape, i, 1.0, l, 0, tokens, b) - fixed;
            budgets[i].saturating_sub(fixed) as f64 / per_frac.max(1) as f64
        })
        .collect()
}

/// Water-fills `speed`-proportional fractions under per-device caps; `None` if the caps sum
/// below 1.
fn water_fill(speed: &[f64], cap: &[f64]) -> Option<Vec<f64>> {
    if cap.iter().sum::<f64>() < 1.0 - 1e-12 {
        return None;
    }
    let n = speed.len();
    let mut f = vec![0.0; n];
    let mut fixed = vec![false; n];
    loop {
        let left = 1.0 - (0..n).filter(|&i| fixed[i]).map(|i| f[i]).sum::<f64>();
        let sp: f64 = (0..n).filter(|&i| !fixed[i]).map(|i| speed[i]).sum();
        let mut changed = false;
        let free: Vec<usize> = (0..n).filter(|&i| !fixed[i]).collect();
        for i in free {
            f[i] = left * speed[i] / sp;
            if f[i] > cap[i] {
                f[i] = cap[i];
                fixed[i] = true;
                changed = true;
            }
        }
        if !changed {
            return Some(f);
        }
    }
}

/// Builds the placement of `kind`: sized for `full_tokens` KV tokens when that fits, else
/// for `prompt_tokens` (KV growth then handled at run time). `Err` says why it is OOM.
pub fn place_tp(
    kind: TpKind,
    shape: &ModelShape,
    cluster: &Cluster,
    b: u32,
    prompt_tokens: u64,
    full_tokens: u64,
    window: u32,
) -> Result<TpPlacement, String> {
    let nd = cluster.devices.len();
    let n_ctx = prompt_tokens / b.max(1) as u64;
    let speed: Vec<f64> = cluster
        .devices
        .iter()
        .map(|d| DeviceModel::new(&d.profile, shape).speed(n_ctx))
        .collect();
    let budgets: Vec<u64> = cluster.devices.iter().map(|d| d.budget()).collect();
    match kind {
        TpKind::Galaxy => {
            for tokens in [full_tokens, prompt_tokens] {
                let cap = shard_caps(shape, &budgets, tokens, b);
                if let Some(frac) = water_fill(&speed, &cap) {
                    let frac: Vec<f64> = frac.iter().zip(&cap).map(|(f, c)| f.min(*c)).collect();
                    return Ok(TpPlacement {
                        kind,
                        frac,
                        resident: vec![shape.layers; nd],
                        slots: vec![0; nd],
                        window: 0,
                        planned_tokens: tokens,
                    });
                }
            }
            let need = shape.total_bytes() as f64 / 1e9;
            Err(format!("all shards must be resident: {need:.1} GB of weights do not fit the devices' budgets"))
        }
        TpKind::TpiLlm | TpKind::TpiLlmOffload => {
            // TPI-LLM's split: by speed, each device's share capped by what it can keep
            // resident (the sliding window then never streams) when the weights fit in
            // total; otherwise by memory, so that every device streams the same share of its
            // slice through the window.
            let cap = shard_caps(shape, &budgets, prompt_tokens, b);
            let frac = water_fill(&speed, &cap).unwrap_or_else(|| {
                let total: f64 = cap.iter().map(|c| c.max(0.0)).sum();
                if total > 0.0 {
                    cap.iter().map(|c| c.max(0.0) / total).collect()
                } else {
                    vec![1.0 / nd as f64; nd]
                }
            });
            let fits_full = (0..nd)
                .all(|i| tp_mem(shape, i, frac[i], shape.layers, 0, full_tokens, b) <= budgets[i]);
            let tokens = if fits_full {
                full_tokens
            } else {
                prompt_tokens
            };
            let mut resident = Vec::with_capacity(nd);
            let mut slots = Vec::with_capacity(nd);
            for i in 0..nd {
                match tpi_window(shape, i, frac[i], window, tokens, b, budgets[i]) {
                    Some((r, s)) => {
                        resident.push(r);
                        slots.push(s);
                    }
                    None => {
                        return Err(format!(
                            "device `{}` cannot hold a one-layer window beside the prompt's KV (+ embedding/head on the first)",
                            cluster.devices[i].name
                        ))
                    }
                }
            }
            Ok(TpPlacement {
                kind,
                frac,
                resident,
                slots,
                window,
                planned_tokens: tokens,
            })
        }
    }
}

/// Simulates a tensor-parallel placement.
pub fn simulate_tp(
    place: &TpPlacement,
    shape: &ModelShape,
    cluster: &Cluster,
    cfg: &SimConfig,
) -> Result<SimReport, SimError> {
    let nd = cluster.devices.len();
    if place.frac.len() != nd || place.resident.len() != nd || place.slots.len() != nd {
        return Err(SimError::Invalid {
            field: "placement",
            reason: "one fraction per cluster device".into(),
        });
    }
    let b = cfg.sequences.max(1);
    let steps = cfg.output_tokens.max(1);
    let l = shape.layers;
    let models: Vec<DeviceModel> = cluster
        .devices
        .iter()
        .map(|d| DeviceModel::new(&d.profile, shape))
        .collect();
    let loader_kind = LoaderKind::Conventional;
    // A collective finishes when its slowest participant's library call does.  // seconds
    let collective_latency = cluster
        .devices
        .iter()
        .map(|d| d.profile.collective_latency)
        .fold(0.0, f64::max);
    let budgets: Vec<u64> = cluster.devices.iter().map(|d| d.budget()).collect();
    let mut eng = Engine::new(cfg.bandwidth.at(0), cfg.latency);
    let comp: Vec<_> = (0..nd).map(|_| eng.resource()).collect();
    let loaders: Vec<_> = (0..nd).map(|_| eng.resource()).collect();
    let mut resident = place.resident.clone();
    let mut slots = place.slots.clone();
    let mut evict = 0u32;
    let mut events = Vec::new();
    let mut peak = vec![0u64; nd];
    // Per device: mlp tasks of streamed layers, in stream order (window release).
    let mut released: Vec<std::collections::VecDeque<TaskId>> = vec![Default::default(); nd];
    let mut input: Option<TaskId> = None;
    let mut ends = Vec::with_capacity(steps as usize);
    let h = shape.act_bytes_per_token as f64;
    let limit = cfg.oot_limit_ms();
    let mut report = SimReport::oom(String::new());
    report.status = Status::Ok;
    report.note = None;
    let mut emitted = 0u32;
    let mut emit = |t: u32,
                    eng: &mut Engine,
                    resident: &mut Vec<u32>,
                    slots: &mut Vec<u32>,
                    evict: &mut u32,
                    input: &mut Option<TaskId>|
     -> TaskId {
        let tokens = b as u64 * (cfg.prompt_tokens as u64 + t as u64 + 1);
        // KV growth: TPI-LLM's window shrinks (more shards stream); evict and recompute
        // only when not even a one-layer window fits (Galaxy: always).
        if place.kind != TpKind::Galaxy {
            for i in 0..nd {
                let tok_held = tokens.saturating_sub(b as u64 * *evict as u64);
                let (r, s) = tpi_window(
                    shape,
                    i,
                    place.frac[i],
                    place.window,
                    tok_held,
                    b,
                    budgets[i],
                )
                .unwrap_or((0, 1));
                // The window only shrinks: it never takes back memory the KV was given.
                if r < resident[i] || (r == resident[i] && s < slots[i]) {
                    resident[i] = r;
                    slots[i] = s;
                }
            }
        }
        let mut e = *evict;
        for i in 0..nd {
            let w = slots[i];
            let m = tp_mem(
                shape,
                i,
                place.frac[i],
                resident[i],
                w,
                tokens.saturating_sub(b as u64 * e as u64),
                b,
            );
            if m > budgets[i] {
                let per_tok =
                    (place.frac[i] * (shape.kv_bytes_per_token * l as u64) as f64).max(1.0);
                let more =
                    (((m - budgets[i]) as f64 / per_tok).ceil() as u64).div_ceil(b as u64) as u32;
                e += more;
            }
        }
        if e != *evict {
            *evict = e;
            events.push(AdaptEvent::Evict { step: t, tokens: e });
        }
        for i in 0..nd {
            let w = slots[i];
            let m = tp_mem(
                shape,
                i,
                place.frac[i],
                resident[i],
                w,
                tokens.saturating_sub(b as u64 * *evict as u64),
                b,
            );
            peak[i] = peak[i].max(m);
        }
        let tok = (b * (1 + *evict)) as f64;
        let n_ctx = cfg.prompt_tokens as u64 + t as u64 + 1;
        let sync = |eng: &mut Engine, deps: &[TaskId]| -> TaskId {
            if nd == 1 {
                return eng.task(None, Work::Secs(0.0), deps);
            }
            let n = nd as f64;
            // Galaxy: a reduce-scatter and an all-gather; TPI-LLM: one all-reduce.
            let (work, calls) = match place.kind {
                TpKind::Galaxy => (
                    Work::Collective {
                        bytes: 2.0 * (n - 1.0) / n * tok * h,
                        hops: 2.0 * (n - 1.0),
                    },
                    2.0,
                ),
                _ => (
                    Work::Collective {
                        bytes: n * tok * h,
                        hops: 2.0,
                    },
                    1.0,
                ),
            };
            let wire = eng.task(None, work, deps);
            if collective_latency > 0.0 {
                eng.task(None, Work::Secs(calls * collective_latency), &[wire])
            } else {
                wire
            }
        };
        let mut prev = *input;
        for layer in 0..l {
            let mut loads = vec![None; nd];
            for i in 0..nd {
                if layer >= resident[i] {
                    let q = released[i].len();
                    let w = slots[i].max(1) as usize;
                    let deps: Vec<TaskId> = if q >= w {
                        vec![released[i][q - w]]
                    } else {
                        Vec::new()
                    };
                    let bytes = (place.frac[i] * shape.layer_bytes() as f64) as u64;
                    let secs = cluster.devices[i]
                        .profile
                        .loader(loader_kind)
                        .load_time(bytes, 2);
                    loads[i] = Some(eng.task(Some(loaders[i]), Work::Secs(secs), &deps));
                }
            }
            let attn: Vec<TaskId> = (0..nd)
                .map(|i| {
                    let deps: Vec<TaskId> = prev.into_iter().chain(loads[i]).collect();
                    // The framework's fixed cost of a forward pass, once per token.
                    let fw = if layer == 0 { cfg.pass_overhead_s } else { 0.0 };
                    let secs = models[i].attn(b, 1 + *evict, n_ctx, place.frac[i]) + fw;
                    eng.task(Some(comp[i]), Work::Secs(secs), &deps)
                })
                .collect();
            let sa = sync(eng, &attn);
            let mlp: Vec<TaskId> = (0..nd)
                .map(|i| {
                    let secs = models[i].mlp(tok as u32, place.frac[i]);
                    let t = eng.task(Some(comp[i]), Work::Secs(secs), &[sa]);
                    if loads[i].is_some() {
                        released[i].push_back(t);
                        if released[i].len() > 64 {
                            released[i].pop_front();
                            released[i].shrink_to(64);
                        }
                    }
                    t
                })
                .collect();
            prev = Some(sync(eng, &mlp));
        }
        let head = eng.task(
            Some(comp[0]),
            Work::Secs(models[0].head(b)),
            &prev.into_iter().collect::<Vec<_>>(),
        );
        let bcast = if nd > 1 {
            let wire = eng.task(
                None,
                Work::Collective {
                    bytes: (nd - 1) as f64 * b as f64 * h,
                    hops: 1.0,
                },
                &[head],
            );
            eng.task(None, Work::Secs(collective_latency), &[wire])
        } else {
            head
        };
        *input = Some(bcast);
        bcast
    };
    for t in 0..steps.min(2) {
        ends.push(emit(
            t,
            &mut eng,
            &mut resident,
            &mut slots,
            &mut evict,
            &mut input,
        ));
        emitted += 1;
    }
    for t in 0..steps {
        let end = eng.run_until(ends[t as usize])?;
        report.step_end_s.push(end);
        eng.set_bandwidth(cfg.bandwidth.at(t + 1));
        let mean_ms = end * 1e3 / ((t + 1) as f64 * b as f64);
        if cfg.stop_when_oot && t >= 7 && mean_ms > 1.2 * limit {
            break;
        }
        if emitted < steps {
            ends.push(emit(
                emitted,
                &mut eng,
                &mut resident,
                &mut slots,
                &mut evict,
                &mut input,
            ));
            emitted += 1;
        }
    }
    report.finish(b, limit, steps);
    report.events = events;
    report.devices = (0..nd)
        .map(|i| DeviceReport {
            name: cluster.devices[i].name.clone(),
            budget: budgets[i],
            peak_memory: peak[i],
            first_threshold: None,
            compute_s: eng.busy(comp[i]),
            load_s: eng.busy(loaders[i]),
            bytes_sent: 0.0,
        })
        .collect();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bandwidth::BandwidthTrace;
    use loip_plan::Pattern;

    fn cluster(presets: &[&str]) -> Cluster {
        crate::testkit::preset_cluster(presets)
    }

    #[test]
    fn water_fill_respects_caps() {
        let f = water_fill(&[1.0, 1.0, 2.0], &[0.2, 1.0, 1.0]).unwrap();
        assert!((f.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        assert!((f[0] - 0.2).abs() < 1e-12 && (f[2] - 2.0 * f[1]).abs() < 1e-12);
        assert!(water_fill(&[1.0, 1.0], &[0.3, 0.3]).is_none());
    }

    #[test]
    fn galaxy_needs_every_shard_in_memory() {
        let sh = crate::shapes::shape("llama3.3-70b").unwrap();
        let ok = place_tp(
            TpKind::Galaxy,
            &sh,
            &cluster(&["orin64", "orin64", "orin32", "nx16"]),
            1,
            512,
            1024,
            2,
        )
        .unwrap();
        assert!((ok.frac.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(place_tp(
            TpKind::Galaxy,
            &sh,
            &cluster(&["orin32", "nx16"]),
            1,
            512,
            1024,
            2
        )
        .is_err());
        // TPI-LLM streams what does not fit instead.
        let tpi = place_tp(
            TpKind::TpiLlm,
            &sh,
            &cluster(&["orin32", "nx16"]),
            1,
            512,
            1024,
            2,
        )
        .unwrap();
        assert!(tpi.resident.iter().all(|&r| r < sh.layers));
    }

    /// One device whose budget holds a third of its slice (plus the KV of `tokens`, the
    /// embedding/head and the working buffers), and a config of `steps` tokens.
    fn third_of_slice(tokens: u64, steps: u32) -> (ModelShape, Cluster, SimConfig) {
        let sh = crate::shapes::shape("llama2-13b").unwrap();
        let mut c = cluster(&["orin32"]);
        let l = sh.layers as u64;
        let budget = tp_mem(&sh, 0, 1.0, 0, 0, tokens, 1) + l / 3 * sh.layer_bytes();
        c.devices[0].reserve = c.devices[0].profile.mem_budget - budget;
        let mut cfg = SimConfig::new(Pattern::Sporadic, 1, BandwidthTrace::constant(12.5e6), 2e-3);
        cfg.prompt_tokens = 64;
        cfg.output_tokens = steps;
        (sh, c, cfg)
    }

    #[test]
    fn tpi_window_overlaps_loads_with_compute() {
        let (sh, c, cfg) = third_of_slice(64 + 9, 8);
        let l = sh.layers;
        let p = place_tp(TpKind::TpiLlm, &sh, &c, 1, 64, 64, 2).unwrap();
        // The window is the third of the slice: L/3 − 2 resident, 2 sliding slots.
        assert_eq!((p.resident[0], p.slots[0]), (l / 3 - 2, 2));
        // Per layer: a resident shard costs its compute, a streamed one the larger of its
        // compute and its load (the next slot loads while the current layer computes).
        let per_token = |c: &Cluster| {
            let m = DeviceModel::new(&c.devices[0].profile, &sh);
            let n = cfg.prompt_tokens as u64 + cfg.output_tokens as u64 / 2;
            let layer = m.attn(1, 1, n, 1.0) + m.mlp(1, 1.0);
            let load = c.devices[0]
                .profile
                .loader(LoaderKind::Conventional)
                .load_time(sh.layer_bytes(), 2);
            let r = p.resident[0] as f64;
            let secs = r * layer + (l as f64 - r) * layer.max(load) + m.head(1);
            (secs, load > layer)
        };
        // Disk-bound (the preset's SSD), then compute-bound (a 100× faster disk).
        let mut fast = c.clone();
        let conv = &mut fast.devices[0].profile.loader.conventional;
        conv.bandwidth *= 100.0;
        conv.per_read_overhead /= 100.0;
        for (c, disk_bound) in [(&c, true), (&fast, false)] {
            let (want, got_disk_bound) = per_token(c);
            assert_eq!(got_disk_bound, disk_bound);
            let got = simulate_tp(&p, &sh, c, &cfg).unwrap();
            assert!(got.events.is_empty(), "{:?}", got.events);
            let want = want * 1e3;
            assert!(
                (got.ms_per_token / want - 1.0).abs() < 0.03,
                "{} ms vs {want} ms",
                got.ms_per_token
            );
        }
    }

    #[test]
    fn tpi_window_shrinks_as_the_kv_cache_grows() {
        let (sh, c, mut cfg) = third_of_slice(64, 0);
        let budget = c.devices[0].budget();
        let (r0, s0) = tpi_window(&sh, 0, 1.0, 2, 64, 1, budget).unwrap();
        // A layer's worth of KV more: one shard fewer in the window.
        let per_layer = sh.layer_bytes() / sh.kv_bytes(sh.layers as u64, 1);
        let (r1, s1) = tpi_window(&sh, 0, 1.0, 2, 64 + per_layer, 1, budget).unwrap();
        assert_eq!((r1, s1), (r0 - 1, s0));
        // Only two shards' room left: both slide, then one, then nothing fits.
        let kv_for = |shards: u64| {
            let free = budget - tp_mem(&sh, 0, 1.0, 0, 0, 0, 1) - shards * sh.layer_bytes();
            free / sh.kv_bytes(sh.layers as u64, 1)
        };
        assert_eq!(
            tpi_window(&sh, 0, 1.0, 2, kv_for(2), 1, budget),
            Some((0, 2))
        );
        assert_eq!(
            tpi_window(&sh, 0, 1.0, 2, kv_for(1), 1, budget),
            Some((0, 1))
        );
        assert_eq!(tpi_window(&sh, 0, 1.0, 2, kv_for(0) + 1, 1, budget), None);
        // In a run the KV grows by three layers' worth: the window shrinks, nothing is
        // evicted, memory stays within the budget and more is loaded per token.
        cfg.output_tokens = (3 * per_layer + 8) as u32;
        cfg.stop_when_oot = false;
        let p = place_tp(TpKind::TpiLlm, &sh, &c, 1, 64, 64, 2).unwrap();
        let got = simulate_tp(&p, &sh, &c, &cfg).unwrap();
        assert!(got.events.is_empty(), "{:?}", got.events);
        assert!(got.devices[0].peak_memory <= budget);
        let ld = c.devices[0]
            .profile
            .loader(LoaderKind::Conventional)
            .load_time(sh.layer_bytes(), 2);
        let at_start = (sh.layers - p.resident[0]) as f64 * ld * cfg.output_tokens as f64;
        assert!(
            got.devices[0].load_s > at_start + 2.0 * ld,
            "{}",
            got.devices[0].load_s
        );
    }

    #[test]
    fn tpi_llm_is_oom_only_without_a_one_layer_window() {
        let (sh, mut c, mut cfg) = third_of_slice(64, 4);
        let fixed = tp_mem(&sh, 0, 1.0, 0, 0, 64 + 5, 1);
        c.devices[0].reserve = c.devices[0].profile.mem_budget - fixed - sh.layer_bytes();
        let p = place_tp(TpKind::TpiLlm, &sh, &c, 1, 64, 64, 2).unwrap();
        assert_eq!((p.resident[0], p.slots[0]), (0, 1));
        // One slot: every layer loads after the previous one computed, nothing overlaps.
        let m = DeviceModel::new(&c.devices[0].profile, &sh);
        let layer = m.attn(1, 1, 66, 1.0) + m.mlp(1, 1.0);
        let load = c.devices[0]
            .profile
            .loader(LoaderKind::Conventional)
            .load_time(sh.layer_bytes(), 2);
        let want = (sh.layers as f64 * (layer + load) + m.head(1)) * 1e3;
        cfg.stop_when_oot = false;
        let got = simulate_tp(&p, &sh, &c, &cfg).unwrap();
        assert!(got.events.is_empty(), "{:?}", got.events);
        assert!(
            (got.ms_per_token / want - 1.0).abs() < 0.03,
            "{} vs {want}",
            got.ms_per_token
        );
        // A byte less than one shard beside the prompt's KV: OOM.
        let prompt_only = tp_mem(&sh, 0, 1.0, 0, 0, 64, 1) + sh.layer_bytes() - 1;
        c.devices[0].reserve = c.devices[0].profile.mem_budget - prompt_only;
        assert!(place_tp(TpKind::TpiLlm, &sh, &c, 1, 64, 64, 2).is_err());
    }

    #[test]
    fn ring_is_cheaper_in_bytes_star_in_hops() {
        let sh = crate::shapes::shape("llama2-13b").unwrap();
        let mut c = cluster(&["orin64", "orin64", "orin64", "orin64"]);
        // Link latency only: the collectives' software latency is checked elsewhere.
        for d in &mut c.devices {
            d.profile.collective_latency = 0.0;
        }
        let run = |kind, latency: f64| {
            let p = place_tp(kind, &sh, &c, 1, 256, 300, 2).unwrap();
            let mut cfg = SimConfig::new(
                Pattern::Sporadic,
                1,
                BandwidthTrace::constant(12.5e6),
                latency,
            );
            cfg.prompt_tokens = 256;
            cfg.output_tokens = 4;
            simulate_tp(&p, &sh, &c, &cfg).unwrap().ms_per_token
        };
        // Without latency the ring moves fewer bytes; with 5 ms per hop the star's 2 hops win.
        assert!(run(TpKind::Galaxy, 0.0) < run(TpKind::TpiLlm, 0.0));
        assert!(run(TpKind::Galaxy, 5e-3) > run(TpKind::TpiLlm, 5e-3));
    }
}
