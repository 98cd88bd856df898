//! `loip pull URL`: flags and a progress bar over [`loip::pull`], which downloads a model
//! file (a GGUF) or an HF file set into the model cache, resumably and verified, so that
//! `loip list` shows it and `loip generate -m NAME` finds it.

use std::time::Duration;

use anyhow::Result;
use clap::Args;
use loip::pull::{Event, Pull, Url};
use loip_plan::units::format_bytes;

/// Arguments of `loip pull`.
#[derive(Args, Debug)]
#[command(after_long_help = "\
Examples:
  loip pull https://example.org/models/SmolLM2-135M-Instruct.Q4_1.gguf --sha256 b179c9…
  loip pull https://example.org/models/my-model/ --name my-model   # an HF file set
  loip generate -m my-model --prompt 'Hello'")]
pub struct PullArgs {
    /// http(s) URL of a GGUF file, or of an HF model directory (ending in `/`): config.json,
    /// tokenizer.json (and tokenizer_config.json, generation_config.json when there), and
    /// model.safetensors or the shards model.safetensors.index.json names.
    pub url: String,
    /// Expected sha256 of the file (hex); a mismatch installs nothing. The sha256 is
    /// recorded in the entry's `pulled.json` either way.
    #[arg(long)]
    pub sha256: Option<String>,
    /// Name in the cache (default: the file's name without its extension, or the
    /// directory's name).
    #[arg(long)]
    pub name: Option<String>,
    /// Seconds without a byte from the server before the download stops (the `.part` is
    /// kept for the next try).
    #[arg(long, default_value_t = 60)]
    pub read_timeout: u64,
}

/// `loip pull`: download, verify, install, record, with a bar per file.
pub fn run(a: PullArgs) -> Result<()> {
    let mut bar: Option<indicatif::ProgressBar> = None;
    let on = &mut |e: Event<'_>| match e {
        Event::Begin { url, start, total } => bar = Some(byte_bar(total, start, url)),
        Event::Bytes(n) => {
            if let Some(b) = &bar {
                b.set_position(n);
            }
        }
        Event::End { complete } => {
            if let Some(b) = bar.take() {
                if complete {
                    b.finish();
                } else {
                    b.abandon();
                }
            }
        }
        Event::Note(s) => eprintln!("{s}"),
    };
    let p = Pull {
        url: &a.url,
        sha256: a.sha256.as_deref(),
        name: a.name.as_deref(),
        read_timeout: Duration::from_secs(a.read_timeout),
    };
    let done = loip::pull::pull(&p, on)?;
    let total: u64 = done.files.iter().map(|f| f.bytes).sum();
    eprintln!(
        "pulled {}: {} file(s), {} in {}",
        done.name,
        done.files.len(),
        format_bytes(total),
        done.dir.display()
    );
    println!("{}", done.name);
    Ok(())
}

/// A bar of bytes with rate and ETA (a spinner of bytes when the size is unknown).
fn byte_bar(total: Option<u64>, start: u64, url: &Url) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    let what = url
        .path_segments()
        .and_then(|mut s| s.next_back())
        .unwrap_or("download")
        .to_string();
    let (bar, tpl) = match total {
        Some(t) => (
            ProgressBar::new(t),
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
        ),
        None => (
            ProgressBar::new_spinner(),
            "{msg} {spinner} {bytes} {bytes_per_sec}",
        ),
    };
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(tpl).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(what);
    bar.set_position(start);
    bar
}
