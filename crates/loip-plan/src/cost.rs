//! The cost model of design §3: time per generated token and memory per device.
//!
//! [`evaluate`] prices any plan, including hand-edited ones whose stages differ. Per stage
//! index `k` (a "round": every device runs its stage `k` once), with `C_i^k` the compute of
//! device `i`'s stage `k`, `ld_i^k` its load, `off_i^k` the compute span of its offloaded
//! blocks ([`stage_span`]) and `c = |D|·(h/bw + δ)` (0 on one device):
//!
//! ```text
//! overlapped, sporadic:  round_k = c + max(C^k, max_i (ld_i^k + off_i^k) − c)
//! overlapped, bursty:    P_k = max(C^k + c, b·max_i (C_i^k + h/bw + δ))
//!                        round_k = max(P_k, max_i (ld_i^k + b·off_i^k))   (= P_k + uncovered)
//! sequential, sporadic:  round_k = c + Σ_i (C_i^k + ld_i^k)
//! sequential, bursty:    round_k = max(C^k + c + Σ_i ld_i^k, max_i (b·(C_i^k + h/bw + δ) + ld_i^k))
//! ms/token = Σ_k round_k / b      (b = 1 for sporadic)
//! ```
//!
//! With identical stages this is exactly `T = s·(c + max(C, max_i g_i − c))` of the design.
//! Attention time is taken at micro-batch 1 and the per-sequence context `⌈context / b⌉`.
//!
//! Memory of a device (design §3): retained blocks of all stages + slot + embedding (first
//! device) + head (last device) + `context · layers · κ` KV + [`ModelShape::working_bytes`].

use crate::cluster::{Cluster, Device};
use crate::error::PlanError;
use crate::plan::{ExecMode, Pattern, Plan, StagePlan};
use crate::profile::LoaderProfile;
use crate::shape::ModelShape;
use serde::{Deserialize, Serialize};

/// Where the time of one generated token goes; the parts add up to the total.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct CostBreakdown {
    /// Compute on the critical path.  // milliseconds
    pub compute_ms: f64,
    /// Activation transfers and link latency.  // milliseconds
    pub comm_ms: f64,
    /// SSD load time not hidden behind compute.  // milliseconds
    pub uncovered_load_ms: f64,
}

impl CostBreakdown {
    /// Sum of the parts.  // milliseconds
    pub fn total_ms(&self) -> f64 {
        self.compute_ms + self.comm_ms + self.uncovered_load_ms
    }
}

/// Per-device figures of an evaluated plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceCost {
    /// Device name.
    pub name: String,
    /// Memory at the planned context.  // bytes
    pub memory_bytes: u64,
    /// Budget.  // bytes
    pub budget_bytes: u64,
    /// Slot.  // bytes
    pub slot_bytes: u64,
    /// KV cache at the planned context.  // bytes
    pub kv_bytes: u64,
    /// Memory at context 0, `M_i(0)`.  // bytes
    pub memory_at_zero_bytes: u64,
    /// Compute per generated token.  // milliseconds
    pub compute_ms: f64,
    /// SSD load per generated token.  // milliseconds
    pub load_ms: f64,
    /// Uncovered load it causes per generated token.  // milliseconds
    pub stall_ms: f64,
}

/// Result of [`evaluate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cost {
    /// Predicted time per generated token.  // milliseconds
    pub ms_per_token: f64,
    /// Its breakdown.
    pub breakdown: CostBreakdown,
    /// Per device, in plan order.
    pub devices: Vec<DeviceCost>,
}

/// Per-block times and loader of one device for one shape and request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockTimes {
    /// Attention block `t^A`.  // seconds
    pub attn: f64,
    /// MLP block `t^P`.  // seconds
    pub mlp: f64,
    /// SSD loader in use.
    pub loader: LoaderProfile,
}

/// Per-sequence context used for attention time: `⌈context / b⌉`.  // tokens
pub fn per_sequence_context(context: u64, micro_batches: u32) -> u64 {
    context.div_ceil(micro_batches.max(1) as u64)
}

/// Block times of `device` for `shape` at the plan parameters.
pub fn block_times(
    device: &Device,
    shape: &ModelShape,
    context: u64,
    micro_batches: u32,
    loader: crate::profile::LoaderKind,
) -> BlockTimes {
    let n = per_sequence_context(context, micro_batches);
    BlockTimes {
        attn: device.profile.attn_time(shape, 1, n),
        mlp: device.profile.mlp_time(shape, 1),
        loader: *device.profile.loader(loader),
    }
}

/// Closed-form compute span of `a` attention and `m` MLP blocks placed as the tightest
/// contiguous run in a stage (design §3 `span(a, m)`).  // seconds
pub fn span(a: u32, m: u32, t_attn: f64, t_mlp: f64) -> f64 {
    let (a, m) = (a as f64, m as f64);
    if a == m {
        a * t_attn + m * t_mlp
    } else if m > a {
        m * t_mlp + a.max(m - 1.0) * t_attn
    } else {
        a * t_attn + m.max(a - 1.0) * t_mlp
    }
}

/// Compute span of a stage's offloaded blocks at their actual positions: the compute of the
/// run of blocks (A₀ P₀ A₁ P₁ …) from the first offloaded block to the last.  // seconds
pub fn stage_span(stage: &StagePlan, t_attn: f64, t_mlp: f64) -> f64 {
    let offloaded = |i: usize| {
        let l = &stage.layers[i / 2];
        if i % 2 == 0 {
            l.attn.is_offloaded()
        } else {
            l.mlp.is_offloaded()
        }
    };
    let blocks = 2 * stage.layers.len();
    let Some(first) = (0..blocks).find(|&i| offloaded(i)) else {
        return 0.0;
    };
    let last = (0..blocks).rev().find(|&i| offloaded(i)).unwrap_or(first);
    (first..=last)
        .map(|i| if i % 2 == 0 { t_attn } else { t_mlp })
        .sum()
}

/// Slot bytes for a device's stages: the largest stage's offloaded bytes (overlapped), or the
/// largest single offloaded block (sequential).  // bytes
pub fn slot_bytes(mode: ExecMode, stages: &[StagePlan], shape: &ModelShape) -> u64 {
    match mode {
        ExecMode::Overlapped => stages
            .iter()
            .map(|s| s.offloaded_bytes(shape))
            .max()
            .unwrap_or(0),
        ExecMode::Sequential => {
            let any_a = stages
                .iter()
                .flat_map(|s| &s.layers)
                .any(|l| l.attn.is_offloaded());
            let any_m = stages
                .iter()
                .flat_map(|s| &s.layers)
                .any(|l| l.mlp.is_offloaded());
            (if any_a { shape.attn_bytes } else { 0 }).max(if any_m { shape.mlp_bytes } else { 0 })
        }
    }
}

/// Memory of a device at `context` tokens, `M_i(n)` of design §3 with `n_trans = 0`.  // bytes
#[allow(clippy::too_many_arguments)]
pub fn device_memory(
    shape: &ModelShape,
    mode: ExecMode,
    stages: &[StagePlan],
    holds_embedding: bool,
    holds_head: bool,
    context: u64,
    micro_batches: u32,
) -> u64 {
    let retained: u64 = stages.iter().map(|s| s.retained_bytes(shape)).sum();
    let layers: u64 = stages.iter().map(|s| s.layers.len() as u64).sum();
    retained
        + slot_bytes(mode, stages, shape)
        + if holds_embedding {
            shape.embed_bytes
        } else {
            0
        }
        + if holds_head {
            shape.head_bytes_on(holds_embedding)
        } else {
            0
        }
        + context * layers * shape.kv_bytes_per_token
        + shape.working_bytes(micro_batches)
}

/// Memory of a device with `s` identical stages of `n` layers, `a`/`m` offloaded blocks each,
/// in overlapped mode (the planner's closed form; equals [`device_memory`]).  // bytes
#[allow(clippy::too_many_arguments)]
pub fn stage_memory(
    shape: &ModelShape,
    s: u32,
    n: u32,
    a: u32,
    m: u32,
    embed: bool,
    head: bool,
    context: u64,
    micro_batches: u32,
) -> u64 {
    let (s, n) = (s as u64, n as u64);
    let off = a as u64 * shape.attn_bytes + m as u64 * shape.mlp_bytes;
    s * n * shape.layer_bytes() - (s - 1) * off
        + if embed { shape.embed_bytes } else { 0 }
        + if head { shape.head_bytes_on(embed) } else { 0 }
        + context * s * n * shape.kv_bytes_per_token
        + shape.working_bytes(micro_batches)
}

/// Communication of one sporadic round `c = |D|·(h/bw + δ)`, 0 on a single device.  // seconds
pub fn round_comm(shape: &ModelShape, cluster: &Cluster, devices: usize) -> f64 {
    if devices <= 1 {
        0.0
    } else {
        devices as f64 * per_hop_comm(shape, cluster, devices)
    }
}

/// One activation transfer `h/bw + δ`, 0 on a single device.  // seconds
pub fn per_hop_comm(shape: &ModelShape, cluster: &Cluster, devices: usize) -> f64 {
    if devices <= 1 {
        0.0
    } else {
        shape.act_bytes_per_token as f64 / cluster.link.bandwidth + cluster.link.latency
    }
}

/// Prices a plan with the cost model. Errors only if a plan device is not in the cluster.
pub fn evaluate(plan: &Plan, shape: &ModelShape, cluster: &Cluster) -> Result<Cost, PlanError> {
    let b = plan.micro_batches.max(1);
    let devs: Vec<&Device> = plan
        .devices
        .iter()
        .map(|d| {
            cluster
                .device(&d.name)
                .ok_or_else(|| PlanError::UnknownDevice(d.name.clone()))
        })
        .collect::<Result<_, _>>()?;
    let times: Vec<BlockTimes> = devs
        .iter()
        .map(|d| block_times(d, shape, plan.context, b, plan.loader))
        .collect();
    let nd = devs.len();
    let c = round_comm(shape, cluster, nd);
    let e = per_hop_comm(shape, cluster, nd);
    let bf = b as f64;
    let bursty = plan.pattern == Pattern::Bursty;
    let per_tok = if bursty { bf } else { 1.0 };
    let rounds = plan
        .devices
        .iter()
        .map(|d| d.stages.len())
        .max()
        .unwrap_or(0);
    let mut total = CostBreakdown::default();
    let mut dev_compute = vec![0.0; nd];
    let mut dev_load = vec![0.0; nd];
    let mut dev_stall = vec![0.0; nd];
    for k in 0..rounds {
        let mut ci = vec![0.0; nd];
        let mut ld = vec![0.0; nd];
        let mut off = vec![0.0; nd];
        for (i, d) in plan.devices.iter().enumerate() {
            let Some(st) = d.stages.get(k) else { continue };
            let t = &times[i];
            let (n, a, m) = st.counts();
            ci[i] = n as f64 * (t.attn + t.mlp);
            ld[i] = t.loader.load_time(st.offloaded_bytes(shape), a + m);
            off[i] = stage_span(st, t.attn, t.mlp);
            dev_compute[i] += ci[i];
            dev_load[i] += ld[i] / per_tok;
        }
        let sum_c: f64 = ci.iter().sum();
        let (bi, max_ci) = ci
            .iter()
            .copied()
            .enumerate()
            .fold(
                (0, f64::MIN),
                |acc, (i, v)| if v > acc.1 { (i, v) } else { acc },
            );
        let (compute, comm, uncov, stall_of): (f64, f64, f64, Vec<f64>) = match (plan.mode, bursty)
        {
            (ExecMode::Overlapped, false) => {
                let stalls: Vec<f64> = (0..nd)
                    .map(|i| (ld[i] + off[i] - sum_c - c).max(0.0))
                    .collect();
                let u = stalls.iter().copied().fold(0.0, f64::max);
                (sum_c, c, u, stalls)
            }
            (ExecMode::Overlapped, true) => {
                let pass = sum_c + c;
                let busiest = bf * (max_ci + e);
                let p = pass.max(busiest);
                let stalls: Vec<f64> = (0..nd)
                    .map(|i| (ld[i] + bf * off[i] - p).max(0.0))
                    .collect();
                let u = stalls.iter().copied().fold(0.0, f64::max);
                if pass >= busiest {
                    (sum_c, c, u, stalls)
                } else {
                    (bf * max_ci, bf * e, u, stalls)
                }
            }
            (ExecMode::Sequential, false) => {
                let u: f64 = ld.iter().sum();
                (sum_c, c, u, ld.clone())
            }
            (ExecMode::Sequential, true) => {
                let sum_ld: f64 = ld.iter().sum();
                let pass = sum_c + c + sum_ld;
                let (wi, worst) = (0..nd)
                    .map(|i| (i, bf * (ci[i] + e) + ld[i]))
                    .fold((bi, f64::MIN), |acc, x| if x.1 > acc.1 { x } else { acc });
                if pass >= worst {
                    (sum_c, c, sum_ld, ld.clone())
                } else {
                    let mut st = vec![0.0; nd];
                    st[wi] = ld[wi];
                    (bf * ci[wi], bf * e, ld[wi], st)
                }
            }
        };
        total.compute_ms += compute * 1e3 / per_tok;
        total.comm_ms += comm * 1e3 / per_tok;
        total.uncovered_load_ms += uncov * 1e3 / per_tok;
        for i in 0..nd {
            dev_stall[i] += stall_of[i] / per_tok;
        }
    }
    let devices = plan
        .devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let layers: u64 = d.stages.iter().map(|s| s.layers.len() as u64).sum();
            let mem = device_memory(
                shape,
                plan.mode,
                &d.stages,
                d.holds_embedding,
                d.holds_head,
                plan.context,
                b,
            );
            let kv = plan.context * layers * shape.kv_bytes_per_token;
            DeviceCost {
                name: d.name.clone(),
                memory_bytes: mem,
                budget_bytes: devs[i].budget(),
                slot_bytes: slot_bytes(plan.mode, &d.stages, shape),
                kv_bytes: kv,
                memory_at_zero_bytes: mem - kv,
                compute_ms: dev_compute[i] * 1e3,
                load_ms: dev_load[i] * 1e3,
                stall_ms: dev_stall[i] * 1e3,
            }
        })
        .collect();
    Ok(Cost {
        ms_per_token: total.total_ms(),
        breakdown: total,
        devices,
    })
}

/// Writes an evaluation into the plan's prediction fields.
pub fn apply(plan: &mut Plan, cost: &Cost) {
    plan.predicted_ms_per_token = cost.ms_per_token;
    plan.breakdown = cost.breakdown;
    for (d, c) in plan.devices.iter_mut().zip(&cost.devices) {
        d.memory_bytes = c.memory_bytes;
        d.budget_bytes = c.budget_bytes;
        d.slot_bytes = c.slot_bytes;
        d.kv_bytes = c.kv_bytes;
        d.compute_ms = c.compute_ms;
        d.load_ms = c.load_ms;
        d.stall_ms = c.stall_ms;
    }
}

/// First threshold `TS¹ = ⌊Left / (layers·κ)⌋` (design §6): tokens of KV a device can hold
/// with `left_bytes = Mem − M(0)` free, `layers = s·n_i` layers, `κ` bytes per token per layer.
pub fn first_threshold(left_bytes: u64, layers: u64, kv_bytes_per_token: u64) -> u64 {
    left_bytes
        .checked_div(layers * kv_bytes_per_token)
        .unwrap_or(u64::MAX)
}

/// KV headroom of one device after placement (design §6).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Threshold {
    /// Device name.
    pub name: String,
    /// `Left_i = Mem_i − M_i(0)` (0 if over budget).  // bytes
    pub left_bytes: u64,
    /// `TS_i^1`: tokens held when the first adaptation must happen.  // tokens
    pub first_threshold: u64,
}

/// First thresholds of every plan device.
pub fn thresholds(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
) -> Result<Vec<Threshold>, PlanError> {
    let c = evaluate(plan, shape, cluster)?;
    Ok(plan
        .devices
        .iter()
        .zip(&c.devices)
        .map(|(d, dc)| {
            let left = dc.budget_bytes.saturating_sub(dc.memory_at_zero_bytes);
            Threshold {
                name: d.name.clone(),
                left_bytes: left,
                first_threshold: first_threshold(
                    left,
                    d.layer_count() as u64,
                    shape.kv_bytes_per_token,
                ),
            }
        })
        .collect())
}
