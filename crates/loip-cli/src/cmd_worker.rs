//! `loip worker`: run this machine as one device of a cluster.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use loip_runtime::net::token;
use loip_runtime::worker::{exit_when_parent_dies, run_blocking, WorkerOptions};

/// Arguments of `loip worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Address to listen on; port 0 picks a free port (the first stdout line says which).
    #[arg(long, default_value = "0.0.0.0:7001")]
    pub listen: String,
    /// Memory budget of this device, e.g. `2GiB`: the most the whole worker process may be
    /// charged, as the kernel counts it (page cache and kernel buffers included). The engine
    /// (weights, slot, KV cache) gets what the process itself does not need; both are
    /// printed at start. Default: the device's — the smaller of this process's memory cgroup
    /// limit and MemAvailable, less a margin of 5 % (at least 8 MiB).
    #[arg(long)]
    pub mem: Option<String>,
    /// Slice store: the slices this device was given, kept and reused across restarts.
    #[arg(long)]
    pub store: PathBuf,
    /// Most bytes of slices the store may hold, e.g. `20GiB`; a coordinator sending more is
    /// refused before a byte is written. Default: what the store holds plus the free space
    /// of its disk, less 5 % of the disk.
    #[arg(long, value_name = "BYTES")]
    pub store_quota: Option<String>,
    /// File holding the shared secret the coordinator must prove (first line; mode 0600, a
    /// file others may read is refused). Default: `$LOIP_TOKEN`; else, off loopback,
    /// `STORE/token`, created on first start (its path is printed, never the token). Without
    /// any, only a loopback address is allowed.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// The shared secret itself (visible to other users in `ps`: prefer --token-file or
    /// `$LOIP_TOKEN`).
    #[arg(long)]
    pub token: Option<String>,
    /// End an authenticated session that receives nothing for this many seconds (the
    /// coordinator sends a keepalive every 10 s).
    #[arg(long, default_value_t = 60)]
    pub idle_timeout: u64,
    /// Name reported to the coordinator (default: worker@ADDR).
    #[arg(long)]
    pub name: Option<String>,
    /// Emulate an outgoing link limit, e.g. `100mbit`.
    #[arg(long)]
    pub bandwidth: Option<String>,
    /// Accept connections (coordinators and peer workers) only from this network, e.g.
    /// `10.0.0.0/24` or `fd00::/64` (repeatable; default: from anywhere). Others are closed at
    /// accept.
    #[arg(long, value_name = "CIDR")]
    pub peer_allow: Vec<String>,
    /// Exit when the parent process exits (used by `loip local`).
    #[arg(long, hide = true)]
    pub exit_with_parent: bool,
}

/// `loip worker`.
pub fn run(a: WorkerArgs) -> Result<()> {
    loip_runtime::memory::return_freed_memory();
    let mem = match &a.mem {
        Some(m) => loip_plan::parse_bytes(m).with_context(|| format!("--mem {m}"))?,
        None => {
            let d = loip_runtime::memory::default_budget().context(
                "no --mem, and neither a cgroup memory limit nor MemAvailable could be read; give --mem",
            )?;
            eprintln!(
                "budget {} (no --mem): {}",
                loip_plan::units::format_bytes(d.bytes),
                d.why
            );
            d.bytes
        }
    };
    if a.token.is_some() {
        eprintln!(
            "warning: --token is visible to other users in `ps`; prefer --token-file or LOIP_TOKEN"
        );
    }
    let given = token::from_sources(a.token_file.as_deref(), a.token.as_deref())?;
    let (tok, created) = token::for_worker(given, &a.listen, &a.store)?;
    match (&tok, created) {
        (Some(_), Some(path)) => eprintln!(
            "generated a token for this worker in {} (mode 0600); give the coordinator a copy \
             of that file with --token-file FILE, or its first line in LOIP_TOKEN",
            path.display()
        ),
        (None, _) => eprintln!(
            "no token: any coordinator that can reach {} may connect (loopback only)",
            a.listen
        ),
        _ => {}
    }
    let (id, made) = loip_runtime::net::identity::Identity::load_or_create(&a.store)?;
    eprintln!(
        "device key {} ({} in {}; coordinators pin it)",
        id.fingerprint(),
        if made { "new" } else { "kept" },
        a.store.display()
    );
    let peer_allow = (a.peer_allow.iter().map(|c| c.parse()))
        .collect::<Result<Vec<_>, String>>()
        .map_err(anyhow::Error::msg)?;
    let mut opts = WorkerOptions::new(a.listen, mem, a.store).whole_process()?;
    opts.peer_allow = peer_allow;
    eprintln!("{}", opts.budget());
    opts.token = tok;
    opts.idle_timeout = std::time::Duration::from_secs(a.idle_timeout.max(1));
    opts.name = a.name;
    opts.store_quota = a
        .store_quota
        .as_deref()
        .map(loip_plan::parse_bytes)
        .transpose()
        .context("--store-quota")?;
    opts.bandwidth = a
        .bandwidth
        .as_deref()
        .map(loip_plan::parse_bandwidth)
        .transpose()
        .context("--bandwidth")?;
    if a.exit_with_parent {
        exit_when_parent_dies();
    }
    run_blocking(opts, |addr| {
        println!("listening on {addr}");
        let _ = std::io::stdout().flush();
    })?;
    Ok(())
}
