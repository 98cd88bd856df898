//! Model hyper-parameters: raw HF `config.json` (a JSON object) → [`ModelConfig`] →
//! [`ModelConfig::validate`].
//!
//! Only what the forward pass of a dense Llama, Mistral, Qwen2 or Qwen3 decoder needs is kept.
//! Each family's differences are fields here (q/k/v biases, q/k norms, a sliding window), read
//! by the one forward pass. Settings that would change the computation in ways the engine does
//! not implement (other biases, RoPE types other than default and llama3, activations other
//! than SiLU) are rejected here, naming the field, rather than
//! silently ignored: the output must be exact.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::ModelError;

mod fields;
mod multimodal;
use fields::*;

/// The decoder family. All are pre-norm RMSNorm + RoPE + GQA + SwiGLU; Qwen2 adds biases to
/// the q/k/v projections, Qwen3 a per-head RMSNorm on q and k (`q_norm`, `k_norm`) before
/// RoPE, and Mistral may limit attention to a sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 2 / Llama 3 (and SmolLM2, TinyLlama: same graph)
    Llama,
    /// Qwen3 dense models
    Qwen3,
    /// Qwen2 and Qwen2.5 (q/k/v biases)
    Qwen2,
    /// Mistral 7B and relatives (optional sliding window)
    Mistral,
    /// Gemma 3 text decoder: embeddings × √hidden, `(1 + w)` RMSNorms before and after
    /// attention and MLP, q/k norms, GeGLU (tanh GELU), `query_pre_attn_scalar`, sliding-window
    /// layers with their own RoPE base between full-attention layers, tied head
    Gemma3,
}

impl Arch {
    /// The HF `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen2 => "qwen2",
            Arch::Mistral => "mistral",
            Arch::Gemma3 => "gemma3_text",
        }
    }

    /// The HF `architectures[0]` class name.
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Mistral => "MistralForCausalLM",
            Arch::Gemma3 => "Gemma3ForCausalLM",
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

/// RoPE frequency scaling beyond the plain `theta^(-2i/d)` schedule.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3.1+ scaling (transformers `_compute_llama3_parameters`): wavelengths longer than
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, shorter
    /// than `original_max_position_embeddings / high_freq_factor` are kept, and the band
    /// between is interpolated smoothly.
    Llama3 {
        /// frequency divisor for long wavelengths (8.0 for Llama 3.1/3.3)
        factor: f32,
        /// lower band edge (1.0)
        low_freq_factor: f32,
        /// upper band edge (4.0)
        high_freq_factor: f32,
        /// context length the model was pre-trained at, tokens (8192)
        original_max_position_embeddings: usize,
    },
}

/// Hyper-parameters of one checkpoint, resolved from HF `config.json` or GGUF metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// decoder family
    pub arch: Arch,
    /// model width `d_model`, elements
    pub hidden_size: usize,
    /// MLP width (gate/up rows, down cols), elements
    pub intermediate_size: usize,
    /// number of decoder blocks
    pub num_layers: usize,
    /// query heads
    pub num_heads: usize,
    /// key/value heads (GQA groups); divides `num_heads`
    pub num_kv_heads: usize,
    /// elements per head (q/k/v); not always `hidden_size / num_heads` (Qwen3)
    pub head_dim: usize,
    /// embedding / LM-head rows
    pub vocab_size: usize,
    /// RMSNorm epsilon
    pub rms_norm_eps: f32,
    /// RoPE base θ
    pub rope_theta: f32,
    /// RoPE frequency scaling, if any
    pub rope_scaling: Option<RopeScaling>,
    /// `lm_head` shares `model.embed_tokens.weight` (no `lm_head.weight` tensor)
    pub tie_word_embeddings: bool,
    /// longest context the model supports, tokens
    pub max_position_embeddings: usize,
    /// per-head RMSNorm on q and k before RoPE (Qwen3 `q_norm` / `k_norm`)
    pub qk_norm: bool,
    /// biases on the q, k and v projections (Qwen2 `q_proj.bias`, ...), added before RoPE
    #[serde(default)]
    pub attn_bias: bool,
    /// each token attends to at most this many most recent positions, itself included
    /// (Mistral `sliding_window`; `None`: full causal attention), tokens
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// per layer, `true` where the layer attends within [`ModelConfig::sliding_window`]
    /// (Gemma 3 `layer_types` "sliding_attention"); empty: the window, if any, applies to
    /// every layer (Mistral)
    #[serde(default)]
    pub sliding_layers: Vec<bool>,
    /// RoPE base θ of the sliding-window layers (Gemma 3 `rope_local_base_freq`); `None`:
    /// [`ModelConfig::rope_theta`]
    #[serde(default)]
    pub rope_local_theta: Option<f32>,
    /// attention scores scaled by `query_pre_attn_scalar^-1/2` (Gemma) instead of
    /// `head_dim^-1/2`; `None`: `head_dim`
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f32>,
    /// RMSNorm weights are stored as `w` and applied as `1 + w` (Gemma HF checkpoints;
    /// llama.cpp's converter stores `1 + w`, so a Gemma GGUF has this `false`)
    #[serde(default)]
    pub norm_plus_one: bool,
    /// beginning-of-sequence token, if the model has one
    pub bos_token_id: Option<u32>,
    /// tokens that end generation (may be empty: then only the length limit stops it)
    pub eos_token_ids: Vec<u32>,
}

/// The largest tensor dimension product accepted, elements. Far above any real model (the
/// 70B embedding is 1.05e9) while keeping every byte count well inside `u64`/`usize`.
const MAX_TENSOR_ELEMS: usize = 1 << 40;

/// Most decoder blocks accepted. This and the bounds below are far above any released model
/// (largest today: 126 layers, 128 heads, head_dim 256, hidden 18432, MLP 73728, vocabulary
/// 262144, context 10M tokens) and low enough that nothing sized from them can exhaust memory
/// before [`ModelConfig::check_fits`] compares them with the file.
pub const MAX_NUM_LAYERS: usize = 1 << 12;
/// Most query (and so key/value) heads accepted.
pub const MAX_NUM_HEADS: usize = 1 << 12;
/// Largest `head_dim` accepted, elements.
pub const MAX_HEAD_DIM: usize = 1 << 12;
/// Largest `hidden_size` accepted, elements.
pub const MAX_HIDDEN_SIZE: usize = 1 << 18;
/// Largest `intermediate_size` accepted, elements.
pub const MAX_INTERMEDIATE_SIZE: usize = 1 << 20;
/// Largest `vocab_size` accepted, tokens.
pub const MAX_VOCAB_SIZE: usize = 1 << 24;
/// Longest `max_position_embeddings` accepted, tokens.
pub const MAX_CONTEXT: usize = 1 << 26;

/// Fewest bits any supported storage type spends per weight element (Q2_K spends 2.625; 2 is a
/// safe floor), used by [`ModelConfig::check_fits`].
const MIN_BITS_PER_WEIGHT: u64 = 2;

impl ModelConfig {
    /// Parses an HF `config.json` (Llama 2/3, Qwen3).
    ///
    /// * `model_type` (or, without it, `architectures[0]`) picks the [`Arch`]; anything else is
    ///   [`ModelError::UnknownArch`] naming it. A multimodal Gemma 3 config (`gemma3`) is read
    ///   as its text model (`text_config`, see `config/multimodal.rs`).
    /// * `head_dim` defaults to `hidden_size / num_attention_heads`; `num_key_value_heads` to
    ///   `num_attention_heads`.
    /// * `rope_theta` is read at top level or inside `rope_parameters` (transformers ≥ 5),
    ///   which may also hold `rope_type` and the llama3 fields; `rope_scaling` (older files)
    ///   takes `rope_type` or `type`.
    /// * `eos_token_id` may be an integer, a list or null.
    ///
    /// The result is not yet validated; call [`ModelConfig::validate`].
    pub fn from_hf_json(text: &str) -> Result<Self, ModelError> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| ModelError::config("config.json", format!("not valid JSON: {e}")))?;
        let obj = root.as_object().ok_or_else(|| {
            ModelError::config("config.json", "the top level is not a JSON object")
        })?;
        if multimodal::is_multimodal_gemma3(obj) {
            let text = Value::Object(multimodal::gemma3_text_config(obj)?);
            return Self::from_hf_json(&text.to_string());
        }
        let arch = arch_of(obj)?;
        reject_unsupported_features(obj, arch)?;

        let hidden_size = req_usize(obj, "hidden_size")?;
        let num_heads = req_usize(obj, "num_attention_heads")?;
        let num_kv_heads = opt_usize(obj, "num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match opt_usize(obj, "head_dim")? {
            Some(d) => d,
            None => {
                if num_heads == 0 || hidden_size % num_heads != 0 {
                    return Err(ModelError::config(
                        "head_dim",
                        format!(
                            "absent, and hidden_size {hidden_size} is not a multiple of \
                             num_attention_heads {num_heads}"
                        ),
                    ));
                }
                hidden_size / num_heads
            }
        };

        let mut rope_parameters = opt_object(obj, "rope_parameters")?;
        // Gemma 3 (transformers ≥ 5): one set of RoPE parameters per layer type.
        let mut rope_local_theta = opt_f32(obj, "rope_local_base_freq")?;
        if let Some(p) = rope_parameters.filter(|p| p.contains_key("full_attention")) {
            rope_parameters = opt_object(p, "full_attention")?;
            if let Some(local) = opt_object(p, "sliding_attention")? {
                if parse_rope_scaling(local, "rope_parameters.sliding_attention")?.is_some() {
                    return Err(ModelError::config(
                        "rope_parameters.sliding_attention.rope_type",
                        "only the default RoPE is supported on sliding layers",
                    ));
                }
                rope_local_theta =
                    opt_f32_in(local, "rope_parameters.sliding_attention", "rope_theta")?
                        .or(rope_local_theta);
            }
        }
        let rope_theta = match opt_f32(obj, "rope_theta")? {
            Some(t) => t,
            None => match rope_parameters {
                Some(p) => opt_f32_in(p, "rope_parameters", "rope_theta")?.unwrap_or(10000.0),
                None => 10000.0,
            },
        };
        let rope_scaling = match opt_object(obj, "rope_scaling")? {
            Some(s) => parse_rope_scaling(s, "rope_scaling")?,
            None => match rope_parameters {
                Some(p) => parse_rope_scaling(p, "rope_parameters")?,
                None => None,
            },
        };

        let default_max_pos = match arch {
            Arch::Llama => 2048,
            Arch::Qwen3 | Arch::Qwen2 => 32768,
            Arch::Mistral | Arch::Gemma3 => 131072,
        };
        let num_layers = req_usize(obj, "num_hidden_layers")?;
        let (sliding_window, mut sliding_layers) = match arch {
            Arch::Mistral | Arch::Gemma3 => (opt_usize(obj, "sliding_window")?, Vec::new()),
            Arch::Qwen2 | Arch::Qwen3 => qwen_sliding(obj, num_layers)?,
            Arch::Llama => (None, Vec::new()),
        };
        let query_pre_attn_scalar = match arch {
            Arch::Gemma3 => {
                sliding_layers = gemma_sliding_layers(obj, num_layers)?;
                Some(opt_f32(obj, "query_pre_attn_scalar")?.unwrap_or(head_dim as f32))
            }
            _ => None,
        };
        let rope_local_theta = match arch {
            Arch::Gemma3 => Some(rope_local_theta.unwrap_or(10000.0)),
            _ => None,
        };
        Ok(ModelConfig {
            arch,
            hidden_size,
            intermediate_size: req_usize(obj, "intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: req_usize(obj, "vocab_size")?,
            rms_norm_eps: opt_f32(obj, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: opt_bool(obj, "tie_word_embeddings")?
                .unwrap_or(arch == Arch::Gemma3),
            max_position_embeddings: opt_usize(obj, "max_position_embeddings")?
                .unwrap_or(default_max_pos),
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Gemma3),
            attn_bias: arch == Arch::Qwen2,
            sliding_window,
            sliding_layers,
            rope_local_theta,
            query_pre_attn_scalar,
            norm_plus_one: arch == Arch::Gemma3,
            bos_token_id: opt_token(obj, "bos_token_id")?,
            eos_token_ids: token_list(obj, "eos_token_id")?,
        })
    }

    /// Writes an HF-style `config.json` that [`ModelConfig::from_hf_json`] reads back to an
    /// equal config. `torch_dtype` is informational (e.g. `"bfloat16"`).
    pub fn to_hf_json(&self, torch_dtype: &str) -> String {
        let mut m = Map::new();
        m.insert(
            "architectures".into(),
            Value::from(vec![self.arch.hf_class()]),
        );
        m.insert("model_type".into(), Value::from(self.arch.model_type()));
        m.insert("hidden_size".into(), Value::from(self.hidden_size));
        m.insert(
            "intermediate_size".into(),
            Value::from(self.intermediate_size),
        );
        m.insert("num_hidden_layers".into(), Value::from(self.num_layers));
        m.insert("num_attention_heads".into(), Value::from(self.num_heads));
        m.insert("num_key_value_heads".into(), Value::from(self.num_kv_heads));
        m.insert("head_dim".into(), Value::from(self.head_dim));
        m.insert("vocab_size".into(), Value::from(self.vocab_size));
        m.insert("rms_norm_eps".into(), Value::from(self.rms_norm_eps));
        m.insert("rope_theta".into(), Value::from(self.rope_theta));
        if let Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) = self.rope_scaling
        {
            let mut s = Map::new();
            s.insert("rope_type".into(), Value::from("llama3"));
            s.insert("factor".into(), Value::from(factor));
            s.insert("low_freq_factor".into(), Value::from(low_freq_factor));
            s.insert("high_freq_factor".into(), Value::from(high_freq_factor));
            s.insert(
                "original_max_position_embeddings".into(),
                Value::from(original_max_position_embeddings),
            );
            m.insert("rope_scaling".into(), Value::Object(s));
        }
        m.insert(
            "tie_word_embeddings".into(),
            Value::from(self.tie_word_embeddings),
        );
        m.insert(
            "max_position_embeddings".into(),
            Value::from(self.max_position_embeddings),
        );
        if let Some(w) = self.sliding_window {
            m.insert("sliding_window".into(), Value::from(w));
        }
        let qwen = matches!(self.arch, Arch::Qwen2 | Arch::Qwen3);
        if qwen && self.sliding_window.is_some() {
            // Qwen reads the window only with `use_sliding_window`, per layer from `layer_types`
            m.insert("use_sliding_window".into(), Value::from(true));
        }
        if !self.sliding_layers.is_empty() || (qwen && self.sliding_window.is_some()) {
            let types: Vec<&str> = (0..self.num_layers)
                .map(|l| {
                    if self.is_sliding_layer(l) {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            m.insert("layer_types".into(), Value::from(types));
        }
        if let Some(t) = self.rope_local_theta {
            m.insert("rope_local_base_freq".into(), Value::from(t));
        }
        if let Some(q) = self.query_pre_attn_scalar {
            m.insert("query_pre_attn_scalar".into(), Value::from(q));
        }
        let act = match self.arch {
            Arch::Gemma3 => "gelu_pytorch_tanh",
            _ => "silu",
        };
        m.insert("hidden_act".into(), Value::from(act));
        m.insert(
            "bos_token_id".into(),
            self.bos_token_id.map_or(Value::Null, Value::from),
        );
        m.insert(
            "eos_token_id".into(),
            match self.eos_token_ids.as_slice() {
                [] => Value::Null,
                [one] => Value::from(*one),
                many => Value::from(many.to_vec()),
            },
        );
        m.insert("torch_dtype".into(), Value::from(torch_dtype));
        // A serde_json::Map of plain values always serializes.
        serde_json::to_string_pretty(&Value::Object(m)).unwrap_or_default()
    }

    /// Checks ranges and relations between fields; the error names the bad field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let nonzero = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in nonzero {
            if v == 0 {
                return Err(ModelError::config(field, "must be greater than 0"));
            }
        }
        let bounded = [
            ("num_layers", self.num_layers, MAX_NUM_LAYERS),
            ("num_heads", self.num_heads, MAX_NUM_HEADS),
            ("num_kv_heads", self.num_kv_heads, MAX_NUM_HEADS),
            ("head_dim", self.head_dim, MAX_HEAD_DIM),
            ("hidden_size", self.hidden_size, MAX_HIDDEN_SIZE),
            (
                "intermediate_size",
                self.intermediate_size,
                MAX_INTERMEDIATE_SIZE,
            ),
            ("vocab_size", self.vocab_size, MAX_VOCAB_SIZE),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_CONTEXT,
            ),
        ];
        for (field, v, max) in bounded {
            if v > max {
                return Err(ModelError::config(
                    field,
                    format!("{v} exceeds the largest accepted value {max}"),
                ));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(ModelError::config(
                "num_kv_heads",
                format!(
                    "{} does not divide num_heads {}",
                    self.num_kv_heads, self.num_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::config(
                "head_dim",
                format!("{} is odd; RoPE rotates pairs of elements", self.head_dim),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(ModelError::config(
                "rms_norm_eps",
                format!("{} is not a positive finite number", self.rms_norm_eps),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(ModelError::config(
                "rope_theta",
                format!("{} is not a positive finite number", self.rope_theta),
            ));
        }
        if let Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) = self.rope_scaling
        {
            for (field, v) in [
                ("rope_scaling.factor", factor),
                ("rope_scaling.low_freq_factor", low_freq_factor),
                ("rope_scaling.high_freq_factor", high_freq_factor),
            ] {
                if !(v.is_finite() && v > 0.0) {
                    return Err(ModelError::config(
                        field,
                        format!("{v} is not a positive finite number"),
                    ));
                }
            }
            if high_freq_factor <= low_freq_factor {
                return Err(ModelError::config(
                    "rope_scaling.high_freq_factor",
                    format!("{high_freq_factor} must exceed low_freq_factor {low_freq_factor}"),
                ));
            }
            if original_max_position_embeddings == 0 {
                return Err(ModelError::config(
                    "rope_scaling.original_max_position_embeddings",
                    "must be greater than 0",
                ));
            }
        }
        if self.attn_bias != (self.arch == Arch::Qwen2) {
            return Err(ModelError::config(
                "attn_bias",
                format!(
                    "{} does not match arch {} (only qwen2 has q/k/v biases)",
                    self.attn_bias, self.arch
                ),
            ));
        }
        match self.sliding_window {
            Some(0) => {
                return Err(ModelError::config(
                    "sliding_window",
                    "must be greater than 0",
                ))
            }
            Some(_) if self.arch == Arch::Llama => {
                return Err(ModelError::config(
                    "sliding_window",
                    format!("arch {} has no sliding window here", self.arch),
                ))
            }
            _ => {}
        }
        let gemma = self.arch == Arch::Gemma3;
        let per_layer = matches!(self.arch, Arch::Gemma3 | Arch::Qwen2 | Arch::Qwen3);
        if !self.sliding_layers.is_empty()
            && (!per_layer || self.sliding_layers.len() != self.num_layers)
        {
            return Err(ModelError::config(
                "sliding_layers",
                format!(
                    "{} layer types for {} layers of arch {} (gemma3, qwen2, qwen3; one per layer)",
                    self.sliding_layers.len(),
                    self.num_layers,
                    self.arch
                ),
            ));
        }
        for (field, v) in [
            ("rope_local_theta", self.rope_local_theta),
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
        ] {
            match v {
                Some(_) if !gemma => {
                    return Err(ModelError::config(
                        field,
                        format!("arch {} has none", self.arch),
                    ))
                }
                Some(x) if !(x.is_finite() && x > 0.0) => {
                    return Err(ModelError::config(
                        field,
                        format!("{x} is not a positive finite number"),
                    ))
                }
                _ => {}
            }
        }
        if self.norm_plus_one && !gemma {
            return Err(ModelError::config(
                "norm_plus_one",
                format!("arch {} has plain RMSNorm weights", self.arch),
            ));
        }
        if self.qk_norm != matches!(self.arch, Arch::Qwen3 | Arch::Gemma3) {
            return Err(ModelError::config(
                "qk_norm",
                format!(
                    "{} does not match arch {} (only qwen3 and gemma3 have q/k norms)",
                    self.qk_norm, self.arch
                ),
            ));
        }
        // Every tensor's element count must stay far inside usize/u64 byte arithmetic.
        let elems = [
            (
                "num_heads",
                self.num_heads
                    .checked_mul(self.head_dim)
                    .and_then(|q| q.checked_mul(self.hidden_size)),
            ),
            (
                "num_kv_heads",
                self.num_kv_heads
                    .checked_mul(self.head_dim)
                    .and_then(|k| k.checked_mul(self.hidden_size)),
            ),
            ("vocab_size", self.vocab_size.checked_mul(self.hidden_size)),
            (
                "intermediate_size",
                self.intermediate_size.checked_mul(self.hidden_size),
            ),
        ];
        for (field, n) in elems {
            if n.is_none_or(|n| n > MAX_TENSOR_ELEMS) {
                return Err(ModelError::config(
                    field,
                    "the tensor sizes it implies are absurdly large",
                ));
            }
        }
        Ok(())
    }

    /// Weight elements of one decoder block (projections and norms), elements. Exact for
    /// a config that passed [`ModelConfig::validate`] (whose bounds keep it far inside `u64`).
    pub fn layer_weight_elems(&self) -> u64 {
        let (h, q, kv, i, d) = (
            self.hidden_size as u64,
            self.q_dim() as u64,
            self.kv_dim() as u64,
            self.intermediate_size as u64,
            self.head_dim as u64,
        );
        let norms = 2 * h + if self.qk_norm { 2 * d } else { 0 };
        let biases = if self.attn_bias { q + 2 * kv } else { 0 };
        let norms = norms + if self.arch == Arch::Gemma3 { 2 * h } else { 0 };
        (2 * q + 2 * kv) * h + 3 * i * h + norms + biases
    }

    /// Checks that files holding `file_bytes` bytes in all can hold the tensors this config
    /// implies, at the fewest bits per weight any supported type spends. Run after
    /// [`ModelConfig::validate`] and before anything is sized from the counts (tensor names
    /// for every layer, buffers), so that a header declaring 2^31 layers in a small file is a
    /// clear error naming the field rather than an allocation abort.
    pub fn check_fits(&self, file_bytes: u64) -> Result<(), ModelError> {
        let min_bytes = |elems: u64| elems.saturating_mul(MIN_BITS_PER_WEIGHT) / 8;
        let layers = min_bytes((self.num_layers as u64).saturating_mul(self.layer_weight_elems()));
        let heads = if self.tie_word_embeddings { 1 } else { 2 };
        let vocab = min_bytes(heads * self.vocab_size as u64 * self.hidden_size as u64);
        if layers.saturating_add(vocab) <= file_bytes {
            return Ok(());
        }
        let field = if layers >= vocab {
            "num_layers"
        } else {
            "vocab_size"
        };
        Err(ModelError::config(
            field,
            format!(
                "{} layers and a vocabulary of {} need at least {} bytes of weights, but the \
                 checkpoint's files hold {file_bytes}",
                self.num_layers,
                self.vocab_size,
                layers.saturating_add(vocab)
            ),
        ))
    }

    /// The attention window of layer `layer`, tokens (`None`: full causal attention).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        match self.sliding_layers.get(layer) {
            Some(false) => None,
            _ => self.sliding_window,
        }
    }

    /// Whether layer `layer` is a sliding-window layer (its own RoPE base on Gemma 3).
    pub fn is_sliding_layer(&self, layer: usize) -> bool {
        self.layer_window(layer).is_some()
    }

    /// Query projection width `num_heads × head_dim`, elements.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Key / value projection width `num_kv_heads × head_dim`, elements.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

fn arch_of(obj: &Map<String, Value>) -> Result<Arch, ModelError> {
    if let Some(mt) = obj.get("model_type").filter(|v| !v.is_null()) {
        let mt = mt.as_str().ok_or_else(|| {
            ModelError::config("model_type", format!("expected a string, got {mt}"))
        })?;
        return match mt {
            "llama" => Ok(Arch::Llama),
            "gemma3_text" => Ok(Arch::Gemma3),
            "qwen3" => Ok(Arch::Qwen3),
            "qwen2" => Ok(Arch::Qwen2),
            "mistral" => Ok(Arch::Mistral),
            other => Err(ModelError::UnknownArch(other.to_string())),
        };
    }
    let first = obj
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .ok_or_else(|| {
            ModelError::config(
                "model_type",
                "missing, and no architectures[0] to infer it from",
            )
        })?;
    match first {
        "LlamaForCausalLM" => Ok(Arch::Llama),
        "Qwen3ForCausalLM" => Ok(Arch::Qwen3),
        "Qwen2ForCausalLM" => Ok(Arch::Qwen2),
        "MistralForCausalLM" => Ok(Arch::Mistral),
        "Gemma3ForCausalLM" => Ok(Arch::Gemma3),
        other => Err(ModelError::UnknownArch(other.to_string())),
    }
}

/// Settings that would make the HF model compute something the engine does not.
fn reject_unsupported_features(obj: &Map<String, Value>, arch: Arch) -> Result<(), ModelError> {
    // Qwen2's q/k/v biases are part of its graph whatever `attention_bias` says (HF ignores it).
    let bias_keys: &[&str] = match arch {
        Arch::Qwen2 => &["mlp_bias"],
        _ => &["attention_bias", "mlp_bias"],
    };
    for &key in bias_keys {
        if opt_bool(obj, key)? == Some(true) {
            return Err(ModelError::config(key, "biases are not supported"));
        }
    }
    if arch == Arch::Gemma3 {
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if obj.get(key).is_some_and(|v| !v.is_null()) {
                return Err(ModelError::config(
                    key,
                    "logit soft-capping is not supported",
                ));
            }
        }
        if opt_bool(obj, "use_bidirectional_attention")? == Some(true) {
            return Err(ModelError::config(
                "use_bidirectional_attention",
                "only causal attention is supported",
            ));
        }
        let act = obj
            .get("hidden_activation")
            .filter(|v| !v.is_null())
            .or_else(|| obj.get("hidden_act").filter(|v| !v.is_null()));
        if let Some(act) = act {
            if act.as_str() != Some("gelu_pytorch_tanh") {
                return Err(ModelError::config(
                    "hidden_activation",
                    format!("{act} is not supported (gemma3: only gelu_pytorch_tanh)"),
                ));
            }
        }
        return Ok(());
    }
    // Qwen2/3 layer types are read with the window (`qwen_sliding`)
    let qwen = matches!(arch, Arch::Qwen3 | Arch::Qwen2);
    if let Some(types) = obj
        .get("layer_types")
        .and_then(Value::as_array)
        .filter(|_| !qwen)
    {
        if let Some(t) = types.iter().find(|t| t.as_str() != Some("full_attention")) {
            return Err(ModelError::config(
                "layer_types",
                format!("layer type {t} is not supported (only full_attention)"),
            ));
        }
    }
    if let Some(act) = obj.get("hidden_act").filter(|v| !v.is_null()) {
        if act.as_str() != Some("silu") {
            return Err(ModelError::config(
                "hidden_act",
                format!("{act} is not supported (only silu)"),
            ));
        }
    }
    Ok(())
}

/// `layer_types` ("sliding_attention" → `true` / "full_attention" → `false`), if present.
fn layer_types(obj: &Map<String, Value>) -> Result<Option<Vec<bool>>, ModelError> {
    let Some(types) = obj.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let types = types
        .as_array()
        .ok_or_else(|| ModelError::config("layer_types", "expected a list"))?;
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(ModelError::config(
                "layer_types",
                format!("layer type {t} is not supported"),
            )),
        })
        .collect::<Result<Vec<bool>, ModelError>>()
        .map(Some)
}

/// Qwen2/Qwen3's window, as HF's `Qwen2Config` reads it: `sliding_window` only when
/// `use_sliding_window` is true; then per layer from `layer_types`, else on the layers from
/// `max_window_layers` (default 28) on. Returns `(window, per-layer flags)`, the flags empty
/// when every layer is alike (the window `None` when no layer slides).
fn qwen_sliding(
    obj: &Map<String, Value>,
    num_layers: usize,
) -> Result<(Option<usize>, Vec<bool>), ModelError> {
    let types = layer_types(obj)?;
    let window = match opt_bool(obj, "use_sliding_window")? {
        Some(true) => opt_usize(obj, "sliding_window")?,
        _ => None,
    };
    let Some(window) = window else {
        return Ok((None, Vec::new()));
    };
    let layers = match types {
        Some(t) => t,
        None if num_layers > MAX_NUM_LAYERS => {
            return Err(ModelError::config(
                "num_hidden_layers",
                format!("{num_layers} is above {MAX_NUM_LAYERS}"),
            ))
        }
        None => {
            let from = opt_usize(obj, "max_window_layers")?.unwrap_or(28);
            (0..num_layers).map(|i| i >= from).collect()
        }
    };
    if layers.len() != num_layers {
        return Err(ModelError::config(
            "layer_types",
            format!("{} layer types for {num_layers} layers", layers.len()),
        ));
    }
    Ok(if layers.iter().all(|&s| s) {
        (Some(window), Vec::new())
    } else if layers.iter().any(|&s| s) {
        (Some(window), layers)
    } else {
        (None, Vec::new())
    })
}

/// Gemma 3's per-layer attention kinds: `layer_types` ("sliding_attention" /
/// "full_attention"), else `sliding_window_pattern` P (every P-th layer full), else 6.
fn gemma_sliding_layers(
    obj: &Map<String, Value>,
    num_layers: usize,
) -> Result<Vec<bool>, ModelError> {
    if let Some(types) = layer_types(obj)? {
        return Ok(types);
    }
    let pattern = match opt_usize(obj, "sliding_window_pattern")? {
        Some(p) => p,
        None => opt_usize(obj, "_sliding_window_pattern")?.unwrap_or(6),
    };
    if pattern == 0 || num_layers > MAX_NUM_LAYERS {
        return Err(ModelError::config(
            "sliding_window_pattern",
            format!("{pattern} for {num_layers} layers"),
        ));
    }
    Ok((0..num_layers).map(|i| (i + 1) % pattern != 0).collect())
}

fn parse_rope_scaling(
    s: &Map<String, Value>,
    field: &str,
) -> Result<Option<RopeScaling>, ModelError> {
    let ty = match s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .filter(|v| !v.is_null())
    {
        None => return Ok(None),
        Some(v) => v.as_str().ok_or_else(|| {
            ModelError::config(
                format!("{field}.rope_type"),
                format!("expected a string, got {v}"),
            )
        })?,
    };
    match ty {
        "default" => Ok(None),
        "llama3" => {
            let req = |key: &str| {
                opt_f32_in(s, field, key)?
                    .ok_or_else(|| ModelError::config(format!("{field}.{key}"), "missing"))
            };
            let omax_field = format!("{field}.original_max_position_embeddings");
            let omax = match s.get("original_max_position_embeddings") {
                Some(v) => as_usize(v).ok_or_else(|| {
                    ModelError::config(
                        &omax_field,
                        format!("expected a non-negative integer, got {v}"),
                    )
                })?,
                None => return Err(ModelError::config(omax_field, "missing")),
            };
            Ok(Some(RopeScaling::Llama3 {
                factor: req("factor")?,
                low_freq_factor: req("low_freq_factor")?,
                high_freq_factor: req("high_freq_factor")?,
                original_max_position_embeddings: omax,
            }))
        }
        other => Err(ModelError::config(
            format!("{field}.rope_type"),
            format!("RoPE type {other:?} is not supported (supported: default, llama3)"),
        )),
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
