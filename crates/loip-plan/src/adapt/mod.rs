//! LOIP's online memory adaptation (design §6): one pure policy, shared by the simulator and
//! the runtime.
//!
//! Pure: no clocks, no I/O. Inputs are the KV tokens held, measured step times and link
//! bandwidth, and the block times of each device (the caller's model: the simulator's
//! [`BlockTimes`] or the runtime's profiles); outputs are decisions ([`AdaptEvent`]s and the
//! layouts they lead to).
//!
//! - [`switch`]: the pieces both users share: thresholds `TS_i^j` (KV tokens a layout can
//!   hold), the choice of a threshold switch (α more attention / β more MLP blocks offloaded
//!   per stage, the same in every stage, or brought back: the least `g = ld + span` that
//!   fits), the layout it leads to, and the Eq. 8 lending amount with the `n_ts` dead band
//!   (shrink at once, grow only near a threshold).
//! - [`admission`]: a plan for the KV held at admission that adaptation carries to the
//!   whole context.
//! - [`policy`]: the whole decision loop over a pipeline of devices ([`Adapter`]), in the
//!   cost model's memory terms; the simulator drives it step by step.
//!
//! Invariant: a decision never lets a device's predicted memory exceed its budget while a
//! layout that fits exists; when none does, eviction (the last resort) takes the rest.

pub mod admission;
pub mod policy;
pub mod priced;
pub mod switch;

pub use admission::{can_grow_to, plan_for_admission};
pub use policy::{Adapter, BlockTimes, DevState, Measure};
pub use priced::evaluate_switched;
pub use switch::{
    choose_switch, counts_max, lend_cap_tokens, lend_grow, lend_shrink, lend_update, stage_layout,
    steps_served, threshold, SwitchVsEvict,
};

use serde::{Deserialize, Serialize};

/// What a method does when the KV cache outgrows its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvPolicy {
    /// LOIP's online adaptation (design §6): thresholds with block offloading, KV lending
    /// when `lending`, eviction + recomputation only when nothing else frees enough.
    Adaptive {
        /// Whether KV lending to a peer is allowed.
        lending: bool,
    },
    /// Evict the oldest KV and recompute it in every forward pass (the baselines).
    Recompute,
}

/// Knobs of the online adaptation (design §6).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdaptConfig {
    /// Lending changes smaller than this are ignored (`n_ts`).  // tokens
    pub min_change_tokens: u32,
    /// A threshold switch frees memory for at least this many more tokens per sequence.  // tokens
    pub horizon_tokens: u32,
    /// Fraction of the idle link time that lent KV may use (Eq. 8 with a safety margin).
    pub lend_link_fraction: f64,
    /// Evict instead of switching where [`SwitchVsEvict`] prices eviction lower. Off by
    /// default: eviction stays the last resort (design §6), because the rule does not yet
    /// price the wait of the evicted sequences (held back, they run after the others rather
    /// than beside them; on llama-1b it chose eviction and the run was slower).
    pub evict_over_switch: bool,
}

impl Default for AdaptConfig {
    fn default() -> Self {
        AdaptConfig {
            min_change_tokens: 16,
            horizon_tokens: 32,
            lend_link_fraction: 0.5,
            evict_over_switch: false,
        }
    }
}

/// One sample of a device's memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MemorySample {
    /// Time (virtual in the simulator; since the run began in the runtime).  // seconds
    pub time_s: f64,
    /// Decoding step.
    pub step: u32,
    /// KV tokens the device's layers hold, summed over sequences (before lending).  // tokens
    pub tokens: u64,
    /// Total memory in use.  // bytes
    pub total: u64,
    /// Weights (retained blocks, slot, embedding/head) and working buffers.  // bytes
    pub weights: u64,
    /// KV cache held locally.  // bytes
    pub kv_local: u64,
    /// KV this device has lent to a peer (not held here).  // bytes
    pub kv_lent: u64,
    /// KV peers have lent to this device (held here).  // bytes
    pub kv_borrowed: u64,
    /// KV evicted (to be recomputed).  // bytes
    pub kv_evicted: u64,
}

/// What the online adaptation did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum AdaptEvent {
    /// A threshold was reached: offloaded blocks per stage changed.
    Switch {
        /// Step it applies from.
        step: u32,
        /// Device index in the plan.
        device: usize,
        /// KV tokens held when it triggered.  // tokens
        tokens: u64,
        /// (attention, MLP) offloaded per stage before.
        from: (u32, u32),
        /// After.
        to: (u32, u32),
    },
    /// KV lending started or changed.
    Lend {
        /// Step it applies from.
        step: u32,
        /// Lending device.
        device: usize,
        /// Borrowing device.
        peer: usize,
        /// Tokens lent per stage (0: stopped).  // tokens
        tokens: u64,
    },
    /// KV evicted: in the simulator recomputed in every pass; in the runtime, whole
    /// sequences released everywhere and re-prefilled once when they run again.
    Evict {
        /// Step it applies from.
        step: u32,
        /// Simulator: tokens recomputed per sequence per pass; runtime: the evicted
        /// sequences' KV tokens.  // tokens
        tokens: u32,
    },
}

impl AdaptEvent {
    /// The step the event applies from.
    pub fn step(&self) -> u32 {
        match self {
            AdaptEvent::Switch { step, .. }
            | AdaptEvent::Lend { step, .. }
            | AdaptEvent::Evict { step, .. } => *step,
        }
    }
}
