//! Checking a plan against a model and a cluster, and repricing it: the methods of [`Plan`]
//! that need the cost model. They sit above the plan types and the cost model so that
//! neither imports the other back.

use crate::cluster::Cluster;
use crate::cost;
use crate::error::{PlanError, PlanInvalid};
use crate::plan::Plan;
use crate::shape::ModelShape;

impl Plan {
    /// Recomputes the derived figures (prediction, breakdown, per-device memory and times)
    /// with the cost model, e.g. after a hand edit or for another cluster's link.
    pub fn reprice(&mut self, shape: &ModelShape, cluster: &Cluster) -> Result<(), PlanError> {
        let c = cost::evaluate(self, shape, cluster)?;
        cost::apply(self, &c);
        Ok(())
    }

    /// Checks a (possibly hand-edited) plan against the model and cluster: layers, order,
    /// stage counts, embedding/head placement, devices known, memory within budget.
    pub fn validate(&self, shape: &ModelShape, cluster: &Cluster) -> Result<(), PlanError> {
        if self.shape != shape.name {
            return Err(PlanInvalid::ShapeMismatch {
                plan: self.shape.clone(),
                model: shape.name.clone(),
            }
            .into());
        }
        if self.devices.is_empty() {
            return Err(PlanInvalid::NoDevice.into());
        }
        if self.stages_per_device == 0 {
            return Err(PlanInvalid::Zero("stages_per_device").into());
        }
        if self.micro_batches == 0 {
            return Err(PlanInvalid::Zero("micro_batches").into());
        }
        let mut last_idx = None;
        for (i, d) in self.devices.iter().enumerate() {
            let idx = cluster
                .index_of(&d.name)
                .ok_or_else(|| PlanError::UnknownDevice(d.name.clone()))?;
            if self.devices[..i].iter().any(|x| x.name == d.name) {
                return Err(PlanInvalid::DuplicateDevice(d.name.clone()).into());
            }
            if last_idx.is_some_and(|l| idx < l) {
                return Err(PlanInvalid::Roles(format!(
                    "device `{}` is out of cluster order",
                    d.name
                ))
                .into());
            }
            last_idx = Some(idx);
            if d.stages.len() != self.stages_per_device as usize {
                return Err(PlanInvalid::StageCount {
                    device: d.name.clone(),
                    got: d.stages.len(),
                    expected: self.stages_per_device,
                }
                .into());
            }
            if let Some(stage) = d.stages.iter().position(|s| s.layers.is_empty()) {
                return Err(PlanInvalid::EmptyStage {
                    device: d.name.clone(),
                    stage,
                }
                .into());
            }
            let first = i == 0;
            let last = i + 1 == self.devices.len();
            if d.holds_embedding != first {
                return Err(PlanInvalid::Roles(format!(
                    "embedding must be on the first device only (device `{}`)",
                    d.name
                ))
                .into());
            }
            if d.holds_head != last {
                return Err(PlanInvalid::Roles(format!(
                    "head must be on the last device only (device `{}`)",
                    d.name
                ))
                .into());
            }
        }
        let mut expected = 0u32;
        for r in self.stage_order() {
            let d = &self.devices[r.device];
            for l in &d.stages[r.stage].layers {
                if l.layer != expected {
                    return Err(PlanInvalid::LayerOrder {
                        device: d.name.clone(),
                        stage: r.stage,
                        expected,
                        found: l.layer,
                    }
                    .into());
                }
                expected += 1;
            }
        }
        if expected != shape.layers {
            return Err(PlanInvalid::LayerCount {
                placed: expected,
                layers: shape.layers,
            }
            .into());
        }
        let c = cost::evaluate(self, shape, cluster)?;
        for d in &c.devices {
            if d.memory_bytes > d.budget_bytes {
                return Err(PlanInvalid::OverBudget {
                    device: d.name.clone(),
                    need: d.memory_bytes,
                    budget: d.budget_bytes,
                }
                .into());
            }
        }
        Ok(())
    }
}
