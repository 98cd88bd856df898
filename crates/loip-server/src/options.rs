//! From a request's sampling fields to the engine's [`GenerateOptions`], with no command-line
//! or HTTP types: `loip generate` and the API build their options here, so the same request
//! runs the same way through either.

use loip_engine::{GenerateOptions, SamplingParams};
use loip_model::ModelConfig;

/// How to generate, as a user asks for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// most new tokens
    pub max_tokens: usize,
    /// 0 is greedy
    pub temperature: f32,
    /// keep the k most likely tokens (0: off)
    pub top_k: usize,
    /// nucleus threshold (1: off)
    pub top_p: f32,
    /// RNG seed
    pub seed: u64,
    /// keep generating past end-of-sequence tokens
    pub ignore_eos: bool,
    /// mask end-of-sequence tokens until this many were generated
    pub min_tokens: usize,
}

/// A request the engine cannot run; the message says why.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRequest(pub String);

/// Checks `prompt_ids` against `config`'s vocabulary and builds the options of `s`.
pub fn generate_options(
    config: &ModelConfig,
    prompt_ids: &[u32],
    s: &Sampling,
) -> Result<GenerateOptions, InvalidRequest> {
    if prompt_ids.is_empty() {
        return Err(InvalidRequest("the prompt encodes to no tokens".into()));
    }
    let vocab = config.vocab_size;
    if let Some(bad) = prompt_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(InvalidRequest(format!(
            "prompt id {bad} is outside the vocabulary of {vocab} tokens"
        )));
    }
    let eos_ids = if s.ignore_eos {
        vec![]
    } else {
        config.eos_token_ids.clone()
    };
    let sampling = SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k,
        top_p: s.top_p,
        seed: s.seed,
    };
    sampling
        .validate()
        .map_err(|e| InvalidRequest(e.to_string()))?;
    Ok(GenerateOptions {
        max_tokens: s.max_tokens,
        sampling,
        eos_ids,
        min_tokens: s.min_tokens,
    })
}
