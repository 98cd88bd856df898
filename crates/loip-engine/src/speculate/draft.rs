//! A draft model: a smaller model with the same tokenizer proposes the next `k` tokens, in
//! memory: by greedy decoding (point masses, checked by exact match), or under a sampled
//! request by sampling its own distribution ([`ModelDrafter::sampling`]; checked by the
//! speculative sampling rule against the target's).
//!
//! The draft keeps its own KV cache of the context it has seen; each proposal feeds the
//! context tokens it has not seen yet in one step, decodes `k` tokens one at a time, then
//! rewinds its cache to the context (its proposals that the target accepts come back as
//! context next time). Whatever the draft proposes, the output is the target's: its tokens
//! (greedy proposals) or its distribution (sampled ones), see [`super`].
//!
//! Invariant: the draft and the target share token ids; [`vocab_matches`] checks the
//! models' side of it (vocabulary size and special ids), the caller the tokenizers.

use crate::forward::TokenPos;
use crate::generate::Generator;
use crate::kv::SeqId;
use crate::sampling::{argmax, Dist, Sampler, SamplingParams};
use crate::speculate::{Drafter, Proposal, Rewind};
use crate::EngineError;

/// A self-draft: the target's own first `layers` layers, its final norm and its head, as a
/// model of its own (the same weights, bound again: nothing copied). Its vocabulary is the
/// target's by construction; the full model verifies, so the tokens are the target's.
/// `layers` must be at least 1 and fewer than the target's.
pub fn self_draft(
    target: &loip_model::Checkpoint,
    layers: usize,
) -> Result<crate::Model<'_>, EngineError> {
    let all = target.config.num_layers;
    if layers == 0 || layers >= all {
        return Err(EngineError::Invalid(format!(
            "a self-draft takes 1 to {} of the model's {all} layers, not {layers}",
            all.saturating_sub(1)
        )));
    }
    let mut cfg = target.config.clone();
    cfg.num_layers = layers;
    cfg.sliding_layers.truncate(layers);
    crate::Model::bind(target, &cfg, target.qk_permuted)
}

/// The layers of a self-draft named `self:L` (`--draft self:L`), `None` for another name.
pub fn self_draft_layers(name: &str) -> Result<Option<usize>, EngineError> {
    let Some(n) = name.strip_prefix("self:") else {
        return Ok(None);
    };
    n.parse().map(Some).map_err(|_| {
        EngineError::Invalid(format!(
            "--draft self:L takes a number of layers, not {n:?}"
        ))
    })
}

/// Greedy proposals of a draft model over any backend that can rewind.
pub struct ModelDrafter<B> {
    draft: B,
    seq: SeqId,
    fed: usize,               // context tokens in the draft's KV
    last: Option<u32>,        // the context token at `fed - 1`, to notice a changed context
    sampler: Option<Sampler>, // draws the proposals of [`Drafter::propose_drawn`]
}

/// A draft sampler's seed from the request's: its own stream, fixed by the request's seed.
const DRAFT_SEED: u64 = 0x5bd1_e995_d1b5_4a32;

impl<B: Rewind> ModelDrafter<B> {
    /// A drafter over `draft` (its KV must not hold sequence `seq`).
    pub fn new(draft: B, seq: SeqId) -> Self {
        ModelDrafter {
            draft,
            seq,
            fed: 0,
            last: None,
            sampler: None,
        }
    }

    /// Samples the proposals of [`Drafter::propose_drawn`] as a request with `params` does
    /// (temperature, top-k, top-p; its own RNG, seeded from `params.seed`) when they are not
    /// greedy; greedy proposals otherwise.
    pub fn sampling(mut self, params: &SamplingParams) -> Result<Self, EngineError> {
        let params = SamplingParams {
            seed: params.seed ^ DRAFT_SEED,
            ..params.clone()
        };
        let sampler = Sampler::new(params)?;
        self.sampler = (!sampler.is_greedy()).then_some(sampler);
        Ok(self)
    }

    /// The draft backend.
    pub fn backend(&self) -> &B {
        &self.draft
    }

    /// The next token after feeding `ids` at `start..`: the argmax, or a draw and the
    /// distribution it came from when `drawn`.
    fn step(
        &mut self,
        ids: &[u32],
        start: usize,
        drawn: bool,
    ) -> Result<(u32, Option<Dist>), EngineError> {
        let batch: Vec<TokenPos> = (start..start + ids.len())
            .map(|pos| TokenPos { seq: self.seq, pos })
            .collect();
        let logits = self.draft.forward_rows(ids, &batch, &[ids.len() - 1])?;
        match self.sampler.as_mut().filter(|_| drawn) {
            Some(s) => {
                let q = s.distribution(&logits);
                if q.ids.is_empty() {
                    return Ok((argmax(&logits), None));
                }
                Ok((s.draw(&q), Some(q)))
            }
            None => Ok((argmax(&logits), None)),
        }
    }

    /// Up to `k` proposals after `context`, drawn (with their distributions) when `drawn`
    /// and this drafter samples; greedy otherwise.
    fn draft(&mut self, context: &[u32], k: usize, drawn: bool) -> Result<Proposal, EngineError> {
        if k == 0 || context.is_empty() {
            return Ok(Proposal::default());
        }
        // The context only grows; if it does not extend what the draft saw, start over.
        if self.fed > context.len() || (self.fed > 0 && self.last != Some(context[self.fed - 1])) {
            self.draft.release(self.seq);
            self.fed = 0;
        }
        if self.fed == context.len() {
            // nothing new: feed the last token again for its logits
            self.fed -= 1;
            self.draft.rewind(self.seq, self.fed)?;
        }
        if self.fed == 0 {
            self.draft.allow_rewind(k);
        }
        // a draft with a shorter context limit proposes nothing near its end
        if let Some(limit) = self.draft.max_positions() {
            if context.len() + k > limit {
                return Ok(Proposal::default());
            }
        }
        let mut out = Proposal::default();
        let mut next = self.step(&context[self.fed..], self.fed, drawn)?;
        self.fed = context.len();
        self.last = context.last().copied();
        loop {
            out.tokens.push(next.0);
            out.q.extend(next.1);
            if out.tokens.len() == k {
                break;
            }
            next = self.step(&[next.0], context.len() + out.tokens.len() - 1, drawn)?;
        }
        // drop the proposals' KV (all but the context)
        self.draft.rewind(self.seq, self.fed)?;
        Ok(out)
    }
}

impl<B: Rewind> Drafter for ModelDrafter<B> {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, EngineError> {
        Ok(self.draft(context, k, false)?.tokens)
    }

    fn propose_drawn(&mut self, context: &[u32], k: usize) -> Result<Proposal, EngineError> {
        self.draft(context, k, true)
    }
}

/// Whether a draft model's token ids can stand for the target's: the same vocabulary size
/// and the same special ids (BOS, EOS). `Err` names the first difference.
pub fn vocab_matches(
    target: &loip_model::ModelConfig,
    draft: &loip_model::ModelConfig,
) -> Result<(), String> {
    if target.vocab_size != draft.vocab_size {
        return Err(format!(
            "vocabulary of {} tokens, the target's has {}",
            draft.vocab_size, target.vocab_size
        ));
    }
    if target.bos_token_id != draft.bos_token_id {
        return Err(format!(
            "BOS id {:?}, the target's is {:?}",
            draft.bos_token_id, target.bos_token_id
        ));
    }
    if target.eos_token_ids != draft.eos_token_ids {
        return Err(format!(
            "EOS ids {:?}, the target's are {:?}",
            draft.eos_token_ids, target.eos_token_ids
        ));
    }
    Ok(())
}

/// An in-memory draft model as a drafter.
pub type GeneratorDrafter<'m, 'a> = ModelDrafter<Generator<'m, 'a>>;
