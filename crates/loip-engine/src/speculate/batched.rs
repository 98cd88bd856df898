//! One sequence's speculation inside the batch runner ([`crate::batch`]): its drafts for the
//! next decode step, its adaptive draft length and what it drafted and kept.
//!
//! The batch runner verifies a speculating sequence's pending token and drafts as several
//! rows of a shared step (other sequences, plain or speculating, in the same forward); a row
//! is used only once the drafts before it were kept, exactly as in
//! [`generate_speculative`](super::generate_speculative), so the sequence's tokens and each
//! kept token's logits are those of decoding alone without speculation. A shared step's
//! time is not a sequence's own: the draft length adapts from the sequence's acceptance rate
//! and the measured times of the serving loop's steps by size, so that drafts that would slow
//! the neighbours more than they gain are not verified ([`AdaptiveK::next_k_shared`]).
//!
//! Pure: token ids in, drafts out.

use super::adapt::{AdaptiveK, StepCost};
use super::lookup::Lookup;
use super::options::{SpecOptions, SpecStats, Speculate};

/// A speculating sequence's state in the batch runner.
#[derive(Debug, Clone)]
pub struct SeqSpec {
    source: Speculate,
    lookup: Lookup,
    adapt: AdaptiveK,
    drafts: Vec<u32>, // ready for the next decode step
    /// what it drafted and kept so far
    pub stats: SpecStats,
}

impl SeqSpec {
    /// Speculation from `source` (prompt lookup; a draft model is not served in batches)
    /// with `opts`.
    pub fn new(source: Speculate, opts: &SpecOptions) -> SeqSpec {
        SeqSpec {
            source,
            lookup: Lookup::default(),
            adapt: opts.controller(),
            drafts: Vec::new(),
            stats: SpecStats::default(),
        }
    }

    /// Where its drafts come from.
    pub fn source(&self) -> Speculate {
        self.source
    }

    /// Drafts for the step after `context` (prompt and kept tokens), at most `wanted` (the
    /// tokens still wanted after that step's first), for a step shared with about `others`
    /// positions of other sequences whose times by size `cost` holds: returns how many are
    /// ready.
    pub fn prepare(
        &mut self,
        context: &[u32],
        wanted: usize,
        others: usize,
        cost: &StepCost,
    ) -> usize {
        let k = self.adapt.next_k_shared(others, cost).min(wanted);
        self.drafts = match self.source {
            Speculate::Lookup => self.lookup.draft(context, k),
            Speculate::Off | Speculate::Draft => Vec::new(),
        };
        self.drafts.len()
    }

    /// The drafts [`SeqSpec::prepare`] made.
    pub fn drafts(&self) -> &[u32] {
        &self.drafts
    }

    /// A step verified `drafted` drafts and kept the first `accepted`.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        self.stats.steps += 1;
        self.stats.drafted += drafted;
        self.stats.accepted += accepted.min(drafted);
        self.stats.draft_steps += usize::from(drafted > 0);
        self.adapt.observe(drafted, accepted, None);
        self.drafts.clear();
    }
}
