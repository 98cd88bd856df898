//! The flags of `loip generate`, `loip serve` and `loip api` that choose where the model
//! runs (offloading, a cluster), mapped to the library's [`Placement`]; the backend itself
//! is [`loip::backend::open`]'s. Also what the commands print of a setup.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use loip::backend::{ClusterOptions, OffloadOptions, Placement};
use loip_plan::{units, Plan};
use loip_runtime::cluster_run::{Breakdown, DeviceReport, Session};
use loip_runtime::MemoryReport;

pub use loip::backend::{cluster_report, peak_rss, Opened, Sizes, Source};

/// Cluster options shared by `loip serve` and `loip generate --cluster`.
#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// Cluster file (TOML): `[[device]]` entries with `name` and `addr`, and optionally a
    /// `preset`/`profile`/inline profile and `mem` (devices without one are measured).
    #[arg(long)]
    pub cluster: Option<PathBuf>,
    /// Find the workers on the LAN for a few seconds (trying each of a device's addresses,
    /// IPv4 then IPv6), show them, and run on the paired ones that answer (`loip pair CODE`
    /// pairs a worker); a --cluster file given wins.
    #[arg(long)]
    pub discover: bool,
    /// File holding the workers' shared secret (first line; default: `$LOIP_TOKEN`).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The shared secret itself (visible to other users in `ps`: prefer --token-file or
    /// `$LOIP_TOKEN`).
    #[arg(long)]
    pub token: Option<String>,
    /// File of the devices' pinned keys (first contact records a device's key, a changed key
    /// is refused). Default: `$LOIP_KNOWN_DEVICES`, else `known_devices` beside the cluster file.
    #[arg(long, value_name = "FILE")]
    pub known_devices: Option<PathBuf>,
    /// Accept (and pin) a new key for this device, e.g. after its store was replaced
    /// (repeatable).
    #[arg(long, value_name = "DEVICE")]
    pub accept_new_key: Vec<String>,
    /// Planner: loip, loip-paper, loip-uniform, pp, pp-offload, edgeshard, …
    #[arg(long, default_value = "loip")]
    pub planner: String,
    /// Use the cluster file's `[link]` for planning instead of the measured links.
    #[arg(long)]
    pub file_link: bool,
    /// Relay every hop through the coordinator instead of handing the rows from worker to
    /// worker (for networks where workers cannot reach each other).
    #[arg(long)]
    pub relay: bool,
    /// Online adaptation may lend KV to the peer with the most spare memory when a device
    /// nears a memory threshold, fetched back before its stage runs again (off by default).
    #[arg(long)]
    pub lend: bool,
    /// Write the plan as JSON to this file.
    #[arg(long)]
    pub plan_out: Option<PathBuf>,
    /// At start, try a worker that refuses or does not answer again for this long (backoff
    /// from 0.25 s to 4 s, each try logged), then leave it out or fail naming its address.
    #[arg(long, default_value = "30s", value_parser = parse_retry)]
    pub connect_retry: std::time::Duration,
}

/// `--connect-retry`: a duration such as `30s`, `500ms` or `0` (seconds).
pub fn parse_retry(s: &str) -> Result<Duration, String> {
    let secs = loip_plan::parse_duration(s).map_err(|e| e.to_string())?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s}: {e}"))
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

/// Prints what setup found and decided (stderr).
pub fn print_setup(s: &Session) {
    print_plan(&s.reports, &s.plan);
    eprintln!("setup took {:.2} s", s.setup_s);
}

/// Prints ms/token and its breakdown (stderr).
pub fn print_breakdown(b: &Breakdown, measured_ms: f64, predicted_ms: f64) {
    eprintln!(
        "{measured_ms:.2} ms/token (plan predicted {predicted_ms:.2}): compute {:.2}, network {:.2}, load stall {:.2}, queued {:.2} ms/step",
        b.compute_ms, b.network_ms, b.load_stall_ms, b.queued_ms
    );
}

/// Memory budget and offloading options of a single device.
#[derive(Args, Debug, Clone)]
pub struct OffloadArgs {
    /// Memory budget, e.g. `300MiB`: keep what fits resident, stream the rest from slice files.
    #[arg(long)]
    pub mem: Option<String>,
    /// Which blocks to offload: auto (what the budget needs, last layers first), none, mlp,
    /// attn, all, alternate (every other layer), or plan (the `loip` planner decides; needs --mem).
    #[arg(long, default_value = "auto")]
    pub offload_blocks: loip_runtime::local::OffloadRule,
    /// Loading path for offloaded blocks: direct (io_uring, O_DIRECT, one slot) or conventional.
    #[arg(long, default_value = "direct")]
    pub loader: loip_runtime::LoaderKind,
    /// Load offloaded blocks only when needed instead of overlapping loads with compute.
    #[arg(long)]
    pub no_overlap: bool,
}

impl OffloadArgs {
    /// Whether the run goes through slice files (any offloading option set).
    pub fn sliced(&self) -> bool {
        self.mem.is_some() || self.offload_blocks != loip_runtime::local::OffloadRule::Auto
    }

    /// The library's offloading options (`--mem` parsed).
    pub fn options(&self) -> Result<OffloadOptions> {
        Ok(OffloadOptions {
            mem: self
                .mem
                .as_deref()
                .map(loip_plan::parse_bytes)
                .transpose()?,
            rule: self.offload_blocks,
            loader: self.loader,
            overlap: !self.no_overlap,
        })
    }
}

/// Where the flags put the model: a cluster when `--cluster` is given, else this machine
/// from slice files when an offloading flag is set, else in memory.
pub fn placement(offload: &OffloadArgs, cluster: &ClusterArgs, quiet: bool) -> Result<Placement> {
    if let Some(file) = &cluster.cluster {
        // a paired coordinator connects with the key its workers pinned
        if let Err(e) = loip::backend::use_paired_identity(false) {
            eprintln!("warning: this coordinator's paired key is not used: {e:#}");
        }
        return Ok(Placement::Cluster(ClusterOptions {
            file: file.clone(),
            token_file: cluster.token_file.clone(),
            token: cluster.token.clone(),
            known_devices: cluster.known_devices.clone(),
            accept_new_key: cluster.accept_new_key.clone(),
            planner: cluster.planner.clone(),
            file_link: cluster.file_link,
            relay: cluster.relay,
            lend: cluster.lend,
            plan_out: cluster.plan_out.clone(),
            connect_retry: cluster.connect_retry,
            on_ship: crate::progress::ship_bars(quiet),
        }));
    }
    if offload.sliced() {
        return Ok(Placement::Offload(offload.options()?));
    }
    Ok(Placement::Memory)
}

/// The source for `model` under the flags (a progress bar while it is split), and what
/// requests need of the model.
pub fn source(
    model: &str,
    offload: &OffloadArgs,
    cluster: &ClusterArgs,
) -> Result<(Source, loip::model::ModelInfo)> {
    let placement = placement(offload, cluster, true)?;
    if loip::backend::needs_slices(model, &placement) {
        loip::backend::check_budget(&placement)?;
        // split in a child process: what a split leaves in this process's heap would count
        // against its budget
        crate::progress::slices_for(model)?;
    }
    crate::progress::splitting(|on_split| loip::backend::source(model, &placement, on_split))
}

/// How a command serves: its placement flags and the sizes the library plans for.
pub struct How<'a> {
    /// offloading options on this machine
    pub offload: &'a OffloadArgs,
    /// the cluster's flags
    pub cluster: &'a ClusterArgs,
    /// what the backend is sized and planned for
    pub sizes: Sizes<'a>,
    /// print nothing of the setup
    pub quiet: bool,
}

/// Opens `src` as a batched backend, printing the budget's split or the cluster's setup
/// unless `how.quiet`.
pub fn open(src: Source, how: &How<'_>) -> Result<Opened> {
    let placement = placement(how.offload, how.cluster, how.quiet)?;
    let opened = loip::backend::open(src, &placement, &how.sizes)?;
    if !how.quiet {
        if let Some(b) = &opened.budget {
            eprintln!("{b}");
        }
        if let Some(session) = opened.backend.session() {
            print_setup(&loip_server::backend::lock(session));
        }
    }
    Ok(opened)
}

/// The memory line of a device run from slice files (stderr).
pub fn print_memory(m: &MemoryReport) {
    let b = loip_plan::units::format_bytes;
    eprint!(
        "memory: budget {}, resident {}, slot {}, working {}, KV budget {}",
        b(m.budget),
        b(m.resident),
        b(m.slot),
        b(m.working),
        b(m.kv_budget)
    );
}
