//! `loip bench model`: one model's prefill and decode ms/token at the global `--threads`,
//! the best of several rounds in one process, measured the way `bench/llama_cpp_prefill.py`
//! and `bench/llama_cpp_decode.py` measure llama.cpp, so that `bench/compare_llama_cpp.sh`
//! sets like beside like (a warm process, the same prompt, the best of the same rounds).
//!
//! - prefill: the prompt's token ids in one forward pass (as `loip generate --prompt-ids IDS
//!   -n 1`), ms per prompt token;
//! - decode: after a short text prompt, `tokens` single-token forwards (greedy, no EOS), ms
//!   per token.
//!
//! The checkpoint is opened as `loip generate` opens it (its pages mapped at open).

use anyhow::{bail, Context, Result};
use clap::Args;
use loip_engine::generate::{generate, Flow};
use loip_engine::{Generator, Model};
use serde_json::json;

use super::{greedy, prefill_prompt};

/// Arguments of `loip bench model`.
#[derive(Args, Debug)]
pub struct ModelBenchArgs {
    /// Model: a known name (`smollm2`, `gemma3-270m`, `qwen2.5-coder-0.5b`), an HF directory
    /// or a GGUF file.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// The prefill prompt: comma-separated token ids, evaluated as one batch (default: 256
    /// ids cycling below the vocabulary).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Vec<u32>,
    /// The text the decode rounds start from (a model without a tokenizer starts from the
    /// prompt's first ids).
    #[arg(long, default_value = "The capital of France is")]
    decode_prompt: String,
    /// Tokens to decode per round.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// Rounds; each figure is the best of them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// Prompt length when `--prompt-ids` is not given.
const DEFAULT_PROMPT: usize = 256;

/// Ids the decode rounds start from when the model has no tokenizer.
const NO_TOKENIZER_START: usize = 6;

/// Runs `loip bench model`; prints one JSON line and returns it.
pub(super) fn run(a: ModelBenchArgs) -> Result<serde_json::Value> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let ckpt = loip::model::open(&a.model)?;
    ckpt.populate();
    let m = Model::from_checkpoint(&ckpt)?;
    let vocab = m.tf.cfg.vocab_size.max(1) as u32;
    let prompt: Vec<u32> = if a.prompt_ids.is_empty() {
        prefill_prompt(&m, DEFAULT_PROMPT)
    } else {
        a.prompt_ids.clone()
    };
    if let Some(&bad) = prompt.iter().find(|&&id| id >= vocab) {
        bail!("token id {bad} is outside the model's vocabulary of {vocab}");
    }
    // a checkpoint without a tokenizer (the test fixtures) decodes after the prompt's first ids
    let start = match loip::model::tokenizer(&ckpt) {
        Ok(tok) => tok
            .encode(&a.decode_prompt, true)
            .context("tokenizing --decode-prompt")?,
        Err(_) => prompt.iter().copied().take(NO_TOKENIZER_START).collect(),
    };
    if start.is_empty() {
        bail!("the decode prompt has no tokens");
    }
    let (mut prefill, mut decode) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..a.rounds {
        let mut g = Generator::new(&m, None);
        let out = generate(&mut g, 0, &prompt, &greedy(1), &mut |_| Flow::Continue)?;
        prefill = prefill.min(out.prompt_ms / prompt.len() as f64);
        let mut g = Generator::new(&m, None);
        let out = generate(&mut g, 0, &start, &greedy(a.tokens + 1), &mut |_| {
            Flow::Continue
        })?;
        decode = decode.min(out.decode_ms_per_token);
    }
    let v = json!({
        "model": a.model,
        "threads": rayon::current_num_threads(),
        "rounds": a.rounds,
        "prompt_tokens": prompt.len(),
        "prompt_ms_per_token": prefill,
        "decode_prompt_tokens": start.len(),
        "decode_tokens": a.tokens,
        "decode_ms_per_token": decode,
    });
    println!("{v}");
    Ok(v)
}
