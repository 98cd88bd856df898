//! The path matrix (STYLE §6): the same prompts through 1–4 worker processes, 1–3 stages per
//! device, no / mixed / heavy offloading, both loaders, overlapped and on-demand loading, one
//! sequence or three concurrent ones — tokens AND logits must be bit-identical to the
//! single-device engine. The tiny fixtures run the whole matrix; SmolLM2 a representative
//! subset. Every case also decodes greedily through argmax steps (the last device picks the
//! token, with EOS held back by a minimum length): the same tokens, and no logits on the wire.
//! Batched micro-batches (`batched_micro_batches_*`): 1–4 sequences per pipeline step through
//! the engine's `Serving` over the pipeline, staggered arrivals, different lengths, chunked
//! prefill, seeded sampling, per-row EOS masks, a cancellation mid-batch, and two
//! micro-batches in flight at once: every sequence's tokens and logits as the engine alone.
//! Forwarding: the whole matrix runs with direct forwarding (rows worker to worker), the
//! mixed-offload cases again with `relay` (through the coordinator) and with one pair of
//! devices relayed (a route of direct and relayed hops): the same tokens and logits, and the
//! link counters show where the rows went.

mod dist_common;

use std::path::Path;
use std::time::Duration;

use dist_common::*;
use std::collections::BTreeMap;

use loip_engine::generate::{generate, Flow, GenerateOptions};
use loip_engine::{
    BatchBackend, EngineError, Model, SamplingParams, SeqEvent, SeqId, Serving, TokenPos,
};
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::sched::Limits;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{uniform_plan, Session, SessionOptions};
use loip_runtime::coordinator::{next_seq_id, PipelineBackend};
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

/// How hops get their rows.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fwd {
    /// worker to worker
    Direct,
    /// through the coordinator (`--relay`)
    Relay,
    /// dev1 ↔ dev2 relayed, the other hops direct
    Mixed,
}

fn start(
    slices: &Path,
    workers: &[loip_runtime::cluster_run::WorkerProcess],
    c: &Case,
    token: Option<&str>,
) -> Session {
    start_fwd(slices, workers, c, token, Fwd::Direct)
}

fn start_fwd(
    slices: &Path,
    workers: &[loip_runtime::cluster_run::WorkerProcess],
    c: &Case,
    token: Option<&str>,
    fwd: Fwd,
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
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let specs = dist_common::netns::worker_specs(&addrs);
    let opts = SessionOptions {
        plan: Some(plan),
        measure_links: false,
        loader: c.loader,
        shape_name: "m".into(),
        context: 256,
        max_step_tokens: 32,
        max_step_seqs: 4,
        step_timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let mut opts = opts;
    opts.connect.token = token.map(str::to_string);
    opts.relay = fwd == Fwd::Relay;
    if fwd == Fwd::Mixed {
        opts.relay_pairs = vec![("dev1".into(), "dev2".into())];
    }
    Session::start(slices, specs, opts).unwrap_or_else(|e| panic!("session: {e}"))
}

/// Where the rows went: worker → worker bytes only on direct hops, and with direct
/// forwarding the coordinator's links carry far less than the workers' links.
fn check_links(what: &str, s: &Session, fwd: Fwd) {
    let links = s.link_bytes();
    let peer = |a: &str, b: &str| {
        links
            .iter()
            .filter(|l| l.from == a && l.to == b)
            .map(|l| l.bytes)
            .sum::<u64>()
    };
    let between: u64 = links
        .iter()
        .filter(|l| l.from != "coordinator" && l.to != "coordinator")
        .map(|l| l.bytes)
        .sum();
    let hops = &s.hop_links().direct;
    let multi = hops.len() > 1;
    match fwd {
        Fwd::Relay => assert_eq!(between, 0, "{what}: rows between workers when relaying"),
        Fwd::Direct => {
            assert!(hops.iter().skip(1).all(|&d| d), "{what}: every hop direct");
            assert_eq!(between > 0, multi, "{what}: rows between workers {links:?}");
        }
        Fwd::Mixed => {
            assert_eq!(peer("dev1", "dev2") + peer("dev2", "dev1"), 0, "{what}: {links:?}");
            assert!(hops.iter().skip(1).any(|&d| !d), "{what}: a relayed hop");
        }
    }
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
                    check_links(&what, &s, Fwd::Direct);
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
                    // The same through the coordinator, and with dev1 ↔ dev2 relayed.
                    if off == Off::Mixed && loader == LoaderKind::Direct && devices > 1 {
                        let mut fwds = vec![Fwd::Relay];
                        if devices > 2 || stages > 1 {
                            fwds.push(Fwd::Mixed);
                        }
                        for fwd in fwds {
                            let what = format!("{what} {fwd:?}");
                            let s = start_fwd(&slices, &workers, &c, Some("matrix"), fwd);
                            check_case(&what, &s, &model, &refs, n_new);
                            check_links(&what, &s, fwd);
                            check_argmax(&what, &s, &ckpt, refs[0].0[0], n_new);
                            s.shutdown();
                        }
                    }
                }
            }
        }
    }
    let splits = (1..=4u32)
        .flat_map(|d| (1..=3u32).map(move |s| d * s))
        .filter(|&ds| ds <= layers)
        .count();
    assert_eq!(cases, splits * 3 * 2);
}

#[test]
fn tiny_llama_matrix() {
    matrix("tiny-llama");
}

#[test]
fn tiny_qwen3_matrix() {
    matrix("tiny-qwen3");
}

/// Gemma 3: 6 layers, 5 of them sliding (window 4, shorter than the prompts and their
/// generations), so sliding layers sit on both sides of every stage boundary.
#[test]
fn tiny_gemma3_matrix() {
    matrix("tiny-gemma3");
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
        let fwds: &[Fwd] = if c.devices == 3 {
            &[Fwd::Direct, Fwd::Relay, Fwd::Mixed]
        } else {
            &[Fwd::Direct]
        };
        for &fwd in fwds {
            let what = format!("{what} {fwd:?}");
            let s = start_fwd(&slices, &workers, c, None, fwd);
            check_case(&what, &s, &model, &refs, n_new);
            check_links(&what, &s, fwd);
            check_argmax(&what, &s, &ckpt, refs[0].0[0], n_new);
            s.shutdown();
        }
    }
}

/// Logits rows per sequence, in order (before any EOS mask).
type Rows = BTreeMap<SeqId, Vec<Vec<f32>>>;

/// The pipeline as a batch backend that asks for every sampled row's logits and records them
/// under its sequence (the picks then happen here, as the engine's default does).
struct RecPipe {
    inner: PipelineBackend,
    rows: Rows,
    max_seqs_in_step: usize,
}

impl BatchBackend for RecPipe {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let out = self.inner.forward_rows(ids, batch, rows)?;
        let vocab = self.inner.vocab_size();
        for (r, l) in rows.iter().zip(out.chunks_exact(vocab)) {
            self.rows.entry(batch[*r].seq).or_default().push(l.to_vec());
        }
        let mut seqs: Vec<SeqId> = batch.iter().map(|t| t.seq).collect();
        seqs.dedup();
        self.max_seqs_in_step = self.max_seqs_in_step.max(seqs.len());
        Ok(out)
    }

    fn release(&mut self, seq: SeqId) {
        self.inner.release(seq)
    }

    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
}

/// A request of the batched matrix.
#[derive(Clone)]
struct Req {
    seq: SeqId,
    at_round: usize, // arrives before this round
    prompt: Vec<u32>,
    opts: GenerateOptions,
}

/// Four requests of different lengths and arrivals: greedy ones with their own EOS mask
/// (the engine's first pick held back until the third token, so the mask decides), one
/// greedy without a mask, one sampled with its own seed.
fn batched_reqs(ckpt: &Checkpoint) -> Vec<Req> {
    let prompts: [&[u32]; 4] = [PROMPTS[0], PROMPTS[1], PROMPTS[2], &[1, 9]];
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let max_tokens = 4 + i;
            let first = reference(ckpt, p, &greedy(1)).0[0];
            let opts = match i {
                1 => GenerateOptions {
                    sampling: SamplingParams {
                        temperature: 0.8,
                        top_k: 20,
                        top_p: 0.9,
                        seed: 4242,
                    },
                    ..greedy(max_tokens)
                },
                3 => greedy(max_tokens),
                _ => GenerateOptions {
                    eos_ids: vec![first],
                    min_tokens: 3,
                    ..greedy(max_tokens)
                },
            };
            Req {
                seq: next_seq_id(),
                at_round: [0, 0, 1, 3][i],
                prompt: p.to_vec(),
                opts,
            }
        })
        .collect()
}

/// What a backend recorded: logits rows per sequence, most sequences in one step.
trait Recorded {
    fn recorded(&self) -> (Rows, usize);
}

impl Recorded for RecPipe {
    fn recorded(&self) -> (Rows, usize) {
        (self.rows.clone(), self.max_seqs_in_step)
    }
}

impl Recorded for PipelineBackend {
    fn recorded(&self) -> (Rows, usize) {
        (Rows::new(), 0)
    }
}

struct Served {
    tokens: BTreeMap<SeqId, Vec<u32>>, // from Token events
    done: BTreeMap<SeqId, Vec<u32>>,   // from Done events
    cancelled: Vec<SeqId>,
    rows: Rows,
    max_seqs_in_step: usize,
}

/// Serves `reqs` through the engine's scheduler over `backend` (micro-batches of up to 4
/// sequences, prefill chunks of 4 tokens), cancelling `cancel = (seq, round)`.
fn serve<B: BatchBackend + Recorded>(
    what: &str,
    backend: B,
    reqs: &[Req],
    cancel: Option<(SeqId, usize)>,
) -> Served {
    let mut limits = Limits::one_device(u64::MAX, 1);
    limits.max_step_seqs = 4;
    limits.max_seqs = 4;
    limits.prefill_chunk = 4;
    limits.max_batch_tokens = 12;
    let mut serving = Serving::new(limits, backend).unwrap();
    let mut served = Served {
        tokens: BTreeMap::new(),
        done: BTreeMap::new(),
        cancelled: Vec::new(),
        rows: Rows::new(),
        max_seqs_in_step: 0,
    };
    let mut t = 0.0;
    let last = reqs.iter().map(|r| r.at_round).max().unwrap_or(0);
    for round in 0..200 {
        for r in reqs.iter().filter(|r| r.at_round == round) {
            serving.submit(t, r.seq, &r.prompt, &r.opts).unwrap();
        }
        if let Some((seq, at)) = cancel {
            if at == round {
                assert!(serving.cancel(t, seq), "{what}: cancel");
            }
        }
        let mut clock = || {
            t += 1.0;
            t
        };
        for e in serving.step(&mut clock).unwrap() {
            match e {
                SeqEvent::Token { seq, id } => served.tokens.entry(seq).or_default().push(id),
                SeqEvent::Done { seq, new_ids, .. } => {
                    assert!(served.done.insert(seq, new_ids).is_none())
                }
                SeqEvent::Cancelled { seq } => served.cancelled.push(seq),
                SeqEvent::Failed { seq, error } => panic!("{what}: {seq} failed: {error}"),
            }
        }
        if round >= last && serving.is_idle() {
            let stats = serving.stats();
            assert!(
                stats.kv.iter().all(|k| k.used == 0 && k.reserved == 0),
                "{what}: KV held after the end"
            );
            (served.rows, served.max_seqs_in_step) = serving.runner().backend().recorded();
            return served;
        }
    }
    panic!("{what}: not idle after 200 rounds");
}

fn rec(s: &Session) -> RecPipe {
    RecPipe {
        inner: s.pipeline().backend(),
        rows: Rows::new(),
        max_seqs_in_step: 0,
    }
}

/// Every request's tokens and logits (a cancelled one's: a prefix) as the engine alone.
fn check_served(
    what: &str,
    s: &Served,
    reqs: &[Req],
    refs: &BTreeMap<SeqId, (Vec<u32>, Vec<Vec<f32>>)>,
    logits: bool,
) {
    for r in reqs {
        let (want, want_rows) = &refs[&r.seq];
        let got = s.tokens.get(&r.seq).cloned().unwrap_or_default();
        let ctx = format!("{what}: seq {} ({} prompt tokens)", r.seq, r.prompt.len());
        if s.cancelled.contains(&r.seq) {
            assert!(!s.done.contains_key(&r.seq), "{ctx}: cancelled and done");
            assert!(
                got.len() < want.len() && want.starts_with(&got),
                "{ctx}: prefix"
            );
        } else {
            assert_eq!(&got, want, "{ctx}: tokens");
            assert_eq!(s.done.get(&r.seq), Some(want), "{ctx}: done");
        }
        if logits {
            let rows = s.rows.get(&r.seq).cloned().unwrap_or_default();
            assert!(rows.len() <= want_rows.len(), "{ctx}: rows");
            assert_bits(&ctx, &rows, &want_rows[..rows.len()]);
            if !s.cancelled.contains(&r.seq) {
                assert_eq!(rows.len(), want_rows.len(), "{ctx}: rows");
            }
        }
    }
}

/// The batched matrix on one fixture: micro-batches of 1–4 sequences through the pipeline.
fn batched(fixture_name: &str, cases: &[Case]) {
    let ckpt_path = fixture(fixture_name);
    let ckpt = Checkpoint::open(&ckpt_path).unwrap();
    let slices = slices_of(&ckpt_path, fixture_name);
    let reqs = batched_reqs(&ckpt);
    let refs: BTreeMap<SeqId, _> = reqs
        .iter()
        .map(|r| (r.seq, reference(&ckpt, &r.prompt, &r.opts)))
        .collect();
    let root = scratch(&format!("batched-{fixture_name}"));
    let n = cases.iter().map(|c| c.devices).max().unwrap_or(1);
    let workers = spawn_workers(&root, n, 1 << 30, Some("batched"));
    for c in cases {
        let what = format!(
            "{fixture_name} batched D={} s={} {:?} {:?} {:?}",
            c.devices, c.stages, c.off, c.loader, c.mode
        );
        let s = start(&slices, &workers, c, Some("batched"));
        // One sequence a step, then micro-batches of up to 4 (logits back, picked here).
        let one = serve(&format!("{what} alone"), rec(&s), &reqs[..1], None);
        check_served(&format!("{what} alone"), &one, &reqs[..1], &refs, true);
        let all = serve(&what, rec(&s), &reqs, None);
        check_served(&what, &all, &reqs, &refs, true);
        assert!(all.max_seqs_in_step >= 3, "{what}: never batched");
        // The last device picks every greedy micro-batch's tokens under each row's own mask
        // (the sampled request left out: with it in the step, logits come back); a worker
        // that ignored the per-row masks would end a sequence at its held-back EOS.
        let greedy_reqs: Vec<Req> = reqs
            .iter()
            .filter(|r| r.opts.sampling.temperature == 0.0)
            .cloned()
            .collect();
        let what_a = format!("{what} argmax");
        let picked = serve(&what_a, s.pipeline().backend(), &greedy_reqs, None);
        check_served(&what_a, &picked, &greedy_reqs, &refs, false);
        // A cancellation in the middle of the batch: the others are untouched.
        let victim = reqs[2].seq;
        let cut = serve(&format!("{what} cancel"), rec(&s), &reqs, Some((victim, 3)));
        assert_eq!(cut.cancelled, vec![victim], "{what}");
        check_served(&format!("{what} cancel"), &cut, &reqs, &refs, true);
        // Two micro-batches of two sequences in flight at once.
        let halves: Vec<Served> = std::thread::scope(|sc| {
            let hs: Vec<_> = reqs
                .chunks(2)
                .map(|half| {
                    let b = rec(&s);
                    let what = &what;
                    sc.spawn(move || serve(&format!("{what} in flight"), b, half, None))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (half, got) in reqs.chunks(2).zip(&halves) {
            check_served(&format!("{what} in flight"), got, half, &refs, true);
        }
        s.shutdown();
    }
}

#[test]
fn batched_micro_batches_tiny_llama() {
    batched(
        "tiny-llama",
        &[
            Case {
                devices: 2,
                stages: 2,
                off: Off::Mixed,
                loader: LoaderKind::Direct,
                mode: ExecMode::Overlapped,
            },
            Case {
                devices: 3,
                stages: 1,
                off: Off::Heavy,
                loader: LoaderKind::Conventional,
                mode: ExecMode::Sequential,
            },
            Case {
                devices: 1,
                stages: 1,
                off: Off::None,
                loader: LoaderKind::Direct,
                mode: ExecMode::Overlapped,
            },
        ],
    );
}

#[test]
fn batched_micro_batches_tiny_qwen3() {
    batched(
        "tiny-qwen3",
        &[Case {
            devices: 4,
            stages: 1,
            off: Off::Heavy,
            loader: LoaderKind::Direct,
            mode: ExecMode::Overlapped,
        }],
    );
}
