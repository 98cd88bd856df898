//! Progress bars on a terminal: a split of a model into slice files, and the slices going
//! out to each device of a cluster.

use indicatif::{ProgressBar, ProgressStyle};
use loip::slices::OnSplit;

/// A bar of `len` bytes labelled `what`.
pub fn bar(len: u64, what: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    let tpl =
        format!("{what} [{{bar:40}}] {{bytes}}/{{total_bytes}} {{bytes_per_sec}} eta {{eta}}");
    b.set_style(
        ProgressStyle::with_template(&tpl).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b
}

/// Runs `f` with a "splitting" bar that follows the bytes it reports, cleared at the end.
pub fn splitting<T>(f: impl FnOnce(OnSplit<'_>) -> T) -> T {
    let b = bar(1, "splitting");
    let r = f(&|done, total| {
        b.set_length(total);
        b.set_position(done);
    });
    b.finish_and_clear();
    r
}

/// [`loip::slices::slices_for`], splitting in a child process (`loip split MODEL`, with its
/// own progress bar, pruning stale splits) when the cache has no current split: a split leaves a few MiB of the
/// splitting process's heap resident (about 7 MiB for SmolLM2), which a process under
/// `--mem` would otherwise carry for its whole run.
pub fn slices_for(model: &str) -> anyhow::Result<std::path::PathBuf> {
    use anyhow::Context;
    let at = loip::slices::locate(model)?;
    if !at.current {
        let exe = std::env::current_exe().context("finding this program to split in a child")?;
        let status = std::process::Command::new(&exe)
            .arg("split")
            .arg(model)
            .stdout(std::process::Stdio::null())
            .status()
            .with_context(|| format!("starting `{} split {model}`", exe.display()))?;
        anyhow::ensure!(
            status.success(),
            "splitting {model} into {} failed ({status}; its error is above)",
            at.dir.display()
        );
    }
    Ok(at.dir)
}

/// [`loip::slices::slices_for`] in this process, with a progress bar while it splits.
pub fn in_process(model: &str) -> anyhow::Result<std::path::PathBuf> {
    splitting(|on_split| loip::slices::slices_for(model, on_split))
}

/// A progress bar per device for the slices going out to it (bytes, rate, time left), on a
/// terminal; `None` when `quiet` or stderr is not a terminal.
pub fn ship_bars(quiet: bool) -> Option<loip_runtime::coordinator::OnShip> {
    use indicatif::MultiProgress;
    use loip_runtime::coordinator::{OnShip, ShipProgress};
    if quiet || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return None;
    }
    let multi = MultiProgress::new();
    let bars: std::sync::Mutex<std::collections::HashMap<String, ProgressBar>> = Default::default();
    Some(OnShip(std::sync::Arc::new(move |p: ShipProgress<'_>| {
        if p.total == 0 {
            return;
        }
        let mut bars = bars.lock().unwrap_or_else(|e| e.into_inner());
        let bar = bars.entry(p.device.to_string()).or_insert_with(|| {
            let b = multi.add(ProgressBar::new(p.total));
            let tpl = "{prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}";
            b.set_style(
                ProgressStyle::with_template(tpl).unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_prefix(format!("slices to {}", p.device));
            b
        });
        // a later call for the same device (the probe's layer first, then the rest)
        if bar.length() != Some(p.total) || p.sent < bar.position() {
            bar.reset();
            bar.set_length(p.total);
        }
        bar.set_position(p.sent);
        if p.sent >= p.total {
            bar.finish();
        }
    })))
}
