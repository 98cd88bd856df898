//! `loip local --bench`: the benchmark matrix's rows as they end, as JSON and as a table.

use std::path::Path;

use anyhow::{Context, Result};
use loip::local::{scratch_size, BenchRow};
use loip_plan::units::format_bytes;

use super::LocalArgs;

/// `--bench`'s budgets against the model's size (stderr).
pub(super) fn show_budgets(budgets: &[u64], model: u64) {
    let total: u64 = budgets.iter().sum();
    eprintln!(
        "budgets: {} (together {}, {:.0}% of the model's {})",
        budgets
            .iter()
            .map(|&b| format_bytes(b))
            .collect::<Vec<_>>()
            .join(", "),
        format_bytes(total),
        100.0 * total as f64 / model.max(1) as f64,
        format_bytes(model)
    );
}

/// A line per row as it ends (stderr).
pub(super) fn show_row(row: &BenchRow) {
    eprintln!(
        "{:>9} {:>10} {:>11}: measured {:>9} predicted {:>9} {}",
        row.pattern,
        row.bandwidth,
        row.planner,
        row.measured_ms.map_or("-".into(), |v| format!("{v:.1} ms")),
        row.predicted_ms
            .map_or("-".into(), |v| format!("{v:.1} ms")),
        row.error
            .as_deref()
            .map(|e| format!("({e})"))
            .unwrap_or_default()
    );
}

/// The rows to `--bench FILE` as JSON, where the stores were kept, and a table.
pub(super) fn finish(a: &LocalArgs, rows: &[BenchRow], store_root: &Path) -> Result<()> {
    if let Some(out) = &a.bench {
        std::fs::write(out, serde_json::to_string_pretty(rows)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    eprintln!(
        "worker stores kept for later runs in {} ({}); remove it with `rm -rf {}`",
        store_root.display(),
        scratch_size(store_root),
        store_root.display()
    );
    print_bench_table(rows);
    Ok(())
}

fn print_bench_table(rows: &[BenchRow]) {
    println!("| pattern | link | planner | devices×stages | measured ms/token | predicted ms/token | measured/predicted | network ms (logits) | load stall ms (pred.) | error |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    for r in rows {
        let ratio = match (r.measured_ms, r.predicted_ms) {
            (Some(m), Some(p)) if p > 0.0 => format!("{:.2}", m / p),
            _ => "-".into(),
        };
        let devs = match (&r.plan_devices, r.stages_per_device) {
            (Some(d), Some(s)) => format!("{}×{s}", d.len()),
            _ => "-".into(),
        };
        println!(
            "| {} | {} | {} | {devs} | {} | {} | {ratio} | {} ({}) | {} ({}) | {} |",
            r.pattern,
            r.bandwidth,
            r.planner,
            f(r.measured_ms),
            f(r.predicted_ms),
            f(r.breakdown.map(|b| b.network_ms)),
            f(r.logits_ms),
            f(r.breakdown.map(|b| b.load_stall_ms)),
            f(r.predicted_breakdown.map(|b| b.uncovered_load_ms)),
            r.error.as_deref().unwrap_or("")
        );
    }
}
