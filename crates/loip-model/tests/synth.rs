//! Random-weight checkpoints round-trip through `Checkpoint::open`.

mod common;

use std::cell::Cell;

use common::{f32s, TempDir};
use loip_kernels::DType;
use loip_model::names::{suffix, EMBED_TOKENS, FINAL_NORM};
use loip_model::synth::synth_checkpoint_sharded;
use loip_model::{
    layer_tensor_name, model_tensors, preset_config, synth_checkpoint, Checkpoint, ModelError,
};

fn no_progress(_: u64, _: u64) {}

#[test]
fn tiny_round_trip_f32_and_bf16() {
    let cfg = preset_config("tiny").unwrap();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let dir = TempDir::new("synth");
        let last = Cell::new((0u64, 0u64));
        synth_checkpoint(&cfg, dtype, None, dir.path(), 7, &|d, t| {
            assert!(d >= last.get().0 && d <= t);
            last.set((d, t));
        })
        .unwrap();
        let (done, total) = last.get();
        assert_eq!(done, total);
        assert_eq!(
            total,
            std::fs::metadata(dir.join("model.safetensors"))
                .unwrap()
                .len()
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.config, cfg);
        assert_eq!(ck.tensors.len(), model_tensors(&cfg).len());
        assert!(ck.tensors.values().all(|t| t.dtype == dtype));
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names.len(),
            2,
            "only config.json and model.safetensors: {names:?}"
        );
        if dtype == DType::F32 {
            let norm = f32s(ck.tensor_bytes(FINAL_NORM).unwrap());
            assert!(norm.iter().all(|x| (0.94..=1.06).contains(x)));
            let w = f32s(ck.tensor_bytes(EMBED_TOKENS).unwrap());
            let mean = w.iter().sum::<f32>() / w.len() as f32;
            let std =
                (w.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / w.len() as f32).sqrt();
            assert!(
                mean.abs() < 0.002 && (std - 0.02).abs() < 0.002,
                "mean {mean} std {std}"
            );
        }
    }
}

#[test]
fn deterministic_and_prefix_stable() {
    let cfg = preset_config("tiny").unwrap();
    let (a, b, c) = (
        TempDir::new("det-a"),
        TempDir::new("det-b"),
        TempDir::new("det-c"),
    );
    synth_checkpoint(&cfg, DType::BF16, None, a.path(), 42, &no_progress).unwrap();
    synth_checkpoint(&cfg, DType::BF16, None, b.path(), 42, &no_progress).unwrap();
    synth_checkpoint(&cfg, DType::BF16, Some(2), c.path(), 42, &no_progress).unwrap();
    let read = |d: &TempDir| std::fs::read(d.join("model.safetensors")).unwrap();
    assert_eq!(read(&a), read(&b));
    let (ca, cc) = (
        Checkpoint::open(a.path()).unwrap(),
        Checkpoint::open(c.path()).unwrap(),
    );
    assert_eq!(cc.config.num_layers, 2);
    let name = layer_tensor_name(1, suffix::UP_PROJ);
    assert_eq!(
        ca.tensor_bytes(&name).unwrap(),
        cc.tensor_bytes(&name).unwrap()
    );
    assert!(!cc.has(&layer_tensor_name(2, suffix::UP_PROJ)));
    let d = TempDir::new("det-d");
    synth_checkpoint(&cfg, DType::BF16, None, d.path(), 43, &no_progress).unwrap();
    assert_ne!(read(&a), read(&d));
}

#[test]
fn sharded_round_trip_and_layout_switch() {
    let cfg = preset_config("qwen3-32b").unwrap();
    // Shrink the real shape to keep the test small, but keep Qwen3's q/k norms.
    let mut cfg = cfg;
    cfg.hidden_size = 64;
    cfg.intermediate_size = 96;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    cfg.head_dim = 32;
    cfg.vocab_size = 300;
    let dir = TempDir::new("sharded");
    synth_checkpoint_sharded(
        &cfg,
        DType::F32,
        Some(3),
        dir.path(),
        1,
        40_000,
        &no_progress,
    )
    .unwrap();
    assert!(dir.join("model.safetensors.index.json").exists());
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert!(ck.files.len() > 2, "{:?}", ck.files);
    assert_eq!(ck.config.num_layers, 3);
    assert!(ck.config.qk_norm);
    assert!(ck.has(&layer_tensor_name(2, suffix::K_NORM)));
    // Unsharded into the same directory: the stale index must not win.
    synth_checkpoint(&cfg, DType::F32, Some(3), dir.path(), 1, &no_progress).unwrap();
    assert!(!dir.join("model.safetensors.index.json").exists());
    let single = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(single.files.len(), 1);
    for name in single.tensors.keys() {
        assert_eq!(
            single.tensor_bytes(name).unwrap(),
            ck.tensor_bytes(name).unwrap(),
            "{name}"
        );
    }
}

#[test]
fn errors_leave_nothing_behind() {
    let cfg = preset_config("tiny").unwrap();
    let dir = TempDir::new("synth-err");
    let e = synth_checkpoint(&cfg, DType::Q4_1, None, dir.path(), 0, &no_progress).unwrap_err();
    assert!(matches!(e, ModelError::UnsupportedDtype { .. }), "{e}");
    let e = synth_checkpoint(&cfg, DType::F32, Some(0), dir.path(), 0, &no_progress).unwrap_err();
    assert!(
        matches!(&e, ModelError::InvalidConfig { field, .. } if field == "num_layers"),
        "{e}"
    );
    // A failure mid-write (config.json is a directory, so the final rename fails) removes
    // the temporary files.
    std::fs::create_dir(dir.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json/x"), b"x").unwrap();
    assert!(synth_checkpoint(&cfg, DType::F32, None, dir.path(), 0, &no_progress).is_err());
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".partial"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    // An output path that is a file.
    let f = dir.join("file");
    std::fs::write(&f, b"x").unwrap();
    assert!(matches!(
        synth_checkpoint(&cfg, DType::F32, None, &f, 0, &no_progress),
        Err(ModelError::Io { .. })
    ));
}
