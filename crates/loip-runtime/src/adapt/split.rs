//! The last resort for a micro-batch that holds the KV itself: when the step's own sequences
//! need more KV together than some device can hold in any layout (with lending), no eviction
//! of *other* sequences helps and holding the step would wait for itself. The adapter splits
//! it instead ([`Verdict::Split`](super::Verdict::Split)): groups of its sequences that each
//! fit alone, those whose KV is held first (no recomputation), in batch order. The
//! coordinator runs the groups as sub-steps one after another (`coordinator/split.rs`) and
//! answers the step with their rows in the original order. Each sub-step is decided like any
//! step: with nothing else in flight the other groups' sequences are evicted (their ids kept)
//! and a group whose KV was evicted is re-prefilled first (`adapt/evict.rs`). The sequences
//! of a split micro-batch stay admitted: their evicted KV is never held as a new admission
//! (that would wait for the micro-batch it is part of). Lossless: every sub-step computes
//! what the whole step computes for its sequences (a token's hidden state depends only on
//! its own sequence). The price: while the micro-batch stays together, every step
//! recomputes the KV of the groups after the first.

use std::collections::BTreeMap;

use loip_engine::TokenPos;

use super::{lock, Adapter};

impl Adapter {
    /// The groups to run `batch` as when its own sequences (`after`: KV tokens per
    /// sequence once the step ran) cannot be held together; `None` when they can, or the
    /// step has one sequence.
    pub(super) fn split_for(
        &mut self,
        batch: &[TokenPos],
        after: &BTreeMap<u64, u64>,
    ) -> Option<Vec<Vec<u64>>> {
        let mut seqs: Vec<u64> = Vec::new();
        for t in batch {
            if !seqs.contains(&t.seq) {
                seqs.push(t.seq);
            }
        }
        if seqs.len() < 2 {
            return None;
        }
        let fits = |g: &[u64]| {
            let tokens: u64 = g.iter().filter_map(|s| after.get(s)).sum();
            self.can_hold(tokens, g.len() as u64)
        };
        if fits(&seqs) {
            return None;
        }
        // held KV first (nothing to recompute), then evicted or new ones; batch order within
        seqs.sort_by_key(|s| !self.held.contains_key(s));
        let mut groups: Vec<Vec<u64>> = Vec::new();
        for s in seqs {
            let joined = groups.last().is_some_and(|g| {
                let mut g = g.clone();
                g.push(s);
                fits(&g)
            });
            match groups.last_mut() {
                Some(g) if joined => g.push(s),
                _ => groups.push(vec![s]),
            }
        }
        self.split.extend(groups.iter().flatten().copied());
        tracing::warn!(
            "the KV of a micro-batch's own sequences fits no layout together: split into \
             {groups:?}"
        );
        lock(&self.report).split_steps += 1;
        Some(groups)
    }
}
