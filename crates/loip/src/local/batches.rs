//! `--micro-batch-seqs`: the same burst run with micro-batches of several sizes on one
//! session, side by side, against the cost model's price of each.

use std::time::Instant;

use anyhow::{bail, Result};
use loip_engine::GenerateOptions;
use loip_runtime::cluster_run::Session;

/// One size's run.
#[derive(Debug, Clone)]
pub struct MicroBatchRow {
    /// sequences in all
    pub sequences: usize,
    /// sequences per step (0 ran one sequence a step)
    pub seqs_per_step: usize,
    /// steps in flight
    pub in_flight: usize,
    /// new tokens of every sequence
    pub tokens: usize,
    /// wall time, seconds
    pub wall_s: f64,
    /// the cost model's ms/token for this size
    pub predicted_ms: f64,
    /// loads of each stage per round (1: every stage's blocks read once a round)
    pub stage_loads_per_round: f64,
}

/// Generates `prompts` in micro-batches of `q` sequences: one thread per micro-batch, each
/// running the engine's `Serving` over the pipeline (so the micro-batches are in flight
/// together). Returns (new tokens, wall seconds).
fn serve_batched(
    s: &Session,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    q: usize,
) -> Result<(usize, f64)> {
    let t = Instant::now();
    let counts: Vec<Result<usize>> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .chunks(q.max(1))
            .map(|group| {
                let backend = s.pipeline().backend();
                sc.spawn(move || -> Result<usize> {
                    let longest = group.iter().map(Vec::len).max().unwrap_or(1);
                    let mut limits = loip_plan::sched::Limits::one_device(u64::MAX, 1);
                    limits.max_step_seqs = group.len();
                    limits.max_seqs = group.len();
                    limits.prefill_chunk = longest;
                    limits.max_batch_tokens = longest * group.len();
                    let mut serving = loip_engine::Serving::new(limits, backend)?;
                    let t0 = Instant::now();
                    let mut clock = || t0.elapsed().as_secs_f64();
                    for p in group {
                        let seq = loip_runtime::coordinator::next_seq_id();
                        serving.submit(clock(), seq, p, opts)?;
                    }
                    let mut tokens = 0;
                    // bounded: every round advances each running sequence by a token
                    for _ in 0..(opts.max_tokens + 2) * group.len() + 16 {
                        for e in serving.step(&mut clock)? {
                            match e {
                                loip_engine::SeqEvent::Token { .. } => tokens += 1,
                                loip_engine::SeqEvent::Failed { error, .. } => bail!(error),
                                _ => {}
                            }
                        }
                        if serving.is_idle() {
                            return Ok(tokens);
                        }
                    }
                    bail!("the micro-batch did not finish")
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a micro-batch thread panicked")))
            })
            .collect()
    });
    let tokens = counts.into_iter().sum::<Result<usize>>()?;
    Ok((tokens, t.elapsed().as_secs_f64()))
}

/// The cost model's price (ms/token) of `s`'s layout run as micro-batches of `q` of `n`
/// sequences.
fn predict(s: &Session, n: usize, q: usize) -> f64 {
    loip_plan::planners::batching::price_layout(&s.plan, &s.shape, &s.cluster, n as u32, q as u32)
        .map_or(f64::NAN, |(ms, _)| ms)
}

/// The cost model's choice for `n` sequences on `s`'s layout: sequences per micro-batch and
/// its ms/token.
pub fn micro_batch_choice(s: &Session, n: usize) -> Option<(u32, f64)> {
    loip_plan::planners::batching::candidates(n as u32)
        .into_iter()
        .map(|(_, q)| (q, predict(s, n, q as usize)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
}

/// `n` sequences of `prompt` run with each micro-batch size of `sizes` on the same session
/// (`0`: one sequence a step, `n` steps in flight; `q`: micro-batches of `q` sequences,
/// `n/q` in flight), `on_row` told of each as it ends.
pub fn compare_micro_batches(
    s: &Session,
    prompt: &[u32],
    opts: &GenerateOptions,
    n: usize,
    sizes: &[usize],
    on_row: &mut dyn FnMut(&MicroBatchRow),
) -> Result<Vec<MicroBatchRow>> {
    let prompts = vec![prompt.to_vec(); n];
    // Offloaded bytes of every stage of the plan: what one round reads when each stage's
    // blocks are read once for all the micro-batches in flight.  // bytes
    let per_round: u64 = s
        .plan
        .devices
        .iter()
        .flat_map(|d| &d.stages)
        .map(|st| st.offloaded_bytes(&s.shape))
        .sum();
    let mut rows = Vec::new();
    for &q in sizes {
        let _ = s.take_totals();
        let (tokens, wall) = if q == 0 {
            let t = Instant::now();
            let outs = s.generate_many(&prompts, opts);
            let outs = outs.into_iter().collect::<Result<Vec<_>, _>>()?;
            let tokens = outs.iter().map(|o| o.new_ids.len()).sum();
            (tokens, t.elapsed().as_secs_f64())
        } else {
            serve_batched(s, &prompts, opts, q)?
        };
        let per = q.max(1);
        // loads per stage and round: decode bytes read over (rounds × one read of each stage)
        let t = s.take_totals();
        let rounds = t.decode_steps as f64 / n.div_ceil(per) as f64;
        let loads = t.decode.loaded_bytes as f64 / (rounds * per_round as f64).max(1.0);
        let row = MicroBatchRow {
            sequences: n,
            seqs_per_step: per,
            in_flight: n.div_ceil(per),
            tokens,
            wall_s: wall,
            predicted_ms: predict(s, n, per),
            stage_loads_per_round: loads,
        };
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}
