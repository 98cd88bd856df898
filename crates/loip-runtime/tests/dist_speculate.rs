//! Lossless speculative decoding through the pipeline (issue 31): a verify step of `k + 1`
//! positions of one sequence is one micro-batch, and the rejected positions' KV is dropped on
//! every device (per stage, with the sequence's next step; lent rows come back first). Every
//! case gives the tokens of the single-device engine without speculation AND each kept token
//! from logits bit-identical to its:
//! - one sequence: the speculation matrix of the engine's own tests (`spec_common`: greedy
//!   and seeded sampled requests, k of 1 to 8, adaptive, prompt lookup and oracle drafts
//!   always right, always wrong, or wrong every third token) over 2 devices resident, 3
//!   devices offloaded, 2 devices of two interleaved stages each fully offloaded (a device
//!   runs two hops of a step: its second hop keeps what its first wrote), and a
//!   sliding-window model;
//! - continuous batching (the engine's `Serving`, as `loip api` on a cluster): speculating
//!   sequences and a plain neighbour in the same micro-batches, logits back and argmax steps
//!   (the last device picks each row's token);
//! - across adaptation events: a tight device lends its oldest rows to its peer (every row
//!   but a sequence's newest may be out when a rewind cuts among them), and a neighbour then
//!   forces the speculating sequence's eviction mid-run (its ids re-prefilled up to the
//!   rewound length).

#[path = "../../loip-engine/tests/spec_common/mod.rs"]
mod spec_common;

mod adapt_common;
mod dist_common;

use std::collections::BTreeMap;
use std::time::Duration;

use adapt_common::{two_device_plan, MAX_STEP};
use dist_common::*;
use loip_engine::batch::{BatchBackend, SeqEvent};
use loip_engine::generate::{generate, Flow};
use loip_engine::speculate::{generate_speculative, SpecOptions, Speculate};
use loip_engine::{
    EngineError, GenerateOptions, Generator, Model, SeqId, Serving, Shaping, TokenPos,
};
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::sched::Limits;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{device_spec, uniform_plan, Session, SessionOptions};
use loip_runtime::coordinator::{next_seq_id, PipelineBackend};
use loip_runtime::executor::Device;
use loip_runtime::LoaderKind;
use spec_common::{bits, ByPos, Oracle, Rec, RecStep};

#[test]
fn dist_worker_entry() {
    worker_entry();
}

/// Logits by (sequence, position), as bits; a later row at the same position replaces an
/// earlier one (a rejected row is computed again once its context is right).
type Rows = BTreeMap<(SeqId, usize), Vec<u32>>;

/// The engine alone without speculation: new tokens, logits by position.
fn alone(model: &Model<'_>, prompt: &[u32], opts: &GenerateOptions) -> (Vec<u32>, ByPos) {
    let mut rec = RecStep {
        inner: Generator::new(model, None),
        rows: ByPos::new(),
    };
    let out = generate(&mut rec, 1, prompt, opts, &mut |_| Flow::Continue).unwrap();
    (out.new_ids, rec.rows)
}

/// The pipeline, recording every returned row and counting rewinds.
struct RecPipe {
    be: PipelineBackend,
    rows: Rows,
    rewinds: usize,
}

impl RecPipe {
    fn new(s: &Session) -> RecPipe {
        RecPipe {
            be: s.pipeline().backend(),
            rows: Rows::new(),
            rewinds: 0,
        }
    }
}

impl BatchBackend for RecPipe {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let l = self.be.forward_rows(ids, batch, rows)?;
        let vocab = l.len() / rows.len().max(1);
        for (&r, row) in rows.iter().zip(l.chunks_exact(vocab.max(1))) {
            self.rows.insert((batch[r].seq, batch[r].pos), bits(row));
        }
        Ok(l)
    }

    fn release(&mut self, seq: SeqId) {
        self.be.release(seq)
    }

    fn rewind(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        self.rewinds += 1;
        self.be.rewind(seq, len)
    }

    fn can_rewind(&self) -> bool {
        self.be.can_rewind()
    }

    fn vocab_size(&self) -> usize {
        self.be.vocab_size()
    }
}

/// A prompt that repeats itself (prompt lookup hits), of `len` tokens.
fn repeating(seed: usize, len: usize, vocab: u32) -> Vec<u32> {
    let period = 3 + seed % 3;
    (0..len)
        .map(|i| ((seed * 13 + (i % period) * 29 + 5) as u32) % vocab)
        .collect()
}

/// Each of `want`'s rows (the engine alone) is `seq`'s in `got`, bit for bit.
fn assert_rows(what: &str, got: &Rows, seq: SeqId, want: &ByPos) {
    for (pos, l) in want {
        assert!(got.get(&(seq, *pos)) == Some(l), "{what}: logits at {pos}");
    }
}

/// A session of `devices` in-process workers (plenty of memory) over a plan of `stages` each,
/// `offload` blocks per stage offloaded.
fn start(fixture_name: &str, devices: usize, stages: u32, offload: u32) -> Session {
    let slices = slices_of(&fixture(fixture_name), fixture_name);
    let m = Manifest::load(&slices).unwrap();
    let names: Vec<String> = (1..=devices).map(|i| format!("dev{i}")).collect();
    let plan = uniform_plan(
        "m",
        m.config.num_layers as u32,
        &names,
        stages,
        ExecMode::Overlapped,
        &|_, n| (offload.min(n), offload.min(n)),
    )
    .unwrap();
    let root = scratch(&format!("spec-{fixture_name}-{devices}x{stages}-{offload}"));
    let addrs: Vec<String> = names
        .iter()
        .map(|n| adapt_common::in_process_worker(n, 1 << 30, root.join(n), 0))
        .collect();
    let opts = SessionOptions {
        plan: Some(plan),
        measure_links: false,
        loader: LoaderKind::Direct,
        shape_name: "m".into(),
        context: 256,
        max_step_tokens: 32,
        max_step_seqs: 4,
        step_timeout: Duration::from_secs(120),
        ..Default::default()
    };
    let specs = dist_common::netns::worker_specs(&addrs);
    Session::start(&slices, specs, opts).unwrap_or_else(|e| panic!("session: {e}"))
}

/// The engine's speculation matrix over the pipeline of `devices` × `stages`, `offload` blocks
/// per stage offloaded.
fn matrix(fixture_name: &str, devices: usize, stages: u32, offload: u32) {
    let ckpt = Checkpoint::open(&fixture(fixture_name)).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let s = start(fixture_name, devices, stages, offload);
    let what = format!("{fixture_name}, {devices} devices x {stages} stages, offload {offload}");
    let hits = spec_common::check_matrix(&model, &what, || s.pipeline().backend(), |_, _, _| {});
    assert!(hits > 0, "{what}: prompt lookup never hit");
    argmax_steps(&what, &s, &model);
    s.pipeline().release(&[7]); // the matrix's sequence
    released(&s, &what);
    s.shutdown();
}

/// Greedy requests through the pipeline itself: each verify step's rows picked on the last
/// device under each row's own EOS mask; the tokens of the engine alone.
fn argmax_steps(what: &str, s: &Session, model: &Model<'_>) {
    let vocab = model.tf.cfg.vocab_size as u32;
    for (i, c) in spec_common::cases(vocab, &[2]).iter().enumerate() {
        if c.opts.sampling.temperature > 0.0 {
            continue;
        }
        let (want, _) = spec_common::reference(model, c);
        let mut oracle = Oracle {
            prompt_len: c.prompt.len(),
            want: want.clone(),
            wrong_every: 3,
            vocab,
        };
        let spec = SpecOptions {
            k_max: 4,
            adaptive: false,
            ..Default::default()
        };
        let seq = next_seq_id();
        let mut be = s.pipeline().backend();
        let out = generate_speculative(
            &mut be,
            seq,
            &c.prompt,
            &c.opts,
            &mut oracle,
            &spec,
            &mut |_| Flow::Continue,
        )
        .unwrap_or_else(|e| panic!("{what} argmax case {i}: {e}"));
        s.pipeline().release(&[seq]);
        assert_eq!(out.out.new_ids, want, "{what} argmax case {i}: tokens");
        assert!(
            out.stats.accepted > 0,
            "{what} argmax case {i}: {:?}",
            out.stats
        );
    }
}

/// The coordinator's ledger holds nothing once every sequence is released (releases are
/// applied by its scheduler: waits for them, at most 5 s).
fn released(s: &Session, what: &str) {
    for _ in 0..500 {
        if s.pipeline().held_tokens() == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "{what}: the ledger holds {} tokens after release",
        s.pipeline().held_tokens()
    );
}

#[test]
fn one_sequence_on_two_resident_devices() {
    matrix("tiny-llama", 2, 1, 0);
}

#[test]
fn one_sequence_on_three_offloaded_devices() {
    matrix("tiny-llama", 3, 1, 1);
}

#[test]
fn one_sequence_on_two_offloaded_devices_of_interleaved_stages() {
    matrix("tiny-llama", 2, 2, 8);
}

#[test]
fn one_sequence_on_a_sliding_window_model() {
    matrix("tiny-gemma3", 2, 1, 0);
}

/// Serves a speculating request beside plain ones (micro-batches of up to 3 sequences, steps
/// of up to 12 tokens): every request's tokens, and with `record` each kept row's logits.
fn batched(what: &str, s: &Session, model: &Model<'_>, record: bool) -> usize {
    let vocab = model.tf.cfg.vocab_size as u32;
    let reqs: Vec<(SeqId, Vec<u32>, usize, Speculate)> = (0..3)
        .map(|i| {
            let spec = if i == 1 {
                Speculate::Off
            } else {
                Speculate::Lookup
            };
            (
                next_seq_id(),
                repeating(i + 1, 9 + 2 * i, vocab),
                16 + 2 * i,
                spec,
            )
        })
        .collect();
    let mut limits = Limits::one_device(u64::MAX, 1);
    limits.max_step_seqs = 3;
    limits.max_seqs = 3;
    limits.prefill_chunk = 4;
    limits.max_batch_tokens = 12;
    limits.max_seq_len = Some(256);
    let spec = SpecOptions {
        k_max: 4,
        adaptive: false,
        ..Default::default()
    };
    let mut tokens: BTreeMap<SeqId, Vec<u32>> = BTreeMap::new();
    let mut drive = |serving: &mut dyn ServingDyn| {
        let mut t = 0.0;
        for (i, (seq, prompt, n, sp)) in reqs.iter().enumerate() {
            let o = greedy(*n);
            serving.submit(t + i as f64, *seq, prompt, &o, (*sp, &spec));
        }
        for _ in 0..400 {
            t += 1.0;
            for e in serving.step(t) {
                match e {
                    SeqEvent::Token { seq, id } => tokens.entry(seq).or_default().push(id),
                    SeqEvent::Done { .. } => {}
                    SeqEvent::Cancelled { seq } => panic!("{what}: {seq} cancelled"),
                    SeqEvent::Failed { seq, error } => panic!("{what}: {seq} failed: {error}"),
                }
            }
            if serving.idle() {
                return;
            }
        }
        panic!("{what}: not idle after 400 rounds");
    };
    let lookup = |totals: &[(Speculate, loip_engine::SpecStats)]| {
        let st = totals.iter().find(|(s, _)| *s == Speculate::Lookup);
        st.map_or(0, |(_, st)| st.accepted)
    };
    let (rows, accepted) = if record {
        let mut serving = Serving::new(limits, RecPipe::new(s)).unwrap();
        drive(&mut serving);
        let b = serving.runner().backend();
        eprintln!("{what}: {} rewinds", b.rewinds);
        (Some(b.rows.clone()), lookup(serving.spec_totals()))
    } else {
        let mut serving = Serving::new(limits, s.pipeline().backend()).unwrap();
        drive(&mut serving);
        (None, lookup(serving.spec_totals()))
    };
    for (seq, prompt, n, sp) in &reqs {
        let (want, want_rows) = alone(model, prompt, &greedy(*n));
        let tag = format!("{what}: seq {seq} ({sp:?})");
        assert_eq!(tokens.get(seq), Some(&want), "{tag}: tokens");
        if let Some(rows) = &rows {
            assert_rows(&tag, rows, *seq, &want_rows);
        }
    }
    accepted
}

/// The engine's serving loop, whatever its backend.
trait ServingDyn {
    fn submit(
        &mut self,
        t: f64,
        seq: SeqId,
        prompt: &[u32],
        o: &GenerateOptions,
        spec: (Speculate, &SpecOptions),
    );
    fn step(&mut self, t: f64) -> Vec<SeqEvent>;
    fn idle(&self) -> bool;
}

impl<B: BatchBackend> ServingDyn for Serving<B> {
    fn submit(
        &mut self,
        t: f64,
        seq: SeqId,
        prompt: &[u32],
        o: &GenerateOptions,
        spec: (Speculate, &SpecOptions),
    ) {
        self.submit_speculative(t, seq, prompt, o, &Shaping::default(), spec)
            .unwrap();
    }
    fn step(&mut self, t: f64) -> Vec<SeqEvent> {
        let mut clock = || t;
        Serving::step(self, &mut clock).unwrap()
    }
    fn idle(&self) -> bool {
        self.is_idle()
    }
}

#[test]
fn speculating_and_plain_neighbours_share_micro_batches() {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let s = start("tiny-llama", 3, 1, 1);
    let a = batched("3 devices, logits back", &s, &model, true);
    let b = batched("3 devices, argmax steps", &s, &model, false);
    eprintln!("drafts kept: {a} (logits back), {b} (argmax steps)");
    assert!(a > 0 && b > 0, "lookup never hit");
    released(&s, "3 devices");
    s.shutdown();
}

/// Two spawned workers over two one-layer stages each, fully offloaded: `dev1` has room for
/// 20 tokens of KV and lends its oldest rows to `dev2` (room for 400).
fn start_lending(tag: &str) -> (Session, Vec<loip_runtime::cluster_run::WorkerProcess>) {
    let path = fixture("tiny-llama");
    let slices = slices_of(&path, "tiny-llama");
    let m = Manifest::load(&slices).unwrap();
    let (names, _, kv_per_token) = two_device_plan(&m);
    let plan = adapt_common::offloaded_plan(&m, &names);
    let root = scratch(tag);
    let mut opts = adapt_common::session_options(plan.clone(), 6);
    opts.lending = true;
    let workers: Vec<_> = [20u64, 400]
        .iter()
        .enumerate()
        .map(|(i, room)| {
            let mut spec = device_spec(&plan, i, LoaderKind::Direct, MAX_STEP, 256, None);
            spec.max_step_seqs = opts.max_step_seqs;
            let mem = Device::open(&slices, &m, spec).unwrap().memory();
            spawn_worker(&W {
                name: names[i].clone(),
                mem: mem.resident + mem.slot + mem.working + room * kv_per_token,
                store: root.join(&names[i]),
                ..Default::default()
            })
        })
        .collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let ws = adapt_common::worker_specs(&names, &addrs);
    let s = Session::start(&slices, ws, opts).unwrap_or_else(|e| panic!("session: {e}"));
    (s, workers)
}

/// A speculates (k 3) through lends of its rows; after its 14th token B runs whole beside it
/// (plain), which lending cannot carry: A is evicted and re-prefilled once B is released.
/// Both bit-identical to the engine alone.
#[test]
fn rewinds_through_lent_rows_and_an_eviction() {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let vocab = model.tf.cfg.vocab_size as u32;
    let (s, _w) = start_lending("spec-lend-evict");
    let (a, b) = (next_seq_id(), next_seq_id());
    let (pa, pb) = (repeating(2, 6, vocab), repeating(4, 6, vocab));
    let (oa, ob) = (greedy(30), greedy(30));
    let (want_a, rows_a) = alone(&model, &pa, &oa);
    let (want_b, rows_b) = alone(&model, &pb, &ob);
    let mut rec = Rec::new(s.pipeline().backend());
    let spec = SpecOptions {
        k_max: 3,
        adaptive: false,
        ..Default::default()
    };
    let mut oracle = Oracle {
        prompt_len: pa.len(),
        want: want_a.clone(),
        wrong_every: 3,
        vocab,
    };
    let mut n = 0;
    let mut b_out = (Vec::new(), ByPos::new());
    let out = generate_speculative(&mut rec, a, &pa, &oa, &mut oracle, &spec, &mut |_| {
        n += 1;
        if n == 14 {
            let mut rb = RecStep {
                inner: s.pipeline().backend(),
                rows: ByPos::new(),
            };
            let o = generate(&mut rb, b, &pb, &ob, &mut |_| Flow::Continue).unwrap();
            b_out = (o.new_ids, rb.rows);
            s.pipeline().release(&[b]);
        }
        Flow::Continue
    })
    .unwrap_or_else(|e| panic!("A: {e}\n{:?}", s.adaptation()));
    s.pipeline().release(&[a]);
    assert_eq!(out.out.new_ids, want_a, "A: tokens");
    for (pos, l) in &rows_a {
        assert!(rec.rows.get(pos) == Some(l), "A: logits at {pos}");
    }
    assert_eq!(b_out.0, want_b, "B: tokens");
    for (pos, l) in &rows_b {
        assert!(b_out.1.get(pos) == Some(l), "B: logits at {pos}");
    }
    let ad = s.adaptation().expect("adaptation on");
    let st = out.stats;
    eprintln!(
        "A: {st:?}; evictions {}, events {}",
        ad.evictions,
        ad.events.len()
    );
    assert!(st.accepted > 0 && st.accepted < st.drafted, "{st:?}");
    assert_eq!(ad.evictions, 1, "{ad:?}");
    assert!(s.pipeline().lend_totals().bytes > 0, "dev1 lent rows");
    released(&s, "lending");
    s.shutdown();
}
