//! What the serving loop reports after each step (`/health`, `/metrics`, the dashboard):
//! below both the loop and the metrics that read it.

use loip_engine::speculate::{SpecStats, Speculate};

/// What `/health` and `/metrics` read of the loop, updated after each step.
#[derive(Debug, Clone, Default)]
pub struct LoopStats {
    /// requests waiting for admission
    pub queued: usize,
    /// admitted sequences
    pub running: usize,
    /// KV bytes written by the running sequences  // bytes
    pub kv_used: u64,
    /// KV bytes promised to the running sequences (their worst case)  // bytes
    pub kv_reserved: u64,
    /// sequences in the last step
    pub last_batch: usize,
    /// steps run
    pub steps: u64,
    /// seconds spent in steps, all together  // s
    pub step_s: f64,
    /// the KV budget of the device  // bytes (u64::MAX: unlimited)
    pub kv_budget: u64,
    /// what the device did in all steps so far (a device run from slice files)
    pub device: DeviceTotals,
    /// what speculation drafted and kept so far, per source
    pub spec: Vec<(Speculate, SpecStats)>,
    /// prompt positions copied from another sequence's KV rather than computed, so far
    /// (sequences with the same prompt: the `n` choices of a request) // tokens
    pub shared_tokens: u64,
    /// finished sequences whose KV is kept for later prompts that begin alike
    pub prompt_cache_sequences: usize,
    /// tokens their KV holds // tokens
    pub prompt_cache_tokens: u64,
}

/// Time and bytes of a device over the steps run so far.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceTotals {
    /// computing blocks  // s
    pub compute_s: f64,
    /// waiting for offloaded blocks to load (not hidden behind compute)  // s
    pub load_stall_s: f64,
    /// read from slice files  // bytes
    pub loaded_bytes: u64,
}
