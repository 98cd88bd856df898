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
    /// The KV cache and working buffers for the context and sequences asked do not fit the
    /// budget even with every block offloaded that the rule allows: a smaller context, fewer
    /// sequences or a larger budget would.
    #[error(
        "memory budget of {} exceeded: even with these blocks offloaded the device needs {} \
         ({} of them KV cache for {seqs} × {context} tokens, {} working buffers)",
        loip_plan::units::format_bytes(*budget),
        loip_plan::units::format_bytes(*needed),
        loip_plan::units::format_bytes(*kv),
        loip_plan::units::format_bytes(*working)
    )]
    KvDoesNotFit {
        /// the engine's budget, bytes
        budget: u64,
        /// what the placement needs in all, bytes
        needed: u64,
        /// of it, the KV cache, bytes
        kv: u64,
        /// of it, the working buffers, bytes
        working: u64,
        /// tokens of context per sequence
        context: usize,
        /// sequences at once
        seqs: usize,
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
