//! A prompt shared by several sequences (the `n` choices of one request) is computed once:
//! the others take a copy of its KV ([`BatchBackend::fork`]) and feed only its last token.
//! Each sequence still gets the tokens AND the bit-identical logits of running it alone
//! through `generate` with its own seed, on a full-attention model and on one with sliding
//! windows, whether it arrives with the first one, while it prefills, while it decodes or
//! after it ended; a backend that cannot fork gives the same answers with one prefill each;
//! the cache never holds more than the scheduler reserved; a waiting sequence cancels cleanly.

use std::collections::BTreeMap;
use std::path::PathBuf;

use loip_engine::batch::{BatchBackend, SeqEvent};
use loip_engine::generate::{generate, Flow, StepBackend};
use loip_engine::{
    one_device_limits, EngineError, GenerateOptions, Generator, Model, SamplingParams, SeqId,
    Serving, TokenPos,
};
use loip_model::Checkpoint;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// Logits rows per sequence, in order.
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

/// The batch backend, recording each sampled row's logits and counting the positions fed;
/// `fork: false` hides the engine's fork (a backend that cannot share KV).
struct RecBatch<'m, 'a> {
    gen: Generator<'m, 'a>,
    rows: Rows,
    fed: usize,
    fork: bool,
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
        self.fed += ids.len();
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

/// Sequence `100 + i` of the prompt: sampled with its own seed (the first greedy), arriving
/// before round `at[i]`.
fn choices(at: &[usize], eos: &[u32]) -> Vec<(SeqId, usize, GenerateOptions)> {
    at.iter()
        .enumerate()
        .map(|(i, &round)| {
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
            (100 + i as SeqId, round, opts)
        })
        .collect()
}

struct Served {
    done: BTreeMap<SeqId, Vec<u32>>,
    rows: Rows,
    fed: usize,
    shared: u64,
    cancelled: Vec<SeqId>,
}

/// Serves the choices with prefill chunks of `chunk` tokens, cancelling `cancel` at its
/// round; checks each round that the cache holds no more than the scheduler reserved.
fn serve(
    model: &Model<'_>,
    prompt: &[u32],
    cs: &[(SeqId, usize, GenerateOptions)],
    chunk: usize,
    fork: bool,
    cancel: Option<(SeqId, usize)>,
) -> Served {
    let mut limits = one_device_limits(model, None);
    limits.prefill_chunk = chunk;
    let backend = RecBatch {
        gen: Generator::new(model, None),
        rows: Rows::new(),
        fed: 0,
        fork,
    };
    let mut serving = Serving::new(limits, backend).unwrap();
    let mut done = BTreeMap::new();
    let mut cancelled = Vec::new();
    let mut t = 0.0;
    let last = cs.iter().map(|c| c.1).max().unwrap_or(0);
    for round in 0..500 {
        for (seq, _, opts) in cs.iter().filter(|c| c.1 == round) {
            serving.submit(t, *seq, prompt, opts).unwrap();
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
                SeqEvent::Done { seq, new_ids, .. } => {
                    assert!(done.insert(seq, new_ids).is_none())
                }
                SeqEvent::Cancelled { seq } => cancelled.push(seq),
                SeqEvent::Failed { seq, error } => panic!("{seq} failed: {error}"),
                SeqEvent::Token { .. } => {}
            }
        }
        let reserved: u64 = serving.stats().kv.iter().map(|k| k.reserved).sum();
        let used = serving.runner().backend().gen.kv.used_bytes();
        assert!(
            used <= reserved,
            "round {round}: {used} B cached, {reserved} B reserved"
        );
        if round >= last && serving.is_idle() {
            assert!(serving.runner().backend().gen.kv.is_empty());
            let b = serving.runner().backend();
            return Served {
                done,
                rows: b.rows.clone(),
                fed: b.fed,
                shared: serving.shared_tokens(),
                cancelled,
            };
        }
    }
    panic!("not idle after 500 rounds");
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

fn check(name: &str) {
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let vocab = ckpt.config.vocab_size;
    let eos = &ckpt.config.eos_token_ids;
    // longer than a tiny model's sliding window, so a fork copies only the window
    let prompt: Vec<u32> = (0..23).map(|i| ((i * 37 + 5) % vocab) as u32).collect();
    // with the first, while it prefills (chunks of 4), while it decodes, after it ended
    let cs = choices(&[0, 0, 0, 2, 4, 40], eos);
    let alone: BTreeMap<SeqId, (Vec<u32>, Vec<Vec<f32>>)> = cs
        .iter()
        .map(|(seq, _, opts)| {
            let mut rec = RecStep {
                gen: Generator::new(&model, None),
                rows: Rows::new(),
            };
            let out = generate(&mut rec, *seq, &prompt, opts, &mut |_| Flow::Continue).unwrap();
            (*seq, (out.new_ids, rec.rows.remove(seq).unwrap()))
        })
        .collect();
    for chunk in [4, 64] {
        let forked = serve(&model, &prompt, &cs, chunk, true, None);
        let alone_fed = serve(&model, &prompt, &cs, chunk, false, None);
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
    let cs = choices(&[0, 0, 0], eos);
    let s = serve(&model, &prompt, &cs, 4, true, Some((101, 1)));
    assert_eq!(s.cancelled, vec![101]);
    assert!(!s.done.contains_key(&101));
    for seq in [100, 102] {
        assert_eq!(s.done[&seq], alone[&seq].0, "{name}: seq {seq}");
    }
    assert_eq!(s.shared, prompt.len() as u64 - 1);
}

#[test]
fn forked_prompts_are_bit_identical_to_generate_alone_tiny_qwen3() {
    check("tiny-qwen3");
}

#[test]
fn forked_prompts_are_bit_identical_to_generate_alone_tiny_gemma3_sliding() {
    check("tiny-gemma3");
}

#[test]
fn forked_prompts_are_bit_identical_to_generate_alone_tiny_llama() {
    check("tiny-llama");
}
