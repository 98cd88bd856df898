//! KV cache: per sequence, per held layer, f32 keys and values of every cached position.
//!
//! A cache holds only the layers of the stages that use it (any set of global layer indices).
//! Growth is accounted in bytes against an optional budget; a step that would exceed it is
//! refused before anything is written, so a refused step leaves the cache unchanged.

use std::collections::HashMap;

use crate::EngineError;

/// A sequence (request) id.
pub type SeqId = u64;

/// Keys and values of one layer of one sequence.
#[derive(Debug, Default, Clone)]
pub struct LayerKv {
    /// (len, n_kv_heads * head_dim)
    pub k: Vec<f32>,
    /// (len, n_kv_heads * head_dim)
    pub v: Vec<f32>,
}

/// The KV cache of one device (all its stages).
#[derive(Debug, Clone)]
pub struct KvCache {
    kv_dim: usize,                      // n_kv_heads * head_dim
    layers: Vec<usize>,                 // global indices of held layers, sorted
    seqs: HashMap<SeqId, Vec<LayerKv>>, // per sequence, per held layer (same order)
    budget: Option<u64>,                // bytes
    used: u64,                          // bytes of K and V held
}

impl KvCache {
    /// A cache for the given global layers with `kv_dim = n_kv_heads * head_dim` floats per
    /// token per layer for each of K and V, and an optional byte budget.
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
            layers,
            seqs: HashMap::new(),
            budget,
            used: 0,
        }
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

    /// Tokens cached for `seq` at held layer `layer` (0 when unknown).
    pub fn len(&self, seq: SeqId, layer: usize) -> usize {
        match (self.slot(layer), self.seqs.get(&seq)) {
            (Ok(i), Some(l)) => l[i].k.len() / self.kv_dim.max(1),
            _ => 0,
        }
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

    /// Checks that `tokens` more tokens fit the budget on every held layer.
    pub fn reserve(&self, tokens: usize) -> Result<(), EngineError> {
        if let Some(budget) = self.budget {
            let needed = tokens as u64 * self.layers.len() as u64 * self.bytes_per_token_layer();
            let available = budget.saturating_sub(self.used);
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
        let n_layers = self.layers.len();
        let kv_dim = self.kv_dim;
        let entry = self
            .seqs
            .entry(seq)
            .or_insert_with(|| vec![LayerKv::default(); n_layers]);
        let l = &mut entry[slot];
        let held = l.k.len() / kv_dim.max(1);
        if pos != held {
            return Err(EngineError::BadPosition {
                seq,
                pos,
                layer,
                held,
            });
        }
        l.k.extend_from_slice(k);
        l.v.extend_from_slice(v);
        self.used += 2 * kv_dim as u64 * 4;
        Ok(())
    }

    /// K and V of `seq` at `layer`, the first `n` positions.
    pub fn get(&self, seq: SeqId, layer: usize, n: usize) -> Result<(&[f32], &[f32]), EngineError> {
        let slot = self.slot(layer)?;
        let l = self.seqs.get(&seq).map(|l| &l[slot]);
        let held = l.map_or(0, |l| l.k.len() / self.kv_dim.max(1));
        match l {
            Some(l) if n <= held => Ok((&l.k[..n * self.kv_dim], &l.v[..n * self.kv_dim])),
            _ => Err(EngineError::BadPosition {
                seq,
                pos: n.saturating_sub(1),
                layer,
                held,
            }),
        }
    }

    /// Drops a sequence's cache.
    pub fn remove(&mut self, seq: SeqId) {
        if let Some(l) = self.seqs.remove(&seq) {
            let floats: usize = l.iter().map(|l| l.k.len() + l.v.len()).sum();
            self.used -= floats as u64 * 4;
        }
    }

    /// Truncates a sequence to its first `n` positions on every held layer (used to roll back
    /// a step that failed part-way).
    pub fn truncate(&mut self, seq: SeqId, n: usize) {
        let kv_dim = self.kv_dim;
        if let Some(layers) = self.seqs.get_mut(&seq) {
            let mut freed = 0usize;
            for l in layers.iter_mut() {
                let keep = (n * kv_dim).min(l.k.len());
                freed += (l.k.len() - keep) * 2;
                l.k.truncate(keep);
                l.v.truncate(keep);
            }
            self.used -= freed as u64 * 4;
        }
    }
}
