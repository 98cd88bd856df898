//! Long-context experiments where the online adaptation (design §6) runs at paper scale.
//!
//! In the experiments of [`crate::experiments`] LOIP's placement for the whole run fits, so no
//! threshold is reached and `loip-no-kvtransfer` equals `loip`. Here every device's budget is
//! scaled so the total is [`ADAPT_RATIOS`] × the weight bytes (as in the memory sweep) and a
//! sporadic request holds 4096 prompt tokens and decodes 1024: the whole run no longer fits,
//! LOIP places the prompt's KV and adapts as it grows — threshold switches offload blocks,
//! KV lending moves KV to the peer with the most spare memory at the link's pace (Eq. 8), so
//! faster links lend more.
//!
//! | experiment | setups | methods | bandwidth (Mbit/s) |
//! |---|---|---|---|
//! | `long-context-adapt` | 70B on Orin64 + 3×Orin32 + NX16 at 0.80× and 0.85× the weight bytes, 4096 + 1024 tokens | `loip`, `loip-no-kvtransfer`, `loip-recompute` (eviction and recomputation only), `pp-offload` | 100, 200, 500, 1000 |
//!
//! It runs by name only: `all` keeps the experiments whose outputs earlier versions
//! produced, byte for byte.

use crate::bandwidth::Bandwidth;
use crate::error::SimError;
use crate::experiments::{sweep_base_setups, sweep_setups, Experiment};
use crate::methods::Method;
use loip_plan::Pattern;

/// Experiments run by name only (not part of `all`).
pub const LONG_EXPERIMENT_NAMES: [&str; 1] = ["long-context-adapt"];

/// Budget ratios of `long-context-adapt` (total budget / weight bytes).
pub const ADAPT_RATIOS: [f64; 2] = [0.80, 0.85];

/// The experiment called `name`, if it is one of [`LONG_EXPERIMENT_NAMES`].
pub fn long_experiment(name: &str) -> Option<Result<Experiment, SimError>> {
    match name {
        "long-context-adapt" => Some(long_context_adapt()),
        _ => None,
    }
}

fn long_context_adapt() -> Result<Experiment, SimError> {
    let five: Vec<_> = sweep_base_setups()
        .into_iter()
        .filter(|s| s.name == "70b-5dev")
        .collect();
    Ok(Experiment {
        name: "long-context-adapt".into(),
        title: "Long context with adaptation: LLaMA-3.3-70B on Orin64 + 3×Orin32 + NX16, budgets 0.80× and 0.85× the weight bytes, 4096-token prompt, 1024 tokens decoded: thresholds are crossed, KV lending follows the link".into(),
        setups: sweep_setups(&five, &ADAPT_RATIOS)?,
        methods: vec![
            Method::Loip,
            Method::LoipNoKvtransfer,
            Method::LoipRecompute,
            Method::PpOffload,
        ],
        bandwidths: [100.0, 200.0, 500.0, 1000.0]
            .into_iter()
            .map(Bandwidth::Mbps)
            .collect(),
        patterns: vec![Pattern::Sporadic],
        lengths: Some((4096, 1024)),
        outputs: Vec::new(),
        sequence_factors: Vec::new(),
    })
}
