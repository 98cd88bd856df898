//! The path matrix (STYLE §6): the same prompts through 1–4 worker processes, 1–3 stages per
//! device, no / mixed / heavy offloading, both loaders, overlapped and on-demand loading, one
//! sequence or three concurrent ones — tokens AND logits must be bit-identical to the
//! single-device engine. The tiny fixtures run the whole matrix; SmolLM2 a representative
//! subset. Every case also decodes greedily through argmax steps (the last device picks the
//! token, with EOS held back by a minimum length): the same tokens, and no logits on the wire.

mod dist_common;

use std::path::Path;
use std::time::Duration;

use dist_common::*;
use loip_engine::generate::{generate, Flow, GenerateOptions};
use loip_engine::Model;
use loip_engine::SamplingParams;
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{uniform_plan, Session, SessionOptions, WorkerSpec};
use loip_runtime::coordinator::next_seq_id;
use loip_runtime::LoaderKind;

#[test]
fn dist_worker_entry() {
    worker_entry();
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Off {
    None,
    Mixed,
    Heavy,
}

fn offload(off: Off) -> impl Fn(usize, u32) -> (u32, u32) {
    move |dev, n| match off {
        Off::None => (0, 0),
        // alternate between "MLP only" and "attention and MLP" across devices
        Off::Mixed => {
            if dev % 2 == 0 {
                (0, 1.min(n))
            } else {
                (1.min(n), 1.min(n))
            }
        }
        Off::Heavy => (n, n),
    }
}

struct Case {
    devices: usize,
    stages: u32,
    off: Off,
    loader: LoaderKind,
    mode: ExecMode,
}

fn start(
    slices: &Path,
    workers: &[loip_runtime::cluster_run::WorkerProcess],
    c: &Case,
    token: Option<&str>,
) -> Session {
    let m = Manifest::load(slices).unwrap();
    let names: Vec<String> = (1..=c.devices).map(|i| format!("dev{i}")).collect();
    let plan = uniform_plan(
        "m",
        m.config.num_layers as u32,
        &names,
        c.stages,
        c.mode,
        &offload(c.off),
    )
    .unwrap();
    let specs = names
        .iter()
        .zip(workers)
        .map(|(n, w)| WorkerSpec {
            profile: loip_plan::profile::preset("host-zen5-2c"),
            ..WorkerSpec::new(n, &w.addr)
        })
        .collect();
    let opts = SessionOptions {
        plan: Some(plan),
        measure_links: false,
        loader: c.loader,
        shape_name: "m".into(),
        context: 256,
        max_step_tokens: 32,
        step_timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let mut opts = opts;
    opts.connect.token = token.map(str::to_string);
    Session::start(slices, specs, opts).unwrap_or_else(|e| panic!("session: {e}"))
}

const PROMPTS: [&[u32]; 3] = [
    &[1, 5, 9, 23, 42, 7],
    &[1, 77, 3],
    &[1, 200, 100, 50, 25, 12, 6, 3, 2],
];

/// Runs one case: all prompt logits, one sequence, three concurrent sequences.
fn check_case(
    what: &str,
    s: &Session,
    model: &Model,
    refs: &[(Vec<u32>, Vec<Vec<f32>>)],
    n_new: usize,
) {
    // Every prompt position's logits in one step.
    let rows: Vec<u32> = (0..PROMPTS[0].len() as u32).collect();
    let seq = next_seq_id();
    let got = s
        .pipeline()
        .step_blocking(seq, PROMPTS[0], 0, &rows)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    s.pipeline().release(&[seq]);
    let want = model.prompt_logits(PROMPTS[0]).unwrap();
    assert_bits(&format!("{what}: prompt logits"), &[got.logits], &[want]);
    // One sequence.
    let mut rec = Rec {
        inner: s.pipeline().backend(),
        logits: vec![],
    };
    let seq = next_seq_id();
    let out = generate(&mut rec, seq, PROMPTS[0], &greedy(n_new), &mut |_| {
        Flow::Continue
    })
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    s.pipeline().release(&[seq]);
    assert_eq!(out.new_ids, refs[0].0, "{what}: tokens");
    assert_bits(&format!("{what}: one sequence"), &rec.logits, &refs[0].1);
    // Three sequences in flight at once.
    let results: Vec<_> = std::thread::scope(|sc| {
        let hs: Vec<_> = PROMPTS
            .iter()
            .map(|p| {
                let pipe = s.pipeline().clone();
                sc.spawn(move || {
                    let mut rec = Rec {
                        inner: pipe.backend(),
                        logits: vec![],
                    };
                    let seq = next_seq_id();
                    let out = generate(&mut rec, seq, p, &greedy(n_new), &mut |_| Flow::Continue);
                    pipe.release(&[seq]);
                    (out.map(|o| o.new_ids), rec.logits)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, ((ids, logits), r)) in results.into_iter().zip(refs).enumerate() {
        let ids = ids.unwrap_or_else(|e| panic!("{what}: concurrent {i}: {e}"));
        assert_eq!(ids, r.0, "{what}: concurrent sequence {i} tokens");
        assert_bits(&format!("{what}: concurrent sequence {i}"), &logits, &r.1);
    }
}

/// Greedy generation through the pipeline's own backend, which asks the last device for the
/// argmax: the engine's tokens (the engine's first pick held back as an EOS id until the
/// third token, so the mask decides the output), and per step the bytes of a row of logits
/// fewer than the same generation asking for logits.
fn check_argmax(what: &str, s: &Session, ckpt: &Checkpoint, first: u32, n_new: usize) {
    let opts = GenerateOptions {
        max_tokens: n_new,
        sampling: SamplingParams::default(),
        eos_ids: vec![first],
        min_tokens: 3,
    };
    let (want, _) = reference(ckpt, PROMPTS[0], &opts);
    let run = |argmax: bool| {
        let _ = s.take_totals();
        let seq = next_seq_id();
        let mut rec = Rec {
            inner: s.pipeline().backend(),
            logits: vec![],
        };
        let mut backend = s.pipeline().backend();
        let out = if argmax {
            generate(&mut backend, seq, PROMPTS[0], &opts, &mut |_| {
                Flow::Continue
            })
        } else {
            // `Rec` only records logits: its steps ask for them
            generate(&mut rec, seq, PROMPTS[0], &opts, &mut |_| Flow::Continue)
        };
        s.pipeline().release(&[seq]);
        let out = out.unwrap_or_else(|e| panic!("{what}: argmax {argmax}: {e}"));
        let t = s.take_totals();
        (
            out,
            t.prompt_steps + t.decode_steps,
            t.prompt.bytes + t.decode.bytes,
        )
    };
    let (got, steps, bytes) = run(true);
    assert_eq!(got.new_ids, want, "{what}: argmax tokens");
    assert_ne!(got.new_ids.first(), Some(&first), "{what}: the mask held");
    let (with_logits, steps_l, bytes_l) = run(false);
    assert_eq!(with_logits.new_ids, want, "{what}: tokens with logits");
    assert_eq!(steps, steps_l, "{what}: steps");
    // an output row of 4 × vocab bytes becomes 8; the step asks with at most 8 more
    let saved = 4 * ckpt.config.vocab_size as u64 - 16;
    assert!(
        bytes + steps * saved <= bytes_l,
        "{what}: {bytes} bytes with argmax steps, {bytes_l} with logits, {steps} steps"
    );
}

fn matrix(fixture_name: &str) {
    let ckpt_path = fixture(fixture_name);
    let ckpt = Checkpoint::open(&ckpt_path).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let slices = slices_of(&ckpt_path, fixture_name);
    let n_new = 6;
    let refs: Vec<_> = PROMPTS
        .iter()
        .map(|p| reference(&ckpt, p, &greedy(n_new)))
        .collect();
    let root = scratch(&format!("matrix-{fixture_name}"));
    let workers = spawn_workers(&root, 4, 1 << 30, Some("matrix"));
    let layers = ckpt.config.num_layers as u32;
    let mut cases = 0;
    for devices in 1..=4usize {
        for stages in 1..=3u32 {
            if devices as u32 * stages > layers {
                continue;
            }
            for off in [Off::None, Off::Mixed, Off::Heavy] {
                for loader in [LoaderKind::Direct, LoaderKind::Conventional] {
                    // Heavy offloading with the conventional loader runs the on-demand
                    // (pp-offload) mode; everything else overlaps loads.
                    let mode = if off == Off::Heavy && loader == LoaderKind::Conventional {
                        ExecMode::Sequential
                    } else {
                        ExecMode::Overlapped
                    };
                    let c = Case {
                        devices,
                        stages,
                        off,
                        loader,
                        mode,
                    };
                    let what = format!(
                        "{fixture_name} D={devices} s={stages} {off:?} {loader:?} {mode:?}"
                    );
                    let s = start(&slices, &workers, &c, Some("matrix"));
                    check_case(&what, &s, &model, &refs, n_new);
                    let t = s.take_totals();
                    // A device whose only offload group is its one stage's keeps it in the
                    // slot after the first load, so count prompt and decode loads together.
                    let loaded = t.prompt.loaded_bytes + t.decode.loaded_bytes;
                    assert_eq!(
                        loaded > 0,
                        off != Off::None,
                        "{what}: bytes loaded from the store"
                    );
                    assert_eq!(
                        t.decode_steps as usize,
                        4 * (n_new - 1),
                        "{what}: decode steps"
                    );
                    check_argmax(&what, &s, &ckpt, refs[0].0[0], n_new);
                    s.shutdown();
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 7 * 3 * 2);
}

#[test]
fn tiny_llama_matrix() {
    matrix("tiny-llama");
}

#[test]
fn tiny_qwen3_matrix() {
    matrix("tiny-qwen3");
}

#[test]
fn tiny_llama_bf16_tied_matrix() {
    matrix("tiny-llama-bf16-tied");
}

#[test]
fn smollm2_representative_paths() {
    let path = match loip_model::fetch::fetch_smollm2() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("skipping: SmolLM2 is not available ({e})");
            return;
        }
    };
    let ckpt = Checkpoint::open(&path).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let slices = slices_of(&path, "smollm2");
    let n_new = 5;
    let refs: Vec<_> = PROMPTS
        .iter()
        .map(|p| reference(&ckpt, p, &greedy(n_new)))
        .collect();
    let root = scratch("matrix-smollm2");
    let workers = spawn_workers(&root, 4, 1 << 30, None);
    let cases = [
        Case {
            devices: 3,
            stages: 2,
            off: Off::Mixed,
            loader: LoaderKind::Direct,
            mode: ExecMode::Overlapped,
        },
        Case {
            devices: 2,
            stages: 3,
            off: Off::Heavy,
            loader: LoaderKind::Conventional,
            mode: ExecMode::Sequential,
        },
        Case {
            devices: 4,
            stages: 1,
            off: Off::None,
            loader: LoaderKind::Direct,
            mode: ExecMode::Overlapped,
        },
        Case {
            devices: 1,
            stages: 3,
            off: Off::Heavy,
            loader: LoaderKind::Direct,
            mode: ExecMode::Overlapped,
        },
    ];
    for c in &cases {
        let what = format!(
            "smollm2 D={} s={} {:?} {:?} {:?}",
            c.devices, c.stages, c.off, c.loader, c.mode
        );
        let s = start(&slices, &workers, c, None);
        check_case(&what, &s, &model, &refs, n_new);
        check_argmax(&what, &s, &ckpt, refs[0].0[0], n_new);
        s.shutdown();
    }
}
