//! One batched step for many sequences: the synchronous batch runner.
//!
//! A [`BatchBackend`] runs ONE forward over the tokens of several sequences (each weight is
//! read once for all of them) and returns the logits of only the rows that need a next
//! token. The [`BatchRunner`] keeps each sequence's tokens and its own [`Decoding`] (sampler
//! and RNG, EOS mask until `min_tokens`, EOS / max-token / caller stops: the pieces the
//! [`generate`](crate::generate()) loop uses), builds the step from a list of [`Feed`]s, and
//! samples per sequence.
//!
//! Invariant (lossless): a sequence's tokens and logits do not depend on the batch around it
//! (arrival times, chunk sizes, other sequences, cancellations): a token's hidden state
//! depends only on its sequence (see the crate docs), and sampling is per sequence. So every
//! sequence gets exactly what [`generate`](crate::generate()) gives it alone.
//!
//! A speculating sequence ([`BatchRunner::speculate`], prompt lookup) carries its drafts in
//! its decode feed; its rows are used as [`generate_speculative`](crate::generate_speculative())
//! uses them (each only once the drafts before it were kept), and the backend drops the
//! rejected positions ([`BatchBackend::rewind`]), so it too gets what `generate` gives it
//! alone without speculation.

use std::collections::{BTreeMap, BTreeSet};

use crate::forward::TokenPos;
use crate::generate::{Decoding, Flow, GenerateOptions, Generator, Next, StopReason};
use crate::kv::SeqId;
use crate::sampling::{argmax_masked, mask};
use crate::sampling::{Shaping, TokenLogprob};
use crate::speculate::adapt::StepCost;
use crate::speculate::batched::SeqSpec;
use crate::speculate::options::{SpecOptions, SpecStats, Speculate};
use crate::EngineError;

/// A row of a step whose logits pick the next token of its sequence.
#[derive(Debug, Clone, Copy)]
pub struct RowPick<'a> {
    /// the row (index into the step's tokens)
    pub row: usize,
    /// pick the argmax where the logits are ([`Next::Id`]); else return them ([`Next::Logits`])
    pub greedy: bool,
    /// ids set to −∞ first (EOS before `min_tokens`)
    pub masked: &'a [u32],
}

/// Runs batched forward steps: the tokens of several sequences in one forward.
pub trait BatchBackend {
    /// Feeds `ids[t]` at `batch[t]` (several sequences, each contiguous from its cached
    /// length) and returns the logits `(rows.len(), vocab)` of the selected rows.
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError>;

    /// [`BatchBackend::forward_rows`] that picks each row's next token as asked. A backend
    /// whose logits live elsewhere (the last device of a pipeline) picks there.
    fn forward_pick(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        picks: &[RowPick<'_>],
    ) -> Result<Vec<Next>, EngineError> {
        let rows: Vec<usize> = picks.iter().map(|p| p.row).collect();
        let logits = self.forward_rows(ids, batch, &rows)?;
        let vocab = logits.len() / picks.len().max(1);
        Ok(pick_rows(&logits, vocab, picks))
    }

    /// Frees `seq`'s KV (nothing when unknown).
    fn release(&mut self, seq: SeqId);

    /// Keeps only the first `len` positions of `seq`'s KV (a speculative step's rejected
    /// positions). A backend that cannot says so in [`BatchBackend::can_rewind`] and is
    /// never asked.
    fn rewind(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        let _ = (seq, len);
        Err(EngineError::Backend(
            "this backend cannot drop KV positions (no speculative decoding)".into(),
        ))
    }

    /// Whether [`BatchBackend::rewind`] works here.
    fn can_rewind(&self) -> bool {
        false
    }

    /// Gives sequence `to` (not cached yet) a copy of `from`'s first `len` positions of KV, as
    /// if it had been fed the same tokens (a prompt shared by several sequences is computed
    /// once), counted against the cache's budget. A backend that cannot says so in
    /// [`BatchBackend::can_fork`] and is never asked: its sequences prefill on their own.
    fn fork(&mut self, from: SeqId, to: SeqId, len: usize) -> Result<(), EngineError> {
        let _ = (from, to, len);
        Err(EngineError::Backend(
            "this backend cannot share KV between sequences".into(),
        ))
    }

    /// Whether [`BatchBackend::fork`] works here.
    fn can_fork(&self) -> bool {
        false
    }

    /// Token ids must be below this.
    fn vocab_size(&self) -> usize;
}

/// Each row's next token from `logits: (picks.len(), vocab)`: its mask applied, then the argmax
/// (greedy rows) or the masked logits to sample from — the engine's own sampler's first steps,
/// wherever the logits were computed.
pub fn pick_rows(logits: &[f32], vocab: usize, picks: &[RowPick<'_>]) -> Vec<Next> {
    picks
        .iter()
        .zip(logits.chunks_exact(vocab.max(1)))
        .map(|(p, l)| {
            if p.greedy {
                // no copy of the row (151936 f32 for Qwen2.5, each row each step)
                return Next::Id(argmax_masked(l, p.masked));
            }
            let mut l = l.to_vec();
            mask(&mut l, p.masked);
            Next::Logits(l)
        })
        .collect()
}

impl BatchBackend for Generator<'_, '_> {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let x = self.model.forward_hidden(ids, batch, &mut self.kv)?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.model.logits(&x, rows)
    }

    fn release(&mut self, seq: SeqId) {
        self.kv.remove(seq);
    }

    fn rewind(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        self.kv.truncate(seq, len);
        Ok(())
    }

    fn can_rewind(&self) -> bool {
        true
    }

    fn fork(&mut self, from: SeqId, to: SeqId, len: usize) -> Result<(), EngineError> {
        self.kv.fork(from, to, len)
    }

    fn can_fork(&self) -> bool {
        true
    }

    fn vocab_size(&self) -> usize {
        self.model.tf.cfg.vocab_size
    }
}

/// Feed the next `len` tokens of sequence `seq` in this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Feed {
    /// the sequence
    pub seq: SeqId,
    /// tokens to feed // tokens
    pub len: usize,
}

/// What a step did to one sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeqEvent {
    /// a new token was kept
    Token {
        /// the sequence
        seq: SeqId,
        /// the token
        id: u32,
    },
    /// the sequence is done (after any `Token` of the same step); its state is gone, its KV
    /// is still held until [`BatchRunner::release`]
    Done {
        /// the sequence
        seq: SeqId,
        /// its new tokens (EOS excluded)
        new_ids: Vec<u32>,
        /// why it ended
        stop: StopReason,
    },
    /// cancelled ([`Serving::cancel`](crate::Serving::cancel)): its KV is free
    Cancelled {
        /// the sequence
        seq: SeqId,
    },
    /// its step failed ([`Serving::step`](crate::Serving::step)); the sequence is dropped
    Failed {
        /// the sequence
        seq: SeqId,
        /// the error's message
        error: String,
    },
}

/// One sequence in the runner.
#[derive(Debug)]
struct SeqRun {
    tokens: Vec<u32>, // prompt, then each kept new token
    fed: usize,       // tokens in the KV cache // tokens
    dec: Decoding,
    spec: Option<SeqSpec>, // speculating: its drafts and counts
}

/// The synchronous batch runner: per-sequence state over one [`BatchBackend`].
pub struct BatchRunner<B> {
    backend: B,
    seqs: BTreeMap<SeqId, SeqRun>,
    /// log-probabilities of sequences' kept tokens, until taken
    logprobs: BTreeMap<SeqId, Vec<TokenLogprob>>,
    /// those of sequences released since the last step, until taken or the next step
    ended: BTreeMap<SeqId, Vec<TokenLogprob>>,
    /// what speculation drafted and kept, per source, over all sequences so far
    spec_totals: Vec<(Speculate, SpecStats)>,
    /// the tokens in the KV of ended sequences not released yet (a fork may still copy
    /// them), kept only where the backend can fork
    ended_kv: BTreeMap<SeqId, Vec<u32>>,
}

impl<B: BatchBackend> BatchRunner<B> {
    /// A runner over `backend`.
    pub fn new(backend: B) -> Self {
        BatchRunner {
            backend,
            seqs: BTreeMap::new(),
            logprobs: BTreeMap::new(),
            ended: BTreeMap::new(),
            spec_totals: Vec::new(),
            ended_kv: BTreeMap::new(),
        }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably.
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Adds a sequence; refuses an empty prompt, an id outside the vocabulary, a known `seq`
    /// or bad sampling parameters.
    pub fn add(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> Result<(), EngineError> {
        self.add_shaped(seq, prompt, opts, &Shaping::default())
    }

    /// [`BatchRunner::add`] for a sequence whose tokens are shaped (penalties, bias) and
    /// whose log-probabilities are recorded ([`BatchRunner::take_logprobs`]); refuses a bad
    /// `shaping` too.
    pub fn add_shaped(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        opts: &GenerateOptions,
        shaping: &Shaping,
    ) -> Result<(), EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt has no tokens".into()));
        }
        if self.seqs.contains_key(&seq) {
            return Err(EngineError::Invalid(format!("sequence {seq} is running")));
        }
        let vocab = self.backend.vocab_size();
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::BadTokenId { id, vocab });
        }
        shaping.validate(vocab)?;
        let dec = Decoding::shaped(opts, shaping, prompt)?;
        self.seqs.insert(
            seq,
            SeqRun {
                tokens: prompt.to_vec(),
                fed: 0,
                dec,
                spec: None,
            },
        );
        Ok(())
    }

    /// Makes added sequence `seq` speculate from `source` with `opts` (prompt lookup; `Off`
    /// turns it off): a feed of its decode step may then carry up to
    /// [`BatchRunner::drafts_ready`]'s drafts after its pending token. Refused when the
    /// backend cannot drop KV positions, or for a draft model (not served in batches).
    pub fn speculate(
        &mut self,
        seq: SeqId,
        source: Speculate,
        opts: &SpecOptions,
    ) -> Result<(), EngineError> {
        let spec = match source {
            Speculate::Off => None,
            Speculate::Draft => {
                return Err(EngineError::Invalid(
                    "a draft model is not served in batches; speculate with lookup".into(),
                ))
            }
            Speculate::Lookup if !self.backend.can_rewind() => {
                return Err(EngineError::Invalid(
                    "speculative decoding is not available on this backend".into(),
                ))
            }
            Speculate::Lookup => Some(SeqSpec::new(source, opts)),
        };
        let run = self
            .seqs
            .get_mut(&seq)
            .ok_or_else(|| EngineError::Invalid(format!("unknown sequence {seq}")))?;
        run.spec = spec;
        Ok(())
    }

    /// Prepares the drafts of every speculating sequence whose next step is a decode step:
    /// `(sequence, drafts ready)`, 0 included. A feed may then carry up to that many tokens
    /// beyond the pending one (the scheduler's `set_drafts`). `cost`: the times of steps by
    /// their number of positions (the draft lengths weigh the neighbours' time too).
    pub fn drafts_ready(&mut self, cost: &StepCost) -> Vec<(SeqId, usize)> {
        let others = self.seqs.len().saturating_sub(1); // at least one position each
        let mut out = Vec::new();
        for (&seq, run) in self.seqs.iter_mut() {
            let Some(spec) = run.spec.as_mut() else {
                continue;
            };
            if run.tokens.len() != run.fed + 1 || run.dec.stop_reason().is_some() {
                continue; // prefilling
            }
            let wanted = run.dec.wanted().saturating_sub(1);
            out.push((seq, spec.prepare(&run.tokens, wanted, others, cost)));
        }
        out
    }

    /// What speculation drafted and kept so far, per source (sequences' steps summed).
    pub fn spec_totals(&self) -> &[(Speculate, SpecStats)] {
        &self.spec_totals
    }

    /// Sequences held.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// Whether no sequence is held.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// The log-probabilities of `seq`'s kept tokens since the last call (asked for with
    /// [`BatchRunner::add_shaped`]); after it is released, until the next step.
    pub fn take_logprobs(&mut self, seq: SeqId) -> Vec<TokenLogprob> {
        self.logprobs
            .remove(&seq)
            .or_else(|| self.ended.remove(&seq))
            .unwrap_or_default()
    }

    /// The tokens in `seq`'s KV (running, or ended and not released yet); `None` when
    /// unknown, or ended on a backend that cannot fork.
    pub fn cached_tokens(&self, seq: SeqId) -> Option<&[u32]> {
        match self.seqs.get(&seq) {
            Some(run) => Some(&run.tokens[..run.fed.min(run.tokens.len())]),
            None => self.ended_kv.get(&seq).map(|t| &t[..]),
        }
    }

    /// Whether `seq` was added and not released.
    pub fn knows(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq) || self.ended_kv.contains_key(&seq)
    }

    /// Whether the backend can share KV between sequences ([`BatchBackend::can_fork`]).
    pub fn can_fork(&self) -> bool {
        self.backend.can_fork()
    }

    /// Gives added sequence `to`, not fed yet, a copy of `from`'s KV for the longest run of
    /// leading tokens they share within all of `to`'s prompt but its last token (which `to`
    /// then feeds itself, so that it samples its first token from its own row): a shared
    /// prompt, or a shared beginning, is computed once. Returns the positions shared. Refused
    /// (nothing changes) when the backend cannot fork, `from` shares no leading token, or the
    /// copy does not fit.
    pub fn fork(&mut self, from: SeqId, to: SeqId) -> Result<usize, EngineError> {
        let target = self
            .seqs
            .get(&to)
            .filter(|r| r.fed == 0)
            .ok_or_else(|| EngineError::Invalid(format!("sequence {to} cannot take a fork")))?;
        let want = &target.tokens[..target.tokens.len() - 1]; // prompts are never empty
        let held = self.cached_tokens(from).unwrap_or_default();
        let n = held.iter().zip(want).take_while(|(a, b)| a == b).count();
        if n == 0 {
            return Err(EngineError::Invalid(format!(
                "sequence {from} does not hold the beginning of {to}'s prompt"
            )));
        }
        self.backend.fork(from, to, n)?;
        if let Some(run) = self.seqs.get_mut(&to) {
            run.fed = n;
        }
        Ok(n)
    }

    /// Ends the runner's part of `seq` but keeps its KV, and the tokens it holds
    /// ([`BatchRunner::cached_tokens`]), for forks until [`BatchRunner::release`]; where the
    /// backend cannot fork, releases it.
    pub fn retire(&mut self, seq: SeqId) {
        if !self.backend.can_fork() {
            return self.release(seq);
        }
        if let Some(run) = self.seqs.remove(&seq) {
            self.keep_kv(seq, &run);
        }
        if let Some(lps) = self.logprobs.remove(&seq) {
            self.ended.insert(seq, lps);
        }
    }

    /// Drops `seq`'s state and frees its KV (a finished, cancelled or failed sequence).
    pub fn release(&mut self, seq: SeqId) {
        self.ended_kv.remove(&seq);
        self.seqs.remove(&seq);
        if let Some(lps) = self.logprobs.remove(&seq) {
            self.ended.insert(seq, lps);
        }
        self.backend.release(seq);
    }

    /// Ends `seq` at the caller's request (a stop string): returns its event, or `None`
    /// when unknown. Its KV is held until [`BatchRunner::release`].
    pub fn stop(&mut self, seq: SeqId) -> Option<SeqEvent> {
        let mut run = self.seqs.remove(&seq)?;
        run.dec.stop();
        self.keep_kv(seq, &run);
        Some(done(seq, run))
    }

    /// Runs one forward over every feed (each a sequence's next unfed tokens, each sequence
    /// at most once; a speculating sequence's decode feed may also carry its prepared
    /// drafts, see [`BatchRunner::drafts_ready`]), samples the sequences whose known tokens
    /// are then all fed, and returns what happened, in feed order. A refused or failed step
    /// changes no sequence's state.
    ///
    /// A speculating feed's rows are used in order while each picks the draft the next row
    /// assumed (as [`generate_speculative`](crate::generate_speculative()) does); its KV then
    /// drops the rejected positions.
    pub fn run_step(&mut self, feeds: &[Feed]) -> Result<Vec<SeqEvent>, EngineError> {
        self.ended.clear();
        let mut ids = Vec::new();
        let mut batch = Vec::new();
        let mut sampled: Vec<(SeqId, usize, usize)> = Vec::new(); // (seq, first row, rows)
        let mut seen = BTreeSet::new();
        for f in feeds {
            let run = self
                .seqs
                .get(&f.seq)
                .ok_or_else(|| EngineError::Invalid(format!("unknown sequence {}", f.seq)))?;
            let unfed = run.tokens.len() - run.fed;
            // a decode feed of a speculating sequence may carry its drafts
            let drafts = match &run.spec {
                Some(sp) if unfed == 1 => sp.drafts(),
                _ => &[],
            };
            if !seen.insert(f.seq) || f.len == 0 || f.len > unfed + drafts.len() {
                return Err(EngineError::Invalid(format!(
                    "sequence {}: cannot feed {} tokens ({unfed} unfed, or fed twice)",
                    f.seq, f.len
                )));
            }
            let first = ids.len();
            let own = f.len.min(unfed);
            ids.extend_from_slice(&run.tokens[run.fed..run.fed + own]);
            ids.extend_from_slice(&drafts[..f.len - own]);
            batch.extend((run.fed..run.fed + f.len).map(|pos| TokenPos { seq: f.seq, pos }));
            if f.len >= unfed {
                let rows = 1 + f.len - own;
                sampled.push((f.seq, first + own - 1, rows));
            }
        }
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let picks: Vec<RowPick<'_>> = sampled
            .iter()
            .flat_map(|&(seq, row, rows)| {
                let dec = &self.seqs[&seq].dec;
                (0..rows).map(move |j| RowPick {
                    row: row + j,
                    greedy: dec.greedy(),
                    masked: dec.masked_after(j),
                })
            })
            .collect();
        let next = self.backend.forward_pick(&ids, &batch, &picks)?;
        if next.len() != picks.len() {
            return Err(EngineError::Backend(format!(
                "{} picks for {} rows",
                next.len(),
                picks.len()
            )));
        }
        for f in feeds {
            if let Some(run) = self.seqs.get_mut(&f.seq) {
                run.fed += f.len;
            }
        }
        let mut events = Vec::new();
        let mut at = 0; // index into `next`
        for &(seq, _, rows) in &sampled {
            let next = &next[at..at + rows];
            at += rows;
            let Some(run) = self.seqs.get_mut(&seq) else {
                continue;
            };
            let mut feed = None;
            let mut kept = 0; // rows used: the pending token's, then each kept draft's
            for (j, n) in next.iter().enumerate() {
                kept = j + 1;
                let before = run.dec.new_ids().len();
                feed = run.dec.accept(n, &mut |_| Flow::Continue);
                let lps = run.dec.take_logprobs();
                if !lps.is_empty() {
                    self.logprobs.entry(seq).or_default().extend(lps);
                }
                if let Some(&id) = run.dec.new_ids().get(before) {
                    events.push(SeqEvent::Token { seq, id });
                }
                let draft = run.spec.as_ref().and_then(|s| s.drafts().get(j).copied());
                if feed.is_none() || j + 1 == rows || feed != draft {
                    break;
                }
                run.tokens.push(draft.unwrap_or_default()); // a kept draft: already fed
            }
            if rows > 1 {
                // drop the rejected drafts' positions: the KV holds the kept tokens only
                run.fed -= rows - kept;
                if kept < rows {
                    if let Err(e) = self.backend.rewind(seq, run.fed) {
                        self.seqs.remove(&seq);
                        events.push(SeqEvent::Failed {
                            seq,
                            error: e.to_string(),
                        });
                        continue;
                    }
                }
            }
            if let Some(spec) = run.spec.as_mut() {
                spec.observe(rows - 1, kept - 1);
                add_stats(&mut self.spec_totals, spec.source(), rows - 1, kept - 1);
            }
            match feed {
                Some(id) => run.tokens.push(id),
                None => {
                    if let Some(run) = self.seqs.remove(&seq) {
                        self.keep_kv(seq, &run);
                        events.push(done(seq, run));
                    }
                }
            }
        }
        Ok(events)
    }
}

impl<B: BatchBackend> BatchRunner<B> {
    /// Notes the tokens in an ending sequence's KV, for a fork until it is released.
    fn keep_kv(&mut self, seq: SeqId, run: &SeqRun) {
        if self.backend.can_fork() {
            self.ended_kv
                .insert(seq, run.tokens[..run.fed.min(run.tokens.len())].to_vec());
        }
    }
}

/// Adds a step that verified `drafted` drafts and kept `accepted` to `source`'s totals.
fn add_stats(
    totals: &mut Vec<(Speculate, SpecStats)>,
    source: Speculate,
    drafted: usize,
    accepted: usize,
) {
    let i = match totals.iter().position(|(s, _)| *s == source) {
        Some(i) => i,
        None => {
            totals.push((source, SpecStats::default()));
            totals.len() - 1
        }
    };
    let t = &mut totals[i].1;
    t.steps += 1;
    t.drafted += drafted;
    t.accepted += accepted.min(drafted);
    t.draft_steps += usize::from(drafted > 0);
}

fn done(seq: SeqId, run: SeqRun) -> SeqEvent {
    SeqEvent::Done {
        seq,
        stop: run.dec.stop_reason().unwrap_or(StopReason::Stop),
        new_ids: run.dec.new_ids().to_vec(),
    }
}
