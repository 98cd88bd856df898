//! The transformer forward over borrowed weights: embedding, attention and MLP blocks, final
//! norm + LM head, KV cache, sampling. No I/O and no async: a pipeline stage is this same code
//! run over a contiguous range of layers.
//!
//! Invariant (lossless): a token's hidden state depends only on the weights' bytes, its id,
//! its position and its sequence's earlier tokens — never on how tokens were grouped into a
//! step, which stage or device ran a block, or where the weight bytes live. Every path
//! (whole model, N stages, offloaded blocks read into a slot) therefore yields bit-identical
//! logits within one build.
//!
//! Serving many sequences at once: [`batch`] runs one forward over the tokens of several
//! sequences and samples each with its own state; [`batch_drive`] drives it with the pure
//! step scheduler of `loip_plan::sched` (continuous batching, chunked prefill), and keeps
//! finished sequences' KV for later prompts that start alike ([`prompt_cache`]).
//! [`speculate`] uses the same batched forward to verify several draft tokens of one
//! sequence in one step (lossless speculative decoding).
#![deny(missing_docs)]

pub mod batch;
pub mod batch_drive;
pub mod constraint;
mod error;
pub mod forward;
pub mod generate;
pub mod kv;
pub mod prompt_cache;
pub mod rope;
pub mod sampling;
pub mod speculate;
pub mod weights;

pub use batch::{BatchBackend, BatchRunner, Feed, RowPick, SeqEvent};
pub use batch_drive::{one_device_limits, ServeError, Serving};
pub use constraint::{Constrained, Constraint, ConstraintState};
pub use error::EngineError;
pub use forward::{Batch, Model, TokenPos};
pub use generate::{
    generate, Decoding, Flow, GenerateOptions, GenerateOutput, Generator, Next, StepBackend,
    StopReason,
};
pub use kv::{KvCache, SeqId};
pub use prompt_cache::PromptCacheOptions;
pub use sampling::{Sampler, SamplingParams, Shaping, TokenLogprob};
pub use speculate::{generate_speculative, Rewind, SpecOptions, SpecOutput, SpecStats, Speculate};
pub use weights::{AttnWeights, HeadWeights, LayerWeights, MlpWeights, TensorSource};
