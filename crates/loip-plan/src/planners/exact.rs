//! `loip`: the exact allocation scheduler of design §4, for the cost model of [`crate::cost`].
//!
//! For each stage count `s` dividing `L` and each device `i` (and its role: holds the
//! embedding, the head, both or neither), `G_i(n)` is the least `g = ld + span` over block
//! choices `(a, m)` whose memory fits. For fixed `a` the least `m` that fits is optimal
//! because `g` grows with `a` and `m`, so `G_i(n)` costs `O(n)`. `G_i` is non-decreasing in
//! `n` (dropping a layer never needs more memory).
//!
//! With identical stages, `n_j` layers per stage on used device `j` (per-layer time `t_j`),
//! `C = Σ n_j t_j`, `t^H` the head time of the last used device `L`, `b` micro-batches
//! (1 sporadic), `c` one pass over the links and `ℓ = h/bw` (in the round with the head,
//! `c_H` and `ℓ_H`: its wrap-around hop is the token's return trip of `r` bytes, see
//! [`crate::cost`]), the cost model gives
//!
//! ```text
//! X_j(n)  = max(b·n·t_j, G_j(n) + (b−1)·n·t_j)                       device j's own demand on a round
//! X'_L(n) = max(b·(n·t_L + t^H), G_L(n) + (b−1)·(n·t_L + t^H))        the same in the round with the head
//! T = [ (s−1)·max(C + c, b·ℓ, max_j X_j)  +  max(C + t^H + c_H, b·ℓ_H, max_{j≠L} X_j, X'_L) ] / b
//! ```
//!
//! `X_j` is non-decreasing in `n`, so for a bound `Λ ≥ max_j X_j` the feasible layer counts of
//! device `j` are `1..=cap_j(Λ)`. For each candidate `Λ` (the finite values of the `X_j`, in
//! increasing order, stopping once `s·Λ/b` exceeds the best found), replacing `max_j X_j`
//! by `Λ` in `T` gives an upper bound that is tight at the optimum's own `Λ`:
//!
//! - sporadic (`b = 1`): `X'_L ≤ max(C + t^H, Λ)`, so the bound depends on the allocation only
//!   through `C`; the least `C` under `1 ≤ n_j ≤ cap_j`, `Σ n_j = L/s` is a linear problem
//!   solved greedily (fill the fastest devices first) — the design's DP over devices in
//!   closed form;
//! - bursty: the bound also depends on `n_L` through `X'_L`, so every `n_L ≤ cap_L` is tried,
//!   the other devices filled greedily with the rest (a prefix sum of the greedy fill gives
//!   all of them in `O(L/s)`).
//!
//! So the search is exact for the cost model; `tests/optimality.rs` checks it against a
//! brute force. All ordered subsets of up to 10 devices are tried (larger clusters: all
//! devices and every single drop); a dropped device is reported with the reason.

use super::base::{build_plan, divisors, does_not_fit, Ctx, PlanRequest, Planner};
use crate::cluster::Cluster;
use crate::cost;
use crate::error::PlanError;
use crate::plan::{DroppedDevice, ExecMode, Plan};
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

/// Least `Σ n_j t_j` with `1 ≤ n_j ≤ caps[j]`, `Σ n_j = total`, over the devices in `order`
/// (sorted by `t_j`, fastest first); writes the `n_j` of those devices.
fn greedy(order: &[usize], caps: &[u32], t: &[f64], total: u32, n: &mut [u32]) -> Option<f64> {
    let k = order.len() as u32;
    if total < k || order.iter().any(|&j| caps[j] == 0) {
        return None;
    }
    let mut left = total - k;
    for &j in order {
        let add = (caps[j] - 1).min(left);
        n[j] = 1 + add;
        left -= add;
    }
    if left > 0 {
        return None;
    }
    Some(order.iter().map(|&j| n[j] as f64 * t[j]).sum())
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
    let last = k - 1;
    let max_n = (per_stage as usize - k + 1).min(per_stage as usize);
    let rows: Vec<&[GEntry]> = (0..k)
        .map(|j| {
            let role = usize::from(j == 0) | (usize::from(j == last) << 1);
            &tables[idx[j]][role][..max_n]
        })
        .collect();
    let t: Vec<f64> = idx.iter().map(|&i| ctx.layer_time(i)).collect();
    let head = ctx.head_time(idx[last]);
    // X_j(n) and X'_L(n), index n − 1.
    let x: Vec<Vec<f64>> = (0..k)
        .map(|j| {
            rows[j]
                .iter()
                .enumerate()
                .map(|(n0, e)| ctx.demand((n0 + 1) as f64 * t[j], e.g))
                .collect()
        })
        .collect();
    let x_head: Vec<f64> = rows[last]
        .iter()
        .enumerate()
        .map(|(n0, e)| ctx.demand((n0 + 1) as f64 * t[last] + head, e.g))
        .collect();
    let mut cands: Vec<f64> = x
        .iter()
        .flatten()
        .copied()
        .filter(|v| v.is_finite())
        .collect();
    cands.sort_by(f64::total_cmp);
    cands.dedup();
    let sf = s as f64;
    let bf = ctx.b as f64;
    let c = cost::round_comm(ctx.shape, ctx.cluster, k);
    let busy_link = bf * cost::link_time(ctx.shape, ctx.cluster, k);
    let c_h = cost::last_round_comm(ctx.shape, ctx.cluster, k);
    let busy_link_h = bf * cost::last_link_time(ctx.shape, ctx.cluster, k);
    // T with max_j X_j bounded by `lam` (the others' by `lam_other`) and X'_L = `xl`.
    let total = |sum_c: f64, lam: f64, lam_other: f64, xl: f64| -> f64 {
        let plain = (sum_c + c).max(busy_link).max(lam);
        let with_head = (sum_c + head + c_h).max(busy_link_h).max(lam_other).max(xl);
        ((sf - 1.0) * plain + with_head) / bf
    };
    let actual = |n: &[u32]| -> f64 {
        let sum_c: f64 = n.iter().zip(&t).map(|(&n, &t)| n as f64 * t).sum();
        let lam_other = (0..last)
            .map(|j| x[j][n[j] as usize - 1])
            .fold(0.0, f64::max);
        let lam = lam_other.max(x[last][n[last] as usize - 1]);
        total(sum_c, lam, lam_other, x_head[n[last] as usize - 1])
    };
    let mut order: Vec<usize> = (0..k).collect();
    order.sort_by(|&a, &b| t[a].total_cmp(&t[b]).then(a.cmp(&b)));
    let others: Vec<usize> = order.iter().copied().filter(|&j| j != last).collect();

    let mut best: Option<(f64, Vec<u32>)> = None;
    let mut n = vec![0u32; k];
    let mut caps = vec![0u32; k];
    let mut fill: Vec<f64> = Vec::with_capacity(per_stage as usize + 1);
    for &lam in &cands {
        if best.as_ref().is_some_and(|b| sf * lam / bf >= b.0) {
            break;
        }
        for j in 0..k {
            caps[j] = x[j].partition_point(|&v| v <= lam) as u32;
        }
        if ctx.b == 1 {
            if greedy(&order, &caps, &t, per_stage, &mut n).is_some() {
                let v = actual(&n);
                if best.as_ref().is_none_or(|b| v < b.0) {
                    best = Some((v, n.clone()));
                }
            }
            continue;
        }
        // Bursty: try every n_L; the others take the rest greedily. fill[r] = least extra
        // compute of the others for r layers beyond one each.
        if others.iter().any(|&j| caps[j] == 0) {
            continue;
        }
        fill.clear();
        fill.push(0.0);
        'fill: for &j in &others {
            for _ in 1..caps[j] {
                if fill.len() > per_stage as usize {
                    break 'fill;
                }
                let prev = fill[fill.len() - 1];
                fill.push(prev + t[j]);
            }
        }
        let base: f64 = others.iter().map(|&j| t[j]).sum();
        let mut pick: Option<(f64, u32)> = None;
        for nl in 1..=caps[last] {
            let Some(r) = (per_stage as usize).checked_sub(nl as usize + others.len()) else {
                break;
            };
            let Some(&extra) = fill.get(r) else { continue };
            let sum_c = base + extra + nl as f64 * t[last];
            let v = total(sum_c, lam, lam, x_head[nl as usize - 1]);
            if pick.is_none_or(|p| v < p.0) {
                pick = Some((v, nl));
            }
        }
        let Some((_, nl)) = pick else { continue };
        n[last] = nl;
        if greedy(&others, &caps, &t, per_stage - nl, &mut n).is_some() {
            let v = actual(&n);
            if best.as_ref().is_none_or(|b| v < b.0) {
                best = Some((v, n.clone()));
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
