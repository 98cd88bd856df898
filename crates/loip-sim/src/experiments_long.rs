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
//!
//! `reserve-sweep` (part of `all`) reserves the same memory on every device of the paper's
//! 70B clusters, from nothing up to [`RESERVE_STEPS_GB`]'s last step, to show where each
//! method goes OOM: the paper's reservations (ii) and (iii) are points of the same axis.

use crate::bandwidth::Bandwidth;
use crate::error::SimError;
use crate::methods::Method;
use crate::setups::{
    end_to_end_setups, mem_constrained_setups, sweep_base_setups, sweep_setups, Experiment,
};
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

/// Memory reserved on every device at the points of `reserve-sweep`.  // GB (10^9 bytes)
pub const RESERVE_STEPS_GB: [f64; 9] = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];

/// `reserve-sweep`: the 70B clusters of the memory-constrained (`70b-5dev`, no reservation
/// of its own) and end-to-end (`70b-4dev`) experiments with [`RESERVE_STEPS_GB`] reserved
/// on every device, named `SETUP+NGB`.
pub(crate) fn reserve_sweep() -> Experiment {
    let mut bases = mem_constrained_setups();
    bases.truncate(1);
    bases[0].name = "70b-5dev".into();
    bases.extend(
        end_to_end_setups()
            .into_iter()
            .filter(|s| s.name == "70b-4dev"),
    );
    let mut setups = Vec::new();
    for base in &bases {
        for gb in RESERVE_STEPS_GB {
            let mut s = base.clone();
            s.name = format!("{}+{gb:.0}GB", base.name);
            for d in &mut s.devices {
                d.reserve += (gb * 1e9) as u64;
            }
            setups.push(s);
        }
    }
    Experiment {
        name: "reserve-sweep".into(),
        title: "Reserve sweep: LLaMA-3.3-70B on Orin64 + 3×Orin32 + NX16 and on 2×Orin64 + Orin32 + NX16 with 0–8 GB reserved on every device: where each method goes OOM".into(),
        setups,
        methods: Method::MAIN.to_vec(),
        bandwidths: vec![Bandwidth::Mbps(100.0)],
        patterns: vec![Pattern::Sporadic, Pattern::Bursty],
        lengths: None,
        outputs: Vec::new(),
        sequence_factors: Vec::new(),
    }
}
