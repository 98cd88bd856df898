//! Shared helpers of the distributed tests: fixture slice directories, worker processes
//! (this test binary re-executed as a worker), the single-device reference, and a backend
//! wrapper that records every step's logits.
#![allow(dead_code)]

pub mod netns;
pub mod raw;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use loip_engine::generate::{generate, Flow};
use loip_engine::{EngineError, GenerateOptions, Generator, Model, SamplingParams, StepBackend};
use loip_model::slice::{split, SplitProgress};
use loip_model::Checkpoint;
use loip_runtime::cluster_run::WorkerProcess;
use loip_runtime::worker::{run_blocking, WorkerOptions};

/// A tiny fixture's directory.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn binary() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_default()
}

/// Where these tests keep files: the checkout's own `target/tmp` (cargo's
/// `CARGO_TARGET_TMPDIR`), never a name in `/tmp` shared by every checkout on the machine,
/// and gone with `cargo clean` (the temp dir for the examples that share these helpers).
pub fn test_tmp() -> PathBuf {
    option_env!("CARGO_TARGET_TMPDIR").map_or_else(std::env::temp_dir, PathBuf::from)
}

/// A fresh scratch directory (emptied on each use, so runs do not pile up).
pub fn scratch(name: &str) -> PathBuf {
    let d = test_tmp()
        .join("loip-dist-scratch")
        .join(binary())
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Splits a checkpoint into slices under [`test_tmp`] (a no-op when already split).
pub fn slices_of(ckpt_path: &Path, name: &str) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let out = test_tmp()
        .join("loip-dist-slices")
        .join(binary())
        .join(name);
    let ckpt = Checkpoint::open(ckpt_path).unwrap();
    split(
        &ckpt,
        &out,
        SplitProgress {
            on_bytes: &|_, _| {},
        },
    )
    .unwrap();
    out
}

/// A two-thread tokio runtime for a test.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A fresh store `name` holding copies of the tiny fixture's slice files (split once per
/// `tag`).
pub fn store_with_slices(name: &str, tag: &str) -> PathBuf {
    let slices = slices_of(&fixture("tiny-llama"), tag);
    let store = scratch(name);
    for e in std::fs::read_dir(&slices).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "slice") {
            std::fs::copy(&p, store.join(p.file_name().unwrap())).unwrap();
        }
    }
    store
}

/// Runs this process as a worker when `LOIP_DIST_WORKER` is set (see [`spawn_worker`]).
/// Call it from a `#[test] fn dist_worker_entry()` in every test binary that spawns workers.
pub fn worker_entry() {
    let Ok(spec) = std::env::var("LOIP_DIST_WORKER") else {
        return;
    };
    let v: serde_json::Value = serde_json::from_str(&spec).unwrap();
    let mut o = WorkerOptions::new(
        "127.0.0.1:0",
        v["mem"].as_u64().unwrap(),
        v["store"].as_str().unwrap(),
    );
    if let Some(l) = v["listen"].as_str() {
        o.listen = l.to_string();
    }
    o.token = v["token"].as_str().map(str::to_string);
    o.name = v["name"].as_str().map(str::to_string);
    o.bandwidth = v["bandwidth"].as_f64();
    if v["whole_process"].as_bool() == Some(true) {
        loip_runtime::memory::return_freed_memory();
        o = o.whole_process().unwrap();
        eprintln!("{}", o.budget());
    }
    loip_runtime::worker::exit_when_parent_dies();
    let r = run_blocking(o, |addr| {
        use std::io::Write;
        println!("listening on {addr}");
        let _ = std::io::stdout().flush();
    });
    if let Err(e) = r {
        eprintln!("worker failed: {e}");
        std::process::exit(3);
    }
}

/// Options of a worker process.
#[derive(Clone, Default)]
pub struct W {
    pub name: String,
    pub mem: u64,
    pub store: PathBuf,
    pub token: Option<String>,
    pub bandwidth: Option<f64>,
    pub listen: Option<String>,
    /// run it inside this network namespace (`ip netns exec NS …`)
    pub netns: Option<String>,
    /// `mem` is the whole process's budget, as `loip worker` takes it
    pub whole_process: bool,
    /// run it in a fresh memory cgroup with this limit, bytes (see [`cgroup_skip_reason`])
    pub cgroup: Option<u64>,
}

/// Spawns this test binary as a worker process.
pub fn spawn_worker(w: &W) -> WorkerProcess {
    let exe = std::env::current_exe().unwrap();
    let spec = serde_json::json!({
        "mem": w.mem, "store": w.store, "token": w.token, "name": w.name, "bandwidth": w.bandwidth, "listen": w.listen,
        "whole_process": w.whole_process,
    });
    let mut cmd = match &w.netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args([
        "dist_worker_entry",
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("LOIP_DIST_WORKER", spec.to_string())
    .env("RAYON_NUM_THREADS", "1");
    let cg = w.cgroup.map(|limit| {
        let name = format!("loip-test-{}-{}", std::process::id(), w.name);
        loip_runtime::memory::Cgroup::create(&name, limit).unwrap()
    });
    WorkerProcess::spawn_in(cmd, Duration::from_secs(60), cg).unwrap()
}

/// Why memory cgroups cannot be made here (not root, no controller), or None when they can.
pub fn cgroup_skip_reason() -> Option<String> {
    let name = format!("loip-test-probe-{}", std::process::id());
    match loip_runtime::memory::Cgroup::create(&name, 64 << 20) {
        Ok(_) => None,
        Err(e) => Some(format!("cannot create a memory cgroup here: {e}")),
    }
}

/// `n` worker processes named dev1..devN with stores under `root`.
pub fn spawn_workers(root: &Path, n: usize, mem: u64, token: Option<&str>) -> Vec<WorkerProcess> {
    (0..n)
        .map(|i| {
            spawn_worker(&W {
                name: format!("dev{}", i + 1),
                mem,
                store: root.join(format!("dev{}", i + 1)),
                token: token.map(str::to_string),
                ..Default::default()
            })
        })
        .collect()
}

/// Records the logits of every step.
pub struct Rec<B> {
    pub inner: B,
    pub logits: Vec<Vec<f32>>,
}

impl<B: StepBackend> StepBackend for Rec<B> {
    fn step(&mut self, seq: u64, ids: &[u32], start_pos: usize) -> Result<Vec<f32>, EngineError> {
        let l = self.inner.step(seq, ids, start_pos)?;
        self.logits.push(l.clone());
        Ok(l)
    }
}

/// Greedy options for `n` tokens (EOS ignored, so every run has the same length).
pub fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: n,
        sampling: SamplingParams::default(),
        eos_ids: vec![],
        min_tokens: 0,
    }
}

/// Tokens and per-step logits of the single-device engine.
pub fn reference(
    ckpt: &Checkpoint,
    prompt: &[u32],
    opts: &GenerateOptions,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let model = Model::from_checkpoint(ckpt).unwrap();
    recorded(Generator::new(&model, None), 0, prompt, opts).unwrap()
}

/// Generates `prompt` as sequence `seq` through `backend`: the new tokens and every step's
/// logits.
pub fn recorded<B: StepBackend>(
    backend: B,
    seq: u64,
    prompt: &[u32],
    opts: &GenerateOptions,
) -> Result<(Vec<u32>, Vec<Vec<f32>>), EngineError> {
    let mut rec = Rec {
        inner: backend,
        logits: vec![],
    };
    let out = generate(&mut rec, seq, prompt, opts, &mut |_| Flow::Continue)?;
    Ok((out.new_ids, rec.logits))
}

/// Bitwise equality of two logits lists, with a readable failure.
pub fn assert_bits(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}: step count");
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: step {s} length");
        if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != w[i].to_bits()) {
            panic!(
                "{what}: step {s} logit {i}: {} (pipeline) vs {} (single device)",
                g[i], w[i]
            );
        }
    }
}
