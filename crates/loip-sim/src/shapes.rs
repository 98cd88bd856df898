//! Built-in model shapes, from the public `config.json` of each checkpoint
//! (`shared/model-shapes/*.json`), with 16-bit weights and a 16-bit KV cache.
//!
//! These are experiment setup data: the simulator does not read model files.

use crate::error::SimError;
use loip_plan::ModelShape;

/// (name, hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied).
type Dims = (&'static str, u64, u64, u32, u64, u64, u64, u64, bool);
const SHAPES: &[Dims] = &[
    ("llama2-13b", 5120, 13824, 40, 40, 40, 128, 32000, false),
    ("qwen3-32b", 5120, 25600, 64, 64, 8, 128, 151936, false),
    ("llama3.3-70b", 8192, 28672, 80, 64, 8, 128, 128256, false),
    ("llama2-7b", 4096, 11008, 32, 32, 32, 128, 32000, false),
    ("llama-1b", 2048, 5632, 22, 32, 4, 64, 32000, false),
];

/// Names of the built-in shapes.
pub fn shape_names() -> Vec<&'static str> {
    SHAPES.iter().map(|s| s.0).collect()
}

/// The built-in shape called `name` (16-bit weights, 16-bit KV cache).
pub fn shape(name: &str) -> Result<ModelShape, SimError> {
    let &(n, hidden, inter, layers, heads, kv, hd, vocab, tied) = SHAPES
        .iter()
        .find(|s| s.0 == name)
        .ok_or_else(|| SimError::UnknownShape {
            name: name.to_string(),
            known: shape_names().join(", "),
        })?;
    Ok(ModelShape::from_dims(
        n, hidden, inter, layers, heads, kv, hd, vocab, tied, 2.0, 2,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_plausible() {
        for (name, lo, hi) in [
            ("llama2-13b", 25.0, 27.0),
            ("qwen3-32b", 63.0, 68.0),
            ("llama3.3-70b", 140.0, 142.0),
        ] {
            let gb = shape(name).unwrap().total_bytes() as f64 / 1e9;
            assert!((lo..hi).contains(&gb), "{name}: {gb} GB");
        }
        assert!(shape("gpt-5").is_err());
    }
}
