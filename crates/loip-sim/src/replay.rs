//! A run of the real runtime replayed in the simulator: the same plan, the profiles the
//! runtime measured on this machine, and the same request (prompt length, tokens decoded),
//! so that the adaptation events of both can be compared step by step (`loip simulate
//! --from-local`, and the runtime-against-simulator test of `loip-cli`).
//!
//! Memory is the one input translated: the simulator prices a device's weights, slot and
//! working buffers with the cost model ([`cost::device_memory`], which reserves the
//! planner's fixed working scratch), the runtime with what the worker actually allocates
//! (slice sizes and the step's buffers). Each device's budget is shifted by the difference
//! at the plan's layout, so both start from the same KV room (`TS¹` identical) and every
//! switch is priced from there by block sizes, which both take from the slice files.
//!
//! Steps: the runtime counts the prompt step as step 0 and decode step `k` holds
//! `prompt + k` tokens; the simulator starts with the prompt cached and its step `t` holds
//! `prompt + t + 1`. So the runtime's step `k` is the simulator's `k − 1`, and a run of `n`
//! new tokens is `n − 1` simulated steps ([`ReplayRun::runtime_step`]).

use crate::bandwidth::BandwidthTrace;
use crate::error::SimError;
use crate::pipeline::simulate_pipeline;
use crate::sim::{KvPolicy, SimConfig, SimReport};
use loip_plan::{cost, Cluster, ModelShape, Pattern, Plan};
use serde::{Deserialize, Serialize};

/// What the runtime ran, as `loip local --json` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayRun {
    /// The plan the session ran.
    pub plan: Plan,
    /// The model's shape as planned.
    pub shape: ModelShape,
    /// The cluster as planned (measured profiles and link).
    pub cluster: Cluster,
    /// Prompt tokens per sequence.  // tokens
    pub prompt_tokens: u32,
    /// New tokens generated per sequence.  // tokens
    pub new_tokens: u32,
    /// Sequences in flight.
    pub sequences: u32,
    /// Per plan device: budget and what the worker accounted for weights, slot and working
    /// buffers when it opened the plan (`budget − kv_budget`).  // bytes
    pub opened: Vec<(u64, u64)>,
}

impl ReplayRun {
    /// The cluster with every plan device's budget shifted to the runtime's accounting (see
    /// the module docs).
    pub fn calibrated_cluster(&self) -> Result<Cluster, SimError> {
        let mut c = self.cluster.clone();
        let b = self.sequences.max(1);
        if self.opened.len() != self.plan.devices.len() {
            return Err(SimError::Invalid {
                field: "opened",
                reason: format!(
                    "{} devices opened, the plan has {}",
                    self.opened.len(),
                    self.plan.devices.len()
                ),
            });
        }
        for (d, &(budget, fixed)) in self.plan.devices.iter().zip(&self.opened) {
            let modelled = cost::device_memory(
                &self.shape,
                self.plan.mode,
                &d.stages,
                d.holds_embedding,
                d.holds_head,
                0,
                b,
            );
            let dev = c
                .devices
                .iter_mut()
                .find(|x| x.name == d.name)
                .ok_or_else(|| loip_plan::PlanError::UnknownDevice(d.name.clone()))?;
            dev.reserve = 0;
            dev.profile.mem_budget = (budget + modelled).saturating_sub(fixed);
        }
        Ok(c)
    }

    /// The simulator's config of the same request under `policy`.
    pub fn config(&self, policy: KvPolicy) -> SimConfig {
        let b = self.sequences.max(1);
        let pattern = if b > 1 {
            Pattern::Bursty
        } else {
            Pattern::Sporadic
        };
        let trace = BandwidthTrace::constant(self.cluster.link.bandwidth);
        let mut c = SimConfig::new(pattern, b, trace, self.cluster.link.latency);
        c.prompt_tokens = self.prompt_tokens;
        c.output_tokens = self.new_tokens.saturating_sub(1).max(1);
        c.kv_policy = policy;
        c.stop_when_oot = false;
        c.record_memory = true;
        c
    }

    /// Simulates the run under `policy`.
    pub fn simulate(&self, policy: KvPolicy) -> Result<SimReport, SimError> {
        let cluster = self.calibrated_cluster()?;
        simulate_pipeline(&self.plan, &self.shape, &cluster, &self.config(policy))
    }

    /// The runtime's step of the simulator's step `t`.
    pub fn runtime_step(t: u32) -> u32 {
        t + 1
    }
}

/// An adaptation event with the step in the runtime's count, for comparing the two.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Switch {
    /// Runtime step it applies from.
    pub step: u32,
    /// Plan device.
    pub device: usize,
    /// KV tokens held when it triggered.  // tokens
    pub tokens: u64,
    /// (attention, MLP) offloaded per stage before.
    pub from: (u32, u32),
    /// After.
    pub to: (u32, u32),
}

/// The threshold switches of `events`, with simulator steps moved to the runtime's count
/// when `simulated`.
pub fn switches(events: &[crate::sim::AdaptEvent], simulated: bool) -> Vec<Switch> {
    events
        .iter()
        .filter_map(|e| match *e {
            crate::sim::AdaptEvent::Switch {
                step,
                device,
                tokens,
                from,
                to,
            } => Some(Switch {
                step: if simulated {
                    ReplayRun::runtime_step(step)
                } else {
                    step
                },
                device,
                tokens,
                from,
                to,
            }),
            _ => None,
        })
        .collect()
}

/// Whether the runtime's and the simulator's switches are the same decisions: the same
/// devices and layouts, at the same round and KV tokens within `sequences − 1`: the runtime
/// counts a step, and the KV, as each sequence's step enters (`sequences` steps a round), the
/// simulator once a round for all of them (and devices switching at one step in any order).
pub fn same_switches(runtime: &[Switch], simulated: &[Switch], sequences: u32) -> bool {
    let b = sequences.max(1);
    let sorted = |v: &[Switch]| {
        let mut v = v.to_vec();
        v.sort_by_key(|s| (s.step, s.device));
        v
    };
    let (runtime, simulated) = (sorted(runtime), sorted(simulated));
    runtime.len() == simulated.len()
        && runtime.iter().zip(&simulated).all(|(a, s)| {
            (a.device, a.from, a.to) == (s.device, s.from, s.to)
                && a.step.abs_diff(s.step.saturating_mul(b)) < b
                && a.tokens.abs_diff(s.tokens) < b as u64
        })
}

fn field<'a>(
    v: &'a serde_json::Value,
    name: &'static str,
) -> Result<&'a serde_json::Value, SimError> {
    v.get(name).ok_or_else(|| SimError::Invalid {
        field: name,
        reason: "missing from the `loip local --json` output".into(),
    })
}

fn parse<T: serde::de::DeserializeOwned>(
    v: &serde_json::Value,
    name: &'static str,
) -> Result<T, SimError> {
    serde_json::from_value(field(v, name)?.clone()).map_err(|e| SimError::Invalid {
        field: name,
        reason: e.to_string(),
    })
}

impl ReplayRun {
    /// The run `loip local --json` printed (`plan`, `shape`, `cluster`, `devices` with what
    /// each worker opened, `prompt_ids`, `new_ids`, `sequences` when bursty).
    pub fn from_local_json(v: &serde_json::Value) -> Result<ReplayRun, SimError> {
        let plan: Plan = parse(v, "plan")?;
        let shape: ModelShape = parse(v, "shape")?;
        let cluster: Cluster = parse(v, "cluster")?;
        let count = |name: &'static str| -> Result<u32, SimError> {
            Ok(field(v, name)?.as_array().map_or(0, |a| a.len()) as u32)
        };
        let prompt_tokens = count("prompt_ids")?;
        let new_tokens = count("new_ids")?;
        let sequences = v
            .get("sequences")
            .and_then(|s| s.as_array())
            .map_or(1, |a| a.len().max(1) as u32);
        let devices = field(v, "devices")?.as_array().cloned().unwrap_or_default();
        let opened = plan
            .devices
            .iter()
            .map(|d| {
                let mem = devices
                    .iter()
                    .find(|r| r.pointer("/endpoint/name").and_then(|n| n.as_str()) == Some(&d.name))
                    .and_then(|r| r.get("memory"))
                    .filter(|m| !m.is_null())
                    .ok_or_else(|| SimError::Invalid {
                        field: "devices",
                        reason: format!("no memory report for plan device `{}`", d.name),
                    })?;
                let num = |k: &str| mem.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
                let budget = num("budget");
                Ok((budget, budget.saturating_sub(num("kv_budget"))))
            })
            .collect::<Result<Vec<_>, SimError>>()?;
        Ok(ReplayRun {
            plan,
            shape,
            cluster,
            prompt_tokens,
            new_tokens,
            sequences,
            opened,
        })
    }
}
