//! The paper-scale experiments of design §10, as data, and their runner.
//!
//! | experiment | setups | methods | bandwidth (Mbit/s) |
//! |---|---|---|---|
//! | `memory-constrained` | 70B on Orin64 + 3×Orin32 + NX16, reservations (i), (ii), (iii) | the seven | 100, 200 |
//! | `end-to-end` | 13B on Orin32 + NX16; 32B on Orin64 + Orin32 + NX16; 70B on 2×Orin64 + Orin32 + NX16 | the seven | 100, 200 |
//! | `dynamic-bandwidth` | the end-to-end setups | the seven | 50–250, changing every 4–32 tokens |
//! | `ablation` | 70B on 2×Orin64 + Orin32 + NX16 | loip and its three ablations | 100, 200, dynamic |
//! | `long-context` | 70B on Orin64 + 3×Orin32 + NX16, reservation (iii), 1024 + 2048 tokens | the seven + `loip-no-kvtransfer` | 100, 200 |
//! | `memory-sweep` | 70B on 5 and on 4 devices, 32B on 3, every budget scaled to [`SWEEP_RATIOS`] × the weight bytes | the seven + `loip-uniform`, `loip-conventional-load` | 100, 200 |
//! | `context-sweep` | 70B on 5 devices, reservation (iii), bursty with `|D|` and `2·|D|` sequences, 512 + [`SWEEP_OUTPUTS`] tokens | the seven + `loip-no-kvtransfer` | 100 |
//! | `reserve-sweep` | 70B on 5 and on 4 devices, [`crate::experiments_long::RESERVE_STEPS_GB`] reserved on every device | the seven | 100 |
//!
//! Every experiment runs both patterns (sporadic: one sequence; bursty: `|D|` sequences)
//! with fixed prompt and output lengths (default 512 + 512 tokens per sequence).
//! `long-context` and the two sweeps are our additions: in this model the paper's
//! memory-constrained setups keep enough headroom that the KV cache of 512 + 512 tokens never
//! reaches a threshold and the weights fit. The memory sweep scales every device's budget
//! (after its reservation) by one factor per point, from 1.3× the weight bytes down to where
//! no method places the model; the context sweep decodes up to 8192 tokens per sequence so
//! that the KV cache outgrows the memory and the online adaptation (§6) runs. The
//! memory-over-time plot comes from the LOIP run with the most adaptation. Experiments that
//! run by name only (not in `all`) are in [`crate::experiments_long`].
//! Devices are the planner crate's Jetson presets; link latency 2 ms (as in
//! `examples/clusters/`). Runs are independent and executed in parallel; results come back
//! in a fixed order, so the output does not depend on scheduling.

use crate::bandwidth::Bandwidth;
use crate::error::SimError;
use crate::methods::{run_method, Method, MethodRun};
use crate::setups::{end_to_end_setups, mem_constrained_setups};
/// The setup and experiment types and the sweeps' setups, defined in [`crate::setups`].
pub use crate::setups::{sweep_base_setups, sweep_setups, Experiment, Setup, SetupDevice};
use crate::shapes::shape;
use crate::sim::{SimConfig, Status};
use loip_plan::Pattern;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Names accepted by [`experiments`] (`all` runs every one).
pub const EXPERIMENT_NAMES: [&str; 9] = [
    "memory-constrained",
    "end-to-end",
    "dynamic-bandwidth",
    "ablation",
    "long-context",
    "memory-sweep",
    "context-sweep",
    "reserve-sweep",
    "all",
];

/// Budget ratios of the memory sweep (total budget / weight bytes), from 1.3 down to below
/// the point where any method places the model.
pub const SWEEP_RATIOS: [f64; 14] = [
    1.3, 1.2, 1.1, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05,
];

/// Output lengths of the context sweep.  // tokens
pub const SWEEP_OUTPUTS: [u32; 5] = [512, 1024, 2048, 4096, 8192];

/// The experiments called `name` (`all`: every one).
pub fn experiments(name: &str) -> Result<Vec<Experiment>, SimError> {
    let both = vec![Pattern::Sporadic, Pattern::Bursty];
    let fixed = vec![Bandwidth::Mbps(100.0), Bandwidth::Mbps(200.0)];
    let make = |n: &str| -> Option<Experiment> {
        Some(match n {
            "memory-constrained" => Experiment {
                name: n.into(),
                title: "Extremely memory-constrained: LLaMA-3.3-70B on Orin64 + 3×Orin32 + NX16, memory reserved (i) none, (ii) 3 GB on two Orin32, (iii) (ii) + 5 GB on Orin64 + 1 GB on NX16".into(),
                setups: mem_constrained_setups(),
                methods: Method::MAIN.to_vec(),
                bandwidths: fixed.clone(),
                patterns: both.clone(),
                lengths: None,
                outputs: Vec::new(),
                sequence_factors: Vec::new(),
            },
            "end-to-end" => Experiment {
                name: n.into(),
                title: "End-to-end: LLaMA-2-13B on Orin32 + NX16; Qwen3-32B on Orin64 + Orin32 + NX16; LLaMA-3.3-70B on 2×Orin64 + Orin32 + NX16".into(),
                setups: end_to_end_setups(),
                methods: Method::MAIN.to_vec(),
                bandwidths: fixed.clone(),
                patterns: both.clone(),
                lengths: None,
                outputs: Vec::new(),
                sequence_factors: Vec::new(),
            },
            "dynamic-bandwidth" => Experiment {
                name: n.into(),
                title: "Dynamic bandwidth: a new bandwidth uniform in 50–250 Mbit/s every 4–32 tokens, end-to-end setups".into(),
                setups: end_to_end_setups(),
                methods: Method::MAIN.to_vec(),
                bandwidths: vec![Bandwidth::PAPER_DYNAMIC],
                patterns: both.clone(),
                lengths: None,
                outputs: Vec::new(),
                sequence_factors: Vec::new(),
            },
            "ablation" => Experiment {
                name: n.into(),
                title: "Ablation: LLaMA-3.3-70B on 2×Orin64 + Orin32 + NX16 without KV transfer, without the scheduler, without the optimized loading path".into(),
                setups: end_to_end_setups().into_iter().filter(|s| s.name == "70b-4dev").collect(),
                methods: Method::ABLATION.to_vec(),
                bandwidths: vec![Bandwidth::Mbps(100.0), Bandwidth::Mbps(200.0), Bandwidth::PAPER_DYNAMIC],
                patterns: both.clone(),
                lengths: None,
                outputs: Vec::new(),
                sequence_factors: Vec::new(),
            },
            "long-context" => Experiment {
                name: n.into(),
                title: "Long context (our addition): LLaMA-3.3-70B on Orin64 + 3×Orin32 + NX16 with reservation (iii), 1024-token prompts, 2048 tokens decoded: KV growth reaches the thresholds".into(),
                setups: mem_constrained_setups().into_iter().filter(|s| s.name == "70b-5dev-iii").collect(),
                methods: Method::MAIN.iter().copied().chain([Method::LoipNoKvtransfer]).collect(),
                bandwidths: fixed.clone(),
                patterns: both.clone(),
                lengths: Some((1024, 2048)),
                outputs: Vec::new(),
                sequence_factors: Vec::new(),
            },
            "memory-sweep" => Experiment {
                name: n.into(),
                title: "Memory sweep: LLaMA-3.3-70B on Orin64 + 3×Orin32 + NX16 and on 2×Orin64 + Orin32 + NX16, Qwen3-32B on Orin64 + Orin32 + NX16, every budget scaled so the total is 1.3× down to 0.05× the weight bytes".into(),
                setups: sweep_setups(&sweep_base_setups(), &SWEEP_RATIOS).ok()?,
                methods: Method::MAIN.iter().copied().chain([Method::LoipUniform, Method::LoipConventionalLoad]).collect(),
                bandwidths: fixed.clone(),
                patterns: both.clone(),
                lengths: None,
                outputs: Vec::new(),
                sequence_factors: Vec::new(),
            },
            "context-sweep" => Experiment {
                name: n.into(),
                title: "Context sweep: LLaMA-3.3-70B on Orin64 + 3×Orin32 + NX16 with reservation (iii), bursty at 100 Mbit/s, |D| and 2·|D| sequences, 512-token prompts, 512 to 8192 tokens decoded: the KV cache outgrows the memory".into(),
                setups: mem_constrained_setups().into_iter().filter(|s| s.name == "70b-5dev-iii").collect(),
                methods: Method::MAIN.iter().copied().chain([Method::LoipNoKvtransfer]).collect(),
                bandwidths: vec![Bandwidth::Mbps(100.0)],
                patterns: vec![Pattern::Bursty],
                lengths: Some((512, 512)),
                outputs: SWEEP_OUTPUTS.to_vec(),
                sequence_factors: vec![1, 2],
            },
            "reserve-sweep" => crate::experiments_long::reserve_sweep(),
            _ => return None,
        })
    };
    if let Some(e) = crate::experiments_long::long_experiment(name) {
        return Ok(vec![e?]);
    }
    if name == "all" {
        return Ok(EXPERIMENT_NAMES[..EXPERIMENT_NAMES.len() - 1]
            .iter()
            .filter_map(|n| make(n))
            .collect());
    }
    make(name)
        .map(|e| vec![e])
        .ok_or_else(|| SimError::UnknownExperiment {
            name: name.to_string(),
            known: EXPERIMENT_NAMES
                .iter()
                .chain(&crate::experiments_long::LONG_EXPERIMENT_NAMES)
                .copied()
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Settings shared by every run of an experiment set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExperimentConfig {
    /// Prompt tokens per sequence.  // tokens
    pub prompt_tokens: u32,
    /// Output tokens per sequence.  // tokens
    pub output_tokens: u32,
    /// Link latency.  // seconds
    pub latency: f64,
    /// Seed of the dynamic bandwidth traces.
    pub seed: u64,
    /// Memory reserved on every device of every setup, besides the setup's own
    /// reservations (`loip simulate --reserve`).  // bytes
    #[serde(default)]
    pub reserve: u64,
}

impl Default for ExperimentConfig {
    fn default() -> Self {
        ExperimentConfig {
            prompt_tokens: 512,
            output_tokens: 512,
            latency: 2e-3,
            seed: 2024,
            reserve: 0,
        }
    }
}

/// One result row: (experiment, setup, method, pattern, bandwidth).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Experiment name.
    pub experiment: String,
    /// Setup name.
    pub setup: String,
    /// Method name.
    pub method: String,
    /// `sporadic` or `bursty`.
    pub pattern: Pattern,
    /// Fixed bandwidth, `None` for dynamic.  // Mbit/s
    pub bandwidth_mbps: Option<f64>,
    /// Total budget over the model's weight bytes.
    pub budget_ratio: f64,
    /// Output tokens per sequence.  // tokens
    pub output_tokens: u32,
    /// Sequences in flight.
    pub sequences: u32,
    /// What the placement was sized for (`run`, `partial`, `prompt`), when placed.
    pub planned_for: Option<String>,
    /// ok / oom / oot.
    pub status: Status,
    /// Simulated decode time per token, when ok.  // milliseconds
    pub ms_per_token: Option<f64>,
    /// The cost model's prediction for the plan at its planned context (pipeline methods).  // milliseconds
    pub predicted_ms_per_token: Option<f64>,
    /// Why OOM.
    pub note: Option<String>,
    /// Threshold switches, lending changes, evictions during the run.
    pub switches: usize,
    /// Lending changes.
    pub lends: usize,
    /// Tokens recomputed per sequence per pass at the end.  // tokens
    pub evicted_tokens: u32,
    /// Stages per device (pipeline methods).
    pub stages: Option<u32>,
}

/// A run kept for the memory-over-time plot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryRun {
    /// Which run.
    pub experiment: String,
    /// Setup.
    pub setup: String,
    /// Pattern.
    pub pattern: Pattern,
    /// Bandwidth label.
    pub bandwidth: String,
    /// The full run.
    pub run: MethodRun,
}

/// Everything an experiment set produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Results {
    /// The experiments, as run.
    pub experiments: Vec<Experiment>,
    /// One record per (experiment, setup, method, pattern, bandwidth), in that order.
    pub records: Vec<Record>,
    /// The LOIP run with the most adaptation (lending first, then switches, then eviction),
    /// for the memory plot.
    pub memory_run: Option<MemoryRun>,
    /// Settings.
    pub config: ExperimentConfig,
}

struct Job {
    exp: usize,
    setup: usize,
    method: Method,
    pattern: Pattern,
    bw: Bandwidth,
    output: Option<u32>,
    factor: u32,
}

fn seed_for(base: u64, setup: &str) -> u64 {
    // FNV-1a of the setup name, mixed with the base seed: one trace per setup.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in setup.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h ^ base
}

/// What one run varies besides setup and method.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunPoint {
    /// Request pattern.
    pub pattern: Pattern,
    /// Link bandwidth.
    pub bw: Bandwidth,
    /// Prompt and output tokens per sequence, overriding the experiment config's.  // tokens
    pub lengths: Option<(u32, u32)>,
    /// Output tokens per sequence, overriding both.  // tokens
    pub output: Option<u32>,
    /// Bursty sequences as a multiple of `|D|`.
    pub factor: u32,
}

/// The config of one run of `setup` at `p`.
pub fn run_config(cfg: &ExperimentConfig, setup: &Setup, p: &RunPoint) -> SimConfig {
    let (pattern, bw) = (p.pattern, p.bw);
    let b = match pattern {
        Pattern::Sporadic => 1,
        Pattern::Bursty => setup.devices.len() as u32 * p.factor.max(1),
    };
    let (prompt, output) = p.lengths.unwrap_or((cfg.prompt_tokens, cfg.output_tokens));
    let output = p.output.unwrap_or(output);
    let trace = bw.trace(output, seed_for(cfg.seed, &setup.name));
    let mut c = SimConfig::new(pattern, b, trace, cfg.latency);
    c.prompt_tokens = prompt;
    c.output_tokens = output;
    c
}

/// Runs `exps`; `progress(done, total)` is called after every run (from worker threads).
pub fn run_experiments(
    exps: Vec<Experiment>,
    cfg: &ExperimentConfig,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Results, SimError> {
    let mut jobs = Vec::new();
    for (ei, e) in exps.iter().enumerate() {
        for (si, _) in e.setups.iter().enumerate() {
            for &pattern in &e.patterns {
                for &bw in &e.bandwidths {
                    for &factor in &e.factor_list() {
                        for &output in &e.output_list() {
                            for &method in &e.methods {
                                jobs.push(Job {
                                    exp: ei,
                                    setup: si,
                                    method,
                                    pattern,
                                    bw,
                                    output,
                                    factor,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    let total = jobs.len();
    let done = AtomicUsize::new(0);
    let runs: Vec<Result<(MethodRun, f64, u32, u32), SimError>> = jobs
        .par_iter()
        .map(|j| {
            let setup = &exps[j.exp].setups[j.setup];
            let shape = shape(&setup.shape)?;
            let mut cluster = setup.cluster()?;
            for d in &mut cluster.devices {
                d.reserve = d.reserve.saturating_add(cfg.reserve);
            }
            let point = RunPoint {
                pattern: j.pattern,
                bw: j.bw,
                lengths: exps[j.exp].lengths,
                output: j.output,
                factor: j.factor,
            };
            let mut sc = run_config(cfg, setup, &point);
            sc.record_memory = j.method == Method::Loip;
            let r = run_method(j.method, &shape, &cluster, &sc).map(|run| {
                let budget: u64 = cluster.devices.iter().map(|d| d.budget()).sum();
                let ratio = budget as f64 / shape.total_bytes().max(1) as f64;
                (run, ratio, sc.output_tokens, sc.sequences)
            });
            progress(done.fetch_add(1, Ordering::Relaxed) + 1, total);
            r
        })
        .collect();
    let mut records = Vec::with_capacity(total);
    let mut memory_run: Option<(usize, usize)> = None; // (score, job index)
    let mut kept = Vec::with_capacity(total);
    for (idx, (j, run)) in jobs.iter().zip(runs).enumerate() {
        let (run, budget_ratio, output_tokens, sequences) = run?;
        let e = &exps[j.exp];
        let setup = &e.setups[j.setup];
        let r = &run.report;
        let switches = r
            .events
            .iter()
            .filter(|e| matches!(e, crate::sim::AdaptEvent::Switch { .. }))
            .count();
        let lends = r
            .events
            .iter()
            .filter(|e| matches!(e, crate::sim::AdaptEvent::Lend { .. }))
            .count();
        let evicted = r
            .events
            .iter()
            .filter_map(|e| match e {
                crate::sim::AdaptEvent::Evict { tokens, .. } => Some(*tokens),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        if j.method == Method::Loip && r.status == Status::Ok {
            let score = 2 * lends.min(1) * 1000 + switches + lends + usize::from(evicted > 0);
            if memory_run.is_none_or(|m| score > m.0) {
                memory_run = Some((score, idx));
            }
        }
        records.push(Record {
            experiment: e.name.clone(),
            setup: setup.name.clone(),
            method: j.method.name().to_string(),
            pattern: j.pattern,
            bandwidth_mbps: j.bw.fixed_mbps(),
            budget_ratio,
            output_tokens,
            sequences,
            planned_for: run.planned_for.map(|p| p.name().to_string()),
            status: r.status,
            ms_per_token: (r.status == Status::Ok).then_some(r.ms_per_token),
            predicted_ms_per_token: run.predicted_ms_per_token,
            note: r.note.clone(),
            switches,
            lends,
            evicted_tokens: evicted,
            stages: run.plan.as_ref().map(|p| p.stages_per_device),
        });
        kept.push(run);
    }
    let memory_run = memory_run.map(|(_, idx)| {
        let j = &jobs[idx];
        MemoryRun {
            experiment: exps[j.exp].name.clone(),
            setup: exps[j.exp].setups[j.setup].name.clone(),
            pattern: j.pattern,
            bandwidth: j.bw.label(),
            run: kept.swap_remove(idx),
        }
    });
    Ok(Results {
        experiments: exps,
        records,
        memory_run,
        config: cfg.clone(),
    })
}
