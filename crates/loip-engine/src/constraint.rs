//! Constrained decoding: what a sequence may sample next, as a grammar (a JSON schema, a
//! Lark grammar) allows it.
//!
//! The engine knows only the two traits: a [`Constraint`] (one compiled grammar, shared by
//! every request that asks for it) starts a [`ConstraintState`] per sequence, which masks a
//! *copy* of the logits before sampling and advances by each kept token. The model's logits,
//! and so the log-probabilities reported, are never changed. The grammar engine itself
//! (`llguidance` over the tokenizer's vocabulary) lives in the server, which owns the
//! tokenizer.

use std::fmt;
use std::sync::Arc;

/// One compiled grammar: starts a fresh state for each sequence that decodes under it.
pub trait Constraint: Send + Sync {
    /// The state at the start of a generation (nothing generated yet).
    fn start(&self) -> Box<dyn ConstraintState>;
}

/// One sequence's place in its grammar.
pub trait ConstraintState: Send {
    /// Sets to −∞ each entry of `logits` (a copy of the model's) that may not come next;
    /// the `eos` ids stay only where the grammar may end. Returns `false` when no token may
    /// come next (the grammar is complete and ending is not allowed, or it failed).
    fn mask(&mut self, logits: &mut [f32], eos: &[u32]) -> bool;

    /// Moves past the kept token `id` (not an end-of-sequence id); `false` if the grammar
    /// does not allow it.
    fn advance(&mut self, id: u32) -> bool;

    /// An independent copy (a decoding state is cloned, e.g. to try a path and drop it).
    fn box_clone(&self) -> Box<dyn ConstraintState>;
}

/// A request's grammar, as [`Shaping`](crate::Shaping) holds it: equal only to itself (two
/// requests with the same grammar text share one, from the server's cache).
#[derive(Clone)]
pub struct Constrained(pub Arc<dyn Constraint>);

impl PartialEq for Constrained {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl fmt::Debug for Constrained {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Constrained(..)")
    }
}

/// A running [`ConstraintState`], cloneable.
pub(crate) struct Running(Box<dyn ConstraintState>);

impl Running {
    pub(crate) fn start(c: &Constrained) -> Running {
        Running(c.0.start())
    }

    pub(crate) fn mask(&mut self, logits: &mut [f32], eos: &[u32]) -> bool {
        self.0.mask(logits, eos)
    }

    pub(crate) fn advance(&mut self, id: u32) -> bool {
        self.0.advance(id)
    }
}

impl Clone for Running {
    fn clone(&self) -> Self {
        Running(self.0.box_clone())
    }
}

impl fmt::Debug for Running {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Running(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{Decoding, Flow, GenerateOptions, Next};
    use crate::sampling::{logprob_of, SamplingParams, Shaping};

    /// Tokens must alternate 1, 2, 1, 2, ... and may end after a 2.
    #[derive(Clone)]
    struct Alternate {
        last: Option<u32>,
    }

    impl ConstraintState for Alternate {
        fn mask(&mut self, logits: &mut [f32], eos: &[u32]) -> bool {
            let want = if self.last == Some(1) { 2 } else { 1 };
            for (i, l) in logits.iter_mut().enumerate() {
                let end_ok = self.last == Some(2) && eos.contains(&(i as u32));
                if i as u32 != want && !end_ok {
                    *l = f32::NEG_INFINITY;
                }
            }
            true
        }
        fn advance(&mut self, id: u32) -> bool {
            self.last = Some(id);
            true
        }
        fn box_clone(&self) -> Box<dyn ConstraintState> {
            Box::new(self.clone())
        }
    }

    struct AlternateGrammar;
    impl Constraint for AlternateGrammar {
        fn start(&self) -> Box<dyn ConstraintState> {
            Box::new(Alternate { last: None })
        }
    }

    #[test]
    fn a_constraint_masks_what_is_sampled_not_the_logprobs() {
        let opts = GenerateOptions {
            max_tokens: 5,
            sampling: SamplingParams {
                temperature: 1.0,
                seed: 3,
                ..Default::default()
            },
            eos_ids: vec![0],
            min_tokens: 0,
        };
        let s = Shaping {
            logprobs: Some(2),
            constraint: Some(Constrained(Arc::new(AlternateGrammar))),
            ..Default::default()
        };
        let logits = vec![0.0f32, -3.0, -4.0, 5.0];
        let mut d = Decoding::shaped(&opts, &s, &[]).unwrap();
        assert!(!d.greedy());
        while d
            .accept(&Next::Logits(logits.clone()), &mut |_| Flow::Continue)
            .is_some()
        {}
        let ids = d.new_ids().to_vec();
        assert!(!ids.is_empty());
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(id, if i % 2 == 0 { 1 } else { 2 }, "{ids:?}");
        }
        // the reported log-probabilities are the model's own
        let lps = d.take_logprobs();
        assert_eq!(lps[0], logprob_of(&logits, 1, 2));
    }
}
