//! What a request asks of speculative decoding and what it did: the draft source, the
//! options, the counts. Below both the speculative loop and the batched backends.

use super::adapt::AdaptiveK;

/// Where draft tokens come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Speculate {
    /// no speculation: one position per step
    #[default]
    Off,
    /// prompt lookup: n-gram matches in the prompt and the generated text
    Lookup,
    /// a draft model with the same tokenizer ([`ModelDrafter`](super::draft::ModelDrafter))
    Draft,
}

impl std::str::FromStr for Speculate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" | "none" => Ok(Speculate::Off),
            "lookup" => Ok(Speculate::Lookup),
            "draft" => Ok(Speculate::Draft),
            _ => Err(format!(
                "unknown speculation {s:?}; expected lookup, draft or off"
            )),
        }
    }
}

/// How a request speculates.
#[derive(Debug, Clone)]
pub struct SpecOptions {
    /// most drafts verified in one step // tokens
    pub k_max: usize,
    /// adapt `k` per step from the acceptance rate and step costs ([`AdaptiveK`](super::adapt::AdaptiveK)); else
    /// always verify as many drafts as the drafter proposes, up to `k_max`
    pub adaptive: bool,
    /// the adaptive controller's prior cost of one more position in a step, relative to a
    /// step of one (replaced by measured step times as they come)
    pub prior_per_row: f64,
    /// the adaptive controller's prior step times by size when the caller knows them:
    /// `step_prior[n - 1]` for a step of `n` positions of one sequence (the cost model's
    /// `loip_plan::speculate::verify_step_times` of a cluster's plan, shifted by one); empty: the
    /// slope `prior_per_row`  // seconds
    pub step_prior: Vec<f64>,
}

impl SpecOptions {
    /// The draft-length controller these options ask for: adaptive from the priors, or
    /// always `k_max`.
    pub fn controller(&self) -> AdaptiveK {
        if self.adaptive {
            AdaptiveK::with_table(self.k_max, self.prior_per_row, &self.step_prior)
        } else {
            AdaptiveK::fixed(self.k_max)
        }
    }
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions {
            k_max: 8,
            adaptive: true,
            prior_per_row: 0.15,
            step_prior: Vec::new(),
        }
    }
}

/// What speculation did over a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SpecStats {
    /// forward steps after the prompt
    pub steps: usize,
    /// draft tokens verified
    pub drafted: usize,
    /// draft tokens accepted
    pub accepted: usize,
    /// steps that verified at least one draft
    pub draft_steps: usize,
}

impl SpecStats {
    /// Accepted over drafted (0 when nothing was drafted).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}
