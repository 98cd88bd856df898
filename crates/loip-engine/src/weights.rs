//! Borrowed weight views of one layer's attention and MLP blocks and of the head.
//!
//! A [`TensorSource`] maps canonical (HF) tensor names to bytes: a whole checkpoint's mmap, a
//! slice file, or the loader's slot. Binding a block only checks shapes and records views;
//! nothing is copied or converted.

use loip_kernels::{DType, Matrix};
use loip_model::names::{
    layer_tensor_name as layer_tensor, suffix, EMBED_TOKENS, FINAL_NORM, LM_HEAD,
};
use loip_model::{Arch, Checkpoint, ModelConfig};

use crate::EngineError;

/// Anything that can hand out a named tensor's bytes.
pub trait TensorSource {
    /// The tensor's stored type, shape (HF order, `[rows, cols]` for matrices) and bytes.
    fn tensor(&self, name: &str) -> Result<(DType, Vec<usize>, &[u8]), EngineError>;
}

impl TensorSource for Checkpoint {
    fn tensor(&self, name: &str) -> Result<(DType, Vec<usize>, &[u8]), EngineError> {
        let bytes = self.tensor_bytes(name)?;
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| EngineError::Invalid(format!("tensor {name} missing")))?;
        Ok((info.dtype, info.shape.clone(), bytes))
    }
}

fn matrix<'a, S: TensorSource + ?Sized>(
    src: &'a S,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Matrix<'a>, EngineError> {
    let (dtype, shape, bytes) = src.tensor(name)?;
    if shape != [rows, cols] {
        return Err(EngineError::WrongShape {
            name: name.to_string(),
            expected: vec![rows, cols],
            actual: shape,
        });
    }
    Ok(Matrix::new(dtype, rows, cols, bytes)?)
}

fn vector<'a, S: TensorSource + ?Sized>(
    src: &'a S,
    name: &str,
    len: usize,
) -> Result<Matrix<'a>, EngineError> {
    let (dtype, shape, bytes) = src.tensor(name)?;
    if shape != [len] {
        return Err(EngineError::WrongShape {
            name: name.to_string(),
            expected: vec![len],
            actual: shape,
        });
    }
    Ok(Matrix::new(dtype, 1, len, bytes)?)
}

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
    /// (1, n_heads * head_dim), Qwen2 only (`q_proj.bias`)
    pub q_bias: Option<Matrix<'a>>,
    /// (1, n_kv_heads * head_dim), Qwen2 only
    pub k_bias: Option<Matrix<'a>>,
    /// (1, n_kv_heads * head_dim), Qwen2 only
    pub v_bias: Option<Matrix<'a>>,
    /// (1, head_dim), Qwen3 and Gemma 3
    pub q_norm: Option<Matrix<'a>>,
    /// (1, head_dim), Qwen3 and Gemma 3
    pub k_norm: Option<Matrix<'a>>,
    /// (1, hidden), Gemma 3 only: norm of the attention output before the residual add
    /// (`post_attention_layernorm`)
    pub post_norm: Option<Matrix<'a>>,
}

impl<'a> AttnWeights<'a> {
    /// Binds layer `layer`'s attention tensors from `src`, checking every shape.
    pub fn bind<S: TensorSource + ?Sized>(
        src: &'a S,
        cfg: &ModelConfig,
        layer: usize,
    ) -> Result<Self, EngineError> {
        let h = cfg.hidden_size;
        let qd = cfg.num_heads * cfg.head_dim;
        let kvd = cfg.num_kv_heads * cfg.head_dim;
        let n = |s: &str| layer_tensor(layer, s);
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(vector(src, &n(suffix::Q_NORM), cfg.head_dim)?),
                Some(vector(src, &n(suffix::K_NORM), cfg.head_dim)?),
            )
        } else {
            (None, None)
        };
        let gemma = cfg.arch == Arch::Gemma3;
        let bias = |s: &str, len: usize| -> Result<Option<Matrix<'a>>, EngineError> {
            cfg.attn_bias.then(|| vector(src, &n(s), len)).transpose()
        };
        Ok(AttnWeights {
            q_bias: bias(suffix::Q_BIAS, qd)?,
            k_bias: bias(suffix::K_BIAS, kvd)?,
            v_bias: bias(suffix::V_BIAS, kvd)?,
            input_norm: vector(src, &n(suffix::INPUT_LAYERNORM), h)?,
            q: matrix(src, &n(suffix::Q_PROJ), qd, h)?,
            k: matrix(src, &n(suffix::K_PROJ), kvd, h)?,
            v: matrix(src, &n(suffix::V_PROJ), kvd, h)?,
            o: matrix(src, &n(suffix::O_PROJ), h, qd)?,
            q_norm,
            k_norm,
            post_norm: gemma
                .then(|| vector(src, &n(suffix::POST_ATTENTION_LAYERNORM), h))
                .transpose()?,
        })
    }
}

/// One layer's MLP block.
#[derive(Debug, Clone, Copy)]
pub struct MlpWeights<'a> {
    /// (1, hidden), the norm before the MLP (`post_attention_layernorm`; Gemma 3
    /// `pre_feedforward_layernorm`)
    pub post_norm: Matrix<'a>,
    /// (1, hidden), Gemma 3 only: norm of the MLP output before the residual add
    /// (`post_feedforward_layernorm`)
    pub out_norm: Option<Matrix<'a>>,
    /// (intermediate, hidden)
    pub gate: Matrix<'a>,
    /// (intermediate, hidden)
    pub up: Matrix<'a>,
    /// (hidden, intermediate)
    pub down: Matrix<'a>,
}

impl<'a> MlpWeights<'a> {
    /// Binds layer `layer`'s MLP tensors from `src`, checking every shape.
    pub fn bind<S: TensorSource + ?Sized>(
        src: &'a S,
        cfg: &ModelConfig,
        layer: usize,
    ) -> Result<Self, EngineError> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let n = |s: &str| layer_tensor(layer, s);
        let gemma = cfg.arch == Arch::Gemma3;
        let pre = if gemma {
            suffix::PRE_FEEDFORWARD_LAYERNORM
        } else {
            suffix::POST_ATTENTION_LAYERNORM
        };
        Ok(MlpWeights {
            post_norm: vector(src, &n(pre), h)?,
            out_norm: gemma
                .then(|| vector(src, &n(suffix::POST_FEEDFORWARD_LAYERNORM), h))
                .transpose()?,
            gate: matrix(src, &n(suffix::GATE_PROJ), i, h)?,
            up: matrix(src, &n(suffix::UP_PROJ), i, h)?,
            down: matrix(src, &n(suffix::DOWN_PROJ), h, i)?,
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
    pub fn bind<S: TensorSource + ?Sized>(
        src: &'a S,
        cfg: &ModelConfig,
        layer: usize,
    ) -> Result<Self, EngineError> {
        Ok(LayerWeights {
            attn: AttnWeights::bind(src, cfg, layer)?,
            mlp: MlpWeights::bind(src, cfg, layer)?,
        })
    }
}

/// Binds the token embedding, (vocab, hidden).
pub fn bind_embedding<'a, S: TensorSource + ?Sized>(
    src: &'a S,
    cfg: &ModelConfig,
) -> Result<Matrix<'a>, EngineError> {
    matrix(src, EMBED_TOKENS, cfg.vocab_size, cfg.hidden_size)
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
    pub fn bind<S: TensorSource + ?Sized>(
        src: &'a S,
        cfg: &ModelConfig,
    ) -> Result<Self, EngineError> {
        let name = if cfg.tie_word_embeddings {
            EMBED_TOKENS
        } else {
            LM_HEAD
        };
        Ok(HeadWeights {
            norm: vector(src, FINAL_NORM, cfg.hidden_size)?,
            lm_head: matrix(src, name, cfg.vocab_size, cfg.hidden_size)?,
        })
    }
}
