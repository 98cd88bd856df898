//! `loip devices`: the workers that answer on the LAN for a few seconds, paired or not.

use std::time::Duration;

use anyhow::Result;
use clap::Args;

use crate::cluster_ux;

/// Arguments of `loip devices`.
#[derive(Args, Debug)]
pub struct DevicesArgs {
    /// How long to listen for answers, e.g. `3s`.
    #[arg(long, default_value = "3s", value_parser = crate::backend::parse_retry)]
    pub wait: Duration,
}

/// `loip devices`: a table of what answered (name, address, budget, key, paired or not) on
/// stdout.
pub fn run(a: DevicesArgs) -> Result<()> {
    let lan = cluster_ux::Lan::browse(a.wait)?;
    if lan.found.is_empty() {
        eprintln!(
            "no worker answered in {:.1} s (`loip worker` announces itself on the LAN; \
             multicast must reach this machine)",
            a.wait.as_secs_f64()
        );
        return Ok(());
    }
    print!("{}", lan.table());
    Ok(())
}
