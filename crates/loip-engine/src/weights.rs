//! Borrowed weight views of one layer's attention and MLP blocks and of the head.
//!
//! A [`TensorSource`] maps canonical (HF) tensor names to bytes: a whole checkpoint's mmap, a
//! slice file, or the loader's slot. Binding a block only checks shapes and records views;
//! nothing is copied or converted.

use loip_kernels::{DType, Matrix};
use loip_model::{Checkpoint, ModelConfig};

use crate::EngineError;

/// Anything that can hand out a named tensor's bytes.
pub trait TensorSource {
    /// The tensor's stored type, shape (HF order, `[rows, cols]` for matrices) and bytes.
    fn tensor(&self, name: &str) -> Result<(DType, Vec<usize>, &[u8]), EngineError>;
}

impl TensorSource for Checkpoint {
    fn tensor(&self, name: &str) -> Result<(DType, Vec<usize>, &[u8]), EngineError> {
        let bytes = self.tensor_bytes(name)?;
        let info = self.tensors.get(name).ok_or_else(|| EngineError::Invalid(format!("tensor {name} missing")))?;
        Ok((info.dtype, info.shape.clone(), bytes))
    }
}

fn matrix<'a, S: TensorSource + ?Sized>(src: &'a S, name: &str, rows: usize, cols: usize) -> Result<Matrix<'a>, EngineError> {
    let (dtype, shape, bytes) = src.tensor(name)?;
    if shape != [rows, cols] {
        return Err(EngineError::WrongShape { name: name.to_string(), expected: vec![rows, cols], actual: shape });
    }
    Ok(Matrix::new(dtype, rows, cols, bytes)?)
}

fn vector<'a, S: TensorSource + ?Sized>(src: &'a S, name: &str, len: usize) -> Result<Matrix<'a>, EngineError> {
    let (dtype, shape, bytes) = src.tensor(name)?;
    if shape != [len] {
        return Err(EngineError::WrongShape { name: name.to_string(), expected: vec![len], actual: shape });
    }
    Ok(Matrix::new(dtype, 1, len, bytes)?)
}

/// Canonical name of a per-layer tensor, e.g. `model.layers.3.self_attn.q_proj.weight`.
pub fn layer_tensor(layer: usize, suffix: &str) -> String {
    format!("model.layers.{layer}.{suffix}")
}

/// Suffixes of the attention block's tensors (norm included), in file order.
pub const ATTN_TENSORS: [&str; 7] = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
];

/// Suffixes of the MLP block's tensors (norm included), in file order.
pub const MLP_TENSORS: [&str; 4] = [
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];

/// One layer's attention block.
#[derive(Debug, Clone, Copy)]
pub struct AttnWeights<'a> {
    /// (1, hidden)
    pub input_norm: Matrix<'a>,
    /// (n_heads * head_dim, hidden)
    pub q: Matrix<'a>,
    /// (n_kv_heads * head_dim, hidden)
    pub k: Matrix<'a>,
    /// (n_kv_heads * head_dim, hidden)
    pub v: Matrix<'a>,
    /// (hidden, n_heads * head_dim)
    pub o: Matrix<'a>,
    /// (1, head_dim), Qwen3 only
    pub q_norm: Option<Matrix<'a>>,
    /// (1, head_dim), Qwen3 only
    pub k_norm: Option<Matrix<'a>>,
}

impl<'a> AttnWeights<'a> {
    /// Binds layer `layer`'s attention tensors from `src`, checking every shape.
    pub fn bind<S: TensorSource + ?Sized>(src: &'a S, cfg: &ModelConfig, layer: usize) -> Result<Self, EngineError> {
        let h = cfg.hidden_size;
        let qd = cfg.num_heads * cfg.head_dim;
        let kvd = cfg.num_kv_heads * cfg.head_dim;
        let n = |s: &str| layer_tensor(layer, s);
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(vector(src, &n("self_attn.q_norm.weight"), cfg.head_dim)?),
                Some(vector(src, &n("self_attn.k_norm.weight"), cfg.head_dim)?),
            )
        } else {
            (None, None)
        };
        Ok(AttnWeights {
            input_norm: vector(src, &n("input_layernorm.weight"), h)?,
            q: matrix(src, &n("self_attn.q_proj.weight"), qd, h)?,
            k: matrix(src, &n("self_attn.k_proj.weight"), kvd, h)?,
            v: matrix(src, &n("self_attn.v_proj.weight"), kvd, h)?,
            o: matrix(src, &n("self_attn.o_proj.weight"), h, qd)?,
            q_norm,
            k_norm,
        })
    }
}

/// One layer's MLP block.
#[derive(Debug, Clone, Copy)]
pub struct MlpWeights<'a> {
    /// (1, hidden)
    pub post_norm: Matrix<'a>,
    /// (intermediate, hidden)
    pub gate: Matrix<'a>,
    /// (intermediate, hidden)
    pub up: Matrix<'a>,
    /// (hidden, intermediate)
    pub down: Matrix<'a>,
}

impl<'a> MlpWeights<'a> {
    /// Binds layer `layer`'s MLP tensors from `src`, checking every shape.
    pub fn bind<S: TensorSource + ?Sized>(src: &'a S, cfg: &ModelConfig, layer: usize) -> Result<Self, EngineError> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let n = |s: &str| layer_tensor(layer, s);
        Ok(MlpWeights {
            post_norm: vector(src, &n("post_attention_layernorm.weight"), h)?,
            gate: matrix(src, &n("mlp.gate_proj.weight"), i, h)?,
            up: matrix(src, &n("mlp.up_proj.weight"), i, h)?,
            down: matrix(src, &n("mlp.down_proj.weight"), h, i)?,
        })
    }
}

/// A whole decoder layer.
#[derive(Debug, Clone, Copy)]
pub struct LayerWeights<'a> {
    /// attention block
    pub attn: AttnWeights<'a>,
    /// MLP block
    pub mlp: MlpWeights<'a>,
}

impl<'a> LayerWeights<'a> {
    /// Binds both blocks of layer `layer`.
    pub fn bind<S: TensorSource + ?Sized>(src: &'a S, cfg: &ModelConfig, layer: usize) -> Result<Self, EngineError> {
        Ok(LayerWeights { attn: AttnWeights::bind(src, cfg, layer)?, mlp: MlpWeights::bind(src, cfg, layer)? })
    }
}

/// Name of the token embedding.
pub const EMBED_TENSOR: &str = "model.embed_tokens.weight";
/// Name of the final norm.
pub const NORM_TENSOR: &str = "model.norm.weight";
/// Name of the untied LM head.
pub const LM_HEAD_TENSOR: &str = "lm_head.weight";

/// Binds the token embedding, (vocab, hidden).
pub fn bind_embedding<'a, S: TensorSource + ?Sized>(src: &'a S, cfg: &ModelConfig) -> Result<Matrix<'a>, EngineError> {
    matrix(src, EMBED_TENSOR, cfg.vocab_size, cfg.hidden_size)
}

/// Final norm and LM head.
#[derive(Debug, Clone, Copy)]
pub struct HeadWeights<'a> {
    /// (1, hidden)
    pub norm: Matrix<'a>,
    /// (vocab, hidden); the embedding when tied
    pub lm_head: Matrix<'a>,
}

impl<'a> HeadWeights<'a> {
    /// Binds the final norm and the LM head (the embedding when the config ties them).
    pub fn bind<S: TensorSource + ?Sized>(src: &'a S, cfg: &ModelConfig) -> Result<Self, EngineError> {
        let name = if cfg.tie_word_embeddings { EMBED_TENSOR } else { LM_HEAD_TENSOR };
        Ok(HeadWeights {
            norm: vector(src, NORM_TENSOR, cfg.hidden_size)?,
            lm_head: matrix(src, name, cfg.vocab_size, cfg.hidden_size)?,
        })
    }
}
