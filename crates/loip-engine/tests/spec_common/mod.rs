//! Shared by the speculation tests of the engine (in memory) and the runtime (offloaded):
//! recording backends, drafters and the matrix of cases that must match decoding without
//! speculation bit for bit.
#![allow(dead_code)]

use std::collections::BTreeMap;

use loip_engine::batch::BatchBackend;
use loip_engine::generate::{generate, Flow, StepBackend};
use loip_engine::speculate::lookup::Lookup;
use loip_engine::speculate::{generate_speculative, Drafter, Rewind, SpecOptions, SpecStats};
use loip_engine::{
    EngineError, GenerateOptions, Generator, Model, SamplingParams, SeqId, TokenPos,
};

/// Logits by position whose row they are (a later row at the same position replaces an
/// earlier one: rejected rows are computed again once their context is right).
pub type ByPos = BTreeMap<usize, Vec<u32>>; // pos → logits as bits

/// A row of logits as bits (exact comparison).
pub fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|v| v.to_bits()).collect()
}

/// `generate`'s backend, recording each step's last-row logits.
pub struct RecStep<B> {
    /// the backend
    pub inner: B,
    /// its rows
    pub rows: ByPos,
}

impl<B: StepBackend> StepBackend for RecStep<B> {
    fn step(&mut self, seq: SeqId, ids: &[u32], start: usize) -> Result<Vec<f32>, EngineError> {
        let l = self.inner.step(seq, ids, start)?;
        self.rows.insert(start + ids.len() - 1, bits(&l));
        Ok(l)
    }
}

/// The speculative loop's backend, recording every row it returns and the forwards run.
pub struct Rec<B> {
    /// the backend
    pub inner: B,
    /// every row returned, by position
    pub rows: ByPos,
    /// forwards run
    pub forwards: usize,
    /// most positions in one forward after the prompt
    pub widest: usize,
}

impl<B> Rec<B> {
    /// A recorder around `inner`.
    pub fn new(inner: B) -> Rec<B> {
        Rec {
            inner,
            rows: ByPos::new(),
            forwards: 0,
            widest: 0,
        }
    }
}

impl<B: Rewind> BatchBackend for Rec<B> {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let out = self.inner.forward_rows(ids, batch, rows)?;
        let vocab = self.inner.vocab_size();
        for (r, l) in rows.iter().zip(out.chunks_exact(vocab)) {
            self.rows.insert(batch[*r].pos, bits(l));
        }
        if self.forwards > 0 {
            self.widest = self.widest.max(ids.len());
        }
        self.forwards += 1;
        Ok(out)
    }
    fn release(&mut self, seq: SeqId) {
        self.inner.release(seq)
    }
    fn rewind(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        self.inner.rewind(seq, len)
    }
    fn can_rewind(&self) -> bool {
        self.inner.can_rewind()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
}

impl<B: Rewind> Rewind for Rec<B> {
    fn allow_rewind(&mut self, k: usize) {
        self.inner.allow_rewind(k)
    }
    fn max_positions(&self) -> Option<usize> {
        self.inner.max_positions()
    }
}

/// Drafts from the reference tokens: right, except every `wrong_every`-th token (0: never).
pub struct Oracle {
    /// prompt length // tokens
    pub prompt_len: usize,
    /// the tokens decoding without speculation gives
    pub want: Vec<u32>,
    /// every this many tokens is drafted wrong (0: none)
    pub wrong_every: usize,
    /// token ids are below this
    pub vocab: u32,
}

impl Drafter for Oracle {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, EngineError> {
        let kept = context.len() - self.prompt_len;
        Ok((kept..(kept + k).min(self.want.len()))
            .map(|i| {
                let t = self.want[i];
                if self.wrong_every > 0 && i % self.wrong_every == 0 {
                    (t + 1) % self.vocab
                } else {
                    t
                }
            })
            .collect())
    }
}

pub struct Case {
    /// prompt ids
    pub prompt: Vec<u32>,
    /// options
    pub opts: GenerateOptions,
}

/// Greedy and seeded sampled requests; the prompts repeat themselves so lookup hits.
pub fn cases(vocab: u32, eos: &[u32]) -> Vec<Case> {
    let rep = |n: usize, s: u32| -> Vec<u32> {
        (0..n).map(|i| (s + (i as u32 % 5) * 7) % vocab).collect()
    };
    let greedy = |max_tokens, min_tokens| GenerateOptions {
        max_tokens,
        sampling: SamplingParams::default(),
        eos_ids: eos.to_vec(),
        min_tokens,
    };
    vec![
        Case {
            prompt: rep(17, 3),
            opts: greedy(24, 24),
        },
        Case {
            prompt: vec![1, 17, 42, 99, 3, 250 % vocab, 7, 8],
            opts: greedy(20, 0),
        },
        Case {
            prompt: rep(9, 11),
            opts: GenerateOptions {
                sampling: SamplingParams {
                    temperature: 0.8,
                    top_k: 20,
                    top_p: 0.95,
                    seed: 42,
                },
                ..greedy(22, 22)
            },
        },
    ]
}

/// The in-memory engine without speculation: new tokens, and logits by position.
pub fn reference(model: &Model<'_>, c: &Case) -> (Vec<u32>, ByPos) {
    let mut rec = RecStep {
        inner: Generator::new(model, None),
        rows: ByPos::new(),
    };
    let out = generate(&mut rec, 7, &c.prompt, &c.opts, &mut |_| Flow::Continue).unwrap();
    (out.new_ids, rec.rows)
}

/// Every case × draft length × drafter through `backend()` against the in-memory engine
/// without speculation: tokens, streamed tokens, each kept token's logits (bit-identical),
/// one forward per step of at most k + 1 positions. Calls `after` with each run's recorder
/// and stats. Returns the tokens prompt lookup accepted over all runs.
pub fn check_matrix<B: Rewind>(
    model: &Model<'_>,
    name: &str,
    mut backend: impl FnMut() -> B,
    mut after: impl FnMut(&str, &mut Rec<B>, &SpecStats),
) -> usize {
    let vocab = model.tf.cfg.vocab_size as u32;
    let mut hits = 0;
    for (ci, c) in cases(vocab, &[2]).iter().enumerate() {
        let (want, want_rows) = reference(model, c);
        let specs = [
            (1, false),
            (2, false),
            (4, false),
            (7, false),
            (8, true), // adaptive
        ];
        for (k, adaptive) in specs {
            for drafter in 0..4 {
                let mut d: Box<dyn Drafter> = match drafter {
                    0 => Box::new(Lookup {
                        ngram_max: 3,
                        ngram_min: 1,
                    }),
                    w => Box::new(Oracle {
                        prompt_len: c.prompt.len(),
                        want: want.clone(),
                        wrong_every: [0, 0, 1, 3][w],
                        vocab,
                    }),
                };
                let mut rec = Rec::new(backend());
                let spec = SpecOptions {
                    k_max: k,
                    adaptive,
                    ..Default::default()
                };
                let mut streamed = Vec::new();
                let got = generate_speculative(
                    &mut rec,
                    7,
                    &c.prompt,
                    &c.opts,
                    d.as_mut(),
                    &spec,
                    &mut |t| {
                        streamed.push(t);
                        Flow::Continue
                    },
                )
                .unwrap();
                let tag = format!("{name} case {ci} k={k} adaptive={adaptive} drafter {drafter}");
                assert_eq!(got.out.new_ids, want, "{tag}: tokens");
                assert_eq!(streamed, want, "{tag}: streamed tokens");
                for (pos, l) in &want_rows {
                    assert!(
                        rec.rows.get(pos) == Some(l),
                        "{tag}: logits at position {pos}"
                    );
                }
                let s = got.stats;
                assert!(s.accepted <= s.drafted, "{tag}: {s:?}");
                assert_eq!(rec.forwards, 1 + s.steps, "{tag}: one forward per step");
                assert!(
                    rec.widest <= k + 1,
                    "{tag}: a step of {} positions",
                    rec.widest
                );
                if drafter == 1 && !adaptive && want.len() > k + 1 {
                    // always right: every step but the last verifies k drafts and keeps them
                    assert!(s.acceptance() == 1.0, "{tag}: {s:?}");
                    assert!(s.steps <= want.len().div_ceil(k + 1), "{tag}: {s:?}");
                }
                if drafter == 2 {
                    assert_eq!(s.accepted, 0, "{tag}: {s:?}");
                }
                if drafter == 0 {
                    hits += s.accepted;
                }
                after(&tag, &mut rec, &s);
            }
        }
    }
    hits
}
