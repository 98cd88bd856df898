//! `loip worker`: run this machine as one device of a cluster.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use loip_runtime::worker::{exit_when_parent_dies, run_blocking, WorkerOptions};

/// Arguments of `loip worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// Address to listen on; port 0 picks a free port (the first stdout line says which).
    #[arg(long, default_value = "0.0.0.0:7001")]
    pub listen: String,
    /// Memory budget of this device, e.g. `2GiB`: weights, slot, KV cache and buffers.
    #[arg(long)]
    pub mem: String,
    /// Slice store: the slices this device was given, kept and reused across restarts.
    #[arg(long)]
    pub store: PathBuf,
    /// Shared secret the coordinator must prove (default: `$LOIP_TOKEN`; none: accept any).
    #[arg(long)]
    pub token: Option<String>,
    /// Name reported to the coordinator (default: worker@ADDR).
    #[arg(long)]
    pub name: Option<String>,
    /// Emulate an outgoing link limit, e.g. `100mbit`.
    #[arg(long)]
    pub bandwidth: Option<String>,
    /// Exit when the parent process exits (used by `loip local`).
    #[arg(long, hide = true)]
    pub exit_with_parent: bool,
}

/// `loip worker`.
pub fn run(a: WorkerArgs) -> Result<()> {
    let mem = loip_plan::parse_bytes(&a.mem).with_context(|| format!("--mem {}", a.mem))?;
    let mut opts = WorkerOptions::new(a.listen, mem, a.store);
    opts.token = a
        .token
        .or_else(|| std::env::var("LOIP_TOKEN").ok().filter(|t| !t.is_empty()));
    opts.name = a.name;
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
