//! `loip split`: slice files for offloading, and the slice cache used by `--mem`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use loip_model::slice::{self, SplitOutcome, SplitProgress, MANIFEST};

/// Arguments of `loip split`.
#[derive(Args, Debug)]
pub struct SplitArgs {
    /// Model to split: `smollm2`, an HF directory or a GGUF file. With --verify: a slice directory.
    pub model: String,
    /// Output directory for the slices and manifest.json.
    #[arg(long, required_unless_present = "verify")]
    pub out: Option<PathBuf>,
    /// Re-check every slice's size and checksum in MODEL (a slice directory) and exit.
    #[arg(long)]
    pub verify: bool,
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    let tpl =
        format!("{what} [{{bar:40}}] {{bytes}}/{{total_bytes}} {{bytes_per_sec}} eta {{eta}}");
    b.set_style(
        ProgressStyle::with_template(&tpl).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b
}

/// `loip split`.
pub fn run(a: SplitArgs) -> Result<()> {
    if a.verify {
        let dir = Path::new(&a.model);
        let b = ProgressBar::new(1);
        let n = slice::verify(dir, &|i, n| {
            b.set_length(n as u64);
            b.set_position(i as u64);
        })?;
        b.finish_and_clear();
        println!("{n} slices verified in {}", dir.display());
        return Ok(());
    }
    let out = a.out.context("--out is required")?;
    split_into(&a.model, &out)?;
    println!("{}", out.display());
    Ok(())
}

/// Splits `model` into `out` (no work when it is up to date), with a progress bar.
pub fn split_into(model: &str, out: &Path) -> Result<()> {
    let ckpt = crate::model_load::open(model)?;
    let b = bar(1, "splitting");
    let outcome = slice::split(
        &ckpt,
        out,
        SplitProgress {
            on_bytes: &|done, total| {
                b.set_length(total);
                b.set_position(done);
            },
        },
    )
    .with_context(|| format!("splitting into {}", out.display()))?;
    b.finish_and_clear();
    if outcome == SplitOutcome::UpToDate {
        tracing::info!("{} is up to date", out.display());
    }
    Ok(())
}

/// A slice directory for `model`: the directory itself when it already is one, else a split
/// in the cache keyed by the checkpoint's path, size and mtime (made on first use).
pub fn slices_for(model: &str) -> Result<PathBuf> {
    let p = Path::new(model);
    if p.join(MANIFEST).is_file() {
        return Ok(p.to_path_buf());
    }
    let path = loip_model::fetch::resolve_model(model)?;
    let ckpt = loip_model::Checkpoint::open(&path)?;
    let stamp = slice::source_stamp(&ckpt)?;
    let key = format!("{}|{}|{}", stamp.path, stamp.bytes, stamp.mtime);
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let dir = loip_model::fetch::cache_dir()
        .join("slices")
        .join(format!("{stem}-{}", slice::crc32_hex(key.as_bytes())));
    drop(ckpt);
    split_into(&path.to_string_lossy(), &dir)?;
    Ok(dir)
}
