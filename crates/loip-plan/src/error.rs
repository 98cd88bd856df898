//! Typed errors of the planning crate.
//!
//! Three families: [`ParseError`] (a byte size, bandwidth or duration string; it lives beside
//! its parsers in [`crate::units`] and is re-exported here),
//! [`ConfigError`] (a cluster file or profile; always names the offending field), and
//! [`PlanError`] (a planner could not place the model, or a plan is inconsistent).

pub use crate::units::ParseError;
use thiserror::Error;

/// A cluster file or device profile is invalid. Every variant names the field.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The text is not valid TOML / JSON, or has the wrong types.
    #[error("cannot parse {what}: {reason}")]
    Syntax {
        /// "cluster file" or "profile `path`".
        what: String,
        /// The parser's message.
        reason: String,
    },
    /// A required field is absent.
    #[error("missing field `{field}`")]
    Missing {
        /// Dotted path of the field, e.g. `device[2].name`.
        field: String,
    },
    /// A field has a bad value.
    #[error("invalid `{field}`: {reason}")]
    Invalid {
        /// Dotted path of the field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A preset name is not known.
    #[error("unknown preset `{name}` in `{field}` (valid: {valid})")]
    UnknownPreset {
        /// Dotted path of the field.
        field: String,
        /// The name given.
        name: String,
        /// The valid names, comma-separated.
        valid: String,
    },
    /// A planner name is not known.
    #[error("unknown planner `{name}` in `{field}` (valid: {valid})")]
    UnknownPlanner {
        /// Dotted path of the field.
        field: String,
        /// The name given.
        name: String,
        /// The valid names, comma-separated.
        valid: String,
    },
}

/// A planner could not produce a plan, or a plan does not match the model and cluster.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The model cannot be placed: `device` lacks `lacks_bytes` bytes in the closest plan.
    #[error("{planner}: model does not fit: device `{device}` lacks {lacks_bytes} bytes ({})", crate::units::format_bytes(*lacks_bytes))]
    DoesNotFit {
        /// Planner name.
        planner: String,
        /// Device that lacks memory.
        device: String,
        /// Bytes missing on it.
        lacks_bytes: u64,
    },
    /// No planner has this name.
    #[error("unknown planner `{name}` (valid: {})", valid.join(", "))]
    UnknownPlanner {
        /// The name given.
        name: String,
        /// The valid names.
        valid: Vec<String>,
    },
    /// The cluster has no device.
    #[error("cluster has no device")]
    EmptyCluster,
    /// The request is malformed (zero micro-batches, ...).
    #[error("invalid request: {0}")]
    BadRequest(String),
    /// A plan names a device that is not in the cluster.
    #[error("plan names device `{0}`, which is not in the cluster")]
    UnknownDevice(String),
    /// A plan is internally inconsistent.
    #[error("invalid plan: {0}")]
    Invalid(#[from] PlanInvalid),
}

/// Why [`crate::Plan::validate`] rejected a plan.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum PlanInvalid {
    /// The plan's shape name differs from the model's.
    #[error("plan is for shape `{plan}`, model is `{model}`")]
    ShapeMismatch {
        /// Name in the plan.
        plan: String,
        /// Name of the model shape.
        model: String,
    },
    /// The plan has no device.
    #[error("plan has no device")]
    NoDevice,
    /// Two plan devices have the same name.
    #[error("device `{0}` appears twice")]
    DuplicateDevice(String),
    /// A device's stage count differs from `stages_per_device`.
    #[error("device `{device}` has {got} stages, plan says {expected}")]
    StageCount {
        /// Device name.
        device: String,
        /// Stages it has.
        got: usize,
        /// `stages_per_device`.
        expected: u32,
    },
    /// A stage has no layer.
    #[error("device `{device}` stage {stage} is empty")]
    EmptyStage {
        /// Device name.
        device: String,
        /// Stage index (0-based).
        stage: usize,
    },
    /// Layers are not `0..L` exactly once in round-robin order.
    #[error("layer order broken at device `{device}` stage {stage}: expected layer {expected}, found {found}")]
    LayerOrder {
        /// Device name.
        device: String,
        /// Stage index (0-based).
        stage: usize,
        /// Layer expected next.
        expected: u32,
        /// Layer found.
        found: u32,
    },
    /// Not all layers are placed.
    #[error("plan places {placed} layers, model has {layers}")]
    LayerCount {
        /// Layers placed.
        placed: u32,
        /// Layers of the model.
        layers: u32,
    },
    /// Embedding / head flags are not on the first / last device.
    #[error("{0}")]
    Roles(String),
    /// `stages_per_device` or `micro_batches` is zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A device exceeds its memory budget at the planned context.
    #[error("device `{device}` needs {need} bytes, budget is {budget}")]
    OverBudget {
        /// Device name.
        device: String,
        /// Bytes needed.
        need: u64,
        /// Budget.
        budget: u64,
    },
}
