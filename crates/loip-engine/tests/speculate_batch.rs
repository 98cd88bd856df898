//! Speculative decoding in continuous batching: speculating sequences (prompt lookup) share
//! steps with plain ones, and each sequence gets the tokens of `generate` alone without
//! speculation, each kept token from bit-identical logits, whatever the batch around it
//! (staggered arrivals, chunked prefill, a step-token limit that leaves few spare positions
//! for drafts, a KV budget of about two requests shared by the cache and the scheduler),
//! greedy and seeded sampled, on a full-attention and a sliding-window model;
//! the scheduler's KV ledger and the cache hold nothing once all are done.

use std::collections::BTreeMap;
use std::path::PathBuf;

use loip_engine::batch::{BatchBackend, SeqEvent};
use loip_engine::generate::{generate, Flow, StepBackend};
use loip_engine::speculate::{Rewind, SpecOptions, Speculate};
use loip_engine::{
    one_device_limits, EngineError, GenerateOptions, Generator, Model, SamplingParams, SeqId,
    Serving, Shaping, TokenPos,
};
use loip_model::Checkpoint;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Logits by (sequence, position), as bits; a later row at the same position replaces an
/// earlier one (a rejected row is computed again once its context is right).
type Rows = BTreeMap<(SeqId, usize), Vec<u32>>;

fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|v| v.to_bits()).collect()
}

/// `generate`'s backend, recording each step's last row.
struct RecStep<'m, 'a> {
    gen: Generator<'m, 'a>,
    rows: Rows,
}

impl StepBackend for RecStep<'_, '_> {
    fn step(&mut self, seq: SeqId, ids: &[u32], start: usize) -> Result<Vec<f32>, EngineError> {
        let l = self.gen.step(seq, ids, start)?;
        self.rows.insert((seq, start + ids.len() - 1), bits(&l));
        Ok(l)
    }
}

/// The batch backend, recording every returned row and the widest item of a sequence.
struct RecBatch<'m, 'a> {
    gen: Generator<'m, 'a>,
    rows: Rows,
    widest: usize, // most positions of one sequence in one forward after its prompt
    rewinds: usize,
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
            self.rows.insert((batch[*r].seq, batch[*r].pos), bits(l));
        }
        let mut per_seq: BTreeMap<SeqId, usize> = BTreeMap::new();
        for (t, r) in batch.iter().enumerate() {
            if rows.contains(&t) {
                *per_seq.entry(r.seq).or_default() += 1;
            }
        }
        self.widest = self
            .widest
            .max(per_seq.values().copied().max().unwrap_or(0));
        Ok(out)
    }
    fn release(&mut self, seq: SeqId) {
        self.gen.release(seq)
    }
    fn rewind(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        self.rewinds += 1;
        self.gen.rewind(seq, len)
    }
    fn can_rewind(&self) -> bool {
        true
    }
    fn vocab_size(&self) -> usize {
        self.gen.vocab_size()
    }
}

struct Case {
    seq: SeqId,
    at_round: usize,
    prompt: Vec<u32>,
    opts: GenerateOptions,
    spec: Speculate,
}

/// Six requests whose prompts repeat themselves (lookup hits); even ones speculate, every
/// third samples with its own seed, some are held to their length past EOS.
fn cases(vocab: u32, eos: &[u32]) -> Vec<Case> {
    (0..6u64)
        .map(|s| {
            let period = 3 + s as usize % 3;
            let prompt: Vec<u32> = (0..9 + 2 * s as usize)
                .map(|i| ((s as usize * 13 + (i % period) * 29 + 5) as u32) % vocab)
                .collect();
            let max_tokens = 12 + 3 * s as usize;
            let sampling = if s % 3 == 1 {
                SamplingParams {
                    temperature: 0.8,
                    top_k: 20,
                    top_p: 0.95,
                    seed: 500 + s,
                }
            } else {
                SamplingParams::default()
            };
            Case {
                seq: 40 + s,
                at_round: (s as usize * 2) % 5,
                prompt,
                opts: GenerateOptions {
                    max_tokens,
                    sampling,
                    eos_ids: eos.to_vec(),
                    min_tokens: if s % 4 < 2 { max_tokens } else { 0 },
                },
                spec: if s % 2 == 0 || s == 5 {
                    Speculate::Lookup
                } else {
                    Speculate::Off
                },
            }
        })
        .collect()
}

fn alone(model: &Model<'_>, c: &Case) -> (Vec<u32>, Rows) {
    let mut rec = RecStep {
        gen: Generator::new(model, None),
        rows: Rows::new(),
    };
    let out = generate(&mut rec, c.seq, &c.prompt, &c.opts, &mut |_| Flow::Continue).unwrap();
    (out.new_ids, rec.rows)
}

/// What serving all cases gave.
struct Served {
    tokens: BTreeMap<SeqId, Vec<u32>>, // from Token events
    done: BTreeMap<SeqId, Vec<u32>>,   // from Done events
    rows: Rows,
    widest: usize,
    rewinds: usize,
    lookup: (usize, usize), // drafted, accepted
}

/// Serves every case with `(prefill chunk, step tokens, k, KV budget)`; the cache and the
/// scheduler share the budget (a request waits for room, none fails for KV mid-way).
fn serve(model: &Model<'_>, cases: &[Case], how: (usize, usize, usize, Option<u64>)) -> Served {
    let (chunk, batch_tokens, k, kv_budget) = how;
    let mut limits = one_device_limits(model, kv_budget);
    limits.prefill_chunk = chunk;
    limits.max_batch_tokens = batch_tokens;
    let mut gen = Generator::new(model, kv_budget);
    gen.allow_rewind(k);
    let backend = RecBatch {
        gen,
        rows: Rows::new(),
        widest: 0,
        rewinds: 0,
    };
    let mut serving = Serving::new(limits, backend).unwrap();
    let spec = SpecOptions {
        k_max: k,
        adaptive: k > 4,
        ..Default::default()
    };
    let (mut tokens, mut done) = (BTreeMap::new(), BTreeMap::new());
    let mut t = 0.0;
    for round in 0..2000 {
        for c in cases.iter().filter(|c| c.at_round == round) {
            let how = (c.spec, &spec);
            let shaping = Shaping::default();
            serving
                .submit_speculative(t, c.seq, &c.prompt, &c.opts, &shaping, how)
                .unwrap();
        }
        let mut clock = || {
            t += 1.0;
            t
        };
        for e in serving.step(&mut clock).unwrap() {
            match e {
                SeqEvent::Token { seq, id } => tokens.entry(seq).or_insert(Vec::new()).push(id),
                SeqEvent::Done { seq, new_ids, .. } => {
                    assert!(done.insert(seq, new_ids).is_none())
                }
                SeqEvent::Cancelled { .. } => panic!("nothing was cancelled"),
                SeqEvent::Failed { seq, error } => panic!("{seq} failed: {error}"),
            }
        }
        if round >= 5 && serving.is_idle() {
            let stats = serving.stats();
            assert!(stats.kv.iter().all(|k| k.used == 0 && k.reserved == 0));
            let lookup = serving
                .spec_totals()
                .iter()
                .find(|(s, _)| *s == Speculate::Lookup)
                .map_or((0, 0), |(_, st)| (st.drafted, st.accepted));
            let b = serving.runner().backend();
            assert!(b.gen.kv.is_empty());
            assert_eq!(b.gen.kv.used_bytes(), 0);
            return Served {
                tokens,
                done,
                rows: b.rows.clone(),
                widest: b.widest,
                rewinds: b.rewinds,
                lookup,
            };
        }
    }
    panic!("not idle after 2000 rounds");
}

fn check(name: &str) {
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let all = cases(ckpt.config.vocab_size as u32, &ckpt.config.eos_token_ids);
    let refs: BTreeMap<SeqId, _> = all.iter().map(|c| (c.seq, alone(&model, c))).collect();
    let mut accepted = 0;
    // room for the KV of about two of the longest requests at once
    let bytes_per_token = one_device_limits(&model, None).devices[0].bytes_per_token;
    let longest = all
        .iter()
        .map(|c| c.prompt.len() + c.opts.max_tokens)
        .max()
        .unwrap_or(1) as u64;
    let tight = Some(2 * longest * bytes_per_token);
    for (chunk, batch_tokens, k, budget) in [
        (4, 64, 3, None),
        (5, 12, 8, None),
        (64, 512, 1, None),
        (3, 9, 6, None),
        (8, 32, 8, tight),
    ] {
        let rec = serve(&model, &all, (chunk, batch_tokens, k, budget));
        let (tokens, done, (drafted, acc)) = (&rec.tokens, &rec.done, rec.lookup);
        let tag = format!("{name}: chunk {chunk}, step tokens {batch_tokens}, k {k}, {budget:?}");
        for c in &all {
            let (want, want_rows) = &refs[&c.seq];
            assert_eq!(
                tokens.get(&c.seq),
                Some(want),
                "{tag} seq {}: tokens",
                c.seq
            );
            assert_eq!(done.get(&c.seq), Some(want), "{tag} seq {}: done", c.seq);
            for (key, l) in want_rows {
                assert!(rec.rows.get(key) == Some(l), "{tag}: logits at {key:?}");
            }
        }
        assert!(acc <= drafted, "{tag}: {acc} of {drafted}");
        assert!(
            rec.widest <= k + 1 || rec.widest <= chunk,
            "{tag}: {}",
            rec.widest
        );
        if acc > 0 {
            assert!(rec.widest > 1, "{tag}: drafts kept without a wide step");
        }
        eprintln!(
            "{tag}: drafted {drafted}, accepted {acc}, rewinds {}",
            rec.rewinds
        );
        accepted += acc;
    }
    assert!(accepted > 0, "{name}: lookup never hit");
}

#[test]
fn speculating_and_plain_sequences_share_steps_losslessly() {
    check("tiny-llama");
}

#[test]
fn batched_speculation_is_lossless_on_a_sliding_window_model() {
    check("tiny-gemma3");
}
