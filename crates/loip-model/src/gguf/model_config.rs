//! The [`ModelConfig`] of a GGUF file: its metadata keys under the architecture's prefix,
//! checked and mapped onto the fields the engine uses.

use super::{GgufFile, GgufMetadata, GgufValue};
use crate::config::{Arch, ModelConfig};
use crate::error::ModelError;

fn req_u32(meta: &GgufMetadata, key: &str) -> Result<usize, ModelError> {
    match meta.get(key) {
        None => Err(ModelError::config(key, "missing from the GGUF metadata")),
        Some(v) => meta.get_u32(key).map(|x| x as usize).ok_or_else(|| {
            ModelError::config(key, format!("expected an unsigned integer, got {v:?}"))
        }),
    }
}

fn opt_u32(meta: &GgufMetadata, key: &str) -> Result<Option<usize>, ModelError> {
    match meta.get(key) {
        None => Ok(None),
        Some(_) => req_u32(meta, key).map(Some),
    }
}

fn opt_f32(meta: &GgufMetadata, key: &str) -> Result<Option<f32>, ModelError> {
    match meta.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_f32()
            .map(Some)
            .ok_or_else(|| ModelError::config(key, format!("expected a float, got {v:?}"))),
    }
}

impl GgufFile {
    /// The [`ModelConfig`] of a `llama`, `qwen2` or `qwen3` GGUF (any other architecture is
    /// [`ModelError::UnknownArch`]); keys are read under the architecture's prefix
    /// (`qwen2.block_count`, ...). Mistral files say `llama` (llama.cpp keeps no sliding window
    /// for them). Not yet validated.
    ///
    /// Features the engine does not implement are rejected by name: RoPE scaling
    /// (`ARCH.rope.scaling.type` other than `none`, or a `rope_freqs.weight` tensor as Llama
    /// 3.1+ conversions write), partial rotary dimensions, expert (MoE) layers.
    pub fn model_config(&self) -> Result<ModelConfig, ModelError> {
        let m = &self.metadata;
        let arch = m
            .architecture()
            .ok_or_else(|| ModelError::config("general.architecture", "missing or not a string"))?;
        let arch_kind = match arch {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            other => return Err(ModelError::UnknownArch(other.to_string())),
        };
        let key = |k: &str| format!("{arch}.{k}");
        if let Some(n) = opt_u32(m, &key("expert_count"))? {
            if n > 0 {
                return Err(ModelError::config(
                    key("expert_count"),
                    "mixture-of-experts models are not supported",
                ));
            }
        }
        if let Some(t) = m.get(&key("rope.scaling.type")) {
            if t.as_str() != Some("none") {
                return Err(ModelError::config(
                    key("rope.scaling.type"),
                    format!("{t:?} is not supported"),
                ));
            }
        }
        if self.tensors.iter().any(|t| t.name == "rope_freqs.weight") {
            return Err(ModelError::config(
                "rope_freqs.weight",
                "per-frequency RoPE factors (Llama 3.1+ GGUF) are not supported; use the HF checkpoint",
            ));
        }
        let hidden_size = req_u32(m, &key("embedding_length"))?;
        let num_heads = req_u32(m, &key("attention.head_count"))?;
        let num_kv_heads = opt_u32(m, &key("attention.head_count_kv"))?.unwrap_or(num_heads);
        let rope_dim = opt_u32(m, &key("rope.dimension_count"))?;
        let head_dim = match (opt_u32(m, &key("attention.key_length"))?, rope_dim) {
            (Some(k), _) => k,
            (None, Some(r)) => r,
            (None, None) if num_heads > 0 => hidden_size / num_heads,
            (None, None) => 0,
        };
        if let Some(r) = rope_dim {
            if r != head_dim {
                return Err(ModelError::config(
                    key("rope.dimension_count"),
                    format!("{r} differs from head_dim {head_dim}: partial rotary embedding is not supported"),
                ));
            }
        }
        if let Some(v) = opt_u32(m, &key("attention.value_length"))? {
            if v != head_dim {
                return Err(ModelError::config(
                    key("attention.value_length"),
                    format!("{v} differs from head_dim {head_dim}"),
                ));
            }
        }
        let vocab_size = match opt_u32(m, &key("vocab_size"))? {
            Some(v) => v,
            None => match m.get("tokenizer.ggml.tokens").and_then(GgufValue::as_array) {
                Some(tokens) => tokens.len(),
                None => self
                    .tensors
                    .iter()
                    .find(|t| t.name == "token_embd.weight")
                    .and_then(|t| t.ne.get(1).copied())
                    .map(|v| v as usize)
                    .ok_or_else(|| {
                        ModelError::config(
                            key("vocab_size"),
                            "missing, and no tokenizer.ggml.tokens",
                        )
                    })?,
            },
        };
        let num_layers = req_u32(m, &key("block_count"))?;
        let gemma = if arch_kind == Arch::Gemma3 {
            gemma3_fields(m, &key, num_layers, hidden_size, num_heads, head_dim)?
        } else {
            GemmaFields::default()
        };
        let mut eos_token_ids = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = opt_u32(m, key)? {
                let id = id as u32;
                if !eos_token_ids.contains(&id) {
                    eos_token_ids.push(id);
                }
            }
        }
        Ok(ModelConfig {
            arch: arch_kind,
            hidden_size,
            intermediate_size: req_u32(m, &key("feed_forward_length"))?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: opt_f32(m, &key("attention.layer_norm_rms_epsilon"))?.ok_or_else(
                || ModelError::config(key("attention.layer_norm_rms_epsilon"), "missing"),
            )?,
            rope_theta: opt_f32(m, &key("rope.freq_base"))?.unwrap_or(10000.0),
            rope_scaling: None,
            tie_word_embeddings: !self.tensors.iter().any(|t| t.name == "output.weight"),
            max_position_embeddings: req_u32(m, &key("context_length"))?,
            qk_norm: matches!(arch_kind, Arch::Qwen3 | Arch::Gemma3),
            attn_bias: arch_kind == Arch::Qwen2,
            sliding_window: gemma.window,
            sliding_layers: gemma.layers,
            rope_local_theta: gemma.local_theta,
            query_pre_attn_scalar: gemma.qpas,
            // llama.cpp's converter stores Gemma's norms as 1 + w already
            norm_plus_one: false,
            bos_token_id: opt_u32(m, "tokenizer.ggml.bos_token_id")?.map(|x| x as u32),
            eos_token_ids,
        })
    }
}

/// The Gemma 3 fields of a GGUF, with llama.cpp's defaults where the file has no key.
#[derive(Default)]
struct GemmaFields {
    window: Option<usize>,
    layers: Vec<bool>,
    local_theta: Option<f32>,
    qpas: Option<f32>,
}

/// llama.cpp (`llama-model.cpp`, LLM_ARCH_GEMMA3): every 6th layer is full attention
/// (`set_swa_pattern(6)`) unless `ARCH.attention.sliding_window_pattern` says otherwise (a
/// period, or one bool per layer, true = sliding); sliding layers use RoPE base 10000 unless
/// `ARCH.rope.freq_base_swa` is set; scores are scaled by `head_dim^-1/2`, except for the
/// 62-layer 27B model, which uses `(hidden / heads)^-1/2`.
fn gemma3_fields(
    m: &GgufMetadata,
    key: &dyn Fn(&str) -> String,
    num_layers: usize,
    hidden: usize,
    heads: usize,
    head_dim: usize,
) -> Result<GemmaFields, ModelError> {
    let window = opt_u32(m, &key("attention.sliding_window"))?;
    let pattern_key = key("attention.sliding_window_pattern");
    let layers = match m.get(&pattern_key) {
        Some(GgufValue::Array(items)) => items
            .iter()
            .map(|v| v.as_bool())
            .collect::<Option<Vec<bool>>>()
            .ok_or_else(|| ModelError::config(&pattern_key, "expected bools"))?,
        Some(_) => {
            let p = req_u32(m, &pattern_key)?;
            if p == 0 || num_layers > crate::config::MAX_NUM_LAYERS {
                return Err(ModelError::config(&pattern_key, format!("{p}")));
            }
            (0..num_layers).map(|i| i % p < p - 1).collect()
        }
        None if num_layers <= crate::config::MAX_NUM_LAYERS => {
            (0..num_layers).map(|i| i % 6 < 5).collect()
        }
        None => Vec::new(), // validate() reports the layer count
    };
    let qpas = if num_layers == 62 && heads > 0 {
        hidden / heads
    } else {
        head_dim
    };
    Ok(GemmaFields {
        window,
        layers,
        local_theta: Some(opt_f32(m, &key("rope.freq_base_swa"))?.unwrap_or(10000.0)),
        qpas: Some(qpas as f32),
    })
}
