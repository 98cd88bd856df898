//! The end-to-end benchmark matrix on local workers: link limits × patterns × planners,
//! measured ms/token against the cost model's prediction.

use std::path::PathBuf;

use std::sync::Arc;

use anyhow::Result;
use loip_engine::generate::Flow;
use loip_engine::GenerateOptions;
use loip_model::slice::Slices;
use loip_plan::{DeviceProfile, Pattern};
use loip_runtime::cluster_run::{Breakdown, Session};
use loip_runtime::local_cluster::{
    bench_budgets, keep_scratch, LocalCluster, LocalWorkers, Start, Started, Until,
};
use serde::Serialize;

use super::{parse_bandwidth, LocalOptions};

/// What the matrix runs: each link limit × pattern × planner.
#[derive(Debug, Clone)]
pub struct BenchMatrix {
    /// link limits (`unlimited` or a bandwidth)
    pub bandwidths: Vec<String>,
    /// patterns (`sporadic`, `bursty`)
    pub patterns: Vec<String>,
    /// planner names
    pub planners: Vec<String>,
}

/// One row of the benchmark.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    /// sporadic or bursty
    pub pattern: String,
    /// link limit (`unlimited` or bytes/s)
    pub bandwidth: String,
    /// planner
    pub planner: String,
    /// measured decode time per generated token  // milliseconds
    pub measured_ms: Option<f64>,
    /// the cost model's prediction for the plan  // milliseconds
    pub predicted_ms: Option<f64>,
    /// per decode step, from the pipeline
    pub breakdown: Option<Breakdown>,
    /// the last device's full logits (vocab × 4 bytes) crossing its link to the coordinator
    /// once per generated token, at the measured link: part of the measured network time,
    /// not of the cost model's `predicted_ms`  // milliseconds
    pub logits_ms: Option<f64>,
    /// the cost model's breakdown of `predicted_ms`
    pub predicted_breakdown: Option<loip_plan::CostBreakdown>,
    /// devices of the plan (the planner may leave some out)
    pub plan_devices: Option<Vec<String>>,
    /// stages per device of the plan
    pub stages_per_device: Option<u32>,
    /// planner or runtime error (OOM for planners that cannot place the model)
    pub error: Option<String>,
}

impl BenchRow {
    fn new(pattern: &str, bandwidth: &str, planner: &str) -> BenchRow {
        BenchRow {
            pattern: pattern.into(),
            bandwidth: bandwidth.into(),
            planner: planner.into(),
            measured_ms: None,
            predicted_ms: None,
            breakdown: None,
            predicted_breakdown: None,
            logits_ms: None,
            plan_devices: None,
            stages_per_device: None,
            error: None,
        }
    }
}

/// The default store root of the benchmark's workers (kept between runs).
pub fn bench_store_root(o: &LocalOptions) -> PathBuf {
    o.store_root
        .clone()
        .unwrap_or_else(|| loip_model::fetch::cache_dir().join("bench-stores"))
}

/// What [`bench`] tells its caller while it runs.
pub enum BenchEvent<'a> {
    /// the budgets, bytes, against the model's slice bytes
    Budgets {
        /// each device's budget, bytes
        budgets: &'a [u64],
        /// the model's slice bytes
        model_bytes: u64,
    },
    /// a row ended
    Row(&'a BenchRow),
}

/// Runs the matrix (at least 3 sequences when bursty) on workers with `o`'s budgets or, when
/// `o.mem` is not given, [`bench_budgets`]: one set of workers per link limit, each row a
/// session of its own started the one way ([`LocalCluster::start_as`]) with the row's
/// planner, pattern and link, planned for the whole context; devices are measured once (by
/// the first session) unless `o.profile` is given. `on_event` is told of the budgets and of
/// each row as it ends. Returns the rows and where the worker stores were kept.
pub fn bench(
    slices: &Slices,
    o: &LocalOptions,
    matrix: &BenchMatrix,
    prompt: &[u32],
    gen: &GenerateOptions,
    on_event: &mut dyn FnMut(BenchEvent<'_>),
) -> Result<(Vec<BenchRow>, PathBuf)> {
    let store_root = bench_store_root(o);
    keep_scratch(&store_root);
    let manifest = &slices.manifest;
    let context = ((prompt.len() + gen.max_tokens) * o.sequences()) as u64;
    let budgets = o.budgets(|| bench_budgets(manifest, o.devices))?;
    let model_bytes = manifest.slices.iter().map(|s| s.size).sum();
    on_event(BenchEvent::Budgets {
        budgets: &budgets,
        model_bytes,
    });
    let n = o.concurrent.max(3);
    let mut rows = Vec::new();
    let mut profiles: Option<Vec<DeviceProfile>> = o.profiles(budgets.len());
    for bw_s in &matrix.bandwidths {
        let on_link = LocalOptions {
            mem: Some(budgets.clone()),
            bandwidth: parse_bandwidth(bw_s)?,
            store_root: Some(store_root.clone()),
            whole_context: true,
            on_ship: None,
            ..o.clone()
        };
        let workers = LocalWorkers::for_options(&on_link, manifest, context, prompt.len())?;
        let workers = Arc::new(workers);
        for pat_s in &matrix.patterns {
            let pattern: Pattern = pat_s.parse().map_err(anyhow::Error::msg)?;
            let seqs = if pattern == Pattern::Bursty { n } else { 1 };
            for planner in &matrix.planners {
                let mut row = BenchRow::new(pat_s, bw_s, planner);
                let lo = LocalOptions {
                    concurrent: seqs,
                    planner: planner.clone(),
                    ..on_link.clone()
                };
                let start = Start {
                    workers: Some(workers.clone()),
                    profiles: profiles.as_deref(),
                    ..Start::new(prompt.len(), gen.max_tokens, Until::Running)
                };
                match LocalCluster::start_as(slices, &lo, start, &mut |_| {}) {
                    Err(e) => row.error = Some(e.to_string()),
                    Ok(Started::Planned(_)) => row.error = Some("planned, not started".into()),
                    Ok(Started::Running(c)) => {
                        if profiles.is_none() {
                            profiles = Some(
                                c.session
                                    .cluster
                                    .devices
                                    .iter()
                                    .map(|d| d.profile.clone())
                                    .collect(),
                            );
                        }
                        measure(&c.session, &mut row, prompt, gen, seqs);
                        c.shutdown();
                    }
                }
                on_event(BenchEvent::Row(&row));
                rows.push(row);
            }
        }
    }
    Ok((rows, store_root))
}

/// One row's run on a started session.
fn measure(s: &Session, row: &mut BenchRow, prompt: &[u32], gen: &GenerateOptions, seqs: usize) {
    row.predicted_ms = Some(s.plan.predicted_ms_per_token);
    row.stages_per_device = Some(s.plan.stages_per_device);
    row.predicted_breakdown = Some(s.plan.breakdown);
    row.logits_ms = logits_ms(s);
    row.plan_devices = Some(s.plan.devices.iter().map(|d| d.name.clone()).collect());
    let prompts = vec![prompt.to_vec(); seqs];
    let outs = if seqs == 1 {
        vec![s.generate(prompt, gen, &mut |_| Flow::Continue)]
    } else {
        s.generate_many(&prompts, gen)
    };
    match outs.into_iter().collect::<Result<Vec<_>, _>>() {
        Ok(o) => {
            let ms = o.iter().map(|o| o.decode_ms_per_token).sum::<f64>() / (seqs * seqs) as f64;
            row.measured_ms = Some(ms);
            row.breakdown = Some(Breakdown::of(&s.take_totals()));
        }
        Err(e) => row.error = Some(e.to_string()),
    }
}

/// Time of the last plan device's logits (vocab × f32) on its measured link.  // milliseconds
fn logits_ms(s: &Session) -> Option<f64> {
    let last = s.plan.devices.last()?;
    let link = s
        .reports
        .iter()
        .find(|r| r.endpoint.name == last.name)?
        .link?;
    let bw = link.up_bps.min(link.down_bps);
    (bw > 0.0).then(|| (s.manifest.config.vocab_size as f64 * 4.0 / bw + link.latency_s) * 1e3)
}
