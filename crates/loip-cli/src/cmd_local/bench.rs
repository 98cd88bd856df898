//! `loip local --bench`: the benchmark matrix's rows as they end, as JSON and as a table.

use std::path::Path;

use anyhow::{Context, Result};
use loip::local::{bench_store_root, scratch_size, BenchMatrix, BenchRow, LocalOptions};
use loip_model::slice::Manifest;

use super::LocalArgs;

/// `--bench`: the matrix, a line per row as it ends, the rows to `out` as JSON, and a table.
pub(super) fn bench(
    a: &LocalArgs,
    o: &LocalOptions,
    dir: &Path,
    out: &Path,
    budgets: &[u64],
    prompt: &[u32],
    gen: &loip_engine::GenerateOptions,
) -> Result<()> {
    let total: u64 = budgets.iter().sum();
    let model: u64 = Manifest::load(dir)?.slices.iter().map(|s| s.size).sum();
    eprintln!(
        "budgets: {} (together {}, {:.0}% of the model's {})",
        budgets
            .iter()
            .map(|&b| loip_plan::units::format_bytes(b))
            .collect::<Vec<_>>()
            .join(", "),
        loip_plan::units::format_bytes(total),
        100.0 * total as f64 / model.max(1) as f64,
        loip_plan::units::format_bytes(model)
    );
    let matrix = BenchMatrix {
        bandwidths: a.bench_bandwidths.clone(),
        patterns: a.bench_patterns.clone(),
        planners: a.bench_planners.clone(),
    };
    let rows = loip::local::bench(dir, o, budgets, &matrix, prompt, gen, &mut |row| {
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
    })?;
    std::fs::write(out, serde_json::to_string_pretty(&rows)?)
        .with_context(|| format!("writing {}", out.display()))?;
    let store_root = bench_store_root(o);
    eprintln!(
        "worker stores kept for later runs in {} ({}); remove it with `rm -rf {}`",
        store_root.display(),
        scratch_size(&store_root),
        store_root.display()
    );
    print_bench_table(&rows);
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
