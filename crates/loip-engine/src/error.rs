//! Engine errors.

use thiserror::Error;

/// Errors of the forward pass, KV cache and weight binding.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A kernel rejected its arguments (a shape bug or a malformed tensor).
    #[error("kernel: {0}")]
    Kernel(#[from] loip_kernels::KernelError),
    /// Reading a tensor from a model file failed.
    #[error(transparent)]
    Model(#[from] loip_model::ModelError),
    /// A tensor has a shape other than the config implies.
    #[error("tensor {name}: expected shape {expected:?}, found {actual:?}")]
    WrongShape {
        /// tensor name
        name: String,
        /// shape implied by the config
        expected: Vec<usize>,
        /// shape found
        actual: Vec<usize>,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    BadTokenId {
        /// the id
        id: u32,
        /// vocabulary size
        vocab: usize,
    },
    /// A position that does not follow the sequence's cached tokens.
    #[error("sequence {seq}: token at position {pos}, but the cache of layer {layer} holds {held} tokens")]
    BadPosition {
        /// sequence
        seq: u64,
        /// the token's position
        pos: usize,
        /// the layer
        layer: usize,
        /// tokens cached
        held: usize,
    },
    /// A layer that this cache or stage does not hold.
    #[error("layer {0} is not held here")]
    LayerNotHeld(usize),
    /// The context would exceed the model's maximum.
    #[error("context of {needed} tokens exceeds the limit of {limit}")]
    ContextTooLong {
        /// tokens needed
        needed: usize,
        /// the limit
        limit: usize,
    },
    /// KV growth refused by the memory budget.
    #[error(
        "KV cache needs {needed} bytes more but only {available} bytes of its budget are left"
    )]
    KvBudget {
        /// bytes asked for
        needed: u64,
        /// bytes left
        available: u64,
    },
    /// A hidden-state buffer of the wrong length.
    #[error("hidden state buffer holds {got} floats, expected {expected}")]
    BadHidden {
        /// floats expected
        expected: usize,
        /// floats given
        got: usize,
    },
    /// The backend running the step (loader, network, worker) failed.
    #[error("{0}")]
    Backend(String),
    /// Bad request parameters.
    #[error("invalid request: {0}")]
    Invalid(String),
}
