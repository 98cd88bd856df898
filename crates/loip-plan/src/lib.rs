//! Planning for LOIP: device profiles, the cost model, the exact allocation scheduler and the
//! baseline planners. Pure logic, no I/O: callers read files and pass text in.
//!
//! Data flow: [`ModelShape`] + [`Cluster`] (+ [`PlanRequest`]) → a planner ([`plan()`]) →
//! [`Plan`] (JSON round-trippable, checked by [`Plan::validate`]) → runtime / simulator.
//! [`cost::evaluate`] prices any plan; every planner's prediction comes from it.
//!
//! Modules: [`adapt`] (the online memory adaptation policy, shared by the simulator and the
//! runtime), [`units`] (byte/bandwidth/duration strings), [`shape`], [`profile`] (device and
//! link profiles, shipped presets), [`cluster`] (cluster files), [`mod@plan`], [`cost`],
//! [`planners`], [`render`] (tables), [`sched`] (the continuous-batching step scheduler),
//! [`speculate`] (the price of a speculative step and the choice of `k`), [`error`].
#![deny(missing_docs)]
// `x % d == 0` instead of `is_multiple_of`: the workspace's rust-version is 1.85.
#![allow(clippy::manual_is_multiple_of)]

pub mod adapt;
pub mod calibrate;
mod check;
pub mod cluster;
pub mod cost;
pub mod error;
pub mod plan;
pub mod planners;
pub mod profile;
pub mod render;
pub mod sched;
pub mod shape;
pub mod speculate;
pub mod units;

pub use cluster::{Cluster, Device, RawCluster};
pub use cost::{evaluate, Cost, CostBreakdown, DeviceCost};
pub use error::{ConfigError, ParseError, PlanError, PlanInvalid};
pub use plan::{
    DevicePlan, DroppedDevice, ExecMode, LayerPlan, Pattern, Plan, Residency, StagePlan, StageRef,
};
pub use planners::{plan, planner, planner_names, PlanRequest, Planner};
pub use profile::{
    ComputeModel, DeviceProfile, LinkProfile, LoaderKind, LoaderProfile, MemoryDerivation,
};
pub use shape::ModelShape;
pub use units::{parse_bandwidth, parse_bytes, parse_duration};
