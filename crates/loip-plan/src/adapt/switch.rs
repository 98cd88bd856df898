//! The decisions both the simulator and the runtime take, as pure functions.
//!
//! - thresholds: `TS_i^j = ⌊(budget − base_j) / kv⌋`, the KV tokens device `i` holds with
//!   layout `j` (`base_j`: weights, slot and buffers of the layout; `kv`: bytes per token
//!   over the device's layers);
//! - a threshold switch: `α`/`β` attention/MLP blocks offloaded per stage (the same counts
//!   in every stage, capped by each stage's size), chosen among all counts whose memory
//!   holds the tokens to come for the smallest `g = ld + span` (what the stall grows with),
//!   then the fewest changed blocks; it may bring back blocks the previous layout offloaded;
//! - lending (Eq. 8): `n_trans ≤ f · (bw·idle − 2·traffic − others) / (2·n·κ)`; a lend
//!   shrinks at once when the link no longer carries it, and grows only when a device is
//!   over its threshold, by at least `n_ts` tokens.

use crate::plan::StagePlan;

/// Largest (attention, MLP) offloaded counts over `stages`.
pub fn counts_max(stages: &[StagePlan]) -> (u32, u32) {
    stages
        .iter()
        .map(|s| s.counts())
        .fold((0, 0), |acc, (_, a, m)| (acc.0.max(a), acc.1.max(m)))
}

/// `stages` with `a`/`m` offloaded blocks per stage (capped per stage), in the cost model's
/// canonical order ([`StagePlan::with_offload`]).
pub fn stage_layout(stages: &[StagePlan], a: u32, m: u32) -> Vec<StagePlan> {
    stages
        .iter()
        .map(|s| {
            let n = s.layers.len() as u32;
            let first = s.layers.first().map(|l| l.layer).unwrap_or(0);
            StagePlan::with_offload(first, n, a.min(n), m.min(n))
        })
        .collect()
}

/// `TS`: KV tokens a device holds when its layout takes `base` of its `budget` and one token
/// costs `kv_per_token` over its layers; `None` when it holds no KV.  // tokens
pub fn threshold(budget: u64, base: u64, kv_per_token: u64) -> Option<u64> {
    (kv_per_token > 0).then(|| budget.saturating_sub(base) / kv_per_token)
}

/// The threshold switch of a device whose largest stage has `n` layers and whose layout
/// offloads `current` (attention, MLP) blocks per stage: among the counts `(a, m)` for which
/// `fits(a, m)`, the smallest `g(a, m)`, then the fewest changed blocks (ties: fewer
/// attention, then fewer MLP blocks offloaded). `None` when no count fits.
pub fn choose_switch(
    n: u32,
    current: (u32, u32),
    mut fits: impl FnMut(u32, u32) -> bool,
    mut g: impl FnMut(u32, u32) -> f64,
) -> Option<(u32, u32)> {
    let (ca, cm) = current;
    let mut best: Option<(f64, u32, u32, u32)> = None;
    for a in 0..=n {
        for m in 0..=n {
            if !fits(a, m) {
                continue;
            }
            let g = g(a, m);
            let moved = a.abs_diff(ca) + m.abs_diff(cm);
            if best.is_none_or(|b| (g, moved) < (b.0, b.1)) {
                best = Some((g, moved, a, m));
            }
        }
    }
    best.map(|b| (b.2, b.3))
}

/// A threshold switch priced against evicting and recomputing instead (design §6): the
/// switch adds its extra load to every step it serves; eviction recomputes the evicted
/// tokens (once in the runtime, which re-prefills an evicted sequence when it runs again; in
/// every remaining pass in the simulator's model of the baselines).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SwitchVsEvict {
    /// time the switch adds to each step, over the devices that switch  // seconds
    pub switch_extra_s: f64,
    /// steps it adds it to: until the new layout's next threshold or the end of the
    /// expected context, whichever is first  // steps
    pub switch_steps: u64,
    /// KV tokens eviction drops and recomputes  // tokens
    pub evict_tokens: u64,
    /// time to recompute one token through every device  // seconds
    pub recompute_s_per_token: f64,
    /// time a recomputation costs besides its tokens (the loads of its chunk steps)  // seconds
    pub recompute_fixed_s: f64,
    /// recomputations: 1 in the runtime, the remaining passes in the simulator
    pub recomputations: u64,
    /// tokens each recomputation adds to the one before (the simulator's evicted KV grows
    /// with the sequences, `b` tokens a pass; 0 in the runtime)  // tokens
    pub evict_growth_tokens: u64,
}

impl SwitchVsEvict {
    /// What the switch costs over the steps it serves.  // seconds
    pub fn switch_cost(&self) -> f64 {
        self.switch_extra_s.max(0.0) * self.switch_steps as f64
    }

    /// What evicting and recomputing costs.  // seconds
    pub fn evict_cost(&self) -> f64 {
        let n = self.recomputations as f64;
        let once = self.evict_tokens as f64 * self.recompute_s_per_token + self.recompute_fixed_s;
        let growth = self.evict_growth_tokens as f64 * self.recompute_s_per_token;
        once * n + growth * n * (n - 1.0).max(0.0) / 2.0
    }

    /// Whether eviction is the cheaper way (a tie switches: every sequence keeps running).
    pub fn evict_cheaper(&self) -> bool {
        self.evict_tokens > 0 && self.evict_cost() < self.switch_cost()
    }
}

/// Steps a layout switched to now serves: this one (its step runs with it, holding `tokens`)
/// and those until it holds `threshold` KV tokens or the expected `end` (total tokens),
/// whichever is first, `seqs` sequences each adding one token a step.  // steps
pub fn steps_served(tokens: u64, threshold: u64, end: u64, seqs: u64) -> u64 {
    threshold.min(end).saturating_sub(tokens) / seqs.max(1) + 1
}

/// Eq. 8: most tokens per stage whose send and fetch-back fit the idle link time `idle_s`
/// at `bandwidth`, after `traffic` activation bytes each way and `others` bytes of other
/// lenders' fetches on the same port; `fraction` is the safety margin and `per_token` the
/// bytes of one token of one stage.  // tokens
pub fn lend_cap_tokens(
    bandwidth: f64,
    idle_s: f64,
    traffic: f64,
    others: f64,
    per_token: f64,
    fraction: f64,
) -> u64 {
    if per_token <= 0.0 {
        return 0;
    }
    let free = (bandwidth * idle_s.max(0.0) - 2.0 * traffic - others).max(0.0);
    (fraction * free / (2.0 * per_token)).floor() as u64
}

/// A lend of `current` tokens when the link carries only `cap`: shrinks at once, to `cap`,
/// when that is `n_ts` tokens or more less, or nothing. `None`: leave it.  // tokens
pub fn lend_shrink(current: u64, cap: u64, n_ts: u64) -> Option<u64> {
    (cap + n_ts <= current || (cap < current && cap == 0)).then_some(cap)
}

/// A lend of `current` tokens of a device `over` bytes over its budget (`saving` bytes freed
/// per lent token): grows by what that needs, at least `n_ts`, when the link's `cap` carries
/// it. `None`: lending cannot help.  // tokens
pub fn lend_grow(current: u64, cap: u64, over: u64, saving: u64, n_ts: u64) -> Option<u64> {
    if over == 0 || saving == 0 {
        return None;
    }
    let need = current + over.div_ceil(saving);
    (cap >= need).then(|| need.max(current + n_ts).min(cap))
}

/// Both rules in turn: shrink at once, else grow near (past) the threshold.  // tokens
pub fn lend_update(current: u64, cap: u64, over: u64, saving: u64, n_ts: u64) -> Option<u64> {
    lend_shrink(current, cap, n_ts).or_else(|| lend_grow(current, cap, over, saving, n_ts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_counts_whole_tokens() {
        assert_eq!(threshold(1000, 100, 300), Some(3));
        assert_eq!(threshold(100, 200, 300), Some(0));
        assert_eq!(threshold(100, 0, 0), None);
    }

    #[test]
    fn switch_takes_the_cheapest_fitting_count() {
        // offloading attention is cheaper than MLP; two blocks needed
        let fits = |a: u32, m: u32| a + m >= 2;
        let g = |a: u32, m: u32| a as f64 + 3.0 * m as f64;
        assert_eq!(choose_switch(4, (0, 0), fits, g), Some((2, 0)));
        // a switch may bring blocks back: from (0, 2) to (2, 0)
        assert_eq!(choose_switch(4, (0, 2), fits, g), Some((2, 0)));
        assert_eq!(choose_switch(4, (0, 0), |_, _| false, g), None);
    }

    #[test]
    fn eviction_wins_only_when_its_recomputation_costs_less_than_the_switch() {
        // llama-1b, two devices (docs/cluster.md, "Long-context benchmark, llama-1b"):
        // offloading all attention adds ~0.9 s a step for this step and the 39 to the end;
        // evicting the other sequence recomputes 120 tokens once
        let c = SwitchVsEvict {
            switch_extra_s: 0.875,
            switch_steps: steps_served(241, 10_000, 280, 1),
            evict_tokens: 120,
            recompute_s_per_token: 0.0625,
            recompute_fixed_s: 0.5,
            recomputations: 1,
            evict_growth_tokens: 0,
        };
        assert_eq!(c.switch_steps, 40);
        assert_eq!(c.switch_cost(), 35.0);
        assert_eq!(c.evict_cost(), 8.0);
        assert!(c.evict_cheaper());
        // the same eviction recomputed in each of the remaining passes (the simulator)
        let every_pass = SwitchVsEvict {
            recomputations: 40,
            ..c
        };
        assert_eq!(every_pass.evict_cost(), 40.0 * 8.0);
        assert!(!every_pass.evict_cheaper());
        // ... and growing by 2 tokens a pass: 40·(2·0.0625) + 2·0.0625·40·39/2
        let growing = SwitchVsEvict {
            evict_tokens: 2,
            recompute_fixed_s: 0.0,
            evict_growth_tokens: 2,
            ..every_pass
        };
        assert_eq!(growing.evict_cost(), 5.0 + 97.5);
        // a switch that adds nothing, or nothing to evict: switch
        assert!(!SwitchVsEvict {
            switch_extra_s: 0.0,
            ..c
        }
        .evict_cheaper());
        assert!(!SwitchVsEvict {
            evict_tokens: 0,
            recompute_fixed_s: 0.0,
            ..c
        }
        .evict_cheaper());
        // a tie switches
        let tie = SwitchVsEvict {
            switch_extra_s: 8.0,
            switch_steps: 1,
            ..c
        };
        assert!(!tie.evict_cheaper());
    }

    #[test]
    fn a_switch_serves_until_its_threshold_or_the_end() {
        assert_eq!(steps_served(100, 140, 1000, 2), 21);
        assert_eq!(steps_served(100, 1000, 140, 2), 21);
        assert_eq!(steps_served(100, 90, 1000, 2), 1);
        assert_eq!(steps_served(100, 140, 1000, 0), 41);
    }

    #[test]
    fn layout_keeps_the_layers() {
        let s = vec![
            StagePlan::with_offload(0, 3, 0, 0),
            StagePlan::with_offload(6, 3, 1, 0),
        ];
        let l = stage_layout(&s, 2, 1);
        assert_eq!(counts_max(&l), (2, 1));
        assert_eq!(l[1].layers.first().map(|l| l.layer), Some(6));
        assert_eq!(counts_max(&s), (1, 0));
    }

    #[test]
    fn lending_dead_band() {
        // shrinks at once when the link drops by n_ts or more
        assert_eq!(lend_update(100, 80, 0, 10, 16), Some(80));
        // a drop under n_ts is ignored
        assert_eq!(lend_update(100, 90, 0, 10, 16), None);
        // grows only when over the threshold, by at least n_ts
        assert_eq!(lend_update(100, 500, 0, 10, 16), None);
        assert_eq!(lend_update(100, 500, 10, 10, 16), Some(116));
        // not when the link cannot carry what is needed
        assert_eq!(lend_update(100, 105, 100, 10, 16), None);
        // Eq. 8
        assert_eq!(lend_cap_tokens(1000.0, 1.0, 100.0, 0.0, 10.0, 0.5), 20);
        assert_eq!(lend_cap_tokens(1000.0, -1.0, 0.0, 0.0, 10.0, 0.5), 0);
    }
}
