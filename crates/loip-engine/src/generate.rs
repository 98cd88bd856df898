//! The generation loop, independent of where the forward runs.
//!
//! A [`StepBackend`] advances one sequence by some tokens and returns the last position's
//! logits; the single-device [`Model`](crate::Model) is one backend, the distributed pipeline
//! another. The loop does prefill, sampling, EOS / max-token / caller stops, and timing.

use std::time::Instant;

use crate::forward::{Model, TokenPos};
use crate::kv::{KvCache, SeqId};
use std::collections::BTreeMap;

use crate::constraint::Running;
use crate::sampling::{
    argmax, argmax_masked, logprob_of, mask, Dist, Sampler, SamplingParams, Shaping, TokenLogprob,
};
use crate::EngineError;

/// Runs forward steps for one sequence.
pub trait StepBackend {
    /// Feeds `ids` at positions `start_pos..` of sequence `seq`; returns the logits `(vocab,)`
    /// of the last of them.
    fn step(&mut self, seq: SeqId, ids: &[u32], start_pos: usize) -> Result<Vec<f32>, EngineError>;

    /// [`StepBackend::step`] for greedy decoding: the argmax ([`argmax_masked`]) of the last
    /// position's logits after setting the `masked` ids to −∞. A backend whose logits live
    /// elsewhere (the last device of a pipeline) computes it there and returns only the id.
    fn step_argmax(
        &mut self,
        seq: SeqId,
        ids: &[u32],
        start_pos: usize,
        masked: &[u32],
    ) -> Result<u32, EngineError> {
        let logits = self.step(seq, ids, start_pos)?;
        Ok(argmax_masked(&logits, masked))
    }
}

/// The next token: an id already chosen by the backend, or logits to sample from.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// chosen where the logits are (greedy)
    Id(u32),
    /// the last position's logits `(vocab,)`, EOS already masked where due
    Logits(Vec<f32>),
}

/// One sequence's decoding state: its sampler (own RNG), the EOS mask of `min_tokens`, the
/// EOS / max-token / caller stops. The generation loop and the batch runner both advance a
/// sequence through it, so a sequence decodes the same whatever batch it runs in.
#[derive(Debug, Clone)]
pub struct Decoding {
    opts: GenerateOptions,
    sampler: Sampler,
    new_ids: Vec<u32>,        // kept new tokens (EOS excluded)
    stop: Option<StopReason>, // set once done
    /// penalties, bias and log-probabilities asked for (off for most requests)
    shaping: Shaping,
    /// kept new tokens' ids and how often each came (with shaping on)
    counts: BTreeMap<u32, u32>,
    /// the prompt's ids, sorted, without repeats (with a repetition penalty)
    prompt_ids: Vec<u32>,
    /// log-probabilities of kept tokens not yet taken ([`Decoding::take_logprobs`])
    logprobs: Vec<TokenLogprob>,
    /// the grammar's state, with a constraint asked for
    constraint: Option<Running>,
}

impl Decoding {
    /// A fresh state; fails on bad sampling parameters.
    pub fn new(opts: &GenerateOptions) -> Result<Decoding, EngineError> {
        Decoding::shaped(opts, &Shaping::default(), &[])
    }

    /// A fresh state that also shapes each token's logits (a copy) and records
    /// log-probabilities as `shaping` asks; `prompt` is the sequence's prompt (for a
    /// repetition penalty). The shaping is not validated here ([`Shaping::validate`]).
    pub fn shaped(
        opts: &GenerateOptions,
        shaping: &Shaping,
        prompt: &[u32],
    ) -> Result<Decoding, EngineError> {
        let mut prompt_ids = Vec::new();
        if shaping.repetition_penalty.is_some() {
            prompt_ids = prompt.to_vec();
            prompt_ids.sort_unstable();
            prompt_ids.dedup();
        }
        Ok(Decoding {
            sampler: Sampler::new(opts.sampling.clone())?,
            stop: (opts.max_tokens == 0).then_some(StopReason::Length),
            opts: opts.clone(),
            new_ids: Vec::new(),
            shaping: shaping.clone(),
            counts: BTreeMap::new(),
            prompt_ids,
            logprobs: Vec::new(),
            constraint: shaping.constraint.as_ref().map(Running::start),
        })
    }

    /// Whether the next token is the argmax (the backend may pick it where the logits are):
    /// greedy sampling and no shaping.
    pub fn greedy(&self) -> bool {
        self.sampler.is_greedy() && self.shaping.is_off()
    }

    /// Log-probabilities of the kept tokens since the last call (with `logprobs` asked for).
    pub fn take_logprobs(&mut self) -> Vec<TokenLogprob> {
        std::mem::take(&mut self.logprobs)
    }

    /// The ids to mask out of the next token's logits: the EOS ids until `min_tokens`.
    pub fn masked(&self) -> &[u32] {
        self.masked_after(0)
    }

    /// [`Decoding::masked`] once `more` tokens more are kept (row `more` of a speculative
    /// step, used only once the `more` drafts before it were kept).
    pub fn masked_after(&self, more: usize) -> &[u32] {
        if self.new_ids.len() + more < self.opts.min_tokens {
            &self.opts.eos_ids
        } else {
            &[]
        }
    }

    /// Takes the next token from `next`; `on_token` sees it if kept. Returns the token to
    /// feed for the following step, or `None` once done ([`Decoding::stop_reason`]).
    pub fn accept(&mut self, next: &Next, on_token: &mut dyn FnMut(u32) -> Flow) -> Option<u32> {
        if self.stop.is_some() {
            return None;
        }
        let mut logprob = None;
        let id = match next {
            Next::Id(id) => *id,
            Next::Logits(logits) if self.shaping.is_off() => self.sampler.sample(logits),
            Next::Logits(logits) => {
                let Some(shaped) = self.shaped_logits(logits) else {
                    // the grammar allows nothing more: it is complete
                    self.stop = Some(StopReason::Eos);
                    return None;
                };
                let id = self.sampler.sample(&shaped);
                logprob = self.shaping.logprobs.map(|n| logprob_of(logits, id, n));
                id
            }
        };
        self.keep(id, logprob, on_token)
    }

    /// [`Decoding::accept`] of a draft `x` drawn from `q` (a sampled draft model), with the
    /// speculative sampling rule ([`Sampler::keep_or_resample`]) against this sequence's
    /// sampling distribution of `logits` (the row, EOS already masked where due): the kept
    /// token is distributed as [`Decoding::accept`]'s. Returns what `accept` returns and
    /// whether the draft was kept.
    pub fn accept_draft(
        &mut self,
        logits: &[f32],
        x: u32,
        q: &Dist,
        on_token: &mut dyn FnMut(u32) -> Flow,
    ) -> (Option<u32>, bool) {
        if self.stop.is_some() {
            return (None, false);
        }
        let p = if self.shaping.is_off() {
            self.sampler.distribution(logits)
        } else {
            match self.shaped_logits(logits) {
                Some(shaped) => self.sampler.distribution(&shaped),
                None => {
                    self.stop = Some(StopReason::Eos);
                    return (None, false);
                }
            }
        };
        let (id, drafted) = if p.ids.is_empty() {
            (argmax(logits), false)
        } else {
            self.sampler.keep_or_resample(&p, x, q)
        };
        let logprob = self.shaping.logprobs.map(|n| logprob_of(logits, id, n));
        (self.keep(id, logprob, on_token), drafted)
    }

    /// A copy of `logits` with the request's penalties and bias applied and what its
    /// grammar forbids masked; `None` when the grammar allows no token.
    fn shaped_logits(&mut self, logits: &[f32]) -> Option<Vec<f32>> {
        let mut shaped = logits.to_vec();
        self.shaping
            .apply(&mut shaped, &self.counts, &self.prompt_ids);
        let allowed = match &mut self.constraint {
            Some(c) => c.mask(&mut shaped, &self.opts.eos_ids),
            None => true,
        };
        allowed.then_some(shaped)
    }

    /// Keeps the chosen `id` (or stops on EOS); the rest of [`Decoding::accept`].
    fn keep(
        &mut self,
        id: u32,
        logprob: Option<TokenLogprob>,
        on_token: &mut dyn FnMut(u32) -> Flow,
    ) -> Option<u32> {
        if self.opts.eos_ids.contains(&id) {
            self.stop = Some(StopReason::Eos);
            return None;
        }
        self.new_ids.push(id);
        if !self.shaping.is_off() {
            *self.counts.entry(id).or_insert(0) += 1;
        }
        self.logprobs.extend(logprob);
        // a token the grammar refuses cannot be sampled (it was masked); were it fed anyway,
        // the grammar could not go on
        let allowed = self.constraint.as_mut().is_none_or(|c| c.advance(id));
        if on_token(id) == Flow::Stop || !allowed {
            self.stop = Some(StopReason::Stop);
        } else if self.new_ids.len() >= self.opts.max_tokens {
            self.stop = Some(StopReason::Length);
        }
        self.stop.is_none().then_some(id)
    }

    /// Ends the sequence at the caller's request (the tokens so far are kept).
    pub fn stop(&mut self) {
        self.stop.get_or_insert(StopReason::Stop);
    }

    /// Why it ended, once done.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    /// New tokens still wanted: `max_tokens` less those kept.
    pub fn wanted(&self) -> usize {
        self.opts.max_tokens.saturating_sub(self.new_ids.len())
    }

    /// The kept new tokens.
    pub fn new_ids(&self) -> &[u32] {
        &self.new_ids
    }
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
    let mut dec = Decoding::new(opts)?;
    let step = |backend: &mut B, dec: &Decoding, ids: &[u32], start: usize| {
        // Greedy decoding needs only the argmax: the backend computes it where the logits are.
        if dec.greedy() {
            backend
                .step_argmax(seq, ids, start, dec.masked())
                .map(Next::Id)
        } else {
            let mut logits = backend.step(seq, ids, start)?;
            mask(&mut logits, dec.masked());
            Ok(Next::Logits(logits))
        }
    };
    let t0 = Instant::now();
    let mut next = step(backend, &dec, prompt, 0)?;
    let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut decode_steps = 0usize;
    let t1 = Instant::now();
    while let Some(id) = dec.accept(&next, on_token) {
        next = step(backend, &dec, &[id], prompt.len() + dec.new_ids().len() - 1)?;
        decode_steps += 1;
    }
    let decode_ms_per_token = if decode_steps > 0 {
        t1.elapsed().as_secs_f64() * 1e3 / decode_steps as f64
    } else {
        0.0
    };
    Ok(GenerateOutput {
        stop: dec.stop_reason().unwrap_or(StopReason::Length),
        new_ids: dec.new_ids,
        prompt_ms,
        decode_ms_per_token,
    })
}
