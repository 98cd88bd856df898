//! Link bandwidth over a run: constant, or changing at random token intervals (design §10:
//! "new bandwidth uniformly in 50–250 Mbit/s at random token intervals").
//!
//! A trace is indexed by decoding step (one token per sequence), so every method of an
//! experiment sees the same bandwidth for its `t`-th token. It is drawn from a ChaCha8 RNG
//! seeded by the caller: the same seed gives the same trace.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Mbit/s → bytes/s.
pub fn mbps_to_bytes(mbps: f64) -> f64 {
    mbps * 1e6 / 8.0
}

/// How the bandwidth of an experiment behaves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Bandwidth {
    /// A fixed bandwidth.  // Mbit/s
    Mbps(f64),
    /// Random: a new value uniform in `[min_mbps, max_mbps]` every `min_interval..=max_interval`
    /// tokens (uniform).
    Dynamic {
        /// Lowest value.  // Mbit/s
        min_mbps: f64,
        /// Highest value.  // Mbit/s
        max_mbps: f64,
        /// Shortest interval.  // tokens
        min_interval: u32,
        /// Longest interval.  // tokens
        max_interval: u32,
    },
}

impl Bandwidth {
    /// The paper's dynamic setting: 50–250 Mbit/s, a change every 4–32 tokens.
    pub const PAPER_DYNAMIC: Bandwidth = Bandwidth::Dynamic {
        min_mbps: 50.0,
        max_mbps: 250.0,
        min_interval: 4,
        max_interval: 32,
    };

    /// `Some(Mbit/s)` for a fixed bandwidth, `None` for a dynamic one.
    pub fn fixed_mbps(&self) -> Option<f64> {
        match self {
            Bandwidth::Mbps(m) => Some(*m),
            Bandwidth::Dynamic { .. } => None,
        }
    }

    /// Short label: `100` or `dynamic`.
    pub fn label(&self) -> String {
        match self {
            Bandwidth::Mbps(m) => format!("{m:.0}"),
            Bandwidth::Dynamic { .. } => "dynamic".to_string(),
        }
    }

    /// The trace for `steps` decoding steps, drawn with `seed`.
    pub fn trace(&self, steps: u32, seed: u64) -> BandwidthTrace {
        match *self {
            Bandwidth::Mbps(m) => BandwidthTrace {
                changes: vec![(0, mbps_to_bytes(m))],
            },
            Bandwidth::Dynamic {
                min_mbps,
                max_mbps,
                min_interval,
                max_interval,
            } => {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let (lo, hi) = (min_interval.max(1), max_interval.max(min_interval.max(1)));
                let mut changes = Vec::new();
                let mut step = 0u32;
                while step < steps.max(1) {
                    let mbps = rng.gen_range(min_mbps..=max_mbps.max(min_mbps));
                    changes.push((step, mbps_to_bytes(mbps)));
                    step += rng.gen_range(lo..=hi);
                }
                BandwidthTrace { changes }
            }
        }
    }
}

/// Piecewise-constant bandwidth by decoding step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BandwidthTrace {
    /// `(first step, bandwidth)` in increasing step order; the first starts at step 0.  // bytes/s
    pub changes: Vec<(u32, f64)>,
}

impl BandwidthTrace {
    /// A constant trace.  // bytes/s
    pub fn constant(bytes_per_s: f64) -> BandwidthTrace {
        BandwidthTrace {
            changes: vec![(0, bytes_per_s)],
        }
    }

    /// Bandwidth during decoding step `step`.  // bytes/s
    pub fn at(&self, step: u32) -> f64 {
        let i = self
            .changes
            .partition_point(|c| c.0 <= step)
            .saturating_sub(1);
        self.changes.get(i).map(|c| c.1).unwrap_or(1.0)
    }

    /// Mean over `steps` steps (by step, not by time).  // bytes/s
    pub fn mean(&self, steps: u32) -> f64 {
        let steps = steps.max(1);
        (0..steps).map(|t| self.at(t)).sum::<f64>() / steps as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_is_seeded_and_in_range() {
        let a = Bandwidth::PAPER_DYNAMIC.trace(500, 7);
        assert_eq!(a, Bandwidth::PAPER_DYNAMIC.trace(500, 7));
        assert_ne!(a, Bandwidth::PAPER_DYNAMIC.trace(500, 8));
        for t in 0..500 {
            let mbps = a.at(t) * 8.0 / 1e6;
            assert!((50.0..=250.0).contains(&mbps));
        }
        assert!(a.changes.len() > 500 / 32);
        assert_eq!(Bandwidth::Mbps(100.0).trace(10, 1).at(9), 12.5e6);
    }
}
