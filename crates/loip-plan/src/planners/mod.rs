//! Planners: from a model shape, a cluster and a request to a [`Plan`].
//!
//! Every planner returns the same [`Plan`] type, priced by [`crate::cost::evaluate`] (the
//! single source of the predicted numbers). Look them up by name with [`planner`] or run one
//! with [`plan`]:
//!
//! | name | what it is |
//! |---|---|
//! | `loip` | exact scheduler of design §4 (stage count over divisors of L, block-level offloading, tries dropping devices) |
//! | `loip-conventional-load` | `loip` priced with the conventional loader (ablation) |
//! | `loip-paper` | greedy memory fill + DP on leftover layers + bottleneck refinement |
//! | `loip-uniform` | interleaved + offloading, uniform consecutive layers (ablation) |
//! | `pp` | one stage per device, compute-proportional within memory, no offloading |
//! | `pp-offload` | one stage per device, whole layers offloaded, loads not overlapped |
//! | `edgeshard` | DP over devices (may skip some) minimising latency, no offloading |
//!
//! [`batching::choose_batching`] picks, for `N` concurrent sequences, the micro-batches in
//! flight and the sequences per micro-batch (design's `q`) that the cost model prices
//! fastest.

mod base;
mod baselines;
pub mod batching;
mod exact;
mod paper;

use crate::cluster::Cluster;
use crate::error::PlanError;
use crate::plan::Plan;
use crate::shape::ModelShape;
pub use base::{PlanRequest, Planner};

static PLANNERS: &[&dyn Planner] = &[
    &exact::Loip,
    &exact::LoipConventionalLoad,
    &paper::LoipPaper,
    &baselines::LoipUniform,
    &baselines::Pp,
    &baselines::PpOffload,
    &baselines::EdgeShard,
];

/// Names of all planners, `loip` first.
pub fn planner_names() -> Vec<&'static str> {
    PLANNERS.iter().map(|p| p.name()).collect()
}

/// All planners.
pub fn planners() -> &'static [&'static dyn Planner] {
    PLANNERS
}

/// The planner called `name`; unknown names list the valid ones.
pub fn planner(name: &str) -> Result<&'static dyn Planner, PlanError> {
    PLANNERS
        .iter()
        .copied()
        .find(|p| p.name() == name)
        .ok_or_else(|| PlanError::UnknownPlanner {
            name: name.to_string(),
            valid: planner_names().iter().map(|s| s.to_string()).collect(),
        })
}

/// Runs the planner called `name`.
pub fn plan(
    name: &str,
    shape: &ModelShape,
    cluster: &Cluster,
    req: &PlanRequest,
) -> Result<Plan, PlanError> {
    planner(name)?.plan(shape, cluster, req)
}

/// Runs every planner (for `--compare`).
pub fn plan_all(
    shape: &ModelShape,
    cluster: &Cluster,
    req: &PlanRequest,
) -> Vec<(String, Result<Plan, PlanError>)> {
    PLANNERS
        .iter()
        .map(|p| (p.name().to_string(), p.plan(shape, cluster, req)))
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_registry_holds_the_names_cluster_files_accept() {
        assert_eq!(super::planner_names(), crate::plan::PLANNER_NAMES);
    }
}
