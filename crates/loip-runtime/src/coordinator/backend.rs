//! The pipeline as the engine's backends: [`StepBackend`] (one sequence a step, the
//! engine's `generate` loop) and [`BatchBackend`] (a micro-batch of several sequences a
//! step, driven by the engine's `Serving` over the pure scheduler).
//!
//! Invariant (lossless): a greedy row's token is the argmax of its logits after its own
//! mask, picked on the last device when every row of the step is greedy (8 bytes a row
//! back) and here otherwise; either way the engine's sampler's mask-then-argmax on the same
//! bits, so the tokens are those of the single-device engine.

use loip_engine::batch::pick_rows;
use loip_engine::generate::Next;
use loip_engine::kv::SeqId;
use loip_engine::speculate::MAX_REWIND;
use loip_engine::{BatchBackend, EngineError, Rewind, RowPick, StepBackend, TokenPos};

use super::{ClusterError, Pipeline, RowsOut, StepOutput, StepStats};

impl Pipeline {
    /// A [`StepBackend`] and [`BatchBackend`] over this pipeline (call from outside the
    /// runtime).
    pub fn backend(&self) -> PipelineBackend {
        PipelineBackend {
            pipeline: self.clone(),
            last: None,
            error: None,
        }
    }
}

/// The pipeline as a [`StepBackend`] (`loip generate --cluster` and `loip local` run the
/// engine's own generation loop over it) and as a [`BatchBackend`] (micro-batches).
pub struct PipelineBackend {
    pipeline: Pipeline,
    /// timing of the last step
    pub last: Option<StepStats>,
    /// the typed error of the step that failed (the engine's loop carries only its text)
    pub error: Option<ClusterError>,
}

impl PipelineBackend {
    /// Keeps a step's outcome: its timing, or its typed error (the loop gets the text).
    fn keep<T>(
        &mut self,
        r: Result<StepOutput, ClusterError>,
        f: impl FnOnce(StepOutput) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        match r {
            Ok(out) => {
                self.last = Some(out.stats);
                f(out)
            }
            Err(e) => {
                let text = e.to_string();
                self.error = Some(e);
                Err(EngineError::Backend(text))
            }
        }
    }
}

impl StepBackend for PipelineBackend {
    fn step(&mut self, seq: u64, ids: &[u32], start_pos: usize) -> Result<Vec<f32>, EngineError> {
        let last = ids.len().saturating_sub(1) as u32;
        let r = self.pipeline.step_blocking(seq, ids, start_pos, &[last]);
        self.keep(r, |out| Ok(out.logits))
    }

    fn step_argmax(
        &mut self,
        seq: u64,
        ids: &[u32],
        start_pos: usize,
        masked: &[u32],
    ) -> Result<u32, EngineError> {
        let last = ids.len().saturating_sub(1) as u32;
        let r = self
            .pipeline
            .step_argmax_blocking(seq, ids, start_pos, &[last], masked);
        self.keep(r, |out| match out.argmax.as_slice() {
            [(id, _)] => Ok(*id),
            other => Err(EngineError::Backend(format!(
                "an argmax step returned {} rows, expected 1",
                other.len()
            ))),
        })
    }
}

fn rows_u32(picks: &[RowPick<'_>]) -> Result<Vec<u32>, EngineError> {
    picks
        .iter()
        .map(|p| {
            u32::try_from(p.row)
                .map_err(|_| EngineError::Invalid(format!("row {} of a step", p.row)))
        })
        .collect()
}

impl BatchBackend for PipelineBackend {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let rows = rows
            .iter()
            .map(|&r| u32::try_from(r).map_err(|_| EngineError::Invalid(format!("row {r}"))))
            .collect::<Result<Vec<u32>, _>>()?;
        let r = self
            .pipeline
            .step_batch_blocking(ids, batch, &rows, RowsOut::Logits);
        self.keep(r, |out| Ok(out.logits))
    }

    /// All rows greedy: the last device picks each row's token under the row's own mask (one
    /// common list when the rows' lists are the same). Else the logits come back and the
    /// picks happen here, as the engine's default does.
    fn forward_pick(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        picks: &[RowPick<'_>],
    ) -> Result<Vec<Next>, EngineError> {
        let rows = rows_u32(picks)?;
        if picks.is_empty() || !picks.iter().all(|p| p.greedy) {
            let vocab = self.pipeline.vocab().max(1);
            let r = self
                .pipeline
                .step_batch_blocking(ids, batch, &rows, RowsOut::Logits);
            let logits = self.keep(r, |out| Ok(out.logits))?;
            if logits.len() != picks.len() * vocab {
                return Err(EngineError::Backend(format!(
                    "{} logits for {} rows of {vocab}",
                    logits.len(),
                    picks.len()
                )));
            }
            return Ok(pick_rows(&logits, vocab, picks));
        }
        let common = picks[0].masked;
        let same = picks.iter().all(|p| p.masked == common);
        let row_masks: Vec<Vec<u32>> = if same {
            Vec::new()
        } else {
            picks.iter().map(|p| p.masked.to_vec()).collect()
        };
        let out = RowsOut::Argmax {
            masked: if same { common } else { &[] },
            row_masks: &row_masks,
        };
        let r = self.pipeline.step_batch_blocking(ids, batch, &rows, out);
        self.keep(r, |out| {
            if out.argmax.len() != picks.len() {
                return Err(EngineError::Backend(format!(
                    "an argmax step returned {} rows, expected {}",
                    out.argmax.len(),
                    picks.len()
                )));
            }
            Ok(out.argmax.iter().map(|&(id, _)| Next::Id(id)).collect())
        })
    }

    fn release(&mut self, seq: SeqId) {
        self.pipeline.release(&[seq]);
    }

    /// The sequence's next step drops the rejected positions on every device (per stage,
    /// lent rows included); the coordinator's ledger follows at once.
    fn rewind(&mut self, seq: SeqId, len: usize) -> Result<(), EngineError> {
        self.pipeline.rewind(seq, len);
        Ok(())
    }

    fn can_rewind(&self) -> bool {
        true
    }

    fn vocab_size(&self) -> usize {
        self.pipeline.vocab()
    }
}

/// One sequence's speculative loop over the pipeline (`loip local --speculate`). The workers
/// keep [`MAX_REWIND`] positions more than each sliding window, so drafts beyond that are
/// not verified here.
impl Rewind for PipelineBackend {
    fn allow_rewind(&mut self, k: usize) {
        if k > MAX_REWIND {
            tracing::warn!("the cluster rewinds at most {MAX_REWIND} positions a step, not {k}");
        }
    }

    fn max_positions(&self) -> Option<usize> {
        self.pipeline.max_positions()
    }
}
