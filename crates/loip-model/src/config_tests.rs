//! Unit tests of [`super`]: HF `config.json` parsing, validation and round trips.

use super::*;

const LLAMA3: &str = r#"{
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256,
    "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "rms_norm_eps": 1e-05, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]
}"#;

#[test]
fn llama3_rope_scaling_and_eos_list() {
    let c = ModelConfig::from_hf_json(LLAMA3).unwrap();
    c.validate().unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(c.head_dim, 128);
    assert_eq!(c.num_kv_heads, 8);
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(
        c.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        })
    );
    assert_eq!(c.bos_token_id, Some(128000));
    assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
    assert!(!c.qk_norm && !c.tie_word_embeddings);
}

#[test]
fn old_rope_scaling_type_key() {
    let text = LLAMA3.replace("\"rope_type\": \"llama3\"", "\"type\": \"llama3\"");
    let c = ModelConfig::from_hf_json(&text).unwrap();
    assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { .. })));
}

#[test]
fn qwen3_explicit_head_dim() {
    let c = ModelConfig::from_hf_json(
        r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
        "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000,
        "eos_token_id": 151645, "bos_token_id": null, "tie_word_embeddings": false,
        "use_sliding_window": false, "sliding_window": null}"#,
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(c.arch, Arch::Qwen3);
    assert_eq!(c.head_dim, 128);
    assert_eq!(c.q_dim(), 8192);
    assert!(c.qk_norm);
    assert_eq!(c.rope_theta, 1e6);
    assert_eq!(c.eos_token_ids, vec![151645]);
    assert_eq!(c.bos_token_id, None);
    assert_eq!(c.max_position_embeddings, 32768);
}

#[test]
fn rope_parameters_hold_theta_and_llama3() {
    let c = ModelConfig::from_hf_json(
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0,
          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}}"#,
    )
    .unwrap();
    assert_eq!(c.rope_theta, 500000.0);
    assert_eq!(c.head_dim, 16);
    assert_eq!(c.num_kv_heads, 4);
    assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 32.0));
    let d = ModelConfig::from_hf_json(
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
        "rope_parameters": {"rope_theta": 1234.0, "rope_type": "default"}}"#,
    )
    .unwrap();
    assert_eq!(d.rope_theta, 1234.0);
    assert_eq!(d.rope_scaling, None);
}

#[test]
fn unknown_arch_is_named() {
    let e =
        ModelConfig::from_hf_json(r#"{"model_type": "mixtral", "hidden_size": 1}"#).unwrap_err();
    assert!(
        matches!(&e, ModelError::UnknownArch(n) if n == "mixtral"),
        "{e}"
    );
    let e = ModelConfig::from_hf_json(r#"{"architectures": ["GPT2LMHeadModel"]}"#).unwrap_err();
    assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
}

#[test]
fn bad_fields_are_named() {
    let e =
        ModelConfig::from_hf_json(r#"{"model_type": "llama", "hidden_size": "big"}"#).unwrap_err();
    assert!(
        matches!(&e, ModelError::InvalidConfig { field, .. } if field == "hidden_size"),
        "{e}"
    );
    let e = ModelConfig::from_hf_json(r#"{"model_type": "llama", "hidden_size": 64}"#).unwrap_err();
    assert!(e.to_string().contains("num_attention_heads"), "{e}");
    let text = LLAMA3.replace("\"llama3\"", "\"yarn\"");
    let e = ModelConfig::from_hf_json(&text).unwrap_err();
    assert!(e.to_string().contains("rope_scaling.rope_type"), "{e}");
    let e = ModelConfig::from_hf_json("[1, 2]").unwrap_err();
    assert!(matches!(e, ModelError::InvalidConfig { .. }));
    let text = LLAMA3.replace(
        "\"rms_norm_eps\"",
        "\"attention_bias\": true, \"rms_norm_eps\"",
    );
    let e = ModelConfig::from_hf_json(&text).unwrap_err();
    assert!(e.to_string().contains("attention_bias"), "{e}");
}

#[test]
fn validate_names_the_field() {
    let mut c = ModelConfig::from_hf_json(LLAMA3).unwrap();
    c.num_kv_heads = 7;
    let e = c.validate().unwrap_err();
    assert!(
        matches!(&e, ModelError::InvalidConfig { field, .. } if field == "num_kv_heads"),
        "{e}"
    );
    c.num_kv_heads = 0;
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("num_kv_heads"));
    c.num_kv_heads = 8;
    c.rms_norm_eps = f32::NAN;
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("rms_norm_eps"));
    c.rms_norm_eps = 1e-5;
    c.vocab_size = usize::MAX / 2;
    assert!(c.validate().unwrap_err().to_string().contains("vocab_size"));
}

#[test]
fn qwen2_biases_and_mistral_window() {
    let base = r#"{"model_type": "MT", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256X}"#;
    let cfg = |mt: &str, extra: &str| {
        ModelConfig::from_hf_json(&base.replace("MT", mt).replace('X', extra))
    };
    let q = cfg(
        "qwen2",
        r#", "attention_bias": true, "sliding_window": 4096"#,
    )
    .unwrap();
    q.validate().unwrap();
    assert!(q.attn_bias && !q.qk_norm && q.sliding_window.is_none());
    // layer types alone change nothing: HF reads the window only with use_sliding_window
    let t = cfg(
        "qwen2",
        r#", "layer_types": ["full_attention", "sliding_attention"]"#,
    )
    .unwrap();
    assert_eq!((t.layer_window(0), t.layer_window(1)), (None, None));
    let e = cfg(
        "qwen2",
        r#", "layer_types": ["full_attention", "chunked_attention"]"#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("layer_types"), "{e}");
    let m = cfg("mistral", r#", "sliding_window": 4096"#).unwrap();
    m.validate().unwrap();
    assert_eq!(
        (m.arch, m.sliding_window, m.attn_bias),
        (Arch::Mistral, Some(4096), false)
    );
    assert_eq!(
        cfg("mistral", r#", "sliding_window": null"#)
            .unwrap()
            .sliding_window,
        None
    );
    assert_eq!(
        ModelConfig::from_hf_json(&m.to_hf_json("float32")).unwrap(),
        m
    );
    let e = cfg("mistral", r#", "attention_bias": true"#).unwrap_err();
    assert!(e.to_string().contains("attention_bias"), "{e}");
    let mut bad = m.clone();
    bad.arch = Arch::Llama;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("sliding_window"));
    let mut bad = q.clone();
    bad.attn_bias = false;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("attn_bias"));
}

#[test]
fn gemma3_layer_types_rope_and_round_trip() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/tiny-gemma3/config.json"
    ))
    .unwrap();
    let g = ModelConfig::from_hf_json(&text).unwrap();
    g.validate().unwrap();
    assert_eq!(g.arch, Arch::Gemma3);
    assert_eq!(g.sliding_layers, [true, true, true, true, true, false]);
    assert_eq!((g.rope_theta, g.rope_local_theta), (1e6, Some(1e4)));
    assert_eq!(
        (g.sliding_window, g.query_pre_attn_scalar),
        (Some(4), Some(16.0))
    );
    assert!(g.qk_norm && g.norm_plus_one && g.tie_word_embeddings && !g.attn_bias);
    assert_eq!((g.layer_window(0), g.layer_window(5)), (Some(4), None));
    assert_eq!(
        ModelConfig::from_hf_json(&g.to_hf_json("float32")).unwrap(),
        g
    );
    // The older form: a pattern and top-level RoPE bases.
    let mut v: Value = serde_json::from_str(&text).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("layer_types");
    o.remove("rope_parameters");
    o.insert("sliding_window_pattern".into(), Value::from(3));
    o.insert("rope_theta".into(), Value::from(1e6));
    o.insert("rope_local_base_freq".into(), Value::from(1e4));
    let old = ModelConfig::from_hf_json(&v.to_string()).unwrap();
    assert_eq!(old.sliding_layers, [true, true, false, true, true, false]);
    assert_eq!((old.rope_theta, old.rope_local_theta), (1e6, Some(1e4)));
    for (key, val) in [
        ("final_logit_softcapping", Value::from(30.0)),
        ("hidden_activation", Value::from("gelu")),
        ("layer_types", Value::from(vec!["chunked_attention"])),
    ] {
        let mut v: Value = serde_json::from_str(&text).unwrap();
        v[key] = val;
        let e = ModelConfig::from_hf_json(&v.to_string()).unwrap_err();
        assert!(e.to_string().contains(key), "{e}");
    }
    let mut bad = g.clone();
    bad.sliding_layers.pop();
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("sliding_layers"));
}

#[test]
fn hf_json_round_trip() {
    let qwen = LLAMA3
        .replace("\"llama\"", "\"qwen3\"")
        .replace("\"rope_scaling\"", "\"head_dim\": 96, \"x\"");
    for text in [LLAMA3, qwen.as_str()] {
        let c = ModelConfig::from_hf_json(text).unwrap();
        let back = ModelConfig::from_hf_json(&c.to_hf_json("bfloat16")).unwrap();
        assert_eq!(c, back);
    }
}

/// Qwen2/Qwen3 `use_sliding_window`, read as HF's `Qwen2Config` does: the window applies to
/// the layers from `max_window_layers` on (default 28), or to those `layer_types` names; it
/// survives the `config.json` round trip; other architectures and shapes are refused.
#[test]
fn qwen_sliding_window_per_layer() {
    let base = r#"{"model_type": "MT", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 256X}"#;
    let cfg = |mt: &str, extra: &str| {
        ModelConfig::from_hf_json(&base.replace("MT", mt).replace('X', extra))
    };
    let windows = |c: &ModelConfig| {
        (0..c.num_layers)
            .map(|l| c.layer_window(l))
            .collect::<Vec<_>>()
    };
    for mt in ["qwen2", "qwen3"] {
        let on = r#", "use_sliding_window": true, "sliding_window": 8"#;
        let c = cfg(mt, &format!(r#"{on}, "max_window_layers": 2"#)).unwrap();
        c.validate().unwrap();
        assert_eq!(windows(&c), [None, None, Some(8), Some(8)], "{mt}");
        assert!(c.is_sliding_layer(3) && !c.is_sliding_layer(1));
        let back = ModelConfig::from_hf_json(&c.to_hf_json("float32")).unwrap();
        assert_eq!(back, c, "{mt} round trip");
        // every layer slides: one window, no per-layer list; it round-trips too
        let all = cfg(mt, &format!(r#"{on}, "max_window_layers": 0"#)).unwrap();
        assert_eq!((all.sliding_window, all.sliding_layers.len()), (Some(8), 0));
        assert_eq!(
            ModelConfig::from_hf_json(&all.to_hf_json("float32")).unwrap(),
            all
        );
        // the default max_window_layers (28) leaves these 4 layers full
        let none = cfg(mt, on).unwrap();
        assert_eq!((none.sliding_window, none.sliding_layers.len()), (None, 0));
        // off, or no window: full attention whatever the rest says
        let off = cfg(
            mt,
            r#", "use_sliding_window": false, "sliding_window": 8, "max_window_layers": 0"#,
        )
        .unwrap();
        assert_eq!(off.sliding_window, None);
        let null = cfg(
            mt,
            r#", "use_sliding_window": true, "sliding_window": null, "max_window_layers": 0"#,
        )
        .unwrap();
        assert_eq!(null.sliding_window, None);
        // explicit layer types win over max_window_layers
        let t = cfg(
            mt,
            &format!(
                r#"{on}, "max_window_layers": 0, "layer_types":
                ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]"#
            ),
        )
        .unwrap();
        assert_eq!(windows(&t), [Some(8), None, Some(8), None]);
        let e = cfg(mt, &format!(r#"{on}, "layer_types": ["full_attention"]"#)).unwrap_err();
        assert!(e.to_string().contains("layer_types"), "{e}");
        let e = cfg(
            mt,
            r#", "use_sliding_window": true, "sliding_window": 0, "max_window_layers": 0"#,
        )
        .unwrap()
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("sliding_window"), "{e}");
    }
    let mut llama = cfg("llama", "").unwrap();
    llama.sliding_window = Some(8);
    assert!(llama
        .validate()
        .unwrap_err()
        .to_string()
        .contains("sliding_window"));
}

/// A multimodal Gemma 3 `config.json` reads as its text model, by `model_type` or by
/// `architectures[0]`: `text_config`, the keys it leaves out at `Gemma3TextConfig`'s defaults,
/// token ids from the outer config. Without a `text_config` it is a clear error.
#[test]
fn multimodal_gemma3_reads_its_text_model() {
    // the shape of a 4B checkpoint's config.json, which omits most text keys
    let text = r#"{"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106], "bos_token_id": 2,
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
            "intermediate_size": 10240, "num_hidden_layers": 34, "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152}}"#;
    let c = ModelConfig::from_hf_json(text).unwrap();
    c.validate().unwrap();
    assert_eq!(c.arch, Arch::Gemma3);
    let dims = (c.hidden_size, c.intermediate_size, c.num_layers);
    assert_eq!(dims, (2560, 10240, 34));
    let heads = (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size);
    assert_eq!(heads, (8, 4, 256, 262_208));
    assert_eq!(c.sliding_window, Some(1024));
    assert_eq!((c.rope_theta, c.rope_local_theta), (1e6, Some(1e4)));
    assert_eq!(c.query_pre_attn_scalar, Some(256.0));
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.clone()),
        (Some(2), vec![1, 106])
    );
    assert!(c.tie_word_embeddings && c.norm_plus_one && c.qk_norm);
    assert!(c.is_sliding_layer(0) && !c.is_sliding_layer(5) && c.is_sliding_layer(6));

    let bare = r#"{"architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"num_hidden_layers": 2, "eos_token_id": 7}, "eos_token_id": 1}"#;
    let c = ModelConfig::from_hf_json(bare).unwrap();
    assert_eq!(
        (c.arch, c.num_layers, c.hidden_size),
        (Arch::Gemma3, 2, 2304)
    );
    assert_eq!(
        (c.sliding_window, c.eos_token_ids.clone()),
        (Some(4096), vec![7])
    );

    for text in [
        r#"{"model_type": "gemma3", "vision_config": {}}"#,
        r#"{"model_type": "gemma3", "text_config": [1]}"#,
    ] {
        let e = ModelConfig::from_hf_json(text).unwrap_err().to_string();
        assert!(e.contains("text_config"), "{e}");
    }
}
