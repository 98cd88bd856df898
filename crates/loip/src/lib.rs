//! loip as a library: open a model by name or path with a placement, and get the one
//! backend that `loip generate`, `serve`, `api`, `local` and the benches all run on.
//!
//! - [`model`]: a known name (`smollm2`, `gemma3-270m`, …) fetched, verified and cached, or
//!   a local HF directory or GGUF file, with its tokenizer and chat template;
//! - [`slices`]: slice files for offloading, and the slice cache keyed by checkpoint version;
//! - [`backend`]: a model and a [`Placement`] (this machine in memory, from slice files under
//!   a budget, a cluster of workers) to a [`loip_server::Backend`];
//! - [`speculate`]: one request with lossless speculative decoding, on this machine or
//!   through a cluster's pipeline;
//! - [`Loip`]: the three together, for a program that wants text.
//!
//! ```no_run
//! use loip::{Loip, Placement};
//!
//! fn main() -> anyhow::Result<()> {
//!     let model = Loip::open("smollm2", Placement::Memory)?;
//!     let text = model.generate("The three primary colours are", 24, &mut |piece| {
//!         print!("{piece}");
//!     })?;
//!     println!("\n({} characters)", text.len());
//!     model.shutdown();
//!     Ok(())
//! }
//! ```

pub mod backend;
pub mod fit;
pub mod local;
pub mod model;
pub mod pull;
pub mod request;
pub mod slices;
pub mod speculate;

use anyhow::{Context, Result};
use loip_engine::Flow;
use loip_model::tokenizer::Tokenizer;
use loip_model::ModelConfig;
use loip_server::options::{generate_options, Sampling};
use loip_server::Backend;

pub use backend::{ClusterOptions, OffloadOptions, Placement};

/// Most tokens of one sequence [`Loip::open`] plans for (prompt and new tokens).
pub const DEFAULT_CONTEXT: usize = 2048;

/// A model opened on a placement, with its tokenizer: text in, text out.
pub struct Loip {
    backend: Backend,
    config: ModelConfig,
    tokenizer: Tokenizer,
}

impl Loip {
    /// Opens `model` (a known name, a checkpoint path or a slice directory) on `placement`,
    /// for one sequence at a time of up to [`DEFAULT_CONTEXT`] tokens.
    pub fn open(model: &str, placement: Placement) -> Result<Loip> {
        let (src, info) = backend::source(model, &placement, &|_, _| {})?;
        let tokenizer = info.tokenizer.context("the model has no tokenizer")?;
        let sizes =
            backend::Sizes::one_sequence(model, DEFAULT_CONTEXT, placement.offload().loader);
        let opened = backend::open(src, &placement, &sizes)?;
        Ok(Loip {
            backend: opened.backend,
            config: info.config,
            tokenizer,
        })
    }

    /// Generates up to `max_tokens` after `prompt` greedily (the same tokens on every
    /// placement), calling `on_text` with each new piece of text; returns the whole text.
    pub fn generate(
        &self,
        prompt: &str,
        max_tokens: usize,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<String> {
        let ids = self.tokenizer.encode(prompt, true)?;
        let sampling = Sampling {
            max_tokens,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            ignore_eos: false,
            min_tokens: 0,
        };
        let opts = generate_options(&self.config, &ids, &sampling)?;
        let mut new_ids = Vec::new();
        let mut text = String::new();
        self.backend.generate(&ids, &opts, &mut |id| {
            new_ids.push(id);
            // whole characters only: a piece ends where the decoded text stops growing
            if let Ok(t) = self.tokenizer.decode(&new_ids, true) {
                if t.len() > text.len() && t.starts_with(&text) {
                    on_text(&t[text.len()..]);
                    text = t;
                }
            }
            Flow::Continue
        })?;
        Ok(text)
    }

    /// The backend, for batched or shaped requests ([`Backend::generate_shaped`]).
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Stops the backend (a cluster's workers are released).
    pub fn shutdown(self) {
        self.backend.shutdown();
    }
}
