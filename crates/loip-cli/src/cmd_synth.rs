//! `loip synth`: random-weight checkpoints of real shapes, for benchmarks.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use loip_kernels::DType;

/// Arguments of `loip synth`.
#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Shape preset: tiny, llama-1b, llama2-7b, llama2-13b, qwen3-32b, llama3.3-70b.
    #[arg(long)]
    pub shape: String,
    /// Stored dtype: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Keep only the first N layers of the shape.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Output directory (an HF checkpoint: config.json + safetensors).
    #[arg(long)]
    pub out: PathBuf,
    /// RNG seed of the weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `loip synth`.
pub fn run(a: SynthArgs) -> Result<()> {
    let dtype = match a.dtype.to_ascii_lowercase().as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        other => bail!("--dtype {other:?}: expected bf16, f16 or f32"),
    };
    let cfg = loip_model::preset_config(&a.shape)?;
    let bar = ProgressBar::new(1);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} writing [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    loip_model::synth_checkpoint(&cfg, dtype, a.layers, &a.out, a.seed, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    eprintln!("wrote {} ({} {})", a.out.display(), a.shape, dtype);
    Ok(())
}
