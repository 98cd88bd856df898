//! A session's per-device numbers for `/metrics`: each plan device's step sums (compute,
//! load stall, queueing, network), the KV bytes its layers hold against the room its budget
//! leaves for KV, and what online adaptation did there (read from the adaptation report).
//!
//! KV bytes held on a device are the tokens held by the pipeline's sequences times the
//! device's layers times a layer's K and V per token as the workers store them (f32); with
//! adaptation on, its report's figures (which follow plan switches) are taken instead.

use serde::Serialize;

use super::Session;
use crate::coordinator::DeviceStepTotals;

/// One plan device's numbers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceStats {
    /// device name
    pub name: String,
    /// its step sums since the pipeline started
    pub steps: DeviceStepTotals,
    /// KV held now  // bytes
    pub kv_used: u64,
    /// KV room of its layout (`None`: not reported)  // bytes
    pub kv_budget: Option<u64>,
    /// online adaptation there, when on
    pub adapt: Option<DeviceAdaptStats>,
}

/// What online adaptation did on one device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DeviceAdaptStats {
    /// plan switches applied (acknowledged by the worker)
    pub switches: u32,
    /// KV thresholds crossed
    pub crossings: u32,
    /// current threshold `TS`  // tokens
    pub threshold: Option<u64>,
    /// most KV held  // bytes
    pub kv_peak: u64,
    /// (attention, MLP) blocks offloaded per stage now
    pub offloaded: (u32, u32),
    /// KV rows lent to a peer per stage now  // tokens
    pub lent_tokens: u64,
    /// bytes reserved here for peers' lent KV now  // bytes
    pub borrowed_bytes: u64,
    /// sequences evicted over the run (the pipeline's: every device drops them)
    pub evictions: u64,
    /// KV evicted here over the run, to be recomputed  // bytes
    pub evicted_bytes: u64,
}

impl Session {
    /// Each plan device's numbers now, in plan order.
    pub fn device_stats(&self) -> Vec<DeviceStats> {
        let c = &self.manifest.config;
        let per_layer = 2 * (c.num_kv_heads * c.head_dim) as u64 * 4; // bytes per token
        let tokens = self.pipeline.held_tokens();
        let steps = self.pipeline.device_totals();
        let adapt = self.adaptation();
        self.plan
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let memory = self
                    .reports
                    .iter()
                    .find(|r| r.endpoint.name == d.name)
                    .and_then(|r| r.memory.as_ref());
                let mut s = DeviceStats {
                    name: d.name.clone(),
                    steps: steps.get(i).copied().unwrap_or_default(),
                    kv_used: tokens
                        .saturating_mul(u64::from(d.layer_count()))
                        .saturating_mul(per_layer),
                    kv_budget: memory.map(|m| m.kv_budget),
                    adapt: None,
                };
                let evictions = adapt.as_ref().map_or(0, |a| a.evictions);
                if let Some(a) = adapt.as_ref().and_then(|a| a.devices.get(i)) {
                    s.kv_used = a.kv_bytes;
                    s.kv_budget = Some(a.kv_budget);
                    s.adapt = Some(DeviceAdaptStats {
                        switches: a.switches_applied,
                        crossings: a.crossings.len() as u32,
                        threshold: a.threshold,
                        kv_peak: a.kv_peak_bytes,
                        offloaded: a.offloaded,
                        lent_tokens: a.lent_tokens,
                        borrowed_bytes: a.borrowed_bytes,
                        evictions,
                        evicted_bytes: a.evicted_bytes,
                    });
                }
                s
            })
            .collect()
    }
}
