//! `loip pair CODE`: pair this coordinator with a worker that printed a pairing code; see
//! [`loip_runtime::net::pairing`] for the exchange and docs/cluster.md for the threat model.

use std::io::{BufRead, Read, Write};
use std::net::ToSocketAddrs;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use loip_runtime::net::{known::KnownDevices, pairing};

use crate::cluster_ux;

/// Arguments of `loip pair`.
#[derive(Args, Debug)]
pub struct PairArgs {
    /// The code the worker printed at start (e.g. `ABCD-EF23`); asked for when left out.
    pub code: Option<String>,
    /// The device to pair (the name `loip devices` shows), when several take a code.
    #[arg(long)]
    pub device: Option<String>,
    /// The worker's pairing address `HOST:PORT`, instead of finding it on the LAN.
    #[arg(long)]
    pub addr: Option<String>,
    /// How long to listen for workers on the LAN, e.g. `3s`.
    #[arg(long, default_value = "3s", value_parser = crate::backend::parse_retry)]
    pub wait: Duration,
}

/// `loip pair`.
pub fn run(a: PairArgs) -> Result<()> {
    let code = match &a.code {
        Some(c) => c.clone(),
        None => {
            eprint!("pairing code (as the worker printed it): ");
            let _ = std::io::stderr().flush();
            let mut line = String::new();
            std::io::stdin()
                .lock()
                .take(256)
                .read_line(&mut line)
                .context("reading the code")?;
            line
        }
    };
    let code = pairing::normalize(code.trim())?;
    let (addr, expect) = match &a.addr {
        Some(s) => {
            let addr = (s.to_socket_addrs())
                .with_context(|| format!("--addr {s}"))?
                .next()
                .with_context(|| format!("--addr {s}: no address"))?;
            (addr, None)
        }
        None => {
            let lan = cluster_ux::Lan::browse(a.wait)?;
            let open: Vec<_> = (lan.found.iter())
                .filter(|f| f.pair_port.is_some())
                .filter(|f| a.device.as_ref().is_none_or(|d| *d == f.name))
                .collect();
            let f =
                match open.as_slice() {
                    [f] => *f,
                    [] => bail!(
                    "no worker{} takes a pairing code on the LAN (found {}): a worker takes one \
                     for a while after it starts on its own token (`loip worker --pair` opens \
                     it again); or give its pairing address with --addr HOST:PORT",
                    a.device.as_ref().map(|d| format!(" named {d}")).unwrap_or_default(),
                    lan.found.len()
                ),
                    many => bail!(
                        "{} workers take a pairing code ({}): say which with --device NAME",
                        many.len(),
                        many.iter()
                            .map(|f| f.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                };
            let addr = f
                .pair_addr()
                .and_then(|s| s.parse().ok())
                .context("the worker announced no usable address")?;
            (addr, Some(f.key))
        }
    };
    let dir = pairing::config_dir()?;
    let (token, made) = pairing::cluster_token(&dir)?;
    if made {
        eprintln!(
            "made this coordinator's cluster token in {} (mode 0600)",
            dir.join(loip_runtime::net::token::STORE_TOKEN).display()
        );
    }
    let me = loip::backend::use_paired_identity(true)?
        .context("this coordinator has no key to pair with")?;
    let card = pairing::pair_with(addr, &code, &token, &me, expect.as_ref())?;
    let key = loip_runtime::net::session::unhex::<32>(&card.key)
        .context("the worker's key is not 64 hex digits")?;
    let known = KnownDevices::new(dir.join(cluster_ux::KNOWN), [card.name.clone()]);
    known.check(&card.name, &key).map_err(anyhow::Error::msg)?;
    println!(
        "paired {} (key {}…, pinned in {}); it now holds this coordinator's token and pins \
         its key. `loip api --discover` uses it",
        card.name,
        &card.key[..16],
        known.path().display()
    );
    Ok(())
}
