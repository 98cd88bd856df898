//! Lossless speculative decoding: propose `k` tokens cheaply, verify them and the position
//! after them in ONE forward of `k + 1` positions, keep the longest prefix the model itself
//! produces, and drop the KV of the rest.
//!
//! The pieces: a [`Drafter`] proposes tokens ([`lookup::Lookup`], prompt lookup, needs no
//! second model; [`draft::ModelDrafter`], a smaller model with the same tokenizer);
//! [`adapt::AdaptiveK`] chooses how many per step; [`generate_speculative`] is the
//! generation loop over any [`Rewind`] backend (the in-memory [`Generator`], the offloaded
//! device of `loip_runtime`); [`batched::SeqSpec`] is a speculating sequence's state in the
//! batch runner (continuous batching, `loip api`).
//!
//! [`Sampler::keep_or_resample`]: crate::Sampler::keep_or_resample
//!
//! Invariants (lossless, tested in `tests/speculate.rs`, `tests/speculate_batch.rs` and
//! `tests/speculate_sampling.rs`):
//! - Row `j` of a verify step is the position after the pending token and the first `j`
//!   drafts. It is only used once those drafts were all accepted, i.e. once its context is
//!   exactly what decoding one token at a time would have fed; the batched forward computes
//!   each position bit-identically to one at a time (crate docs), so its logits are the
//!   non-speculative step's, bit for bit.
//! - Each used row goes through the sequence's own [`Decoding`] exactly as in
//!   [`generate`](crate::generate()) (EOS mask, argmax or one draw of the seeded sampler).
//!   A point-mass draft (prompt lookup, a greedy draft model) counts as accepted only when
//!   that pick equals it. So greedy AND seeded sampled requests with such drafts give the
//!   tokens of decoding without speculation; the sampler draws once per kept token in both.
//!   (For `q = δ(x)` this IS the speculative sampling rule: `x` is kept with probability
//!   `p(x)`, else the token is drawn from `p` without `x`.)
//! - A draft drawn from a distribution `q` (a draft model sampling under a sampled request,
//!   [`Proposal::q`]) is kept with probability `min(1, p(x) / q(x))`, else replaced by a
//!   draw from the residual `max(0, p − q)` ([`Sampler::keep_or_resample`]): each kept token
//!   is distributed as without speculation, though a seed no longer gives the same tokens
//!   (`tests/speculate_sampling.rs` checks the law with a chi-square test).
//! - After a step the KV holds exactly the fed tokens that were kept: the rejected rows are
//!   truncated ([`BatchBackend::rewind`]) before the next step.

pub mod adapt;
pub mod batched;
pub mod draft;
pub mod lookup;
pub(crate) mod options;

use std::time::Instant;

use crate::batch::{pick_rows, BatchBackend, RowPick};
use crate::forward::TokenPos;
use crate::generate::{
    Decoding, Flow, GenerateOptions, GenerateOutput, Generator, Next, StopReason,
};
use crate::kv::SeqId;
use crate::sampling::Dist;
use crate::EngineError;

use lookup::Lookup;
pub use options::{SpecOptions, SpecStats, Speculate};

/// Most positions a backend that serves many requests (a cluster's workers) lets one step
/// rewind: its sliding-window layers keep this many positions more than their window. A
/// request speculates at most this many drafts a step there.
pub const MAX_REWIND: usize = 16;

/// A backend that drops a sequence's newest positions (the rejected drafts' KV, with
/// [`BatchBackend::rewind`]) in one sequence's speculative loop.
pub trait Rewind: BatchBackend {
    /// Makes rewinds of up to `k` positions possible from now on: a sliding-window layer
    /// keeps `k` positions more than its window ([`KvCache::widen_windows`]), so a rewind
    /// never drops below the window the next step reads.
    ///
    /// [`KvCache::widen_windows`]: crate::KvCache::widen_windows
    fn allow_rewind(&mut self, k: usize);

    /// The model's context limit (positions), if any.
    fn max_positions(&self) -> Option<usize>;
}

impl Rewind for Generator<'_, '_> {
    fn allow_rewind(&mut self, k: usize) {
        self.kv.widen_windows(k);
    }

    fn max_positions(&self) -> Option<usize> {
        Some(self.model.tf.cfg.max_position_embeddings)
    }
}

/// Proposes draft tokens to follow a context.
pub trait Drafter {
    /// Up to `k` tokens likely to follow `context` (prompt and kept tokens).
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, EngineError>;

    /// [`Drafter::propose`] with the distributions the drafts were drawn from. The default:
    /// point masses (`q` empty), verified by exact match; a drafter that samples (a draft
    /// model under a sampled request) returns one `q` per draft, verified by the speculative
    /// sampling rule.
    fn propose_drawn(&mut self, context: &[u32], k: usize) -> Result<Proposal, EngineError> {
        Ok(Proposal {
            tokens: self.propose(context, k)?,
            q: Vec::new(),
        })
    }
}

/// Draft tokens and, for drafts drawn from a distribution, theirs.
#[derive(Debug, Clone, Default)]
pub struct Proposal {
    /// the drafts
    pub tokens: Vec<u32>,
    /// empty: each draft is a point mass; else `q[i]` is the distribution `tokens[i]` was
    /// drawn from (as many as `tokens`)
    pub q: Vec<Dist>,
}

impl Drafter for Lookup {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, EngineError> {
        Ok(self.draft(context, k))
    }
}

/// The output of [`generate_speculative`].
#[derive(Debug, Clone)]
pub struct SpecOutput {
    /// the tokens and timings, as [`generate`](crate::generate()) reports them
    pub out: GenerateOutput,
    /// what speculation did
    pub stats: SpecStats,
}

/// Generates like [`generate`](crate::generate()) (same tokens, and each kept token from
/// logits bit-identical to its), verifying the `drafter`'s proposals in steps of up to
/// `spec.k_max + 1` positions. `decode_ms_per_token` is the decode time over the tokens
/// after the first, as without speculation.
pub fn generate_speculative<B: Rewind + ?Sized>(
    backend: &mut B,
    seq: SeqId,
    prompt: &[u32],
    opts: &GenerateOptions,
    drafter: &mut dyn Drafter,
    spec: &SpecOptions,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<SpecOutput, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::Invalid("the prompt has no tokens".into()));
    }
    let mut dec = Decoding::new(opts)?;
    let mut adapt = spec.controller();
    let mut stats = SpecStats::default();
    backend.allow_rewind(spec.k_max);
    let mut context = prompt.to_vec(); // prompt, then each kept token
    let t0 = Instant::now();
    // the prompt's step, as without speculation (greedy: picked where the logits are)
    let first = if dec.greedy() {
        Next::Id(greedy_last(backend, seq, prompt, dec.masked())?)
    } else {
        Next::Logits(verify(backend, seq, prompt, 0, 1)?)
    };
    let mut fed = prompt.len(); // positions in the KV
    let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t1 = Instant::now();
    let mut pending = match &first {
        Next::Id(_) => {
            let next = dec.accept(&first, on_token);
            extend_context(&dec, 0, &mut context);
            next
        }
        Next::Logits(row) => take(&mut dec, row, on_token, &mut context),
    };
    while let Some(last) = pending {
        // drafts: no more than the tokens still wanted after this step's first, nor past the
        // model's context limit
        let wanted = opts.max_tokens.saturating_sub(dec.new_ids().len() + 1);
        let room = backend_room(backend, fed);
        let k = adapt.next_k().min(wanted).min(room);
        let ts = Instant::now(); // a step's cost: drafting and verifying
        let Proposal {
            tokens: mut draft,
            q,
        } = if k > 0 {
            drafter.propose_drawn(&context, k)?
        } else {
            Proposal::default()
        };
        draft.truncate(k);
        // None: point masses (and no drafts at all: a step of one position picks its token
        // where the logits are, as without speculation)
        let q = (!draft.is_empty() && q.len() >= draft.len()).then_some(q);
        let mut ids = Vec::with_capacity(draft.len() + 1);
        ids.push(last);
        ids.extend_from_slice(&draft);
        // greedy with point-mass drafts: each row's token is picked where the logits are
        // (the last device of a pipeline: 8 bytes a row back), under the row's own EOS mask
        let pick = dec.greedy() && q.is_none();
        let rows = match verify_rows(backend, seq, &ids, fed, &dec, pick) {
            // the KV budget refused the longer step (nothing was written): verify none
            Err(EngineError::KvBudget { .. }) if !draft.is_empty() => {
                draft.clear();
                ids.truncate(1);
                verify_rows(backend, seq, &ids, fed, &dec, pick)?
            }
            r => r?,
        };
        let secs = ts.elapsed().as_secs_f64();
        // use rows in order while each picks the draft that the next row assumed
        let vocab = rows.logits.len() / ids.len();
        let mut kept = 0; // fed tokens kept: the pending one, then accepted drafts
        pending = None;
        for j in 0..ids.len() {
            kept = j + 1;
            let row = rows.logits.get(j * vocab..(j + 1) * vocab).unwrap_or(&[]);
            let drawn = q.as_ref().and_then(|q| Some((*draft.get(j)?, &q[j])));
            let (next, hit) = match (rows.picked.get(j), drawn) {
                (Some(&id), _) => {
                    let held = dec.new_ids().len();
                    let next = dec.accept(&Next::Id(id), on_token);
                    extend_context(&dec, held, &mut context);
                    (next, next.is_some() && next == draft.get(j).copied())
                }
                (None, Some((x, qj))) => take_drawn(&mut dec, row, x, qj, on_token, &mut context),
                (None, None) => {
                    let next = take(&mut dec, row, on_token, &mut context);
                    (next, next.is_some() && next == draft.get(j).copied())
                }
            };
            if !hit || next.is_none() {
                pending = next;
                break;
            }
        }
        let accepted = kept - 1;
        fed += kept;
        if kept < ids.len() {
            backend.rewind(seq, fed)?;
        }
        stats.steps += 1;
        stats.drafted += draft.len();
        stats.accepted += accepted.min(draft.len());
        stats.draft_steps += usize::from(!draft.is_empty());
        adapt.observe(draft.len(), accepted, Some(secs));
    }
    let decoded = dec.new_ids().len().saturating_sub(1);
    let decode_ms_per_token = if decoded > 0 {
        t1.elapsed().as_secs_f64() * 1e3 / decoded as f64
    } else {
        0.0
    };
    Ok(SpecOutput {
        out: GenerateOutput {
            stop: dec.stop_reason().unwrap_or(StopReason::Length),
            new_ids: dec.new_ids().to_vec(),
            prompt_ms,
            decode_ms_per_token,
        },
        stats,
    })
}

/// Positions a step at `fed` may add before the model's context limit, beyond the first.
fn backend_room<B: Rewind + ?Sized>(backend: &B, fed: usize) -> usize {
    backend
        .max_positions()
        .map_or(usize::MAX, |limit| limit.saturating_sub(fed + 1))
}

/// One forward of `ids` at positions `start..` of `seq`: the logits `(rows, vocab)` of its
/// last `rows` positions.
fn verify<B: Rewind + ?Sized>(
    backend: &mut B,
    seq: SeqId,
    ids: &[u32],
    start: usize,
    rows: usize,
) -> Result<Vec<f32>, EngineError> {
    let batch: Vec<TokenPos> = (start..start + ids.len())
        .map(|pos| TokenPos { seq, pos })
        .collect();
    let rows: Vec<usize> = (ids.len() - rows..ids.len()).collect();
    backend.forward_rows(ids, &batch, &rows)
}

/// A verify step's rows: each row's logits `(rows, vocab)`, or (picked where the logits are)
/// each row's greedy token.
struct Rows {
    logits: Vec<f32>,
    picked: Vec<u32>,
}

/// One forward of `ids` at positions `start..` of `seq`, every position a row: with `pick`,
/// each row's argmax under the EOS mask the row is used with ([`Decoding::masked_after`]),
/// the picks made by the backend; else the logits.
/// The prompt's greedy step: `prompt` at positions `0..` of `seq`, and the argmax of its last
/// row after setting the `masked` ids to −∞, picked where the logits are (no logits row
/// fetched), as plain greedy decoding's first step.
fn greedy_last<B: Rewind + ?Sized>(
    backend: &mut B,
    seq: SeqId,
    prompt: &[u32],
    masked: &[u32],
) -> Result<u32, EngineError> {
    let batch: Vec<TokenPos> = (0..prompt.len()).map(|pos| TokenPos { seq, pos }).collect();
    let pick = RowPick {
        row: prompt.len().saturating_sub(1),
        greedy: true,
        masked,
    };
    match backend.forward_pick(prompt, &batch, &[pick])?.pop() {
        Some(Next::Id(id)) => Ok(id),
        _ => Err(EngineError::Backend(
            "a greedy step returned no token".into(),
        )),
    }
}

fn verify_rows<B: Rewind + ?Sized>(
    backend: &mut B,
    seq: SeqId,
    ids: &[u32],
    start: usize,
    dec: &Decoding,
    pick: bool,
) -> Result<Rows, EngineError> {
    if !pick {
        let logits = verify(backend, seq, ids, start, ids.len())?;
        return Ok(Rows {
            logits,
            picked: Vec::new(),
        });
    }
    let batch: Vec<TokenPos> = (start..start + ids.len())
        .map(|pos| TokenPos { seq, pos })
        .collect();
    let picks: Vec<RowPick<'_>> = (0..ids.len())
        .map(|j| RowPick {
            row: j,
            greedy: true,
            masked: dec.masked_after(j),
        })
        .collect();
    let picked = backend
        .forward_pick(ids, &batch, &picks)?
        .into_iter()
        .map(|n| match n {
            Next::Id(id) => Ok(id),
            Next::Logits(_) => Err(EngineError::Backend(
                "a greedy row came back as logits".into(),
            )),
        })
        .collect::<Result<Vec<u32>, _>>()?;
    if picked.len() != ids.len() {
        return Err(EngineError::Backend(format!(
            "{} picks for a step of {} rows",
            picked.len(),
            ids.len()
        )));
    }
    Ok(Rows {
        logits: Vec::new(),
        picked,
    })
}

/// Picks the next token from one row `(vocab,)` as the sequence's decoding state says (EOS
/// mask, argmax or a sample) and keeps it; the kept token is appended to `context`.
/// Returns the token to feed next, `None` once done.
fn take(
    dec: &mut Decoding,
    row: &[f32],
    on_token: &mut dyn FnMut(u32) -> Flow,
    context: &mut Vec<u32>,
) -> Option<u32> {
    let next = masked_row(dec, row)?;
    let kept = dec.new_ids().len();
    let feed = dec.accept(&next, on_token);
    extend_context(dec, kept, context);
    feed
}

/// [`take`] for a draft `x` drawn from `q`: the speculative sampling rule
/// ([`Decoding::accept_draft`]). Returns the token to feed next and whether `x` was kept.
fn take_drawn(
    dec: &mut Decoding,
    row: &[f32],
    x: u32,
    q: &Dist,
    on_token: &mut dyn FnMut(u32) -> Flow,
    context: &mut Vec<u32>,
) -> (Option<u32>, bool) {
    let kept = dec.new_ids().len();
    let out = match masked_row(dec, row) {
        Some(Next::Logits(l)) => dec.accept_draft(&l, x, q, on_token),
        // a greedy request: the argmax, kept like any point-mass draft
        Some(next) => {
            let feed = dec.accept(&next, on_token);
            (feed, feed == Some(x))
        }
        None => (None, false),
    };
    extend_context(dec, kept, context);
    out
}

/// The row with the sequence's EOS mask applied: its argmax when greedy, else the logits.
fn masked_row(dec: &Decoding, row: &[f32]) -> Option<Next> {
    let pick = RowPick {
        row: 0,
        greedy: dec.greedy(),
        masked: dec.masked(),
    };
    pick_rows(row, row.len(), &[pick]).pop()
}

/// Appends the token kept since `dec` held `kept` tokens (if any) to `context`.
fn extend_context(dec: &Decoding, kept: usize, context: &mut Vec<u32>) {
    if let Some(&id) = dec.new_ids().get(kept) {
        context.push(id);
    }
}
