//! Offloading is lossless: every placement × loader × overlap gives logits bit-identical to
//! the in-memory engine; corrupt, truncated and missing slices are caught and named.

use std::path::{Path, PathBuf};

use loip_engine::generate::{generate, Flow};
use loip_engine::{GenerateOptions, Model, SamplingParams, StepBackend};
use loip_model::slice::{self, SplitProgress};
use loip_model::Checkpoint;
use loip_runtime::local::{LocalModel, LocalOptions, OffloadRule};
use loip_runtime::{LoaderKind, RuntimeError};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

struct TempDir(PathBuf);
impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "loip-test-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn split(ckpt: &Checkpoint, out: &Path) {
    slice::split(
        ckpt,
        out,
        SplitProgress {
            on_bytes: &|_, _| {},
        },
    )
    .unwrap();
}

fn opts(rule: OffloadRule, loader: LoaderKind, overlap: bool) -> LocalOptions {
    LocalOptions {
        mem_budget: None,
        rule,
        loader,
        overlap,
        context: 64,
        max_step_tokens: 16,
    }
}

const RULES: [OffloadRule; 4] = [
    OffloadRule::None,
    OffloadRule::All,
    OffloadRule::Mlp,
    OffloadRule::Attn,
];

/// Prompt logits plus 6 greedy decode steps' logits.
fn trace<B: StepBackend>(b: &mut B, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut logits = vec![b.step(0, prompt, 0).unwrap()];
    let mut ids = vec![];
    for i in 0..6 {
        let next = loip_engine::sampling::argmax(logits.last().unwrap());
        ids.push(next);
        logits.push(b.step(0, &[next], prompt.len() + i).unwrap());
    }
    (ids, logits)
}

fn check_model(ckpt_path: &Path, prompt: &[u32], tag: &str) {
    let ckpt = Checkpoint::open(ckpt_path).unwrap();
    let dir = TempDir::new(tag);
    split(&ckpt, &dir.0);
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let mut gen = loip_engine::Generator::new(&model, None);
    let want = trace(&mut gen, prompt);
    for rule in RULES {
        for loader in [LoaderKind::Direct, LoaderKind::Conventional] {
            for overlap in [true, false] {
                let mut local = LocalModel::open(&dir.0, &opts(rule, loader, overlap)).unwrap();
                let got = trace(&mut local, prompt);
                assert_eq!(
                    got.0, want.0,
                    "{tag} {rule:?} {loader:?} overlap={overlap}: tokens"
                );
                assert!(
                    got.1 == want.1,
                    "{tag} {rule:?} {loader:?} overlap={overlap}: logits differ"
                );
            }
        }
    }
}

#[test]
fn tiny_fixtures_offloaded_are_bit_identical() {
    for name in ["tiny-llama", "tiny-qwen3", "tiny-llama-bf16-tied"] {
        check_model(&fixture(name), &[1, 17, 42, 99, 3, 250, 7, 8], name);
    }
}

#[test]
fn smollm2_offloaded_is_bit_identical() {
    let path = loip_model::fetch::fetch_smollm2().unwrap();
    check_model(&path, &[504, 3575, 282, 4649, 314], "smollm2");
}

#[test]
fn generation_through_slices_matches_reference_tokens() {
    let exp: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-llama").join("expected.json")).unwrap(),
    )
    .unwrap();
    let ids = |v: &serde_json::Value| {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect::<Vec<_>>()
    };
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let dir = TempDir::new("gen");
    split(&ckpt, &dir.0);
    let mut local =
        LocalModel::open(&dir.0, &opts(OffloadRule::All, LoaderKind::Direct, true)).unwrap();
    let want = ids(&exp["greedy_new_ids"]);
    let o = GenerateOptions {
        max_tokens: want.len(),
        sampling: SamplingParams::default(),
        eos_ids: vec![2],
        min_tokens: want.len(),
    };
    let out = generate(&mut local, 0, &ids(&exp["input_ids"]), &o, &mut |_| {
        Flow::Continue
    })
    .unwrap();
    assert_eq!(out.new_ids, want);
}

#[test]
fn planner_chosen_single_device_placement_is_bit_identical() {
    let ckpt = Checkpoint::open(&fixture("tiny-qwen3")).unwrap();
    let dir = TempDir::new("plan");
    split(&ckpt, &dir.0);
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let mut gen = loip_engine::Generator::new(&model, None);
    let prompt = [3, 1, 4, 1, 5, 9, 2, 6];
    let want = trace(&mut gen, &prompt);
    // A budget too small for everything resident (the planner's working-buffer allowance is
    // 16 MiB), so the plan offloads.
    let free = LocalModel::open(&dir.0, &opts(OffloadRule::None, LoaderKind::Direct, true))
        .unwrap()
        .device
        .memory();
    let mut o = opts(OffloadRule::Plan, LoaderKind::Direct, true);
    let mlp = slice::Manifest::load(&dir.0)
        .unwrap()
        .slice(slice::SliceKind::Mlp(0))
        .unwrap()
        .size;
    o.mem_budget = Some(free.resident + (16 << 20) - 2 * mlp);
    let mut local = LocalModel::open(&dir.0, &o).unwrap();
    assert!(
        local.device.memory().slot > 0,
        "{:?}",
        local.device.memory()
    );
    let got = trace(&mut local, &prompt);
    assert_eq!(got, want);
}

#[test]
fn split_twice_is_harmless_and_verify_passes() {
    let ckpt = Checkpoint::open(&fixture("tiny-qwen3")).unwrap();
    let dir = TempDir::new("twice");
    assert_eq!(
        slice::split(
            &ckpt,
            &dir.0,
            SplitProgress {
                on_bytes: &|_, _| {}
            }
        )
        .unwrap(),
        slice::SplitOutcome::Written
    );
    assert_eq!(
        slice::split(
            &ckpt,
            &dir.0,
            SplitProgress {
                on_bytes: &|_, _| {}
            }
        )
        .unwrap(),
        slice::SplitOutcome::UpToDate
    );
    let m = slice::Manifest::load(&dir.0).unwrap();
    assert_eq!(slice::verify(&dir.0, &|_, _| {}).unwrap(), m.slices.len());
    // 4 layers × 2 blocks + embed + head
    assert_eq!(m.slices.len(), 10);
    for s in &m.slices {
        assert_eq!(s.size % 4096, 0);
        assert!(s.tensors.iter().all(|t| t.offset % 4096 == 0));
    }
}

fn damaged(tag: &str, damage: impl Fn(&Path)) -> (TempDir, String) {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let dir = TempDir::new(tag);
    split(&ckpt, &dir.0);
    let file = "layer-002-mlp.slice".to_string();
    damage(&dir.0.join(&file));
    (dir, file)
}

fn run_all_offloaded(dir: &Path, loader: LoaderKind) -> Result<(), RuntimeError> {
    let mut local = LocalModel::open(dir, &opts(OffloadRule::All, loader, true))?;
    local.forward_hidden(
        &[1, 2, 3],
        &[0, 1, 2].map(|pos| loip_engine::TokenPos { seq: 0, pos }),
    )?;
    Ok(())
}

#[test]
fn corrupt_truncated_and_missing_slices_are_named_errors() {
    let flip = |p: &Path| {
        let mut b = std::fs::read(p).unwrap();
        let i = b.len() - 5000; // inside tensor data
        b[i] ^= 0x01;
        std::fs::write(p, b).unwrap();
    };
    let truncate = |p: &Path| {
        let b = std::fs::read(p).unwrap();
        std::fs::write(p, &b[..b.len() - 4096]).unwrap();
    };
    let remove = |p: &Path| std::fs::remove_file(p).unwrap();
    for (tag, damage, what) in [
        ("flip", &flip as &dyn Fn(&Path), "checksum"),
        ("trunc", &truncate, "bytes"),
        ("missing", &remove, "No such file"),
    ] {
        for loader in [LoaderKind::Direct, LoaderKind::Conventional] {
            let (dir, file) = damaged(tag, damage);
            let err = run_all_offloaded(&dir.0, loader)
                .expect_err("damage must be caught")
                .to_string();
            assert!(err.contains(&file), "{tag} {loader:?}: {err}");
            assert!(err.contains(what), "{tag} {loader:?}: {err}");
        }
        // Resident slices are checked when they are read too.
        let (dir, file) = damaged(tag, damage);
        let err = LocalModel::open(&dir.0, &opts(OffloadRule::None, LoaderKind::Direct, true))
            .err()
            .expect("caught");
        assert!(err.to_string().contains(&file), "{err}");
        // And `loip split --verify`.
        let err = slice::verify(&dir.0, &|_, _| {})
            .expect_err("verify catches it")
            .to_string();
        assert!(err.contains(&file), "{err}");
    }
}

#[test]
fn over_budget_placement_is_refused_with_sizes() {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let dir = TempDir::new("budget");
    split(&ckpt, &dir.0);
    let mut o = opts(OffloadRule::Auto, LoaderKind::Direct, true);
    o.mem_budget = Some(10_000);
    let err = LocalModel::open(&dir.0, &o)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("budget of 9.8 KiB exceeded"), "{err}");
    // A budget one byte short of keeping everything resident forces offloading and still
    // gives the same logits.
    let o_free = opts(OffloadRule::None, LoaderKind::Direct, true);
    let free = LocalModel::open(&dir.0, &o_free).unwrap().device.memory();
    let cfg = &ckpt.config;
    let kv = (o.context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4) as u64;
    o.mem_budget = Some(free.resident + free.working + kv - 1);
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let want = model.prompt_logits(&[5, 6, 7]).unwrap();
    let mut local = LocalModel::open(&dir.0, &o).unwrap();
    let mem = local.device.memory();
    assert!(mem.slot > 0, "{mem:?}");
    assert!(
        mem.resident + mem.slot + mem.working + kv <= o.mem_budget.unwrap(),
        "{mem:?}"
    );
    let got = local.step(0, &[5, 6, 7], 0).unwrap();
    assert_eq!(got, want[2 * 256..]);
}
