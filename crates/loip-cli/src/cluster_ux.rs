//! What `loip serve` and `loip api` add around a cluster's backend: `--discover` (the paired
//! workers that answer on the LAN become the cluster), the watcher that re-admits a worker
//! that comes back, and `--preview` (the plan without loading).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use loip_runtime::cluster_run::Session;
use loip_server::Backend;

use crate::backend::{self, ClusterArgs};
use loip_runtime::net::discovery::{self, Found};
use loip_runtime::net::pairing;

/// The paired devices' pinned keys, in the coordinator's directory.
pub const KNOWN: &str = "known_devices";
/// The cluster file `--discover` writes in the coordinator's directory.
const DISCOVERED: &str = "discovered.toml";
/// How long `--discover` listens for workers.
const DISCOVER_WAIT: Duration = Duration::from_secs(3);
/// How long `--discover` waits for each of a device's addresses to accept a connection.
const ADDR_WAIT: Duration = Duration::from_millis(1500);
/// Most devices a browse keeps.
const MAX_DEVICES: usize = 64;

/// What answered on the LAN, and which of it this coordinator paired.
pub struct Lan {
    /// the devices, by name
    pub found: Vec<Found>,
    /// paired key → the name it was paired under
    pub pins: std::collections::HashMap<[u8; 32], String>,
}

impl Lan {
    /// Listens for `wait`; answers that are not a loip worker's are logged and left out.
    pub fn browse(wait: Duration) -> Result<Lan> {
        let dir = pairing::config_dir()?;
        let pins = pairing::pinned_keys(&dir.join(KNOWN))?;
        let found = discovery::browse(wait, MAX_DEVICES, |who, why| {
            eprintln!("ignored an answer from {who}: {why}")
        })?;
        Ok(Lan { found, pins })
    }

    /// Whether `f` is paired here and speaks this protocol (it may be used).
    pub fn usable(&self, f: &Found) -> bool {
        self.pins.contains_key(&f.key) && f.version == loip_runtime::wire::PROTOCOL_VERSION
    }

    fn state(&self, f: &Found) -> String {
        if f.version != loip_runtime::wire::PROTOCOL_VERSION {
            return format!(
                "protocol v{} (this loip speaks v{}): not used",
                f.version,
                loip_runtime::wire::PROTOCOL_VERSION
            );
        }
        match (self.pins.get(&f.key), f.pair_port) {
            (Some(n), _) if *n == f.name => "paired".into(),
            (Some(n), _) => format!("paired (as {n})"),
            (None, Some(_)) => format!(
                "not paired: takes a code (`loip pair CODE --device {}`)",
                f.name
            ),
            (None, None) => "not paired: never used".into(),
        }
    }

    /// A table of the devices (one line each, a header first).
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<20} {:<24} {:>10} {:<17} state\n",
            "device", "address", "budget", "key"
        );
        for f in &self.found {
            let mem = f.mem.map_or("?".into(), loip_plan::units::format_bytes);
            out += &format!(
                "{:<20} {:<24} {:>10} {:<17} {}\n",
                f.name,
                f.session_addr().unwrap_or_default(),
                mem,
                f.short_key(),
                self.state(f)
            );
        }
        out
    }
}

/// `--discover` (without `--cluster`): listens for workers, prints them, and makes the
/// paired ones that answer the cluster (a cluster file in the coordinator's directory, with
/// its token unless one is given). A cluster file given wins.
pub fn discover(c: &mut ClusterArgs) -> Result<()> {
    if !c.discover {
        return Ok(());
    }
    if let Some(f) = &c.cluster {
        eprintln!("--discover: using the cluster file {} given", f.display());
        return Ok(());
    }
    let dir = pairing::config_dir()?;
    eprintln!(
        "looking for workers on the LAN for {:.0} s…",
        DISCOVER_WAIT.as_secs_f64()
    );
    let lan = Lan::browse(DISCOVER_WAIT)?;
    eprint!("{}", lan.table());
    let mut file =
        String::from("# written by `loip --discover`: the paired workers that answered\n");
    for f in lan.found.iter().filter(|f| lan.usable(f)) {
        let Some(name) = lan.pins.get(&f.key) else {
            continue;
        };
        let Some(addr) = f.answering_session_addr(ADDR_WAIT) else {
            eprintln!(
                "--discover: {name} answers on none of its addresses ({}); left out",
                f.addrs
                    .iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            continue;
        };
        file += &format!("\n[[device]]\nname = \"{name}\"\naddr = \"{addr}\"\n");
    }
    if !file.contains("[[device]]") {
        anyhow::bail!(
            "--discover: no paired worker answered in {:.0} s ({} found). Pair each with \
             `loip pair CODE` (the code a worker prints at start); `loip devices` lists what \
             answers",
            DISCOVER_WAIT.as_secs_f64(),
            lan.found.len()
        );
    }
    let path = dir.join(DISCOVERED);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(&path, file).with_context(|| format!("writing {}", path.display()))?;
    c.cluster = Some(path);
    if c.token_file.is_none() && c.token.is_none() {
        c.token_file = Some(dir.join(loip_runtime::net::token::STORE_TOKEN));
    }
    Ok(())
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
    let (workers, opts) = loip::backend::session_options(c, &how.sizes)?;
    let p = Session::preview(dir, &workers, &opts)?;
    backend::print_plan(&p.reports, &p.plan);
    if let Some(out) = &how.cluster.plan_out {
        std::fs::write(out, p.plan.to_json())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    eprintln!("preview only: nothing loaded (drop --preview to run this plan)");
    Ok(())
}
