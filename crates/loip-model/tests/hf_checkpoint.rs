//! HF safetensors checkpoints: the fixtures, sharding, and every kind of bad input.

mod common;

use common::{copy_fixture, fixture, TempDir};
use loip_kernels::DType;
use loip_model::names::{suffix, EMBED_TOKENS, FINAL_NORM, LM_HEAD};
use loip_model::safetensors_file::{read_header, to_bytes};
use loip_model::{layer_tensor_name, model_tensors, Arch, Checkpoint, Format, ModelError};

#[test]
fn tiny_llama_fixture_opens() {
    let ck = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let c = &ck.config;
    assert_eq!(ck.format, Format::HfSafetensors);
    assert!(!ck.qk_permuted && ck.gguf_metadata.is_none());
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.num_layers),
        (64, 128, 4)
    );
    assert_eq!(
        (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size),
        (4, 2, 16, 256)
    );
    assert_eq!(
        (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings),
        (1e-6, 10000.0, 256)
    );
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.as_slice()),
        (Some(1), &[2u32][..])
    );
    assert!(!c.tie_word_embeddings && !c.qk_norm && c.rope_scaling.is_none());
    for spec in model_tensors(c) {
        let t = ck.tensor_info(&spec.name).unwrap();
        assert_eq!(
            (t.dtype, &t.shape),
            (DType::F32, &spec.shape),
            "{}",
            spec.name
        );
    }
    let k = ck
        .matrix(&layer_tensor_name(3, suffix::K_PROJ), 32, 64)
        .unwrap();
    assert_eq!((k.rows, k.cols, k.data.len()), (32, 64, 32 * 64 * 4));
    assert!(ck.has(LM_HEAD));
    let norm = ck.vector(FINAL_NORM, 64).unwrap();
    assert_eq!(norm.data.len(), 256);
    // A 1-D tensor also reads as a 1 × n matrix.
    assert_eq!(ck.matrix(FINAL_NORM, 1, 64).unwrap().cols, 64);
}

#[test]
fn tiny_qwen3_fixture_opens() {
    let ck = Checkpoint::open(&fixture("tiny-qwen3")).unwrap();
    let c = &ck.config;
    assert_eq!(c.arch, Arch::Qwen3);
    assert!(c.qk_norm);
    assert_eq!((c.bos_token_id, c.eos_token_ids.len()), (None, 0));
    let qn = ck
        .vector(&layer_tensor_name(0, suffix::Q_NORM), 16)
        .unwrap();
    assert_eq!(qn.dtype, DType::F32);
    assert_eq!(ck.tensors.len(), model_tensors(c).len());
}

#[test]
fn tiny_bf16_tied_fixture_opens() {
    let ck = Checkpoint::open(&fixture("tiny-llama-bf16-tied")).unwrap();
    assert!(ck.config.tie_word_embeddings);
    assert!(!ck.has(LM_HEAD));
    let e = ck.matrix(EMBED_TOKENS, 256, 64).unwrap();
    assert_eq!((e.dtype, e.data.len()), (DType::BF16, 256 * 64 * 2));
    assert!(ck.tensors.values().all(|t| t.dtype == DType::BF16));
}

#[test]
fn open_via_file_inside_the_directory() {
    let ck = Checkpoint::open(&fixture("tiny-llama").join("model.safetensors")).unwrap();
    assert_eq!(ck.config.num_layers, 4);
}

#[test]
fn wrong_shape_names_tensor_and_shapes() {
    let ck = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let name = layer_tensor_name(0, suffix::Q_PROJ);
    let e = ck.matrix(&name, 64, 32).unwrap_err();
    match &e {
        ModelError::WrongShape {
            tensor,
            expected,
            actual,
        } => {
            assert_eq!(
                (tensor, expected, actual),
                (&name, &vec![64, 32], &vec![64, 64])
            );
        }
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains("q_proj"), "{e}");
    assert!(matches!(
        ck.vector(&name, 64),
        Err(ModelError::WrongShape { .. })
    ));
}

#[test]
fn missing_tensor_names_tensor_and_path() {
    let ck = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let e = ck
        .tensor_bytes("model.layers.9.mlp.up_proj.weight")
        .unwrap_err();
    assert!(
        matches!(&e, ModelError::MissingTensor { tensor, .. } if tensor == "model.layers.9.mlp.up_proj.weight")
    );
    assert!(e.to_string().contains("tiny-llama"), "{e}");
    assert!(!ck.has("nope"));
}

/// Rewrites the fixture's safetensors without one tensor, or with one tensor reshaped.
fn rewrite(dir: &TempDir, drop: Option<&str>, reshape: Option<(&str, Vec<usize>)>) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let mut out = Vec::new();
    for e in read_header(&bytes, &path).unwrap() {
        if Some(e.name.as_str()) == drop {
            continue;
        }
        let data = bytes[e.offset as usize..(e.offset + e.nbytes) as usize].to_vec();
        let shape = match &reshape {
            Some((n, s)) if *n == e.name => s.clone(),
            _ => e.shape,
        };
        out.push((e.name, e.dtype.unwrap(), shape, data));
    }
    std::fs::write(&path, to_bytes(&out).unwrap()).unwrap();
}

#[test]
fn open_reports_missing_required_tensor() {
    let dir = copy_fixture("tiny-llama");
    let name = layer_tensor_name(2, suffix::DOWN_PROJ);
    rewrite(&dir, Some(&name), None);
    let e = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::MissingTensor { tensor, .. } if *tensor == name),
        "{e}"
    );
}

#[test]
fn open_reports_wrong_shape() {
    let dir = copy_fixture("tiny-llama");
    let name = layer_tensor_name(1, suffix::GATE_PROJ);
    rewrite(&dir, None, Some((&name, vec![64, 128])));
    let e = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::WrongShape { tensor, expected, actual } if *tensor == name && expected == &[128, 64] && actual == &[64, 128]),
        "{e}"
    );
}

#[test]
fn truncated_safetensors() {
    let dir = copy_fixture("tiny-llama");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    // cut inside the data
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err();
    assert!(matches!(e, ModelError::DataPastEof { .. }), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    // cut inside the header
    std::fs::write(&path, &bytes[..100]).unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err();
    assert!(matches!(e, ModelError::Truncated { .. }), "{e}");
    // cut inside the length
    std::fs::write(&path, &bytes[..5]).unwrap();
    assert!(matches!(
        Checkpoint::open(dir.path()).unwrap_err(),
        ModelError::Truncated { .. }
    ));
    // empty
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(
        Checkpoint::open(dir.path()).unwrap_err(),
        ModelError::Truncated { .. }
    ));
}

#[test]
fn header_offsets_past_eof() {
    let dir = copy_fixture("tiny-llama");
    let path = dir.join("model.safetensors");
    // One tensor whose header claims 1 MiB of data; the file has 16 bytes of data.
    let header = br#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[256,1024],"data_offsets":[0,1048576]}}"#;
    let mut f = (header.len() as u64).to_le_bytes().to_vec();
    f.extend_from_slice(header);
    f.extend_from_slice(&[0u8; 16]);
    std::fs::write(&path, &f).unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err();
    match &e {
        ModelError::DataPastEof {
            tensor,
            end,
            file_len,
            ..
        } => {
            assert_eq!(tensor, "model.embed_tokens.weight");
            assert!(end > file_len);
        }
        other => panic!("{other}"),
    }
    // Offsets that do not match the dtype size, and non-JSON headers, are bad headers.
    for header in [
        &br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}}"#[..],
        &br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#[..],
        &b"not json"[..],
    ] {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header);
        f.extend_from_slice(&[0u8; 64]);
        std::fs::write(&path, &f).unwrap();
        let e = Checkpoint::open(dir.path()).unwrap_err();
        assert!(matches!(e, ModelError::BadHeader { .. }), "{e}");
    }
    // A header length beyond the file.
    let mut f = 1_000_000u64.to_le_bytes().to_vec();
    f.extend_from_slice(b"{}");
    std::fs::write(&path, &f).unwrap();
    assert!(matches!(
        Checkpoint::open(dir.path()).unwrap_err(),
        ModelError::Truncated { .. }
    ));
}

#[test]
fn unsupported_dtype_of_a_needed_tensor() {
    let dir = copy_fixture("tiny-llama");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
    // Same byte size: F32 [64] (256 bytes) → I32 [64].
    let v: serde_json::Value = serde_json::from_str(header).unwrap();
    let mut v = v.as_object().unwrap().clone();
    let t = v
        .get_mut("model.norm.weight")
        .unwrap()
        .as_object_mut()
        .unwrap();
    t.insert("dtype".into(), "I32".into());
    let mut h = serde_json::to_string(&v).unwrap().into_bytes();
    while h.len() < n {
        h.push(b' ');
    }
    assert_eq!(h.len(), n, "rewritten header must fit");
    let mut out = bytes.clone();
    out[8..8 + n].copy_from_slice(&h);
    std::fs::write(&path, &out).unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::UnsupportedDtype { tensor, dtype } if tensor == "model.norm.weight" && dtype == "I32"),
        "{e}"
    );
}

#[test]
fn config_errors_surface() {
    let dir = copy_fixture("tiny-llama");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        text.replace("\"llama\"", "\"falcon\""),
    )
    .unwrap();
    assert!(
        matches!(Checkpoint::open(dir.path()).unwrap_err(), ModelError::UnknownArch(a) if a == "falcon")
    );
    std::fs::write(
        dir.join("config.json"),
        text.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
    )
    .unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::InvalidConfig { field, .. } if field == "num_kv_heads"),
        "{e}"
    );
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(matches!(
        Checkpoint::open(dir.path()).unwrap_err(),
        ModelError::Io { .. }
    ));
}

/// Splits the fixture into two shards with an index and checks it opens the same.
#[test]
fn sharded_index() {
    let single = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let dir = TempDir::new("shard");
    let src = fixture("tiny-llama").join("model.safetensors");
    let bytes = std::fs::read(&src).unwrap();
    let entries = read_header(&bytes, &src).unwrap();
    let (a, b) = entries.split_at(entries.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (part, file) in [
        (a, "model-00001-of-00002.safetensors"),
        (b, "model-00002-of-00002.safetensors"),
    ] {
        let tensors: Vec<_> = part
            .iter()
            .map(|e| {
                weight_map.insert(e.name.clone(), file.into());
                (
                    e.name.clone(),
                    e.dtype.clone().unwrap(),
                    e.shape.clone(),
                    bytes[e.offset as usize..(e.offset + e.nbytes) as usize].to_vec(),
                )
            })
            .collect();
        std::fs::write(dir.join(file), to_bytes(&tensors).unwrap()).unwrap();
    }
    std::fs::copy(
        fixture("tiny-llama").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.files.len(), 2);
    assert_eq!(ck.tensors.len(), single.tensors.len());
    for name in single.tensors.keys() {
        assert_eq!(
            ck.tensor_bytes(name).unwrap(),
            single.tensor_bytes(name).unwrap(),
            "{name}"
        );
    }
    assert!(ck.tensors.values().any(|t| t.file == 1));

    // The index pointing a tensor at the wrong shard, or outside the directory, is refused.
    let first = a[0].name.clone();
    let mut bad = weight_map.clone();
    bad.insert(first, "model-00002-of-00002.safetensors".into());
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": bad}).to_string(),
    )
    .unwrap();
    assert!(matches!(
        Checkpoint::open(dir.path()).unwrap_err(),
        ModelError::BadHeader { .. }
    ));
    let mut bad = weight_map.clone();
    bad.insert("x".into(), "../model.safetensors".into());
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": bad}).to_string(),
    )
    .unwrap();
    assert!(matches!(
        Checkpoint::open(dir.path()).unwrap_err(),
        ModelError::BadHeader { .. }
    ));
    // A missing shard file is an I/O error naming it.
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": weight_map}).to_string(),
    )
    .unwrap();
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err();
    assert!(e.to_string().contains("model-00002-of-00002"), "{e}");
}
