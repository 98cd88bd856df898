//! The planner's view of a real model: dimensions from the config, block bytes from the
//! actual stored tensors (so quantized checkpoints plan with their real sizes).

use loip_model::slice::{Manifest, SliceKind};
use loip_model::{Checkpoint, ModelConfig};
use loip_plan::ModelShape;

/// KV cache element size of this engine: f32, bytes.
pub const KV_DTYPE_BYTES: u64 = 4;

fn base(name: &str, c: &ModelConfig, bytes_per_param: f64) -> ModelShape {
    ModelShape::from_dims(
        name,
        c.hidden_size as u64,
        c.intermediate_size as u64,
        c.num_layers as u32,
        c.num_heads as u64,
        c.num_kv_heads as u64,
        c.head_dim as u64,
        c.vocab_size as u64,
        c.tie_word_embeddings,
        bytes_per_param,
        KV_DTYPE_BYTES,
    )
    .with_sliding_window(c.sliding_window.map(|w| w as u64), c.sliding_layers.clone())
}

/// A preset's shape (16-bit weights).
pub fn shape_from_config(name: &str, c: &ModelConfig, bytes_per_param: f64) -> ModelShape {
    base(name, c, bytes_per_param)
}

/// The shape of a checkpoint, with block sizes summed from its tensors (layer 0's blocks;
/// every layer has the same tensors).
pub fn shape_from_checkpoint(name: &str, ckpt: &Checkpoint) -> ModelShape {
    let c = &ckpt.config;
    let total: u64 = ckpt.tensors.values().map(|t| t.nbytes).sum();
    let params: u64 = ckpt
        .tensors
        .values()
        .map(|t| t.shape.iter().product::<usize>() as u64)
        .sum();
    let mut s = base(name, c, total as f64 / params.max(1) as f64);
    let sum = |kind: SliceKind| -> u64 {
        ckpt.tensors
            .values()
            .filter(|t| loip_model::slice::slice_of(&t.name) == Some(kind))
            .map(|t| t.nbytes)
            .sum()
    };
    s.attn_bytes = sum(SliceKind::Attn(0));
    s.mlp_bytes = sum(SliceKind::Mlp(0));
    s.embed_bytes = sum(SliceKind::Embed);
    s.head_bytes = sum(SliceKind::Head)
        + if c.tie_word_embeddings {
            s.embed_bytes
        } else {
            0
        };
    s
}

/// The shape of a split model, with block sizes from its slice files (what a device reads).
pub fn shape_from_manifest(name: &str, m: &Manifest) -> ModelShape {
    let c = &m.config;
    let size = |k: SliceKind| m.slice(k).map_or(0, |s| s.size);
    let data: u64 = m.slices.iter().map(|s| s.data_bytes()).sum();
    let params: u64 = m
        .slices
        .iter()
        .flat_map(|s| &s.tensors)
        .map(|t| t.shape.iter().product::<usize>() as u64)
        .sum();
    let mut s = base(name, c, data as f64 / params.max(1) as f64);
    s.attn_bytes = size(SliceKind::Attn(0));
    s.mlp_bytes = size(SliceKind::Mlp(0));
    s.embed_bytes = size(SliceKind::Embed);
    s.head_bytes = size(SliceKind::Head)
        + if c.tie_word_embeddings {
            s.embed_bytes
        } else {
            0
        };
    s
}
