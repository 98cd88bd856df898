//! Token sampling: greedy, temperature, top-k, top-p, seeded.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

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

/// Index of the largest value; the lowest index wins ties; NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
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
        let p = &self.params;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, v / p.temperature))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 - max) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|q| *q /= total);
        }
        let r: f64 = self.rng.gen();
        let mut acc = 0.0;
        for (i, q) in probs.iter().enumerate() {
            acc += q;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[probs.len() - 1].0
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
