//! `loip bench speculate`: decode ms/token and acceptance with and without speculative
//! decoding (prompt lookup), on this machine in memory and from slice files with half the
//! layers offloaded (or under `--mem`). A program that prints a table, never a timed test.
//!
//! Method: for each prompt and backend, plain decoding (`loip_engine::generate`, one
//! position per step) and speculative decoding alternate within each round; the table gives
//! medians over rounds (other work on the machine moves single runs), and the median of the
//! per-round ratios (the two runs of a round ran side by side). Greedy, EOS ignored,
//! so every run decodes the same number of tokens; a run whose tokens differ from plain
//! decoding's is an error (the invariant of `loip_engine::speculate`).

use std::path::PathBuf;

use super::spec_batch::{in_turn, memory_batch, run_batch, sliced_batch, tell_memory};
use super::spec_drafts::{BenchDrafter, Drafts, Run};
use anyhow::{bail, Context, Result};
use clap::Args;
use loip_engine::generate::{generate, Flow};
use loip_engine::speculate::{generate_speculative, Rewind, SpecOptions, SpecStats};
use loip_engine::{GenerateOptions, Generator, Model, SamplingParams, StepBackend};
use loip_model::chat::ChatMessage;
use loip_runtime::local::{LocalModel, LocalOptions, OffloadRule};
use serde_json::json;

/// Built-in prompts: a code edit (the answer copies its input, lookup hits) and a story
/// (little to copy).
const PROMPTS: [(&str, &str); 2] = [
    (
        "code edit",
        include_str!("../../../../bench/prompts/code_edit.txt"),
    ),
    ("story", include_str!("../../../../bench/prompts/story.txt")),
];

/// Arguments of `loip bench speculate`.
#[derive(Args, Debug)]
pub struct SpecBenchArgs {
    /// Model: `smollm2`, an HF directory or a GGUF file.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Tokens to decode per run.
    #[arg(long, default_value_t = 256)]
    tokens: usize,
    /// Rounds (each runs every prompt × backend × mode once).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Most drafts verified per step.
    #[arg(long, default_value_t = 8)]
    k: usize,
    /// Always verify up to `k` drafts (no adaptation).
    #[arg(long)]
    fixed: bool,
    /// Memory budget of the offloaded run (default: half the layers offloaded, no budget).
    #[arg(long)]
    mem: Option<String>,
    /// Prompt files used as the user message of the chat template (default: the built-in
    /// code edit and story).
    #[arg(long)]
    prompt_file: Vec<PathBuf>,
    /// Skip the in-memory runs.
    #[arg(long)]
    no_memory: bool,
    /// Skip the runs from slice files.
    #[arg(long)]
    no_offload: bool,
    /// Also run each prompt with every draft made wrong (the cost of rejected drafts and
    /// of the adaptive fallback to k = 0).
    #[arg(long)]
    wrong: bool,
    /// Also run each prompt with lookup searching every step and proposing nothing (the
    /// cost of the speculative loop where lookup never hits).
    #[arg(long)]
    silent: bool,
    /// Also serve this many copies of each prompt at once in memory through the serving
    /// loop (continuous batching, as `loip api`), all speculating or none.
    #[arg(long)]
    batch: Option<usize>,
    /// Also run through the pipeline of this many worker processes on loopback, as `loip
    /// local --devices N` (default budgets; one plan for every round, so plain and lookup
    /// runs compare on the same plan).
    #[arg(long)]
    local: Option<usize>,
    /// Each `--local` worker's budget (default: `loip local`'s, which offload part of the
    /// layers; a budget above the model's bytes keeps every block resident, a
    /// compute-bound plan).
    #[arg(long, requires = "local")]
    local_mem: Option<String>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// A plain run and a speculative run over the same backend (its KV of sequence 0 dropped
/// between runs).
fn run_pair<B: StepBackend + Rewind>(
    b: &mut B,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &SpecOptions,
    spec_first: bool,
    drafts: Drafts,
) -> Result<(Run, Run)> {
    let plain = |b: &mut B| -> Result<Run> {
        b.release(0);
        let out = generate(b, 0, prompt, opts, &mut |_| Flow::Continue)?;
        Ok(Run {
            ids: out.new_ids,
            ms_per_token: out.decode_ms_per_token,
            stats: SpecStats::default(),
        })
    };
    let fast = |b: &mut B| -> Result<Run> {
        b.release(0);
        let drafter = &mut BenchDrafter(drafts, b.vocab_size() as u32);
        let out = generate_speculative(b, 0, prompt, opts, drafter, spec, &mut |_| Flow::Continue)?;
        Ok(Run {
            ids: out.out.new_ids,
            ms_per_token: out.out.decode_ms_per_token,
            stats: out.stats,
        })
    };
    if spec_first {
        let s = fast(b)?;
        Ok((plain(b)?, s))
    } else {
        let p = plain(b)?;
        Ok((p, fast(b)?))
    }
}

/// `loip bench speculate`.
pub fn run(a: SpecBenchArgs) -> Result<serde_json::Value> {
    let ckpt = loip::model::open(&a.model)?;
    let tok = loip::model::tokenizer(&ckpt)?;
    let chat = loip::model::chat_template(&ckpt)?;
    let mut prompts = Vec::new();
    let texts: Vec<(String, String)> = if a.prompt_file.is_empty() {
        PROMPTS
            .iter()
            .map(|(n, t)| (n.to_string(), t.to_string()))
            .collect()
    } else {
        a.prompt_file
            .iter()
            .map(|p| {
                std::fs::read_to_string(p)
                    .with_context(|| format!("reading {}", p.display()))
                    .map(|t| (p.display().to_string(), t))
            })
            .collect::<Result<_>>()?
    };
    for (name, text) in texts {
        let ids = match &chat {
            Some(tpl) => tpl.encode(&tok, &[ChatMessage::new("user", text)], true)?,
            None => tok.encode(&text, true)?,
        };
        for (on, d) in [(a.wrong, Drafts::Wrong), (a.silent, Drafts::Silent)] {
            if on {
                prompts.push((format!("{name}{}", d.suffix()), ids.clone(), d));
            }
        }
        prompts.push((name, ids, Drafts::Lookup));
    }
    let opts = GenerateOptions {
        max_tokens: a.tokens,
        sampling: SamplingParams::default(),
        eos_ids: vec![],
        min_tokens: 0,
    };
    let longest = prompts.iter().map(|p| p.1.len()).max().unwrap_or(1);
    let model = Model::from_checkpoint(&ckpt)?;
    let what = if a.mem.is_some() {
        "--mem"
    } else {
        "half offloaded"
    };
    let mut batch_sliced = None;
    let mut sliced = if a.no_offload {
        None
    } else {
        let dir = crate::progress::slices_for(&a.model)?;
        let mem_budget = a.mem.as_deref().map(loip_plan::parse_bytes).transpose()?;
        let lopts = LocalOptions {
            mem_budget,
            rule: if mem_budget.is_some() {
                OffloadRule::Auto
            } else {
                OffloadRule::Alternate
            },
            loader: loip_runtime::LoaderKind::Direct,
            overlap: true,
            context: longest + a.tokens + a.k + 1,
            max_step_tokens: longest.max(a.k + 1),
        };
        let model = LocalModel::open_batched(&dir, &lopts, 1)?;
        tell_memory("one sequence", &model);
        if let Some(n) = a.batch {
            // n sequences' KV and steps of up to n verify steps
            let batched = LocalOptions {
                context: lopts.context * n,
                max_step_tokens: lopts.max_step_tokens.max(n * (a.k + 1)),
                ..lopts
            };
            batch_sliced = Some((dir, batched));
        }
        Some(model)
    };
    let how = loip::speculate::Spec {
        source: loip_engine::Speculate::Lookup,
        draft: None,
        k: a.k,
        fixed: a.fixed,
    };
    let spec = |offloaded: bool| how.options(offloaded);
    let local = match a.local {
        Some(n) => {
            let mem = a
                .local_mem
                .as_deref()
                .map(loip_plan::parse_bytes)
                .transpose()?;
            Some(super::spec_local::start(
                &a.model, n, mem, longest, a.tokens, a.k,
            )?)
        }
        None => None,
    };
    // (prompt, backend) → per round: (plain, speculative)
    type Pairs = Vec<(Run, Run)>;
    let mut results: Vec<(String, String, Pairs)> = Vec::new();
    for round in 0..a.rounds.max(1) {
        let spec_first = round % 2 == 1;
        for (name, ids, drafts) in &prompts {
            let mut push = |backend: String, pair: (Run, Run)| match results
                .iter_mut()
                .find(|r| &r.0 == name && r.1 == backend)
            {
                Some(r) => r.2.push(pair),
                None => results.push((name.clone(), backend, vec![pair])),
            };
            if !a.no_memory {
                let mut gen = Generator::new(&model, None);
                push(
                    "in memory".into(),
                    run_pair(&mut gen, ids, &opts, &spec(false), spec_first, *drafts)?,
                );
            }
            if let Some(n) = a.batch.filter(|_| *drafts == Drafts::Lookup) {
                let sp = spec(false);
                let one = |spec| run_batch(memory_batch(&model), ids, &opts, n, spec);
                push(
                    format!("{n} at once, in memory"),
                    in_turn(spec_first, &sp, one)?,
                );
                if let Some((dir, lopts)) = &batch_sliced {
                    let one = |spec| run_batch(sliced_batch(dir, lopts, n)?, ids, &opts, n, spec);
                    push(
                        format!("{n} at once, {what}"),
                        in_turn(spec_first, &spec(true), one)?,
                    );
                }
            }
            if let Some(lm) = sliced.as_mut() {
                push(
                    what.into(),
                    run_pair(lm, ids, &opts, &spec(true), spec_first, *drafts)?,
                );
            }
            if let Some(cluster) = &local {
                let pair = super::spec_local::pair(cluster, ids, &opts, &how, spec_first, *drafts)?;
                push(
                    format!("loip local, {} devices", cluster.budgets.len()),
                    pair,
                );
            }
            eprintln!("round {} of {}: {name} done", round + 1, a.rounds.max(1));
        }
    }
    if let Some(cluster) = local {
        cluster.shutdown();
    }
    println!(
        "| prompt | prompt tokens | backend | plain ms/token | lookup ms/token | ratio | ratio per round (median) | acceptance | tokens per step | identical |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    let mut rows = Vec::new();
    for (name, backend, runs) in &results {
        let identical = runs.iter().all(|(p, s)| p.ids == s.ids);
        if !identical {
            bail!("{name} {backend}: speculative tokens differ from plain decoding");
        }
        let plain = median(runs.iter().map(|r| r.0.ms_per_token).collect());
        let fast = median(runs.iter().map(|r| r.1.ms_per_token).collect());
        // the two runs of a round ran side by side: their ratio is less moved by other work
        let per_round = median(
            runs.iter()
                .map(|r| r.1.ms_per_token / r.0.ms_per_token)
                .collect(),
        );
        let st = runs.last().map(|r| r.1.stats).unwrap_or_default();
        let per_step = runs.last().map_or(0.0, |r| {
            r.1.ids.len().saturating_sub(1) as f64 / st.steps.max(1) as f64
        });
        let prompt_len = prompts
            .iter()
            .find(|p| &p.0 == name)
            .map_or(0, |p| p.1.len());
        println!(
            "| {name} | {prompt_len} | {backend} | {plain:.2} | {fast:.2} | {:.2} | {per_round:.2} | {:.0} % | {per_step:.2} | yes |",
            fast / plain,
            st.acceptance() * 100.0
        );
        rows.push(json!({
            "prompt": name, "prompt_tokens": prompt_len, "backend": backend,
            "plain_ms_per_token": plain, "lookup_ms_per_token": fast, "ratio": fast / plain,
            "ratio_per_round_median": per_round,
            "acceptance": st.acceptance(), "drafted": st.drafted, "accepted": st.accepted,
            "steps": st.steps, "tokens": a.tokens, "rounds": runs.len(), "k_max": a.k,
            "adaptive": !a.fixed,
            "plain_runs_ms": runs.iter().map(|r| r.0.ms_per_token).collect::<Vec<_>>(),
            "lookup_runs_ms": runs.iter().map(|r| r.1.ms_per_token).collect::<Vec<_>>(),
        }));
    }
    Ok(json!(rows))
}
