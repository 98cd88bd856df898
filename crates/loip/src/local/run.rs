//! `loip local` from start to end: the slices, the request, the workers and the session,
//! then one job on them (a generation, micro-batch sizes side by side, or the benchmark
//! matrix), told to the caller as [`Event`]s while it runs and returned as an [`Outcome`].

use std::path::PathBuf;

use anyhow::{bail, Result};
use loip_engine::speculate::SpecStats;
use loip_engine::GenerateOutput;
use loip_model::slice::Slices;
use loip_runtime::adapt::AdaptReport;
use loip_runtime::cluster_run::{Breakdown, Preview, Session};
use loip_runtime::local_cluster::{CgroupReport, Start, Started, Until};

use super::{
    bench, compare_micro_batches, micro_batch_choice, BenchEvent, BenchMatrix, BenchRow, Burst,
    LocalCluster, LocalOptions, MicroBatchRow,
};
use crate::request::{prepare, Prepared, Printer, Request};
use crate::speculate::{on_session, Spec};

/// What to run once the workers are up.
pub enum Job {
    /// one generation ([`LocalOptions::concurrent`] sequences at once when above one), its
    /// text streamed to stdout unless `quiet`
    Generate {
        /// print nothing while generating
        quiet: bool,
        /// speculative decoding of the one sequence through the pipeline (drafts verified
        /// k + 1 positions a step; the same tokens)
        speculate: Option<Spec>,
    },
    /// the sequences with each micro-batch size (`0`: one sequence a step) on one session
    MicroBatches(Vec<usize>),
    /// the benchmark matrix, each row on a session of its own
    Bench(BenchMatrix),
    /// the plan only: the workers measured and planned on, nothing loaded
    Preview,
}

/// What happens while [`run`] runs, for a caller that shows it.
pub enum Event<'a> {
    /// the worker processes started with these budgets, bytes
    Spawned(&'a [u64]),
    /// the session is planned and loaded
    Planned(&'a Session),
    /// the benchmark's budgets, bytes, against the model's bytes
    BenchBudgets {
        /// each device's budget, bytes
        budgets: &'a [u64],
        /// the model's slice bytes
        model_bytes: u64,
    },
    /// a benchmark row ended
    BenchRow(&'a BenchRow),
    /// the cost model's micro-batch size for these sequences, and its ms/token
    MicroBatchChoice {
        /// sequences at once
        sequences: usize,
        /// sequences per micro-batch
        per_step: u32,
        /// predicted ms per token
        ms: f64,
    },
    /// a micro-batch size's run ended
    MicroBatchRow(&'a MicroBatchRow),
}

/// What [`run`] made.
pub enum Outcome {
    /// one generation
    Generated(Box<Generated>),
    /// each micro-batch size's run
    MicroBatches(Vec<MicroBatchRow>),
    /// the plan [`Job::Preview`] found
    Preview(Box<Preview>),
    /// the benchmark's rows, and where the worker stores were kept
    Bench {
        /// one per (pattern, link, planner)
        rows: Vec<BenchRow>,
        /// the kept worker stores
        store_root: PathBuf,
    },
}

/// One generation on the local cluster, with what its report needs.
pub struct Generated {
    /// the prompt's ids
    pub prompt_ids: Vec<u32>,
    /// the first sequence
    pub out: GenerateOutput,
    /// its text, cut before a stop string
    pub text: String,
    /// measured decode ms per token of one sequence
    pub ms_per_token: f64,
    /// the plan's prediction, ms per token
    pub predicted_ms_per_token: f64,
    /// where the decode steps' time went
    pub breakdown: Breakdown,
    /// online adaptation's report (thresholds crossed, switches, lending)
    pub adaptation: Option<AdaptReport>,
    /// each worker's cgroup charge (empty without cgroups)
    pub cgroups: Vec<CgroupReport>,
    /// what speculative decoding did, when it ran
    pub speculation: Option<SpecStats>,
    /// the run as JSON fields beside `loip generate --json`'s: plan, devices, breakdown,
    /// links, adaptation, shape, cluster, sequences, ms/token measured and predicted
    pub fields: serde_json::Map<String, serde_json::Value>,
}

/// Runs `job` for `req` on local workers made as `o` says, on `slices`: the slice directory
/// of `o.model`, opened (split into the slice cache first when needed:
/// [`crate::slices::slices_for`]), telling `on_event` what happens. Every job starts its
/// cluster the one way ([`LocalCluster::start_as`]): a preview stops after planning, the
/// benchmark starts a session per row.
pub fn run(
    slices: Slices,
    o: &LocalOptions,
    req: &Request,
    job: Job,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<Outcome> {
    let prep = prepare(crate::model::slice_info(&slices), req)?;
    let until = match &job {
        Job::Bench(matrix) => {
            let on_bench = &mut |e: BenchEvent<'_>| match e {
                BenchEvent::Budgets {
                    budgets,
                    model_bytes,
                } => on_event(Event::BenchBudgets {
                    budgets,
                    model_bytes,
                }),
                BenchEvent::Row(r) => on_event(Event::BenchRow(r)),
            };
            let (ids, opts) = (&prep.prompt_ids, &prep.opts);
            let (rows, store_root) = bench(&slices, o, matrix, ids, opts, on_bench)?;
            return Ok(Outcome::Bench { rows, store_root });
        }
        Job::Preview => Until::Planned,
        Job::Generate {
            speculate: Some(_), ..
        } if o.sequences() > 1 => {
            bail!("speculative decoding runs one sequence (--concurrent 1)")
        }
        Job::Generate { .. } | Job::MicroBatches(_) => Until::Running,
    };
    let start = Start::new(prep.prompt_ids.len(), prep.opts.max_tokens, until);
    let on_spawned = &mut |b: &[u64]| on_event(Event::Spawned(b));
    let cluster = match LocalCluster::start_as(&slices, o, start, on_spawned)? {
        Started::Planned(p) => return Ok(Outcome::Preview(p)),
        Started::Running(c) => *c,
    };
    on_event(Event::Planned(&cluster.session));
    let outcome = match job {
        Job::MicroBatches(sizes) => micro_batches(&cluster, &prep, &sizes, on_event),
        Job::Generate { quiet, speculate } => {
            generate(&cluster, &slices, req, &prep, quiet, speculate.as_ref())
        }
        // started and ended above
        Job::Bench(_) | Job::Preview => bail!("not a job on a running cluster"),
    };
    cluster.shutdown();
    outcome
}

/// The cluster's sequences with each micro-batch size of `sizes`, after the cost model's
/// choice.
fn micro_batches(
    cluster: &LocalCluster,
    prep: &Prepared,
    sizes: &[usize],
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<Outcome> {
    let (s, n) = (&cluster.session, cluster.sequences);
    if let Some((per_step, ms)) = micro_batch_choice(s, n) {
        on_event(Event::MicroBatchChoice {
            sequences: n,
            per_step,
            ms,
        });
    }
    let on_row = &mut |r: &MicroBatchRow| on_event(Event::MicroBatchRow(r));
    let rows = compare_micro_batches(s, &prep.prompt_ids, &prep.opts, n, sizes, on_row)?;
    Ok(Outcome::MicroBatches(rows))
}

/// One generation of `req` on `cluster` (a burst when it is planned for several sequences),
/// speculative when `speculate` says so, its text streamed unless `quiet`.
fn generate(
    cluster: &LocalCluster,
    slices: &Slices,
    req: &Request,
    prep: &Prepared,
    quiet: bool,
    speculate: Option<&Spec>,
) -> Result<Outcome> {
    let (ids, opts, n) = (&prep.prompt_ids, &prep.opts, cluster.sequences);
    let stops = if n == 1 { req.stop.clone() } else { vec![] };
    let mut printer = Printer::new(prep.tokenizer.as_ref(), stops, quiet);
    let mut speculation = None;
    let on_token = &mut |id| printer.on_token(id);
    let burst = match speculate {
        None => cluster.generate(ids, opts, n, on_token).map_err(Into::into),
        Some(spec) => {
            let target = (&slices.manifest.config, prep.tokenizer.as_ref());
            on_session(&cluster.session, target, ids, opts, spec, on_token).map(|run| {
                speculation = Some(run.stats);
                Burst {
                    ms_per_token: run.out.decode_ms_per_token,
                    first: run.out,
                    sequences: None,
                    wall_ms_per_token: None,
                }
            })
        }
    };
    let text = printer.finish();
    let mut g = generated(cluster, prep.prompt_ids.clone(), burst?, text)?;
    if let Some(st) = speculation {
        g.fields
            .insert("speculation".into(), serde_json::to_value(st)?);
        g.speculation = Some(st);
    }
    Ok(Outcome::Generated(Box::new(g)))
}

/// The report of a generation finished on `cluster`: `burst` of `prompt_ids`, its `text`,
/// and what the session measured and planned.
pub fn generated(
    cluster: &LocalCluster,
    prompt_ids: Vec<u32>,
    burst: Burst,
    text: String,
) -> Result<Generated> {
    let s = &cluster.session;
    let mut f = serde_json::Map::new();
    f.insert("plan".into(), serde_json::to_value(&s.plan)?);
    f.insert("devices".into(), serde_json::to_value(&s.reports)?);
    if let Some(seqs) = &burst.sequences {
        f.insert("sequences".into(), seqs.clone().into());
    }
    if let Some(wall) = burst.wall_ms_per_token {
        f.insert("bursty_wall_ms_per_token".into(), wall.into());
    }
    let breakdown = Breakdown::of(&s.take_totals());
    f.insert("breakdown".into(), serde_json::to_value(breakdown)?);
    f.insert("links".into(), serde_json::to_value(s.link_bytes())?);
    let adaptation = s.adaptation();
    if let Some(ad) = &adaptation {
        f.insert("adaptation".into(), serde_json::to_value(ad)?);
    }
    // What the simulator needs to replay the run (`loip simulate --from-local`).
    f.insert("shape".into(), serde_json::to_value(&s.shape)?);
    f.insert("cluster".into(), serde_json::to_value(&s.cluster)?);
    let predicted = s.plan.predicted_ms_per_token;
    f.insert("ms_per_token".into(), burst.ms_per_token.into());
    f.insert("predicted_ms_per_token".into(), predicted.into());
    let cgroups = cluster.workers.cgroup_reports();
    if cluster.cgroup {
        f.insert("cgroups".into(), serde_json::to_value(&cgroups)?);
    }
    Ok(Generated {
        prompt_ids,
        out: burst.first,
        text,
        ms_per_token: burst.ms_per_token,
        predicted_ms_per_token: predicted,
        breakdown,
        adaptation,
        cgroups,
        speculation: None,
        fields: f,
    })
}
