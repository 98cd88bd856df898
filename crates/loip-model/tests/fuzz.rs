//! Random mutations and truncations of small GGUF and safetensors files never panic.

mod common;

use common::{fixture, TempDir};
use loip_model::gguf::GgufFile;
use loip_model::gguf_write::GgufWriter;
use loip_model::safetensors_file::read_header;
use loip_model::{preset_config, Checkpoint, GgufValue};
use proptest::prelude::*;

fn small_gguf() -> Vec<u8> {
    let mut cfg = preset_config("tiny").unwrap();
    cfg.num_layers = 1;
    cfg.hidden_size = 32;
    cfg.intermediate_size = 32;
    cfg.num_heads = 2;
    cfg.num_kv_heads = 1;
    cfg.head_dim = 16;
    cfg.vocab_size = 8;
    cfg.tie_word_embeddings = true;
    let mut w = GgufWriter::new();
    w.llama_metadata(&cfg);
    w.kv(
        "tokenizer.ggml.tokens",
        GgufValue::Array((0..8).map(|i| GgufValue::Str(format!("{i}"))).collect()),
    );
    w.kv(
        "x.nested",
        GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::F64(1.0)])]),
    );
    for spec in loip_model::model_tensors(&cfg) {
        let name = loip_model::gguf::hf_to_gguf_name(&spec.name).unwrap();
        let n: usize = spec.numel();
        if spec.shape.len() == 2 {
            w.tensor(
                name,
                loip_kernels::DType::Q8_0,
                &spec.shape,
                vec![1u8; n / 32 * 34],
            );
        } else {
            w.tensor(
                name,
                loip_kernels::DType::F32,
                &spec.shape,
                vec![0u8; n * 4],
            );
        }
    }
    w.to_bytes().unwrap()
}

fn mutate(mut bytes: Vec<u8>, edits: &[(usize, u8)], cut: Option<usize>) -> Vec<u8> {
    for &(at, v) in edits {
        let n = bytes.len();
        if n > 0 {
            bytes[at % n] = v;
        }
    }
    if let Some(c) = cut {
        let c = c % (bytes.len() + 1);
        bytes.truncate(c);
    }
    bytes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn gguf_parse_never_panics(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8), cut in proptest::option::of(any::<usize>())) {
        let base = small_gguf();
        // Bias edits towards the header, where the structure is.
        let edits: Vec<_> = edits.into_iter().map(|(a, v)| (a % 600, v)).collect();
        let bytes = mutate(base, &edits, cut);
        if let Ok(f) = GgufFile::parse(&bytes, std::path::Path::new("m.gguf")) {
            let _ = f.model_config();
        }
    }

    #[test]
    fn safetensors_header_never_panics(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8), cut in proptest::option::of(any::<usize>())) {
        let path = fixture("tiny-llama").join("model.safetensors");
        let base = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
        let edits: Vec<_> = edits.into_iter().map(|(a, v)| (a % (n + 8), v)).collect();
        let bytes = mutate(base, &edits, cut);
        let _ = read_header(&bytes, &path);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// The whole open path (mmap, config, name map, shape checks) on mutated files.
    #[test]
    fn checkpoint_open_never_panics(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6), cut in proptest::option::of(any::<usize>())) {
        let dir = TempDir::new("fuzz");
        let edits_g: Vec<_> = edits.iter().map(|&(a, v)| (a % 600, v)).collect();
        let path = dir.join("m.gguf");
        std::fs::write(&path, mutate(small_gguf(), &edits_g, cut)).unwrap();
        let _ = Checkpoint::open(&path);
        let st = std::fs::read(fixture("tiny-llama").join("model.safetensors")).unwrap();
        std::fs::copy(fixture("tiny-llama").join("config.json"), dir.join("config.json")).unwrap();
        let edits_s: Vec<_> = edits.iter().map(|&(a, v)| (a % 5000, v)).collect();
        std::fs::write(dir.join("model.safetensors"), mutate(st, &edits_s, cut)).unwrap();
        if let Ok(ck) = Checkpoint::open(dir.path()) {
            for name in ck.tensors.keys() {
                let _ = ck.tensor_bytes(name);
            }
        }
    }
}

#[test]
fn unmutated_small_gguf_opens() {
    let dir = TempDir::new("fuzz-base");
    let path = dir.join("m.gguf");
    std::fs::write(&path, small_gguf()).unwrap();
    Checkpoint::open(&path).unwrap();
}
