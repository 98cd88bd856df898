//! What `loip serve` and `loip api` add around a cluster's backend: the watcher that
//! re-admits a worker that comes back, and `--preview` (the plan without loading).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use loip_runtime::cluster_run::Session;
use loip_server::Backend;

use crate::backend;

/// How often the rejoin watcher looks for missing workers.
const REJOIN_EVERY: Duration = Duration::from_secs(2);

/// On a cluster: watch for workers that left (unreachable at start, or gone) and answer
/// again, re-plan with them and log it (`loip: w2 answers again; re-planned over w1, w2`).
/// The watcher ends with the backend.
pub fn watch_rejoin(backend: &Backend) {
    let Some(s) = backend.session() else { return };
    let said = loip_runtime::cluster_run::watch_rejoin(
        std::sync::Arc::downgrade(s),
        REJOIN_EVERY,
        |line| eprintln!("loip: {line}"),
    );
    if let Err(e) = said {
        eprintln!("warning: workers that come back will not rejoin: {e}");
    }
}

/// `--preview`: connects to the cluster's workers, measures, profiles and plans as a real
/// start does, prints the plan (per device: stages, resident and offloaded blocks, memory
/// against budget, predicted compute/load/stall, and ms/token with its breakdown), says
/// goodbye to the workers and stops: nothing is shipped (but layer 0 to a device that is
/// profiled) or loaded. `--plan-out` still writes the plan.
pub fn preview(dir: &Path, how: &backend::How<'_>) -> Result<()> {
    let placement = backend::placement(how.offload, how.cluster, true)?;
    let loip::backend::Placement::Cluster(c) = &placement else {
        anyhow::bail!("--preview needs --cluster FILE");
    };
    let (workers, opts) = loip::backend::session_options(c, &backend::cluster_start(how))?;
    let p = Session::preview(dir, &workers, &opts)?;
    backend::print_plan(&p.reports, &p.plan);
    if let Some(out) = &how.cluster.plan_out {
        std::fs::write(out, p.plan.to_json())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    eprintln!("preview only: nothing loaded (drop --preview to run this plan)");
    Ok(())
}
