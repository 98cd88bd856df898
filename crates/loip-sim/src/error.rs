//! Typed errors of the simulator.

use loip_plan::PlanError;
use thiserror::Error;

/// Why a simulation or an experiment could not run.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SimError {
    /// A model shape name is not among the built-in shapes.
    #[error("unknown model shape `{name}` (known: {known})")]
    UnknownShape {
        /// The name given.
        name: String,
        /// Known names, comma-separated.
        known: String,
    },
    /// A method name is not known.
    #[error("unknown method `{name}` (known: {known})")]
    UnknownMethod {
        /// The name given.
        name: String,
        /// Known names, comma-separated.
        known: String,
    },
    /// An experiment name is not known.
    #[error("unknown experiment `{name}` (known: {known})")]
    UnknownExperiment {
        /// The name given.
        name: String,
        /// Known names, comma-separated.
        known: String,
    },
    /// A setting is out of range.
    #[error("invalid setting `{field}`: {reason}")]
    Invalid {
        /// The setting.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The planner crate refused the plan or the cluster.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// No event was left while the simulation still waited for a task (a bug in the task
    /// graph; reported rather than hanging).
    #[error("simulation deadlocked at t = {time_s:.6} s")]
    Deadlock {
        /// Virtual time when it stopped.  // seconds
        time_s: f64,
    },
    /// Writing an output file or plot failed.
    #[error("cannot write `{path}`: {reason}")]
    Output {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
}
