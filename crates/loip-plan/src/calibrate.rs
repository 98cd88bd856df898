//! A started pipeline's warm-up steps against the cost model: the figures the setup's
//! probes take on an idle machine, re-taken the way the run pays them.
//!
//! Why: the setup measures a hop's latency and wake-up with pings and echoes while the
//! other workers are idle, each block alone in a probe and the loaders alone (and the
//! disk with all of them reading) some seconds before the run. On `loip local` (three
//! workers, their loaders and the coordinator on two cores) a real step's hops cost about
//! 70 µs a transfer more than those pings (the cores are shared), and the VM's speed
//! drifts between the probes and the run (docs/simulator.md, "The cost model against
//! `loip local`"). The runtime therefore runs a few decode steps through the started
//! pipeline before the first request, in groups at different moments (each group one
//! throwaway sequence decoding a few positions, released after it), and hands their times
//! here. Each figure below is the **median over the groups of each group's median**, so a
//! burst of other work on the machine that falls on one or two groups moves nothing:
//!
//! - **Compute**: the steps' compute (blocks and head, as the workers time them) over the
//!   plan's priced compute gives a factor `s` by which the probed devices' block and head
//!   grids are multiplied ([`DeviceProfile::scale_compute`]): the probe re-timed in place
//!   right before decoding. Clamped to `[1/4, 4]`.
//! - **The coordinator's part of a step**: a group's steps after its first are one
//!   sequence's, so the pipeline times the coordinator's span before each as the run does
//!   (`StepStats::coordinator_s`); [`Cluster::coordinator`] becomes that figure when it is
//!   larger than the setup's hand-off.
//! - **Hops**: the steps' hops (wall less compute and load stall: the transfers, queues,
//!   wake-ups and the workers' time outside blocks) less the plan's priced communication,
//!   over the transfers it prices (one per device and round), is what a transfer costs
//!   beyond `δ`, its bytes and `hop_wake`; every device's [`DeviceProfile::hop_extra`] is
//!   set to it (never below 0, never above [`extra_cap`]), so a placement with more rounds
//!   pays it on each of its hops.
//! - **Loads**: when the plan streams, each group's load stall (the median of its steps)
//!   against the priced one: `f_g`, the factor on the loads' times at which the cost
//!   model's stall equals the group's ([`load_scale`], clamped to [`LOAD_RANGE`]); `f` is
//!   the mean of the groups' factors ([`trimmed_mean`]: from four groups on without the
//!   largest and the smallest), since the disk's rate drifts from one window to the next
//!   and a stall averages load times, that is `bytes / rate` over the windows, not the
//!   bytes over a median rate. Weighed against the probes' 1 by [`LOAD_WEIGHT`] (`f^w`),
//!   it slows (or speeds up) the loaders of the probed devices and the disks' measured
//!   rates ([`DeviceProfile::scale_loads`]): the loaders' rate as the run pays it, their
//!   threads and the disk shared with the machine's other work, which the setup's probe
//!   on an idle machine misses.
//!
//! [`reprice`] is the same fit fed a run's own first decode steps ([`REPRICE_STEPS`] of
//! them), pricing the run's remaining steps: the second prediction, beside the setup's,
//! that says whether the cost model is right when its inputs are the run's.
//!
//! Pure: the runtime measures, this prices. Only plans of single-sequence steps
//! ([`Pattern::Sporadic`]) are calibrated: the warm-up is one sequence's steps.
//!
//! [`DeviceProfile::scale_compute`]: crate::DeviceProfile::scale_compute
//! [`DeviceProfile::scale_loads`]: crate::DeviceProfile::scale_loads
//! [`DeviceProfile::hop_extra`]: crate::DeviceProfile::hop_extra

use crate::adapt::{evaluate_switched, AdaptEvent};
use crate::{cost, Cluster, CostBreakdown, ModelShape, Pattern, Plan, PlanError};

/// The least and most a warm-up may scale the probed compute by.
const SCALE_RANGE: (f64, f64) = (0.25, 4.0);

/// The least and most a warm-up may scale the loads' times by ([`load_scale`]).
pub const LOAD_RANGE: (f64, f64) = (0.5, 4.0);

/// The weight of the warm-up's load factor `f` against the probes' 1: `f^w` is applied.
/// The stall is the difference of two larger figures (a load and the compute and hops it
/// hides behind), so a small error in the steps' stall moves `f` far: on this project's
/// 2-core VM under load 7.3–7.8 four warm-ups asked 1.17–1.29 where the runs' own stall
/// needed 1.05–1.12 (docs/simulator.md), so half the factor's logarithm is applied.
pub const LOAD_WEIGHT: f64 = 0.5;

/// One warm-up step as the pipeline timed it.  // seconds
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WarmupStep {
    /// which group of steps it ran in (groups run at different moments)
    pub group: u32,
    /// from submission to the result
    pub wall_s: f64,
    /// blocks and head on the devices
    pub compute_s: f64,
    /// waiting for loads on the devices
    pub stall_s: f64,
    /// the coordinator's part before it (0 for its sequence's first step: not measured)
    pub coordinator_s: f64,
}

impl WarmupStep {
    /// The step's hops: wall less compute and load stall (never below 0).  // seconds
    pub fn hops_s(&self) -> f64 {
        (self.wall_s - self.compute_s - self.stall_s).max(0.0)
    }
}

/// What a warm-up measured and what it changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Calibration {
    /// steps taken into account
    pub steps: u32,
    /// the groups they ran in
    pub groups: u32,
    /// their compute (the median of the groups' medians, as every measured figure here)
    /// // seconds
    pub compute_s: f64,
    /// the plan's compute per step before  // seconds
    pub priced_compute_s: f64,
    /// the factor the probed devices' block times were multiplied by
    pub compute_scale: f64,
    /// their hops  // seconds
    pub hops_s: f64,
    /// the plan's communication per step, compute scaled, before the extra  // seconds
    pub priced_comm_s: f64,
    /// transfers a step is priced with (devices × rounds; 0 on one device)
    pub transfers: u32,
    /// each transfer's cost beyond the price, set as every device's `hop_extra`  // seconds
    pub hop_extra: f64,
    /// the coordinator's part of a step they measured (0: none measured)  // seconds
    pub coordinator_s: f64,
    /// their load stall  // seconds
    pub stall_s: f64,
    /// the plan's stall per step before the loads were scaled  // seconds
    pub priced_stall_s: f64,
    /// the factor on the loads' times that prices their stall (1: the plan does not
    /// stream)
    pub load_fit: f64,
    /// the factor the loads' times were multiplied by: `load_fit^`[`LOAD_WEIGHT`]
    pub load_scale: f64,
    /// the link's latency `δ` after it: lowered when the steps' hops cost less than
    /// priced (the setup's pings fell into a burst)  // seconds
    #[serde(default)]
    pub link_latency: f64,
}

impl Calibration {
    /// The measured terms against the priced ones, for a log line: compute, hops and the
    /// load stall, each with the factor or extra fitted from it.
    pub fn terms(&self) -> String {
        format!(
            "compute {:.2} ms against {:.2} priced (x{:.2}), hops {:.2} ms against {:.2} \
             priced ({:.0} us more on each of {} transfers), stall {:.2} ms against {:.2} \
             priced (loads x{:.2} of x{:.2} fitted)",
            self.compute_s * 1e3,
            self.priced_compute_s * 1e3,
            self.compute_scale,
            self.hops_s * 1e3,
            self.priced_comm_s * 1e3,
            self.hop_extra * 1e6,
            self.transfers,
            self.stall_s * 1e3,
            self.priced_stall_s * 1e3,
            self.load_scale,
            self.load_fit
        )
    }
}

/// The weights a calibration applies its fitted factors with (`factor^weight`: 1 the
/// whole factor, 0 none).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// on the compute factor
    pub compute: f64,
    /// on the loads' factor
    pub loads: f64,
}

/// The median of the finite values of `xs` (`None` when there is none).
pub fn median(xs: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut v: Vec<f64> = xs.into_iter().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The median over `steps`' groups of each group's median of `f` (steps where `f` is not
/// finite left out): robust to a burst that slows one or two groups of several, where a
/// median over all steps is not when the burst covers most of one group's steps and the
/// others are few.
pub fn group_median(steps: &[WarmupStep], f: impl Fn(&WarmupStep) -> f64) -> Option<f64> {
    let mut groups: Vec<u32> = steps.iter().map(|s| s.group).collect();
    groups.sort_unstable();
    groups.dedup();
    median(
        groups
            .iter()
            .filter_map(|&g| median(steps.iter().filter(|s| s.group == g).map(&f))),
    )
}

/// Transfers of one step the cost model prices with a wake-up: one hop out of each device
/// per round (the last round's last one is the return trip); none on one device.
pub fn transfers_per_step(plan: &Plan) -> u32 {
    let nd = plan.devices.len() as u32;
    if nd <= 1 {
        return 0;
    }
    let rounds = plan
        .devices
        .iter()
        .map(|d| d.stages.len() as u32)
        .max()
        .unwrap_or(0);
    nd * rounds
}

/// A transfer's cost beyond its price: `(measured − priced) / transfers`, in `[0, cap]`
/// (and at most 1 s); 0 without transfers or with a value that is not finite.  // seconds
pub fn hop_extra(measured_hops_s: f64, priced_comm_s: f64, transfers: u32, cap: f64) -> f64 {
    if transfers == 0 {
        return 0.0;
    }
    let x = (measured_hops_s - priced_comm_s) / transfers as f64;
    if x.is_finite() {
        x.clamp(0.0, cap.clamp(0.0, 1.0))
    } else {
        0.0
    }
}

/// The most a warm-up may add to a transfer: [`EXTRA_CAP`] times what the setup's pings
/// and echoes price one at (`δ` and the devices' mean `hop_wake`). A warm-up of a few
/// tens of milliseconds can fall into a burst of other work on the machine and see every
/// hop several times slower than the run's average (on a 2-core VM under other builds, two
/// of four resident runs priced about 1 ms a transfer where the runs paid 0.3).  // seconds
pub fn extra_cap(cluster: &Cluster) -> f64 {
    let n = cluster.devices.len().max(1) as f64;
    let wake = cluster
        .devices
        .iter()
        .map(|d| d.profile.hop_wake)
        .sum::<f64>()
        / n;
    EXTRA_CAP * (cluster.link.latency + wake)
}

/// See [`extra_cap`]: on this project's 2-core VM the warm-up's extra ran 1–2× the pings'
/// price at load 0–6.
const EXTRA_CAP: f64 = 3.0;

/// How much longer the blocks ran than priced: `measured / priced` in [`SCALE_RANGE`]; 1
/// when either is not positive and finite.
pub fn compute_scale(measured_s: f64, priced_s: f64) -> f64 {
    let ok = |x: f64| x > 0.0 && x.is_finite();
    if ok(measured_s) && ok(priced_s) {
        (measured_s / priced_s).clamp(SCALE_RANGE.0, SCALE_RANGE.1)
    } else {
        1.0
    }
}

/// Bisections of [`load_scale`]: the factor to within `4 / 2^40` of the range.
const LOAD_BISECTIONS: u32 = 40;

/// The factor `f` in [`LOAD_RANGE`] nearest 1 by which the loads' times must be multiplied
/// for the priced stall `stall_at(f)` (non-decreasing in `f`) to equal `measured_s`: the
/// range's end when even it prices too little or too much; 1 when `measured_s` is not
/// finite or already priced at 1, or when `f` moves nothing (nothing streams).
pub fn load_scale(measured_s: f64, stall_at: impl Fn(f64) -> f64) -> f64 {
    const EPS: f64 = 1e-9; // seconds
    if !measured_s.is_finite() || measured_s < 0.0 {
        return 1.0;
    }
    let at1 = stall_at(1.0);
    if (at1 - measured_s).abs() <= EPS || stall_at(LOAD_RANGE.1) <= stall_at(LOAD_RANGE.0) {
        return 1.0;
    }
    let (mut lo, mut hi) = if at1 < measured_s {
        if stall_at(LOAD_RANGE.1) <= measured_s {
            return LOAD_RANGE.1;
        }
        (1.0, LOAD_RANGE.1)
    } else {
        if stall_at(LOAD_RANGE.0) >= measured_s + EPS {
            return LOAD_RANGE.0;
        }
        (LOAD_RANGE.0, 1.0)
    };
    // stall_at(lo) ≤ measured < stall_at(hi): bisect on the log of the factor, keeping the
    // largest factor that prices no more than measured
    for _ in 0..LOAD_BISECTIONS {
        let mid = (lo * hi).sqrt();
        if stall_at(mid) <= measured_s {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// `cluster` with the loads of the devices named in `probed` and every disk's measured
/// rate `f` times as slow.
fn with_loads_scaled(cluster: &Cluster, probed: &[String], f: f64) -> Cluster {
    let mut c = cluster.clone();
    for d in &mut c.devices {
        if probed.contains(&d.name) {
            d.profile.scale_loads(f);
        }
    }
    for r in &mut c.disk_rates {
        *r /= f;
    }
    c
}

/// What a calibration is fed: one step's figures (a warm-up's medians, a run's means).
/// // seconds
#[derive(Debug, Clone, Copy)]
struct Fed {
    compute_s: f64,
    hops_s: f64,
    stall_s: f64,
}

/// The mean of `xs` without its smallest and largest value when there are at least four
/// (a burst on one window, or one quiet window, moves it little); `None` when empty.
pub fn trimmed_mean(xs: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let kept = if v.len() >= 4 {
        &v[1..v.len() - 1]
    } else {
        &v[..]
    };
    Some(kept.iter().sum::<f64>() / kept.len() as f64)
}

/// Fits the factor on the loads' times, given the stall priced at a factor.
type FitLoads<'a> = dyn Fn(&dyn Fn(f64) -> f64) -> f64 + 'a;

/// Scales the compute and the loads of the devices named in `probed` and sets every
/// device's `hop_extra` so that `price` (the cost model over the steps that were measured)
/// prices the `fed` figures: the compute factor, the extra per transfer, then the factor
/// on the loads' times `fit_loads` returns (given the stall priced at a factor), applied
/// as `fit^weight`. Returns what it measured and changed (`steps`, `groups` and the
/// coordinator's part left to the caller).
fn fit_to(
    cluster: &mut Cluster,
    probed: &[String],
    transfers: u32,
    fed: Fed,
    price: &dyn Fn(&Cluster) -> Result<CostBreakdown, PlanError>,
    fit_loads: &FitLoads,
    w: Weights,
) -> Result<Calibration, PlanError> {
    for d in &mut cluster.devices {
        d.profile.hop_extra = 0.0; // a remembered profile's: priced anew below
    }
    let priced_compute_s = price(cluster)?.compute_ms / 1e3;
    let scale = compute_scale(fed.compute_s, priced_compute_s).powf(w.compute);
    for d in &mut cluster.devices {
        if probed.contains(&d.name) {
            d.profile.scale_compute(scale);
        }
    }
    let priced = price(cluster)?;
    let priced_comm_s = priced.comm_ms / 1e3;
    let priced_stall_s = priced.uncovered_load_ms / 1e3;
    let extra = hop_extra(fed.hops_s, priced_comm_s, transfers, extra_cap(cluster));
    for d in &mut cluster.devices {
        d.profile.hop_extra = extra;
    }
    // hops cheaper than priced: the setup's pings (`δ`, half the fastest of a few) fell
    // into a burst; each transfer's latency comes down by the difference
    let under = if transfers > 0 {
        (fed.hops_s - priced_comm_s) / transfers as f64
    } else {
        0.0
    };
    if under.is_finite() && under < 0.0 {
        cluster.link.latency = (cluster.link.latency + under).max(0.0);
    }
    // the loads: the stall is what they leave uncovered (the extra above is outside the
    // overlap, so it moves no stall)
    let fit = {
        let c0: &Cluster = cluster;
        let stall_at = |f: f64| {
            let c = with_loads_scaled(c0, probed, f);
            price(&c).map_or(0.0, |b| b.uncovered_load_ms / 1e3)
        };
        fit_loads(&stall_at)
    };
    let load = fit.powf(w.loads);
    if load != 1.0 {
        *cluster = with_loads_scaled(cluster, probed, load);
    }
    Ok(Calibration {
        compute_s: fed.compute_s,
        priced_compute_s,
        compute_scale: scale,
        hops_s: fed.hops_s,
        priced_comm_s,
        transfers,
        hop_extra: extra,
        stall_s: fed.stall_s,
        priced_stall_s,
        load_fit: fit,
        load_scale: load,
        link_latency: cluster.link.latency,
        ..Calibration::default()
    })
}

/// Calibrates `cluster` from the warm-up `steps` of `plan`: scales the compute and the
/// loads of the devices named in `probed`, sets the coordinator's part and every device's
/// `hop_extra` (module docs). `None` (nothing changed) without steps or for a plan of
/// bursty steps; errors only if a plan device is not in the cluster.
pub fn calibrate(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &mut Cluster,
    steps: &[WarmupStep],
    probed: &[String],
) -> Result<Option<Calibration>, PlanError> {
    if steps.is_empty() || plan.pattern != Pattern::Sporadic {
        return Ok(None);
    }
    let (Some(compute_s), Some(hops_s), Some(stall_s)) = (
        group_median(steps, |s| s.compute_s),
        group_median(steps, WarmupStep::hops_s),
        group_median(steps, |s| s.stall_s),
    ) else {
        return Ok(None);
    };
    let coordinator_s = group_median(steps, |s| {
        if s.coordinator_s > 0.0 {
            s.coordinator_s
        } else {
            f64::NAN
        }
    })
    .unwrap_or(0.0);
    if coordinator_s.is_finite() && coordinator_s > cluster.coordinator {
        cluster.coordinator = coordinator_s.min(1.0);
    }
    let mut groups: Vec<u32> = steps.iter().map(|s| s.group).collect();
    groups.sort_unstable();
    groups.dedup();
    // each group's stall: a window of the disk's drifting rate
    let group_stalls: Vec<f64> = groups
        .iter()
        .filter_map(|&g| median(steps.iter().filter(|s| s.group == g).map(|s| s.stall_s)))
        .collect();
    let streams = plan
        .devices
        .iter()
        .any(|d| d.stages.iter().any(|st| st.offloaded_bytes(shape) > 0));
    let price = |c: &Cluster| cost::evaluate(plan, shape, c).map(|c| c.breakdown);
    let fit_loads = |stall_at: &dyn Fn(f64) -> f64| {
        if !streams {
            return 1.0;
        }
        let fits: Vec<f64> = group_stalls
            .iter()
            .map(|&s| load_scale(s, stall_at))
            .collect();
        trimmed_mean(&fits).unwrap_or(1.0)
    };
    let fed = Fed {
        compute_s,
        hops_s,
        stall_s,
    };
    let transfers = transfers_per_step(plan);
    let cal = fit_to(
        cluster,
        probed,
        transfers,
        fed,
        &price,
        &fit_loads,
        Weights {
            compute: 1.0,
            loads: LOAD_WEIGHT,
        },
    )?;
    Ok(Some(Calibration {
        steps: steps.len() as u32,
        groups: groups.len() as u32,
        coordinator_s,
        ..cal
    }))
}

/// Decode steps at the start of a run that the re-priced prediction is fed from
/// ([`reprice`]): few, so that what it predicts is most of the run (on `loip local`'s
/// 64-token runs, 8 of 63 decode steps).
pub const REPRICE_STEPS: u32 = 8;

/// A run's first decode steps not fed to the re-priced prediction (but inside the span it
/// prices over): on `loip local` a sequence's first decode step after its prompt runs
/// about a tenth slower than the next ones (10 traced runs).
pub const REPRICE_SKIP: u32 = 1;

/// The weights [`reprice`] applies the run's factors with: the compute keeps the warm-up's
/// (the run's first steps, 40–200 ms on `loip local`, are a shorter window of the VM's
/// drifting speed than the warm-up's five groups over about a second), the loads take half
/// the factor, as the warm-up's ([`LOAD_WEIGHT`]); the hops, the link's latency and the
/// coordinator's part are the steps' own. On 28 runs of `bench/runtime_vs_sim.sh` (7
/// December 2026, load 5–14) these weights put 23 within 20 %, the whole factors 19, no
/// re-fit of compute or loads 21 (docs/simulator.md).
pub const REPRICE_WEIGHTS: Weights = Weights {
    compute: 0.0,
    loads: 0.5,
};

/// The re-priced prediction of a run's remaining steps ([`reprice`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Repriced {
    /// what the first steps measured and what it changed (`steps`: how many; one group)
    pub calibration: Calibration,
    /// the cluster fed those rates
    pub cluster: Cluster,
    /// the cost model over the remaining steps, each with the placement in force at it
    /// ([`evaluate_switched`])  // milliseconds
    pub ms_per_token: f64,
    /// its mean breakdown  // milliseconds
    pub breakdown: CostBreakdown,
}

/// The second prediction of a run: after its first decode steps (steps `first .. first +
/// k` in the adapter's numbering, whose switches are `events`), the cost model fed the
/// rates they measured (`fed`: per step, over [`REPRICE_STEPS`] of them not parked for a
/// switch, after the first [`REPRICE_SKIP`]; `coordinator_s` the coordinator's part)
/// prices the run's remaining `steps − k` steps.
/// The same fit as the warm-up's ([`calibrate`]) over the placements those steps ran,
/// its factors applied with the weights `w` ([`REPRICE_WEIGHTS`]; others to price a kept
/// run again), and the coordinator's part becomes the steps' own when measured. `None`
/// for a plan of bursty steps, without such steps, or when none remain.
#[allow(clippy::too_many_arguments)]
pub fn reprice(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    events: &[AdaptEvent],
    first: u32,
    k: u32,
    steps: u32,
    fed: &WarmupStep,
    probed: &[String],
    w: Weights,
) -> Result<Option<Repriced>, PlanError> {
    let ok = |x: f64| x.is_finite() && x >= 0.0;
    if plan.pattern != Pattern::Sporadic
        || k == 0
        || steps <= k
        || !(ok(fed.wall_s) && ok(fed.compute_s) && ok(fed.stall_s))
    {
        return Ok(None);
    }
    let mut c = cluster.clone();
    if fed.coordinator_s > 0.0 && fed.coordinator_s.is_finite() {
        c.coordinator = fed.coordinator_s.min(1.0);
    }
    let price = |cl: &Cluster| evaluate_switched(plan, shape, cl, events, first, k).map(|(_, b)| b);
    let fit_loads = |stall_at: &dyn Fn(f64) -> f64| load_scale(fed.stall_s, stall_at);
    let f = Fed {
        compute_s: fed.compute_s,
        hops_s: fed.hops_s(),
        stall_s: fed.stall_s,
    };
    let cal = fit_to(
        &mut c,
        probed,
        transfers_per_step(plan),
        f,
        &price,
        &fit_loads,
        w,
    )?;
    let (ms_per_token, breakdown) =
        evaluate_switched(plan, shape, &c, events, first + k, steps - k)?;
    Ok(Some(Repriced {
        calibration: Calibration {
            steps: k,
            groups: 1,
            coordinator_s: fed.coordinator_s,
            ..cal
        },
        cluster: c,
        ms_per_token,
        breakdown,
    }))
}
