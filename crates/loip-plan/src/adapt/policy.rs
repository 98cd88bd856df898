//! The adaptation loop over a pipeline of devices (design §6), in the cost model's memory
//! terms: the simulator runs it step by step; the pieces it decides with are in
//! [`super::switch`], which the runtime uses too.
//!
//! Memory of device `i` while step `t` runs (`n_t = b·(prompt + t + 1)` KV tokens held over
//! all sequences):
//!
//! ```text
//! M_i = base_i                          retained blocks + slot + embedding/head + buffers
//!     + (n_t − b·e) · L_i · κ            KV cache; e tokens per sequence evicted (recomputed)
//!     − lent_i · (L_i − n_i^max) · κ     KV lent to a peer: all stages but one buffer
//!     + Σ_lenders lent_j · L_j · κ       KV borrowed from peers
//! ```
//!
//! (`L_i` layers, `n_i^max` layers of its largest stage.) Lent KV of a stage is sent after the
//! stage runs; the next stage's lent KV is fetched back into the same buffer once that send
//! is done, before the next stage runs (a streaming swap through one stage-sized buffer). So
//! a lender always holds one stage's lent part: the design's formula counts all `s` stages as
//! freed, which a real device cannot reach, and lending needs `s ≥ 2`. Send and fetch share
//! the device's idle window between two of its stages, `T_round − C_i`, which is Eq. 8:
//! `n_trans ≤ (bw·(T_round − C_i) − traffic) / (2·n_i·κ)`.
//!
//! Decisions for step `t` are made when step `t − 2` ends (the runtime prefetches one step
//! ahead), from measured step time and bandwidth:
//! 1. shrink lending at once when the measured bandwidth no longer carries it (changes under
//!    `n_ts` tokens are ignored);
//! 2. for every device over budget (least slack first): if the cheapest threshold switch —
//!    offload `α`/`β` more attention/MLP blocks per stage, or bring one back, chosen for the
//!    smallest `g = ld + span` whose memory lasts `horizon` more tokens — does not lengthen
//!    the step the cost model predicts ([`cost::overlapped_round`]), switch; otherwise lend
//!    enough KV (at least `n_ts` more tokens) to the peer with the most spare memory if the
//!    idle link time carries it (Eq. 8); otherwise switch (when no layout lasts, offload
//!    every block if that frees anything — with one stage per device it does not: the slot
//!    holds what is offloaded);
//!    — unless evicting and recomputing instead costs less than the switch adds until the
//!    new layout's next threshold or the run's end ([`switch::SwitchVsEvict`]; here the
//!    evicted tokens are recomputed in every remaining pass);
//! 3. evict and recompute what still does not fit (the baselines only do this).

use super::switch::{self, counts_max};
use super::{AdaptConfig, AdaptEvent, KvPolicy, MemorySample};
use crate::cost;
use crate::{ExecMode, LoaderProfile, ModelShape, StagePlan};

/// Block compute times of the devices, from the caller's model (the simulator's device
/// models, or measured profiles).
pub trait BlockTimes {
    /// (attention, MLP) block time on `device` for `tokens` new tokens of one sequence over
    /// `n` cached tokens.  // seconds
    fn blocks(&self, device: usize, tokens: u32, n: u64) -> (f64, f64);
    /// Final norm and LM head for one token on `device`.  // seconds
    fn head(&self, device: usize) -> f64;
}

/// Memory and offload state of one pipeline device.
#[derive(Debug, Clone)]
pub struct DevState {
    /// Budget.  // bytes
    pub budget: u64,
    /// Current stage layouts.
    pub stages: Vec<StagePlan>,
    /// Holds the embedding.
    pub embed: bool,
    /// Holds the final norm and LM head.
    pub head: bool,
    /// Layers on the device.
    pub layers: u64,
    /// Largest stage.  // layers
    pub n_max: u32,
    /// Lending: (peer index, tokens lent).
    pub lend: Option<(usize, u64)>,
    /// Peak memory seen.  // bytes
    pub peak: u64,
}

/// What the simulator measured over the last completed step.
#[derive(Debug, Clone, Copy)]
pub struct Measure {
    /// Duration of the step.  // seconds
    pub step_s: f64,
    /// Bandwidth measured on the links during it.  // bytes/s
    pub bandwidth: f64,
}

/// The adaptation state of a pipeline run.
pub struct Adapter<'a, T: BlockTimes> {
    /// The model's shape.
    pub shape: &'a ModelShape,
    /// Execution mode of the plan.
    pub mode: ExecMode,
    /// Sequences in flight.
    pub b: u32,
    /// What to do when the KV outgrows the memory.
    pub policy: KvPolicy,
    /// Knobs.
    pub cfg: AdaptConfig,
    /// Prompt tokens per sequence.  // tokens
    pub prompt: u32,
    /// Steps of the run.
    pub steps: u32,
    /// Link latency per transfer.  // seconds
    pub latency: f64,
    /// Per device.
    pub devs: Vec<DevState>,
    /// Block times of the devices.
    pub clock: T,
    /// Loader of each device.
    pub loaders: Vec<LoaderProfile>,
    /// Tokens per sequence evicted and recomputed in every pass.
    pub evict: u32,
    /// What was decided so far.
    pub events: Vec<AdaptEvent>,
}

impl<'a, T: BlockTimes> Adapter<'a, T> {
    /// KV tokens held over all sequences while step `step` runs.  // tokens
    pub fn tokens(&self, step: u32) -> u64 {
        self.b as u64 * (self.prompt as u64 + step as u64 + 1)
    }

    fn kv_pt(&self, i: usize) -> u64 {
        self.shape.kv_bytes(self.devs[i].layers, 1)
    }

    /// Bytes freed per lent token on device `i` (0 when it cannot lend).  // bytes
    fn lend_saving_pt(&self, i: usize) -> u64 {
        let d = &self.devs[i];
        d.layers.saturating_sub(d.n_max as u64) * self.shape.kv_bytes_per_token
    }

    /// Weights, slot and buffers of `stages` on device `i`.  // bytes
    pub fn base(&self, i: usize, stages: &[StagePlan]) -> u64 {
        let d = &self.devs[i];
        cost::device_memory(self.shape, self.mode, stages, d.embed, d.head, 0, self.b)
    }

    fn borrowed(&self, p: usize) -> u64 {
        (0..self.devs.len())
            .filter_map(|j| match self.devs[j].lend {
                Some((q, tok)) if q == p => Some(tok * self.kv_pt(j)),
                _ => None,
            })
            .sum()
    }

    /// Memory of device `i` at `tokens` KV tokens with layout `base` bytes.  // bytes
    fn mem_with(&self, i: usize, base: u64, tokens: u64) -> u64 {
        let kv = tokens.saturating_sub(self.b as u64 * self.evict as u64) * self.kv_pt(i);
        let lent = self.devs[i].lend.map(|l| l.1).unwrap_or(0) * self.lend_saving_pt(i);
        (base + kv + self.borrowed(i)).saturating_sub(lent)
    }

    /// Memory of device `i` at `tokens` with its current layout.  // bytes
    pub fn mem(&self, i: usize, tokens: u64) -> u64 {
        self.mem_with(i, self.base(i, &self.devs[i].stages), tokens)
    }

    /// `TS¹` of device `i`: KV tokens it can hold with its initial layout.  // tokens
    pub fn first_threshold(&self, i: usize) -> Option<u64> {
        let base = self.base(i, &self.devs[i].stages);
        switch::threshold(self.devs[i].budget, base, self.kv_pt(i))
    }

    /// Per-device (attention, MLP) block times at `step`.  // seconds
    fn block_times(&self, step: u32) -> Vec<(f64, f64)> {
        let n = self.prompt as u64 + step as u64 + 1;
        let tok = 1 + self.evict;
        (0..self.devs.len())
            .map(|i| self.clock.blocks(i, tok, n))
            .collect()
    }

    /// `g = ld + span` of `a`/`m` offloaded blocks per stage on device `i`.  // seconds
    fn g(&self, i: usize, a: u32, m: u32, times: &[(f64, f64)]) -> f64 {
        let (ta, tm) = times[i];
        let (a, m) = (a.min(self.devs[i].n_max), m.min(self.devs[i].n_max));
        let bytes = a as u64 * self.shape.attn_bytes + m as u64 * self.shape.mlp_bytes;
        self.loaders[i].load_time(bytes, a + m) + cost::span(a, m, ta, tm)
    }

    /// Predicted time of a step if device `i` offloads `a`/`m` blocks per stage and the others
    /// keep their layouts (overlapped): the cost model's rounds ([`cost::overlapped_round`])
    /// at the current block times and bandwidth, `s − 1` without the LM head and one with
    /// it, whose wrap-around hop is the token's return trip (`r` bytes).  // seconds
    fn predicted_step(&self, i: usize, a: u32, m: u32, times: &[(f64, f64)], bw: f64) -> f64 {
        let nd = self.devs.len();
        let act = (1 + self.evict) as f64 * self.shape.act_bytes_per_token as f64; // bytes
        let ret = self.shape.return_bytes_per_token() as f64; // bytes
        let (c, link, c_last, link_last) = if nd > 1 {
            let hop = act / bw + self.latency;
            (
                nd as f64 * hop,
                act / bw,
                (nd - 1) as f64 * hop + ret / bw + self.latency,
                act.max(ret) / bw,
            )
        } else {
            (0.0, 0.0, 0.0, 0.0)
        };
        let mut parts: Vec<cost::DeviceRound> = (0..nd)
            .map(|j| {
                let (ja, jm) = if j == i {
                    (a, m)
                } else {
                    counts_max(&self.devs[j].stages)
                };
                cost::DeviceRound {
                    compute: self.devs[j].n_max as f64 * (times[j].0 + times[j].1),
                    g: self.g(j, ja, jm, times),
                }
            })
            .collect();
        let rounds = self.devs[i].stages.len().max(1) as f64;
        let plain = cost::overlapped_round(&parts, self.b, c, link).time;
        parts[nd - 1].compute += self.clock.head(nd - 1);
        let with_head = cost::overlapped_round(&parts, self.b, c_last, link_last).time;
        (rounds - 1.0) * plain + with_head
    }

    /// Stages of device `i` with `a`/`m` offloaded blocks per stage (capped per stage).
    fn layout(&self, i: usize, a: u32, m: u32) -> Vec<StagePlan> {
        switch::stage_layout(&self.devs[i].stages, a, m)
    }

    /// The cheapest layout of device `i` whose memory holds `tokens`: smallest `g = ld + off`
    /// (what its stall grows with, in both patterns), then the fewest changed blocks. `None`
    /// if even offloading everything does not fit.
    fn best_switch(&self, i: usize, tokens: u64, times: &[(f64, f64)]) -> Option<(u32, u32)> {
        switch::choose_switch(
            self.devs[i].n_max,
            counts_max(&self.devs[i].stages),
            |a, m| {
                let base = self.base(i, &self.layout(i, a, m));
                self.mem_with(i, base, tokens) <= self.devs[i].budget
            },
            |a, m| self.g(i, a, m, times),
        )
    }

    fn switch(&mut self, i: usize, step: u32, to: (u32, u32)) {
        let from = counts_max(&self.devs[i].stages);
        if from == to {
            return;
        }
        self.devs[i].stages = self.layout(i, to.0, to.1);
        let tokens = self.tokens(step);
        self.events.push(AdaptEvent::Switch {
            step,
            device: i,
            tokens,
            from,
            to,
        });
    }

    /// The switch of device `i` to `to` (adding `extra` seconds a step) priced against
    /// evicting the `over` bytes it is over its budget instead, recomputed in every
    /// remaining pass and growing by `b` tokens a pass ([`switch::SwitchVsEvict`], the
    /// runtime's choice too).
    fn evict_vs_switch(
        &self,
        i: usize,
        step: u32,
        to: (u32, u32),
        extra: f64,
        over: u64,
    ) -> switch::SwitchVsEvict {
        let (kv, b) = (self.kv_pt(i).max(1), self.b as u64);
        let base = self.base(i, &self.layout(i, to.0, to.1));
        let lent = self.devs[i].lend.map(|l| l.1).unwrap_or(0) * self.lend_saving_pt(i);
        let room = (self.devs[i].budget + lent).saturating_sub(base + self.borrowed(i));
        let threshold = room / kv + b * self.evict as u64;
        let end = self.tokens(self.steps.saturating_sub(1));
        let n = self.prompt as u64 + step as u64 + 1;
        let per_token = (0..self.devs.len())
            .map(|j| {
                let (ta, tm) = self.clock.blocks(j, 1, n);
                self.devs[j].layers as f64 * (ta + tm)
            })
            .sum();
        switch::SwitchVsEvict {
            switch_extra_s: extra,
            switch_steps: switch::steps_served(self.tokens(step), threshold, end, b),
            evict_tokens: over.div_ceil(kv).div_ceil(b) * b,
            recompute_s_per_token: per_token,
            recompute_fixed_s: 0.0,
            recomputations: self.steps.saturating_sub(step) as u64,
            evict_growth_tokens: b,
        }
    }

    /// Activation bytes device `i` sends per round (one stage, all micro-batches).  // bytes
    fn traffic(&self) -> f64 {
        self.b as f64 * (1 + self.evict) as f64 * self.shape.act_bytes_per_token as f64
    }

    /// Spare memory of `p` for borrowed KV until the end of the run.  // bytes
    fn spare(&self, p: usize) -> u64 {
        let last = self.tokens(self.steps.saturating_sub(1));
        self.devs[p].budget.saturating_sub(self.mem(p, last))
    }

    /// Most tokens device `i` can lend to `p`: Eq. 8 over the idle window between two of its
    /// stages (send and fetch in turn), and `p`'s spare memory.  // tokens
    fn lend_cap(&self, i: usize, p: usize, m: &Measure, times: &[(f64, f64)]) -> u64 {
        let d = &self.devs[i];
        let s = d.stages.len().max(1) as f64;
        let per_tok = d.n_max as f64 * self.shape.kv_bytes_per_token as f64;
        if per_tok <= 0.0 || d.stages.len() < 2 {
            return 0;
        }
        let round = m.step_s / s;
        let busy = self.b as f64 * d.n_max as f64 * (times[i].0 + times[i].1);
        // Other lenders' fetches also use p's port in the same window.
        let others: f64 = (0..self.devs.len())
            .filter(|&j| j != i)
            .filter_map(|j| match self.devs[j].lend {
                Some((q, tok)) if q == p => Some(
                    tok as f64 * self.devs[j].n_max as f64 * self.shape.kv_bytes_per_token as f64,
                ),
                _ => None,
            })
            .sum();
        let link = switch::lend_cap_tokens(
            m.bandwidth,
            round - busy,
            self.traffic(),
            others,
            per_tok,
            self.cfg.lend_link_fraction,
        );
        let own = self.devs[i]
            .lend
            .filter(|l| l.0 == p)
            .map(|l| l.1 * self.kv_pt(i))
            .unwrap_or(0);
        let memory = (self.spare(p) + own) / self.kv_pt(i).max(1);
        link.min(memory)
    }

    fn set_lend(&mut self, i: usize, step: u32, lend: Option<(usize, u64)>) {
        let lend = lend.filter(|l| l.1 > 0);
        if self.devs[i].lend != lend {
            let (peer, tokens) = lend
                .or(self.devs[i].lend.map(|l| (l.0, 0)))
                .unwrap_or((i, 0));
            self.devs[i].lend = lend;
            self.events.push(AdaptEvent::Lend {
                step,
                device: i,
                peer,
                tokens,
            });
        }
    }

    /// Makes the decisions for step `step` (see the module docs).
    pub fn decide(&mut self, step: u32, measure: Option<Measure>) {
        let nd = self.devs.len();
        let tok = self.tokens(step);
        let adaptive = matches!(self.policy, KvPolicy::Adaptive { .. });
        let lending = matches!(self.policy, KvPolicy::Adaptive { lending: true })
            && self.mode == ExecMode::Overlapped;
        let times = self.block_times(step);
        let n_ts = self.cfg.min_change_tokens as u64;
        // 1. Shrink lending the link no longer carries.
        if let Some(m) = &measure {
            for i in 0..nd {
                if let Some((p, cur)) = self.devs[i].lend {
                    let cap = self.lend_cap(i, p, m, &times);
                    if let Some(to) = switch::lend_shrink(cur, cap, n_ts) {
                        self.set_lend(i, step, Some((p, to)));
                    }
                }
            }
        }
        // 2. Devices over budget, least slack first.
        if adaptive {
            let mut order: Vec<usize> = (0..nd).collect();
            order.sort_by_key(|&i| (self.devs[i].budget as i128 - self.mem(i, tok) as i128, i));
            let horizon = self.tokens(
                (step + self.cfg.horizon_tokens)
                    .min(self.steps.saturating_sub(1))
                    .max(step),
            );
            let bw = measure.map(|m| m.bandwidth).unwrap_or(f64::INFINITY);
            for i in order {
                let over = self.mem(i, tok).saturating_sub(self.devs[i].budget);
                if over == 0 {
                    continue;
                }
                let sw = self
                    .best_switch(i, horizon, &times)
                    .or_else(|| self.best_switch(i, tok, &times));
                let (ca, cm) = counts_max(&self.devs[i].stages);
                let step_now = self.predicted_step(i, ca, cm, &times, bw);
                let free = sw.is_some_and(|(a, m)| {
                    self.predicted_step(i, a, m, &times, bw) <= step_now * (1.0 + 1e-12)
                });
                let saving = self.lend_saving_pt(i);
                if lending && !free && saving > 0 {
                    if let Some(m) = &measure {
                        let cur = self.devs[i].lend;
                        let peer = cur.map(|l| l.0).or_else(|| {
                            (0..nd)
                                .filter(|&p| p != i && self.devs[p].lend.is_none())
                                .max_by_key(|&p| (self.spare(p), std::cmp::Reverse(p)))
                        });
                        if let Some(p) = peer {
                            let have = cur.map(|l| l.1).unwrap_or(0);
                            let cap = self.lend_cap(i, p, m, &times);
                            if let Some(to) = switch::lend_grow(have, cap, over, saving, n_ts) {
                                self.set_lend(i, step, Some((p, to)));
                                continue;
                            }
                        }
                    }
                }
                if let Some(to) = sw.filter(|&to| to != (ca, cm)) {
                    let extra = self.predicted_step(i, to.0, to.1, &times, bw) - step_now;
                    let c = self.evict_vs_switch(i, step, to, extra, over);
                    if self.cfg.evict_over_switch && c.evict_cheaper() {
                        // step 3 evicts instead: cheaper over the rest of the run
                        continue;
                    }
                }
                match sw {
                    Some(to) => self.switch(i, step, to),
                    None => {
                        // Offload everything if that frees memory at all (with one stage per
                        // device the slot holds what was offloaded, so it frees nothing and
                        // only adds loads); eviction handles the rest.
                        let n = self.devs[i].n_max;
                        let least = self.base(i, &self.layout(i, n, n));
                        if least < self.base(i, &self.devs[i].stages) {
                            self.switch(i, step, (n, n));
                        }
                    }
                }
            }
        }
        // 3. Evict and recompute what still does not fit.
        let mut evict = self.evict;
        for i in 0..nd {
            let kv = self.kv_pt(i);
            if kv == 0 {
                continue;
            }
            let over = self.mem(i, tok).saturating_sub(self.devs[i].budget);
            if over > 0 {
                let more = over.div_ceil(kv).div_ceil(self.b as u64) as u32;
                evict = evict.max(self.evict + more);
            }
        }
        if evict != self.evict {
            self.evict = evict;
            self.events.push(AdaptEvent::Evict {
                step,
                tokens: evict,
            });
        }
        for i in 0..nd {
            let m = self.mem(i, tok);
            self.devs[i].peak = self.devs[i].peak.max(m);
        }
    }

    /// Memory sample of device `i` while step `step` runs, stamped `time_s`.
    pub fn sample(&self, i: usize, step: u32, time_s: f64) -> MemorySample {
        let tokens = self.tokens(step);
        let weights = self.base(i, &self.devs[i].stages);
        let kv_pt = self.kv_pt(i);
        let evicted = (self.b as u64 * self.evict as u64).min(tokens) * kv_pt;
        let lent_tok = self.devs[i].lend.map(|l| l.1).unwrap_or(0);
        let kv_lent = lent_tok * self.lend_saving_pt(i);
        let kv_local = (tokens * kv_pt)
            .saturating_sub(evicted)
            .saturating_sub(kv_lent);
        let kv_borrowed = self.borrowed(i);
        MemorySample {
            time_s,
            step,
            tokens,
            total: weights + kv_local + kv_borrowed,
            weights,
            kv_local,
            kv_lent,
            kv_borrowed,
            kv_evicted: evicted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LoaderProfile;

    struct Flat;
    impl BlockTimes for Flat {
        fn blocks(&self, _: usize, tokens: u32, _: u64) -> (f64, f64) {
            (1e-3 * tokens as f64, 1e-3 * tokens as f64)
        }
        fn head(&self, _: usize) -> f64 {
            1e-3
        }
    }

    /// The decisions of one device, two stages of two layers, nothing offloaded, two
    /// sequences of 10 + 40 tokens, its budget 4 tokens a sequence past the prompt, its
    /// loader reading at `bandwidth` (bytes/s).
    fn events(shape: &ModelShape, bandwidth: f64) -> Vec<AdaptEvent> {
        let stages = vec![
            StagePlan::with_offload(0, 2, 0, 0),
            StagePlan::with_offload(2, 2, 0, 0),
        ];
        let mut ad = Adapter {
            shape,
            mode: ExecMode::Overlapped,
            b: 2,
            policy: KvPolicy::Adaptive { lending: false },
            cfg: AdaptConfig {
                evict_over_switch: true,
                ..AdaptConfig::default()
            },
            prompt: 10,
            steps: 40,
            latency: 0.0,
            devs: vec![DevState {
                budget: u64::MAX,
                stages,
                embed: true,
                head: true,
                layers: 4,
                n_max: 2,
                lend: None,
                peak: 0,
            }],
            clock: Flat,
            loaders: vec![LoaderProfile {
                bandwidth,
                per_read_overhead: 1e-4,
            }],
            evict: 0,
            events: Vec::new(),
        };
        let base = ad.base(0, &ad.devs[0].stages);
        ad.devs[0].budget = base + ad.kv_pt(0) * ad.tokens(4);
        let m = Measure {
            step_s: 0.1,
            bandwidth: 1e9,
        };
        for step in 0..ad.steps {
            ad.decide(step, Some(m));
        }
        ad.events
    }

    #[test]
    fn a_switch_whose_loads_cost_more_than_recomputing_is_not_taken() {
        let shape = ModelShape::from_dims("t", 64, 256, 4, 4, 2, 16, 100, false, 2.0, 2);
        let fast = events(&shape, 1e12);
        assert!(
            matches!(fast.first(), Some(AdaptEvent::Switch { step: 5, .. })),
            "{fast:?}"
        );
        assert!(
            !fast.iter().any(|e| matches!(e, AdaptEvent::Evict { .. })),
            "{fast:?}"
        );
        // at 1 kB/s a block takes a minute to load: recomputing the overflow in each pass
        // costs far less than the switch would add
        let slow = events(&shape, 1e3);
        assert!(
            matches!(slow.first(), Some(AdaptEvent::Evict { step: 5, .. })),
            "{slow:?}"
        );
        assert!(
            !slow.iter().any(|e| matches!(e, AdaptEvent::Switch { .. })),
            "{slow:?}"
        );
    }
}
