//! What `loip serve` and `loip api` add around a cluster's backend: the `--connect-retry`
//! flag's parser, the watcher that re-admits a worker that comes back, the plan as printed
//! at start, and `--preview` (the plan without loading).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use loip_plan::{units, Plan};
use loip_runtime::cluster_run::{DeviceReport, Session};
use loip_server::Backend;

use crate::backend;

/// `--connect-retry`: a duration such as `30s`, `500ms` or `0` (seconds).
pub fn parse_retry(s: &str) -> Result<Duration, String> {
    let secs = loip_plan::parse_duration(s).map_err(|e| e.to_string())?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s}: {e}"))
}

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

/// Prints what setup found per device (budget, link, probe, slices) and the plan table
/// (stderr).
pub fn print_plan(reports: &[DeviceReport], plan: &Plan) {
    for r in reports {
        let link = r
            .link
            .map(|l| {
                format!(
                    "latency {:.3} ms, up {}, down {}",
                    l.latency_s * 1e3,
                    units::format_bandwidth(l.up_bps),
                    units::format_bandwidth(l.down_bps)
                )
            })
            .unwrap_or_default();
        let probe = r
            .probe
            .as_ref()
            .map(|p| {
                format!(
                    "; t^A(1,{}) {:.3} ms, t^P {:.3} ms, load {}",
                    p.attn.first().map_or(0, |a| a.0),
                    p.attn.first().map_or(0.0, |a| a.1) * 1e3,
                    p.mlp_s * 1e3,
                    units::format_bandwidth(p.direct.bandwidth)
                )
            })
            .unwrap_or_default();
        eprintln!(
            "device {} ({}): budget {}, {link}{probe}; slices sent {} ({}), reused {}",
            r.endpoint.name,
            r.endpoint.addr,
            units::format_bytes(r.mem_budget),
            r.shipped.sent.len(),
            units::format_bytes(r.shipped.sent_bytes),
            r.shipped.reused
        );
    }
    eprint!("{}", loip_plan::render::plan_table(plan));
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
    print_plan(&p.reports, &p.plan);
    if let Some(out) = &how.cluster.plan_out {
        std::fs::write(out, p.plan.to_json())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    eprintln!("preview only: nothing loaded (drop --preview to run this plan)");
    Ok(())
}
