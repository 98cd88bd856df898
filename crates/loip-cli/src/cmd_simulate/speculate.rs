//! `loip simulate --plan … --acceptance A`: the plan served without and with speculative
//! decoding (optionally from a `--trace` of requests), and its table.

use anyhow::{bail, Context, Result};
use loip_plan::Plan;

use super::SimulateArgs;

/// One request of `--trace`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceEntry {
    arrival: f64,
    prompt_len: usize,
    output_len: usize,
    k: Option<usize>,
    acceptance: Option<f64>,
}

/// Most requests and tokens per request `--trace` may hold (the replay is bounded by them).
const TRACE_MAX_REQUESTS: usize = 10_000;
const TRACE_MAX_TOKENS: usize = 1 << 20;

/// `--acceptance`: the plan served without and with speculative decoding.
pub(super) fn speculative(
    args: &SimulateArgs,
    acceptance: f64,
    plan: &Plan,
    shape: &loip_plan::ModelShape,
    cluster: &loip_plan::Cluster,
    prompt: u32,
    output: u32,
) -> Result<loip_sim::speculate::SpecReplay> {
    use loip_sim::serving::{SpecRequest, Speculation, TraceRequest};
    let valid = |a: f64, what: &str| -> Result<f64> {
        if (0.0..=1.0).contains(&a) {
            Ok(a)
        } else {
            bail!("{what} {a}: must be between 0 and 1")
        }
    };
    let acceptance = valid(acceptance, "--acceptance")?;
    let k = match args.speculate_k {
        Some(k) => k,
        None => {
            let mut one = plan.clone();
            one.micro_batches = 1;
            one.pattern = loip_plan::Pattern::Sporadic;
            loip_plan::speculate::best_k(&one, shape, cluster, 1, acceptance, 8)?.k
        }
    };
    let (trace, per_request): (Vec<TraceRequest>, Vec<SpecRequest>) = match &args.trace {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading trace {}", path.display()))?;
            let entries: Vec<TraceEntry> = serde_json::from_str(&text)
                .with_context(|| format!("parsing trace {}", path.display()))?;
            if entries.is_empty() || entries.len() > TRACE_MAX_REQUESTS {
                bail!(
                    "--trace: 1 to {TRACE_MAX_REQUESTS} requests, not {}",
                    entries.len()
                );
            }
            let mut trace = Vec::new();
            let mut spec = Vec::new();
            for (i, e) in entries.into_iter().enumerate() {
                if !e.arrival.is_finite() || e.arrival < 0.0 {
                    bail!("--trace request {i}: arrival must be a time >= 0");
                }
                if e.prompt_len == 0 || e.output_len == 0 {
                    bail!("--trace request {i}: prompt_len and output_len must be >= 1");
                }
                if e.prompt_len + e.output_len > TRACE_MAX_TOKENS {
                    bail!("--trace request {i}: more than {TRACE_MAX_TOKENS} tokens");
                }
                trace.push(TraceRequest {
                    arrival: e.arrival,
                    prompt_len: e.prompt_len,
                    output_len: e.output_len,
                });
                spec.push(SpecRequest {
                    k: e.k
                        .unwrap_or(k as usize)
                        .min(loip_plan::speculate::MAX_K as usize),
                    acceptance: valid(
                        e.acceptance.unwrap_or(acceptance),
                        &format!("--trace request {i}: acceptance"),
                    )?,
                });
            }
            (trace, spec)
        }
        None => {
            let n = plan.micro_batches.max(1) as usize;
            let r = TraceRequest {
                arrival: 0.0,
                prompt_len: prompt.max(1) as usize,
                output_len: output.max(1) as usize,
            };
            let s = SpecRequest {
                k: k as usize,
                acceptance,
            };
            (vec![r; n], vec![s; n])
        }
    };
    let mut limits = loip_plan::sched::Limits::one_device(u64::MAX, 1);
    limits.max_seqs = limits.max_seqs.max(plan.micro_batches as usize);
    limits.max_step_seqs = limits.max_seqs;
    limits.max_queue = limits.max_queue.max(trace.len());
    let spec = Speculation {
        per_request,
        seed: args.seed,
    };
    Ok(loip_sim::speculate::replay_speculative(
        plan, shape, cluster, &limits, &trace, &spec,
    )?)
}

pub(super) fn speculation_table(r: &loip_sim::speculate::SpecReplay) -> String {
    format!(
        "speculative decoding, k = {} drafts at acceptance {:.2}, steps one at a time:\n\
         \x20            decode ms/token   decode steps   cost model ms/token\n\
         without      {:>14.1} {:>14} {:>21.1}\n\
         with         {:>14.1} {:>14} {:>21.1}\n\
         drafts accepted {} of {} ({:.1} %), speedup {:.2}× (cost model {:.2}×)\n",
        r.k,
        r.acceptance,
        r.plain_ms_per_token,
        r.plain_steps,
        r.predicted_plain_ms_per_token,
        r.spec_ms_per_token,
        r.spec_steps,
        r.predicted_spec_ms_per_token,
        r.accepted,
        r.drafted,
        100.0 * r.accepted as f64 / r.drafted.max(1) as f64,
        r.plain_ms_per_token / r.spec_ms_per_token,
        r.predicted_plain_ms_per_token / r.predicted_spec_ms_per_token
    )
}
