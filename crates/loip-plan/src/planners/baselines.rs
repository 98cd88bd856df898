//! Baseline planners (design §9) and the uniform ablation. All one stage per device except
//! `loip-uniform`; none drops devices except `pp` (a device that cannot hold one layer) and
//! `edgeshard` (its DP may skip devices).

use super::base::{build_plan, divisors, does_not_fit, Ctx, PlanRequest, Planner};
use super::exact::best_blocks;
use crate::cluster::Cluster;
use crate::cost;
use crate::error::PlanError;
use crate::plan::{DroppedDevice, ExecMode, Pattern, Plan};
use crate::shape::ModelShape;

/// Interleaved + block offloading with uniform consecutive layers (no scheduler).
pub struct LoipUniform;
/// Pipeline parallelism: every device gets a layer, the rest go where they finish soonest
/// (compute-proportional) within memory; no offloading. Drops only devices that cannot hold a
/// layer.
pub struct Pp;
/// Conventional pipeline + offloading: whole layers, loads not overlapped.
pub struct PpOffload;
/// EdgeShard: latency DP over devices under memory, no offloading.
pub struct EdgeShard;

/// One device's share: (cluster index, layers per stage, offloaded attention, offloaded MLP).
type Alloc = (usize, u32, u32, u32);

fn role(j: usize, k: usize) -> (bool, bool) {
    (j == 0, j + 1 == k)
}

impl Planner for LoipUniform {
    fn name(&self) -> &'static str {
        "loip-uniform"
    }
    fn describe(&self) -> &'static str {
        "interleaved + offloading, the same layer count on every device (ablation)"
    }
    fn plan(
        &self,
        shape: &ModelShape,
        cluster: &Cluster,
        req: &PlanRequest,
    ) -> Result<Plan, PlanError> {
        let ctx = Ctx::new(shape, cluster, req)?;
        let k = cluster.devices.len();
        let idx: Vec<usize> = (0..k).collect();
        let mut best: Option<(f64, u32, Vec<Alloc>)> = None;
        for s in divisors(shape.layers) {
            let per_stage = shape.layers / s;
            if (per_stage as usize) < k {
                continue;
            }
            let n: Vec<u32> = (0..k as u32)
                .map(|j| per_stage / k as u32 + u32::from(j < per_stage % k as u32))
                .collect();
            let entries: Vec<_> = (0..k)
                .map(|j| {
                    let (e, h) = role(j, k);
                    best_blocks(&ctx, s, j, n[j], e, h)
                })
                .collect();
            if entries.iter().any(|e| !e.g.is_finite()) {
                continue;
            }
            let g: Vec<f64> = entries.iter().map(|e| e.g).collect();
            let v = ctx.closed_form(s, &idx, &n, &g);
            if best.as_ref().is_none_or(|b| v < b.0) {
                best = Some((
                    v,
                    s,
                    (0..k)
                        .map(|j| (j, n[j], entries[j].a, entries[j].m))
                        .collect(),
                ));
            }
        }
        let Some((_, s, alloc)) = best else {
            // Closest miss: the uniform split (everything offloaded) with the smallest deficit.
            let mut miss: Option<(i128, usize)> = None;
            for s in divisors(shape.layers)
                .into_iter()
                .filter(|&s| (shape.layers / s) as usize >= k)
            {
                let per_stage = shape.layers / s;
                let worst = (0..k)
                    .map(|j| {
                        let n = per_stage / k as u32 + u32::from((j as u32) < per_stage % k as u32);
                        let (e, h) = role(j, k);
                        (
                            ctx.mem(s, n, n, n, e, h) as i128 - ctx.budgets[j] as i128,
                            j,
                        )
                    })
                    .max();
                if let Some(w) = worst.filter(|w| w.0 > 0) {
                    if miss.is_none_or(|m| w.0 < m.0) {
                        miss = Some(w);
                    }
                }
            }
            return Err(match miss {
                Some((deficit, j)) => PlanError::DoesNotFit {
                    planner: self.name().into(),
                    device: cluster.devices[j].name.clone(),
                    lacks_bytes: deficit as u64,
                },
                None => does_not_fit(&ctx, self.name(), &divisors(shape.layers), &|s, n, e, h| {
                    ctx.mem(s, n, n, n, e, h)
                }),
            });
        };
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

/// Most layers device `i` holds in one stage without offloading.
fn cap_no_offload(ctx: &Ctx, i: usize, embed: bool, head: bool) -> u32 {
    let fixed = ctx.mem(1, 0, 0, 0, embed, head);
    let per_layer = ctx.shape.layer_bytes() + ctx.shape.kv_bytes(1, ctx.req.context);
    (ctx.budgets[i].saturating_sub(fixed) / per_layer.max(1)).min(ctx.shape.layers as u64) as u32
}

impl Planner for Pp {
    fn name(&self) -> &'static str {
        "pp"
    }
    fn describe(&self) -> &'static str {
        "pipeline parallelism: one stage per device, layers by compute speed within memory"
    }
    fn plan(
        &self,
        shape: &ModelShape,
        cluster: &Cluster,
        req: &PlanRequest,
    ) -> Result<Plan, PlanError> {
        let ctx = Ctx::new(shape, cluster, req)?;
        let mut used: Vec<usize> = (0..cluster.devices.len()).collect();
        let mut dropped = Vec::new();
        let fail = || does_not_fit(&ctx, "pp", &[1], &|_, n, e, h| ctx.mem(1, n, 0, 0, e, h));
        loop {
            let k = used.len();
            if k == 0 {
                return Err(fail());
            }
            let caps: Vec<u32> = (0..k)
                .map(|j| {
                    let (e, h) = role(j, k);
                    cap_no_offload(&ctx, used[j], e, h)
                })
                .collect();
            if let Some(j) = (0..k).find(|&j| caps[j] == 0) {
                let i = used.remove(j);
                dropped.push(DroppedDevice {
                    name: cluster.devices[i].name.clone(),
                    reason: "cannot hold one layer without offloading".into(),
                });
                continue;
            }
            if shape.layers < k as u32 {
                let j = (0..k)
                    .max_by(|&x, &y| ctx.layer_time(used[x]).total_cmp(&ctx.layer_time(used[y])))
                    .unwrap_or(0);
                let i = used.remove(j);
                dropped.push(DroppedDevice {
                    name: cluster.devices[i].name.clone(),
                    reason: "fewer layers than devices; slowest left out".into(),
                });
                continue;
            }
            // One layer each, then one at a time to the device that finishes its share soonest
            // (the last one also runs the LM head).
            let mut n = vec![1u32; k];
            let finish = |j: usize, layers: u32| {
                layers as f64 * ctx.layer_time(used[j])
                    + if j + 1 == k {
                        ctx.head_time(used[j])
                    } else {
                        0.0
                    }
            };
            for _ in k as u32..shape.layers {
                let pick = (0..k).filter(|&j| n[j] < caps[j]).min_by(|&x, &y| {
                    let fx = finish(x, n[x] + 1);
                    let fy = finish(y, n[y] + 1);
                    fx.total_cmp(&fy).then(x.cmp(&y))
                });
                match pick {
                    Some(j) => n[j] += 1,
                    None => return Err(fail()),
                }
            }
            let alloc: Vec<_> = (0..k).map(|j| (used[j], n[j], 0, 0)).collect();
            return build_plan(&ctx, self.name(), 1, &alloc, ExecMode::Overlapped, dropped);
        }
    }
}

/// Fewest whole layers device `i` must offload to hold `n` layers in sequential mode
/// (retained layers + a one-block buffer), or `None`.
fn seq_offload(ctx: &Ctx, i: usize, n: u32, embed: bool, head: bool) -> Option<u32> {
    let sh = ctx.shape;
    let need = ctx.mem(1, n, 0, 0, embed, head) as i128 - ctx.budgets[i] as i128;
    if need <= 0 {
        return Some(0);
    }
    let layer = sh.layer_bytes() as i128;
    let buf = sh.attn_bytes.max(sh.mlp_bytes) as i128;
    let k = (need + buf + layer - 1) / layer;
    (k <= n as i128).then_some(k as u32)
}

impl Planner for PpOffload {
    fn name(&self) -> &'static str {
        "pp-offload"
    }
    fn describe(&self) -> &'static str {
        "conventional pipeline + offloading: one stage per device, whole layers loaded after the resident ones"
    }
    fn plan(
        &self,
        shape: &ModelShape,
        cluster: &Cluster,
        req: &PlanRequest,
    ) -> Result<Plan, PlanError> {
        let ctx = Ctx::new(shape, cluster, req)?;
        let k = cluster.devices.len();
        let l = shape.layers as usize;
        // DP over devices in order: least Σ (n·t + load of its offloaded layers).
        let cost_of = |j: usize, n: u32| -> Option<(f64, u32)> {
            let (e, h) = role(j, k);
            let off = seq_offload(&ctx, j, n, e, h)?;
            let t = &ctx.times[j];
            let ld = t
                .loader
                .load_time(off as u64 * shape.layer_bytes(), 2 * off);
            Some((n as f64 * ctx.layer_time(j) + ld, off))
        };
        let mut dp = vec![vec![f64::INFINITY; l + 1]; k + 1];
        let mut choice = vec![vec![(0u32, 0u32); l + 1]; k + 1];
        dp[0][0] = 0.0;
        for j in 0..k {
            for done in 0..l {
                if !dp[j][done].is_finite() {
                    continue;
                }
                // The last device must take every remaining layer.
                let range = if j + 1 == k {
                    (l - done)..=(l - done)
                } else {
                    1..=(l - done)
                };
                for n in range {
                    if n == 0 {
                        continue;
                    }
                    if let Some((v, off)) = cost_of(j, n as u32) {
                        let cand = dp[j][done] + v;
                        if cand < dp[j + 1][done + n] {
                            dp[j + 1][done + n] = cand;
                            choice[j + 1][done + n] = (n as u32, off);
                        }
                    }
                }
            }
        }
        if !dp[k][l].is_finite() {
            return Err(does_not_fit(&ctx, self.name(), &[1], &|_, n, e, h| {
                ctx.mem(1, n, 0, 0, e, h)
                    .saturating_sub(n as u64 * shape.layer_bytes())
                    + shape.attn_bytes.max(shape.mlp_bytes)
            }));
        }
        let mut alloc = vec![(0usize, 0u32, 0u32, 0u32); k];
        let mut done = l;
        for j in (0..k).rev() {
            let (n, off) = choice[j + 1][done];
            alloc[j] = (j, n, off, off);
            done -= n as usize;
        }
        build_plan(
            &ctx,
            self.name(),
            1,
            &alloc,
            ExecMode::Sequential,
            Vec::new(),
        )
    }
}

/// EdgeShard DP: least cost of placing all layers on devices in order (skipping allowed),
/// each used device a contiguous block within `cap`, with per-device cost `n·t_j + e` (plus
/// the LM head `t^H_j` on the device that takes the last layer) and its compute
/// `n·t_j (+ t^H_j) ≤ bound`. Returns (Σ cost = C + c, used (j, n)) for the best plan using at
/// least two devices.
fn edgeshard_dp(ctx: &Ctx, e: f64, bound: f64) -> Option<(f64, Vec<(usize, u32)>)> {
    let k = ctx.cluster.devices.len();
    let l = ctx.shape.layers as usize;
    // state: [device][layers done][used: 0, 1, 2+]
    let mut dp = vec![vec![[f64::INFINITY; 3]; l + 1]; k + 1];
    let mut from = vec![vec![[(0u32, 0u8); 3]; l + 1]; k + 1]; // (n taken by device j, prev used)
    dp[0][0][0] = 0.0;
    for j in 0..k {
        let t = ctx.layer_time(j);
        let head_t = ctx.head_time(j);
        for done in 0..=l {
            for u in 0..3 {
                let cur = dp[j][done][u];
                if !cur.is_finite() {
                    continue;
                }
                if cur < dp[j + 1][done][u] {
                    dp[j + 1][done][u] = cur;
                    from[j + 1][done][u] = (0, u as u8);
                }
                for n in 1..=(l - done) {
                    let embed = done == 0;
                    let head = done + n == l;
                    let busy = n as f64 * t + if head { head_t } else { 0.0 };
                    if busy > bound {
                        break; // busy grows with n (the head comes with the largest n)
                    }
                    if n as u32 > cap_no_offload(ctx, j, embed, head) {
                        continue;
                    }
                    let nu = (u + 1).min(2);
                    let cand = cur + busy + e;
                    if cand < dp[j + 1][done + n][nu] {
                        dp[j + 1][done + n][nu] = cand;
                        from[j + 1][done + n][nu] = (n as u32, u as u8);
                    }
                }
            }
        }
    }
    let best = dp[k][l][2];
    if !best.is_finite() {
        return None;
    }
    let mut used = Vec::new();
    let (mut done, mut u) = (l, 2usize);
    for j in (0..k).rev() {
        let (n, pu) = from[j + 1][done][u];
        if n > 0 {
            used.push((j, n));
            done -= n as usize;
        }
        u = pu as usize;
    }
    used.reverse();
    Some((best, used))
}

impl Planner for EdgeShard {
    fn name(&self) -> &'static str {
        "edgeshard"
    }
    fn describe(&self) -> &'static str {
        "EdgeShard: DP partition over devices minimising latency under memory, no offloading"
    }
    fn plan(
        &self,
        shape: &ModelShape,
        cluster: &Cluster,
        req: &PlanRequest,
    ) -> Result<Plan, PlanError> {
        let ctx = Ctx::new(shape, cluster, req)?;
        let k = cluster.devices.len();
        let l = shape.layers;
        let bf = ctx.b as f64;
        let bursty = req.pattern == Pattern::Bursty;
        // Every candidate is priced by the cost model (one stage, nothing offloaded).
        let total = |used: &[(usize, u32)]| -> f64 {
            let idx: Vec<usize> = used.iter().map(|u| u.0).collect();
            let n: Vec<u32> = used.iter().map(|u| u.1).collect();
            ctx.closed_form(1, &idx, &n, &vec![0.0; used.len()])
        };
        // Single-device plans (no communication).
        let mut best: Option<(f64, Vec<(usize, u32)>)> = None;
        for j in 0..k {
            if cap_no_offload(&ctx, j, true, true) >= l {
                let used = vec![(j, l)];
                let v = total(&used);
                if best.as_ref().is_none_or(|b| v < b.0) {
                    best = Some((v, used));
                }
            }
        }
        // Plans on two or more devices: c = |used|·e is additive over used devices, and the
        // DP's objective is Σ (n·t + e) + t^H = C + c with the head.
        let e = shape.act_bytes_per_token as f64 / cluster.link.bandwidth + cluster.link.latency;
        // One round (s = 1), the one with the head: its wrap-around hop is the return trip
        // (a constant for two or more devices) and the last device's port carries `r`.
        let ret = cost::return_comm(shape, cluster, 2) - e;
        let link = cost::last_link_time(shape, cluster, 2);
        if k >= 2 {
            if !bursty {
                if let Some((_, used)) = edgeshard_dp(&ctx, e, f64::INFINITY) {
                    let v = total(&used);
                    if best.as_ref().is_none_or(|b| v < b.0) {
                        best = Some((v, used));
                    }
                }
            } else {
                // Bursty: bound the busiest device's compute B; the round is
                // max(C + c, b·max(B, h/bw)), so binary-search the B where b·max(B, h/bw)
                // overtakes the least C + c under that bound.
                let mut cands: Vec<f64> = (0..k)
                    .flat_map(|j| (1..=l).map(move |n| (j, n)))
                    .flat_map(|(j, n)| {
                        let busy = n as f64 * ctx.layer_time(j);
                        [busy, busy + ctx.head_time(j)]
                    })
                    .collect();
                cands.sort_by(f64::total_cmp);
                cands.dedup();
                let run = |bi: usize| edgeshard_dp(&ctx, e, cands[bi]);
                let (mut lo, mut hi) = (0usize, cands.len());
                while lo < hi {
                    let mid = (lo + hi) / 2;
                    let crossed =
                        run(mid).is_some_and(|(pass, _)| bf * cands[mid].max(link) >= pass + ret);
                    if crossed {
                        hi = mid;
                    } else {
                        lo = mid + 1;
                    }
                }
                for bi in [lo.wrapping_sub(1), lo] {
                    if bi < cands.len() {
                        if let Some((_, used)) = run(bi) {
                            let v = total(&used);
                            if best.as_ref().is_none_or(|b| v < b.0) {
                                best = Some((v, used));
                            }
                        }
                    }
                }
            }
        }
        let Some((_, used)) = best else {
            return Err(does_not_fit(&ctx, self.name(), &[1], &|_, n, e, h| {
                ctx.mem(1, n, 0, 0, e, h)
            }));
        };
        let dropped = (0..k)
            .filter(|j| !used.iter().any(|u| u.0 == *j))
            .map(|j| DroppedDevice {
                name: cluster.devices[j].name.clone(),
                reason: "left out by the EdgeShard DP (faster without it, or no room for a layer)"
                    .into(),
            })
            .collect();
        let alloc: Vec<_> = used.iter().map(|&(j, n)| (j, n, 0, 0)).collect();
        build_plan(&ctx, self.name(), 1, &alloc, ExecMode::Overlapped, dropped)
    }
}
