//! The batched half of `loip bench speculate`: copies of a prompt served at once by the
//! serving loop, in memory or from slice files under a budget, with and without lookup.

use std::path::Path;

use super::spec_drafts::Run;
use anyhow::{bail, Result};
use loip_engine::speculate::{Rewind, SpecOptions};
use loip_engine::{BatchBackend, GenerateOptions, Generator, Model};
use loip_plan::sched::Limits;
use loip_runtime::local::{LocalModel, LocalOptions};

/// `n` copies of `prompt` served at once by the serving loop over `backend` (with its
/// `limits`), speculating with prompt lookup or not: each copy's tokens, and the decode
/// time over the steps after every copy has its first token, per token of one copy.
pub(super) fn run_batch<B: BatchBackend + Rewind>(
    (mut backend, mut limits): (B, Limits),
    prompt: &[u32],
    opts: &GenerateOptions,
    n: usize,
    spec: Option<&SpecOptions>,
) -> Result<Run> {
    use loip_engine::{Serving, Shaping, Speculate};
    limits.max_seqs = n;
    limits.max_step_seqs = n;
    backend.allow_rewind(spec.map_or(0, |s| s.k_max));
    let mut serving = Serving::new(limits, backend)?;
    let off = SpecOptions::default();
    let how = spec.map_or((Speculate::Off, &off), |s| (Speculate::Lookup, s));
    for seq in 0..n as u64 {
        serving.submit_speculative(0.0, seq, prompt, opts, &Shaping::default(), how)?;
    }
    let t0 = std::time::Instant::now();
    let mut clock = || t0.elapsed().as_secs_f64();
    let mut ids: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut started = None;
    while !serving.is_idle() {
        for e in serving.step(&mut clock)? {
            match e {
                loip_engine::SeqEvent::Token { seq, id } => ids[seq as usize].push(id),
                loip_engine::SeqEvent::Failed { error, .. } => bail!("a sequence failed: {error}"),
                _ => {}
            }
        }
        if started.is_none() && ids.iter().all(|v| !v.is_empty()) {
            started = Some(std::time::Instant::now());
        }
    }
    if ids.windows(2).any(|w| w[0] != w[1]) {
        bail!("copies of one prompt decoded differently");
    }
    let decoded = opts.max_tokens.saturating_sub(1).max(1);
    let mut stats = serving
        .spec_totals()
        .iter()
        .find(|(s, _)| *s == Speculate::Lookup)
        .map(|(_, st)| *st)
        .unwrap_or_default();
    stats.steps = stats.steps.div_ceil(n.max(1)); // one copy's steps
    Ok(Run {
        ids: ids.swap_remove(0),
        ms_per_token: started.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3) / decoded as f64,
        stats,
    })
}

/// A plain run (`run(None)`) and a speculative one (`run(Some(spec))`), the speculative
/// one first when `spec_first`: (plain, speculative).
pub(super) fn in_turn<'s>(
    spec_first: bool,
    spec: &'s SpecOptions,
    run: impl Fn(Option<&'s SpecOptions>) -> Result<Run>,
) -> Result<(Run, Run)> {
    if spec_first {
        let s = run(Some(spec))?;
        Ok((run(None)?, s))
    } else {
        let p = run(None)?;
        Ok((p, run(Some(spec))?))
    }
}

/// The in-memory backend of [`run_batch`] and its limits.
pub(super) fn memory_batch<'m>(model: &'m Model<'m>) -> (Generator<'m, 'm>, Limits) {
    (
        Generator::new(model, None),
        loip_engine::one_device_limits(model, None),
    )
}

/// The backend of [`run_batch`] from slice files with `lopts` for `n` sequences, and its
/// limits (the scheduler's KV budget: the device's).
pub(super) fn sliced_batch(
    dir: &Path,
    lopts: &LocalOptions,
    n: usize,
) -> Result<(LocalModel, Limits)> {
    let m = LocalModel::open_batched(dir, lopts, n)?;
    tell_memory(&format!("{n} at once"), &m);
    let dev = &m.device;
    let bytes_per_token = dev.kv.bytes_per_token_layer() * dev.tf.cfg.num_layers as u64;
    let budget = match dev.memory() {
        r if r.budget == 0 => u64::MAX,
        r => r.kv_budget,
    };
    let mut limits = Limits::one_device(budget, bytes_per_token);
    limits.max_seq_len = Some(dev.tf.cfg.max_position_embeddings);
    limits.max_batch_tokens = limits.max_batch_tokens.min(lopts.max_step_tokens.max(1));
    limits.prefill_chunk = limits.prefill_chunk.min(limits.max_batch_tokens);
    Ok((m, limits))
}

/// Prints how a device from slice files spends its budget (how much is offloaded).
pub(super) fn tell_memory(what: &str, m: &LocalModel) {
    let r = m.device.memory();
    let b = loip_plan::units::format_bytes;
    eprintln!(
        "{what}: budget {}, resident blocks {}, slot for offloaded blocks {}, working {}, KV {}",
        b(r.budget),
        b(r.resident),
        b(r.slot),
        b(r.working),
        b(r.kv_budget)
    );
}
