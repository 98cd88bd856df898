//! `loip-paper`: the paper's Algorithm 1 as published (for the ablation).
//!
//! For each stage count `s` dividing `L`:
//! 1. **greedy fill**: devices, fastest first, take as many layers per stage as fit without
//!    offloading (every device at least one);
//! 2. **DP on leftover layers**: layers that fit nowhere are spread over the devices to
//!    minimise the largest `g = ld + span` (ties: least compute);
//! 3. **bottleneck refinement**: move one layer at a time away from the bottleneck device
//!    (largest `g` when loads dominate, else largest compute) while the prediction improves.
//!
//! Uses every device; not guaranteed optimal.

use super::base::{build_plan, divisors, does_not_fit, Ctx, PlanRequest, Planner};
use super::exact::{g_tables, GEntry};
use crate::cluster::Cluster;
use crate::cost;
use crate::error::PlanError;
use crate::plan::{ExecMode, Plan};
use crate::shape::ModelShape;

/// Greedy + DP + refinement planner.
pub struct LoipPaper;

impl Planner for LoipPaper {
    fn name(&self) -> &'static str {
        "loip-paper"
    }
    fn describe(&self) -> &'static str {
        "paper's Alg. 1: greedy memory fill, DP on leftover layers, bottleneck refinement"
    }
    fn plan(
        &self,
        shape: &ModelShape,
        cluster: &Cluster,
        req: &PlanRequest,
    ) -> Result<Plan, PlanError> {
        let ctx = Ctx::new(shape, cluster, req)?;
        let nd = cluster.devices.len();
        let idx: Vec<usize> = (0..nd).collect();
        let t: Vec<f64> = idx.iter().map(|&i| ctx.layer_time(i)).collect();
        let mut best: Option<(f64, u32, Vec<u32>, Vec<GEntry>)> = None;
        for s in divisors(shape.layers) {
            let per_stage = shape.layers / s;
            if (per_stage as usize) < nd {
                continue;
            }
            let tables = g_tables(&ctx, s, per_stage);
            let rows: Vec<&Vec<GEntry>> = (0..nd)
                .map(|j| &tables[j][usize::from(j == 0) | (usize::from(j + 1 == nd) << 1)])
                .collect();
            let g_of = |j: usize, n: u32| {
                if n == 0 {
                    f64::INFINITY
                } else {
                    rows[j][n as usize - 1].g
                }
            };
            // 1. Greedy fill without offloading.
            let mut n = vec![1u32; nd];
            let mut left = per_stage - nd as u32;
            let mut order: Vec<usize> = (0..nd).collect();
            order.sort_by(|&x, &y| t[x].total_cmp(&t[y]).then(x.cmp(&y)));
            for &j in &order {
                let fit = rows[j].iter().take_while(|e| e.g == 0.0).count() as u32;
                let add = fit.saturating_sub(n[j]).min(left);
                n[j] += add;
                left -= add;
            }
            // 2. DP over devices for the leftover layers: minimise (max g, compute).
            if left > 0 {
                let r = left as usize;
                let mut dp = vec![vec![(f64::INFINITY, f64::INFINITY); r + 1]; nd + 1];
                let mut choice = vec![vec![0usize; r + 1]; nd + 1];
                dp[0][0] = (0.0, 0.0);
                for j in 0..nd {
                    for x in 0..=r {
                        for y in 0..=x {
                            let (pg, pc) = dp[j][x - y];
                            let g = g_of(j, n[j] + y as u32);
                            if !pg.is_finite() || !g.is_finite() {
                                continue;
                            }
                            let cand = (pg.max(g), pc + y as f64 * t[j]);
                            if cand.0 < dp[j + 1][x].0
                                || (cand.0 == dp[j + 1][x].0 && cand.1 < dp[j + 1][x].1)
                            {
                                dp[j + 1][x] = cand;
                                choice[j + 1][x] = y;
                            }
                        }
                    }
                }
                if !dp[nd][r].0.is_finite() {
                    continue;
                }
                let mut x = r;
                for j in (0..nd).rev() {
                    let y = choice[j + 1][x];
                    n[j] += y as u32;
                    x -= y;
                }
            }
            if (0..nd).any(|j| !g_of(j, n[j]).is_finite()) {
                continue;
            }
            // 3. Bottleneck refinement.
            let price = |n: &[u32]| {
                let g: Vec<f64> = (0..nd).map(|j| g_of(j, n[j])).collect();
                ctx.closed_form(s, &idx, n, &g)
            };
            let mut cur = price(&n);
            for _ in 0..(4 * shape.layers) {
                let g: Vec<f64> = (0..nd).map(|j| g_of(j, n[j])).collect();
                let comp: f64 = (0..nd).map(|j| n[j] as f64 * t[j]).sum();
                let max_g = g.iter().copied().fold(0.0, f64::max);
                let c = cost::round_comm(shape, cluster, nd);
                let from = if max_g - c > comp {
                    (0..nd).max_by(|&x, &y| g[x].total_cmp(&g[y])).unwrap_or(0)
                } else {
                    (0..nd)
                        .max_by(|&x, &y| (n[x] as f64 * t[x]).total_cmp(&(n[y] as f64 * t[y])))
                        .unwrap_or(0)
                };
                if n[from] <= 1 {
                    break;
                }
                let mut step: Option<(f64, usize)> = None;
                for to in (0..nd).filter(|&to| to != from) {
                    let mut m = n.clone();
                    m[from] -= 1;
                    m[to] += 1;
                    if !g_of(to, m[to]).is_finite() {
                        continue;
                    }
                    let v = price(&m);
                    if v < cur && step.is_none_or(|st| v < st.0) {
                        step = Some((v, to));
                    }
                }
                let Some((v, to)) = step else { break };
                n[from] -= 1;
                n[to] += 1;
                cur = v;
            }
            if best.as_ref().is_none_or(|b| cur < b.0) {
                let entries = (0..nd).map(|j| rows[j][n[j] as usize - 1]).collect();
                best = Some((cur, s, n, entries));
            }
        }
        let Some((_, s, n, entries)) = best else {
            return Err(does_not_fit(
                &ctx,
                self.name(),
                &divisors(shape.layers),
                &|s, n, e, h| ctx.mem(s, n, n, n, e, h),
            ));
        };
        let alloc: Vec<_> = (0..nd)
            .map(|j| (j, n[j], entries[j].a, entries[j].m))
            .collect();
        build_plan(
            &ctx,
            self.name(),
            s,
            &alloc,
            ExecMode::Overlapped,
            Vec::new(),
        )
    }
}
