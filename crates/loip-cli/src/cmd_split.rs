//! `loip split`: slice files for offloading, and the slice cache used by `--mem`.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use indicatif::ProgressBar;
use loip_model::slice;

/// Arguments of `loip split`.
#[derive(Args, Debug)]
pub struct SplitArgs {
    /// Model to split: a known name (`smollm2`, `gemma3-270m`), an HF directory or a GGUF file. With --verify: a slice directory.
    pub model: String,
    /// Output directory for the slices and manifest.json. Default: the slice cache that
    /// `--mem` and `loip local` use (printed).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Re-check every slice's size and checksum in MODEL (a slice directory) and exit.
    #[arg(long)]
    pub verify: bool,
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
    let out = match a.out {
        Some(out) => {
            split_into(&a.model, &out)?;
            out
        }
        None => crate::progress::in_process(&a.model)?,
    };
    println!("{}", out.display());
    Ok(())
}

/// `model` split into `out` with a progress bar.
fn split_into(model: &str, out: &Path) -> Result<()> {
    crate::progress::splitting(|on_split| loip::slices::split_into(model, out, on_split))
}
