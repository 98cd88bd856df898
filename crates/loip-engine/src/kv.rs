//! KV cache: per sequence, per held layer, f32 keys and values of the cached positions.
//!
//! A cache holds only the layers of the stages that use it (any set of global layer indices).
//! A full-attention layer keeps every position. A sliding-window layer of window `W`
//! ([`KvCache::with_windows`]) keeps only its last `W` positions (a ring): once a step has
//! attended, [`KvCache::settle`] drops the positions that left the window, so its KV stops
//! growing at `W` rows. Within a step the ring may hold more (a prompt chunk longer than the
//! window appends all its rows before its queries attend, each to its own last `W`).
//! Every layer's rows are one contiguous run in position order, so attention reads the same
//! rows in the same order as from a cache that keeps everything (bit-identical).
//!
//! Growth is accounted in bytes against an optional budget; a step that would exceed it is
//! refused before anything is written, so a refused step leaves the cache unchanged.
//!
//! KV lending (design §6): the oldest rows a layer holds may be taken out
//! ([`KvCache::lend_rows`]) to be held elsewhere and put back ([`KvCache::return_rows`])
//! before the layer is read again; while they are out the layer cannot be read (a typed
//! error, never a partial read), their bytes are freed here, and bytes held for a peer
//! ([`KvCache::set_held_for_peers`]) count against the budget.

use std::collections::HashMap;

use loip_kernels::PageVec;

use crate::EngineError;

/// A sequence (request) id.
pub type SeqId = u64;

/// Rows of one layer in position order: the live rows are `buf[start..]`.
///
/// Dropping the oldest rows (a sliding window, lending) only moves `start`; appending writes
/// after the end. The dead front is reclaimed by one move to the start of the buffer when an
/// append would otherwise grow a buffer that is at least half dead, so an append costs O(1)
/// floats moved amortized (never a window of rows per token) and the buffer stays within a
/// small factor of the rows held. Each buffer is its own mapping ([`PageVec`]): growing it
/// copies nothing and leaves no freed chunk resident, and only the pages written are charged,
/// so the memory the cache takes is the bytes it accounts plus less than a page a buffer.
#[derive(Debug, Default, Clone)]
struct Rows {
    buf: PageVec, // (start + held rows, kv_dim): a dead front, then the live rows
    start: usize, // floats of the dead front
}

impl Rows {
    /// Live floats.
    fn len(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The live rows, contiguous.
    fn as_slice(&self) -> &[f32] {
        &self.buf[self.start..]
    }

    fn push_back(&mut self, x: &[f32]) {
        if self.buf.len() + x.len() > self.buf.capacity() && 2 * self.start >= self.buf.len() {
            self.buf.copy_within(self.start.., 0);
            self.buf.truncate(self.buf.len() - self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(x);
    }

    /// Puts `x` before the live rows (rows coming back from a lend).
    fn push_front(&mut self, x: &[f32]) {
        if x.len() <= self.start {
            self.start -= x.len();
            self.buf[self.start..self.start + x.len()].copy_from_slice(x);
        } else {
            let mut buf = PageVec::from_slice(x);
            buf.extend_from_slice(self.as_slice());
            *self = Rows { buf, start: 0 };
        }
    }

    /// Drops the oldest `n` live floats and returns them.
    fn take_front(&mut self, n: usize) -> Vec<f32> {
        let n = n.min(self.len());
        let out = self.buf[self.start..self.start + n].to_vec();
        self.drop_front(n);
        out
    }

    /// Drops the oldest `n` live floats.
    fn drop_front(&mut self, n: usize) {
        self.start += n.min(self.len());
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
    }

    /// Keeps the oldest `n` live floats.
    fn truncate(&mut self, n: usize) {
        self.buf.truncate(self.start + n);
        self.drop_front(0);
    }
}

/// Keys and values of one layer of one sequence: positions `lo..lo + lent` are lent out,
/// the rows held are the positions after them, contiguous.
#[derive(Debug, Default, Clone)]
struct LayerKv {
    k: Rows,   // (held, kv_dim)
    v: Rows,   // (held, kv_dim)
    lo: usize, // oldest position of the layer (lent or held)
}

impl LayerKv {
    fn push_back(&mut self, k: &[f32], v: &[f32]) {
        self.k.push_back(k);
        self.v.push_back(v);
    }

    fn push_front(&mut self, k: &[f32], v: &[f32]) {
        self.k.push_front(k);
        self.v.push_front(v);
    }
}

/// The KV cache of one device (all its stages).
#[derive(Debug, Clone)]
pub struct KvCache {
    kv_dim: usize,                        // n_kv_heads * head_dim
    layers: Vec<usize>,                   // global indices of held layers, sorted
    windows: Vec<Option<usize>>,          // per held layer: its sliding window, tokens
    seqs: HashMap<SeqId, Vec<LayerKv>>,   // per sequence, per held layer (same order)
    budget: Option<u64>,                  // bytes
    used: u64,                            // bytes of K and V held
    lent: HashMap<(SeqId, usize), usize>, // (seq, held-layer slot) → oldest rows lent out
    for_peers: u64,                       // bytes held for peers (borrowed KV)
}

impl KvCache {
    /// A cache for the given global layers with `kv_dim = n_kv_heads * head_dim` floats per
    /// token per layer for each of K and V, and an optional byte budget. Every layer keeps
    /// every position until [`KvCache::with_windows`] says which slide.
    pub fn new(
        layers: impl IntoIterator<Item = usize>,
        kv_dim: usize,
        budget: Option<u64>,
    ) -> KvCache {
        let mut layers: Vec<usize> = layers.into_iter().collect();
        layers.sort_unstable();
        layers.dedup();
        KvCache {
            kv_dim,
            windows: vec![None; layers.len()],
            layers,
            seqs: HashMap::new(),
            budget,
            used: 0,
            lent: HashMap::new(),
            for_peers: 0,
        }
    }

    /// The same (empty) cache with a sliding window on the layers `window_of` gives one
    /// (`ModelConfig::layer_window`): those keep only their last `window` positions.
    pub fn with_windows(mut self, window_of: impl Fn(usize) -> Option<usize>) -> KvCache {
        self.windows = self
            .layers
            .iter()
            .map(|&l| window_of(l).map(|w| w.max(1)))
            .collect();
        self
    }

    /// Keeps `slack` positions more than the window on every sliding-window layer from now
    /// on (speculative decoding: a rewind of up to `slack` rejected positions then leaves at
    /// least the window). Reads are unchanged: attention reads the last `window` positions
    /// of the model's config, which the wider ring still holds in the same order.
    pub fn widen_windows(&mut self, slack: usize) {
        for w in self.windows.iter_mut().flatten() {
            *w = w.saturating_add(slack);
        }
    }

    /// The window of held layer `layer` (`None`: it keeps every position, or is not held).
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.slot(layer).ok().and_then(|i| self.windows[i])
    }

    /// Bytes per cached token per layer (K and V).
    pub fn bytes_per_token_layer(&self) -> u64 {
        2 * self.kv_dim as u64 * 4
    }

    /// Bytes in use.
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// Sets or clears the byte budget.
    pub fn set_budget(&mut self, budget: Option<u64>) {
        self.budget = budget;
    }

    fn held_rows(&self, l: &LayerKv) -> usize {
        l.k.len() / self.kv_dim.max(1)
    }

    fn layer(&self, seq: SeqId, slot: usize) -> Option<&LayerKv> {
        self.seqs.get(&seq).map(|l| &l[slot])
    }

    /// Rows cached for `seq` at held layer `layer` (0 when unknown), lent rows included: every
    /// position on a full-attention layer, at most its window on a sliding one (after a step).
    pub fn len(&self, seq: SeqId, layer: usize) -> usize {
        match self.slot(layer) {
            Ok(i) => self
                .layer(seq, i)
                .map_or(0, |l| self.held_rows(l) + self.lent_at(seq, i)),
            _ => 0,
        }
    }

    /// The next position `seq` appends at held layer `layer` (positions cached so far,
    /// dropped and lent ones included).
    pub fn next_pos(&self, seq: SeqId, layer: usize) -> usize {
        match self.slot(layer) {
            Ok(i) => self
                .layer(seq, i)
                .map_or(0, |l| l.lo + self.lent_at(seq, i) + self.held_rows(l)),
            _ => 0,
        }
    }

    fn lent_at(&self, seq: SeqId, slot: usize) -> usize {
        self.lent.get(&(seq, slot)).copied().unwrap_or(0)
    }

    /// Sequences cached, in id order.
    pub fn seq_ids(&self) -> Vec<SeqId> {
        let mut v: Vec<SeqId> = self.seqs.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Rows of `seq` at held layer `layer` lent out (0 when none).
    pub fn lent(&self, seq: SeqId, layer: usize) -> usize {
        self.slot(layer).map_or(0, |i| self.lent_at(seq, i))
    }

    /// Takes the oldest `n` rows `seq` holds at held layer `layer` out (to lend them): K then
    /// V, each `(n, kv_dim)`. Refused when rows are already out or fewer are held.
    pub fn lend_rows(
        &mut self,
        seq: SeqId,
        layer: usize,
        n: usize,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let slot = self.slot(layer)?;
        let kv_dim = self.kv_dim;
        let out = self.lent_at(seq, slot);
        let held = self.layer(seq, slot).map_or(0, |l| self.held_rows(l));
        match self.seqs.get_mut(&seq).map(|l| &mut l[slot]) {
            Some(l) if out == 0 && n <= held => {
                let k = l.k.take_front(n * kv_dim);
                let v = l.v.take_front(n * kv_dim);
                self.used -= (k.len() + v.len()) as u64 * 4;
                if n > 0 {
                    self.lent.insert((seq, slot), n);
                }
                Ok((k, v))
            }
            _ => Err(EngineError::BadPosition {
                seq,
                pos: n.saturating_sub(1),
                layer,
                held,
            }),
        }
    }

    /// Puts back the rows [`KvCache::lend_rows`] took out: exactly as many as are out.
    /// Checked against the budget like any growth.
    pub fn return_rows(
        &mut self,
        seq: SeqId,
        layer: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), EngineError> {
        let slot = self.slot(layer)?;
        let kv_dim = self.kv_dim.max(1);
        let out = self.lent_at(seq, slot);
        if self.layer(seq, slot).is_none() {
            return Err(EngineError::BadPosition {
                seq,
                pos: 0,
                layer,
                held: 0,
            });
        }
        if k.len() != out * kv_dim || v.len() != k.len() {
            return Err(EngineError::BadPosition {
                seq,
                pos: (k.len().max(v.len()) / kv_dim).saturating_sub(1),
                layer,
                held: out,
            });
        }
        let bytes = (k.len() + v.len()) as u64 * 4;
        self.room_for(bytes)?;
        if let Some(l) = self.seqs.get_mut(&seq).map(|l| &mut l[slot]) {
            l.push_front(k, v);
        }
        self.used += bytes;
        self.lent.remove(&(seq, slot));
        Ok(())
    }

    /// Bytes held for peers (KV they lent here), counted against the budget; refused (and
    /// unchanged) when they do not fit next to what is cached.
    pub fn set_held_for_peers(&mut self, bytes: u64) -> Result<(), EngineError> {
        if let Some(budget) = self.budget {
            let available = budget.saturating_sub(self.used);
            if bytes > self.for_peers && bytes > available {
                return Err(EngineError::KvBudget {
                    needed: bytes,
                    available,
                });
            }
        }
        self.for_peers = bytes;
        Ok(())
    }

    /// Bytes held for peers.
    pub fn held_for_peers(&self) -> u64 {
        self.for_peers
    }

    /// Whether no sequence is cached.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    fn slot(&self, layer: usize) -> Result<usize, EngineError> {
        self.layers
            .binary_search(&layer)
            .map_err(|_| EngineError::LayerNotHeld(layer))
    }

    /// Checks that `tokens` more tokens fit the budget on every held layer (a sliding layer
    /// holds a step's rows too until [`KvCache::settle`], so it is counted like the others).
    pub fn reserve(&self, tokens: usize) -> Result<(), EngineError> {
        self.room_for(tokens as u64 * self.layers.len() as u64 * self.bytes_per_token_layer())
    }

    /// Checks that `needed` more bytes fit the budget beside what is held and what peers'
    /// lent rows take.
    fn room_for(&self, needed: u64) -> Result<(), EngineError> {
        if let Some(budget) = self.budget {
            let available = budget.saturating_sub(self.used + self.for_peers);
            if needed > available {
                return Err(EngineError::KvBudget { needed, available });
            }
        }
        Ok(())
    }

    /// Appends one token's K and V (each `kv_dim`) at `pos` for `seq` at `layer`.
    pub fn append(
        &mut self,
        seq: SeqId,
        layer: usize,
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), EngineError> {
        let slot = self.slot(layer)?;
        let kv_dim = self.kv_dim;
        if k.len() != kv_dim || v.len() != kv_dim {
            return Err(EngineError::Invalid(format!(
                "KV rows of {} and {} floats for a width of {kv_dim}",
                k.len(),
                v.len()
            )));
        }
        let next = self.next_pos(seq, layer);
        if pos != next {
            return Err(EngineError::BadPosition {
                seq,
                pos,
                layer,
                held: next,
            });
        }
        let n_layers = self.layers.len();
        let entry = self
            .seqs
            .entry(seq)
            .or_insert_with(|| vec![LayerKv::default(); n_layers]);
        entry[slot].push_back(k, v);
        self.used += 2 * kv_dim as u64 * 4;
        Ok(())
    }

    /// After a step attended at `layer`: a sliding layer of `seq` drops the positions before
    /// its last `window` (none while rows are lent out). Nothing happens on other layers.
    pub fn settle(&mut self, seq: SeqId, layer: usize) {
        let Ok(slot) = self.slot(layer) else { return };
        let (Some(w), 0) = (self.windows[slot], self.lent_at(seq, slot)) else {
            return;
        };
        let kv_dim = self.kv_dim;
        if let Some(l) = self.seqs.get_mut(&seq).map(|l| &mut l[slot]) {
            let held = l.k.len() / kv_dim.max(1);
            if held > w {
                let drop = held - w;
                l.k.drop_front(drop * kv_dim);
                l.v.drop_front(drop * kv_dim);
                l.lo += drop;
                self.used -= (2 * drop * kv_dim) as u64 * 4;
            }
        }
    }

    /// K and V of `seq` at `layer`, the first `n` positions (a layer that still holds them).
    pub fn get(&self, seq: SeqId, layer: usize, n: usize) -> Result<(&[f32], &[f32]), EngineError> {
        self.rows(seq, layer, 0, n)
    }

    /// K and V of `seq` at `layer`, positions `from..to`, each `(to - from, kv_dim)`. Refused
    /// while rows are lent out, and for positions not held (past the end, or dropped from a
    /// sliding window).
    pub fn rows(
        &self,
        seq: SeqId,
        layer: usize,
        from: usize,
        to: usize,
    ) -> Result<(&[f32], &[f32]), EngineError> {
        let slot = self.slot(layer)?;
        let l = self.layer(seq, slot);
        let held = l.map_or(0, |l| self.held_rows(l));
        match l {
            // rows lent out: nothing is read until they are back
            Some(l)
                if from >= l.lo
                    && from <= to
                    && to <= l.lo + held
                    && self.lent_at(seq, slot) == 0 =>
            {
                let d = self.kv_dim;
                let (a, b) = ((from - l.lo) * d, (to - l.lo) * d);
                return Ok((&l.k.as_slice()[a..b], &l.v.as_slice()[a..b]));
            }
            _ => {}
        }
        Err(EngineError::BadPosition {
            seq,
            pos: to.saturating_sub(1),
            layer,
            held,
        })
    }

    /// Gives `to` (not cached yet) a copy of `from`'s first `n` positions on every held layer,
    /// as if `to` had been fed the same `n` tokens (a prompt shared by several sequences is
    /// computed once; a token's K and V depend only on the tokens before it). A sliding layer
    /// copies its last window before `n`. Refused (nothing changes) when `to` is cached, rows
    /// of `from` are lent out, `from` does not hold all of those positions (fewer cached, or
    /// dropped from a window), or the copy does not fit the budget.
    pub fn fork(&mut self, from: SeqId, to: SeqId, n: usize) -> Result<(), EngineError> {
        let refuse = |why: &str| Err(EngineError::Invalid(format!("KV fork {from}→{to}: {why}")));
        if self.seqs.contains_key(&to) {
            return refuse("the target is cached already");
        }
        let Some(src) = self.seqs.get(&from) else {
            return refuse("the source is not cached");
        };
        let d = self.kv_dim;
        let mut layers = Vec::with_capacity(src.len());
        for (slot, l) in src.iter().enumerate() {
            let held = self.held_rows(l);
            // the oldest position a read at `n` needs (its window), and where the copy
            // starts: the whole window before `n` where it is still held
            let need = self.windows[slot].map_or(0, |w| n.saturating_sub(w - 1));
            let lo = self.windows[slot].map_or(0, |w| n.saturating_sub(w).max(l.lo));
            if self.lent_at(from, slot) > 0 || l.lo > need || l.lo + held < n {
                return refuse("the source does not hold those positions");
            }
            let (a, b) = ((lo - l.lo) * d, (n - l.lo) * d);
            let rows = |r: &Rows| Rows {
                buf: PageVec::from_slice(&r.as_slice()[a..b]),
                start: 0,
            };
            layers.push(LayerKv {
                k: rows(&l.k),
                v: rows(&l.v),
                lo,
            });
        }
        let floats: usize = layers.iter().map(|l| l.k.len() + l.v.len()).sum();
        let bytes = floats as u64 * 4;
        self.room_for(bytes)?;
        self.seqs.insert(to, layers);
        self.used += bytes;
        Ok(())
    }

    /// Drops a sequence's cache.
    pub fn remove(&mut self, seq: SeqId) {
        if let Some(l) = self.seqs.remove(&seq) {
            let floats: usize = l.iter().map(|l| l.k.len() + l.v.len()).sum();
            self.used -= floats as u64 * 4;
        }
        self.lent.retain(|(s, _), _| *s != seq);
    }

    /// Truncates a sequence to its first `n` positions on every held layer (used to roll back
    /// a step that failed part-way). A sliding layer cannot bring back positions it dropped:
    /// a step longer than one token rolled back there leaves the window short, and reading it
    /// is then a typed error rather than a different answer.
    pub fn truncate(&mut self, seq: SeqId, n: usize) {
        for slot in 0..self.layers.len() {
            self.truncate_slot(seq, slot, n);
        }
    }

    /// [`KvCache::truncate`] on global layer `layer` alone (a device truncates each stage's
    /// layers when that stage runs: speculative decoding's rejected positions). Nothing
    /// happens for a layer not held here.
    pub fn truncate_layer(&mut self, seq: SeqId, layer: usize, n: usize) {
        if let Ok(slot) = self.slot(layer) {
            self.truncate_slot(seq, slot, n);
        }
    }

    fn truncate_slot(&mut self, seq: SeqId, slot: usize, n: usize) {
        let kv_dim = self.kv_dim;
        let out = self.lent_at(seq, slot);
        let Some(l) = self.seqs.get_mut(&seq).and_then(|l| l.get_mut(slot)) else {
            return;
        };
        let keep = (n.saturating_sub(l.lo + out) * kv_dim).min(l.k.len());
        let freed = (l.k.len() - keep) * 2;
        l.k.truncate(keep);
        l.v.truncate(keep);
        if out == 0 && n < l.lo {
            l.lo = n;
        }
        self.used -= freed as u64 * 4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_moves_rows_rarely_and_stays_small() {
        // window 8, kv_dim 3: 2,000 single-token steps, each settled; then a lend and return
        let (w, d) = (8usize, 3usize);
        let mut c = KvCache::new([0], d, None).with_windows(|_| Some(w));
        let row =
            |p: usize, s: f32| -> Vec<f32> { (0..d).map(|j| s * (p * d + j) as f32).collect() };
        let mut moved_cap = 0;
        for pos in 0..2000 {
            c.append(1, 0, pos, &row(pos, 1.0), &row(pos, -1.0))
                .unwrap();
            c.settle(1, 0);
            let l = &c.seqs[&1][0];
            moved_cap = moved_cap.max(l.k.buf.capacity());
            let lo = pos.saturating_sub(w - 1);
            let (k, v) = c.rows(1, 0, lo, pos + 1).unwrap();
            let want: Vec<f32> = (lo..=pos).flat_map(|p| row(p, 1.0)).collect();
            assert_eq!(k, &want[..]);
            assert_eq!(v.iter().map(|x| -x).collect::<Vec<_>>(), want);
        }
        assert!(
            moved_cap <= (4 * w * d).max(loip_kernels::page_bytes() / 4),
            "buffer of {moved_cap} floats for {w} rows"
        );
        assert_eq!(c.used_bytes(), (2 * w * d * 4) as u64);
        // lend the oldest 3 rows and put them back (into the dead front or a new buffer)
        let before = c
            .rows(1, 0, 1992, 2000)
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .unwrap();
        let (k, v) = c.lend_rows(1, 0, 3).unwrap();
        c.return_rows(1, 0, &k, &v).unwrap();
        let after = c
            .rows(1, 0, 1992, 2000)
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .unwrap();
        assert_eq!(before, after);
        // truncating back past the window leaves what is held, and appends continue
        c.truncate(1, 1998);
        assert_eq!(c.next_pos(1, 0), 1998);
        c.append(1, 0, 1998, &row(1998, 1.0), &row(1998, -1.0))
            .unwrap();
        let (k, _) = c.rows(1, 0, 1992, 1999).unwrap();
        let want: Vec<f32> = (1992..=1998).flat_map(|p| row(p, 1.0)).collect();
        assert_eq!(k, &want[..]);
    }

    #[test]
    fn a_fork_copies_the_first_positions_and_counts_them() {
        // layer 0 full, layer 1 a window of 3; kv_dim 2; 6 positions of sequence 1
        let mut c = KvCache::new([0, 1], 2, Some(1 << 20)).with_windows(|l| (l == 1).then_some(3));
        for pos in 0..6 {
            for layer in [0, 1] {
                let k = [pos as f32, layer as f32];
                c.append(1, layer, pos, &k, &[-(pos as f32), 0.5]).unwrap();
                c.settle(1, layer);
            }
        }
        let used = c.used_bytes();
        c.fork(1, 2, 5).unwrap();
        assert_eq!(c.next_pos(2, 0), 5);
        assert_eq!(c.next_pos(2, 1), 5);
        assert_eq!(c.get(2, 0, 5).unwrap(), c.get(1, 0, 5).unwrap());
        assert_eq!(c.rows(2, 1, 3, 5).unwrap(), c.rows(1, 1, 3, 5).unwrap());
        assert!(
            c.rows(2, 1, 1, 5).is_err(),
            "only the window before the fork"
        );
        assert_eq!(c.used_bytes(), used + (5 + 2) * 2 * 2 * 4);
        // a known target, an unknown source, dropped or missing positions, the budget
        assert!(c.fork(1, 2, 3).is_err());
        assert!(c.fork(9, 3, 3).is_err());
        assert!(c.fork(1, 3, 7).is_err(), "past the end");
        assert!(c.fork(1, 3, 2).is_err(), "dropped from the window");
        c.set_budget(Some(c.used_bytes() + 8));
        assert!(matches!(c.fork(1, 3, 5), Err(EngineError::KvBudget { .. })));
        assert_eq!(c.seq_ids(), vec![1, 2]);
        c.remove(2);
        assert_eq!(c.used_bytes(), used);
    }

    #[test]
    fn lent_rows_come_back_bit_identical_and_are_checked() {
        let mut c = KvCache::new([3, 5], 2, Some(1 << 20));
        for pos in 0..4 {
            let k = [pos as f32, 0.5];
            let v = [-(pos as f32), 1.5];
            c.append(7, 3, pos, &k, &v).unwrap();
        }
        let before = c
            .get(7, 3, 4)
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .unwrap();
        let used = c.used_bytes();
        let (k, v) = c.lend_rows(7, 3, 3).unwrap();
        assert_eq!(c.used_bytes(), used - 3 * 2 * 2 * 4, "lent rows are freed");
        assert_eq!(c.len(7, 3), 4);
        assert!(c.get(7, 3, 4).is_err(), "no read while rows are out");
        assert!(c.lend_rows(7, 3, 1).is_err(), "rows out once");
        // short, long or mismatched: refused, nothing changes
        assert!(c.return_rows(7, 3, &k[..4], &v[..4]).is_err());
        assert!(c.return_rows(7, 3, &k, &v[..4]).is_err());
        c.return_rows(7, 3, &k, &v).unwrap();
        assert_eq!(c.used_bytes(), used);
        let after = c
            .get(7, 3, 4)
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .unwrap();
        assert_eq!(before, after);
        // held for peers counts against the budget
        let mut small = KvCache::new([0], 2, Some(64));
        small.set_held_for_peers(48).unwrap();
        assert!(small.reserve(1).is_ok());
        assert!(small.reserve(2).is_err());
        assert!(small.set_held_for_peers(80).is_err());
    }
}
