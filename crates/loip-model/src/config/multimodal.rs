//! The text part of a multimodal Gemma 3 `config.json` (`model_type` `gemma3`,
//! `Gemma3ForConditionalGeneration`): its `text_config`, as transformers resolves it. Keys the
//! file leaves out take `Gemma3TextConfig`'s defaults (real checkpoints omit most of them);
//! token ids and head tying come from the outer config where the inner one has none. The vision
//! tower's config is not read (its tensors are skipped when the checkpoint opens).

use serde_json::{Map, Value};

use crate::error::ModelError;

/// `Gemma3TextConfig`'s defaults for the keys the engine reads.
fn text_defaults() -> [(&'static str, Value); 16] {
    [
        ("vocab_size", 262_208.into()),
        ("hidden_size", 2304.into()),
        ("intermediate_size", 9216.into()),
        ("num_hidden_layers", 26.into()),
        ("num_attention_heads", 8.into()),
        ("num_key_value_heads", 4.into()),
        ("head_dim", 256.into()),
        ("max_position_embeddings", 131_072.into()),
        ("rms_norm_eps", 1e-6.into()),
        ("rope_theta", 1_000_000.0.into()),
        ("rope_local_base_freq", 10_000.0.into()),
        ("query_pre_attn_scalar", 256.into()),
        ("sliding_window", 4096.into()),
        ("hidden_activation", "gelu_pytorch_tanh".into()),
        ("bos_token_id", 2.into()),
        ("eos_token_id", 1.into()),
    ]
}

/// Keys the outer config may hold for the whole model.
const INHERITED: [&str; 3] = ["bos_token_id", "eos_token_id", "tie_word_embeddings"];

/// Whether `obj` is a multimodal Gemma 3 config (by `model_type`, else `architectures[0]`).
pub(super) fn is_multimodal_gemma3(obj: &Map<String, Value>) -> bool {
    match obj.get("model_type").and_then(Value::as_str) {
        Some(mt) => mt == "gemma3",
        None => {
            obj.get("architectures")
                .and_then(Value::as_array)
                .and_then(|a| a.first())
                .and_then(Value::as_str)
                == Some("Gemma3ForConditionalGeneration")
        }
    }
}

/// The `gemma3_text` config of a multimodal Gemma 3 config: `text_config` with the defaults
/// and inherited keys filled in. The RoPE base of the full-attention layers is not filled when
/// `rope_parameters` (transformers ≥ 5) carries it.
pub(super) fn gemma3_text_config(
    obj: &Map<String, Value>,
) -> Result<Map<String, Value>, ModelError> {
    let mut text = match obj.get("text_config") {
        Some(Value::Object(t)) => t.clone(),
        Some(other) => {
            return Err(ModelError::config(
                "text_config",
                format!("expected an object, got {other}"),
            ))
        }
        None => {
            return Err(ModelError::config(
                "text_config",
                "missing (a multimodal gemma3 config keeps its text model there)",
            ))
        }
    };
    for key in INHERITED {
        match (text.get(key), obj.get(key)) {
            (None | Some(Value::Null), Some(v)) if !v.is_null() => {
                text.insert(key.into(), v.clone());
            }
            _ => {}
        }
    }
    let rope_in_parameters = text.contains_key("rope_parameters");
    for (key, value) in text_defaults() {
        let carried_elsewhere =
            rope_in_parameters && matches!(key, "rope_theta" | "rope_local_base_freq");
        if !text.contains_key(key) && !carried_elsewhere {
            text.insert(key.into(), value);
        }
    }
    text.insert("model_type".into(), "gemma3_text".into());
    text.remove("architectures");
    Ok(text)
}
