//! Token sampling: greedy, temperature, top-k, top-p, seeded.

use std::collections::{BTreeMap, HashMap};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::constraint::Constrained;
use crate::EngineError;

/// How to pick the next token from logits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax)
    pub temperature: f32,
    /// keep the k most likely tokens; 0 disables
    pub top_k: usize,
    /// keep the smallest set of tokens whose probability reaches p; 1 disables
    pub top_p: f32,
    /// RNG seed (same seed, same logits → same tokens)
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Rejects out-of-range values, naming the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(EngineError::Invalid(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(EngineError::Invalid(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// A seeded sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
}

/// Sets the `ids` entries of `logits` to −∞ (ids outside the vocabulary are ignored): the
/// end-of-sequence ids held back by a minimum length.
pub fn mask(logits: &mut [f32], ids: &[u32]) {
    for &e in ids {
        if let Some(l) = logits.get_mut(e as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Index of the largest value; the lowest index wins ties; NaN never wins (0 when no value
/// is above −∞).
///
/// Two passes that the compiler vectorizes, with the result of the sequential scan (`best`
/// replaced where `v > best_v`): the largest value not NaN (lanes of 16 kept with the same
/// comparison, so NaN is skipped), then the first index holding it. A 151936-entry row (Qwen2.5's
/// vocabulary; 8 of them each batched step) is a few tens of µs instead of a dependent scan.
pub fn argmax(logits: &[f32]) -> u32 {
    const L: usize = 16;
    let top = |a: f32, v: f32| if v > a { v } else { a };
    let mut lanes = [f32::NEG_INFINITY; L];
    let chunks = logits.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in lanes.iter_mut().zip(c) {
            *a = top(*a, v);
        }
    }
    let best_v = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |a, &v| top(a, v));
    if best_v == f32::NEG_INFINITY {
        return 0;
    }
    // the first chunk holding `best_v`, then its first lane (`best_v` is not NaN)
    let mut base = 0;
    for c in logits.chunks(L) {
        if c.iter().fold(false, |f, &v| f | (v == best_v)) {
            let i = c.iter().position(|&v| v == best_v).unwrap_or(0);
            return (base + i) as u32;
        }
        base += L;
    }
    0
}

/// [`argmax`] of `logits` with the `masked` ids taken as −∞ ([`mask`]), without a copy of
/// the row: the argmax of the row itself is that of the masked row unless it is a masked id
/// above −∞ (every other value only falls), in which case the row is copied and masked.
pub fn argmax_masked(logits: &[f32], masked: &[u32]) -> u32 {
    let i = argmax(logits);
    let hit = masked.contains(&i)
        && logits
            .get(i as usize)
            .is_some_and(|&v| v > f32::NEG_INFINITY);
    if !hit {
        return i;
    }
    let mut l = logits.to_vec();
    mask(&mut l, masked);
    argmax(&l)
}

impl Sampler {
    /// A sampler with its RNG seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Result<Sampler, EngineError> {
        params.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Ok(Sampler { params, rng })
    }

    /// Whether [`Sampler::sample`] is the plain [`argmax`] (temperature 0 or top-k 1).
    pub fn is_greedy(&self) -> bool {
        self.params.temperature == 0.0 || self.params.top_k == 1
    }

    /// Picks a token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let d = self.distribution(logits);
        if d.ids.is_empty() {
            return argmax(logits);
        }
        self.draw(&d)
    }

    /// The distribution [`Sampler::sample`] draws from: temperature, then top-k, then
    /// top-p; a point mass on the [`argmax`] when greedy; empty when no logit is finite.
    ///
    /// With top-k or top-p its ids are the kept tokens, most likely first (ties: the lower
    /// id); with neither, every token with a finite logit in id order. Only the kept part is
    /// sorted, so that a sampled step over a vocabulary of 10⁵ tokens costs one pass over it
    /// (a sort of the whole vocabulary took longer than the step's forward pass).
    pub fn distribution(&self, logits: &[f32]) -> Dist {
        if self.is_greedy() {
            return Dist {
                ids: vec![argmax(logits)],
                probs: vec![1.0],
            };
        }
        let p = &self.params;
        let mut cand = candidates(logits, p.temperature);
        if cand.is_empty() {
            return Dist::default();
        }
        let sorted = p.top_k > 0;
        if sorted {
            if p.top_k < cand.len() {
                cand.select_nth_unstable_by(p.top_k - 1, likelier);
                cand.truncate(p.top_k);
            }
            cand.sort_unstable_by(likelier);
        }
        let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        if max == f32::INFINITY {
            // a temperature so small that a logit over it overflows: the limit is greedy
            return Dist {
                ids: vec![argmax(logits)],
                probs: vec![1.0],
            };
        }
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        if p.top_p < 1.0 {
            let keep = if sorted {
                top_p_prefix(probs.iter().copied(), p.top_p as f64)
            } else {
                // the most likely tokens first, sorted only as far as top-p reaches
                nucleus(&mut cand, &mut probs, p.top_p as f64)
            };
            cand.truncate(keep);
            probs.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|q| *q /= total);
        }
        Dist {
            ids: cand.into_iter().map(|c| c.0).collect(),
            probs,
        }
    }

    /// One draw from `d` (not empty) with this sampler's RNG.
    pub fn draw(&mut self, d: &Dist) -> u32 {
        let r = self.uniform();
        let mut acc = 0.0;
        for (i, q) in d.probs.iter().enumerate() {
            acc += q;
            if r < acc {
                return d.ids[i];
            }
        }
        d.ids[d.ids.len() - 1]
    }

    /// One uniform draw in [0, 1) from this sampler's RNG.
    pub fn uniform(&mut self) -> f64 {
        self.rng.gen()
    }

    /// The speculative sampling rule, for a draft `x` drawn from a distribution `q` (a
    /// sampled draft model): keeps `x` with probability `min(1, p(x) / q(x))`, else draws
    /// from the residual `max(0, p − q)` renormalised; whatever `q`, the result is
    /// distributed as `p` (Leviathan et al. 2023, Chen et al. 2023). Returns the token and
    /// whether it is the draft. One uniform draw, one more on rejection. `p` not empty.
    ///
    /// A point-mass draft (`q = δ(x)`) keeps `x` with probability `p(x)` and otherwise draws
    /// from `p` without `x`: the same law as drawing from `p` and keeping the draft when
    /// they match, which the speculative loop does for point masses (it also gives the
    /// seeded tokens of decoding without speculation).
    pub fn keep_or_resample(&mut self, p: &Dist, x: u32, q: &Dist) -> (u32, bool) {
        let (px, qx) = (p.prob(x), q.prob(x));
        // u < p/q without dividing: a draft q never proposes (qx = 0) is kept iff p allows it
        if px > 0.0 && self.uniform() * qx < px {
            return (x, true);
        }
        // q's probabilities by id: a draft model's q can hold the whole vocabulary
        let q_of: HashMap<u32, f64> = q.ids.iter().copied().zip(q.probs.iter().copied()).collect();
        let residual: Vec<f64> = p
            .ids
            .iter()
            .zip(&p.probs)
            .map(|(id, &pi)| (pi - q_of.get(id).copied().unwrap_or(0.0)).max(0.0))
            .collect();
        let total: f64 = residual.iter().sum();
        if total <= 0.0 {
            // p ≤ q everywhere means p = q up to rounding: a rejection that cannot happen in
            // exact arithmetic; p is the law it would have drawn from
            return (self.draw(p), false);
        }
        let r = Dist {
            ids: p.ids.clone(),
            probs: residual.iter().map(|v| v / total).collect(),
        };
        (self.draw(&r), false)
    }
}

/// The tokens with a finite logit and their logits over `temperature`, in id order.
fn candidates(logits: &[f32], temperature: f32) -> Vec<(u32, f32)> {
    logits
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (i as u32, v / temperature))
        .collect()
}

/// The sampling order: the larger (scaled) logit first, the lower id on ties (a total order).
fn likelier(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// How many of `probs` (most likely first) top-p keeps: up to the first whose running sum
/// reaches `top_p`.
fn top_p_prefix(probs: impl IntoIterator<Item = f64>, top_p: f64) -> usize {
    let mut acc = 0.0;
    let mut n = 0;
    for q in probs {
        acc += q;
        n += 1;
        if acc >= top_p {
            break;
        }
    }
    n
}

/// Top-p over candidates in id order: moves the `k` likeliest to the front, sorted (`k`
/// growing 256, 1024, … until their probabilities reach `top_p`, at most all of them), and
/// returns how many top-p keeps ([`top_p_prefix`] of the sorted front).
fn nucleus(cand: &mut [(u32, f32)], probs: &mut [f64], top_p: f64) -> usize {
    let n = cand.len();
    // probabilities travel with their candidates
    let mut both: Vec<((u32, f32), f64)> =
        cand.iter().copied().zip(probs.iter().copied()).collect();
    let by = |a: &((u32, f32), f64), b: &((u32, f32), f64)| likelier(&a.0, &b.0);
    let mut k = 256.min(n);
    let keep = loop {
        if k < n {
            both.select_nth_unstable_by(k - 1, by);
        }
        both[..k].sort_unstable_by(by);
        let keep = top_p_prefix(both[..k].iter().map(|b| b.1), top_p);
        // a prefix short of `k` reached top-p; all `n` is the answer whatever it reached
        if keep < k || k == n {
            break keep;
        }
        k = (4 * k).min(n);
    };
    for (i, (c, q)) in both.into_iter().enumerate() {
        cand[i] = c;
        probs[i] = q;
    }
    keep
}

/// A distribution over token ids: the ids with non-zero probability and theirs (summing to
/// 1; in the order [`Sampler::distribution`] gives).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dist {
    /// token ids
    pub ids: Vec<u32>,
    /// their probabilities, `[i]` of `ids[i]`
    pub probs: Vec<f64>,
}

impl Dist {
    /// The probability of `id` (0 outside the support).
    pub fn prob(&self, id: u32) -> f64 {
        self.ids
            .iter()
            .position(|&i| i == id)
            .map_or(0.0, |i| self.probs[i])
    }
}

/// What a request asks of the next token besides sampling: penalties on tokens already seen,
/// a bias per token, and the log-probabilities to report. Shaping works on a copy of the
/// logits: the model's logits are never changed, and log-probabilities are those of the
/// model's own logits ([`logprob_of`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shaping {
    /// subtracted from a token's logit once per time it was generated (OpenAI's)
    pub frequency_penalty: f32,
    /// subtracted once from a token's logit when it was generated (OpenAI's)
    pub presence_penalty: f32,
    /// a token in the prompt or generated has its logit divided by this when positive,
    /// multiplied when negative (Hugging Face's `repetition_penalty`); `None` is off
    pub repetition_penalty: Option<f32>,
    /// `(token id, bias)`: the bias is added to the token's logit (−100 bans it)
    pub logit_bias: Vec<(u32, f32)>,
    /// report the chosen token's log-probability and this many most likely alternatives
    pub logprobs: Option<usize>,
    /// a grammar the output must follow: it masks what may be sampled, never the
    /// log-probabilities ([`crate::constraint`])
    pub constraint: Option<Constrained>,
}

/// Most alternatives [`Shaping::logprobs`] may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Shaping {
    /// Whether it asks for nothing (the next token may be picked where the logits are).
    pub fn is_off(&self) -> bool {
        *self == Shaping::default()
    }

    /// Rejects out-of-range values, naming the field: penalties in [−2, 2], a repetition
    /// penalty in (0, 10], biases in [−100, 100] on ids inside `vocab`, at most
    /// [`MAX_TOP_LOGPROBS`] alternatives.
    pub fn validate(&self, vocab: usize) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::Invalid(m));
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be between -2 and 2, got {v}"));
            }
        }
        if let Some(r) = self.repetition_penalty {
            if !(r > 0.0 && r <= 10.0) {
                return bad(format!("repetition_penalty must be in (0, 10], got {r}"));
            }
        }
        for &(id, b) in &self.logit_bias {
            if id as usize >= vocab {
                return bad(format!(
                    "logit_bias: token id {id} is outside the vocabulary of {vocab} tokens"
                ));
            }
            if !(-100.0..=100.0).contains(&b) {
                return bad(format!(
                    "logit_bias of token {id} must be between -100 and 100, got {b}"
                ));
            }
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return bad(format!("at most {MAX_TOP_LOGPROBS} top log-probabilities"));
        }
        Ok(())
    }

    /// Applies the penalties and the bias to `logits` (a copy of the model's): `counts` are
    /// the generated tokens' ids and how often each came, `prompt` the prompt's ids
    /// (sorted, without repeats).
    pub fn apply(&self, logits: &mut [f32], counts: &BTreeMap<u32, u32>, prompt: &[u32]) {
        for (&id, &n) in counts {
            if let Some(l) = logits.get_mut(id as usize) {
                *l -= n as f32 * self.frequency_penalty + self.presence_penalty;
            }
        }
        if let Some(r) = self.repetition_penalty {
            let seen = counts
                .keys()
                .copied()
                .chain(prompt.iter().copied().filter(|id| !counts.contains_key(id)));
            for id in seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        for &(id, b) in &self.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
    }
}

/// A chosen token's log-probability under the model's logits, and the most likely tokens'.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// the chosen token
    pub id: u32,
    /// its log-probability (−∞ for a masked token)
    pub logprob: f32,
    /// the most likely tokens, most likely first (ties: lower id first), with theirs
    pub top: Vec<(u32, f32)>,
}

/// The log-softmax of `logits` at `id`, and at the `top` most likely ids: `l − max −
/// ln Σ exp(l − max)`, summed in f64, so the same logits give the same bits on every path.
pub fn logprob_of(logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let max = logits
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|v| v.is_finite())
        .map(|&v| f64::from(v - max).exp())
        .sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |v: f32| {
        if v.is_finite() {
            (f64::from(v) - lse) as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &v) in logits.iter().enumerate() {
            if !v.is_finite() || (best.len() == top && v <= best[top - 1].1) {
                continue;
            }
            let at = best.partition_point(|b| b.1 >= v);
            best.insert(at, (i as u32, v));
            best.truncate(top);
        }
    }
    TokenLogprob {
        id,
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&v| lp(v)),
        top: best.into_iter().map(|(i, v)| (i, lp(v))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_argmax_lowest_index_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]), 1);
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.5, -1.0, 2.0]), 2);
    }

    /// The sequential scan [`argmax`] replaced.
    fn argmax_scan(logits: &[f32]) -> u32 {
        let mut best = 0usize;
        let mut best_v = f32::NEG_INFINITY;
        for (i, &v) in logits.iter().enumerate() {
            if v > best_v {
                best_v = v;
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_and_the_masked_argmax_are_the_sequential_scan() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, 2.5];
        for case in 0..2000 {
            let len = rng.gen_range(0..80);
            let mut l: Vec<f32> = (0..len)
                .map(|_| match rng.gen_range(0..4) {
                    0 => specials[rng.gen_range(0..specials.len())],
                    _ => f32::from(rng.gen_range(-4i8..4)) * 0.5,
                })
                .collect();
            if case % 7 == 0 {
                l.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
            }
            assert_eq!(argmax(&l), argmax_scan(&l), "{l:?}");
            let masked: Vec<u32> = (0..rng.gen_range(0..4))
                .map(|_| rng.gen_range(0..len.max(1) as u32 + 2))
                .collect();
            let mut m = l.clone();
            mask(&mut m, &masked);
            assert_eq!(
                argmax_masked(&l, &masked),
                argmax_scan(&m),
                "{l:?} {masked:?}"
            );
        }
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_limits_choice() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 3,
            top_p: 1.0,
            seed: 7,
        };
        let mut a = Sampler::new(params.clone()).unwrap();
        let mut b = Sampler::new(params).unwrap();
        let mut top: Vec<usize> = (0..50).collect();
        top.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]));
        for _ in 0..100 {
            let t = a.sample(&logits);
            assert_eq!(t, b.sample(&logits));
            assert!(top[..3].contains(&(t as usize)));
        }
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let logits = [0.1, 5.0, 0.3, 4.9];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.01,
            seed: 1,
        })
        .unwrap();
        for _ in 0..20 {
            assert_eq!(s.sample(&logits), 1);
        }
    }

    /// The definition [`Sampler::distribution`] implements, by sorting every candidate.
    fn by_full_sort(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
        let mut cand = candidates(logits, p.temperature);
        cand.sort_by(likelier);
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let w: Vec<f64> = cand
            .iter()
            .map(|c| ((c.1 - cand[0].1) as f64).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let mut probs: Vec<f64> = w.iter().map(|q| q / total).collect();
        if p.top_p < 1.0 {
            probs.truncate(top_p_prefix(probs.iter().copied(), p.top_p as f64));
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|q| *q /= total);
        }
        cand.iter().zip(probs).map(|(c, q)| (c.0, q)).collect()
    }

    /// Over a vocabulary of Gemma 3's size, with ties and masked tokens: the same kept ids
    /// as sorting everything; top-k sums in the same order (the same bits), top-p alone and
    /// no limit sum the whole vocabulary in id order (the last bits may differ).
    #[test]
    fn a_large_vocabulary_sorts_only_what_it_keeps() {
        let n = 262_144;
        let mut logits: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.618).sin() * 9.0).round() / 2.0)
            .collect();
        logits[17] = f32::NEG_INFINITY;
        logits[99] = f32::NAN;
        for (top_k, top_p) in [
            (40, 1.0),
            (40, 0.9),
            (0, 0.9),
            (0, 0.999),
            (0, 1.0),
            (n, 0.5),
        ] {
            let params = SamplingParams {
                temperature: 0.7,
                top_k,
                top_p,
                seed: 3,
            };
            let want = by_full_sort(&logits, &params);
            let got = Sampler::new(params).unwrap().distribution(&logits);
            assert_eq!(got.ids.len(), want.len(), "top_k {top_k} top_p {top_p}");
            let mut by_id: Vec<(u32, f64)> = got.ids.iter().copied().zip(got.probs).collect();
            if top_k == 0 && top_p == 1.0 {
                assert!(by_id.windows(2).all(|w| w[0].0 < w[1].0), "id order");
                by_id.sort_by(|a, b| {
                    likelier(&(a.0, logits[a.0 as usize]), &(b.0, logits[b.0 as usize]))
                });
            }
            for ((gi, gq), (wi, wq)) in by_id.iter().zip(&want) {
                assert_eq!(gi, wi, "top_k {top_k} top_p {top_p}");
                if top_k > 0 {
                    assert_eq!(gq.to_bits(), wq.to_bits(), "top_k {top_k} top_p {top_p}");
                } else {
                    assert!((gq - wq).abs() <= 1e-9 * wq, "{gq} vs {wq}");
                }
            }
        }
    }

    #[test]
    fn an_overflowing_temperature_is_greedy() {
        let s = Sampler::new(SamplingParams {
            temperature: 1e-45,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        })
        .unwrap();
        let d = s.distribution(&[1.0, 3.0, -2.0]);
        assert_eq!((d.ids, d.probs), (vec![1], vec![1.0]));
    }

    /// Exact: the rule's output law is q·min(1, p/q) + (1 − Σ min(p, q))·residual = p;
    /// here checked by drawing (fixed seed) against p, with a loose bound.
    #[test]
    fn the_kept_tokens_follow_p_whatever_q() {
        let p = Dist {
            ids: vec![0, 1, 2, 3],
            probs: vec![0.5, 0.25, 0.15, 0.1],
        };
        let q = Dist {
            ids: vec![3, 1, 4],
            probs: vec![0.6, 0.3, 0.1],
        };
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 9,
            ..Default::default()
        })
        .unwrap();
        let mut draft = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 10,
            ..Default::default()
        })
        .unwrap();
        let n = 200_000;
        let mut counts = [0usize; 5];
        let mut kept = 0;
        for _ in 0..n {
            let x = draft.draw(&q);
            let (t, k) = s.keep_or_resample(&p, x, &q);
            assert!(!k || t == x);
            kept += usize::from(k);
            counts[t as usize] += 1;
        }
        for (id, &c) in counts.iter().enumerate() {
            let want = p.prob(id as u32);
            let got = c as f64 / n as f64;
            assert!((got - want).abs() < 0.005, "token {id}: {got} vs {want}");
        }
        // acceptance is Σ min(p, q) = 0.1 + 0.25 = 0.35
        let acc = kept as f64 / n as f64;
        assert!((acc - 0.35).abs() < 0.005, "{acc}");
        // a draft outside p is never kept
        assert!(!s.keep_or_resample(&p, 4, &q).1);
    }

    #[test]
    fn bad_params_are_refused() {
        assert!(Sampler::new(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        })
        .is_err());
    }
}

#[cfg(test)]
mod shaping_tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_of_the_model_logits() {
        let logits = [1.0f32, 3.0, 3.0, f32::NEG_INFINITY, 0.5];
        let lp = logprob_of(&logits, 4, 3);
        let z: f64 = [1.0f64, 3.0, 3.0, 0.5].iter().map(|v| v.exp()).sum();
        assert!((f64::from(lp.logprob) - (0.5 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 2, 0]);
        assert_eq!(lp.top[0].1, lp.top[1].1);
        assert_eq!(logprob_of(&logits, 3, 0).logprob, f32::NEG_INFINITY);
        assert!(logprob_of(&logits, 3, 0).top.is_empty());
    }

    #[test]
    fn penalties_and_bias_shape_a_copy() {
        let mut l = vec![2.0f32, -1.0, 0.0, 1.0];
        let counts = BTreeMap::from([(0, 2), (1, 1)]);
        let s = Shaping {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            repetition_penalty: Some(2.0),
            logit_bias: vec![(3, -100.0)],
            logprobs: None,
            constraint: None,
        };
        s.apply(&mut l, &counts, &[2]);
        // 2 - 1 - 0.25 = 0.75, then / 2; -1 - 0.5 - 0.25 = -1.75, then * 2; 0 * 2; 1 - 100
        assert_eq!(l, vec![0.375, -3.5, 0.0, -99.0]);
        assert!(s.validate(4).is_ok());
        assert!(s.validate(3).is_err());
        assert!(Shaping {
            frequency_penalty: 3.0,
            ..Default::default()
        }
        .validate(4)
        .is_err());
        assert!(Shaping {
            logprobs: Some(21),
            ..Default::default()
        }
        .validate(4)
        .is_err());
        assert!(Shaping::default().is_off());
    }

    #[test]
    fn a_penalised_greedy_decoding_moves_off_a_repeated_token() {
        use crate::generate::{Decoding, Flow, GenerateOptions, Next};
        let opts = GenerateOptions {
            max_tokens: 3,
            sampling: SamplingParams::default(),
            eos_ids: vec![],
            min_tokens: 0,
        };
        let logits = Next::Logits(vec![1.0, 0.0, -0.5]);
        let run = |shaping: &Shaping| {
            let mut d = Decoding::shaped(&opts, shaping, &[]).unwrap();
            while d.accept(&logits, &mut |_| Flow::Continue).is_some() {}
            (d.new_ids().to_vec(), d.take_logprobs())
        };
        assert_eq!(run(&Shaping::default()).0, [0, 0, 0]);
        let s = Shaping {
            presence_penalty: 2.0,
            logprobs: Some(1),
            ..Default::default()
        };
        let (ids, lps) = run(&s);
        // 0 (1.0), then 1 (0.0 beats 1.0 - 2), then 2 (-0.5 beats -1 and -2)
        assert_eq!(ids, [0, 1, 2]);
        // log-probabilities are of the model's logits, not the penalised ones
        let want = logprob_of(&[1.0, 0.0, -0.5], 1, 1);
        assert_eq!(lps.len(), 3);
        assert_eq!(lps[1], want);
        assert!(!Decoding::shaped(&opts, &s, &[]).unwrap().greedy());
    }
}
