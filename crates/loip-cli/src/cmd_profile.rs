//! `loip profile`: measure this machine as a device profile for the planner (design §7).
//!
//! Attention and MLP block times are taken for micro-batches of b = 1, 2, 4 and 8
//! sequences (the profile's `b` grid, design §11); the cost model interpolates between
//! them. Profiles written before the grid hold b = 1 only and mean a time flat in `b`.
//!
//! The probe runs `--repeat` times (default 5) and each figure is the median of the runs
//! ([`loip_runtime::profile::median_probe`]), so a burst of other work does not end up in
//! the plan; `--cpus 2,3` (or `quiet:2`, the two least busy cores) pins the measurement to
//! a core set, e.g. the cores `taskset` will give the worker.
//!
//! The final norm + LM head is timed the same way for the profile's `head` grid
//! ([`loip_runtime::profile::time_head`]); without it the cost model scales the MLP's time
//! by the head's bytes.
//!
//! The profile's `collective_latency` is measured too: half the median round trip of a
//! 4 KiB message over TCP on loopback ([`loip_runtime::profile::loopback_latency`]), the
//! software cost of one message that the simulator charges per tensor-parallel collective.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use loip_model::slice::Manifest;

/// Arguments of `loip profile`.
#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// Model to time blocks of: a known name (`smollm2`, `gemma3-270m`), an HF directory, a GGUF file or a slice directory.
    #[arg(long, short = 'm', default_value = "smollm2")]
    pub model: String,
    /// Where to write the profile JSON.
    #[arg(long)]
    pub out: PathBuf,
    /// Device name recorded in the profile.
    #[arg(long, default_value = "this-machine")]
    pub name: String,
    /// Memory the engine may use on this device (default: the device's, as `loip worker`
    /// picks it: the cgroup limit or MemAvailable, less a margin).
    #[arg(long)]
    pub mem: Option<String>,
    /// Times to run the probe; every figure of the profile is the median of the runs.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub repeat: u32,
    /// Pin the measurement to these cores: a list as `taskset -c` takes it (`2,3`, `0-3`), or
    /// `quiet:N` for the N cores least busy over half a second. Default: no pinning (every
    /// core this process may use, as the worker will).
    #[arg(long)]
    pub cpus: Option<String>,
}

/// `loip profile`.
pub fn run(a: ProfileArgs) -> Result<()> {
    let dir = crate::progress::slices_for(&a.model)?;
    let manifest = Manifest::load(&dir)?;
    let shape = loip_runtime::shape::shape_from_manifest(&a.model, &manifest);
    let mem = match &a.mem {
        Some(m) => loip_plan::parse_bytes(m)?,
        None => {
            loip_runtime::memory::default_budget()
                .context("cannot read the cgroup limit or MemAvailable; give --mem")?
                .bytes
        }
    };
    if let Some(c) = &a.cpus {
        let cpus = match c.strip_prefix("quiet:") {
            Some(n) => {
                let n: usize = n
                    .parse()
                    .ok()
                    .filter(|&n| n >= 1)
                    .with_context(|| format!("--cpus {c}: quiet:N takes a core count >= 1"))?;
                loip_runtime::profile::quiet_cpus(n, std::time::Duration::from_millis(500))?
            }
            None => loip_runtime::profile::parse_cpu_list(c)?,
        };
        loip_runtime::profile::pin_to_cpus(&cpus).with_context(|| format!("--cpus {c}"))?;
        eprintln!("measuring on cores {cpus:?}");
    }
    let bar = indicatif::ProgressBar::new(a.repeat as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} runs")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_message("timing attention and MLP blocks, then both loaders");
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    let mut runs = Vec::new();
    for _ in 0..a.repeat {
        runs.push(loip_runtime::net::probe::probe(
            &dir,
            &manifest,
            true,
            true,
            loip_runtime::net::probe::ProbeBudget { bytes: 0 },
        )?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let layer_ms: Vec<String> = runs
        .iter()
        .map(|r| {
            format!(
                "{:.3}",
                (r.attn.first().map_or(0.0, |a| a.1) + r.mlp_s) * 1e3
            )
        })
        .collect();
    let slow: Vec<String> = runs
        .iter()
        .map(|r| format!("{:.2}", r.load_slowdown))
        .collect();
    eprintln!(
        "each run: layer ms at b = 1, n = 1: {}; slowdown beside a load: {}",
        layer_ms.join(", "),
        slow.join(", ")
    );
    let probe = loip_runtime::profile::median_probe(&runs).context("no probe ran")?;
    let head = loip_runtime::profile::time_head(&dir, &manifest).context("timing the LM head")?;
    let head_ms: Vec<String> = head
        .seconds
        .iter()
        .map(|s| format!("{:.3}", s * 1e3))
        .collect();
    let mut profile = loip_runtime::cluster_run::profile_from_probe(&a.name, mem, &shape, &probe)?
        .with_head(head)?;
    profile.collective_latency = loip_runtime::profile::loopback_latency(2000, 4096)
        .context("measuring the loopback message latency")?;
    profile.sources.push(format!(
        "collective_latency {:.1} us: half the median round trip of a 4 KiB message over TCP on \
         loopback, 2000 rounds (`loip profile`)",
        profile.collective_latency * 1e6
    ));
    std::fs::write(&a.out, profile.to_json())
        .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "measured {} time(s) in {:.1} s (medians): direct {:.2} GB/s, conventional {:.2} GB/s, \
         loopback message {:.1} us",
        a.repeat,
        probe.took_s,
        probe.direct.bandwidth / 1e9,
        probe.conventional.bandwidth / 1e9,
        profile.collective_latency * 1e6
    );
    let one = loip_runtime::wire::BatchProbe {
        b: 1,
        attn: probe.attn.clone(),
        mlp_s: probe.mlp_s,
    };
    eprintln!("| b | t^A(b, 1) ms | t^A(b, max n) ms | t^P(b) ms | layer ms per sequence |");
    eprintln!("|---|---|---|---|---|");
    for g in std::iter::once(&one).chain(&probe.batched) {
        let first = g.attn.first().map_or(0.0, |a| a.1);
        let last = g.attn.last().map_or((0, 0.0), |a| *a);
        eprintln!(
            "| {} | {:.3} | {:.3} (n = {}) | {:.3} | {:.3} |",
            g.b,
            first * 1e3,
            last.1 * 1e3,
            last.0,
            g.mlp_s * 1e3,
            (first + g.mlp_s) * 1e3 / g.b.max(1) as f64
        );
    }
    eprintln!(
        "final norm + LM head, b = 1, 2, 4, 8: {} ms; a block computes {:.0} % slower beside a load",
        head_ms.join(", "),
        profile.load_slowdown * 100.0
    );
    println!("{}", a.out.display());
    Ok(())
}
