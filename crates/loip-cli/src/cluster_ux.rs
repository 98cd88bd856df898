//! What `loip serve` and `loip api` add around a cluster's backend: the `--connect-retry`
//! flag's parser, and the watcher that re-admits a worker that comes back.

use std::time::Duration;

use loip_server::Backend;

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
