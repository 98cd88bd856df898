//! Golden tests: the engine against HF transformers float32 references, and the lossless
//! invariants (step grouping and micro-batching never change a token's logits). The families
//! beyond Llama go through every format the engine reads: each tiny HF fixture converted to
//! GGUF as llama.cpp's converter lays it out (`qwen2` with q/k/v biases, `qwen3` with q/k
//! norms, both in HF row order; Mistral as `llama`, q/k permuted) gives the HF logits; and
//! Mistral's sliding window is honoured when set.

use std::path::PathBuf;

use loip_engine::generate::{generate, Flow};
use loip_engine::{GenerateOptions, Generator, KvCache, Model, SamplingParams, TokenPos};
use loip_model::gguf_write::GgufWriter;
use loip_model::{Arch, Checkpoint};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn expected(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

const TINY: [&str; 6] = [
    "tiny-llama",
    "tiny-qwen3",
    "tiny-llama-bf16-tied",
    "tiny-qwen2",
    "tiny-mistral",
    "tiny-gemma3",
];

#[test]
fn tiny_fixtures_logits_match_reference_at_every_position() {
    for name in TINY {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let model = Model::from_checkpoint(&ckpt).unwrap();
        let exp = expected(name);
        let input = ids(&exp["input_ids"]);
        let logits = model.prompt_logits(&input).unwrap();
        let worst = worst_diff(&logits, &exp);
        assert!(worst <= 1e-4, "{name}: max |logit diff| = {worst}");
    }
}

#[test]
fn tiny_fixtures_greedy_tokens_match_reference() {
    for name in TINY {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let model = Model::from_checkpoint(&ckpt).unwrap();
        let exp = expected(name);
        let want = ids(&exp["greedy_new_ids"]);
        let mut gen = Generator::new(&model, None);
        let opts = GenerateOptions {
            max_tokens: want.len(),
            sampling: SamplingParams::default(),
            eos_ids: ckpt.config.eos_token_ids.clone(),
            min_tokens: want.len(),
        };
        let out = generate(&mut gen, 0, &ids(&exp["input_ids"]), &opts, &mut |_| {
            Flow::Continue
        })
        .unwrap();
        assert_eq!(out.new_ids, want, "{name}");
    }
}

#[test]
fn step_grouping_and_micro_batching_are_bit_identical() {
    let ckpt = Checkpoint::open(&fixture("tiny-qwen3")).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let prompt = ids(&expected("tiny-qwen3")["input_ids"]);
    let full = model.prompt_logits(&prompt).unwrap();
    let vocab = ckpt.config.vocab_size;

    // One token per step.
    let mut kv = model.new_cache(None);
    for (p, &id) in prompt.iter().enumerate() {
        let x = model
            .forward_hidden(&[id], &[TokenPos { seq: 0, pos: p }], &mut kv)
            .unwrap();
        let l = model.logits(&x, &[0]).unwrap();
        assert_eq!(l, full[p * vocab..(p + 1) * vocab], "position {p}");
    }

    // Three sequences interleaved in one micro-batch, at different positions.
    let mut kv = KvCache::new(0..ckpt.config.num_layers, model.tf.kv_dim(), None);
    let other: Vec<u32> = prompt.iter().rev().copied().collect();
    let x = model
        .forward_hidden(
            &other[..3],
            &[0, 1, 2].map(|pos| TokenPos { seq: 7, pos }),
            &mut kv,
        )
        .unwrap();
    drop(x);
    let mut batch_ids = vec![];
    let mut batch = vec![];
    for (p, &id) in prompt.iter().enumerate().take(4) {
        batch_ids.push(id);
        batch.push(TokenPos { seq: 1, pos: p });
    }
    batch_ids.push(other[3]);
    batch.push(TokenPos { seq: 7, pos: 3 });
    let x = model.forward_hidden(&batch_ids, &batch, &mut kv).unwrap();
    let l = model.logits(&x, &[0, 1, 2, 3]).unwrap();
    assert_eq!(l, full[..4 * vocab]);
    let alone = model.prompt_logits(&other[..4]).unwrap();
    assert_eq!(model.logits(&x, &[4]).unwrap(), alone[3 * vocab..]);
}

/// A sliding-window layer's prompt runs (whole, or chunks starting inside and past the
/// window) give the logits of one token per step, bit for bit.
#[test]
fn sliding_prompt_runs_are_bit_identical_to_one_token_steps() {
    for (name, window) in [("tiny-gemma3", None), ("tiny-mistral", Some(3))] {
        let ck = Checkpoint::open(&fixture(name)).unwrap();
        let mut cfg = ck.config.clone();
        if window.is_some() {
            cfg.sliding_window = window;
            cfg.validate().unwrap();
        }
        assert!(cfg.sliding_window.is_some(), "{name}");
        let model = Model::bind(&ck, &cfg, ck.qk_permuted).unwrap();
        let base = ids(&expected(name)["input_ids"]);
        let vocab = cfg.vocab_size;
        // long enough for several windows
        let prompt: Vec<u32> = base.iter().cycle().take(3 * base.len()).copied().collect();
        let mut kv = model.new_cache(None);
        let mut steps = Vec::new();
        for (p, &id) in prompt.iter().enumerate() {
            let x = model
                .forward_hidden(&[id], &[TokenPos { seq: 0, pos: p }], &mut kv)
                .unwrap();
            steps.extend(model.logits(&x, &[0]).unwrap());
        }
        assert_eq!(
            model.prompt_logits(&prompt).unwrap(),
            steps,
            "{name}: whole"
        );
        for chunk in [2, 5, 9] {
            let mut kv = model.new_cache(None);
            let mut got = Vec::new();
            for (c, part) in prompt.chunks(chunk).enumerate() {
                let pos: Vec<TokenPos> = (0..part.len())
                    .map(|i| TokenPos {
                        seq: 0,
                        pos: c * chunk + i,
                    })
                    .collect();
                let x = model.forward_hidden(part, &pos, &mut kv).unwrap();
                let rows: Vec<usize> = (0..part.len()).collect();
                got.extend(model.logits(&x, &rows).unwrap());
            }
            assert_eq!(got.len(), prompt.len() * vocab);
            assert_eq!(got, steps, "{name}: chunks of {chunk}");
        }
    }
}

#[test]
fn bad_token_id_and_kv_budget_are_errors() {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    assert!(model.prompt_logits(&[1, 999]).is_err());
    let mut kv = model.new_cache(Some(100));
    let err = model.forward_hidden(
        &[1, 2],
        &[TokenPos { seq: 0, pos: 0 }, TokenPos { seq: 0, pos: 1 }],
        &mut kv,
    );
    assert!(
        matches!(err, Err(loip_engine::EngineError::KvBudget { .. })),
        "{err:?}"
    );
    assert_eq!(kv.used_bytes(), 0);
}

fn worst_diff(logits: &[f32], exp: &Value) -> f32 {
    let mut worst = 0f32;
    let rows = exp["logits"].as_array().unwrap();
    let vocab = logits.len() / rows.len();
    for (p, row) in rows.iter().enumerate() {
        for (j, v) in row.as_array().unwrap().iter().enumerate() {
            worst = worst.max((logits[p * vocab + j] - v.as_f64().unwrap() as f32).abs());
        }
    }
    worst
}

#[test]
fn converted_gguf_of_each_family_gives_the_hf_logits() {
    let dir = std::env::temp_dir().join(format!("loip-golden-families-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, arch, gguf_arch) in [
        ("tiny-qwen2", Arch::Qwen2, "qwen2"),
        ("tiny-qwen3", Arch::Qwen3, "qwen3"),
        ("tiny-mistral", Arch::Mistral, "llama"),
        ("tiny-gemma3", Arch::Gemma3, "gemma3"),
    ] {
        let hf = Checkpoint::open(&fixture(name)).unwrap();
        assert_eq!(hf.config.arch, arch, "{name}");
        let path = dir.join(format!("{name}.gguf"));
        GgufWriter::from_checkpoint(&hf)
            .unwrap()
            .write(&path)
            .unwrap();
        let gg = Checkpoint::open(&path).unwrap();
        let meta = gg.gguf_metadata.as_ref().unwrap();
        assert_eq!(meta.architecture(), Some(gguf_arch), "{name}");
        assert_eq!(gg.qk_permuted, gguf_arch == "llama", "{name}");
        assert_eq!(gg.config.attn_bias, arch == Arch::Qwen2, "{name}");
        let qk_norm = matches!(arch, Arch::Qwen3 | Arch::Gemma3);
        assert_eq!(gg.config.qk_norm, qk_norm, "{name}");
        let (mut a_cfg, mut g_cfg) = (hf.config.clone(), gg.config.clone());
        // A Gemma GGUF stores its norms as 1 + w, a Mistral one says llama; nothing else may
        // differ.
        a_cfg.arch = g_cfg.arch;
        (a_cfg.norm_plus_one, g_cfg.norm_plus_one) = (false, false);
        (a_cfg.eos_token_ids, g_cfg.eos_token_ids) = (vec![], vec![]);
        assert_eq!(a_cfg, g_cfg, "{name}");

        let exp = expected(name);
        let input = ids(&exp["input_ids"]);
        let a = Model::from_checkpoint(&hf)
            .unwrap()
            .prompt_logits(&input)
            .unwrap();
        let b = Model::from_checkpoint(&gg)
            .unwrap()
            .prompt_logits(&input)
            .unwrap();
        let (da, db) = (worst_diff(&a, &exp), worst_diff(&b, &exp));
        assert!(da <= 1e-4 && db <= 1e-4, "{name}: HF {da}, GGUF {db}");
        if gguf_arch != "llama" {
            // Same rows, same order, same kernels: the same bits.
            assert_eq!(a, b, "{name}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Positions before `w` give the same logits as `full` (a window of `w` still sees all of
/// them), every later one differs.
fn assert_first_equal_then_differ(windowed: &[f32], full: &[f32], vocab: usize, w: usize) {
    assert_eq!(windowed[..w * vocab], full[..w * vocab]);
    for p in w..full.len() / vocab {
        let row = p * vocab..(p + 1) * vocab;
        assert_ne!(windowed[row.clone()], full[row], "{p}");
    }
}

#[test]
fn mistral_sliding_window_is_honoured() {
    let ck = Checkpoint::open(&fixture("tiny-mistral")).unwrap();
    assert_eq!(ck.config.sliding_window, None);
    let input = ids(&expected("tiny-mistral")["input_ids"]);
    let n = input.len();
    let vocab = ck.config.vocab_size;
    let full = Model::from_checkpoint(&ck)
        .unwrap()
        .prompt_logits(&input)
        .unwrap();
    let with_window = |w: usize| {
        let mut cfg = ck.config.clone();
        cfg.sliding_window = Some(w);
        cfg.validate().unwrap();
        Model::bind(&ck, &cfg, ck.qk_permuted)
            .unwrap()
            .prompt_logits(&input)
            .unwrap()
    };
    // A window covering the whole prompt is full attention, bit for bit.
    assert_eq!(with_window(n), full);
    // A window of 4: the first 4 positions see everything anyway; later ones differ.
    let w4 = with_window(4);
    assert_first_equal_then_differ(&w4, &full, vocab, 4);
    // A config that sets it is read.
    let text = std::fs::read_to_string(fixture("tiny-mistral").join("config.json")).unwrap();
    let text = text.replace("\"sliding_window\": null", "\"sliding_window\": 4");
    let cfg = loip_model::ModelConfig::from_hf_json(&text).unwrap();
    assert_eq!(cfg.sliding_window, Some(4));
}

/// With a window of `w` on the only layer, position `p` attends to positions `p - w + 1 ..= p`:
/// its logits are those of full attention over those `w` tokens alone, run from position 0
/// (RoPE scores depend only on the query and key positions' difference, up to rounding). An
/// independent reference for the window, whatever the family.
fn assert_window_is_last_tokens(ck: &Checkpoint, input: &[u32], w: usize) {
    let vocab = ck.config.vocab_size;
    let mut one = ck.config.clone();
    one.num_layers = 1;
    (one.sliding_window, one.sliding_layers) = (None, Vec::new());
    one.validate().unwrap();
    let full = Model::bind(ck, &one, ck.qk_permuted).unwrap();
    one.sliding_window = Some(w);
    one.validate().unwrap();
    let windowed = Model::bind(ck, &one, ck.qk_permuted)
        .unwrap()
        .prompt_logits(input)
        .unwrap();
    for p in 0..input.len() {
        let tail = &input[(p + 1).saturating_sub(w)..=p];
        let reference = full.prompt_logits(tail).unwrap();
        let want = &reference[(tail.len() - 1) * vocab..];
        let got = &windowed[p * vocab..(p + 1) * vocab];
        let worst = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= 1e-4, "{}: position {p}: {worst}", ck.config.arch);
    }
}

#[test]
fn windows_attend_to_the_last_tokens_only() {
    for name in ["tiny-qwen2", "tiny-mistral", "tiny-qwen3"] {
        let ck = Checkpoint::open(&fixture(name)).unwrap();
        let input = ids(&expected(name)["input_ids"]);
        assert_window_is_last_tokens(&ck, &input, 4);
    }
}

#[test]
fn qwen_sliding_window_is_honoured() {
    let ck = Checkpoint::open(&fixture("tiny-qwen2")).unwrap();
    assert_eq!(ck.config.sliding_window, None);
    let input = ids(&expected("tiny-qwen2")["input_ids"]);
    let vocab = ck.config.vocab_size;
    let text = std::fs::read_to_string(fixture("tiny-qwen2").join("config.json")).unwrap();
    let read = |use_window: bool, types: &str| {
        let t = text
            .replace("\"sliding_window\": null", "\"sliding_window\": 4")
            .replace(
                "\"use_sliding_window\": false",
                &format!("\"use_sliding_window\": {use_window}"),
            );
        let full = r#""full_attention",
    "full_attention",
    "full_attention",
    "full_attention""#;
        let cfg = loip_model::ModelConfig::from_hf_json(&t.replace(full, types)).unwrap();
        cfg.validate().unwrap();
        cfg
    };
    let logits = |cfg: &loip_model::ModelConfig| {
        Model::bind(&ck, cfg, false)
            .unwrap()
            .prompt_logits(&input)
            .unwrap()
    };
    let full = Model::from_checkpoint(&ck)
        .unwrap()
        .prompt_logits(&input)
        .unwrap();
    let half = r#""full_attention", "full_attention", "sliding_attention", "sliding_attention""#;
    // As HF reads it: `sliding_window` counts only with `use_sliding_window`.
    let off = read(false, half);
    assert_eq!((off.sliding_window, off.sliding_layers.len()), (None, 0));
    assert_eq!(logits(&off), full);
    // Layers 2 and 3 slide (window 4), 0 and 1 attend to everything.
    let on = read(true, half);
    let windows: Vec<_> = (0..4).map(|l| on.layer_window(l)).collect();
    assert_eq!(windows, [None, None, Some(4), Some(4)]);
    let w4 = logits(&on);
    assert_first_equal_then_differ(&w4, &full, vocab, 4);
    // Without layer types, the window starts at `max_window_layers` (28 here: no layer).
    let t = text
        .replace("\"sliding_window\": null", "\"sliding_window\": 4")
        .replace(
            "\"use_sliding_window\": false",
            "\"use_sliding_window\": true",
        );
    let start = t.find("\"layer_types\"").unwrap();
    let end = start + t[start..].find(']').unwrap() + 2;
    let untyped = format!("{}{}", &t[..start], &t[end..]);
    let cfg = loip_model::ModelConfig::from_hf_json(&untyped).unwrap();
    assert_eq!(cfg.sliding_window, None);
    let cfg = loip_model::ModelConfig::from_hf_json(
        &untyped.replace("\"max_window_layers\": 28", "\"max_window_layers\": 2"),
    )
    .unwrap();
    assert_eq!(cfg.layer_window(1), None);
    assert_eq!(cfg.layer_window(2), Some(4));
    assert_eq!(logits(&cfg), w4);
}

/// Writes `tensors` (name, F32 shape, bytes) as one safetensors file.
fn write_safetensors(path: &std::path::Path, tensors: &[(String, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (name, shape, data) in tensors {
        let entry = serde_json::json!({
            "dtype": "F32", "shape": shape, "data_offsets": [at, at + data.len()],
        });
        header.insert(name.clone(), entry);
        at += data.len();
    }
    let mut head = Value::Object(header).to_string().into_bytes();
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    for (_, _, data) in tensors {
        out.extend_from_slice(data);
    }
    std::fs::write(path, out).unwrap();
}

/// A multimodal Gemma 3 checkpoint (`Gemma3ForConditionalGeneration`: the text model under
/// `language_model.*` or `model.language_model.*`, a vision tower beside it, the text config
/// inside `text_config`) runs its text model: the tiny-gemma3 fixture so wrapped gives its
/// logits bit for bit, and so does a GGUF `gemma3` file that carries vision tensors.
#[test]
fn multimodal_gemma3_runs_its_text_model() {
    let name = "tiny-gemma3";
    let hf = Checkpoint::open(&fixture(name)).unwrap();
    let input = ids(&expected(name)["input_ids"]);
    let want = Model::from_checkpoint(&hf)
        .unwrap()
        .prompt_logits(&input)
        .unwrap();
    let text_config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap())
            .unwrap();
    let dir = std::env::temp_dir().join(format!("loip-golden-mm-{}", std::process::id()));
    for (prefix, vision) in [
        (
            "language_model.",
            "vision_tower.vision_model.post_layernorm.weight",
        ),
        (
            "model.language_model.",
            "model.vision_tower.vision_model.post_layernorm.weight",
        ),
    ] {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = hf
            .tensors
            .values()
            .map(|t| {
                let stored = match prefix {
                    "language_model." => format!("{prefix}{}", t.name),
                    _ => t.name.replacen("model.", prefix, 1),
                };
                let bytes = hf.tensor_bytes(&t.name).unwrap().to_vec();
                (stored, t.shape.clone(), bytes)
            })
            .collect();
        tensors.push((vision.into(), vec![3], vec![0; 12]));
        tensors.push((
            "multi_modal_projector.mm_soft_emb_norm.weight".into(),
            vec![2],
            vec![0; 8],
        ));
        write_safetensors(&dir.join("model.safetensors"), &tensors);
        let config = serde_json::json!({
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": text_config,
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 3},
            "mm_tokens_per_image": 256,
        });
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let mm = Checkpoint::open(&dir).unwrap();
        assert_eq!(mm.config, hf.config, "{prefix}");
        assert!(!mm.tensors.keys().any(|k| k.contains("vision")), "{prefix}");
        let got = Model::from_checkpoint(&mm)
            .unwrap()
            .prompt_logits(&input)
            .unwrap();
        assert!(got == want, "{prefix}: logits differ");
    }

    let mut w = GgufWriter::from_checkpoint(&hf).unwrap();
    w.tensor(
        "v.blk.0.attn_q.weight",
        loip_kernels::DType::F32,
        &[2, 2],
        vec![0; 16],
    );
    w.tensor(
        "mm.input_projection.weight",
        loip_kernels::DType::F32,
        &[2],
        vec![0; 8],
    );
    let path = dir.join("mm.gguf");
    w.write(&path).unwrap();
    let gg = Checkpoint::open(&path).unwrap();
    let got = Model::from_checkpoint(&gg)
        .unwrap()
        .prompt_logits(&input)
        .unwrap();
    // the converted file gives the HF bits (see converted_gguf_of_each_family_gives_the_hf_logits)
    assert!(got == want, "GGUF with vision tensors: logits differ");
    let _ = std::fs::remove_dir_all(&dir);
}
