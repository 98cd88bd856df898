//! Named model shapes: HF `config.json` files of published checkpoints (weights not included)
//! and a tiny test model, embedded in the binary. Used by the planner, the simulator and
//! [`crate::synth`].

use crate::config::ModelConfig;
use crate::error::ModelError;

const PRESETS: [(&str, &str); 6] = [
    ("tiny", include_str!("../presets/tiny.json")),
    ("llama-1b", include_str!("../presets/llama-1b.json")),
    ("llama2-7b", include_str!("../presets/llama2-7b.json")),
    ("llama2-13b", include_str!("../presets/llama2-13b.json")),
    ("llama3.3-70b", include_str!("../presets/llama3.3-70b.json")),
    ("qwen3-32b", include_str!("../presets/qwen3-32b.json")),
];

const NAMES: [&str; 6] = [
    PRESETS[0].0,
    PRESETS[1].0,
    PRESETS[2].0,
    PRESETS[3].0,
    PRESETS[4].0,
    PRESETS[5].0,
];

/// The preset names, smallest first.
pub fn preset_names() -> &'static [&'static str] {
    &NAMES
}

/// The validated config of a preset.
pub fn preset_config(name: &str) -> Result<ModelConfig, ModelError> {
    let (_, text) =
        PRESETS
            .iter()
            .find(|(n, _)| *n == name)
            .ok_or_else(|| ModelError::UnknownPreset {
                name: name.into(),
                known: NAMES.join(", "),
            })?;
    let cfg = ModelConfig::from_hf_json(text)?;
    cfg.validate()?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, RopeScaling};

    #[test]
    fn every_preset_parses() {
        for name in preset_names() {
            preset_config(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let t = preset_config("tiny").unwrap();
        assert_eq!(
            (
                t.hidden_size,
                t.num_layers,
                t.num_heads,
                t.num_kv_heads,
                t.intermediate_size,
                t.vocab_size
            ),
            (64, 4, 4, 2, 128, 256)
        );
        let q = preset_config("qwen3-32b").unwrap();
        assert_eq!((q.arch, q.head_dim, q.q_dim()), (Arch::Qwen3, 128, 8192));
        let l = preset_config("llama3.3-70b").unwrap();
        assert!(
            matches!(l.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
        assert_eq!(preset_config("llama2-7b").unwrap().head_dim, 128);
        let e = preset_config("gpt-5").unwrap_err();
        assert!(
            e.to_string().contains("gpt-5") && e.to_string().contains("tiny"),
            "{e}"
        );
    }
}
