//! The last resort of online adaptation (design §6): eviction and recomputation, lossless.
//!
//! When a step of an admitted sequence needs more KV than any layout of some device leaves
//! room for, nothing else is in flight (no sequence can finish and make room), switches and
//! lending are exhausted, the coordinator evicts the newest-admitted *other* sequences, one
//! at a time, until the step fits: their KV is released on every device
//! ([`Action::Evict`]), but the coordinator keeps their token ids (it saw every step's
//! tokens, [`Adapter::record`]). An evicted sequence's next step is a new admission for the
//! adapter: held until it fits again, then preceded by steps that re-prefill its prompt and
//! generated tokens (chunks of at most the step limit, no output rows,
//! [`Action::Recompute`]). The workers compute exactly what they computed the first time
//! (positions from 0, the same ids, the same chunking does not matter: prefill is
//! bit-identical to decoding one token at a time in this engine), so tokens and logits stay
//! bit-identical. An admitted request never fails for memory and the budget is never
//! exceeded.

use std::collections::BTreeMap;

use loip_engine::TokenPos;
use loip_plan::adapt::AdaptEvent;

use super::{lock, Action, Adapter};

/// What eviction keeps: every sequence's token ids and which sequences were evicted.
#[derive(Debug, Default)]
pub(super) struct Recompute {
    /// token ids fed per sequence, by position
    ids: BTreeMap<u64, Vec<u32>>,
    /// admission number per sequence held (the newest is evicted first)
    order: BTreeMap<u64, u64>,
    next: u64,
    /// evicted sequences → KV tokens they held  // tokens
    evicted: BTreeMap<u64, u64>,
    /// recomputed by the last step admitted (restored by an undo): (seq, tokens)
    undo: Vec<(u64, u64)>,
}

impl Recompute {
    /// KV tokens evicted now, summed over sequences.  // tokens
    pub(super) fn evicted_tokens(&self) -> u64 {
        self.evicted.values().sum()
    }

    /// Whether `seq` is evicted now.
    pub(super) fn is_evicted(&self, seq: u64) -> bool {
        self.evicted.contains_key(&seq)
    }
}

impl Adapter {
    /// Sequence `seq` keeps its first `len` positions (a speculative step's rejected drafts):
    /// the KV it holds, or held when evicted, and the ids that would re-prefill it.
    pub fn rewind(&mut self, seq: u64, len: usize) {
        if let Some(e) = self.held.get_mut(&seq) {
            *e = (*e).min(len as u64);
        }
        if let Some(e) = self.recomp.evicted.get_mut(&seq) {
            *e = (*e).min(len as u64);
        }
        if let Some(v) = self.recomp.ids.get_mut(&seq) {
            v.truncate(len);
        }
    }

    /// The tokens of a step that entered: the ids at their positions (kept to recompute the
    /// sequence if it is evicted). A step that rolls a sequence back truncates its ids.
    pub fn record(&mut self, batch: &[TokenPos], ids: &[u32]) {
        for (t, &id) in batch.iter().zip(ids) {
            let v = self.recomp.ids.entry(t.seq).or_default();
            if t.pos < v.len() {
                v.truncate(t.pos);
            }
            if t.pos == v.len() {
                v.push(id);
            }
        }
        for t in batch {
            if !self.recomp.order.contains_key(&t.seq) {
                let n = self.recomp.next;
                self.recomp.next += 1;
                self.recomp.order.insert(t.seq, n);
            }
        }
    }

    /// Whether every device can hold `tokens` of KV for `seqs` sequences: in its current
    /// room, with more lent to its peer, or after a switch.
    pub(super) fn can_hold(&self, tokens: u64, seqs: u64) -> bool {
        (0..self.devs.len()).all(|i| {
            let room = self.room(i) + self.lend_headroom(i, tokens, seqs);
            tokens.saturating_mul(self.devs[i].kv_per_token) <= room
                || self.choose(i, tokens, seqs).is_some()
        })
    }

    /// The sequence of `after` to evict next for `batch`: the newest-admitted outside it
    /// whose every id is known (only those can be recomputed), and its KV tokens.
    pub(super) fn victim(
        &self,
        batch: &[TokenPos],
        after: &BTreeMap<u64, u64>,
    ) -> Option<(u64, u64)> {
        after
            .iter()
            .filter(|(s, &n)| {
                !batch.iter().any(|t| t.seq == **s)
                    && self.recomp.ids.get(s).is_some_and(|v| v.len() as u64 >= n)
            })
            .max_by_key(|(s, _)| self.recomp.order.get(s).copied().unwrap_or(0))
            .map(|(&s, &n)| (s, n))
    }

    /// Evicts the newest-admitted sequences of `after` outside `batch` until every device
    /// can hold the rest; the sequences evicted (removed from `after`).
    pub(super) fn evict_for(
        &mut self,
        batch: &[TokenPos],
        after: &mut BTreeMap<u64, u64>,
    ) -> Vec<u64> {
        let mut out = Vec::new();
        loop {
            let tokens: u64 = after.values().sum();
            if self.can_hold(tokens, after.len() as u64) {
                break;
            }
            let Some((seq, n)) = self.victim(batch, after) else {
                break;
            };
            after.remove(&seq);
            self.recomp.order.remove(&seq);
            self.recomp.evicted.insert(seq, n);
            out.push(seq);
        }
        if !out.is_empty() {
            let tokens: u64 = out.iter().filter_map(|s| self.recomp.evicted.get(s)).sum();
            tracing::warn!(
                "no layout holds the KV of the step: evicted sequence(s) {out:?} ({tokens} \
                 tokens), recomputed when they run again"
            );
            let mut rep = lock(&self.report);
            rep.evictions += out.len() as u64;
            rep.events.push(AdaptEvent::Evict {
                step: self.step,
                tokens: tokens.min(u32::MAX as u64) as u32,
            });
            for (i, d) in self.devs.iter().enumerate() {
                if let Some(r) = rep.devices.get_mut(i) {
                    r.evicted_bytes += tokens.saturating_mul(d.kv_per_token);
                }
            }
        }
        out
    }

    /// Tokens a re-prefill step carries: the smallest step limit over the devices (at least 1).
    pub(super) fn recompute_chunk(&self) -> usize {
        self.devs
            .iter()
            .map(|d| d.spec.max_step_tokens)
            .min()
            .unwrap_or(1)
            .max(1)
    }

    /// The steps that re-prefill the evicted sequences of `batch` (everything before their
    /// first position there), in chunks of at most the step limit; they are no longer
    /// evicted.
    pub(super) fn recompute_for(&mut self, batch: &[TokenPos]) -> Option<Action> {
        let chunk = self.recompute_chunk();
        let mut steps = Vec::new();
        self.recomp.undo.clear();
        let mut seqs: Vec<u64> = batch.iter().map(|t| t.seq).collect();
        seqs.dedup();
        for seq in seqs {
            let Some(n) = self.recomp.evicted.remove(&seq) else {
                continue;
            };
            self.recomp.undo.push((seq, n));
            let first = batch
                .iter()
                .filter(|t| t.seq == seq)
                .map(|t| t.pos)
                .min()
                .unwrap_or(0);
            let ids = self.recomp.ids.get(&seq).map(|v| &v[..first.min(v.len())]);
            let Some(ids) = ids else {
                continue;
            };
            for (k, c) in ids.chunks(chunk).enumerate() {
                let start = k * chunk;
                let pos = (start..start + c.len())
                    .map(|pos| TokenPos { seq, pos })
                    .collect();
                steps.push((pos, c.to_vec()));
            }
            let mut rep = lock(&self.report);
            rep.recomputed_tokens += ids.len() as u64;
            tracing::info!(
                "sequence {seq} runs again: {} evicted tokens recomputed",
                ids.len()
            );
        }
        (!steps.is_empty()).then_some(Action::Recompute(steps))
    }

    /// Undoes the last step's recomputation (the step is decided again): the sequences it
    /// recomputed are evicted again, those it evicted stay evicted.
    pub(super) fn undo_recompute(&mut self) {
        for (seq, n) in std::mem::take(&mut self.recomp.undo) {
            self.recomp.evicted.insert(seq, n);
        }
        for s in self.recomp.evicted.keys() {
            self.held.remove(s);
        }
    }

    /// Sequences released: their ids and eviction are forgotten.
    pub(super) fn release_recompute(&mut self, seqs: &[u64]) {
        for s in seqs {
            self.recomp.ids.remove(s);
            self.recomp.order.remove(s);
            self.recomp.evicted.remove(s);
        }
    }
}
