//! The generation loop, independent of where the forward runs.
//!
//! A [`StepBackend`] advances one sequence by some tokens and returns the last position's
//! logits; the single-device [`Model`](crate::Model) is one backend, the distributed pipeline
//! another. The loop does prefill, sampling, EOS / max-token / caller stops, and timing.

use std::time::Instant;

use crate::forward::{Model, TokenPos};
use crate::kv::{KvCache, SeqId};
use crate::sampling::{argmax, mask, Sampler, SamplingParams};
use crate::EngineError;

/// Runs forward steps for one sequence.
pub trait StepBackend {
    /// Feeds `ids` at positions `start_pos..` of sequence `seq`; returns the logits `(vocab,)`
    /// of the last of them.
    fn step(&mut self, seq: SeqId, ids: &[u32], start_pos: usize) -> Result<Vec<f32>, EngineError>;

    /// [`StepBackend::step`] for greedy decoding: the argmax ([`argmax`]) of the last
    /// position's logits after setting the `masked` ids to −∞. A backend whose logits live
    /// elsewhere (the last device of a pipeline) computes it there and returns only the id.
    fn step_argmax(
        &mut self,
        seq: SeqId,
        ids: &[u32],
        start_pos: usize,
        masked: &[u32],
    ) -> Result<u32, EngineError> {
        let mut logits = self.step(seq, ids, start_pos)?;
        mask(&mut logits, masked);
        Ok(argmax(&logits))
    }
}

/// The next token: an id already chosen by the backend, or logits to sample from.
enum Next {
    Id(u32),
    Logits(Vec<f32>),
}

/// The single-device engine as a backend: a bound model and its cache.
pub struct Generator<'m, 'a> {
    /// the model
    pub model: &'m Model<'a>,
    /// its KV cache
    pub kv: KvCache,
}

impl<'m, 'a> Generator<'m, 'a> {
    /// A generator with an empty cache under an optional KV byte budget.
    pub fn new(model: &'m Model<'a>, kv_budget: Option<u64>) -> Self {
        Generator {
            model,
            kv: model.new_cache(kv_budget),
        }
    }
}

impl StepBackend for Generator<'_, '_> {
    fn step(&mut self, seq: SeqId, ids: &[u32], start_pos: usize) -> Result<Vec<f32>, EngineError> {
        let batch: Vec<TokenPos> = (0..ids.len())
            .map(|i| TokenPos {
                seq,
                pos: start_pos + i,
            })
            .collect();
        let x = self.model.forward_hidden(ids, &batch, &mut self.kv)?;
        self.model.logits(&x, &[ids.len() - 1])
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// most new tokens
    pub max_tokens: usize,
    /// sampling
    pub sampling: SamplingParams,
    /// tokens that end generation (not included in the output)
    pub eos_ids: Vec<u32>,
    /// generate at least this many tokens: until then EOS tokens are masked out of the
    /// logits (HF `min_new_tokens`)
    pub min_tokens: usize,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// reached max tokens
    Length,
    /// produced an EOS token
    Eos,
    /// the caller asked to stop (e.g. a stop string)
    Stop,
}

/// The result of one generation.
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    /// new token ids (EOS excluded)
    pub new_ids: Vec<u32>,
    /// why it ended
    pub stop: StopReason,
    /// milliseconds for the prompt step
    pub prompt_ms: f64,
    /// milliseconds per decode step (0 when there was none)
    pub decode_ms_per_token: f64,
}

/// Whether the caller wants more tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// keep going
    Continue,
    /// stop now (the current token is kept)
    Stop,
}

/// Generates up to `opts.max_tokens` tokens for `prompt` as sequence `seq`. `on_token` sees
/// each new token as it is produced.
pub fn generate<B: StepBackend + ?Sized>(
    backend: &mut B,
    seq: SeqId,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<GenerateOutput, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::Invalid("the prompt has no tokens".into()));
    }
    let mut sampler = Sampler::new(opts.sampling.clone())?;
    // Greedy decoding needs only the argmax: the backend computes it where the logits are.
    let greedy = sampler.is_greedy();
    let no_eos: &[u32] = &[];
    let step = |backend: &mut B, ids: &[u32], start: usize, new: usize| {
        let masked = if new < opts.min_tokens {
            &opts.eos_ids[..]
        } else {
            no_eos
        };
        if greedy {
            backend.step_argmax(seq, ids, start, masked).map(Next::Id)
        } else {
            let mut logits = backend.step(seq, ids, start)?;
            mask(&mut logits, masked);
            Ok(Next::Logits(logits))
        }
    };
    let t0 = Instant::now();
    let mut next = step(backend, prompt, 0, 0)?;
    let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut new_ids = Vec::new();
    let mut stop = StopReason::Length;
    let mut decode_steps = 0usize;
    let t1 = Instant::now();
    while new_ids.len() < opts.max_tokens {
        let id = match &next {
            Next::Id(id) => *id,
            Next::Logits(logits) => sampler.sample(logits),
        };
        if opts.eos_ids.contains(&id) {
            stop = StopReason::Eos;
            break;
        }
        new_ids.push(id);
        if on_token(id) == Flow::Stop {
            stop = StopReason::Stop;
            break;
        }
        if new_ids.len() == opts.max_tokens {
            break;
        }
        next = step(
            backend,
            &[id],
            prompt.len() + new_ids.len() - 1,
            new_ids.len(),
        )?;
        decode_steps += 1;
    }
    let decode_ms_per_token = if decode_steps > 0 {
        t1.elapsed().as_secs_f64() * 1e3 / decode_steps as f64
    } else {
        0.0
    };
    Ok(GenerateOutput {
        new_ids,
        stop,
        prompt_ms,
        decode_ms_per_token,
    })
}
