//! The plan: what every device runs, in which order, and what stays in memory.
//!
//! A [`Plan`] is produced by a planner, consumed by the runtime (workers execute it) and the
//! simulator, and can be written to JSON, reviewed, hand-edited and checked again with
//! [`Plan::validate`].
//!
//! Invariants of a valid plan (design §2):
//! - every device has exactly `stages_per_device` non-empty stages;
//! - reading stages in round-robin order (device 1 stage 1, device 2 stage 1, …, device 1
//!   stage 2, …) gives the layers `0..L`, each exactly once, in increasing order;
//! - the first device holds the embedding, the last one the final norm + LM head;
//! - every device's memory at the planned context is within its budget.
//!
//! This module holds the plan types alone, below the cluster, the cost model and the
//! planners that all use them; checking and repricing a plan against a cluster
//! ([`Plan::validate`], [`Plan::reprice`]) need the cost model and live in `check.rs`.

use crate::profile::LoaderKind;
use crate::shape::ModelShape;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Names of the planners, `loip` first: what a plan's `planner` and a cluster file's
/// `plan.planner` may say. The registry (`planners::planners`) holds one planner for each,
/// in this order.
pub const PLANNER_NAMES: [&str; 7] = [
    "loip",
    "loip-conventional-load",
    "loip-paper",
    "loip-uniform",
    "pp",
    "pp-offload",
    "edgeshard",
];

/// Request pattern (design §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pattern {
    /// One request at a time: a token passes all stages before the next starts.
    #[default]
    Sporadic,
    /// `micro_batches` sequences in flight, one after another through the stages.
    Bursty,
}

impl std::str::FromStr for Pattern {
    type Err = String;
    fn from_str(s: &str) -> Result<Pattern, String> {
        match s {
            "sporadic" => Ok(Pattern::Sporadic),
            "bursty" => Ok(Pattern::Bursty),
            _ => Err(format!("unknown pattern `{s}` (valid: sporadic, bursty)")),
        }
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Pattern::Sporadic => "sporadic",
            Pattern::Bursty => "bursty",
        })
    }
}

/// How a device's offloaded blocks are loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecMode {
    /// LOIP: one slot per device holds a whole stage's offloaded blocks; the next stage's
    /// blocks load while other devices compute.
    #[default]
    Overlapped,
    /// Conventional offloading (`pp-offload`): each offloaded block is read into a one-block
    /// buffer when it is needed, after the resident layers before it ran; loads are not hidden.
    Sequential,
}

/// Where a block lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// Kept in memory for the whole run.
    Retained,
    /// Read from the device's SSD into the slot each time its stage runs.
    Offloaded,
}

impl Residency {
    /// Whether the block is offloaded.
    pub fn is_offloaded(self) -> bool {
        self == Residency::Offloaded
    }
}

/// One layer inside a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPlan {
    /// Global layer index (0-based).
    pub layer: u32,
    /// Attention block residency.
    pub attn: Residency,
    /// MLP block residency.
    pub mlp: Residency,
}

/// One pipeline stage of a device: contiguous layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagePlan {
    /// Layers in execution order.
    pub layers: Vec<LayerPlan>,
}

impl StagePlan {
    /// Global layer range `first..last+1` (empty for an empty stage).
    pub fn layer_range(&self) -> Range<u32> {
        match (self.layers.first(), self.layers.last()) {
            (Some(f), Some(l)) => f.layer..l.layer + 1,
            _ => 0..0,
        }
    }

    /// `(n, a, m)`: layers, offloaded attention blocks, offloaded MLP blocks.
    pub fn counts(&self) -> (u32, u32, u32) {
        let a = self.layers.iter().filter(|l| l.attn.is_offloaded()).count() as u32;
        let m = self.layers.iter().filter(|l| l.mlp.is_offloaded()).count() as u32;
        (self.layers.len() as u32, a, m)
    }

    /// Bytes of this stage's offloaded blocks.  // bytes
    pub fn offloaded_bytes(&self, shape: &ModelShape) -> u64 {
        let (_, a, m) = self.counts();
        a as u64 * shape.attn_bytes + m as u64 * shape.mlp_bytes
    }

    /// Bytes of this stage's retained blocks.  // bytes
    pub fn retained_bytes(&self, shape: &ModelShape) -> u64 {
        let (n, a, m) = self.counts();
        (n - a) as u64 * shape.attn_bytes + (n - m) as u64 * shape.mlp_bytes
    }

    /// Builds a stage of layers `first..first+n` whose offloaded blocks (`a` attention, `m`
    /// MLP) form the tightest contiguous run at the end of the stage, so that its compute
    /// span is [`crate::cost::span`]`(a, m)`. Requires `a, m <= n`.
    pub fn with_offload(first: u32, n: u32, a: u32, m: u32) -> StagePlan {
        let (a, m) = (a.min(n), m.min(n));
        let mut layers: Vec<LayerPlan> = (first..first + n)
            .map(|layer| LayerPlan {
                layer,
                attn: Residency::Retained,
                mlp: Residency::Retained,
            })
            .collect();
        let n = n as usize;
        let (a, m) = (a as usize, m as usize);
        if a >= m {
            // Run A_j P_j … A_{n-1} (a ≥ m): attention of the last a layers; MLP of the m
            // layers just before the last one (all of them when a == m).
            let mlp_end = if a == m { n } else { n - 1 };
            for l in &mut layers[n - a..] {
                l.attn = Residency::Offloaded;
            }
            for l in &mut layers[mlp_end - m..mlp_end] {
                l.mlp = Residency::Offloaded;
            }
        } else {
            // Run P_j A_{j+1} … P_{n-1} (m > a): MLP of the last m layers; attention of the
            // last a layers (a ≤ m − 1, so they sit inside the run).
            for l in &mut layers[n - m..] {
                l.mlp = Residency::Offloaded;
            }
            for l in &mut layers[n - a..] {
                l.attn = Residency::Offloaded;
            }
        }
        StagePlan { layers }
    }
}

/// What one device runs. The figures after `stages` are derived (by [`crate::cost::evaluate`]);
/// a hand-written plan may omit them and call [`Plan::reprice`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DevicePlan {
    /// Device name (as in the cluster).
    pub name: String,
    /// Whether it holds the token embedding (first device).
    pub holds_embedding: bool,
    /// Whether it holds the final norm + LM head (last device).
    pub holds_head: bool,
    /// Its stages, in execution order.
    pub stages: Vec<StagePlan>,
    /// Memory at the planned context: retained + slot + embedding/head + KV + buffers.  // bytes
    #[serde(default)]
    pub memory_bytes: u64,
    /// Its budget (profile budget − reservation).  // bytes
    #[serde(default)]
    pub budget_bytes: u64,
    /// Slot size: largest stage's offloaded bytes (one block in sequential mode).  // bytes
    #[serde(default)]
    pub slot_bytes: u64,
    /// KV cache at the planned context.  // bytes
    #[serde(default)]
    pub kv_bytes: u64,
    /// Its compute per generated token (all its stages).  // milliseconds
    #[serde(default)]
    pub compute_ms: f64,
    /// Its SSD load time per generated token.  // milliseconds
    #[serde(default)]
    pub load_ms: f64,
    /// Load time it leaves uncovered per generated token (round stalls it causes).  // milliseconds
    #[serde(default)]
    pub stall_ms: f64,
}

impl DevicePlan {
    /// Layers on this device, all stages.
    pub fn layer_count(&self) -> u32 {
        self.stages.iter().map(|s| s.layers.len() as u32).sum()
    }
}

/// A device a planner left out, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DroppedDevice {
    /// Device name.
    pub name: String,
    /// Human-readable reason.
    pub reason: String,
}

/// One stage in global execution order (see [`Plan::stage_order`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageRef {
    /// Index into [`Plan::devices`].
    pub device: usize,
    /// Stage index on that device.
    pub stage: usize,
    /// Global layers it runs.
    pub layers: Range<u32>,
}

/// Where the time of one generated token goes; the parts add up to the total.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct CostBreakdown {
    /// Compute on the critical path.  // milliseconds
    pub compute_ms: f64,
    /// Activation transfers and link latency.  // milliseconds
    pub comm_ms: f64,
    /// SSD load time not hidden behind compute.  // milliseconds
    pub uncovered_load_ms: f64,
    /// The coordinator's own part of a step on the critical path
    /// ([`crate::Cluster::coordinator`]).  // milliseconds
    #[serde(default, skip_serializing_if = "is_zero")]
    pub coordinator_ms: f64,
    /// Threshold switches' parked steps, spread over a run's tokens (a run's pricing only,
    /// [`crate::adapt::evaluate_switched`]; a plan's own evaluation has none).  // milliseconds
    #[serde(default, skip_serializing_if = "is_zero")]
    pub switch_ms: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl CostBreakdown {
    /// Sum of the parts.  // milliseconds
    pub fn total_ms(&self) -> f64 {
        self.compute_ms
            + self.comm_ms
            + self.uncovered_load_ms
            + self.coordinator_ms
            + self.switch_ms
    }
}

/// A complete allocation of a model to devices, with its predicted cost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Model shape name.
    pub shape: String,
    /// Planner that produced it.
    pub planner: String,
    /// `s`: stages per device.
    pub stages_per_device: u32,
    /// Request pattern it was planned for.
    pub pattern: Pattern,
    /// Planned context: KV tokens held, summed over sequences in flight.  // tokens
    pub context: u64,
    /// `b`: sequences in flight (1 for sporadic), each a micro-batch of one.
    pub micro_batches: u32,
    /// Load execution mode.
    pub mode: ExecMode,
    /// Loading path the load times assume.
    pub loader: LoaderKind,
    /// Devices in pipeline order (a subset of the cluster's, same order).
    pub devices: Vec<DevicePlan>,
    /// Cluster devices left out.
    #[serde(default)]
    pub dropped: Vec<DroppedDevice>,
    /// Predicted time per generated token.  // milliseconds
    #[serde(default)]
    pub predicted_ms_per_token: f64,
    /// Its breakdown; the parts add up to `predicted_ms_per_token`.
    #[serde(default)]
    pub breakdown: CostBreakdown,
}

impl Plan {
    /// Stages in global execution order: (device, stage, layers).
    pub fn stage_order(&self) -> Vec<StageRef> {
        let s = self
            .devices
            .iter()
            .map(|d| d.stages.len())
            .max()
            .unwrap_or(0);
        let mut out = Vec::new();
        for stage in 0..s {
            for (device, d) in self.devices.iter().enumerate() {
                if let Some(st) = d.stages.get(stage) {
                    out.push(StageRef {
                        device,
                        stage,
                        layers: st.layer_range(),
                    });
                }
            }
        }
        out
    }

    /// Index into [`Plan::devices`] of the device running `layer`.
    pub fn device_of_layer(&self, layer: u32) -> Option<usize> {
        self.devices.iter().position(|d| {
            d.stages
                .iter()
                .any(|s| s.layers.iter().any(|l| l.layer == layer))
        })
    }

    /// Slot bytes of device `device` (index into [`Plan::devices`]).  // bytes
    pub fn slot_bytes(&self, shape: &ModelShape, device: usize) -> u64 {
        self.devices
            .get(device)
            .map(|d| slot_bytes(self.mode, &d.stages, shape))
            .unwrap_or(0)
    }

    /// Total layers placed.
    pub fn layer_count(&self) -> u32 {
        self.devices.iter().map(|d| d.layer_count()).sum()
    }

    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Parses JSON (does not validate; call [`Plan::validate`]).
    pub fn from_json(text: &str) -> Result<Plan, serde_json::Error> {
        serde_json::from_str(text)
    }
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
