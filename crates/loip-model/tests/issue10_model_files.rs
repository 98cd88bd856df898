//! Issue 10, finding 8 ("model files"): counts in a GGUF header or an HF `config.json` that
//! no file of that size can back are clear, typed errors naming the field, found before
//! anything is allocated from them (a GGUF `block_count` of 2^31−1 and a `num_hidden_layers`
//! of 2^32 aborted the process on allocation before).

mod common;

use common::{copy_fixture, small_gguf_with, TempDir};
use loip_model::gguf::GgufFile;
use loip_model::safetensors_file::{read_header, read_index};
use loip_model::{Checkpoint, GgufValue, ModelError};
use std::path::Path;

fn open_gguf_bytes(bytes: &[u8]) -> Result<Checkpoint, ModelError> {
    let dir = TempDir::new("issue10");
    let path = dir.join("m.gguf");
    std::fs::write(&path, bytes).unwrap();
    Checkpoint::open(&path)
}

fn assert_config_error(e: &ModelError, want_field: &str) {
    match e {
        ModelError::InvalidConfig { field, .. } => {
            assert_eq!(field, want_field, "{e}")
        }
        other => panic!("expected an invalid-config error naming {want_field}, got {other}"),
    }
}

/// Replaces the integer value of `"key": N` in a config.json text.
fn set_json_field(text: &str, key: &str, value: &str) -> String {
    let mut v: serde_json::Value = serde_json::from_str(text).unwrap();
    v[key] = serde_json::from_str(value).unwrap();
    v.to_string()
}

fn open_tiny_llama_with(key: &str, value: &str) -> Result<Checkpoint, ModelError> {
    let dir = copy_fixture("tiny-llama");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), set_json_field(&text, key, value)).unwrap();
    Checkpoint::open(dir.path())
}

#[test]
fn finding8_gguf_block_count_2_31_minus_1_is_a_clear_error() {
    let e = open_gguf_bytes(&small_gguf_with(&[(
        "llama.block_count",
        GgufValue::U32((1 << 31) - 1),
    )]))
    .unwrap_err();
    assert_config_error(&e, "num_layers");
    assert!(e.to_string().contains("2147483647"), "{e}");
}

#[test]
fn finding8_gguf_block_count_within_bounds_but_past_the_file_is_a_clear_error() {
    // 4000 layers pass the absolute bound but cannot fit a 6 KB file.
    let e = open_gguf_bytes(&small_gguf_with(&[(
        "llama.block_count",
        GgufValue::U32(4000),
    )]))
    .unwrap_err();
    assert_config_error(&e, "num_layers");
    assert!(e.to_string().contains("hold"), "{e}");
}

#[test]
fn finding8_gguf_huge_heads_hidden_vocab_context_are_clear_errors() {
    for (key, field) in [
        ("llama.attention.head_count", "num_heads"),
        ("llama.embedding_length", "hidden_size"),
        ("llama.vocab_size", "vocab_size"),
        ("llama.context_length", "max_position_embeddings"),
        ("llama.feed_forward_length", "intermediate_size"),
    ] {
        let e = open_gguf_bytes(&small_gguf_with(&[(key, GgufValue::U32(u32::MAX))])).unwrap_err();
        // head_count also breaks divisibility/head_dim first; each error must name a field.
        match (&e, key) {
            (ModelError::InvalidConfig { .. }, "llama.attention.head_count") => {}
            _ => assert_config_error(&e, field),
        }
    }
}

#[test]
fn finding8_config_num_hidden_layers_2_32_is_a_clear_error() {
    let e = open_tiny_llama_with("num_hidden_layers", "4294967296").unwrap_err();
    assert_config_error(&e, "num_layers");
    let e = open_tiny_llama_with("num_hidden_layers", "4000").unwrap_err();
    assert_config_error(&e, "num_layers");
    assert!(e.to_string().contains("hold"), "{e}");
}

#[test]
fn finding8_config_huge_heads_hidden_vocab_context_are_clear_errors() {
    for (key, field) in [
        ("num_attention_heads", "num_heads"),
        ("num_key_value_heads", "num_kv_heads"),
        ("head_dim", "head_dim"),
        ("hidden_size", "hidden_size"),
        ("intermediate_size", "intermediate_size"),
        ("vocab_size", "vocab_size"),
        ("max_position_embeddings", "max_position_embeddings"),
    ] {
        let e = open_tiny_llama_with(key, "4294967296").unwrap_err();
        assert_config_error(&e, field);
    }
    // Within the absolute bound, past what the file holds.
    let e = open_tiny_llama_with("vocab_size", "1000000").unwrap_err();
    assert_config_error(&e, "vocab_size");
}

#[test]
fn finding8_gguf_huge_counts_and_lengths_are_clear_errors() {
    let base = small_gguf_with(&[]);
    let path = Path::new("m.gguf");
    // Header: magic, version, tensor_count @8, kv_count @16, then the first key's length @24.
    for (at, what) in [(8usize, "tensor"), (16, "metadata"), (24, "metadata key")] {
        for v in [u64::MAX, 1 << 63, (1 << 32) + 1, (1 << 31) - 1] {
            let mut b = base.clone();
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            let e = GgufFile::parse(&b, path).unwrap_err();
            assert!(
                matches!(
                    e,
                    ModelError::Truncated { .. } | ModelError::BadHeader { .. }
                ),
                "{what} = {v}: {e}"
            );
        }
    }
    // An array length: the tokens array's u64 length follows its element type.
    let key = b"tokenizer.ggml.tokens";
    let at = base.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 4 + 4;
    for v in [u64::MAX, 1 << 40, 1 << 24] {
        let mut b = base.clone();
        b[at..at + 8].copy_from_slice(&v.to_le_bytes());
        let e = GgufFile::parse(&b, path).unwrap_err();
        assert!(e.to_string().contains("array"), "array length {v}: {e}");
    }
    // A string length inside that array.
    for v in [u64::MAX, 1 << 40] {
        let mut b = base.clone();
        b[at + 8..at + 16].copy_from_slice(&v.to_le_bytes());
        let e = GgufFile::parse(&b, path).unwrap_err();
        assert!(e.to_string().contains("string"), "string length {v}: {e}");
    }
}

#[test]
fn finding8_safetensors_huge_header_and_shapes_are_clear_errors() {
    let base = std::fs::read(common::fixture("tiny-llama").join("model.safetensors")).unwrap();
    let path = Path::new("model.safetensors");
    for v in [u64::MAX, 1 << 40, 100_000_001, base.len() as u64] {
        let mut b = base.clone();
        b[..8].copy_from_slice(&v.to_le_bytes());
        assert!(read_header(&b, path).is_err(), "header length {v}");
    }
    // A shape whose element count overflows, and one past the data.
    let header = br#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,16]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(&[0u8; 16]);
    assert!(read_header(&b, path).is_err());
    let header = br#"{"a":{"dtype":"F32","shape":[1073741824],"data_offsets":[0,4294967296]}}"#;
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header);
    b.extend_from_slice(&[0u8; 16]);
    assert!(matches!(
        read_header(&b, path),
        Err(ModelError::DataPastEof { .. })
    ));
}

#[test]
fn finding8_sharded_index_hostile_entries_are_clear_errors() {
    let p = Path::new("model.safetensors.index.json");
    for text in [
        r#"{"weight_map": {"a": "../etc/passwd"}}"#,
        r#"{"weight_map": {"a": "/etc/passwd"}}"#,
        r#"{"weight_map": {"a": 7}}"#,
        r#"{"weight_map": []}"#,
        r#"{"weight_map": {"a": ".hidden"}}"#,
        r#"[]"#,
        "{",
    ] {
        assert!(read_index(text, p).is_err(), "{text}");
    }
    // Many entries naming absent shards: the first one opened is a clear I/O error.
    let dir = copy_fixture("tiny-llama");
    let mut map = serde_json::Map::new();
    for i in 0..10_000 {
        map.insert(format!("t{i}"), format!("shard-{i}.safetensors").into());
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({ "weight_map": map }).to_string(),
    )
    .unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err();
    assert!(matches!(e, ModelError::Io { .. }), "{e}");
}
