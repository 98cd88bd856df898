//! `loip`: the exact allocation scheduler of design §4.
//!
//! For each stage count `s` dividing `L` and each device `i` (and its role: holds the
//! embedding, the head, both or neither), `G_i(n)` is the least `g = ld + w·span` over block
//! choices `(a, m)` whose memory fits (`w = 1` sporadic, `b` bursty). For fixed `a` the
//! least `m` that fits is optimal because `g` grows with `a` and `m`, so `G_i(n)` costs
//! `O(n)`. `G_i` is non-decreasing in `n` (dropping a layer never needs more memory), so
//! for a bound `Λ` on `max_i g_i` the feasible layer counts of device `i` are `1..=cap_i(Λ)`.
//!
//! - Sporadic: `T = s·(c + max(Σ n_i t_i, max_i g_i − c))`. For each candidate `Λ` (the
//!   finite values of `G`), the least `Σ n_i t_i` under `1 ≤ n_i ≤ cap_i`, `Σ n_i = L/s` is a
//!   linear problem solved greedily (fill the fastest devices first); this is the design's
//!   DP over devices, solved in closed form.
//! - Bursty: `T = s·max(C + c, b·max_i (n_i t_i + h/bw + δ), max_i g_i) / b`. For each `Λ`,
//!   the bottleneck bound `B` is searched over its candidate values; `C(B)` does not grow
//!   with `B` and `b·B` grows, so a binary search finds the best `B`.
//!
//! The optimum has `Λ` (and `B`) equal to one of the candidates, so the search is exact for
//! the cost model. All ordered subsets of up to 10 devices are tried (larger clusters: all
//! devices and every single drop); a dropped device is reported with the reason.

use super::{build_plan, divisors, does_not_fit, Ctx, PlanRequest, Planner};
use crate::cluster::Cluster;
use crate::cost;
use crate::error::PlanError;
use crate::plan::{DroppedDevice, ExecMode, Pattern, Plan};
use crate::profile::LoaderKind;
use crate::shape::ModelShape;

/// The exact scheduler (default planner).
pub struct Loip;
/// The exact scheduler priced with the conventional loader (ablation).
pub struct LoipConventionalLoad;

impl Planner for Loip {
    fn name(&self) -> &'static str {
        "loip"
    }
    fn describe(&self) -> &'static str {
        "exact scheduler: interleaved stages, block-level offloading, optimal for the cost model"
    }
    fn plan(
        &self,
        shape: &ModelShape,
        cluster: &Cluster,
        req: &PlanRequest,
    ) -> Result<Plan, PlanError> {
        exact_plan(shape, cluster, req, self.name())
    }
}

impl Planner for LoipConventionalLoad {
    fn name(&self) -> &'static str {
        "loip-conventional-load"
    }
    fn describe(&self) -> &'static str {
        "loip with the conventional (read, parse, copy) loader"
    }
    fn plan(
        &self,
        shape: &ModelShape,
        cluster: &Cluster,
        req: &PlanRequest,
    ) -> Result<Plan, PlanError> {
        let req = PlanRequest {
            loader: LoaderKind::Conventional,
            ..req.clone()
        };
        exact_plan(shape, cluster, &req, self.name())
    }
}

/// `G` entry: least `g` and its `(a, m)`; `g = ∞` when nothing fits.
#[derive(Clone, Copy)]
pub(crate) struct GEntry {
    pub g: f64,
    pub a: u32,
    pub m: u32,
}

const INFEASIBLE: GEntry = GEntry {
    g: f64::INFINITY,
    a: 0,
    m: 0,
};

/// Least `g` for `n` layers per stage on cluster device `i` with `s` stages.
pub(crate) fn best_blocks(ctx: &Ctx, s: u32, i: usize, n: u32, embed: bool, head: bool) -> GEntry {
    let need = ctx.mem(s, n, 0, 0, embed, head) as i128 - ctx.budgets[i] as i128;
    if need <= 0 {
        return GEntry { g: 0.0, a: 0, m: 0 };
    }
    if s == 1 {
        return INFEASIBLE;
    }
    let sa = (s as i128 - 1) * ctx.shape.attn_bytes as i128;
    let sp = (s as i128 - 1) * ctx.shape.mlp_bytes as i128;
    let mut best = INFEASIBLE;
    for a in 0..=n {
        let rem = need - a as i128 * sa;
        let m = if rem <= 0 {
            0
        } else if sp == 0 {
            u32::MAX
        } else {
            ((rem + sp - 1) / sp).min(u32::MAX as i128) as u32
        };
        if m <= n {
            let g = ctx.g(i, a, m);
            if g < best.g {
                best = GEntry { g, a, m };
            }
        }
        if rem <= 0 {
            break; // more attention offloading only adds load time
        }
    }
    best
}

/// `G` tables for one `s`: `[device][role][n − 1]`, role bit 0 = embedding, bit 1 = head.
pub(crate) fn g_tables(ctx: &Ctx, s: u32, per_stage: u32) -> Vec<[Vec<GEntry>; 4]> {
    (0..ctx.cluster.devices.len())
        .map(|i| {
            std::array::from_fn(|role| {
                (1..=per_stage)
                    .map(|n| best_blocks(ctx, s, i, n, role & 1 != 0, role & 2 != 0))
                    .collect()
            })
        })
        .collect()
}

/// Least `Σ n_j t_j` with `1 ≤ n_j ≤ caps[j]`, `Σ n_j = total`; `order` lists `j` by `t_j`.
fn greedy(order: &[usize], caps: &[u32], t: &[f64], total: u32, n: &mut [u32]) -> Option<f64> {
    let k = caps.len() as u32;
    if total < k || caps.contains(&0) {
        return None;
    }
    let mut left = total - k;
    n.iter_mut().for_each(|x| *x = 1);
    for &j in order {
        let add = (caps[j] - 1).min(left);
        n[j] += add;
        left -= add;
    }
    if left > 0 {
        return None;
    }
    Some(n.iter().zip(t).map(|(&n, &t)| n as f64 * t).sum())
}

/// Best (seconds per token, layers per device) for devices `idx` (in order) and `s`.
pub(crate) fn solve_subset(
    ctx: &Ctx,
    s: u32,
    idx: &[usize],
    tables: &[[Vec<GEntry>; 4]],
) -> Option<(f64, Vec<u32>)> {
    let k = idx.len();
    let per_stage = ctx.shape.layers / s;
    if (per_stage as usize) < k || k == 0 {
        return None;
    }
    let max_n = (per_stage as usize - k + 1).min(per_stage as usize);
    let rows: Vec<&[GEntry]> = (0..k)
        .map(|j| {
            let role = usize::from(j == 0) | (usize::from(j + 1 == k) << 1);
            &tables[idx[j]][role][..max_n]
        })
        .collect();
    let t: Vec<f64> = idx.iter().map(|&i| ctx.layer_time(i)).collect();
    let mut order: Vec<usize> = (0..k).collect();
    order.sort_by(|&x, &y| t[x].total_cmp(&t[y]).then(x.cmp(&y)));
    let mut cands: Vec<f64> = rows
        .iter()
        .flat_map(|r| r.iter().map(|e| e.g))
        .filter(|g| g.is_finite())
        .collect();
    cands.sort_by(f64::total_cmp);
    cands.dedup();
    let sf = s as f64;
    let c = cost::round_comm(ctx.shape, ctx.cluster, k);
    let e = cost::per_hop_comm(ctx.shape, ctx.cluster, k);
    let bf = ctx.b as f64;
    let bursty = ctx.req.pattern == Pattern::Bursty;
    // Bottleneck candidates (bursty): n·t_j + e for every j and n.
    let per_dev_b: Vec<Vec<f64>> = t
        .iter()
        .map(|&tj| (1..=max_n).map(|n| n as f64 * tj + e).collect())
        .collect();
    let mut b_cands: Vec<f64> = if bursty {
        per_dev_b.iter().flatten().copied().collect()
    } else {
        Vec::new()
    };
    b_cands.sort_by(f64::total_cmp);
    b_cands.dedup();

    let mut best: Option<(f64, Vec<u32>)> = None;
    let mut n = vec![0u32; k];
    let mut caps = vec![0u32; k];
    let mut caps_b = vec![0u32; k];
    let actual = |n: &[u32]| -> f64 {
        let sum_c: f64 = n.iter().zip(&t).map(|(&n, &t)| n as f64 * t).sum();
        let max_g = n
            .iter()
            .zip(&rows)
            .map(|(&n, r)| r[n as usize - 1].g)
            .fold(0.0, f64::max);
        if bursty {
            let busiest = n
                .iter()
                .zip(&t)
                .map(|(&n, &t)| bf * (n as f64 * t + e))
                .fold(0.0, f64::max);
            sf * (sum_c + c).max(busiest).max(max_g) / bf
        } else {
            sf * (c + sum_c.max(max_g - c))
        }
    };
    for &lam in &cands {
        let lower = if bursty { sf * lam / bf } else { sf * lam };
        if best.as_ref().is_some_and(|b| lower >= b.0) {
            break;
        }
        for j in 0..k {
            caps[j] = rows[j].partition_point(|e| e.g <= lam) as u32;
        }
        if !bursty {
            if greedy(&order, &caps, &t, per_stage, &mut n).is_some() {
                let v = actual(&n);
                if best.as_ref().is_none_or(|b| v < b.0) {
                    best = Some((v, n.clone()));
                }
            }
            continue;
        }
        // Bursty: binary search over the bottleneck bound B.
        let mut eval_b = |bi: usize, n: &mut [u32]| -> Option<f64> {
            let bound = b_cands[bi];
            for j in 0..k {
                caps_b[j] = caps[j].min(per_dev_b[j].partition_point(|&v| v <= bound) as u32);
            }
            greedy(&order, &caps_b, &t, per_stage, n)
        };
        let (mut lo, mut hi) = (0usize, b_cands.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            let crossed = eval_b(mid, &mut n).is_some_and(|sum| bf * b_cands[mid] >= sum + c);
            if crossed {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        for bi in [lo.wrapping_sub(1), lo] {
            if bi < b_cands.len() && eval_b(bi, &mut n).is_some() {
                let v = actual(&n);
                if best.as_ref().is_none_or(|b| v < b.0) {
                    best = Some((v, n.clone()));
                }
            }
        }
    }
    best
}

/// Ordered device subsets to try: all of them (largest first) for up to 10 devices, else
/// the full set and every single drop.
fn subsets(nd: usize, allow_drop: bool) -> Vec<Vec<usize>> {
    let full: Vec<usize> = (0..nd).collect();
    if !allow_drop || nd == 1 {
        return vec![full];
    }
    if nd > 10 {
        let mut v = vec![full.clone()];
        v.extend((0..nd).map(|d| full.iter().copied().filter(|&x| x != d).collect()));
        return v;
    }
    let mut masks: Vec<u32> = (1..(1u32 << nd)).collect();
    masks.sort_by_key(|m| (std::cmp::Reverse(m.count_ones()), std::cmp::Reverse(*m)));
    masks
        .iter()
        .map(|m| (0..nd).filter(|i| m & (1 << i) != 0).collect())
        .collect()
}

/// Runs the exact scheduler.
pub(crate) fn exact_plan(
    shape: &ModelShape,
    cluster: &Cluster,
    req: &PlanRequest,
    name: &str,
) -> Result<Plan, PlanError> {
    let ctx = Ctx::new(shape, cluster, req)?;
    let nd = cluster.devices.len();
    let sets = subsets(nd, req.allow_drop);
    let mut best: Option<(f64, u32, Vec<usize>, Vec<u32>)> = None;
    let mut best_full: Option<f64> = None;
    for s in divisors(shape.layers) {
        let per_stage = shape.layers / s;
        let tables = g_tables(&ctx, s, per_stage);
        for set in &sets {
            if let Some((v, n)) = solve_subset(&ctx, s, set, &tables) {
                if set.len() == nd && best_full.is_none_or(|b| v < b) {
                    best_full = Some(v);
                }
                if best.as_ref().is_none_or(|b| v < b.0 * (1.0 - 1e-12)) {
                    best = Some((v, s, set.clone(), n));
                }
            }
        }
    }
    let Some((v, s, set, n)) = best else {
        let ss = divisors(shape.layers);
        return Err(does_not_fit(&ctx, name, &ss, &|s, n, e, h| {
            ctx.mem(s, n, n, n, e, h)
        }));
    };
    let k = set.len();
    let tables = g_tables(&ctx, s, shape.layers / s);
    let alloc: Vec<(usize, u32, u32, u32)> = set
        .iter()
        .zip(&n)
        .enumerate()
        .map(|(j, (&i, &n))| {
            let role = usize::from(j == 0) | (usize::from(j + 1 == k) << 1);
            let e = tables[i][role][n as usize - 1];
            (i, n, e.a, e.m)
        })
        .collect();
    let dropped = (0..nd)
        .filter(|i| !set.contains(i))
        .map(|i| DroppedDevice {
            name: cluster.devices[i].name.clone(),
            reason: match best_full {
                None => "no plan using every device fits in memory".to_string(),
                Some(full) => format!(
                    "faster without it: {:.1} ms/token vs {:.1} ms/token with every device",
                    v * 1e3,
                    full * 1e3
                ),
            },
        })
        .collect();
    build_plan(&ctx, name, s, &alloc, ExecMode::Overlapped, dropped)
}
