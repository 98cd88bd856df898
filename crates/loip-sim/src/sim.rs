//! What a simulation takes and what it reports.
//!
//! A run decodes `output_tokens` tokens for each of `sequences` requests whose prompts
//! (`prompt_tokens` each) are already in the KV cache: the prompt phase is not simulated, and
//! ms/token is decode time per generated token, `(end of the last step) / (steps · sequences)`.
//! Sporadic traffic is one sequence; bursty traffic is `|D|` sequences in flight, each a
//! micro-batch of one (pipeline methods) or together one batch (tensor-parallel methods).

use crate::bandwidth::BandwidthTrace;
use loip_plan::Pattern;
use serde::{Deserialize, Serialize};

pub use loip_plan::adapt::{AdaptConfig, AdaptEvent, KvPolicy, MemorySample};

/// Everything a run needs besides the plan and the cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimConfig {
    /// Prompt tokens per sequence, in the KV cache when decoding starts.  // tokens
    pub prompt_tokens: u32,
    /// Tokens decoded per sequence.  // tokens
    pub output_tokens: u32,
    /// Request pattern.
    pub pattern: Pattern,
    /// Sequences in flight: 1 for sporadic, `|D|` for bursty by default.
    pub sequences: u32,
    /// KV overflow handling.
    pub kv_policy: KvPolicy,
    /// Adaptation knobs.
    pub adapt: AdaptConfig,
    /// Link bandwidth per decoding step.
    pub bandwidth: BandwidthTrace,
    /// Link latency per transfer.  // seconds
    pub latency: f64,
    /// Stop early once the mean is clearly over the OOT limit (saves time on hopeless runs).
    pub stop_when_oot: bool,
    /// Stop once the virtual clock passes this (the run is then OOT): set when the run can
    /// only matter if it beats one that took this long.  // seconds
    #[serde(default)]
    pub stop_after_s: Option<f64>,
    /// Record memory per device at every step.
    pub record_memory: bool,
    /// TPI-LLM's sliding slots, the layer shards streamed through (the rest of its window,
    /// sized from memory by `tp::tpi_window`, stays resident).
    pub tpi_window_layers: u32,
    /// Fixed cost a framework adds to every pass of a micro-batch through a stage (pipeline
    /// methods) or of a token through a device (tensor parallelism): see
    /// `Method::framework`.  // seconds
    #[serde(default)]
    pub pass_overhead_s: f64,
}

impl SimConfig {
    /// A config with the defaults used by the experiments.
    pub fn new(
        pattern: Pattern,
        sequences: u32,
        bandwidth: BandwidthTrace,
        latency: f64,
    ) -> SimConfig {
        SimConfig {
            prompt_tokens: 512,
            output_tokens: 128,
            pattern,
            sequences: sequences.max(1),
            kv_policy: KvPolicy::Adaptive { lending: true },
            adapt: AdaptConfig::default(),
            bandwidth,
            latency,
            stop_when_oot: true,
            stop_after_s: None,
            record_memory: false,
            tpi_window_layers: 2,
            pass_overhead_s: 0.0,
        }
    }

    /// OOT limit of the pattern: 5 s/token sporadic, 2 s/token bursty.  // milliseconds
    pub fn oot_limit_ms(&self) -> f64 {
        oot_limit_ms(self.pattern)
    }
}

/// OOT limit of a pattern: 5 s/token sporadic, 2 s/token bursty.  // milliseconds
pub fn oot_limit_ms(pattern: Pattern) -> f64 {
    match pattern {
        Pattern::Sporadic => 5000.0,
        Pattern::Bursty => 2000.0,
    }
}

/// Outcome class of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Ran to the end within the time limit.
    Ok,
    /// The method cannot place its weights.
    Oom,
    /// Slower than the pattern's limit.
    Oot,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Status::Ok => "ok",
            Status::Oom => "oom",
            Status::Oot => "oot",
        })
    }
}

/// Per-device totals of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceReport {
    /// Device name.
    pub name: String,
    /// Budget.  // bytes
    pub budget: u64,
    /// Highest memory in use.  // bytes
    pub peak_memory: u64,
    /// First threshold `TS¹` at the start: KV tokens it can hold, if it holds any KV.  // tokens
    pub first_threshold: Option<u64>,
    /// Compute busy time.  // seconds
    pub compute_s: f64,
    /// SSD loader busy time.  // seconds
    pub load_s: f64,
    /// Bytes sent on its egress port (activations and lent KV; collectives excluded).  // bytes
    pub bytes_sent: f64,
}

/// Result of one simulated run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// ok / oom / oot.
    pub status: Status,
    /// Why OOM, when it is.
    pub note: Option<String>,
    /// Decode time per generated token (all sequences).  // milliseconds
    pub ms_per_token: f64,
    /// The same over the second half of the steps only.  // milliseconds
    pub steady_ms_per_token: f64,
    /// Steps simulated (fewer than asked when stopped as OOT).
    pub steps: u32,
    /// End time of every step.  // seconds
    pub step_end_s: Vec<f64>,
    /// Per device.
    pub devices: Vec<DeviceReport>,
    /// Adaptation events.
    pub events: Vec<AdaptEvent>,
    /// Memory per device per step, when recorded (outer index: device).
    pub memory: Vec<Vec<MemorySample>>,
}

impl SimReport {
    /// A report for a run that could not start.
    pub fn oom(note: String) -> SimReport {
        SimReport {
            status: Status::Oom,
            note: Some(note),
            ms_per_token: f64::NAN,
            steady_ms_per_token: f64::NAN,
            steps: 0,
            step_end_s: Vec::new(),
            devices: Vec::new(),
            events: Vec::new(),
            memory: Vec::new(),
        }
    }

    /// Mean ms/token over steps `from..to` (end exclusive), all sequences.  // milliseconds
    pub fn window_ms_per_token(&self, from: usize, to: usize, sequences: u32) -> f64 {
        let to = to.min(self.step_end_s.len());
        if to <= from {
            return f64::NAN;
        }
        let start = if from == 0 {
            0.0
        } else {
            self.step_end_s[from - 1]
        };
        (self.step_end_s[to - 1] - start) * 1e3 / ((to - from) as f64 * sequences.max(1) as f64)
    }

    /// Fills `ms_per_token`, `steady_ms_per_token`, `steps` and `status` from the step times.
    pub(crate) fn finish(&mut self, sequences: u32, limit_ms: f64, wanted_steps: u32) {
        let n = self.step_end_s.len();
        self.steps = n as u32;
        self.ms_per_token = self.window_ms_per_token(0, n, sequences);
        self.steady_ms_per_token = self.window_ms_per_token(n / 2, n, sequences);
        if self.status == Status::Ok && (self.steps < wanted_steps || self.ms_per_token > limit_ms)
        {
            self.status = Status::Oot;
        }
    }
}
