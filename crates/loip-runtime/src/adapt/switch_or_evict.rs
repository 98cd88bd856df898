//! Switch or evict (design §6): a threshold switch adds its extra loads to every step until
//! the new layout's next threshold (or the end of the expected context); evicting other
//! sequences instead costs one recomputation of their KV when they run again. Before a step
//! that needs a switch, the coordinator prices both with the devices' profiles and the
//! shared pure rule ([`SwitchVsEvict`], the simulator's too) and, when eviction is cheaper,
//! takes the eviction path for this step (no switch: the step waits for the steps in flight,
//! then evicts, as `--evict-only` does); the sequences evicted for it come back without a
//! switch too (held as new admissions until there is room).
//!
//! - switch: per device that needs one, `stages × (g(to) − g(from))` seconds a step (`g`:
//!   load + span of one stage's offloaded blocks, the quantity the switch itself minimises),
//!   for [`steps_served`] steps;
//! - eviction: the victims [`Adapter::victim`] would pick until every device holds the rest
//!   in its current layout (with what lending can still free); their tokens recomputed
//!   through every device (`layers × (attention + MLP)` per token, from the profile at a
//!   whole recompute chunk: re-prefilling is batched), plus each recompute chunk's loads of
//!   the offloaded blocks.

use std::collections::BTreeMap;

use loip_engine::TokenPos;
use loip_plan::adapt::{counts_max, steps_served, SwitchVsEvict};

use super::{lock, Adapter};

impl Adapter {
    /// Whether `batch` (KV per sequence `after` once it ran) should evict other sequences
    /// rather than switch some device's layout: a switch is needed, an eviction makes room
    /// without one, and costs less.
    pub(super) fn eviction_cheaper(
        &mut self,
        batch: &[TokenPos],
        after: &BTreeMap<u64, u64>,
    ) -> bool {
        if self.evict_only || !self.cfg.evict_over_switch || self.devs.is_empty() {
            return false;
        }
        let Some(c) = self.switch_vs_evict(batch, after) else {
            return false;
        };
        let cheaper = c.evict_cheaper();
        lock(&self.report)
            .switch_vs_evict
            .push((self.step, c, cheaper));
        if cheaper {
            self.chose_eviction = true;
            tracing::info!(
                "evicting {} tokens (recomputed once, ~{:.3} s) instead of a switch adding \
                 {:.3} s a step for {} steps (~{:.3} s)",
                c.evict_tokens,
                c.evict_cost(),
                c.switch_extra_s,
                c.switch_steps,
                c.switch_cost()
            );
            lock(&self.report).evictions_over_switch += 1;
        }
        cheaper
    }

    /// Both ways priced; `None` when no switch is needed, or eviction cannot avoid one.
    fn switch_vs_evict(
        &self,
        batch: &[TokenPos],
        after: &BTreeMap<u64, u64>,
    ) -> Option<SwitchVsEvict> {
        let tokens: u64 = after.values().sum();
        let seqs = after.len() as u64;
        let fits_now = |i: usize, tokens: u64, seqs: u64| {
            let d = &self.devs[i];
            tokens.saturating_mul(d.kv_per_token)
                <= self.room(i) + self.lend_headroom(i, tokens, seqs)
        };
        // the switches this step needs, and what they add a step
        let end = if self.context > tokens {
            self.context
        } else {
            tokens + seqs * self.cfg.horizon_tokens as u64
        };
        let (mut extra, mut steps) = (0.0, u64::MAX);
        for i in 0..self.devs.len() {
            if fits_now(i, tokens, seqs) {
                continue;
            }
            let to = self.choose_switch(i, tokens, seqs)?;
            let d = &self.devs[i];
            let from = counts_max(&d.plan_stages);
            let (base, _) = self.price(i, to.0, to.1)?;
            let lent = d.lend.map_or(0, |l| l.1) * d.saving_pt(self.per_layer);
            let room = (d.budget.saturating_sub(base) + lent).saturating_sub(self.borrowed(i));
            let threshold = room / d.kv_per_token.max(1);
            extra += d.stages as f64 * (self.g(i, to.0, to.1) - self.g(i, from.0, from.1));
            steps = steps.min(steps_served(tokens, threshold, end, seqs));
        }
        if steps == u64::MAX {
            return None;
        }
        // the eviction that makes room without a switch
        let mut rest = after.clone();
        let mut evicted = 0;
        loop {
            let (t, n) = (rest.values().sum(), rest.len() as u64);
            if (0..self.devs.len()).all(|i| fits_now(i, t, n)) {
                break;
            }
            let (seq, k) = self.victim(batch, &rest)?;
            rest.remove(&seq);
            evicted += k;
        }
        let chunk = self.recompute_chunk() as u64;
        let per_token = self
            .devs
            .iter()
            .map(|d| d.layers as f64 * d.recompute_s)
            .sum();
        let loads: f64 = self
            .devs
            .iter()
            .map(|d| {
                let (a, m) = counts_max(&d.plan_stages);
                let bytes = a as u64 * self.shape.attn_bytes + m as u64 * self.shape.mlp_bytes;
                d.stages as f64 * d.loader.load_time(bytes, a + m)
            })
            .sum();
        Some(SwitchVsEvict {
            switch_extra_s: extra,
            switch_steps: steps,
            evict_tokens: evicted,
            recompute_s_per_token: per_token,
            recompute_fixed_s: evicted.div_ceil(chunk) as f64 * loads,
            recomputations: 1,
            evict_growth_tokens: 0,
        })
    }
}
