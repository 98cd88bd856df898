//! Device and link profiles: what the cost model knows about one machine and the network.
//!
//! A device profile is a JSON document (schema below). Its compute part is either
//! **measured** (grids of attention time `t^A(b, n)` and MLP time `t^P(b)` taken by
//! `loip profile` for one model shape, interpolated between grid points) or a **roofline**
//! model for hardware we lack, derived from public specifications:
//!
//! ```text
//! t^A(b, n) = max((A + b·n·κ) / mem_bw, b·(F_proj + 4·q_dim·n) / peak_flops) / efficiency + overhead
//! t^P(b)    = max(P / mem_bw,           b·6·hidden·intermediate / peak_flops) / efficiency + overhead
//! ```
//!
//! (`A`, `P`, `κ` from [`ModelShape`]; `F_proj` = 2 FLOPs per projection weight; `overhead` is
//! the per-block kernel-launch cost.) Decoding with small `b` is memory-bound, so `mem_bw`
//! and `efficiency` dominate.
//!
//! The final norm + LM head (`H` bytes, one `vocab × hidden` matvec per token) runs once per
//! token on the last device; [`DeviceProfile::head_time`] prices it:
//!
//! ```text
//! roofline:  t^H(b) = max(H / mem_bw, b·2·vocab·hidden / peak_flops) / efficiency + overhead
//! measured:  t^H(b) = head grid at b · H'/H_measured      when the profile measured the head
//!            t^H(b) = t^P(b) · H / P                      otherwise (memory-bound scaling)
//! ```
//!
//! (A 70B head is 2.1 GB: 59 ms per token on a Xavier NX.) The embedding lookup reads one
//! row of `hidden` weights per token (16 KB for a 70B) and is left out as negligible.
//!
//! ```json
//! {
//!   "name": "jetson-agx-orin-64gb",
//!   "mem_budget": 65498251264,                       // bytes the engine may use
//!   "compute": { "kind": "roofline",
//!                "mem_bw": 204.8e9,                   // bytes/s
//!                "peak_flops": 42.5e12,               // FLOP/s (FP16 dense)
//!                "efficiency": 0.65,                  // achieved fraction of the roofline
//!                "block_overhead": 30e-6 },           // seconds per block
//!   // or { "kind": "measured", "model": "llama-1b", "attn_bytes": .., "mlp_bytes": ..,
//!   //      "attn": { "b": [1, 2], "n": [128, 1024], "seconds": [[..], [..]] },  // seconds[b][n]
//!   //      "mlp":  { "b": [1, 2], "seconds": [.., ..] },
//!   //      "head": { "bytes": .., "b": [1, 2], "seconds": [.., ..] } }   // optional
//!   "loader": { "direct":       { "bandwidth": 2.0e9, "per_read_overhead": 1e-4 },   // B/s, s
//!               "conventional": { "bandwidth": 1.0e9, "per_read_overhead": 1e-3 } },
//!   "sources": ["..."]
//! }
//! ```
//!
//! A measured profile used for another shape is scaled by the ratio of block bytes
//! (`A'/A`, `P'/P`): an approximation that holds while decoding is memory-bound.
//!
//! `loip profile` measures the grids at b = 1, 2, 4, 8; between grid points the time is
//! interpolated linearly, beyond the last one extrapolated from the last segment. A profile
//! written before the b grid holds b = 1 only: its times are taken for every `b` (flat in
//! `b`, the memory-bound assumption the cost model made before).

use crate::error::ConfigError;
use crate::shape::ModelShape;
use serde::{Deserialize, Serialize};

/// SSD → slot read performance of one loader.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LoaderProfile {
    /// Sustained read bandwidth `β`.  // bytes/s
    pub bandwidth: f64,
    /// Fixed cost per block read `λ` (submission, header parse, allocation).  // seconds
    pub per_read_overhead: f64,
}

impl LoaderProfile {
    /// Time to read `reads` blocks totalling `bytes`.  // seconds
    pub fn load_time(&self, bytes: u64, reads: u32) -> f64 {
        if reads == 0 {
            return 0.0;
        }
        bytes as f64 / self.bandwidth + self.per_read_overhead * reads as f64
    }
}

/// Which loading path a plan uses (design §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoaderKind {
    /// O_DIRECT + io_uring into the slot, no copies.
    #[default]
    Direct,
    /// Read file → parse → allocate → copy (ablation baseline).
    Conventional,
}

/// Both loaders of a device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Loaders {
    /// The optimized path.
    pub direct: LoaderProfile,
    /// The conventional path.
    pub conventional: LoaderProfile,
}

/// Attention time grid `seconds[i][j] = t^A(b[i], n[j])`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttnGrid {
    /// Micro-batch sizes, strictly increasing.
    pub b: Vec<u32>,
    /// Context lengths (tokens), strictly increasing.
    pub n: Vec<u64>,
    /// Seconds, `b.len()` rows of `n.len()` values.  // seconds
    pub seconds: Vec<Vec<f64>>,
}

/// MLP time grid `seconds[i] = t^P(b[i])`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MlpGrid {
    /// Micro-batch sizes, strictly increasing.
    pub b: Vec<u32>,
    /// Seconds per block.  // seconds
    pub seconds: Vec<f64>,
}

/// Final norm + LM head time grid `seconds[i] = t^H(b[i])`, measured with a head of `bytes`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadGrid {
    /// Bytes of the measured shape's final norm + LM head (for scaling).  // bytes
    pub bytes: u64,
    /// Micro-batch sizes, strictly increasing.
    pub b: Vec<u32>,
    /// Seconds per token batch.  // seconds
    pub seconds: Vec<f64>,
}

/// Times measured on the device for one model shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasuredTimes {
    /// Shape the grids were measured with.
    pub model: String,
    /// That shape's attention block bytes (for scaling to other shapes).  // bytes
    pub attn_bytes: u64,
    /// That shape's MLP block bytes.  // bytes
    pub mlp_bytes: u64,
    /// `t^A(b, n)`.
    pub attn: AttnGrid,
    /// `t^P(b)`.
    pub mlp: MlpGrid,
    /// `t^H(b)`, when measured; otherwise the head is priced as `t^P(b) · H / P`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<HeadGrid>,
}

/// A roofline compute model from public specifications.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Roofline {
    /// Memory bandwidth.  // bytes/s
    pub mem_bw: f64,
    /// Peak 16-bit throughput.  // FLOP/s
    pub peak_flops: f64,
    /// Achieved fraction of the roofline, in (0, 1].
    pub efficiency: f64,
    /// Fixed cost per block (kernel launches, synchronisation).  // seconds
    #[serde(default)]
    pub block_overhead: f64,
    /// Achieved throughput of a block that runs many tokens at once (prefill, or the
    /// recomputation of evicted KV), measured or stated from a cited figure; `None`: the
    /// roofline's `peak_flops · efficiency`.  // FLOP/s
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_flops: Option<f64>,
}

impl Roofline {
    /// FLOP/s of a many-token block: [`Roofline::prefill_flops`], else the roofline's.  // FLOP/s
    pub fn many_token_flops(&self) -> f64 {
        self.prefill_flops
            .unwrap_or(self.peak_flops * self.efficiency)
    }
}

/// Where a preset's `mem_budget` comes from: the module's RAM less what the engine never
/// gets. `mem_budget` must equal [`MemoryDerivation::usable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryDerivation {
    /// Physical RAM of the module.  // bytes
    pub physical: u64,
    /// Hidden from the OS by firmware and kernel carve-outs (physical − what `free` shows).  // bytes
    pub carve_out: u64,
    /// OS, desktop and services at idle.  // bytes
    pub os: u64,
    /// CUDA context and the GPU libraries it maps (cuBLAS, cuDNN kernels).  // bytes
    pub cuda_context: u64,
    /// The serving framework's own process memory besides the CUDA context (Python with
    /// PyTorch imported, for the paper's systems).  // bytes
    #[serde(default)]
    pub framework: u64,
}

impl MemoryDerivation {
    /// What is left for the engine.  // bytes
    pub fn usable(&self) -> u64 {
        self.physical
            .saturating_sub(self.carve_out)
            .saturating_sub(self.os)
            .saturating_sub(self.cuda_context)
            .saturating_sub(self.framework)
    }
}

/// How a device's compute time is known.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ComputeModel {
    /// Grids measured by `loip profile`.
    Measured(MeasuredTimes),
    /// Derived from specifications.
    Roofline(Roofline),
}

/// Everything the planner knows about one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    /// Device (hardware) name.
    pub name: String,
    /// Memory the engine may use: weights, KV cache, buffers.  // bytes
    pub mem_budget: u64,
    /// Compute-time model.
    pub compute: ComputeModel,
    /// SSD read performance of both loaders.
    pub loader: Loaders,
    /// Where every number comes from.
    #[serde(default)]
    pub sources: Vec<String>,
    /// How `mem_budget` was derived, for presets written from specifications.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryDerivation>,
    /// Software latency of one collective (all-reduce, all-gather) started on this device,
    /// besides the link's per-hop latency: library call, synchronisation, staging copies.
    /// Tensor-parallel syncs wait for the largest among the devices.  // seconds
    #[serde(default)]
    pub collective_latency: f64,
    /// How much slower a block computes while a load runs beside it on the same machine (the
    /// loader's reads and copies share memory bandwidth and cores with the compute), as a
    /// fraction of its time alone: 0.3 is 30 % slower. Measured by the probe (a block timed
    /// while layer 0's slices are read); 0 when unknown. The cost model stretches the
    /// compute an offloaded stage's load overlaps by it ([`crate::cost`]).  // fraction
    #[serde(default, skip_serializing_if = "is_zero")]
    pub load_slowdown: f64,
    /// What a hop into this device costs beyond the link's latency `δ` as the runtime pays
    /// it: the frame queued for the device's compute thread, the thread woken, its output
    /// handed to the sending task. Measured at setup as a ping answered from the worker's
    /// compute thread less a plain ping; 0 when unknown (presets: part of `δ`). The cost
    /// model adds it to every hop into the device ([`crate::cost`]).  // seconds
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hop_wake: f64,
    /// What a hop into this device cost beyond `δ`, the bytes' time and `hop_wake`, as the
    /// run pays it: measured by the runtime at the end of setup from warm-up decode steps
    /// through the started pipeline (the steps' hops, wall less compute and stall, less the
    /// cost model's price of them, over the transfers; [`crate::calibrate`]). It covers
    /// what the setup's idle-machine pings miss: the workers, their loaders and the
    /// coordinator sharing the cores. 0 when unknown (presets). The cost model adds it to
    /// every hop into the device, after the loads' overlap (a load does not progress in it;
    /// [`crate::cost`]); the simulator beside `hop_wake`.  // seconds
    #[serde(default, skip_serializing_if = "is_zero")]
    pub hop_extra: f64,
    /// What a threshold switch of this device costs the run: the step that needs the new
    /// placement is parked from the coordinator sending the switch until the device answers
    /// (the kept blocks stay, the new resident ones are read, a new loader and slot). The
    /// runtime measures each park (`breakdown.switch_ms` of a `loip local --json` run);
    /// 0 when unknown (presets). Priced once per switching step over a run's switches
    /// ([`crate::adapt::evaluate_switched`]).  // seconds
    #[serde(default, skip_serializing_if = "is_zero")]
    pub switch_s: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

/// Network between devices (one shared link model).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LinkProfile {
    /// Bandwidth `bw`.  // bytes/s
    pub bandwidth: f64,
    /// Latency `δ` per transfer.  // seconds
    pub latency: f64,
}

/// Linear interpolation (and extrapolation from the nearest segment) of `ys` over `xs`.
fn interp(xs: &[f64], ys: &[f64], x: f64) -> f64 {
    match xs.len() {
        0 => 0.0,
        1 => ys[0],
        len => {
            let mut i = xs.partition_point(|&v| v <= x).saturating_sub(1);
            i = i.min(len - 2);
            let (x0, x1, y0, y1) = (xs[i], xs[i + 1], ys[i], ys[i + 1]);
            (y0 + (y1 - y0) * (x - x0) / (x1 - x0)).max(0.0)
        }
    }
}

impl MeasuredTimes {
    fn attn_at(&self, b: u32, n: u64) -> f64 {
        let ns: Vec<f64> = self.attn.n.iter().map(|&v| v as f64).collect();
        let per_b: Vec<f64> = self
            .attn
            .seconds
            .iter()
            .map(|row| interp(&ns, row, n as f64))
            .collect();
        let bs: Vec<f64> = self.attn.b.iter().map(|&v| v as f64).collect();
        interp(&bs, &per_b, b as f64)
    }

    fn mlp_at(&self, b: u32) -> f64 {
        let bs: Vec<f64> = self.mlp.b.iter().map(|&v| v as f64).collect();
        interp(&bs, &self.mlp.seconds, b as f64)
    }

    /// Head time for `shape` at `b`: the head grid scaled by head bytes, or the MLP grid
    /// scaled by `H / P_measured`.  // seconds
    fn head_for(&self, shape: &ModelShape, b: u32) -> f64 {
        match &self.head {
            Some(h) => {
                let bs: Vec<f64> = h.b.iter().map(|&v| v as f64).collect();
                interp(&bs, &h.seconds, b as f64) * shape.head_bytes as f64 / h.bytes as f64
            }
            None => self.mlp_at(b) * shape.head_bytes as f64 / self.mlp_bytes as f64,
        }
    }
}

fn increasing<T: PartialOrd>(v: &[T]) -> bool {
    v.windows(2).all(|w| w[0] < w[1])
}

impl DeviceProfile {
    /// Builds a measured profile from samples `(b, n, seconds)` and `(b, seconds)`.
    ///
    /// Samples may come in any order; repeated points are averaged. Attention samples must
    /// cover a full grid (every `b` with every `n`); otherwise an error names the hole.
    #[allow(clippy::too_many_arguments)]
    pub fn from_measurements(
        name: impl Into<String>,
        mem_budget: u64,
        shape: &ModelShape,
        attn_samples: Vec<(u32, u64, f64)>,
        mlp_samples: Vec<(u32, f64)>,
        direct: LoaderProfile,
        conventional: LoaderProfile,
    ) -> Result<DeviceProfile, ConfigError> {
        let mut bs: Vec<u32> = attn_samples.iter().map(|s| s.0).collect();
        let mut ns: Vec<u64> = attn_samples.iter().map(|s| s.1).collect();
        bs.sort_unstable();
        bs.dedup();
        ns.sort_unstable();
        ns.dedup();
        let mut seconds = vec![vec![(0.0, 0u32); ns.len()]; bs.len()];
        for &(b, n, t) in &attn_samples {
            let (i, j) = (
                bs.binary_search(&b).unwrap_or(0),
                ns.binary_search(&n).unwrap_or(0),
            );
            seconds[i][j].0 += t;
            seconds[i][j].1 += 1;
        }
        let mut grid = vec![vec![0.0; ns.len()]; bs.len()];
        for (i, row) in seconds.iter().enumerate() {
            for (j, &(sum, count)) in row.iter().enumerate() {
                if count == 0 {
                    return Err(ConfigError::Missing {
                        field: format!("attn sample (b={}, n={})", bs[i], ns[j]),
                    });
                }
                grid[i][j] = sum / count as f64;
            }
        }
        let mut mb: Vec<u32> = mlp_samples.iter().map(|s| s.0).collect();
        mb.sort_unstable();
        mb.dedup();
        let mut msum = vec![(0.0, 0u32); mb.len()];
        for &(b, t) in &mlp_samples {
            let i = mb.binary_search(&b).unwrap_or(0);
            msum[i].0 += t;
            msum[i].1 += 1;
        }
        let profile = DeviceProfile {
            name: name.into(),
            mem_budget,
            compute: ComputeModel::Measured(MeasuredTimes {
                model: shape.name.clone(),
                attn_bytes: shape.attn_bytes,
                mlp_bytes: shape.mlp_bytes,
                attn: AttnGrid {
                    b: bs,
                    n: ns,
                    seconds: grid,
                },
                mlp: MlpGrid {
                    b: mb,
                    seconds: msum.iter().map(|&(s, c)| s / c as f64).collect(),
                },
                head: None,
            }),
            loader: Loaders {
                direct,
                conventional,
            },
            sources: vec!["measured by `loip profile`".to_string()],
            memory: None,
            collective_latency: 0.0,
            load_slowdown: 0.0,
            hop_wake: 0.0,
            hop_extra: 0.0,
            switch_s: 0.0,
        };
        profile.validate()?;
        Ok(profile)
    }

    /// The same profile with a measured final norm + LM head grid: `head_time` then reads it
    /// (scaled by head bytes) instead of scaling the MLP time by `H / P`. A head's matrix is
    /// `vocab` rows long and often of another weight type than the blocks' (SmolLM2: a Q8_0
    /// head, Q4_1 blocks), so its time per byte differs from the MLP's. Roofline profiles
    /// are returned unchanged.
    pub fn with_head(mut self, head: HeadGrid) -> Result<DeviceProfile, ConfigError> {
        if let ComputeModel::Measured(m) = &mut self.compute {
            m.head = Some(head);
        }
        self.validate()?;
        Ok(self)
    }

    /// The same profile with every measured block and head time multiplied by `factor` (a
    /// probe re-timed: the blocks ran `factor` times as long as the grids say); roofline
    /// profiles, and factors that are not positive and finite, leave it unchanged.
    pub fn scale_compute(&mut self, factor: f64) {
        if !(factor > 0.0 && factor.is_finite()) {
            return;
        }
        if let ComputeModel::Measured(m) = &mut self.compute {
            for row in &mut m.attn.seconds {
                row.iter_mut().for_each(|s| *s *= factor);
            }
            m.mlp.seconds.iter_mut().for_each(|s| *s *= factor);
            if let Some(h) = &mut m.head {
                h.seconds.iter_mut().for_each(|s| *s *= factor);
            }
        }
    }

    /// The same profile with both loaders `factor` times as slow (each read's time, its
    /// fixed cost and its bytes' time, multiplied by `factor`: the loads re-timed as the run
    /// pays them); factors that are not positive and finite leave it unchanged.
    pub fn scale_loads(&mut self, factor: f64) {
        if !(factor > 0.0 && factor.is_finite()) {
            return;
        }
        for l in [&mut self.loader.direct, &mut self.loader.conventional] {
            l.bandwidth /= factor;
            l.per_read_overhead *= factor;
        }
    }

    /// Checks grids, bandwidths and efficiencies; errors name the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &str, reason: &str| ConfigError::Invalid {
            field: field.to_string(),
            reason: reason.to_string(),
        };
        if self.name.trim().is_empty() {
            return Err(ConfigError::Missing {
                field: "name".into(),
            });
        }
        if self.mem_budget == 0 {
            return Err(bad("mem_budget", "must be positive"));
        }
        if let Some(m) = &self.memory {
            if m.usable() != self.mem_budget {
                return Err(bad(
                    "mem_budget",
                    &format!(
                        "must equal memory.physical − carve_out − os − cuda_context − framework = {}",
                        m.usable()
                    ),
                ));
            }
        }
        if !(self.collective_latency >= 0.0 && self.collective_latency.is_finite()) {
            return Err(bad("collective_latency", "must be >= 0"));
        }
        if !(self.load_slowdown >= 0.0 && self.load_slowdown <= 10.0) {
            return Err(bad("load_slowdown", "must be in [0, 10]"));
        }
        if !(self.hop_wake >= 0.0 && self.hop_wake <= 1.0) {
            return Err(bad("hop_wake", "must be in [0, 1] s"));
        }
        if !(self.hop_extra >= 0.0 && self.hop_extra <= 1.0) {
            return Err(bad("hop_extra", "must be in [0, 1] s"));
        }
        if !(self.switch_s >= 0.0 && self.switch_s <= 60.0) {
            return Err(bad("switch_s", "must be in [0, 60] s"));
        }
        match &self.compute {
            ComputeModel::Roofline(r) => {
                if !(r.mem_bw > 0.0 && r.mem_bw.is_finite()) {
                    return Err(bad("compute.mem_bw", "must be positive"));
                }
                if !(r.peak_flops > 0.0 && r.peak_flops.is_finite()) {
                    return Err(bad("compute.peak_flops", "must be positive"));
                }
                if !(r.efficiency > 0.0 && r.efficiency <= 1.0) {
                    return Err(bad("compute.efficiency", "must be in (0, 1]"));
                }
                if !(r.block_overhead >= 0.0 && r.block_overhead.is_finite()) {
                    return Err(bad("compute.block_overhead", "must be >= 0"));
                }
                if r.prefill_flops.is_some_and(|f| !(f > 0.0 && f.is_finite())) {
                    return Err(bad("compute.prefill_flops", "must be positive"));
                }
            }
            ComputeModel::Measured(m) => {
                let a = &m.attn;
                if a.b.is_empty() || a.n.is_empty() || !increasing(&a.b) || !increasing(&a.n) {
                    return Err(bad(
                        "compute.attn",
                        "b and n must be non-empty and strictly increasing",
                    ));
                }
                if a.seconds.len() != a.b.len() || a.seconds.iter().any(|r| r.len() != a.n.len()) {
                    return Err(bad(
                        "compute.attn.seconds",
                        "must have b.len() rows of n.len() values",
                    ));
                }
                if a.seconds
                    .iter()
                    .flatten()
                    .any(|&t| !(t >= 0.0 && t.is_finite()))
                {
                    return Err(bad("compute.attn.seconds", "times must be finite and >= 0"));
                }
                let p = &m.mlp;
                if p.b.is_empty() || !increasing(&p.b) || p.seconds.len() != p.b.len() {
                    return Err(bad(
                        "compute.mlp",
                        "b must be non-empty, increasing, one time each",
                    ));
                }
                if p.seconds.iter().any(|&t| !(t >= 0.0 && t.is_finite())) {
                    return Err(bad("compute.mlp.seconds", "times must be finite and >= 0"));
                }
                if m.attn_bytes == 0 || m.mlp_bytes == 0 {
                    return Err(bad("compute.attn_bytes", "block bytes must be positive"));
                }
                if let Some(h) = &m.head {
                    if h.b.is_empty() || !increasing(&h.b) || h.seconds.len() != h.b.len() {
                        return Err(bad(
                            "compute.head",
                            "b must be non-empty, increasing, one time each",
                        ));
                    }
                    if h.seconds.iter().any(|&t| !(t >= 0.0 && t.is_finite())) {
                        return Err(bad("compute.head.seconds", "times must be finite and >= 0"));
                    }
                    if h.bytes == 0 {
                        return Err(bad("compute.head.bytes", "must be positive"));
                    }
                }
            }
        }
        for (field, l) in [
            ("loader.direct", &self.loader.direct),
            ("loader.conventional", &self.loader.conventional),
        ] {
            if !(l.bandwidth > 0.0 && l.bandwidth.is_finite()) {
                return Err(bad(&format!("{field}.bandwidth"), "must be positive"));
            }
            if !(l.per_read_overhead >= 0.0 && l.per_read_overhead.is_finite()) {
                return Err(bad(&format!("{field}.per_read_overhead"), "must be >= 0"));
            }
        }
        Ok(())
    }

    /// Attention block time `t^A(b, n)` for `shape`: `b` sequences, `n` cached tokens each.  // seconds
    pub fn attn_time(&self, shape: &ModelShape, b: u32, n: u64) -> f64 {
        match &self.compute {
            ComputeModel::Measured(m) => {
                m.attn_at(b, n) * shape.attn_bytes as f64 / m.attn_bytes as f64
            }
            ComputeModel::Roofline(r) => {
                let bytes =
                    shape.attn_bytes as f64 + (b as u64 * n * shape.kv_bytes_per_token) as f64;
                let flops = b as f64 * (shape.attn_proj_flops() + shape.attn_ctx_flops(n));
                (bytes / r.mem_bw).max(flops / r.peak_flops) / r.efficiency + r.block_overhead
            }
        }
    }

    /// MLP block time `t^P(b)` for `shape`.  // seconds
    pub fn mlp_time(&self, shape: &ModelShape, b: u32) -> f64 {
        match &self.compute {
            ComputeModel::Measured(m) => m.mlp_at(b) * shape.mlp_bytes as f64 / m.mlp_bytes as f64,
            ComputeModel::Roofline(r) => {
                let bytes = shape.mlp_bytes as f64;
                let flops = b as f64 * shape.mlp_flops();
                (bytes / r.mem_bw).max(flops / r.peak_flops) / r.efficiency + r.block_overhead
            }
        }
    }

    /// Final norm + LM head time `t^H(b)` for `shape`, `b` tokens at once (module docs).
    /// Its bytes are `H` whether or not the head is tied to the embedding.  // seconds
    pub fn head_time(&self, shape: &ModelShape, b: u32) -> f64 {
        match &self.compute {
            ComputeModel::Measured(m) => m.head_for(shape, b),
            ComputeModel::Roofline(r) => {
                let bytes = shape.head_bytes as f64;
                let flops = b as f64 * 2.0 * (shape.vocab * shape.hidden) as f64;
                (bytes / r.mem_bw).max(flops / r.peak_flops) / r.efficiency + r.block_overhead
            }
        }
    }

    /// The loader profile of `kind`.
    pub fn loader(&self, kind: LoaderKind) -> &LoaderProfile {
        match kind {
            LoaderKind::Direct => &self.loader.direct,
            LoaderKind::Conventional => &self.loader.conventional,
        }
    }

    /// Serializes to pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Parses and validates a JSON profile.
    pub fn from_json(text: &str) -> Result<DeviceProfile, ConfigError> {
        let p: DeviceProfile = serde_json::from_str(text).map_err(|e| ConfigError::Syntax {
            what: "device profile".into(),
            reason: e.to_string(),
        })?;
        p.validate()?;
        Ok(p)
    }
}

/// Shipped profiles: (preset name, JSON text).
const PRESETS: &[(&str, &str)] = &[
    (
        "orin64",
        include_str!("../profiles/jetson-agx-orin-64gb.json"),
    ),
    (
        "orin32",
        include_str!("../profiles/jetson-agx-orin-32gb.json"),
    ),
    (
        "nx16",
        include_str!("../profiles/jetson-xavier-nx-16gb.json"),
    ),
    (
        "host-zen5-2c",
        include_str!("../profiles/host-zen5-2c.json"),
    ),
];

/// Names accepted by [`preset`].
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.0).collect()
}

/// A shipped device profile by preset name (`orin64`, `orin32`, `nx16`, `host-zen5-2c`).
pub fn preset(name: &str) -> Option<DeviceProfile> {
    PRESETS
        .iter()
        .find(|p| p.0 == name)
        .and_then(|p| DeviceProfile::from_json(p.1).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ModelShape {
        ModelShape::from_dims("t", 64, 128, 4, 4, 2, 16, 100, false, 2.0, 2)
    }

    #[test]
    fn presets_parse() {
        for name in preset_names() {
            let p = preset(name).unwrap_or_else(|| panic!("preset {name}"));
            assert_eq!(DeviceProfile::from_json(&p.to_json()).unwrap(), p);
        }
    }

    #[test]
    fn a_profile_with_b_1_only_is_flat_in_b() {
        let s = shape();
        let l = LoaderProfile {
            bandwidth: 1e9,
            per_read_overhead: 0.0,
        };
        let old = DeviceProfile::from_measurements(
            "old",
            1 << 30,
            &s,
            vec![(1, 1, 1e-3), (1, 1024, 2e-3)],
            vec![(1, 3e-3)],
            l,
            l,
        )
        .unwrap();
        let grid = DeviceProfile::from_measurements(
            "grid",
            1 << 30,
            &s,
            [1, 2, 4, 8]
                .iter()
                .flat_map(|&b| [(b, 1, 1e-3 * b as f64), (b, 1024, 2e-3 * b as f64)])
                .collect(),
            vec![(1, 3e-3), (2, 4e-3), (4, 6e-3), (8, 1e-2)],
            l,
            l,
        )
        .unwrap();
        for b in [1, 2, 3, 8, 16] {
            assert_eq!(old.attn_time(&s, b, 512), old.attn_time(&s, 1, 512));
            assert_eq!(old.mlp_time(&s, b), 3e-3);
        }
        assert!((grid.mlp_time(&s, 3) - 5e-3).abs() < 1e-12);
        assert!((grid.mlp_time(&s, 16) - 1.8e-2).abs() < 1e-12);
        assert!((grid.attn_time(&s, 8, 1) - 8e-3).abs() < 1e-12);
        let back = DeviceProfile::from_json(&grid.to_json()).unwrap();
        assert_eq!(back, grid);
    }

    #[test]
    fn measured_interpolates() {
        let l = LoaderProfile {
            bandwidth: 1e9,
            per_read_overhead: 0.0,
        };
        let s = shape();
        let p = DeviceProfile::from_measurements(
            "m",
            1 << 30,
            &s,
            vec![
                (1, 100, 1.0),
                (1, 200, 2.0),
                (2, 100, 3.0),
                (2, 200, 4.0),
                (1, 100, 1.0),
            ],
            vec![(1, 0.5), (4, 2.0)],
            l,
            l,
        )
        .unwrap();
        assert!((p.attn_time(&s, 1, 150) - 1.5).abs() < 1e-12);
        assert!((p.attn_time(&s, 2, 300) - 5.0).abs() < 1e-12);
        assert!((p.attn_time(&s, 1, 50) - 0.5).abs() < 1e-12);
        assert!((p.mlp_time(&s, 2) - 1.0).abs() < 1e-12);
        // No head measurement: the MLP time scaled by H / P.
        let ratio = s.head_bytes as f64 / s.mlp_bytes as f64;
        assert!((p.head_time(&s, 1) - 0.5 * ratio).abs() < 1e-12);
        // A measured head (`loip profile` times it): read from its grid, not the MLP's.
        let q = p
            .clone()
            .with_head(HeadGrid {
                bytes: s.head_bytes,
                b: vec![1, 2],
                seconds: vec![0.25, 0.5],
            })
            .unwrap();
        assert!((q.head_time(&s, 1) - 0.25).abs() < 1e-12);
        assert!((q.head_time(&s, 2) - 0.5).abs() < 1e-12);
        let empty = HeadGrid {
            bytes: s.head_bytes,
            b: vec![],
            seconds: vec![],
        };
        assert!(p.clone().with_head(empty).is_err());
        assert_eq!(DeviceProfile::from_json(&q.to_json()).unwrap(), q);
        let err = DeviceProfile::from_measurements(
            "m",
            1,
            &s,
            vec![(1, 1, 1.0), (2, 2, 1.0)],
            vec![(1, 1.0)],
            l,
            l,
        );
        assert!(err.is_err());
    }
}
