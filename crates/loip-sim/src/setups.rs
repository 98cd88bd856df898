//! What an experiment runs on: a [`Setup`] (a model on a set of preset devices, its budgets
//! optionally scaled), the [`Experiment`] type, and the setups of design §10. Below the
//! experiment registry ([`crate::experiments`]) and the long experiments
//! ([`crate::experiments_long`]), which both build on them; their public paths under
//! `experiments` are re-exports.

use crate::bandwidth::Bandwidth;
use crate::error::SimError;
use crate::methods::Method;
use crate::shapes::shape;
use loip_plan::profile::preset;
use loip_plan::{Cluster, LinkProfile, Pattern};
use serde::{Deserialize, Serialize};

/// A device of a setup: (name, preset, reserved bytes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SetupDevice {
    /// Device name.
    pub name: String,
    /// Planner-crate preset (`orin64`, `orin32`, `nx16`).
    pub preset: String,
    /// Memory reserved for other programs.  // bytes
    pub reserve: u64,
}

/// A model on a set of devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    /// Short name used in tables, e.g. `70b-4dev`.
    pub name: String,
    /// Built-in shape name.
    pub shape: String,
    /// Devices in pipeline order.
    pub devices: Vec<SetupDevice>,
    /// Every device's budget (after its reservation) times this, when set: the memory sweep.
    #[serde(default)]
    pub budget_scale: Option<f64>,
}

impl Setup {
    fn new(name: &str, shape: &str, devices: &[(&str, &str, f64)]) -> Setup {
        Setup {
            name: name.to_string(),
            shape: shape.to_string(),
            devices: devices
                .iter()
                .map(|&(n, p, gb)| SetupDevice {
                    name: n.to_string(),
                    preset: p.to_string(),
                    reserve: (gb * 1e9) as u64,
                })
                .collect(),
            budget_scale: None,
        }
    }

    /// This setup with every device's budget scaled so that the total is `ratio` × the
    /// model's weight bytes; named `NAME@RATIO`.
    pub fn scaled(&self, ratio: f64) -> Result<Setup, SimError> {
        let mut base = self.clone();
        base.budget_scale = None;
        let total: u64 = base.cluster()?.devices.iter().map(|d| d.budget()).sum();
        let weights = shape(&self.shape)?.total_bytes();
        Ok(Setup {
            name: format!("{}@{ratio:.2}", self.name),
            budget_scale: Some(ratio * weights as f64 / total.max(1) as f64),
            ..base
        })
    }

    /// Total budget over the model's weight bytes.
    pub fn budget_ratio(&self) -> Result<f64, SimError> {
        let total: u64 = self.cluster()?.devices.iter().map(|d| d.budget()).sum();
        Ok(total as f64 / shape(&self.shape)?.total_bytes().max(1) as f64)
    }

    /// The setup's name without the `@RATIO` of a scaled one.
    pub fn base_name(&self) -> &str {
        self.name.split('@').next().unwrap_or(&self.name)
    }

    /// The cluster (link bandwidth/latency are set per run).
    pub fn cluster(&self) -> Result<Cluster, SimError> {
        let mut devices = Vec::with_capacity(self.devices.len());
        for d in &self.devices {
            let p = preset(&d.preset).ok_or_else(|| SimError::Invalid {
                field: "preset",
                reason: format!("unknown preset `{}`", d.preset),
            })?;
            devices.push((d.name.clone(), p));
        }
        let mut c = Cluster::new(
            devices,
            LinkProfile {
                bandwidth: 12.5e6,
                latency: 2e-3,
            },
        );
        for (dev, sd) in c.devices.iter_mut().zip(&self.devices) {
            dev.reserve = sd.reserve;
            if let Some(scale) = self.budget_scale {
                if !(scale.is_finite() && scale > 0.0) {
                    return Err(SimError::Invalid {
                        field: "budget_scale",
                        reason: format!("{scale} is not a positive factor"),
                    });
                }
                dev.profile.mem_budget = (dev.budget() as f64 * scale) as u64;
                dev.reserve = 0;
            }
        }
        Ok(c)
    }
}

/// One experiment of design §10.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Experiment {
    /// Name (`memory-constrained`, …).
    pub name: String,
    /// What it shows.
    pub title: String,
    /// Setups.
    pub setups: Vec<Setup>,
    /// Methods compared.
    pub methods: Vec<Method>,
    /// Bandwidths.
    pub bandwidths: Vec<Bandwidth>,
    /// Patterns.
    pub patterns: Vec<Pattern>,
    /// Prompt and output tokens per sequence, when not the run's defaults.  // tokens
    pub lengths: Option<(u32, u32)>,
    /// Output tokens per sequence swept (the context sweep); empty: the one of `lengths` or
    /// the run's default.  // tokens
    #[serde(default)]
    pub outputs: Vec<u32>,
    /// Bursty sequences in flight as multiples of `|D|` (the context sweep); empty: `[1]`.
    #[serde(default)]
    pub sequence_factors: Vec<u32>,
}

impl Experiment {
    /// Whether it sweeps budgets or lengths (tables and figures show the swept values).
    pub fn is_sweep(&self) -> bool {
        !self.outputs.is_empty()
            || !self.sequence_factors.is_empty()
            || self.setups.iter().any(|s| s.budget_scale.is_some())
    }

    /// Output lengths it runs, `None`: the run's default.  // tokens
    pub(crate) fn output_list(&self) -> Vec<Option<u32>> {
        if self.outputs.is_empty() {
            vec![self.lengths.map(|l| l.1)]
        } else {
            self.outputs.iter().map(|&o| Some(o)).collect()
        }
    }

    pub(crate) fn factor_list(&self) -> Vec<u32> {
        if self.sequence_factors.is_empty() {
            vec![1]
        } else {
            self.sequence_factors.clone()
        }
    }

    /// Number of runs.
    pub fn runs(&self) -> usize {
        self.setups.len()
            * self.methods.len()
            * self.patterns.len()
            * self.bandwidths.len()
            * self.output_list().len()
            * self.factor_list().len()
    }
}

/// The setups of the memory sweep (70B on 4 and 5 devices, 32B on 3), unscaled.
pub fn sweep_base_setups() -> Vec<Setup> {
    let mut v: Vec<Setup> = end_to_end_setups()
        .into_iter()
        .filter(|s| s.name == "70b-4dev" || s.name == "32b-3dev")
        .collect();
    let mut five = mem_constrained_setups().remove(0);
    five.name = "70b-5dev".into();
    v.insert(0, five);
    v.swap(1, 2);
    v
}

/// `bases` at every ratio of `ratios`.
pub fn sweep_setups(bases: &[Setup], ratios: &[f64]) -> Result<Vec<Setup>, SimError> {
    let mut v = Vec::with_capacity(bases.len() * ratios.len());
    for b in bases {
        for &r in ratios {
            v.push(b.scaled(r)?);
        }
    }
    Ok(v)
}

pub(crate) fn mem_constrained_setups() -> Vec<Setup> {
    let base = |name: &str, r64: f64, r32: f64, rnx: f64| {
        Setup::new(
            name,
            "llama3.3-70b",
            &[
                ("orin64", "orin64", r64),
                ("orin32-a", "orin32", r32),
                ("orin32-b", "orin32", r32),
                ("orin32-c", "orin32", 0.0),
                ("nx16", "nx16", rnx),
            ],
        )
    };
    vec![
        base("70b-5dev-i", 0.0, 0.0, 0.0),
        base("70b-5dev-ii", 0.0, 3.0, 0.0),
        base("70b-5dev-iii", 5.0, 3.0, 1.0),
    ]
}

pub(crate) fn end_to_end_setups() -> Vec<Setup> {
    vec![
        Setup::new(
            "13b-2dev",
            "llama2-13b",
            &[("orin32", "orin32", 0.0), ("nx16", "nx16", 0.0)],
        ),
        Setup::new(
            "32b-3dev",
            "qwen3-32b",
            &[
                ("orin64", "orin64", 0.0),
                ("orin32", "orin32", 0.0),
                ("nx16", "nx16", 0.0),
            ],
        ),
        Setup::new(
            "70b-4dev",
            "llama3.3-70b",
            &[
                ("orin64-a", "orin64", 0.0),
                ("orin64-b", "orin64", 0.0),
                ("orin32", "orin32", 0.0),
                ("nx16", "nx16", 0.0),
            ],
        ),
    ]
}
