//! Text rendering of plans and planner comparisons (pure: returns `String`).

use crate::error::PlanError;
use crate::plan::{Plan, Residency, StagePlan};
use crate::units::format_bytes;
use std::fmt::Write;

/// Compact description of a stage's layers: `0-9` plus offloaded blocks, e.g.
/// `20-39 (off: A38-39 P37-39)`.
pub fn stage_summary(stage: &StagePlan) -> String {
    let r = stage.layer_range();
    let mut s = if r.end == r.start + 1 {
        format!("{}", r.start)
    } else {
        format!("{}-{}", r.start, r.end - 1)
    };
    let ranges = |pick: fn(&crate::plan::LayerPlan) -> Residency| -> String {
        let idx: Vec<u32> = stage
            .layers
            .iter()
            .filter(|l| pick(l).is_offloaded())
            .map(|l| l.layer)
            .collect();
        let mut parts = Vec::new();
        let mut i = 0;
        while i < idx.len() {
            let mut j = i;
            while j + 1 < idx.len() && idx[j + 1] == idx[j] + 1 {
                j += 1;
            }
            parts.push(if i == j {
                format!("{}", idx[i])
            } else {
                format!("{}-{}", idx[i], idx[j])
            });
            i = j + 1;
        }
        parts.join(",")
    };
    let a = ranges(|l| l.attn);
    let m = ranges(|l| l.mlp);
    if !a.is_empty() || !m.is_empty() {
        s.push_str(" (off:");
        if !a.is_empty() {
            let _ = write!(s, " A{a}");
        }
        if !m.is_empty() {
            let _ = write!(s, " P{m}");
        }
        s.push(')');
    }
    s
}

/// Human-readable table of a plan: one block per device, then the prediction.
pub fn plan_table(plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "plan `{}` for {}: {} stage(s)/device, {} context {} tokens, b = {}, {:?} loads, {:?} loader",
        plan.planner, plan.shape, plan.stages_per_device, plan.pattern, plan.context, plan.micro_batches, plan.mode, plan.loader
    );
    let _ = writeln!(
        out,
        "{:<18} {:>6} {:>9} {:>9} {:>22} {:>9} {:>9} {:>9}  stages",
        "device", "layers", "resident", "offload", "memory / budget", "compute", "load", "stall"
    );
    for d in &plan.devices {
        let (mut res, mut off) = (0u32, 0u32);
        for l in d.stages.iter().flat_map(|s| &s.layers) {
            for r in [l.attn, l.mlp] {
                if r.is_offloaded() {
                    off += 1;
                } else {
                    res += 1;
                }
            }
        }
        let mut name = d.name.clone();
        if d.holds_embedding {
            name.push_str(" [E]");
        }
        if d.holds_head {
            name.push_str(" [H]");
        }
        let mem = format!(
            "{} / {}",
            format_bytes(d.memory_bytes),
            format_bytes(d.budget_bytes)
        );
        let stages: Vec<String> = d.stages.iter().map(stage_summary).collect();
        let _ = writeln!(
            out,
            "{:<18} {:>6} {:>9} {:>9} {:>22} {:>7.1}ms {:>7.1}ms {:>7.1}ms  {}",
            name,
            d.layer_count(),
            res,
            off,
            mem,
            d.compute_ms,
            d.load_ms,
            d.stall_ms,
            stages.join(" | ")
        );
    }
    for d in &plan.dropped {
        let _ = writeln!(out, "dropped {}: {}", d.name, d.reason);
    }
    let b = &plan.breakdown;
    let _ = writeln!(
        out,
        "predicted {:.1} ms/token = compute {:.1} + communication {:.1} + uncovered load {:.1}  (resident/offload count blocks; [E] embedding, [H] head)",
        plan.predicted_ms_per_token, b.compute_ms, b.comm_ms, b.uncovered_load_ms
    );
    out
}

/// Side-by-side predictions of several planners; failures show `OOM` (model does not fit)
/// or `error`.
pub fn compare_table(results: &[(String, Result<Plan, PlanError>)]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:>10} {:>9} {:>9} {:>9} {:>7} {:>8}  note",
        "planner", "ms/token", "compute", "comm", "uncov", "stages", "devices"
    );
    let best = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok().map(|p| p.predicted_ms_per_token))
        .fold(f64::INFINITY, f64::min);
    for (name, r) in results {
        match r {
            Ok(p) => {
                let b = &p.breakdown;
                let note = if p.predicted_ms_per_token <= best {
                    "best".to_string()
                } else {
                    format!("{:.2}x", p.predicted_ms_per_token / best)
                };
                let _ = writeln!(
                    out,
                    "{:<24} {:>10.1} {:>9.1} {:>9.1} {:>9.1} {:>7} {:>8}  {}",
                    name,
                    p.predicted_ms_per_token,
                    b.compute_ms,
                    b.comm_ms,
                    b.uncovered_load_ms,
                    p.stages_per_device,
                    p.devices.len(),
                    note
                );
            }
            Err(PlanError::DoesNotFit {
                device,
                lacks_bytes,
                ..
            }) => {
                let _ = writeln!(
                    out,
                    "{:<24} {:>10}  {} lacks {}",
                    name,
                    "OOM",
                    device,
                    format_bytes(*lacks_bytes)
                );
            }
            Err(e) => {
                let _ = writeln!(out, "{:<24} {:>10}  {}", name, "error", e);
            }
        }
    }
    out
}

/// The price of speculative decoding for `k = 0, 1, …` drafts per step (rows of
/// [`crate::speculate::price_ks`]), the cheapest marked.
pub fn speculation_table(ks: &[crate::speculate::SpecCost], best: usize) -> String {
    let mut s = String::new();
    let alpha = ks.first().map_or(0.0, |c| c.acceptance);
    let _ = writeln!(
        s,
        "speculative decoding at acceptance {alpha:.2} (k drafts, k + 1 positions per step):\n"
    );
    let _ = writeln!(
        s,
        "| k | step ms (k + 1 positions) | tokens per step | ms/token | vs k = 0 |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---:|---:|");
    let plain = ks.first().map_or(f64::NAN, |c| c.cost.ms_per_token);
    for (i, c) in ks.iter().enumerate() {
        let _ = writeln!(
            s,
            "| {}{} | {:.2} | {:.2} | {:.2} | {:.2}× |",
            c.k,
            if i == best { " (best)" } else { "" },
            c.step_ms,
            c.expected_tokens,
            c.cost.ms_per_token,
            c.cost.ms_per_token / plain
        );
    }
    s
}
