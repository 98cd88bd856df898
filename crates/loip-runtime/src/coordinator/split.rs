//! A split micro-batch (the adapter's [`Verdict::Split`](crate::adapt::Verdict::Split)): its
//! sequences run as sub-steps, one group after another, and the step is answered with their
//! rows in the original order.
//!
//! The sub-steps enter through the pipeline's own command queue, like any caller's step, so
//! each is decided by the adapter on its own (evicting the other groups' KV and re-prefilling
//! its own when it must) and admitted, waved and timed as usual. The next group is sent only
//! when the previous one has come back: eviction needs nothing in flight. Rows keep their
//! masks; the output is the same rows, logits or argmax, as the whole step would give.

use tokio::sync::{mpsc, oneshot};

use super::{ClusterError, Cmd, InFlight, StepOutput, StepStats};

/// One group's part of the step: its tokens and, per row it answers, the row's index in
/// the whole step's `rows`.
struct Part {
    batch: Vec<loip_engine::TokenPos>,
    ids: Vec<u32>,
    rows: Vec<u32>,
    row_masks: Vec<Vec<u32>>,
    slots: Vec<usize>,
    rewind: Vec<u64>,
}

/// The parts of a step of `f` (input `ids`) for `groups` of its sequences.
fn parts(f: &InFlight, ids: &[u32], groups: &[Vec<u64>]) -> Vec<Part> {
    groups
        .iter()
        .map(|g| {
            let mut p = Part {
                batch: Vec::new(),
                ids: Vec::new(),
                rows: Vec::new(),
                row_masks: Vec::new(),
                slots: Vec::new(),
                rewind: f.rewind.iter().copied().filter(|s| g.contains(s)).collect(),
            };
            let mut index = vec![None; f.batch.len()]; // whole-step token → part token
            for (t, tp) in f.batch.iter().enumerate() {
                if g.contains(&tp.seq) {
                    index[t] = Some(p.batch.len() as u32);
                    p.batch.push(*tp);
                    p.ids.push(ids.get(t).copied().unwrap_or(0));
                }
            }
            for (k, &r) in f.rows.iter().enumerate() {
                if let Some(Some(i)) = index.get(r as usize) {
                    p.rows.push(*i);
                    p.slots.push(k);
                    if let Some(m) = f.row_masks.get(k) {
                        p.row_masks.push(m.clone());
                    }
                }
            }
            p
        })
        .collect()
}

/// Runs the step `f` (input `data`) as sub-steps of `groups`, in order, through `cmd`, and
/// answers `f`'s reply with the rows put back in order (or the first sub-step's error).
pub(super) fn run(
    cmd: mpsc::WeakUnboundedSender<Cmd>,
    f: InFlight,
    data: Vec<u8>,
    groups: Vec<Vec<u64>>,
) {
    let ids: Vec<u32> = data
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let parts = parts(&f, &ids, &groups);
    let (n_rows, argmax, started, reply) = (f.rows.len(), f.argmax, f.started, f.reply);
    tokio::spawn(async move {
        let r = run_parts(cmd, parts, n_rows, argmax).await;
        let _ = reply.send(r.map(|mut out| {
            out.stats.wall_s = started.elapsed().as_secs_f64();
            out
        }));
    });
}

async fn run_parts(
    cmd: mpsc::WeakUnboundedSender<Cmd>,
    parts: Vec<Part>,
    n_rows: usize,
    argmax: Option<Vec<u32>>,
) -> Result<StepOutput, ClusterError> {
    let mut logits: Vec<Vec<f32>> = vec![Vec::new(); n_rows];
    let mut picks: Vec<(u32, f32)> = vec![(0, 0.0); n_rows];
    let mut stats = StepStats::default();
    for p in parts {
        let (reply, rx) = oneshot::channel();
        let tx = cmd.upgrade().ok_or(ClusterError::Stopped)?;
        tx.send(Cmd::Step {
            batch: p.batch,
            ids: p.ids,
            rows: p.rows,
            argmax: argmax.clone(),
            row_masks: p.row_masks,
            rewind: p.rewind,
            reply,
        })
        .map_err(|_| ClusterError::Stopped)?;
        drop(tx);
        let out = rx.await.map_err(|_| ClusterError::Stopped)??;
        stats.add(&out.stats);
        let n = p.slots.len();
        if argmax.is_some() {
            if out.argmax.len() != n {
                return Err(ClusterError::Invalid(format!(
                    "a sub-step returned {} argmax rows, expected {n}",
                    out.argmax.len()
                )));
            }
            for (&k, &a) in p.slots.iter().zip(&out.argmax) {
                picks[k] = a;
            }
        } else if let Some(vocab) = out.logits.len().checked_div(n) {
            if vocab == 0 || vocab * n != out.logits.len() {
                return Err(ClusterError::Invalid(format!(
                    "a sub-step returned {} logits for {n} rows",
                    out.logits.len()
                )));
            }
            for (&k, l) in p.slots.iter().zip(out.logits.chunks_exact(vocab)) {
                logits[k] = l.to_vec();
            }
        }
    }
    Ok(StepOutput {
        logits: if argmax.is_some() {
            Vec::new()
        } else {
            logits.concat()
        },
        argmax: if argmax.is_some() { picks } else { Vec::new() },
        stats,
    })
}
