//! Model files: HF config + safetensors, GGUF, tokenizer and chat template, the SmolLM2
//! fetcher, random-weight checkpoints of real shapes, and (later) slice files + manifest.
//!
//! Everything here is about bytes on disk; nothing here computes a forward pass.
//!
//! * [`config`]: HF `config.json` → validated [`ModelConfig`].
//! * [`names`]: canonical HF tensor names and the shapes a config implies.
//! * [`checkpoint`]: [`Checkpoint::open`] on an HF directory or a GGUF file; borrowed,
//!   shape-checked [`loip_kernels::Matrix`] views over memory maps.
//! * [`gguf`] / [`gguf_write`]: GGUF reader (and a small writer for tests and fixtures).
//! * [`safetensors_file`]: safetensors header reading, checking and writing.
//! * [`presets`], [`synth`]: named shapes and random-weight checkpoints of those shapes.
#![deny(missing_docs)]

pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod fetch;
pub mod gguf;
pub mod gguf_write;
pub mod names;
pub mod presets;
pub mod safetensors_file;
pub mod slice;
pub mod synth;
pub mod tokenizer;

pub use checkpoint::{Checkpoint, Format, TensorInfo};
pub use config::{Arch, ModelConfig, RopeScaling};
pub use error::ModelError;
pub use gguf::{GgufMetadata, GgufValue};
pub use names::{layer_tensor_name, layer_tensors, model_tensors, TensorGroup, TensorSpec};
pub use presets::{preset_config, preset_names};
pub use synth::synth_checkpoint;
