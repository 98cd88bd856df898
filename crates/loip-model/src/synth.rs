//! Random-weight HF checkpoints of real shapes, for benchmarks and tests of models whose
//! weights are not at hand.
//!
//! Weights are streamed to disk tensor by tensor in small chunks (memory use is independent
//! of model size) and are a pure function of `(seed, tensor name, element index)`, so a
//! checkpoint with fewer layers has the same first layers as a deeper one. Files are written
//! under temporary names and renamed into place only when all are complete; `config.json`
//! last, so a checkpoint is never visible half-written, and on error the temporary files are
//! removed.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use loip_kernels::DType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::names::{self, TensorSpec};
use crate::safetensors_file::{safetensors_dtype_name, write_header};

/// Largest shard written by [`synth_checkpoint`], bytes (like HF's default of a few GB).
pub const DEFAULT_SHARD_BYTES: u64 = 2 << 30;
/// Standard deviation of matrix weights (HF `initializer_range`).
const WEIGHT_STD: f32 = 0.02;
/// Half-width of the spread of norm weights around 1.0.
const NORM_SPREAD: f32 = 0.05;
/// Elements generated per write.
const CHUNK_ELEMS: usize = 1 << 16;

/// Writes `config.json` and `model.safetensors` (or `model-0000i-of-0000n.safetensors` shards
/// of at most ~2 GiB plus `model.safetensors.index.json`) with random weights into `out_dir`.
///
/// * `dtype`: F32, F16 or BF16.
/// * `layers`: write a model of this many decoder layers instead of `cfg.num_layers` (the
///   written `config.json` says so, and the first layers equal those of the full model).
/// * `progress(done, total)`: bytes written so far and in all, called every chunk.
///
/// The result opens with [`crate::Checkpoint::open`]. Existing files of the same names are
/// replaced.
pub fn synth_checkpoint(
    cfg: &ModelConfig,
    dtype: DType,
    layers: Option<usize>,
    out_dir: &Path,
    seed: u64,
    progress: &dyn Fn(u64, u64),
) -> Result<(), ModelError> {
    synth_checkpoint_sharded(
        cfg,
        dtype,
        layers,
        out_dir,
        seed,
        DEFAULT_SHARD_BYTES,
        progress,
    )
}

/// [`synth_checkpoint`] with an explicit shard limit, bytes of tensor data per file (a tensor
/// larger than the limit gets a file of its own).
pub fn synth_checkpoint_sharded(
    cfg: &ModelConfig,
    dtype: DType,
    layers: Option<usize>,
    out_dir: &Path,
    seed: u64,
    shard_bytes: u64,
    progress: &dyn Fn(u64, u64),
) -> Result<(), ModelError> {
    let mut cfg = cfg.clone();
    if let Some(n) = layers {
        cfg.num_layers = n;
    }
    cfg.validate()?;
    let torch_dtype = match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        other => {
            return Err(ModelError::UnsupportedDtype {
                tensor: "(synthetic checkpoint)".into(),
                dtype: other.name().into(),
            })
        }
    };
    debug_assert!(safetensors_dtype_name(dtype).is_some());

    // Pack tensors into shards in checkpoint order.
    let elem_bytes = dtype.block_bytes() as u64;
    let mut shards: Vec<Vec<TensorSpec>> = vec![Vec::new()];
    let mut used = 0u64;
    for spec in names::model_tensors(&cfg) {
        let nbytes = spec.numel() as u64 * elem_bytes;
        let last_nonempty = shards.last().is_some_and(|s| !s.is_empty());
        if last_nonempty && used + nbytes > shard_bytes {
            shards.push(Vec::new());
            used = 0;
        }
        used += nbytes;
        if let Some(last) = shards.last_mut() {
            last.push(spec);
        }
    }
    let n = shards.len();
    let shard_names: Vec<String> = if n == 1 {
        vec!["model.safetensors".into()]
    } else {
        (1..=n)
            .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
            .collect()
    };

    std::fs::create_dir_all(out_dir).map_err(|e| ModelError::io(out_dir, e))?;
    let mut pending = Pending {
        dir: out_dir.to_path_buf(),
        files: Vec::new(),
        committed: false,
    };

    let headers = shards
        .iter()
        .map(|s| {
            write_header(
                &s.iter()
                    .map(|t| (t.name.clone(), dtype, t.shape.clone()))
                    .collect::<Vec<_>>(),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let total: u64 = headers
        .iter()
        .map(|(h, sizes)| h.len() as u64 + sizes.iter().sum::<u64>())
        .sum();
    let mut done = 0u64;
    progress(0, total);

    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;
    for ((specs, (header, _)), name) in shards.iter().zip(&headers).zip(&shard_names) {
        let tmp = pending.add(name);
        let file = File::create(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
        let mut w = BufWriter::with_capacity(8 << 20, file);
        let io = |e| ModelError::io(&tmp, e);
        w.write_all(header).map_err(io)?;
        done += header.len() as u64;
        for spec in specs {
            let before = done;
            write_tensor(&mut w, spec, dtype, seed, &mut |bytes| {
                done += bytes;
                progress(done, total);
            })
            .map_err(io)?;
            total_size += done - before;
            weight_map.insert(spec.name.clone(), name.clone());
        }
        w.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)?;
    }
    if n > 1 {
        let index =
            serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
        write_small(
            &pending.add("model.safetensors.index.json"),
            &index.to_string(),
        )?;
    }
    write_small(&pending.add("config.json"), &cfg.to_hf_json(torch_dtype))?;

    // A stale file of the other layout would take precedence or confuse readers.
    let stale = if n > 1 {
        "model.safetensors"
    } else {
        "model.safetensors.index.json"
    };
    remove_if_exists(&out_dir.join(stale))?;
    pending.commit()?;
    progress(total, total);
    Ok(())
}

/// Temporary files to rename into place on success, or remove on failure.
struct Pending {
    dir: PathBuf,
    files: Vec<String>,
    committed: bool,
}

impl Pending {
    fn tmp_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!(".{name}.partial"))
    }

    fn add(&mut self, name: &str) -> PathBuf {
        self.files.push(name.to_string());
        self.tmp_path(name)
    }

    fn commit(&mut self) -> Result<(), ModelError> {
        for name in &self.files {
            let (from, to) = (self.tmp_path(name), self.dir.join(name));
            std::fs::rename(&from, &to).map_err(|e| ModelError::io(&to, e))?;
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.committed {
            for name in &self.files {
                let _ = std::fs::remove_file(self.tmp_path(name));
            }
        }
    }
}

fn remove_if_exists(path: &Path) -> Result<(), ModelError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(ModelError::io(path, e)),
        _ => Ok(()),
    }
}

fn write_small(path: &Path, text: &str) -> Result<(), ModelError> {
    std::fs::write(path, text).map_err(|e| ModelError::io(path, e))
}

/// The RNG of one tensor: ChaCha8 keyed by SHA-256(seed ‖ name).
fn tensor_rng(seed: u64, name: &str) -> ChaCha8Rng {
    let mut h = Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(name.as_bytes());
    ChaCha8Rng::from_seed(h.finalize().into())
}

/// Streams one tensor's values: matrices uniform with std [`WEIGHT_STD`], vectors (norm
/// weights) uniform in `1 ± NORM_SPREAD`.
fn write_tensor(
    w: &mut impl Write,
    spec: &TensorSpec,
    dtype: DType,
    seed: u64,
    on_bytes: &mut dyn FnMut(u64),
) -> std::io::Result<()> {
    let mut rng = tensor_rng(seed, &spec.name);
    let (center, half_width) = if spec.shape.len() == 1 {
        (1.0, NORM_SPREAD)
    } else {
        (0.0, WEIGHT_STD * 3f32.sqrt())
    };
    let scale = half_width * (2.0 / (1u32 << 24) as f32);
    let mut left = spec.numel();
    let mut bits = vec![0u32; CHUNK_ELEMS];
    let mut buf = vec![0u8; CHUNK_ELEMS * 4];
    while left > 0 {
        let n = left.min(CHUNK_ELEMS);
        let bits = &mut bits[..n];
        rng.fill(bits);
        // 24 random bits → uniform in [center - half_width, center + half_width)
        let value = |b: u32| center - half_width + (b >> 8) as f32 * scale;
        let out = match dtype {
            DType::BF16 => {
                for (o, &b) in buf.chunks_exact_mut(2).zip(bits.iter()) {
                    o.copy_from_slice(&bf16::from_f32(value(b)).to_le_bytes());
                }
                &buf[..n * 2]
            }
            DType::F16 => {
                for (o, &b) in buf.chunks_exact_mut(2).zip(bits.iter()) {
                    o.copy_from_slice(&f16::from_f32(value(b)).to_le_bytes());
                }
                &buf[..n * 2]
            }
            _ => {
                for (o, &b) in buf.chunks_exact_mut(4).zip(bits.iter()) {
                    o.copy_from_slice(&value(b).to_le_bytes());
                }
                &buf[..n * 4]
            }
        };
        w.write_all(out)?;
        on_bytes(out.len() as u64);
        left -= n;
    }
    Ok(())
}
