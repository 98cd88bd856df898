//! `loip bench speculate --local N`: plain and speculative decoding through the pipeline of
//! N worker processes on loopback (as `loip local --devices N`), on one plan for every round
//! so that the two compare on the same stages and offloading (separate `loip local` runs
//! may plan differently from their own probes).

use anyhow::Result;
use loip::local::{LocalCluster, LocalOptions};
use loip::speculate::{pipeline_options, Spec};
use loip_engine::generate::Flow;
use loip_engine::speculate::{generate_speculative, SpecStats};
use loip_engine::GenerateOptions;

use super::spec_drafts::{BenchDrafter, Drafts, Run};

/// Starts `devices` workers with `mem` bytes each (default: `loip local`'s budgets),
/// planned for one sequence of `prompt_len + tokens` positions and verify steps of up to
/// `k + 1`.
pub(super) fn start(
    model: &str,
    devices: usize,
    mem: Option<u64>,
    prompt_len: usize,
    tokens: usize,
    k: usize,
) -> Result<LocalCluster> {
    let dir = crate::progress::slices_for(model)?;
    let o = LocalOptions {
        model: model.to_string(),
        devices,
        mem: mem.map(|m| vec![m]),
        bandwidth: None,
        planner: "loip".into(),
        loader: loip_runtime::LoaderKind::Direct,
        concurrent: 1,
        cgroup: false,
        store_root: None,
        relay: false,
        lend: false,
        probe_loads_together: false,
        shared_disk: false,
        micro_batch_seqs: Vec::new(),
        profile: None,
        whole_context: false,
        evict_only: false,
        evict_when_cheaper: false,
        greedy: true,
        step_slack: k,
        on_ship: None,
    };
    let slices = loip_model::slice::Slices::open(&dir)?;
    let cluster = LocalCluster::start(&slices, &o, prompt_len, tokens, &mut |budgets| {
        let b: Vec<String> = budgets
            .iter()
            .map(|&b| loip_plan::units::format_bytes(b))
            .collect();
        eprintln!("{} workers on loopback, budgets {}", b.len(), b.join(", "));
    })?;
    // the adaptive controller's prior: the plan's price of a step of n positions over one
    let prior = loip::speculate::pipeline_step_prior(&cluster.session, k);
    let one = prior.first().copied().unwrap_or(f64::NAN);
    let rel: Vec<String> = prior.iter().map(|t| format!("{:.2}", t / one)).collect();
    eprintln!(
        "the plan's step of n = 1.. positions over one: {}",
        rel.join(", ")
    );
    Ok(cluster)
}

/// A plain run (the engine's loop over the pipeline, as `loip local`) and a speculative one
/// (as `loip local --speculate lookup`, or with the drafts of `drafts`) of `prompt`.
pub(super) fn pair(
    cluster: &LocalCluster,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &Spec,
    spec_first: bool,
    drafts: Drafts,
) -> Result<(Run, Run)> {
    let s = &cluster.session;
    let plain = || -> Result<Run> {
        let out = s.generate(prompt, opts, &mut |_| Flow::Continue)?;
        Ok(Run {
            ids: out.new_ids,
            ms_per_token: out.decode_ms_per_token,
            stats: SpecStats::default(),
        })
    };
    let fast = || -> Result<Run> {
        let pipeline = s.pipeline();
        let mut backend = pipeline.backend();
        let drafter = &mut BenchDrafter(drafts, pipeline.vocab() as u32);
        let o = pipeline_options(s, spec);
        let seq = loip_runtime::coordinator::next_seq_id();
        let out = generate_speculative(&mut backend, seq, prompt, opts, drafter, &o, &mut |_| {
            Flow::Continue
        });
        pipeline.release(&[seq]);
        let out = out?;
        Ok(Run {
            ids: out.out.new_ids,
            ms_per_token: out.out.decode_ms_per_token,
            stats: out.stats,
        })
    };
    if spec_first {
        let f = fast()?;
        Ok((plain()?, f))
    } else {
        let p = plain()?;
        Ok((p, fast()?))
    }
}
