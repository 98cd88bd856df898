//! Lossless continuous batching: each sequence served by the scheduler-driven batch runner
//! gets the tokens AND the bit-identical logits of running it alone through `generate`,
//! whatever the batch around it: 1–8 sequences, staggered arrivals, different lengths, chunk
//! sizes from 1 token up, seeded sampling, a cancellation in the middle.
//!
//! A prompt shared by several sequences (the `n` choices of one request) is computed once:
//! the others take a copy of its KV ([`BatchBackend::fork`]) and feed only its last token,
//! and each still gets what `generate` gives it alone with its own seed, on a full-attention
//! model and on one with sliding windows, whether it arrives with the first one, while it
//! prefills, while it decodes or after it ended; a backend that cannot fork gives the same
//! answers with one prefill each; the cache never holds more than the scheduler reserved; a
//! waiting sequence cancels cleanly.

use std::collections::BTreeMap;
use std::path::PathBuf;

use loip_engine::batch::{BatchBackend, BatchRunner, Feed, SeqEvent};
use loip_engine::generate::{generate, Flow, StepBackend};
use loip_engine::{
    one_device_limits, EngineError, GenerateOptions, Generator, Model, PromptCacheOptions,
    SamplingParams, SeqId, ServeError, Serving, TokenPos,
};
use loip_model::Checkpoint;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Logits rows a backend produced, per sequence, in order (before any EOS mask).
type Rows = BTreeMap<SeqId, Vec<Vec<f32>>>;

/// `generate`'s backend, recording each step's logits.
struct RecStep<'m, 'a> {
    gen: Generator<'m, 'a>,
    rows: Rows,
}

impl StepBackend for RecStep<'_, '_> {
    fn step(&mut self, seq: SeqId, ids: &[u32], start: usize) -> Result<Vec<f32>, EngineError> {
        let l = self.gen.step(seq, ids, start)?;
        self.rows.entry(seq).or_default().push(l.clone());
        Ok(l)
    }
}

/// The batch backend, recording each sampled row's logits under its sequence and counting
/// the positions fed; `fork: false` hides the engine's fork (a backend that cannot share KV).
struct RecBatch<'m, 'a> {
    gen: Generator<'m, 'a>,
    rows: Rows,
    forwards: usize,
    max_seqs_in_forward: usize,
    fed: usize,
    fork: bool,
}

impl<'m, 'a> RecBatch<'m, 'a> {
    fn new(model: &'m Model<'a>, fork: bool) -> Self {
        RecBatch {
            gen: Generator::new(model, None),
            rows: Rows::new(),
            forwards: 0,
            max_seqs_in_forward: 0,
            fed: 0,
            fork,
        }
    }
}

impl BatchBackend for RecBatch<'_, '_> {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let out = self.gen.forward_rows(ids, batch, rows)?;
        let vocab = self.gen.vocab_size();
        for (r, l) in rows.iter().zip(out.chunks_exact(vocab)) {
            self.rows.entry(batch[*r].seq).or_default().push(l.to_vec());
        }
        self.forwards += 1;
        self.fed += ids.len();
        let mut seqs: Vec<SeqId> = batch.iter().map(|t| t.seq).collect();
        seqs.dedup();
        self.max_seqs_in_forward = self.max_seqs_in_forward.max(seqs.len());
        Ok(out)
    }

    fn release(&mut self, seq: SeqId) {
        self.gen.release(seq)
    }

    fn fork(&mut self, from: SeqId, to: SeqId, len: usize) -> Result<(), EngineError> {
        self.gen.fork(from, to, len)
    }

    fn can_fork(&self) -> bool {
        self.fork
    }

    fn vocab_size(&self) -> usize {
        self.gen.vocab_size()
    }
}

/// A request of the matrix.
#[derive(Clone)]
struct Case {
    seq: SeqId,
    at_round: usize, // arrives before this round
    prompt: Vec<u32>,
    opts: GenerateOptions,
}

/// Prompts and options of different lengths; odd sequences sample with their own seed.
fn cases(vocab: usize, eos: &[u32], n: usize) -> Vec<Case> {
    (0..n as u64)
        .map(|s| {
            let len = 1 + (s as usize * 7) % 13;
            let prompt = (0..len)
                .map(|i| ((s as usize * 31 + i * 17 + 3) % vocab) as u32)
                .collect();
            let max_tokens = 3 + ((s as usize + 1) * 5) % 9;
            let sampling = if s % 2 == 1 {
                SamplingParams {
                    temperature: 0.7 + 0.1 * s as f32,
                    top_k: if s % 3 == 0 { 0 } else { 20 },
                    top_p: 0.9,
                    seed: 1000 + s,
                }
            } else {
                SamplingParams::default()
            };
            Case {
                seq: 100 + s,
                at_round: (s as usize * 3) % 5,
                prompt,
                opts: GenerateOptions {
                    max_tokens,
                    sampling,
                    eos_ids: eos.to_vec(),
                    // Half of them may stop at EOS early, the others are held to their length.
                    min_tokens: if s % 4 < 2 { max_tokens } else { 0 },
                },
            }
        })
        .collect()
}

/// Each case alone through `generate`: (new tokens, logits rows).
fn alone(model: &Model<'_>, c: &Case) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut rec = RecStep {
        gen: Generator::new(model, None),
        rows: Rows::new(),
    };
    let out = generate(&mut rec, c.seq, &c.prompt, &c.opts, &mut |_| Flow::Continue).unwrap();
    (out.new_ids, rec.rows.remove(&c.seq).unwrap_or_default())
}

#[derive(Default)]
struct Served {
    tokens: BTreeMap<SeqId, Vec<u32>>, // from Token events
    done: BTreeMap<SeqId, Vec<u32>>,   // from Done events
    cancelled: Vec<SeqId>,
    rows: Rows,
    max_seqs_in_forward: usize,
    fed: usize,  // positions fed in all
    shared: u64, // prompt positions copied by forks
}

/// Serves `cases` through the scheduler, cancelling `cancel = (seq, round)`, forking
/// shared prompts where `fork`; checks each round that the cache holds no more than the
/// scheduler reserved.
fn serve(
    model: &Model<'_>,
    cases: &[Case],
    (chunk, batch_tokens): (usize, usize),
    fork: bool,
    cancel: Option<(SeqId, usize)>,
) -> Served {
    let kept = (PromptCacheOptions::OFF, None);
    serve_with(model, cases, (chunk, batch_tokens), fork, cancel, kept)
}

/// [`serve`] with a prompt cache and a KV budget `kept = (cache, budget)`: each round the
/// cache holds no more than the scheduler reserved plus what the prompt cache keeps, and no
/// more than the budget.
fn serve_with(
    model: &Model<'_>,
    cases: &[Case],
    (chunk, batch_tokens): (usize, usize),
    fork: bool,
    cancel: Option<(SeqId, usize)>,
    (cache, budget): (PromptCacheOptions, Option<u64>),
) -> Served {
    let mut limits = one_device_limits(model, budget);
    limits.prefill_chunk = chunk;
    limits.max_batch_tokens = batch_tokens;
    let per_token = limits.devices[0].bytes_per_token;
    let backend = RecBatch::new(model, fork);
    let mut serving = Serving::new(limits, backend).unwrap();
    serving.set_prompt_cache(cache);
    let mut served = Served::default();
    let mut t = 0.0;
    let last_arrival = cases.iter().map(|c| c.at_round).max().unwrap_or(0);
    for round in 0..1000 {
        for c in cases.iter().filter(|c| c.at_round == round) {
            serving.submit(t, c.seq, &c.prompt, &c.opts).unwrap();
        }
        if let Some((seq, at)) = cancel {
            if at == round {
                assert!(serving.cancel(t, seq));
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
                SeqEvent::Failed { seq, error } => panic!("{seq} failed: {error}"),
            }
        }
        let reserved: u64 = serving.stats().kv.iter().map(|k| k.reserved).sum();
        let used = serving.runner().backend().gen.kv.used_bytes();
        let kept = serving.prompt_cache().2 * per_token;
        assert!(
            used <= reserved + kept && used <= budget.unwrap_or(u64::MAX),
            "round {round}: {used} B cached, {reserved} B reserved, {kept} B kept"
        );
        if round >= last_arrival && serving.is_idle() {
            let stats = serving.stats();
            assert!(stats.kv.iter().all(|k| k.used == 0 && k.reserved == 0));
            let kv = &serving.runner().backend().gen.kv;
            assert_eq!(kv.is_empty(), kept == 0);
            assert!(kv.used_bytes() <= kept);
            let backend = serving.runner().backend();
            served.rows = backend.rows.clone();
            served.max_seqs_in_forward = backend.max_seqs_in_forward;
            served.fed = backend.fed;
            served.shared = serving.shared_tokens();
            return served;
        }
    }
    panic!("not idle after 1000 rounds");
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Runs `runs = (sequences, prefill chunk, batch tokens)` against each case alone; with
/// `cancel`, also all 8 cases with one cancelled in the middle.
fn check_matrix(name: &str, runs: &[(usize, usize, usize)], cancel: bool) {
    let path = match name {
        "smollm2" => loip_model::fetch::fetch_smollm2().unwrap(),
        _ => fixture(name),
    };
    let ckpt = Checkpoint::open(&path).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let vocab = ckpt.config.vocab_size;
    let n_max = if cancel {
        8
    } else {
        runs.iter().map(|r| r.0).max().unwrap_or(1)
    };
    let all = cases(vocab, &ckpt.config.eos_token_ids, n_max);
    let refs: BTreeMap<SeqId, _> = all.iter().map(|c| (c.seq, alone(&model, c))).collect();
    for &(n, chunk, batch_tokens) in runs {
        let s = serve(&model, &all[..n], (chunk, batch_tokens), false, None);
        for c in &all[..n] {
            let (want, want_rows) = &refs[&c.seq];
            let ctx = format!("{name}: n={n} chunk={chunk} seq={}", c.seq);
            assert!(!want.is_empty() && want_rows.len() >= want.len(), "{ctx}");
            assert_eq!(&s.done[&c.seq], want, "{ctx}: tokens");
            assert_eq!(
                s.tokens.get(&c.seq).cloned().unwrap_or_default(),
                *want,
                "{ctx}"
            );
            assert_eq!(bits(&s.rows[&c.seq]), bits(want_rows), "{ctx}: logits");
        }
        if n > 1 {
            assert!(s.max_seqs_in_forward > 1, "{name}: n={n} never batched");
        }
    }
    if !cancel {
        return;
    }
    // A cancellation in the middle: the others are untouched, the cancelled one got a prefix.
    let victim = all[5].seq;
    let s = serve(&model, &all, (4, 16), false, Some((victim, 3)));
    assert_eq!(s.cancelled, vec![victim]);
    assert!(!s.done.contains_key(&victim));
    for c in &all {
        let (want, want_rows) = &refs[&c.seq];
        let got = s.tokens.get(&c.seq).cloned().unwrap_or_default();
        let rows = s.rows.get(&c.seq).cloned().unwrap_or_default();
        if c.seq == victim {
            assert!(got.len() < want.len() && want.starts_with(&got), "{name}");
            assert_eq!(bits(&rows), bits(&want_rows[..rows.len()]), "{name}");
        } else {
            assert_eq!(&got, want, "{name}: seq {}", c.seq);
            assert_eq!(bits(&rows), bits(want_rows), "{name}: seq {}", c.seq);
        }
    }
}

/// (sequences, prefill chunk, batch tokens)
const MATRIX: [(usize, usize, usize); 5] =
    [(1, 64, 512), (2, 3, 8), (4, 1, 6), (8, 7, 24), (8, 64, 512)];

#[test]
fn batched_serving_is_bit_identical_to_generate_alone_tiny_qwen3() {
    check_matrix("tiny-qwen3", &MATRIX, true);
}

#[test]
fn batched_serving_is_bit_identical_to_generate_alone_tiny_llama_bf16() {
    check_matrix("tiny-llama-bf16-tied", &MATRIX, true);
}

/// SmolLM2-135M (Q4_1, fetched and cached like its golden test): 4 sequences, staggered,
/// two sampled, chunked prefill.
#[test]
fn batched_serving_is_bit_identical_to_generate_alone_smollm2() {
    check_matrix("smollm2", &[(4, 5, 12)], false);
}

#[test]
fn bad_requests_and_bad_feeds_are_refused_without_changing_state() {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let vocab = ckpt.config.vocab_size;
    let opts = GenerateOptions {
        max_tokens: 3,
        sampling: SamplingParams::default(),
        eos_ids: vec![],
        min_tokens: 0,
    };
    let mut serving = Serving::new(
        one_device_limits(&model, Some(1 << 20)),
        Generator::new(&model, Some(1 << 20)),
    )
    .unwrap();
    let err = |r: Result<(), ServeError>| r.unwrap_err().to_string();
    assert!(err(serving.submit(0.0, 1, &[], &opts)).contains("no tokens"));
    assert!(err(serving.submit(0.0, 1, &[vocab as u32], &opts)).contains("vocabulary"));
    let bad = GenerateOptions {
        sampling: SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        ..opts.clone()
    };
    assert!(err(serving.submit(0.0, 1, &[1], &bad)).contains("temperature"));
    let huge = GenerateOptions {
        max_tokens: 1 << 30,
        ..opts.clone()
    };
    assert!(err(serving.submit(0.0, 1, &[1], &huge)).contains("refused"));
    serving.submit(0.0, 1, &[1, 2], &opts).unwrap();
    assert!(err(serving.submit(0.0, 1, &[1, 2], &opts)).contains("running"));
    // The runner refuses feeds that do not follow a sequence's tokens.
    let mut runner = BatchRunner::new(Generator::new(&model, None));
    runner.add(7, &[1, 2, 3], &opts).unwrap();
    for feeds in [
        vec![Feed { seq: 8, len: 1 }],
        vec![Feed { seq: 7, len: 4 }],
        vec![Feed { seq: 7, len: 0 }],
        vec![Feed { seq: 7, len: 1 }, Feed { seq: 7, len: 1 }],
    ] {
        assert!(runner.run_step(&feeds).is_err(), "{feeds:?}");
    }
    assert!(runner.backend().kv.is_empty());
    let ev = runner.run_step(&[Feed { seq: 7, len: 3 }]).unwrap();
    assert!(matches!(ev[..], [SeqEvent::Token { seq: 7, .. }]));
}

/// Sequence `100 + i` of `prompt`: sampled with its own seed (the first greedy), arriving
/// before round `at[i]`.
fn choices(prompt: &[u32], at: &[usize], eos: &[u32]) -> Vec<Case> {
    at.iter()
        .enumerate()
        .map(|(i, &at_round)| {
            let sampling = if i == 0 {
                SamplingParams::default()
            } else {
                SamplingParams {
                    temperature: 0.9,
                    top_k: 0,
                    top_p: 0.95,
                    seed: 7 + i as u64,
                }
            };
            let opts = GenerateOptions {
                max_tokens: 6,
                sampling,
                eos_ids: eos.to_vec(),
                min_tokens: 6,
            };
            Case {
                seq: 100 + i as SeqId,
                at_round,
                prompt: prompt.to_vec(),
                opts,
            }
        })
        .collect()
}

fn check_forks(name: &str) {
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let vocab = ckpt.config.vocab_size;
    let eos = &ckpt.config.eos_token_ids;
    // longer than a tiny model's sliding window, so a fork copies only the window
    let prompt: Vec<u32> = (0..23).map(|i| ((i * 37 + 5) % vocab) as u32).collect();
    // with the first, while it prefills (chunks of 4), while it decodes, after it ended
    let cs = choices(&prompt, &[0, 0, 0, 2, 4, 40], eos);
    let alone: BTreeMap<SeqId, _> = cs.iter().map(|c| (c.seq, alone(&model, c))).collect();
    for chunk in [4, 64] {
        let forked = serve(&model, &cs, (chunk, 512), true, None);
        let alone_fed = serve(&model, &cs, (chunk, 512), false, None);
        for (seq, (want, want_rows)) in &alone {
            let ctx = format!("{name} chunk {chunk} seq {seq}");
            assert_eq!(&forked.done[seq], want, "{ctx}: tokens");
            assert_eq!(bits(&forked.rows[seq]), bits(want_rows), "{ctx}: logits");
            assert_eq!(&alone_fed.done[seq], want, "{ctx}: tokens, no fork");
            assert_eq!(bits(&alone_fed.rows[seq]), bits(want_rows), "{ctx}");
        }
        // The four that came while the first held the prompt shared all of it but one
        // token; on a sliding-window model only those that came before it decoded past the
        // window (it no longer holds the window before the prompt's last token).
        let n = prompt.len() as u64 - 1;
        let sliding = ckpt.config.sliding_window.is_some();
        let forks = if sliding && chunk == 64 { 2 } else { 4 };
        assert_eq!(forked.shared, forks * n, "{name} chunk {chunk}");
        assert_eq!(alone_fed.shared, 0);
        assert_eq!(alone_fed.fed - forked.fed, forked.shared as usize);
    }
    // A sequence waiting for the prompt is cancelled before it starts: the others are whole.
    let cs = choices(&prompt, &[0, 0, 0], eos);
    let s = serve(&model, &cs, (4, 512), true, Some((101, 1)));
    assert_eq!(s.cancelled, vec![101]);
    assert!(!s.done.contains_key(&101));
    for seq in [100, 102] {
        assert_eq!(s.done[&seq], alone[&seq].0, "{name}: seq {seq}");
    }
    assert_eq!(s.shared, prompt.len() as u64 - 1);
}

#[test]
fn forked_prompts_are_bit_identical_to_generate_alone_tiny_qwen3() {
    check_forks("tiny-qwen3");
}

#[test]
fn forked_prompts_are_bit_identical_to_generate_alone_tiny_gemma3_sliding() {
    check_forks("tiny-gemma3");
}

#[test]
fn forked_prompts_are_bit_identical_to_generate_alone_tiny_llama() {
    check_forks("tiny-llama");
}

/// A chat's turns: each later prompt begins with an earlier request's prompt and answer.
/// With the prompt cache each takes a copy of the longest beginning a finished sequence's KV
/// shares with it and computes the rest; tokens and logits stay those of `generate` alone;
/// a KV budget too small for the kept KV and a new admission evicts the kept KV first.
fn check_prompt_cache(name: &str) {
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let vocab = ckpt.config.vocab_size;
    let eos = &ckpt.config.eos_token_ids;
    let first: Vec<u32> = (0..20).map(|i| ((i * 37 + 5) % vocab) as u32).collect();
    let first_case = choices(&first, &[0], eos).remove(0);
    let answer = alone(&model, &first_case).0;
    let turn = |seq: SeqId, at_round: usize, prompt: Vec<u32>| Case {
        seq,
        at_round,
        prompt,
        ..first_case.clone()
    };
    let mut cs = vec![first_case.clone()];
    // the next turn: the first prompt, its answer, three new tokens
    let next: Vec<u32> = [&first[..], &answer[..], &[7, 8, 9]].concat();
    // a prompt sharing 18 tokens, the same prompt again, an unrelated one
    let partial: Vec<u32> = [&first[..18], &[3, 3, 3, 3]].concat();
    let other: Vec<u32> = (0..20).map(|i| ((i * 11 + 1) % vocab) as u32).collect();
    cs.extend([
        turn(201, 30, next.clone()),
        turn(202, 30, partial),
        turn(203, 30, first.clone()),
        turn(204, 30, other),
    ]);
    let want: BTreeMap<SeqId, _> = cs.iter().map(|c| (c.seq, alone(&model, c))).collect();
    let full = ckpt.config.sliding_window.is_none();
    for chunk in [4, 64] {
        let on = (PromptCacheOptions::keep(4), None);
        let s = serve_with(&model, &cs, (chunk, 512), true, None, on);
        for (seq, (tokens, rows)) in &want {
            let ctx = format!("{name} chunk {chunk} seq {seq}");
            assert_eq!(&s.done[seq], tokens, "{ctx}: tokens");
            assert_eq!(bits(&s.rows[seq]), bits(rows), "{ctx}: logits");
        }
        // the first's KV holds its prompt and all its answer but the last token
        let held = first.len() + answer.len() - 1;
        let total: usize = cs
            .iter()
            .map(|c| c.prompt.len() + c.opts.max_tokens - 1)
            .sum();
        assert_eq!(
            s.fed + s.shared as usize,
            total,
            "{name}: every position once"
        );
        if full {
            assert_eq!(s.shared as usize, held + 18 + (first.len() - 1), "{name}");
        } else {
            // a sliding window no longer holds the rows before 18 or 19: only the next
            // turn, which continues where the first ended, shares
            assert_eq!(s.shared as usize, held, "{name} chunk {chunk}");
        }
    }
    // A budget that holds one sequence at full length: the first's KV is kept until the
    // next turn is admitted, then evicted to make room for it (nothing shared).
    let per = one_device_limits(&model, None).devices[0].bytes_per_token;
    let one = (next.len() + first_case.opts.max_tokens) as u64 * per;
    let cs = vec![first_case.clone(), turn(201, 30, next)];
    let tight = (PromptCacheOptions::keep(4), Some(one));
    let s = serve_with(&model, &cs, (64, 512), true, None, tight);
    for c in &cs {
        assert_eq!(
            s.done[&c.seq], want[&c.seq].0,
            "{name}: tight, seq {}",
            c.seq
        );
    }
    assert_eq!(s.shared, 0, "{name}: the kept KV yields to an admission");
}

#[test]
fn prompt_cache_reuses_finished_kv_bit_identically_tiny_qwen3() {
    check_prompt_cache("tiny-qwen3");
}

#[test]
fn prompt_cache_reuses_finished_kv_bit_identically_tiny_gemma3_sliding() {
    check_prompt_cache("tiny-gemma3");
}
