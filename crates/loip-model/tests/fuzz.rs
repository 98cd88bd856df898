//! Bounded, deterministic fuzzing of every model-file parser a user reaches: seeded mutations
//! of real small files (a project-written GGUF, the tiny fixtures' safetensors and config, a
//! sharded index) never panic and never abort on allocation; each run states how many inputs
//! it tried. The counts are fixed (the whole file runs in about a second) and the seeds are
//! constants, so a failure names the input index that reproduces it.
//!
//! Mutations: byte sets and flips, "interesting" little-endian integers (0, 2^31−1, 2^32,
//! u64::MAX, ...) written over 4 or 8 bytes, truncation, insertion, deletion and duplication of
//! ranges; for the JSON inputs, numbers replaced by interesting numbers. Structure-aware inputs
//! put interesting values into real GGUF metadata keys.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use common::{fixture, small_gguf, small_gguf_with, TempDir};
use loip_model::gguf::GgufFile;
use loip_model::safetensors_file::{read_header, read_index};
use loip_model::tokenizer::Tokenizer;
use loip_model::{Checkpoint, GgufValue, ModelConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const INTERESTING: [u64; 16] = [
    0,
    1,
    2,
    7,
    0x7f,
    0xff,
    0x7fff,
    0xffff,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    1 << 63,
    u64::MAX,
];

/// One random mutation of `b`, edits biased into `b[..focus]` (where the structure is).
fn mutate_once(rng: &mut ChaCha8Rng, b: &mut Vec<u8>, focus: usize) {
    let n = b.len();
    let at = |rng: &mut ChaCha8Rng| {
        if n == 0 {
            0
        } else {
            rng.gen_range(0..focus.clamp(1, n))
        }
    };
    match rng.gen_range(0..8) {
        0 if n > 0 => {
            let i = at(rng);
            b[i] = rng.gen();
        }
        1 if n > 0 => {
            let i = at(rng);
            b[i] ^= 1 << rng.gen_range(0..8);
        }
        2 | 3 if n >= 8 => {
            let v = INTERESTING[rng.gen_range(0..INTERESTING.len())];
            let width = if rng.gen() { 8 } else { 4 };
            let i = at(rng).min(n - width);
            b[i..i + width].copy_from_slice(&v.to_le_bytes()[..width]);
        }
        4 => {
            let cut = rng.gen_range(0..=n);
            b.truncate(cut);
        }
        5 => {
            let i = at(rng).min(n);
            let len = rng.gen_range(1..16);
            let bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            b.splice(i..i, bytes);
        }
        6 if n > 0 => {
            let i = at(rng);
            let len = rng.gen_range(1..=16).min(n - i);
            b.drain(i..i + len);
        }
        _ if n > 0 => {
            let i = at(rng);
            let len = rng.gen_range(1..=32).min(n - i);
            let chunk = b[i..i + len].to_vec();
            let j = at(rng).min(b.len());
            b.splice(j..j, chunk);
        }
        _ => b.push(rng.gen()),
    }
}

/// 1 to 4 mutations of a copy of `base`.
fn mutated(rng: &mut ChaCha8Rng, base: &[u8], focus: usize) -> Vec<u8> {
    let mut b = base.to_vec();
    for _ in 0..rng.gen_range(1..=4) {
        mutate_once(rng, &mut b, focus);
    }
    b
}

/// Replaces 1 to 3 of the JSON numbers in `text` with interesting ones (or a random
/// byte mutation of the text, one time in four).
fn mutated_json(rng: &mut ChaCha8Rng, text: &str) -> Vec<u8> {
    if rng.gen_range(0..4) == 0 {
        return mutated(rng, text.as_bytes(), text.len());
    }
    let starts: Vec<usize> = text
        .char_indices()
        .filter(|&(i, c)| {
            c.is_ascii_digit() && (i == 0 || !text.as_bytes()[i - 1].is_ascii_alphanumeric())
        })
        .map(|(i, _)| i)
        .collect();
    let mut out = text.to_string();
    for _ in 0..rng.gen_range(1..=3) {
        if starts.is_empty() {
            break;
        }
        let s = starts[rng.gen_range(0..starts.len())].min(out.len());
        let Some(rest) = out.get(s..) else { continue };
        let len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == '-'))
            .unwrap_or(rest.len());
        let v = INTERESTING[rng.gen_range(0..INTERESTING.len())];
        let repl = match rng.gen_range(0..4) {
            0 => format!("-{v}"),
            1 => format!("{v}.5"),
            _ => v.to_string(),
        };
        out.replace_range(s..s + len, &repl);
    }
    out.into_bytes()
}

/// Runs `count` inputs through `check` (`true`: the input was accepted), catching panics;
/// prints the counts and fails naming every input that panicked.
fn run(name: &str, seed: u64, count: usize, mut check: impl FnMut(&mut ChaCha8Rng) -> bool) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut ok, mut panics) = (0usize, Vec::new());
    for i in 0..count {
        match catch_unwind(AssertUnwindSafe(|| check(&mut rng))) {
            Ok(true) => ok += 1,
            Ok(false) => {}
            Err(_) => panics.push(i),
        }
    }
    eprintln!(
        "fuzz {name}: {count} inputs (seed {seed}), {ok} accepted, {} refused, {} panics",
        count - ok - panics.len(),
        panics.len()
    );
    assert!(panics.is_empty(), "{name}: inputs {panics:?} panicked");
}

/// Everything a GGUF file goes through before the engine: parse, config, bounds and fit,
/// tokenizer.
fn gguf_pipeline(bytes: &[u8]) -> bool {
    let Ok(f) = GgufFile::parse(bytes, Path::new("m.gguf")) else {
        return false;
    };
    let _ = Tokenizer::from_gguf_metadata(&f.metadata);
    let Ok(cfg) = f.model_config() else {
        return false;
    };
    sized_from(&cfg, bytes.len() as u64)
}

/// Validation and the fit check, then what the open path sizes from an accepted config (a
/// name for every tensor of every layer): `true` when accepted.
fn sized_from(cfg: &ModelConfig, file_bytes: u64) -> bool {
    let ok = cfg.validate().is_ok() && cfg.check_fits(file_bytes).is_ok();
    if ok {
        assert!(!loip_model::model_tensors(cfg).is_empty());
    }
    ok
}

#[test]
fn gguf_parse_never_panics() {
    let base = small_gguf();
    assert!(gguf_pipeline(&base));
    run("gguf bytes", 0x6767_7566, 4000, |rng| {
        gguf_pipeline(&mutated(rng, &base, 700))
    });
}

#[test]
fn gguf_metadata_values_never_panic() {
    const KEYS: [&str; 12] = [
        "llama.block_count",
        "llama.context_length",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.rope.dimension_count",
        "llama.attention.key_length",
        "llama.vocab_size",
        "general.alignment",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
    ];
    run("gguf metadata", 0x6d65_7461, 600, |rng| {
        let mut over = Vec::new();
        for _ in 0..rng.gen_range(1..=3) {
            let v = INTERESTING[rng.gen_range(0..INTERESTING.len())];
            let value = match rng.gen_range(0..6) {
                0 => GgufValue::U64(v),
                1 => GgufValue::I32(v as i32),
                2 => GgufValue::F32(v as f32),
                3 => GgufValue::Str(v.to_string()),
                _ => GgufValue::U32(v as u32),
            };
            over.push((KEYS[rng.gen_range(0..KEYS.len())], value));
        }
        gguf_pipeline(&small_gguf_with(&over))
    });
}

#[test]
fn safetensors_header_never_panics() {
    let path = fixture("tiny-llama").join("model.safetensors");
    let base = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
    let header_text = std::str::from_utf8(&base[8..8 + n]).unwrap().to_string();
    let data = base[8 + n..].to_vec();
    run("safetensors header", 0x7361_6665, 3000, |rng| {
        let bytes = if rng.gen() {
            mutated(rng, &base, n + 8)
        } else {
            let h = mutated_json(rng, &header_text);
            let mut b = (h.len() as u64).to_le_bytes().to_vec();
            b.extend_from_slice(&h);
            b.extend_from_slice(&data);
            b
        };
        read_header(&bytes, &path).is_ok()
    });
}

#[test]
fn config_json_never_panics() {
    let text = std::fs::read_to_string(fixture("tiny-llama").join("config.json")).unwrap();
    let qwen = std::fs::read_to_string(fixture("tiny-qwen3").join("config.json")).unwrap();
    run("config.json", 0x636f_6e66, 3000, |rng| {
        let base = if rng.gen() { &text } else { &qwen };
        let bytes = mutated_json(rng, base);
        let Ok(s) = std::str::from_utf8(&bytes) else {
            return false;
        };
        let Ok(cfg) = ModelConfig::from_hf_json(s) else {
            return false;
        };
        sized_from(&cfg, 727_208)
    });
}

#[test]
fn sharded_index_never_panics() {
    let ck = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let mut map = serde_json::Map::new();
    for (i, name) in ck.tensors.keys().enumerate() {
        map.insert(
            name.clone(),
            format!("model-0000{}-of-00002.safetensors", i % 2 + 1).into(),
        );
    }
    let text =
        serde_json::json!({"metadata": {"total_size": 727000}, "weight_map": map}).to_string();
    let path = Path::new("model.safetensors.index.json");
    assert!(read_index(&text, path).is_ok());
    run("safetensors index", 0x696e_6478, 2000, |rng| {
        let bytes = mutated(rng, text.as_bytes(), text.len());
        match std::str::from_utf8(&bytes) {
            Ok(s) => read_index(s, path).is_ok(),
            Err(_) => false,
        }
    });
}

/// The whole open path (mmap, config, bounds, name map, shape checks, tensor reads) on
/// mutated files on disk.
#[test]
fn checkpoint_open_never_panics() {
    let dir = TempDir::new("fuzz");
    let gguf = small_gguf();
    let st = std::fs::read(fixture("tiny-llama").join("model.safetensors")).unwrap();
    let cfg = std::fs::read_to_string(fixture("tiny-llama").join("config.json")).unwrap();
    let read_all = |ck: &Checkpoint| {
        for name in ck.tensors.keys() {
            let _ = ck.tensor_bytes(name);
        }
    };
    run("checkpoint open", 0x6f70_656e, 150, |rng| {
        let path = dir.join("m.gguf");
        std::fs::write(&path, mutated(rng, &gguf, 700)).unwrap();
        let g = Checkpoint::open(&path).inspect(read_all).is_ok();
        std::fs::write(dir.join("config.json"), mutated_json(rng, &cfg)).unwrap();
        std::fs::write(dir.join("model.safetensors"), mutated(rng, &st, 5000)).unwrap();
        let h = Checkpoint::open(dir.path()).inspect(read_all).is_ok();
        g || h
    });
}

#[test]
fn unmutated_small_gguf_opens() {
    let dir = TempDir::new("fuzz-base");
    let path = dir.join("m.gguf");
    std::fs::write(&path, small_gguf()).unwrap();
    Checkpoint::open(&path).unwrap();
}
