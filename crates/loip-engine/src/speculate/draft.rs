//! A draft model: a smaller model with the same tokenizer proposes the next `k` tokens by
//! greedy decoding, in memory.
//!
//! The draft keeps its own KV cache of the context it has seen; each proposal feeds the
//! context tokens it has not seen yet in one step, decodes `k` tokens one at a time, then
//! rewinds its cache to the context (its proposals that the target accepts come back as
//! context next time). Greedy proposals are checked by exact match ([`super`]), so the
//! output is the target's whatever the draft.
//!
//! Invariant: the draft and the target share token ids; [`vocab_matches`] checks the
//! models' side of it (vocabulary size and special ids), the caller the tokenizers.

use crate::forward::TokenPos;
use crate::generate::Generator;
use crate::kv::SeqId;
use crate::sampling::argmax;
use crate::speculate::{Drafter, Rewind};
use crate::EngineError;

/// Greedy proposals of a draft model over any backend that can rewind.
pub struct ModelDrafter<B> {
    draft: B,
    seq: SeqId,
    fed: usize,        // context tokens in the draft's KV
    last: Option<u32>, // the context token at `fed - 1`, to notice a changed context
}

impl<B: Rewind> ModelDrafter<B> {
    /// A drafter over `draft` (its KV must not hold sequence `seq`).
    pub fn new(draft: B, seq: SeqId) -> Self {
        ModelDrafter {
            draft,
            seq,
            fed: 0,
            last: None,
        }
    }

    /// The draft backend.
    pub fn backend(&self) -> &B {
        &self.draft
    }

    fn step(&mut self, ids: &[u32], start: usize) -> Result<u32, EngineError> {
        let batch: Vec<TokenPos> = (start..start + ids.len())
            .map(|pos| TokenPos { seq: self.seq, pos })
            .collect();
        let logits = self.draft.forward_rows(ids, &batch, &[ids.len() - 1])?;
        Ok(argmax(&logits))
    }
}

impl<B: Rewind> Drafter for ModelDrafter<B> {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, EngineError> {
        if k == 0 || context.is_empty() {
            return Ok(Vec::new());
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
                return Ok(Vec::new());
            }
        }
        let mut out = Vec::with_capacity(k);
        let mut next = self.step(&context[self.fed..], self.fed)?;
        self.fed = context.len();
        self.last = context.last().copied();
        out.push(next);
        while out.len() < k {
            next = self.step(&[next], context.len() + out.len() - 1)?;
            out.push(next);
        }
        // drop the proposals' KV (all but the context)
        self.draft.rewind(self.seq, self.fed)?;
        Ok(out)
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
