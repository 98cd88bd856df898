//! What online adaptation reports over a run (`loip local --json` "adaptation", `/metrics`,
//! the plot): per device KV, thresholds crossed, switches, lending and eviction.

use loip_plan::adapt::{AdaptEvent, MemorySample};
use serde::Serialize;

/// A threshold a device's KV reached.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Crossing {
    /// decision step (steps admitted so far)
    pub step: u32,
    /// KV tokens held, summed over sequences, with the step  // tokens
    pub tokens: u64,
    /// the threshold `TS` crossed  // tokens
    pub threshold: u64,
    /// seconds since the pipeline started  // seconds
    pub time_s: f64,
}

/// One device's adaptation, as reported.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceAdapt {
    /// device name
    pub name: String,
    /// its budget  // bytes
    pub budget: u64,
    /// KV held now  // bytes
    pub kv_bytes: u64,
    /// most KV held  // bytes
    pub kv_peak_bytes: u64,
    /// KV room of the current layout  // bytes
    pub kv_budget: u64,
    /// current threshold `TS`  // tokens
    pub threshold: Option<u64>,
    /// thresholds reached, in order
    pub crossings: Vec<Crossing>,
    /// switches applied (acknowledged by the worker)
    pub switches_applied: u32,
    /// switches the worker refused (the layout it kept stays; another measure was taken)
    pub switches_refused: u32,
    /// KV lending: the peer it lends to and the rows lent per stage now  // tokens
    pub lent_to: Option<String>,
    /// rows lent per stage now  // tokens
    pub lent_tokens: u64,
    /// KV bytes lending frees here now  // bytes
    pub lent_bytes: u64,
    /// bytes reserved here for peers' lent KV  // bytes
    pub borrowed_bytes: u64,
    /// lent KV fetched back (relayed fetches answered)
    pub fetches: u64,
    /// lent KV bytes that left and came back through the coordinator  // bytes
    pub kv_moved_bytes: u64,
    /// KV evicted here over the run, to be recomputed (the last resort)  // bytes
    pub evicted_bytes: u64,
    /// (attention, MLP) blocks offloaded per stage now
    pub offloaded: (u32, u32),
}

/// What adaptation did over the run (`loip local --json` "adaptation").
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AdaptReport {
    /// per plan device
    pub devices: Vec<DeviceAdapt>,
    /// switches decided, in the simulator's terms (step = decision step)
    pub events: Vec<AdaptEvent>,
    /// steps of new sequences held back because nothing could free enough
    pub held_admissions: u64,
    /// steps of admitted sequences held back until another step finished or a sequence was
    /// released (nothing else could free enough)
    pub held_steps: u64,
    /// KV tokens held now, summed over sequences  // tokens
    pub tokens: u64,
    /// sequences evicted (their KV dropped everywhere, recomputed when they run again)
    pub evictions: u64,
    /// KV tokens recomputed after evictions  // tokens
    pub recomputed_tokens: u64,
    /// micro-batches whose own sequences' KV no layout held together, run as sub-steps
    /// one after another (evicting each other's KV in between)
    pub split_steps: u64,
    /// steps that evicted other sequences rather than switch a layout, because the
    /// recomputation costs less than the switch's extra loads (`adapt/switch_or_evict.rs`)
    pub evictions_over_switch: u64,
    /// every switch priced against eviction: (decision step, both ways, eviction taken)
    pub switch_vs_evict: Vec<(u32, loip_plan::adapt::SwitchVsEvict, bool)>,
    /// lent-KV transfer rate last measured  // bytes/s
    pub lend_bandwidth: Option<f64>,
    /// memory of every device at every switch and crossing: (seconds, device, KV bytes,
    /// weights + slot + working bytes)
    pub samples: Vec<(f64, usize, u64, u64)>,
    /// memory of every plan device at every step admitted, `memory[device][k]`
    pub memory: Vec<Vec<MemorySample>>,
}
