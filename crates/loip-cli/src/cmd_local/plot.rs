//! `loip local --plot FILE`: memory per device over the run, drawn from the runtime's
//! adaptation report (one sample per device per step, the threshold switches and lending
//! changes it decided) with the simulator's figure code ([`loip_sim::plot::memory_panels`]),
//! so runtime and simulator plots read the same. SVG when FILE ends in `.svg`, else PNG.

use std::path::Path;

use anyhow::{bail, Context, Result};
use loip_runtime::adapt::AdaptReport;
use loip_sim::plot::{device_charts, memory_panels};

/// Draws `report` into `path`, every panel headed by `title`.
pub fn write(path: &Path, report: &AdaptReport, title: &str) -> Result<()> {
    if report.memory.iter().all(|m| m.is_empty()) {
        bail!("--plot: the run recorded no memory samples");
    }
    let names: Vec<String> = report.devices.iter().map(|d| d.name.clone()).collect();
    let budgets: Vec<u64> = report.devices.iter().map(|d| d.budget).collect();
    let charts = device_charts(title, &names, &budgets, &report.memory, &report.events);
    memory_panels(path, &charts).with_context(|| format!("--plot {}", path.display()))?;
    Ok(())
}
