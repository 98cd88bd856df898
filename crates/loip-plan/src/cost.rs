//! The cost model of design §3: time per generated token and memory per device.
//!
//! [`evaluate`] prices any plan, including hand-edited ones whose stages differ. Per stage
//! index `k` (a "round": every device runs its stage `k` once, for each of the `b`
//! micro-batches in flight; `b = 1` for sporadic traffic), with
//!
//! ```text
//! C_i^k   s  compute of device i's stage k (one micro-batch); the last device's last stage
//!            also counts the final norm + LM head t^H (profile::DeviceProfile::head_time)
//! ld_i^k  s  load of its offloaded blocks          off_i^k  s  their compute span (stage_span)
//! g_i^k = ld_i^k + off_i^k                          C^k = Σ_i C_i^k
//! c       s  one pass over the links, |D|·(h/bw + δ) (0 on one device)
//! ℓ       s  one activation on an egress port, h/bw (0 on one device)
//! e_i     s  device i's hop out of its stage, h/bw + δ + w_{i+1} (0 on one device)
//! w_i     s  the runtime's wake-up of a hop into device i beyond δ (profile `hop_wake`; 0 for
//!            presets): a pass carries Σ_i w_i, c = |D|·(h/bw + δ) + Σ_i w_i
//! x_i     s  what the setup's warm-up steps paid for a hop into device i beyond that (profile
//!            `hop_extra`; 0 for presets): Σ_i x_i added to each round's pass (b·Σ_i x_i
//!            bursty) after the overlap, since no load progresses in it
//! co      s  the coordinator's part of a step (`Cluster::coordinator`; 0 for presets), on the
//!            last round's pass and busy b·co per round ([`coordinated_round`])
//! ```
//!
//! In the last round (the one with the LM head) the wrap-around hop is the token's return
//! trip, last device → first device, carrying `r` bytes ([`ModelShape::return_bytes_per_token`];
//! `h` unless set; `vocab·4` for the full logits the runtime sends today, 4 for a sampled
//! token id), so there `c`, `ℓ` and the head device's `e_i` are
//!
//! ```text
//! c_H = (|D|−1)·(h/bw + δ) + r/bw + δ      ℓ_H = max(h, r)/bw      e_i = r/bw + δ
//! ```
//!
//! the overlapped round ([`overlapped_round`]) and the sequential one are
//!
//! ```text
//! overlapped:  P_k     = max(C^k + c, b·max(max_i C_i^k, ℓ))
//!              round_k = max(P_k, max_i (g_i^k + (b−1)·C_i^k))         (= P_k + uncovered)
//! sequential, sporadic:  round_k = c + Σ_i (C_i^k + ld_i^k)
//! sequential, bursty:    round_k = max(C^k + c + Σ_i ld_i^k, max_i b·(C_i^k + ld_i^k + e_i))
//! ms/token = Σ_k round_k / b
//! ```
//!
//! **Why the overlapped round is what it is.** `P_k` is the round period without loads: one
//! micro-batch's pass through every device and link (`C^k + c`), or the busiest resource
//! serving all `b` micro-batches — a device's compute unit (`b·C_i^k`) or an egress port
//! (`b·ℓ`; the link latency `δ` delays a transfer but does not occupy the port, and compute
//! and sending overlap, so the busy time is not `b·(C_i + h/bw + δ)`).
//!
//! A device's single slot holds one stage's offloaded blocks. The load of stage `k+1` can
//! start only once the slot is released — after the offloaded run of stage `k` has finished
//! for the **last** micro-batch — and must be done before the run starts for the **first**
//! micro-batch of stage `k+1`. Micro-batches pass a device back to back when it is the
//! bottleneck, `C_i` apart, so from the start of the first micro-batch's run to the end of
//! the last one's the slot is busy for `(b−1)·C_i + off_i`. Over a period `P` the load window
//! is therefore
//!
//! ```text
//! window_i = P − (b−1)·C_i − off_i        (design §3 assumed P − b·off_i)
//! stall_i  = max(0, ld_i − window_i) = max(0, g_i + (b−1)·C_i − P)
//! ```
//!
//! and a round lasts `P + max_i stall_i` (loads of different devices overlap each other).
//! With `b = 1` this is the sporadic rule `round = c + max(C, max_i g_i − c)` of the design.
//! The old window `P − b·off_i` let a device whose own `b` micro-batches fill most of the
//! round "hide" a load that in fact had only the retained part of one micro-batch to hide
//! behind. A device that is not the bottleneck sees its micro-batches arrive further apart
//! than `C_i`, so its slot is held longer and this underestimates there: on `loip`'s own
//! plans of random clusters the simulator (`loip-sim`, which runs the slot event by event) is
//! within 10 % (5 % for 199 of 200), but with extra loads forced onto every device it was
//! found up to 43 % slower; see docs/simulator.md (section "Simulator versus cost model").
//!
//! **The LM head** runs after the last stage on the last device, for every micro-batch, so
//! it is part of that device's compute in the last round: it lengthens the pass, counts in
//! the busiest-device term, holds the slot `(b−1)·t^H` longer, and (sporadic) widens the
//! window in which the first stage's loads of the next token are hidden. The embedding
//! lookup (one row per token) is left out as negligible.
//!
//! **The return trip** is one hop per generated token (per micro-batch in bursty mode): it
//! lengthens the last round's pass by `(r − h)/bw` and, bursty, the last device's egress port
//! sends `b` of them per round. It counts as communication and is 0 on one device.
//!
//! **The sequential bursty round** (conventional pipeline + offloading, `pp-offload` only):
//! each sequence runs through a stage on its own, and its offloaded blocks are read again into
//! the one-block buffer each time, after the blocks before them ran; nothing hides a load. A
//! device is therefore busy `b·(C_i + ld_i + e_i)` per round (compute, its reads and its
//! sends, in turn), and one micro-batch's pass is `C + c + Σ ld`; the round is the larger.
//! Per generated token a device reads its offloaded blocks once (`ld_i`, not `ld_i / b`).
//! This is how the distributed runtime runs a stage, and how `loip-sim` simulates it (within
//! 6 %: a device there sends one micro-batch's activation while it computes the next, which
//! this formula charges in turn).
//!
//! **Compute beside a load.** A load shares the machine's memory bandwidth and cores with the
//! compute it overlaps, which then runs slower by the profile's `load_slowdown` `σ_i`
//! (measured by the probe; 0 for presets): in overlapped mode `C_i` grows by
//! `σ_i · min(ld_i, Σ_mates C_j − off_i)` ([`load_slowdown_extra`]; the mates are the devices
//! on its disk, i.e. its machine). The closed form of the exact scheduler leaves it out.
//!
//! With identical stages, `s` rounds of which the last carries the head, this is the closed
//! form the exact scheduler minimises (`planners::exact`). Attention time is taken at
//! micro-batch 1 and the per-sequence context `⌈context / b⌉`.
//!
//! **Micro-batches of several sequences** ([`evaluate_batched`], continuous batching): each
//! of the `b` micro-batches carries `q` sequences, one token each. Every block time is the
//! profile's `t(q)` (a measured profile's grid over b, or the roofline with `b = q`), the
//! per-sequence context is `⌈context / (b·q)⌉`, `h` and `r` are `q` activations / results,
//! and a round yields `q` tokens per micro-batch: `ms/token = Σ_k round_k / (b·q)` bursty
//! (`/ q` sporadic), each device's compute per token `C_i / q`. `q = 1` is [`evaluate`]
//! exactly. While decoding is memory-bound `t(q) ≈ t(1)`, so the time per token falls
//! nearly `q`-fold until compute binds.
//!
//! Memory of a device (design §3): retained blocks of all stages + slot + embedding (first
//! device) + head (last device) + `context · layers · κ` KV + [`ModelShape::working_bytes`].

mod disk;

pub use disk::{staggered_load_times, staggered_load_times_at};

use crate::cluster::{Cluster, Device};
use crate::error::PlanError;
/// The breakdown and the slot size are plan figures, defined with the plan types.
pub use crate::plan::{slot_bytes, CostBreakdown};
use crate::plan::{ExecMode, Pattern, Plan, StagePlan};
use crate::profile::LoaderProfile;
use crate::shape::ModelShape;
use serde::{Deserialize, Serialize};

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
    /// Final norm + LM head `t^H` (run by the last device only).  // seconds
    pub head: f64,
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
    block_times_batched(device, shape, context, micro_batches, 1, loader)
}

/// Block times of `device` for one micro-batch of `seqs` sequences (one token each): the
/// profile's `t(b)` at `b = seqs` (its grid, or the roofline), with the per-sequence context
/// `⌈context / (micro_batches · seqs)⌉`.
pub fn block_times_batched(
    device: &Device,
    shape: &ModelShape,
    context: u64,
    micro_batches: u32,
    seqs: u32,
    loader: crate::profile::LoaderKind,
) -> BlockTimes {
    block_times_rows(device, shape, context, micro_batches, seqs, 1, loader)
}

/// Block times of `device` for one micro-batch of `seqs` sequences feeding `positions`
/// positions each (a speculative step verifies `k + 1`): the profile's `t(b)` at
/// `b = seqs · positions` rows. Attention is taken at `⌈n / positions⌉` cached tokens per
/// row, `n = ⌈context / (micro_batches · seqs)⌉` the per-sequence context: the positions of
/// one sequence read its KV once (the profile's grid is for `b` sequences, each reading its
/// own), at the cost of undercounting the context part of their FLOPs, which is small
/// beside the projections while decoding. `positions = 1` is [`block_times_batched`].
pub fn block_times_rows(
    device: &Device,
    shape: &ModelShape,
    context: u64,
    micro_batches: u32,
    seqs: u32,
    positions: u32,
    loader: crate::profile::LoaderKind,
) -> BlockTimes {
    let q = seqs.max(1);
    let rows = q.saturating_mul(positions.max(1));
    let n = per_sequence_context(context, micro_batches.max(1).saturating_mul(q));
    let n_row = n.div_ceil(positions.max(1) as u64);
    BlockTimes {
        attn: device.profile.attn_time(shape, rows, n_row),
        mlp: device.profile.mlp_time(shape, rows),
        head: device.profile.head_time(shape, rows),
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
    let offloaded = |i: usize| block_offloaded(stage, i);
    let blocks = 2 * stage.layers.len();
    let Some(first) = (0..blocks).find(|&i| offloaded(i)) else {
        return 0.0;
    };
    let last = (0..blocks).rev().find(|&i| offloaded(i)).unwrap_or(first);
    (first..=last)
        .map(|i| if i % 2 == 0 { t_attn } else { t_mlp })
        .sum()
}

/// Whether block `i` of a stage (A₀ P₀ A₁ P₁ …) is offloaded.
fn block_offloaded(stage: &StagePlan, i: usize) -> bool {
    let l = &stage.layers[i / 2];
    if i % 2 == 0 {
        l.attn.is_offloaded()
    } else {
        l.mlp.is_offloaded()
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
        + shape.kv_bytes_of(stage_layers(stages), context)
        + shape.working_bytes(micro_batches)
}

/// Global layers of `stages`.
fn stage_layers(stages: &[StagePlan]) -> impl Iterator<Item = u32> + '_ {
    stages.iter().flat_map(|s| s.layers.iter().map(|l| l.layer))
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
        + shape.kv_bytes(s * n, context)
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

/// The token's return trip, last device → first device once per generated token,
/// `r/bw + δ` with `r` = [`ModelShape::return_bytes_per_token`]; 0 on a single device.  // seconds
pub fn return_comm(shape: &ModelShape, cluster: &Cluster, devices: usize) -> f64 {
    if devices <= 1 {
        0.0
    } else {
        shape.return_bytes_per_token() as f64 / cluster.link.bandwidth + cluster.link.latency
    }
}

/// Communication of the last round (the one with the LM head), whose wrap-around hop is the
/// return trip: `c_H = (|D|−1)·(h/bw + δ) + r/bw + δ`, 0 on a single device.  // seconds
pub fn last_round_comm(shape: &ModelShape, cluster: &Cluster, devices: usize) -> f64 {
    if devices <= 1 {
        0.0
    } else {
        (devices - 1) as f64 * per_hop_comm(shape, cluster, devices)
            + return_comm(shape, cluster, devices)
    }
}

/// Time the busiest egress port is occupied per micro-batch in the last round,
/// `ℓ_H = max(h, r)/bw` (the last device sends `r` instead of `h`), 0 on a single
/// device.  // seconds
pub fn last_link_time(shape: &ModelShape, cluster: &Cluster, devices: usize) -> f64 {
    if devices <= 1 {
        0.0
    } else {
        shape
            .act_bytes_per_token
            .max(shape.return_bytes_per_token()) as f64
            / cluster.link.bandwidth
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

/// Time one activation occupies an egress port, `ℓ = h/bw`, 0 on a single device.  // seconds
pub fn link_time(shape: &ModelShape, cluster: &Cluster, devices: usize) -> f64 {
    if devices <= 1 {
        0.0
    } else {
        shape.act_bytes_per_token as f64 / cluster.link.bandwidth
    }
}

/// One device's part of an overlapped round.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DeviceRound {
    /// Compute of its stage for one micro-batch `C_i` (LM head included on the last device in
    /// the last round).  // seconds
    pub compute: f64,
    /// Load + compute span of the stage's offloaded blocks `g_i = ld_i + off_i` (0 when
    /// nothing is offloaded).  // seconds
    pub g: f64,
}

/// An overlapped round priced by [`overlapped_round`].
#[derive(Debug, Clone, PartialEq)]
pub struct RoundCost {
    /// Round period without loads `P`.  // seconds
    pub period: f64,
    /// Round time, `P` + uncovered load.  // seconds
    pub time: f64,
    /// Compute part of `P` on the critical path.  // seconds
    pub compute: f64,
    /// Communication part of `P`.  // seconds
    pub comm: f64,
    /// Per device: its stall `max(0, g_i + (b−1)·C_i − P)`.  // seconds
    pub stalls: Vec<f64>,
}

/// One overlapped round (module docs): `b` micro-batches, `c` one pass over the links, `link`
/// one activation on an egress port.
pub fn overlapped_round(devs: &[DeviceRound], b: u32, c: f64, link: f64) -> RoundCost {
    let bf = b.max(1) as f64;
    let sum_c: f64 = devs.iter().map(|d| d.compute).sum();
    let max_c = devs.iter().map(|d| d.compute).fold(0.0, f64::max);
    let pass = sum_c + c;
    let busiest = bf * max_c.max(link);
    let period = pass.max(busiest);
    let (compute, comm) = if pass >= busiest {
        (sum_c, c)
    } else {
        (bf * max_c, busiest - bf * max_c)
    };
    let stalls: Vec<f64> = devs
        .iter()
        .map(|d| (d.g + (bf - 1.0) * d.compute - period).max(0.0))
        .collect();
    let uncovered = stalls.iter().copied().fold(0.0, f64::max);
    RoundCost {
        period,
        time: period + uncovered,
        compute,
        comm,
        stalls,
    }
}

/// The wake-ups of one pass over the links: every device receives one hop per micro-batch
/// and round, each costing its profile's `hop_wake` beyond `δ`; 0 on a single device.
/// // seconds
pub fn pass_wakes(wakes: &[f64]) -> f64 {
    if wakes.len() <= 1 {
        0.0
    } else {
        wakes.iter().sum()
    }
}

/// What the warm-up's extras `x_i` (profile `hop_extra`, one per device) add to a round
/// after the loads' overlap: `Σ_i x_i` a pass, `b` passes a round when bursty (one
/// otherwise); 0 on one device. A load does not progress in it (the run queue the loaders
/// share), so the simulator lengthens each overlapped load by the same figure, which
/// leaves its stall what the cost model prices.  // seconds
pub fn round_extra(extras: &[f64], b: u32, bursty: bool) -> f64 {
    let passes = if bursty { b.max(1) as f64 } else { 1.0 };
    passes * pass_wakes(extras)
}

/// [`overlapped_round`] for a round whose pass also carries the coordinator's part `co` of
/// a step (the last round; 0 elsewhere). The coordinator serves the micro-batches one at a
/// time, so like an egress port it is busy `b·co` per round:
/// `P = max(C + c + co, b·max(max_i C_i, ℓ, co))`. Returns the round, whose `comm` leaves
/// the coordinator's part out, and that part of the period.  // seconds
pub fn coordinated_round(
    devs: &[DeviceRound],
    b: u32,
    c: f64,
    link: f64,
    co: f64,
) -> (RoundCost, f64) {
    if co <= 0.0 {
        return (overlapped_round(devs, b, c, link), 0.0);
    }
    let mut r = overlapped_round(devs, b, c + co, link.max(co));
    let sum_c: f64 = devs.iter().map(|d| d.compute).sum();
    let max_c = devs.iter().map(|d| d.compute).fold(0.0, f64::max);
    let part = if sum_c + c + co >= b.max(1) as f64 * max_c.max(link).max(co) {
        co // the pass binds: the coordinator's part is on it
    } else if co > link {
        r.comm // the coordinator is the busiest resource
    } else {
        0.0
    };
    r.comm -= part;
    (r, part)
}

/// Devices that share a disk ([`Cluster::disks`]) load their stage `k` in the same round, so
/// the disk's rate is shared: fair sharing from a common start, a device's load ends once
/// the disk has served `Σ_j min(B_j, B_i)` bytes (its own `B_i` plus, from each mate, as
/// much as it reads or `B_i` if less), so its load time `ld_i` grows by that over `B_i`.
/// Overlapped mode only: a sequential device loads when its stage runs, alone.
///
/// With one micro-batch (`b = 1`) the loads do not start together: device `i`'s load of stage
/// `k` starts when its slot is released in the round before, once its offloaded run of
/// stage `k−1` is done, which is later down the pipeline (`starts`, seconds from that
/// round's pass start; [`load_starts`]). Then the disk is shared among the loads running at
/// each instant ([`staggered_load_times`]). `starts = None` keeps the common start.
fn share_disks(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    k: usize,
    starts: Option<&[f64]>,
    ld: &mut [f64],
) {
    if cluster.disks.is_empty() {
        return;
    }
    let bytes: Vec<u64> = plan
        .devices
        .iter()
        .map(|d| d.stages.get(k).map_or(0, |st| st.offloaded_bytes(shape)))
        .collect();
    if let Some(starts) = starts {
        let alone = ld.to_vec();
        for (g, group) in cluster.disks.iter().enumerate() {
            let idx: Vec<usize> = (0..plan.devices.len())
                .filter(|&i| group.contains(&plan.devices[i].name) && bytes[i] > 0)
                .collect();
            let works: Vec<f64> = idx.iter().map(|&i| alone[i]).collect();
            let at: Vec<f64> = idx.iter().map(|&i| starts[i]).collect();
            let times = match cluster.disk_rates.get(g).copied().filter(|r| *r > 0.0) {
                Some(rate) => {
                    let solo: Vec<f64> = idx
                        .iter()
                        .map(|&i| bytes[i] as f64 / alone[i].max(1e-12))
                        .collect();
                    staggered_load_times_at(&works, &at, &solo, rate)
                }
                None => staggered_load_times(&works, &at),
            };
            for (&i, t) in idx.iter().zip(times) {
                ld[i] = t;
            }
        }
        return;
    }
    for (i, d) in plan.devices.iter().enumerate() {
        let mine = bytes[i];
        if mine == 0 {
            continue;
        }
        let mates = cluster.disk_mates(&d.name);
        let served: u64 = plan
            .devices
            .iter()
            .zip(&bytes)
            .filter(|(o, _)| mates.contains(&o.name.as_str()))
            .map(|(_, &b)| b.min(mine))
            .sum();
        ld[i] *= served.max(mine) as f64 / mine as f64;
    }
}

/// When each device's load of stage `k` starts, one micro-batch in flight: in the round of
/// stage `k−1` (the last round of the token before for `k = 0`), once the device's slot is
/// released after its offloaded run, counted from that round's pass start: the compute and
/// hops of the devices before it (`compute`, `hops`: that round's `C_j` and `e_j`) plus its
/// own compute up to the end of its last offloaded block (`release`; a stage without
/// offloaded blocks released its slot earlier, so its start is the pass's). // seconds
pub fn load_starts(compute: &[f64], hops: &[f64], release: &[f64]) -> Vec<f64> {
    let mut at = 0.0;
    (0..compute.len())
        .map(|i| {
            let s = at + release.get(i).copied().unwrap_or(0.0);
            at += compute[i] + hops.get(i).copied().unwrap_or(0.0);
            s
        })
        .collect()
}

/// Compute from a stage's start to the end of its last offloaded block (0 without one).
/// // seconds
pub fn stage_release(stage: &StagePlan, t_attn: f64, t_mlp: f64) -> f64 {
    let blocks = 2 * stage.layers.len();
    match (0..blocks).rev().find(|&i| block_offloaded(stage, i)) {
        None => 0.0,
        Some(last) => (0..=last)
            .map(|i| if i % 2 == 0 { t_attn } else { t_mlp })
            .sum(),
    }
}

/// Compute a load slows (overlapped mode): device `i`'s load of its next offloaded blocks
/// starts once its stage's offloaded run is done and runs while the devices on its machine
/// compute (its disk group, [`Cluster::disk_mates`]; itself alone without one), and a block
/// computes `σ_i` slower beside a load (the profile's `load_slowdown`, measured by the
/// probe). So `σ_i · min(ld_i, Σ_mates C_j − off_i)` is added to device `i`'s compute of the
/// round: the part of the machine's compute the load can overlap, never more than the load
/// lasts. Sequential mode loads before it computes, so nothing overlaps there.
fn slow_under_loads(
    plan: &Plan,
    cluster: &Cluster,
    devs: &[&Device],
    ld: &[f64],
    off: &[f64],
    ci: &mut [f64],
) {
    let before = ci.to_vec();
    for (i, d) in plan.devices.iter().enumerate() {
        let sigma = devs[i].profile.load_slowdown;
        if sigma <= 0.0 || ld[i] <= 0.0 {
            continue;
        }
        let mates = cluster.disk_mates(&d.name);
        let machine: f64 = plan
            .devices
            .iter()
            .zip(&before)
            .filter(|(o, _)| mates.contains(&o.name.as_str()))
            .map(|(_, &c)| c)
            .sum();
        ci[i] += load_slowdown_extra(sigma, ld[i], machine - off[i]);
    }
}

/// Extra compute of a load of `ld` seconds beside `overlappable` seconds of compute that runs
/// `sigma` slower under it: `σ · min(ld, overlappable)` (0 for σ ≤ 0).  // seconds
pub fn load_slowdown_extra(sigma: f64, ld: f64, overlappable: f64) -> f64 {
    if sigma > 0.0 {
        sigma * ld.min(overlappable).max(0.0)
    } else {
        0.0
    }
}

/// Prices a plan with the cost model. Errors only if a plan device is not in the cluster.
pub fn evaluate(plan: &Plan, shape: &ModelShape, cluster: &Cluster) -> Result<Cost, PlanError> {
    evaluate_batched(plan, shape, cluster, 1)
}

/// [`evaluate`] with every micro-batch carrying `seqs` sequences (continuous batching): a
/// block runs once for the `seqs` tokens of a micro-batch at `t(seqs)`
/// ([`block_times_batched`]), a hop carries `seqs` activations (and the return trip `seqs`
/// results), an offloaded block is read once per micro-batch (sequential) or per round
/// (overlapped), and a round yields `seqs` tokens per micro-batch, so
/// `ms/token = Σ_k round_k / (b · seqs)` (bursty; `/ seqs` sporadic). `seqs = 1` is
/// [`evaluate`].
pub fn evaluate_batched(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    seqs: u32,
) -> Result<Cost, PlanError> {
    evaluate_rows(plan, shape, cluster, seqs, 1)
}

/// [`evaluate_batched`] with each sequence feeding `positions` positions per step (a
/// speculative step verifies the pending token and `positions − 1` drafts): every block runs
/// for `seqs · positions` rows ([`block_times_rows`]), a hop carries that many activations
/// and the return trip that many results, and memory counts the `positions − 1` extra KV
/// rows per sequence written before the rejected ones are dropped. Figures are per
/// *sequence step* (one verification of each sequence), not per accepted token: divide by
/// the expected tokens per step (`crate::speculate`). `positions = 1` is
/// [`evaluate_batched`].
pub fn evaluate_rows(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    seqs: u32,
    positions: u32,
) -> Result<Cost, PlanError> {
    let q = seqs.max(1);
    let pos = positions.max(1);
    let rows = q.saturating_mul(pos);
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
        .map(|d| block_times_rows(d, shape, plan.context, b, q, pos, plan.loader))
        .collect();
    let nd = devs.len();
    // Transfers of one micro-batch: one activation per row per hop, one result per row
    // returned.
    let batched_shape = ModelShape {
        act_bytes_per_token: shape.act_bytes_per_token.saturating_mul(rows as u64),
        return_bytes: Some(shape.return_bytes_per_token().saturating_mul(rows as u64)),
        ..shape.clone()
    };
    let shape_io = if rows == 1 { shape } else { &batched_shape };
    let c = round_comm(shape_io, cluster, nd);
    let e = per_hop_comm(shape_io, cluster, nd);
    let link = link_time(shape_io, cluster, nd);
    let c_last = last_round_comm(shape_io, cluster, nd);
    let e_ret = return_comm(shape_io, cluster, nd);
    let link_last = last_link_time(shape_io, cluster, nd);
    // The runtime's fixed costs: every hop wakes its receiving device; the coordinator's
    // part of a step lengthens the last round's pass.
    let wakes: Vec<f64> = devs.iter().map(|d| d.profile.hop_wake).collect();
    let wake_pass = pass_wakes(&wakes);
    // What the setup's warm-up found a hop to cost beyond that (`hop_extra`): the run queue
    // of a machine the workers and their loaders share, so no load progresses in it. Added
    // to each round's pass after the overlap, not offered to the loads.
    let extras: Vec<f64> = devs.iter().map(|d| d.profile.hop_extra).collect();
    let bf = b as f64;
    let qf = q as f64;
    let bursty = plan.pattern == Pattern::Bursty;
    let per_tok = if bursty { bf } else { 1.0 } * qf; // tokens per round
    let rounds = plan
        .devices
        .iter()
        .map(|d| d.stages.len())
        .max()
        .unwrap_or(0);
    // Per round: each device's hop out of it for one micro-batch (the return trip for the
    // head's device in the last round), its compute and where its slot is released; the
    // starts of the loads of round k follow from round k−1's ([`load_starts`]).
    let hops_of = |k: usize| -> Vec<f64> {
        let last_round = k + 1 == rounds;
        plan.devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let wake = if nd > 1 { wakes[(i + 1) % nd] } else { 0.0 };
                wake + if last_round && d.holds_head { e_ret } else { e }
            })
            .collect()
    };
    // Device i's compute in round k for one micro-batch: its stage's blocks, and the head on
    // the head's device in the last round.  // seconds
    let round_compute = |i: usize, k: usize| -> f64 {
        let (d, t) = (&plan.devices[i], &times[i]);
        let head = if d.holds_head && k + 1 == rounds {
            t.head
        } else {
            0.0
        };
        head + d
            .stages
            .get(k)
            .map_or(0.0, |st| st.counts().0 as f64 * (t.attn + t.mlp))
    };
    let starts_of = |k: usize| -> Vec<f64> {
        let prev = (k + rounds - 1) % rounds.max(1);
        let comp: Vec<f64> = (0..nd).map(|i| round_compute(i, prev)).collect();
        let release: Vec<f64> = (0..nd)
            .map(|i| {
                let t = &times[i];
                plan.devices[i]
                    .stages
                    .get(prev)
                    .map_or(0.0, |st| stage_release(st, t.attn, t.mlp))
            })
            .collect();
        load_starts(&comp, &hops_of(prev), &release)
    };
    let staggered = b == 1 && nd > 1;
    let mut total = CostBreakdown::default();
    let mut dev_compute = vec![0.0; nd];
    let mut dev_load = vec![0.0; nd];
    let mut dev_stall = vec![0.0; nd];
    for k in 0..rounds {
        let last_round = k + 1 == rounds;
        let (c, link) = if last_round {
            (c_last + wake_pass, link_last)
        } else {
            (c + wake_pass, link)
        };
        let co = if last_round {
            cluster.coordinator.max(0.0)
        } else {
            0.0
        };
        // Per device: what its hop out of this round costs one micro-batch (the return trip
        // for the head's device in the last round).
        let hop = hops_of(k);
        let mut ci = vec![0.0; nd];
        let mut ld = vec![0.0; nd];
        let mut off = vec![0.0; nd];
        for (i, d) in plan.devices.iter().enumerate() {
            let t = &times[i];
            ci[i] = round_compute(i, k);
            let Some(st) = d.stages.get(k) else { continue };
            let (_, a, m) = st.counts();
            ld[i] = t.loader.load_time(st.offloaded_bytes(shape), a + m);
            off[i] = stage_span(st, t.attn, t.mlp);
        }
        if plan.mode == ExecMode::Overlapped {
            let starts = staggered.then(|| starts_of(k));
            share_disks(plan, shape, cluster, k, starts.as_deref(), &mut ld);
            slow_under_loads(plan, cluster, &devs, &ld, &off, &mut ci);
        }
        // Sequential mode reads every offloaded block once per micro-batch; overlapped mode
        // once per round for all of them.
        let ld_per_tok = if plan.mode == ExecMode::Sequential {
            qf
        } else {
            per_tok
        };
        for i in 0..nd {
            dev_compute[i] += ci[i] / qf;
            dev_load[i] += ld[i] / ld_per_tok;
        }
        let sum_c: f64 = ci.iter().sum();
        let mut co_part = co;
        let (compute, comm, uncov, stall_of): (f64, f64, f64, Vec<f64>) = match plan.mode {
            ExecMode::Overlapped => {
                let parts: Vec<DeviceRound> = (0..nd)
                    .map(|i| DeviceRound {
                        compute: ci[i],
                        g: ld[i] + off[i],
                    })
                    .collect();
                let (r, part) = coordinated_round(&parts, b, c, link, co);
                co_part = part;
                (r.compute, r.comm, r.time - r.period, r.stalls)
            }
            ExecMode::Sequential if !bursty => {
                let u: f64 = ld.iter().sum();
                (sum_c, c, u, ld.clone())
            }
            ExecMode::Sequential => {
                let sum_ld: f64 = ld.iter().sum();
                let pass = sum_c + c + co + sum_ld;
                let (wi, worst) = (0..nd)
                    .map(|i| (i, bf * (ci[i] + ld[i] + hop[i])))
                    .fold((0, f64::MIN), |acc, x| if x.1 > acc.1 { x } else { acc });
                if pass >= worst {
                    (sum_c, c, sum_ld, ld.clone())
                } else {
                    co_part = 0.0;
                    let mut st = vec![0.0; nd];
                    st[wi] = bf * ld[wi];
                    (bf * ci[wi], bf * hop[wi], bf * ld[wi], st)
                }
            }
        };
        total.compute_ms += compute * 1e3 / per_tok;
        let extra = round_extra(&extras, b, bursty);
        total.comm_ms += (comm + extra) * 1e3 / per_tok;
        total.uncovered_load_ms += uncov * 1e3 / per_tok;
        total.coordinator_ms += co_part * 1e3 / per_tok;
        for i in 0..nd {
            dev_stall[i] += stall_of[i] / per_tok;
        }
    }
    let devices = plan
        .devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            // A speculative step writes `positions − 1` more rows per sequence before the
            // rejected ones are dropped.
            let context = plan.context + b as u64 * (rows - q) as u64;
            let mem = device_memory(
                shape,
                plan.mode,
                &d.stages,
                d.holds_embedding,
                d.holds_head,
                context,
                b.saturating_mul(rows),
            );
            let kv = shape.kv_bytes_of(stage_layers(&d.stages), context);
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
                // sliding layers stop growing at their window
                first_threshold: shape.kv_tokens_within(d.layer_count() as u64, left),
            }
        })
        .collect())
}
