//! `--speculate`: the flags of lossless speculative decoding (`loip generate`, `loip
//! local`); the runs themselves are the library's ([`loip::speculate`]).

use clap::Args;
use loip::speculate::Spec;
use loip_engine::speculate::{SpecOptions, Speculate};

/// Speculative decoding flags.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding: `lookup` (drafts from n-gram matches in the prompt and the
    /// output so far), `draft` (a smaller model with the same tokenizer, --draft), or `off`.
    /// Drafts are verified k + 1 positions per forward; the tokens are the same.
    #[arg(long, default_value = "off")]
    pub speculate: Speculate,
    /// The draft model of `--speculate draft` (`smollm2`, an HF directory or a GGUF file),
    /// run in memory; its tokenizer must be the target's. `self:L`: the model's own first L
    /// layers with its final norm and head (in memory, `loip generate` without --mem).
    #[arg(long)]
    pub draft: Option<String>,
    /// Most draft tokens verified in one step.
    #[arg(long, default_value_t = 8)]
    pub speculate_k: usize,
    /// Always verify up to --speculate-k drafts (no adaptation from the acceptance rate
    /// and the measured step costs).
    #[arg(long)]
    pub speculate_fixed: bool,
}

impl SpecArgs {
    /// Whether speculation is on.
    pub fn on(&self) -> bool {
        self.speculate != Speculate::Off
    }

    /// The library's speculation of these flags.
    pub fn spec(&self) -> Spec {
        Spec {
            source: self.speculate,
            draft: self.draft.clone(),
            k: self.speculate_k,
            fixed: self.speculate_fixed,
        }
    }

    /// The engine's options; `offloaded`: steps are load-bound (a position more costs little).
    pub fn options(&self, offloaded: bool) -> SpecOptions {
        self.spec().options(offloaded)
    }
}
