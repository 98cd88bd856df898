//! A started pipeline's warm-up steps against the cost model: the figures the setup's
//! probes take on an idle machine, re-taken the way the run pays them.
//!
//! Why: the setup measures a hop's latency and wake-up with pings and echoes while the
//! other workers are idle, and each block alone in a probe some seconds before the run.
//! On `loip local` (three workers, their loaders and the coordinator on two cores) a real
//! step's hops cost about 70 µs a transfer more than those pings (the cores are shared),
//! and the VM's speed drifts between the probes and the run (docs/simulator.md, "The cost
//! model against `loip local`"). The runtime therefore runs a few decode steps through
//! the started pipeline before the first request (each a fresh throwaway sequence of one
//! token, released after it) and hands their times here:
//!
//! - **Compute**: the steps' median compute (blocks and head, as the workers time them)
//!   over the plan's priced compute gives a factor `s` by which the probed devices' block
//!   and head grids are multiplied ([`DeviceProfile::scale_compute`]): the probe re-timed
//!   in place right before decoding. Clamped to `[1/4, 4]`.
//! - **Hops**: the steps' median hops (wall less compute and load stall: the transfers,
//!   queues, wake-ups and the workers' time outside blocks) less the plan's priced
//!   communication, over the transfers it prices (one per device and round), is what a
//!   transfer costs beyond `δ`, its bytes and `hop_wake`; every device's
//!   [`DeviceProfile::hop_extra`] is set to it (never below 0, never above [`extra_cap`]:
//!   a short warm-up can fall into a burst of other work), so a placement with more rounds
//!   pays it on each of its hops.
//!
//! Pure: the runtime measures, this prices. Only plans of single-sequence steps
//! ([`Pattern::Sporadic`]) are calibrated: the warm-up is one sequence's steps.
//!
//! [`DeviceProfile::scale_compute`]: crate::DeviceProfile::scale_compute
//! [`DeviceProfile::hop_extra`]: crate::DeviceProfile::hop_extra

use crate::{cost, Cluster, ModelShape, Pattern, Plan, PlanError};

/// The least and most a warm-up may scale the probed compute by.
const SCALE_RANGE: (f64, f64) = (0.25, 4.0);

/// One warm-up step as the pipeline timed it.  // seconds
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WarmupStep {
    /// from submission to the result
    pub wall_s: f64,
    /// blocks and head on the devices
    pub compute_s: f64,
    /// waiting for loads on the devices
    pub stall_s: f64,
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
    /// their median compute  // seconds
    pub compute_s: f64,
    /// the plan's compute per step before  // seconds
    pub priced_compute_s: f64,
    /// the factor the probed devices' block times were multiplied by
    pub compute_scale: f64,
    /// their median hops  // seconds
    pub hops_s: f64,
    /// the plan's communication per step, compute scaled, before the extra  // seconds
    pub priced_comm_s: f64,
    /// transfers a step is priced with (devices × rounds; 0 on one device)
    pub transfers: u32,
    /// each transfer's cost beyond the price, set as every device's `hop_extra`  // seconds
    pub hop_extra: f64,
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

/// Calibrates `cluster` from the warm-up `steps` of `plan`: scales the compute of the
/// devices named in `probed` and sets every device's `hop_extra` (module docs). `None`
/// (nothing changed) without steps or for a plan of bursty steps; errors only if a plan
/// device is not in the cluster.
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
    let (Some(compute_s), Some(hops_s)) = (
        median(steps.iter().map(|s| s.compute_s)),
        median(steps.iter().map(WarmupStep::hops_s)),
    ) else {
        return Ok(None);
    };
    for d in &mut cluster.devices {
        d.profile.hop_extra = 0.0; // a remembered profile's: priced anew below
    }
    let before = cost::evaluate(plan, shape, cluster)?.breakdown;
    let priced_compute_s = before.compute_ms / 1e3;
    let scale = compute_scale(compute_s, priced_compute_s);
    for d in &mut cluster.devices {
        if probed.contains(&d.name) {
            d.profile.scale_compute(scale);
        }
    }
    let priced_comm_s = cost::evaluate(plan, shape, cluster)?.breakdown.comm_ms / 1e3;
    let transfers = transfers_per_step(plan);
    let extra = hop_extra(hops_s, priced_comm_s, transfers, extra_cap(cluster));
    for d in &mut cluster.devices {
        d.profile.hop_extra = extra;
    }
    Ok(Some(Calibration {
        steps: steps.len() as u32,
        compute_s,
        priced_compute_s,
        compute_scale: scale,
        hops_s,
        priced_comm_s,
        transfers,
        hop_extra: extra,
    }))
}
