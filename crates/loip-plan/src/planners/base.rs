//! What every planner takes and shares: the request ([`PlanRequest`]), the [`Planner`]
//! trait, block times and budgets per cluster device ([`Ctx`]), and building and pricing a
//! plan of identical stages ([`build_plan`]). The planners (`exact`, `paper`, `baselines`)
//! import it; the registry in `planners/mod.rs` imports them, so no planner imports the
//! registry back.

use crate::cluster::Cluster;
use crate::cost::{self, BlockTimes};
use crate::error::PlanError;
use crate::plan::{DevicePlan, DroppedDevice, ExecMode, Pattern, Plan, StagePlan};
use crate::profile::LoaderKind;
use crate::shape::ModelShape;
use serde::{Deserialize, Serialize};

/// What to plan for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRequest {
    /// Planned context: KV tokens held, summed over sequences in flight (prompt + max new
    /// tokens, times concurrent sequences).  // tokens
    pub context: u64,
    /// Request pattern.
    pub pattern: Pattern,
    /// Sequences in flight; `None`: 1 for sporadic, the cluster's device count for bursty.
    pub micro_batches: Option<u32>,
    /// Loading path.
    pub loader: LoaderKind,
    /// Whether `loip` may leave devices out.
    pub allow_drop: bool,
}

impl Default for PlanRequest {
    fn default() -> Self {
        PlanRequest {
            context: 1024,
            pattern: Pattern::Sporadic,
            micro_batches: None,
            loader: LoaderKind::Direct,
            allow_drop: true,
        }
    }
}

impl PlanRequest {
    /// The `b` this request means on `cluster`.
    pub fn micro_batches_for(&self, cluster: &Cluster) -> u32 {
        match self.pattern {
            Pattern::Sporadic => 1,
            Pattern::Bursty => self
                .micro_batches
                .unwrap_or(cluster.devices.len() as u32)
                .max(1),
        }
    }
}

/// A named allocation strategy.
pub trait Planner: Sync {
    /// Registry name.
    fn name(&self) -> &'static str;
    /// One-line description.
    fn describe(&self) -> &'static str;
    /// Plans `shape` on `cluster`.
    fn plan(
        &self,
        shape: &ModelShape,
        cluster: &Cluster,
        req: &PlanRequest,
    ) -> Result<Plan, PlanError>;
}

/// Shared inputs of the planners: block times and budgets per cluster device.
pub(crate) struct Ctx<'a> {
    pub shape: &'a ModelShape,
    pub cluster: &'a Cluster,
    pub req: &'a PlanRequest,
    pub b: u32,
    pub times: Vec<BlockTimes>,
    pub budgets: Vec<u64>,
}

impl<'a> Ctx<'a> {
    pub fn new(
        shape: &'a ModelShape,
        cluster: &'a Cluster,
        req: &'a PlanRequest,
    ) -> Result<Ctx<'a>, PlanError> {
        if cluster.devices.is_empty() {
            return Err(PlanError::EmptyCluster);
        }
        if shape.layers == 0 {
            return Err(PlanError::BadRequest("model has no layer".into()));
        }
        if req.micro_batches == Some(0) {
            return Err(PlanError::BadRequest(
                "micro_batches must be at least 1".into(),
            ));
        }
        let b = req.micro_batches_for(cluster);
        let times = cluster
            .devices
            .iter()
            .map(|d| cost::block_times(d, shape, req.context, b, req.loader))
            .collect();
        let budgets = cluster.devices.iter().map(|d| d.budget()).collect();
        Ok(Ctx {
            shape,
            cluster,
            req,
            b,
            times,
            budgets,
        })
    }

    /// Per-layer compute `t^A + t^P` of cluster device `i`.  // seconds
    pub fn layer_time(&self, i: usize) -> f64 {
        self.times[i].attn + self.times[i].mlp
    }

    /// Final norm + LM head time of cluster device `i` (when it is last).  // seconds
    pub fn head_time(&self, i: usize) -> f64 {
        self.times[i].head
    }

    /// `g = ld + span` of `a`/`m` offloaded blocks per stage on cluster device `i`.  // seconds
    pub fn g(&self, i: usize, a: u32, m: u32) -> f64 {
        let t = &self.times[i];
        let bytes = a as u64 * self.shape.attn_bytes + m as u64 * self.shape.mlp_bytes;
        t.loader.load_time(bytes, a + m) + cost::span(a, m, t.attn, t.mlp)
    }

    /// What one device alone forces a round to last (the cost model's per-device terms):
    /// `max(b·C, g + (b−1)·C)` with `C` its compute for one micro-batch (`∞` if `g` is).
    /// Non-decreasing in `C` and `g`.  // seconds
    pub fn demand(&self, compute: f64, g: f64) -> f64 {
        let bf = self.b as f64;
        (bf * compute).max(g + (bf - 1.0) * compute)
    }

    /// Memory of cluster device `i` with `s` stages of (n, a, m) in overlapped mode.  // bytes
    pub fn mem(&self, s: u32, n: u32, a: u32, m: u32, embed: bool, head: bool) -> u64 {
        cost::stage_memory(
            self.shape,
            s,
            n,
            a,
            m,
            embed,
            head,
            self.req.context,
            self.b,
        )
    }

    /// Closed-form seconds per token for identical stages: `n[j]` layers per stage and
    /// `g[j] = ld + span` on used device `j` (cluster index `idx[j]`, the last one holds the
    /// head). Equals [`cost::evaluate`] of the built plan: `s − 1` rounds without the head
    /// and one with it (and the return trip, [`cost::last_round_comm`]), each
    /// [`cost::overlapped_round`].  // seconds
    pub fn closed_form(&self, s: u32, idx: &[usize], n: &[u32], g: &[f64]) -> f64 {
        let nd = idx.len();
        let c = cost::round_comm(self.shape, self.cluster, nd);
        let link = cost::link_time(self.shape, self.cluster, nd);
        let mut parts: Vec<cost::DeviceRound> = idx
            .iter()
            .zip(n)
            .zip(g)
            .map(|((&i, &n), &g)| cost::DeviceRound {
                compute: n as f64 * self.layer_time(i),
                g,
            })
            .collect();
        let plain = cost::overlapped_round(&parts, self.b, c, link).time;
        if let (Some(p), Some(&l)) = (parts.last_mut(), idx.last()) {
            p.compute += self.head_time(l);
        }
        let (c, link) = (
            cost::last_round_comm(self.shape, self.cluster, nd),
            cost::last_link_time(self.shape, self.cluster, nd),
        );
        let with_head = cost::overlapped_round(&parts, self.b, c, link).time;
        ((s as f64 - 1.0) * plain + with_head) / self.b as f64
    }
}

/// Divisors of `l`, ascending.
pub(crate) fn divisors(l: u32) -> Vec<u32> {
    (1..=l).filter(|d| l % d == 0).collect()
}

/// Builds and prices a plan of `s` identical stages per device. `alloc[j] = (cluster index,
/// n, a, m)` in pipeline order; `a`/`m` are offloaded blocks per stage (overlapped mode) or
/// whole offloaded layers `a == m` (sequential mode).
pub(crate) fn build_plan(
    ctx: &Ctx,
    planner: &str,
    s: u32,
    alloc: &[(usize, u32, u32, u32)],
    mode: ExecMode,
    dropped: Vec<DroppedDevice>,
) -> Result<Plan, PlanError> {
    let per_stage: u32 = alloc.iter().map(|x| x.1).sum();
    let mut devices: Vec<DevicePlan> = alloc
        .iter()
        .enumerate()
        .map(|(j, &(i, _, _, _))| DevicePlan {
            name: ctx.cluster.devices[i].name.clone(),
            holds_embedding: j == 0,
            holds_head: j + 1 == alloc.len(),
            stages: Vec::with_capacity(s as usize),
            memory_bytes: 0,
            budget_bytes: ctx.budgets[i],
            slot_bytes: 0,
            kv_bytes: 0,
            compute_ms: 0.0,
            load_ms: 0.0,
            stall_ms: 0.0,
        })
        .collect();
    for k in 0..s {
        let mut first = k * per_stage;
        for (j, &(_, n, a, m)) in alloc.iter().enumerate() {
            devices[j]
                .stages
                .push(StagePlan::with_offload(first, n, a, m));
            first += n;
        }
    }
    let mut plan = Plan {
        shape: ctx.shape.name.clone(),
        planner: planner.to_string(),
        stages_per_device: s,
        pattern: ctx.req.pattern,
        context: ctx.req.context,
        micro_batches: ctx.b,
        mode,
        loader: ctx.req.loader,
        devices,
        dropped,
        predicted_ms_per_token: 0.0,
        breakdown: Default::default(),
    };
    let c = cost::evaluate(&plan, ctx.shape, ctx.cluster)?;
    cost::apply(&mut plan, &c);
    Ok(plan)
}

/// The closest miss when nothing fits: spreads layers over the devices (in order, at least
/// one each; only the first `L` devices when there are more devices than layers) to maximise
/// the smallest headroom, with `min_mem(s, n, embed, head)` the least memory a device needs
/// for `n` layers per stage; returns the device with the largest deficit over the candidate
/// stage counts `ss`.
pub(crate) fn does_not_fit(
    ctx: &Ctx,
    planner: &str,
    ss: &[u32],
    min_mem: &dyn Fn(u32, u32, bool, bool) -> u64,
) -> PlanError {
    let nd = ctx.cluster.devices.len().min(ctx.shape.layers as usize);
    let mut best: Option<(i128, usize)> = None; // (largest deficit, device)
    for &s in ss {
        let per_stage = ctx.shape.layers / s;
        if (per_stage as usize) < nd {
            continue;
        }
        let mut n = vec![1u32; nd];
        let head =
            |j: usize, n: u32| ctx.budgets[j] as i128 - min_mem(s, n, j == 0, j + 1 == nd) as i128;
        for _ in nd as u32..per_stage {
            let j = (0..nd)
                .max_by_key(|&j| (head(j, n[j] + 1), std::cmp::Reverse(j)))
                .unwrap_or(0);
            n[j] += 1;
        }
        let (worst, j) = (0..nd).map(|j| (-head(j, n[j]), j)).max().unwrap_or((0, 0));
        if best.is_none_or(|b| worst < b.0) {
            best = Some((worst, j));
        }
    }
    let (deficit, j) = best.unwrap_or((0, 0));
    if deficit <= 0 && ctx.cluster.devices.len() > ctx.shape.layers as usize {
        return PlanError::BadRequest(format!(
            "{} devices but only {} layers: every device in a plan needs a layer; allow dropping devices",
            ctx.cluster.devices.len(),
            ctx.shape.layers
        ));
    }
    PlanError::DoesNotFit {
        planner: planner.to_string(),
        device: ctx.cluster.devices[j].name.clone(),
        lacks_bytes: deficit.max(0) as u64,
    }
}
