//! The end-to-end benchmark matrix on local workers: link limits × patterns × planners,
//! measured ms/token against the cost model's prediction.

use std::path::PathBuf;

use anyhow::{Context, Result};
use loip_engine::generate::Flow;
use loip_engine::GenerateOptions;
use loip_model::slice::Slices;
use loip_plan::{DeviceProfile, Pattern};
use loip_runtime::cluster_run::{Breakdown, Session};
use loip_runtime::local_cluster::{keep_scratch, LocalWorkerOptions, LocalWorkers};
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

/// Runs the matrix on workers with `budgets` (at least 3 sequences when bursty), one
/// session per row on the workers of its link limit; devices are measured once (by the
/// first session) unless `o.profile` is given. `on_row` is told of each row as it ends.
pub fn bench(
    slices: &Slices,
    o: &LocalOptions,
    budgets: &[u64],
    matrix: &BenchMatrix,
    prompt: &[u32],
    gen: &GenerateOptions,
    on_row: &mut dyn FnMut(&BenchRow),
) -> Result<Vec<BenchRow>> {
    let n = o.concurrent.max(3);
    let token = loip_runtime::net::token::generate();
    let mut rows = Vec::new();
    let mut profiles: Option<Vec<DeviceProfile>> = o.profiles(budgets.len());
    let store_root = bench_store_root(o);
    keep_scratch(&store_root);
    for bw_s in &matrix.bandwidths {
        let bw = parse_bandwidth(bw_s)?;
        let workers = LocalWorkers::spawn(&LocalWorkerOptions {
            exe: std::env::current_exe().context("locating the loip binary")?,
            budgets: budgets.to_vec(),
            bandwidth: bw,
            token: token.clone(),
            store_root: Some(store_root.clone()),
            cgroup: o.cgroup,
        })?;
        for pat_s in &matrix.patterns {
            let pattern: Pattern = pat_s.parse().map_err(anyhow::Error::msg)?;
            let seqs = if pattern == Pattern::Bursty { n } else { 1 };
            let context = ((prompt.len() + gen.max_tokens) * seqs) as u64;
            for planner in &matrix.planners {
                let mut row = BenchRow::new(pat_s, bw_s, planner);
                let lo = LocalOptions {
                    concurrent: seqs,
                    ..o.clone()
                };
                let opts = lo.session_options(planner, pattern, bw, context, prompt.len(), &token);
                match Session::start_opened(
                    slices.clone(),
                    workers.specs(profiles.as_deref()),
                    opts,
                ) {
                    Err(e) => row.error = Some(e.to_string()),
                    Ok(s) => {
                        if profiles.is_none() {
                            profiles = Some(
                                s.cluster
                                    .devices
                                    .iter()
                                    .map(|d| d.profile.clone())
                                    .collect(),
                            );
                        }
                        measure(&s, &mut row, prompt, gen, seqs);
                        s.shutdown();
                    }
                }
                on_row(&row);
                rows.push(row);
            }
        }
    }
    Ok(rows)
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
