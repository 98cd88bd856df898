//! Canonical (Hugging Face) tensor names and the shapes a [`ModelConfig`] implies for them.
//!
//! Every checkpoint, whatever its format, is presented under these names; the engine, the
//! slicer and the synthesizer all take them from here. Shapes are in HF order: a linear
//! layer's weight is `[out_features, in_features]` = `[rows, cols]`, so `y = W x` reads one row
//! per output element.

use crate::config::{Arch, ModelConfig};

/// Token embedding, `[vocab_size, hidden_size]`.
pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
/// Final RMSNorm weight, `[hidden_size]`.
pub const FINAL_NORM: &str = "model.norm.weight";
/// Output projection, `[vocab_size, hidden_size]`; absent when embeddings are tied.
pub const LM_HEAD: &str = "lm_head.weight";

/// Per-layer tensor suffixes; the full name is [`layer_tensor_name`]`(layer, suffix)`.
pub mod suffix {
    /// RMSNorm before attention, `[hidden_size]`
    pub const INPUT_LAYERNORM: &str = "input_layernorm.weight";
    /// `[num_heads * head_dim, hidden_size]`
    pub const Q_PROJ: &str = "self_attn.q_proj.weight";
    /// `[num_kv_heads * head_dim, hidden_size]`
    pub const K_PROJ: &str = "self_attn.k_proj.weight";
    /// `[num_kv_heads * head_dim, hidden_size]`
    pub const V_PROJ: &str = "self_attn.v_proj.weight";
    /// `[hidden_size, num_heads * head_dim]`
    pub const O_PROJ: &str = "self_attn.o_proj.weight";
    /// Qwen2 q bias, `[num_heads * head_dim]`
    pub const Q_BIAS: &str = "self_attn.q_proj.bias";
    /// Qwen2 k bias, `[num_kv_heads * head_dim]`
    pub const K_BIAS: &str = "self_attn.k_proj.bias";
    /// Qwen2 v bias, `[num_kv_heads * head_dim]`
    pub const V_BIAS: &str = "self_attn.v_proj.bias";
    /// Qwen3 per-head RMSNorm on q, `[head_dim]`
    pub const Q_NORM: &str = "self_attn.q_norm.weight";
    /// Qwen3 per-head RMSNorm on k, `[head_dim]`
    pub const K_NORM: &str = "self_attn.k_norm.weight";
    /// RMSNorm before the MLP, `[hidden_size]`; on Gemma 3 the norm of the attention
    /// output, before the residual add (part of the attention block)
    pub const POST_ATTENTION_LAYERNORM: &str = "post_attention_layernorm.weight";
    /// Gemma 3 RMSNorm before the MLP, `[hidden_size]`
    pub const PRE_FEEDFORWARD_LAYERNORM: &str = "pre_feedforward_layernorm.weight";
    /// Gemma 3 RMSNorm of the MLP output, before the residual add, `[hidden_size]`
    pub const POST_FEEDFORWARD_LAYERNORM: &str = "post_feedforward_layernorm.weight";
    /// `[intermediate_size, hidden_size]`
    pub const GATE_PROJ: &str = "mlp.gate_proj.weight";
    /// `[intermediate_size, hidden_size]`
    pub const UP_PROJ: &str = "mlp.up_proj.weight";
    /// `[hidden_size, intermediate_size]`
    pub const DOWN_PROJ: &str = "mlp.down_proj.weight";
}

/// `model.layers.{layer}.{suffix}`.
pub fn layer_tensor_name(layer: usize, suffix: &str) -> String {
    format!("model.layers.{layer}.{suffix}")
}

/// Splits `model.layers.{layer}.{suffix}` into `(layer, suffix)`; `None` for other names.
pub fn parse_layer_tensor_name(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (idx, suffix) = rest.split_once('.')?;
    if idx.is_empty()
        || !idx.bytes().all(|b| b.is_ascii_digit())
        || (idx.len() > 1 && idx.starts_with('0'))
    {
        return None;
    }
    Some((idx.parse().ok()?, suffix))
}

/// Which part of a decoder block a tensor belongs to (the unit of slicing and placement).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorGroup {
    /// embedding table
    Embedding,
    /// `input_layernorm` + q/k/v/o (+ q/k/v biases, q/k norms) of a layer
    Attention(usize),
    /// `post_attention_layernorm` + gate/up/down of a layer
    Mlp(usize),
    /// final norm and LM head
    Head,
}

/// One tensor a model needs: its canonical name and HF shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// HF canonical name
    pub name: String,
    /// HF order: `[rows, cols]` for matrices, `[len]` for vectors
    pub shape: Vec<usize>,
    /// the block it belongs to
    pub group: TensorGroup,
}

impl TensorSpec {
    fn new(name: String, shape: Vec<usize>, group: TensorGroup) -> Self {
        TensorSpec { name, shape, group }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The tensors of decoder block `layer`, attention part first, in checkpoint order.
pub fn layer_tensors(cfg: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
    use suffix::*;
    let (h, q, kv, inter, d) = (
        cfg.hidden_size,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.intermediate_size,
        cfg.head_dim,
    );
    let att = TensorGroup::Attention(layer);
    let mlp = TensorGroup::Mlp(layer);
    let n = |s: &str| layer_tensor_name(layer, s);
    let mut v = vec![
        TensorSpec::new(n(INPUT_LAYERNORM), vec![h], att),
        TensorSpec::new(n(Q_PROJ), vec![q, h], att),
        TensorSpec::new(n(K_PROJ), vec![kv, h], att),
        TensorSpec::new(n(V_PROJ), vec![kv, h], att),
        TensorSpec::new(n(O_PROJ), vec![h, q], att),
    ];
    if cfg.attn_bias {
        v.push(TensorSpec::new(n(Q_BIAS), vec![q], att));
        v.push(TensorSpec::new(n(K_BIAS), vec![kv], att));
        v.push(TensorSpec::new(n(V_BIAS), vec![kv], att));
    }
    if cfg.qk_norm {
        v.push(TensorSpec::new(n(Q_NORM), vec![d], att));
        v.push(TensorSpec::new(n(K_NORM), vec![d], att));
    }
    if cfg.arch == Arch::Gemma3 {
        v.extend([
            TensorSpec::new(n(POST_ATTENTION_LAYERNORM), vec![h], att),
            TensorSpec::new(n(PRE_FEEDFORWARD_LAYERNORM), vec![h], mlp),
        ]);
    } else {
        v.push(TensorSpec::new(n(POST_ATTENTION_LAYERNORM), vec![h], mlp));
    }
    v.extend([
        TensorSpec::new(n(GATE_PROJ), vec![inter, h], mlp),
        TensorSpec::new(n(UP_PROJ), vec![inter, h], mlp),
        TensorSpec::new(n(DOWN_PROJ), vec![h, inter], mlp),
    ]);
    if cfg.arch == Arch::Gemma3 {
        v.push(TensorSpec::new(n(POST_FEEDFORWARD_LAYERNORM), vec![h], mlp));
    }
    v
}

/// Every tensor the model needs, in checkpoint order: embedding, layers 0.., final norm,
/// LM head (unless tied).
pub fn model_tensors(cfg: &ModelConfig) -> Vec<TensorSpec> {
    let mut v = vec![TensorSpec::new(
        EMBED_TOKENS.into(),
        vec![cfg.vocab_size, cfg.hidden_size],
        TensorGroup::Embedding,
    )];
    for layer in 0..cfg.num_layers {
        v.extend(layer_tensors(cfg, layer));
    }
    v.push(TensorSpec::new(
        FINAL_NORM.into(),
        vec![cfg.hidden_size],
        TensorGroup::Head,
    ));
    if !cfg.tie_word_embeddings {
        v.push(TensorSpec::new(
            LM_HEAD.into(),
            vec![cfg.vocab_size, cfg.hidden_size],
            TensorGroup::Head,
        ));
    }
    v
}

/// Where a multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`) keeps its text
/// model: `language_model.model.*` and `language_model.lm_head.*` (transformers before 4.52),
/// or `model.language_model.*` (later); the canonical names drop the prefix.
const TEXT_MODEL_PREFIXES: [(&str, &str); 3] = [
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
];

/// Tensors of a vision tower or its projector: safetensors (`vision_tower.*`,
/// `multi_modal_projector.*`, under `model.` in later transformers) and GGUF (`v.*`, `mm.*`).
const VISION_PREFIXES: [&str; 6] = [
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "v.",
    "mm.",
];

/// Whether a stored tensor belongs to a vision tower or its projector (never read: only the
/// text model runs).
pub fn is_vision_tensor(name: &str) -> bool {
    VISION_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The canonical name of a stored safetensors tensor: a multimodal checkpoint's text-model
/// tensors lose their prefix ([`TEXT_MODEL_PREFIXES`]); other names are kept as stored.
pub fn text_model_name(name: &str) -> String {
    for (stored, canonical) in TEXT_MODEL_PREFIXES {
        if let Some(rest) = name.strip_prefix(stored) {
            return format!("{canonical}{rest}");
        }
    }
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names_round_trip() {
        let n = layer_tensor_name(12, suffix::Q_PROJ);
        assert_eq!(n, "model.layers.12.self_attn.q_proj.weight");
        assert_eq!(parse_layer_tensor_name(&n), Some((12, suffix::Q_PROJ)));
        assert_eq!(parse_layer_tensor_name(EMBED_TOKENS), None);
        assert_eq!(parse_layer_tensor_name("model.layers.01.x"), None);
        assert_eq!(parse_layer_tensor_name("model.layers..x"), None);
        assert_eq!(
            parse_layer_tensor_name("model.layers.99999999999999999999999.x"),
            None
        );
    }

    #[test]
    fn multimodal_text_names_map_to_canonical_ones() {
        for (stored, canonical) in [
            (
                "language_model.model.layers.3.mlp.up_proj.weight",
                "model.layers.3.mlp.up_proj.weight",
            ),
            ("language_model.lm_head.weight", LM_HEAD),
            ("model.language_model.embed_tokens.weight", EMBED_TOKENS),
            ("model.norm.weight", FINAL_NORM),
        ] {
            assert_eq!(text_model_name(stored), canonical);
        }
        assert!(is_vision_tensor(
            "vision_tower.vision_model.post_layernorm.weight"
        ));
        assert!(is_vision_tensor(
            "model.multi_modal_projector.mm_input_projection_weight"
        ));
        assert!(is_vision_tensor("v.blk.0.attn_q.weight"));
        assert!(!is_vision_tensor(EMBED_TOKENS) && !is_vision_tensor("blk.0.attn_v.weight"));
    }
}
