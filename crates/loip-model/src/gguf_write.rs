//! A small GGUF v3 writer, for tests and fixtures: synthetic files of any shape, corrupt files,
//! and a llama GGUF converted from an HF checkpoint exactly as llama.cpp's
//! `convert_hf_to_gguf.py` lays it out (q/k rows permuted, see [`crate::gguf::gguf_qk_row_to_hf`]).
//!
//! Everything is built in memory; it is not meant for multi-GB models.

use std::path::Path;

use loip_kernels::DType;

use crate::checkpoint::Checkpoint;
use crate::config::{Arch, ModelConfig};
use crate::error::ModelError;
use crate::gguf::{
    ggml_type_of, gguf_qk_row_to_hf, hf_to_gguf_name_for, value_type, GgufValue, DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
};
use crate::names::{self, suffix};

struct WriterTensor {
    name: String,
    ggml_type: u32,
    ne: Vec<u64>, // ggml order: ne[0] = cols
    data: Vec<u8>,
}

/// Builds a GGUF file in memory.
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    kv: Vec<(String, GgufValue)>,
    tensors: Vec<WriterTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment (32).
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            kv: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets the version field written (the layout is the v2/v3 one whatever the number).
    pub fn set_version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Sets the data alignment and writes `general.alignment` (a power of two).
    pub fn set_alignment(&mut self, alignment: u32) -> &mut Self {
        self.alignment = u64::from(alignment.max(1));
        self.kv(String::from("general.alignment"), GgufValue::U32(alignment))
    }

    /// Adds a metadata key/value (a key added twice is written twice).
    pub fn kv(&mut self, key: impl Into<String>, value: GgufValue) -> &mut Self {
        self.kv.push((key.into(), value));
        self
    }

    /// Adds a tensor given its HF shape (`[rows, cols]`; written reversed as ggml `ne`).
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        hf_shape: &[usize],
        data: Vec<u8>,
    ) -> &mut Self {
        let ne = hf_shape.iter().rev().map(|&d| d as u64).collect::<Vec<_>>();
        self.tensor_raw(name, ggml_type_of(dtype), &ne, data)
    }

    /// Adds a tensor with any ggml type id and `ne` dims, data written as given.
    pub fn tensor_raw(
        &mut self,
        name: impl Into<String>,
        ggml_type: u32,
        ne: &[u64],
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(WriterTensor {
            name: name.into(),
            ggml_type,
            ne: ne.to_vec(),
            data,
        });
        self
    }

    /// Writes `general.architecture` and the `ARCH.*` keys for `cfg`, ARCH being
    /// [`gguf_arch_name`] (`llama` for Llama and Mistral, `qwen2`, `qwen3`), plus
    /// `tokenizer.ggml.bos_token_id` / `eos_token_id` when set.
    pub fn llama_metadata(&mut self, cfg: &ModelConfig) -> &mut Self {
        let u = |v: usize| GgufValue::U32(v as u32);
        let a = gguf_arch_name(cfg.arch);
        let k = |key: &str| format!("{a}.{key}");
        self.kv("general.architecture", GgufValue::Str(a.into()))
            .kv(k("block_count"), u(cfg.num_layers))
            .kv(k("context_length"), u(cfg.max_position_embeddings))
            .kv(k("embedding_length"), u(cfg.hidden_size))
            .kv(k("feed_forward_length"), u(cfg.intermediate_size))
            .kv(k("attention.head_count"), u(cfg.num_heads))
            .kv(k("attention.head_count_kv"), u(cfg.num_kv_heads))
            .kv(k("rope.freq_base"), GgufValue::F32(cfg.rope_theta))
            .kv(
                k("attention.layer_norm_rms_epsilon"),
                GgufValue::F32(cfg.rms_norm_eps),
            )
            .kv(k("vocab_size"), u(cfg.vocab_size))
            .kv(k("rope.dimension_count"), u(cfg.head_dim));
        if cfg.arch == Arch::Gemma3 {
            self.kv(k("attention.key_length"), u(cfg.head_dim))
                .kv(k("attention.value_length"), u(cfg.head_dim));
            if let Some(w) = cfg.sliding_window {
                self.kv(k("attention.sliding_window"), u(w));
            }
        }
        if let Some(b) = cfg.bos_token_id {
            self.kv("tokenizer.ggml.bos_token_id", GgufValue::U32(b));
        }
        if let Some(&e) = cfg.eos_token_ids.first() {
            self.kv("tokenizer.ggml.eos_token_id", GgufValue::U32(e));
        }
        self
    }

    /// The file bytes. Fails only on an array whose elements are not all of one type.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ModelError> {
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
        for (key, value) in &self.kv {
            put_str(&mut out, key);
            out.extend_from_slice(&value.type_id().to_le_bytes());
            put_value(&mut out, value, key)?;
        }
        let align = self.alignment.max(1);
        let mut rel = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            offsets.push(rel);
            rel = (rel + t.data.len() as u64).div_ceil(align) * align;
        }
        for (t, off) in self.tensors.iter().zip(&offsets) {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.ggml_type.to_le_bytes());
            out.extend_from_slice(&off.to_le_bytes());
        }
        pad_to(&mut out, align);
        let data_start = out.len() as u64;
        for (t, off) in self.tensors.iter().zip(&offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(&t.data);
        }
        if !self.tensors.is_empty() {
            pad_to(&mut out, align);
        }
        Ok(out)
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: &Path) -> Result<(), ModelError> {
        let bytes = self.to_bytes()?;
        std::fs::write(path, bytes).map_err(|e| ModelError::io(path, e))
    }

    /// A GGUF with the weights of an HF checkpoint, laid out as llama.cpp's converter does:
    /// names mapped, dims reversed, for `llama` q/k rows permuted per head, data copied as
    /// stored (F32/F16/BF16). A Mistral sliding window has no GGUF key and is rejected.
    pub fn from_checkpoint(ck: &Checkpoint) -> Result<Self, ModelError> {
        let cfg = &ck.config;
        let gemma = cfg.arch == Arch::Gemma3;
        if gemma {
            let pattern6: Vec<bool> = (0..cfg.num_layers).map(|i| i % 6 < 5).collect();
            let plain = cfg.sliding_layers == pattern6
                && cfg.rope_local_theta == Some(10000.0)
                && cfg.query_pre_attn_scalar == Some(cfg.head_dim as f32)
                && cfg.norm_plus_one
                && info_is_f32(ck);
            if !plain {
                return Err(ModelError::config(
                    "gemma3",
                    "only F32 checkpoints with llama.cpp's default layer pattern, local RoPE base \
                     and score scale convert to GGUF",
                ));
            }
        }
        if cfg.sliding_window.is_some() && !gemma {
            return Err(ModelError::config(
                "sliding_window",
                "a GGUF file cannot carry it (llama.cpp keeps none for mistral)",
            ));
        }
        let permute = gguf_arch_name(cfg.arch) == "llama" && !ck.qk_permuted;
        let mut w = GgufWriter::new();
        w.llama_metadata(cfg);
        for spec in names::model_tensors(cfg) {
            let info = ck.tensor_info(&spec.name)?;
            let bytes = ck.tensor_bytes(&spec.name)?;
            let gguf_name = hf_to_gguf_name_for(cfg.arch, &spec.name)
                .ok_or_else(|| ModelError::config(spec.name.clone(), "has no GGUF name"))?;
            let data = match names::parse_layer_tensor_name(&spec.name) {
                Some((_, s)) if (s == suffix::Q_PROJ || s == suffix::K_PROJ) && permute => {
                    let row_bytes = info.dtype.row_bytes(info.shape[1]).map_err(|source| {
                        ModelError::Kernel {
                            tensor: spec.name.clone(),
                            source,
                        }
                    })?;
                    permute_heads(bytes, row_bytes, cfg.head_dim)
                }
                // llama.cpp's Gemma converter stores norms as 1 + w (F32, checked above)
                _ if gemma && spec.name.ends_with("norm.weight") => bytes
                    .chunks_exact(4)
                    .flat_map(|c| {
                        (f32::from_le_bytes([c[0], c[1], c[2], c[3]]) + 1.0).to_le_bytes()
                    })
                    .collect(),
                _ => bytes.to_vec(),
            };
            w.tensor(gguf_name, info.dtype, &info.shape, data);
        }
        Ok(w)
    }
}

/// Whether every tensor of the checkpoint is stored as F32.
fn info_is_f32(ck: &Checkpoint) -> bool {
    ck.tensors
        .values()
        .all(|t| t.dtype == loip_kernels::DType::F32)
}

/// The GGUF `general.architecture` of a family (Mistral files say `llama`).
pub fn gguf_arch_name(arch: Arch) -> &'static str {
    match arch {
        Arch::Llama | Arch::Mistral => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
        Arch::Gemma3 => "gemma3",
    }
}

/// llama.cpp's `permute` on whole rows: GGUF row `j` of each head = HF row
/// `gguf_qk_row_to_hf(j, head_dim)`.
fn permute_heads(bytes: &[u8], row_bytes: usize, head_dim: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let head_bytes = row_bytes * head_dim;
    for head in bytes.chunks(head_bytes) {
        for j in 0..head.len() / row_bytes {
            let src = gguf_qk_row_to_hf(j, head_dim) * row_bytes;
            out.extend_from_slice(&head[src..src + row_bytes]);
        }
    }
    out
}

fn pad_to(out: &mut Vec<u8>, align: u64) {
    let len = (out.len() as u64).div_ceil(align) * align;
    out.resize(len as usize, 0);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &GgufValue, key: &str) -> Result<(), ModelError> {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::Str(s) => put_str(out, s),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Array(items) => {
            let elem = items.first().map_or(value_type::U8, GgufValue::type_id);
            if items.iter().any(|i| i.type_id() != elem) {
                return Err(ModelError::config(
                    key,
                    "a GGUF array must hold values of one type",
                ));
            }
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i, key)?;
            }
        }
    }
    Ok(())
}
