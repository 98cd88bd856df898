//! Runtime errors.

use std::path::PathBuf;

use thiserror::Error;

/// Errors of loading, executing and serving.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// the file
        path: PathBuf,
        /// the cause
        source: std::io::Error,
    },
    /// A model or slice file is malformed, truncated or corrupt.
    #[error(transparent)]
    Model(#[from] loip_model::ModelError),
    /// The forward pass failed.
    #[error(transparent)]
    Engine(#[from] loip_engine::EngineError),
    /// A placement that does not fit the device's memory budget.
    #[error("memory budget of {budget} bytes exceeded: {detail}")]
    OverBudget {
        /// the budget, bytes
        budget: u64,
        /// what needs how much
        detail: String,
    },
    /// An allocation failed.
    #[error("could not allocate {bytes} bytes for {what}")]
    OutOfMemory {
        /// what it was for
        what: String,
        /// bytes asked
        bytes: u64,
    },
    /// The loader thread stopped.
    #[error("the loader thread stopped unexpectedly")]
    LoaderGone,
    /// A bad argument or plan.
    #[error("{0}")]
    Invalid(String),
}
