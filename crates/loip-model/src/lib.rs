//! Model files: HF config + safetensors, GGUF, tokenizer and chat template, the SmolLM2
//! fetcher, random-weight checkpoints of real shapes, and (later) slice files + manifest.
//!
//! Everything here is about bytes on disk; nothing here computes a forward pass.
#![deny(missing_docs)]

pub mod chat;
pub mod fetch;
pub mod tokenizer;
