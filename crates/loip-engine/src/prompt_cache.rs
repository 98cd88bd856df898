//! Finished sequences' KV kept for later prompts that start the same way: a chat client
//! resends the whole conversation each turn, so the next request's prompt begins with the
//! last one's prompt and answer. The serving loop ([`crate::Serving`]) keeps the KV of up to
//! [`PromptCacheOptions::entries`] finished sequences; a new prompt that shares at least
//! [`PromptCacheOptions::min_prefix`] leading tokens with one takes a copy of that KV (the
//! same fork the `n` choices of one request use) and computes only the rest. A token's K and
//! V depend only on the tokens before it, so its tokens and logits stay those of
//! [`generate`](crate::generate()) alone.
//!
//! The kept KV lives in the room the scheduler does not promise: after each admission the
//! oldest entries go until the scheduler's reservations plus every kept entry (counted at
//! its whole length on every layer) fit the device's KV budget, and the KV room the loop was
//! sized for (`max_seqs × max_seq_len` tokens where both are set). So an admitted sequence
//! never fails for KV, and the process never holds more KV than it would without the cache.
//!
//! This module is the pure part: which entries are kept, which one a prompt reuses, which
//! goes first. The loop owns the KV itself.

use std::collections::VecDeque;

use crate::kv::SeqId;

/// How many finished sequences' KV the serving loop keeps for later prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptCacheOptions {
    /// most finished sequences kept (0: off)
    pub entries: usize,
    /// fewest leading tokens a later prompt must share with a kept sequence to reuse its
    /// KV // tokens
    pub min_prefix: usize,
}

impl PromptCacheOptions {
    /// No cache: every prompt is computed (the `n` choices of one request still share theirs).
    pub const OFF: PromptCacheOptions = PromptCacheOptions {
        entries: 0,
        min_prefix: DEFAULT_MIN_PREFIX,
    };

    /// A cache of `entries` finished sequences, reused from [`DEFAULT_MIN_PREFIX`] shared
    /// tokens on.
    pub fn keep(entries: usize) -> PromptCacheOptions {
        PromptCacheOptions {
            entries,
            min_prefix: DEFAULT_MIN_PREFIX,
        }
    }
}

/// Shared leading tokens below which a prompt computes its own KV: a chat template's common
/// header is shorter, and copying a few rows saves less than it costs to look them up.
pub const DEFAULT_MIN_PREFIX: usize = 16;

/// The kept sequences, least recently used first.
#[derive(Debug, Clone)]
pub(crate) struct PromptCache {
    opts: PromptCacheOptions,
    /// (sequence, tokens its KV holds)
    kept: VecDeque<(SeqId, usize)>,
}

impl PromptCache {
    pub(crate) fn new(opts: PromptCacheOptions) -> Self {
        PromptCache {
            opts,
            kept: VecDeque::new(),
        }
    }

    pub(crate) fn options(&self) -> PromptCacheOptions {
        self.opts
    }

    /// New options; what is kept stays (the loop trims it to the new count).
    pub(crate) fn set_options(&mut self, opts: PromptCacheOptions) {
        self.opts = opts;
    }

    /// Whether a finished sequence whose KV holds `tokens` tokens is worth keeping.
    pub(crate) fn wants(&self, tokens: usize) -> bool {
        self.opts.entries > 0 && tokens >= self.opts.min_prefix.max(1)
    }

    /// Keeps `seq` as the most recently used entry.
    pub(crate) fn insert(&mut self, seq: SeqId, tokens: usize) {
        self.remove(seq);
        self.kept.push_back((seq, tokens));
    }

    /// Forgets `seq`; returns whether it was kept.
    pub(crate) fn remove(&mut self, seq: SeqId) -> bool {
        let before = self.kept.len();
        self.kept.retain(|&(s, _)| s != seq);
        self.kept.len() != before
    }

    /// The kept entry whose tokens (`held(seq)`) share the longest prefix with `prompt`'s
    /// tokens before its last (which a sequence always feeds itself, to sample from its own
    /// row), if that is at least `min_prefix`; it becomes the most recently used. Ties go to
    /// the most recent.
    pub(crate) fn best<'a>(
        &mut self,
        prompt: &[u32],
        held: impl Fn(SeqId) -> Option<&'a [u32]>,
    ) -> Option<(SeqId, usize)> {
        let want = prompt.len().checked_sub(1)?;
        let mut best: Option<(usize, SeqId, usize)> = None; // (index, seq, shared)
        for (i, &(seq, _)) in self.kept.iter().enumerate() {
            let Some(tokens) = held(seq) else { continue };
            let n = common_prefix(&tokens[..tokens.len().min(want)], &prompt[..want]);
            if best.is_none_or(|(_, _, b)| n >= b) {
                best = Some((i, seq, n));
            }
        }
        let (i, seq, n) = best?;
        if n < self.opts.min_prefix.max(1) {
            return None;
        }
        if let Some(e) = self.kept.remove(i) {
            self.kept.push_back(e);
        }
        Some((seq, n))
    }

    /// Kept entries.
    pub(crate) fn len(&self) -> usize {
        self.kept.len()
    }

    /// Tokens the kept entries hold, all together // tokens
    pub(crate) fn tokens(&self) -> u64 {
        self.kept.iter().map(|&(_, t)| t as u64).sum()
    }

    /// Removes and returns the least recently used entry while `fits(entries, tokens)`
    /// says the cache is too large; `None` once it fits (or is empty).
    pub(crate) fn evict_one(&mut self, fits: impl Fn(usize, u64) -> bool) -> Option<SeqId> {
        if self.kept.is_empty() || fits(self.len(), self.tokens()) {
            return None;
        }
        self.kept.pop_front().map(|(s, _)| s)
    }
}

/// Length of the longest common prefix.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(entries: usize, min_prefix: usize) -> PromptCache {
        PromptCache::new(PromptCacheOptions {
            entries,
            min_prefix,
        })
    }

    #[test]
    fn the_longest_shared_prefix_wins_and_becomes_most_recent() {
        let mut c = cache(4, 2);
        let held: Vec<(SeqId, Vec<u32>)> = vec![
            (1, vec![1, 2, 3, 4, 5]),
            (2, vec![1, 2, 9]),
            (3, vec![7, 7, 7, 7]),
        ];
        for (s, t) in &held {
            c.insert(*s, t.len());
        }
        let look = |s: SeqId| held.iter().find(|(x, _)| *x == s).map(|(_, t)| &t[..]);
        // the prompt's last token is never shared: [1, 2, 3, 4] of [1, 2, 3, 4, 5]
        assert_eq!(c.best(&[1, 2, 3, 4, 5], look), Some((1, 4)));
        assert_eq!(c.best(&[1, 2, 9, 9], look), Some((2, 3)));
        // entry 1 is now older than 2: an equal prefix goes to the more recent
        assert_eq!(c.best(&[1, 2, 0, 0], look), Some((2, 2)));
        assert_eq!(c.best(&[1, 5, 5], look), None, "below min_prefix");
        assert_eq!(
            c.best(&[1], look),
            None,
            "a one-token prompt shares nothing"
        );
        assert_eq!(c.best(&[], look), None);
        // eviction takes the least recently used: 3, then 1
        let too_many = |n: usize, _| n <= 1;
        assert_eq!(c.evict_one(too_many), Some(3));
        assert_eq!(c.evict_one(too_many), Some(1));
        assert_eq!(c.evict_one(too_many), None);
        assert_eq!((c.len(), c.tokens()), (1, 3));
    }

    #[test]
    fn eviction_follows_the_room() {
        let mut c = cache(8, 1);
        c.insert(1, 100);
        c.insert(2, 50);
        c.insert(1, 100); // again: now the most recent
        assert_eq!(c.len(), 2);
        let room = |_, t: u64| t <= 120;
        assert_eq!(c.evict_one(room), Some(2));
        assert_eq!(c.evict_one(room), None);
        assert!(c.remove(1));
        assert!(!c.remove(1));
        assert!(!cache(0, 1).wants(100));
        assert!(!cache(4, 16).wants(15));
        assert!(cache(4, 16).wants(16));
    }
}
