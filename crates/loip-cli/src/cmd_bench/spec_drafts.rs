//! What both halves of `loip bench speculate` share (one machine in `spec`, `loip local` in
//! `spec_local`): which drafts a run verifies, the drafter that makes them, and a timed run.

use loip_engine::speculate::lookup::Lookup;
use loip_engine::speculate::{Drafter, SpecStats};
use loip_engine::EngineError;

/// Which drafts a speculative run verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Drafts {
    /// prompt lookup's
    Lookup,
    /// prompt lookup's made wrong (each id + 1): the cost of speculation when every draft is
    /// rejected, i.e. of the adaptive fallback to k = 0
    Wrong,
    /// none, though lookup searches every step: the cost of the loop where lookup never hits
    Silent,
}

impl Drafts {
    /// What the prompt's name gets in the table.
    pub(super) fn suffix(self) -> &'static str {
        match self {
            Drafts::Lookup => "",
            Drafts::Wrong => ", drafts made wrong",
            Drafts::Silent => ", no drafts",
        }
    }
}

/// The drafter of [`Drafts`] for a model of `.1` tokens.
pub(super) struct BenchDrafter(pub(super) Drafts, pub(super) u32);

impl Drafter for BenchDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, EngineError> {
        let d = Lookup::default().draft(context, k);
        Ok(match self.0 {
            Drafts::Lookup => d,
            Drafts::Wrong => d.into_iter().map(|t| (t + 1) % self.1.max(1)).collect(),
            Drafts::Silent => Vec::new(),
        })
    }
}

/// One timed run.
pub(super) struct Run {
    pub(super) ids: Vec<u32>,
    pub(super) ms_per_token: f64,
    pub(super) stats: SpecStats,
}
