//! Bringing a cluster up, one function per job: connect and authenticate the workers
//! ([`connect_workers`]), measure the links ([`measure_links`]) and the peer sessions,
//! profile the devices without a profile ([`probe_devices`]), describe the cluster
//! ([`describe_cluster`]), plan ([`make_plan`]), ship each plan device its slices and open it
//! ([`ship_and_open`]: each device's slices [`device_slices`] and spec [`device_spec`]), then
//! start the pipeline over the hops' links ([`hop_links`]).

use std::time::{Duration, Instant};

use loip_model::slice::{Manifest, SliceKind, Slices};
use loip_plan::speculate::{step_parts, StepParts};
use loip_plan::{Cluster, DeviceProfile, ExecMode, LinkProfile, ModelShape, Plan, PlanRequest};

use super::peers::connect_peers;
use super::{
    direct_link, profile_from_probe, DeviceReport, SessionOptions, WorkerSpec, ARGMAX_RETURN_BYTES,
};
use crate::adapt::{AdaptReport, Adapter};
use crate::coordinator::{
    ClusterError, Conn, Endpoint, HopLinks, LinkStats, Pipeline, PipelineOptions, Route, ShipStats,
};
use crate::executor::DeviceSpec;
use crate::loader::LoaderKind;
use crate::wire::{DeviceMemory, NetError, ProbeResult, WireError};

/// What setup hands the session.
pub(super) struct Setup {
    pub pipeline: Pipeline,
    pub hop_links: HopLinks,
    pub plan: Plan,
    pub cluster: Cluster,
    pub shape: ModelShape,
    /// the plan's step in parts, to price verify steps ([`loip_plan::speculate::StepParts`])
    pub step: StepParts,
    pub reports: Vec<DeviceReport>,
    pub profiles: Vec<(String, DeviceProfile)>,
    pub adapt: Option<std::sync::Arc<std::sync::Mutex<AdaptReport>>>,
    /// the workers nobody answered for, left out of the plan
    pub unreachable: Vec<String>,
}

/// Brings the cluster of `workers` up for the model in `slices`: plans ([`plan_cluster`]),
/// then brings the plan up ([`bring_up`]).
pub(super) async fn setup(
    slices: &Slices,
    workers: &[WorkerSpec],
    opts: &SessionOptions,
) -> Result<Setup, ClusterError> {
    let planned = plan_cluster(slices, workers, opts).await?;
    bring_up(slices, planned, opts).await
}

/// Ships each plan device its slices, opens it and starts the pipeline over the hops'
/// links, with online adaptation when planned for admission.
pub(super) async fn bring_up(
    slices: &Slices,
    planned: Planned,
    opts: &SessionOptions,
) -> Result<Setup, ClusterError> {
    let Planned {
        conns,
        workers,
        mut reports,
        reach,
        shape,
        cluster,
        profiles,
        plan,
        unreachable,
    } = planned;
    let manifest = &slices.manifest;
    let route = Route::from_plan(&plan)?;
    let opened = ship_and_open(slices, &plan, &workers, conns, &mut reports, opts).await?;
    let hop_links = hop_links(&route, opened.peer_ids, &reach);
    let popts = PipelineOptions {
        step_timeout: opts.step_timeout,
        hidden: manifest.config.hidden_size,
        vocab: manifest.config.vocab_size,
        max_positions: Some(manifest.config.max_position_embeddings),
    };
    let adapter = opts.admitted.map(|_| {
        let mut a = Adapter::for_session(&plan, manifest, &shape, &cluster, &opened.devices);
        a.set_lending(opts.lending);
        a.set_config(opts.adapt);
        a.set_evict_only(opts.evict_only);
        a
    });
    let adapt = adapter.as_ref().map(|a| a.report());
    let pipeline = Pipeline::start_with(opened.conns, route, popts, hop_links.clone(), adapter);
    let (mut cluster, mut profiles, mut plan) = (cluster, profiles, plan);
    if opts.measure_links && plan.pattern == loip_plan::Pattern::Sporadic && warm_up_on() {
        let room = warm_up_room(adapt.as_deref(), opts.adapt.horizon_tokens as u64);
        warm_up(
            &pipeline,
            &mut plan,
            &shape,
            &mut cluster,
            &reports,
            opts,
            room,
        )
        .await?;
        for (name, p) in &mut profiles {
            if let Some(d) = cluster.device(name) {
                *p = d.profile.clone();
            }
        }
    }
    // what the plan's evaluation priced, once per plan (a plan whose device is not in the
    // cluster was refused above)
    let step = step_parts(&plan, &shape, &cluster).unwrap_or_default();
    Ok(Setup {
        pipeline,
        hop_links,
        plan,
        cluster,
        shape,
        step,
        reports,
        profiles,
        adapt,
        unreachable,
    })
}

/// Groups of warm-up steps, run [`WARMUP_GAP`] apart so that a burst of other work on the
/// machine falls on one or two of them, not on all ([`loip_plan::calibrate::group_median`]).
const WARMUP_GROUPS: u32 = 5;
/// Decode steps of one group; the first of each is not counted (after the gap the workers'
/// threads are asleep and a streaming device's first stage is already loaded), nor the
/// first group's first two (the pipeline's first steps touch cold pages).
const WARMUP_GROUP_STEPS: u32 = 6;
/// The pause between two groups.
const WARMUP_GAP: Duration = Duration::from_millis(150);
/// The most positions one warm-up sequence decodes: a group's steps are sequences of up
/// to this many positions, so the coordinator's part before a step is timed as in a run;
/// fewer when a device's KV room is small (half the room before the adapter's first
/// switch, [`warm_up_room`]), so that no warm-up sequence crosses a threshold.
const WARMUP_SEQ_POSITIONS: u64 = 6;

/// Whether the warm-up runs: `LOIP_WARMUP=0` in the coordinator's environment turns it off
/// (the setup as before it, for side-by-side runs).
fn warm_up_on() -> bool {
    !matches!(std::env::var("LOIP_WARMUP").as_deref(), Ok("0"))
}

/// The KV tokens a warm-up sequence may hold without a device's threshold switch: the
/// smallest threshold of the adapter's devices less its look-ahead `horizon` (none without
/// an adapter: nothing switches).
fn warm_up_room(adapt: Option<&std::sync::Mutex<AdaptReport>>, horizon: u64) -> u64 {
    let Some(a) = adapt else { return u64::MAX };
    a.lock().map_or(0, |r| {
        r.devices
            .iter()
            .filter_map(|d| d.threshold)
            .min()
            .map_or(u64::MAX, |t| t.saturating_sub(horizon))
    })
}

/// Runs [`WARMUP_GROUPS`] groups of [`WARMUP_GROUP_STEPS`] one-token decode steps through
/// the started pipeline, [`WARMUP_GAP`] apart, from a thread outside the runtime as a
/// session's decode loop does: each group decodes throwaway sequences at positions 0, 1, …
/// (at most [`WARMUP_SEQ_POSITIONS`], and half of `room`, the KV tokens a sequence may hold
/// without a threshold switch; released after it: no KV is left behind, the tokens of
/// later requests do not change).
/// Then calibrates the cost model from their times ([`loip_plan::calibrate`]): the probed
/// devices' block and load times re-timed in place, the coordinator's part of a step, and
/// what a hop costs as the run pays it while every worker shares the machine. The plan's
/// prediction is priced again; the pipeline's totals start over after it.
async fn warm_up(
    pipeline: &Pipeline,
    plan: &mut Plan,
    shape: &ModelShape,
    cluster: &mut Cluster,
    reports: &[DeviceReport],
    opts: &SessionOptions,
    room: u64,
) -> Result<(), ClusterError> {
    let positions = (room / 2).clamp(1, WARMUP_SEQ_POSITIONS);
    crate::hop_trace::mark("warm-up");
    let mut steps = Vec::new();
    for g in 0..WARMUP_GROUPS {
        if g > 0 {
            tokio::time::sleep(WARMUP_GAP).await;
        }
        let (p, greedy) = (pipeline.clone(), opts.greedy);
        let group = tokio::task::spawn_blocking(move || warm_up_group(&p, greedy, positions))
            .await
            .map_err(|e| ClusterError::Invalid(format!("warm-up task: {e}")))??;
        let skip = if g == 0 { 2 } else { 1 };
        steps.extend(
            group
                .into_iter()
                .skip(skip)
                .map(|st| loip_plan::calibrate::WarmupStep {
                    group: g,
                    wall_s: st.wall_s,
                    compute_s: st.compute_s,
                    stall_s: st.stall_s,
                    coordinator_s: st.coordinator_s,
                }),
        );
    }
    pipeline.warmed();
    crate::hop_trace::mark("warmed");
    let _ = pipeline.take_totals();
    let probed: Vec<String> = reports
        .iter()
        .filter(|r| r.probe.is_some())
        .map(|r| r.endpoint.name.clone())
        .collect();
    let cal = loip_plan::calibrate::calibrate(plan, shape, cluster, &steps, &probed)?;
    if let Some(c) = cal {
        tracing::info!(
            "warm-up: {} steps in {} groups, {} (probed devices); coordinator {:.0} us a step \
             (sequences of {} positions)",
            c.steps,
            c.groups,
            c.terms(),
            c.coordinator_s * 1e6,
            positions
        );
        plan.reprice(shape, cluster)?;
    }
    Ok(())
}

/// One group of the warm-up ([`warm_up`]): [`WARMUP_GROUP_STEPS`] steps, sequences of
/// `positions` positions each, every sequence released after its last step; their stats.
fn warm_up_group(
    pipeline: &Pipeline,
    greedy: bool,
    positions: u64,
) -> Result<Vec<crate::coordinator::StepStats>, ClusterError> {
    let mut stats = Vec::new();
    let mut seq = crate::coordinator::next_seq_id();
    let mut pos = 0u64;
    for k in 0..WARMUP_GROUP_STEPS {
        let batch = [loip_engine::TokenPos {
            seq,
            pos: pos as usize,
        }];
        let out = if greedy {
            crate::coordinator::RowsOut::Argmax {
                masked: &[],
                row_masks: &[],
            }
        } else {
            crate::coordinator::RowsOut::Logits
        };
        let r = pipeline.step_batch_blocking(&[0], &batch, &[0], out);
        pos += 1;
        let last = k + 1 == WARMUP_GROUP_STEPS;
        if r.is_err() || last || pos >= positions {
            pipeline.release(&[seq]);
            (seq, pos) = (crate::coordinator::next_seq_id(), 0);
        }
        stats.push(r?.stats);
    }
    Ok(stats)
}

/// What setup knows once it has planned, before shipping and loading.
pub(super) struct Planned {
    /// one connection per reachable worker
    pub conns: Vec<Conn>,
    /// the reachable workers, in the order of `conns`
    pub workers: Vec<WorkerSpec>,
    pub reports: Vec<DeviceReport>,
    /// which worker reaches which (`reach[from][to]`; empty: every hop relayed)
    pub reach: Vec<Vec<bool>>,
    pub shape: ModelShape,
    pub cluster: Cluster,
    pub profiles: Vec<(String, DeviceProfile)>,
    pub plan: Plan,
    /// the workers nobody answered for, left out of the plan
    pub unreachable: Vec<String>,
}

/// Connects, authenticates, measures the links, profiles and plans: everything before the
/// slices go out ([`crate::cluster_run::Session::preview`] stops here).
pub(super) async fn plan_cluster(
    slices: &Slices,
    workers: &[WorkerSpec],
    opts: &SessionOptions,
) -> Result<Planned, ClusterError> {
    let Connected {
        mut conns,
        workers,
        unreachable,
    } = connect_workers(workers, opts).await?;
    let mut reports: Vec<DeviceReport> = conns.iter().map(new_report).collect();
    let links = measure_links(&mut conns, &mut reports, opts).await?;
    let reach = if opts.relay || conns.len() < 2 {
        Vec::new()
    } else {
        connect_peers(&mut conns, opts, &mut reports).await?
    };
    let manifest = &slices.manifest;
    let shape = planning_shape(manifest, opts);
    let (probes, disk_rate) =
        probe_devices(slices, &workers, &mut conns, &mut reports, opts).await?;
    let (mut cluster, profiles) = describe_cluster(
        &workers,
        &conns,
        &mut reports,
        probes,
        &shape,
        &links,
        !reach.is_empty(),
        opts,
    )?;
    if opts.measure_links {
        cluster.coordinator = crate::coordinator::handoff_s().await; // its part of a step
    }
    if disk_rate > 0.0 && !cluster.disks.is_empty() {
        cluster.disk_rates = vec![disk_rate; cluster.disks.len()];
    }
    let plan = make_plan(&shape, &cluster, &unreachable, opts)?;
    Ok(Planned {
        conns,
        workers,
        reports,
        reach,
        shape,
        cluster,
        profiles,
        plan,
        unreachable: unreachable.into_iter().map(|(ep, _)| ep.name).collect(),
    })
}

/// The workers that answered, and those nobody answered for.
struct Connected {
    /// one connection per reachable worker
    conns: Vec<Conn>,
    /// the reachable workers, in the order of `conns`
    workers: Vec<WorkerSpec>,
    /// the workers left out, and why
    unreachable: Vec<(Endpoint, NetError)>,
}

/// Whether `e` (from connecting) means nobody answered at the address: refused, reset,
/// unreachable, or no answer in time.
fn is_unreachable(e: &WireError) -> bool {
    matches!(
        e,
        WireError::Io(_) | WireError::Timeout(..) | WireError::Closed
    )
}

/// Connects to and authenticates every worker. A worker that cannot be reached is left out
/// when the planner may choose the devices (no fixed plan, dropping allowed): the model may
/// still fit on the others. A worker that answers but refuses (wrong token, other version)
/// is an error, and so is a cluster where nobody answered.
async fn connect_workers(
    workers: &[WorkerSpec],
    opts: &SessionOptions,
) -> Result<Connected, ClusterError> {
    if workers.is_empty() {
        return Err(ClusterError::Invalid("no worker to run on".into()));
    }
    let mut conns = Vec::new();
    let mut reachable = Vec::new();
    let mut unreachable: Vec<(Endpoint, NetError)> = Vec::new();
    let may_leave_out = opts.plan.is_none() && opts.allow_drop;
    // one window for all workers: a cluster of dead workers waits `connect_retry` once
    let until = Instant::now() + opts.connect_retry;
    for w in workers {
        match connect_retrying(w, opts, until).await {
            Ok(c) => {
                conns.push(c);
                reachable.push(w.clone());
            }
            Err(e) if may_leave_out && is_unreachable(&e.source) => {
                tracing::warn!("leaving out {e}");
                unreachable.push((w.endpoint.clone(), e));
            }
            Err(e) => return Err(e.into()),
        }
    }
    if conns.is_empty() && !unreachable.is_empty() {
        return Err(unreachable.remove(0).1.into());
    }
    Ok(Connected {
        conns,
        workers: reachable,
        unreachable,
    })
}

/// First pause between two tries of a worker nobody answers for; it doubles up to
/// [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(250);
/// Longest pause between two tries.
const RETRY_MAX: Duration = Duration::from_secs(4);

/// Connects to `w`, trying again with backoff while nobody answers (refused, reset, no
/// answer in time) until `until`, each failure logged; then its last error, which names the
/// worker and its address. A worker that answers but refuses is not tried again.
async fn connect_retrying(
    w: &WorkerSpec,
    opts: &SessionOptions,
    until: Instant,
) -> Result<Conn, NetError> {
    let mut pause = RETRY_FIRST;
    let mut tries = 0u32;
    loop {
        tries += 1;
        let e = match Conn::connect(&w.endpoint, &opts.connect).await {
            Ok(c) => return Ok(c),
            Err(e) => e,
        };
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || !is_unreachable(&e.source) {
            if tries > 1 {
                tracing::warn!("gave up on {} after {tries} tries", w.endpoint.addr);
            }
            return Err(e);
        }
        tracing::warn!(
            "{e}; trying again in {:.1} s ({:.0} s left)",
            pause.min(left).as_secs_f64(),
            left.as_secs_f64()
        );
        tokio::time::sleep(pause.min(left)).await;
        pause = (pause * 2).min(RETRY_MAX);
    }
}

/// `e` naming the unreachable workers the plan was made without.
fn left_out(unreachable: &[(Endpoint, NetError)], e: ClusterError) -> ClusterError {
    if unreachable.is_empty() {
        return e;
    }
    let names: Vec<String> = unreachable
        .iter()
        .map(|(ep, _)| format!("{} ({})", ep.name, ep.addr))
        .collect();
    ClusterError::Invalid(format!(
        "{e} (planned without the unreachable {})",
        names.join(", ")
    ))
}

/// An empty report for the worker behind `c`.
fn new_report(c: &Conn) -> DeviceReport {
    DeviceReport {
        endpoint: c.endpoint.clone(),
        mem_budget: c.info.mem_budget,
        link: None,
        probe: None,
        shipped: ShipStats::default(),
        memory: None,
        peers: Vec::new(),
    }
}

/// Measures every coordinator ↔ worker link (with `opts.measure_links`; else none).
async fn measure_links(
    conns: &mut [Conn],
    reports: &mut [DeviceReport],
    opts: &SessionOptions,
) -> Result<Vec<LinkStats>, ClusterError> {
    let mut links = Vec::new();
    if opts.measure_links {
        for c in conns.iter_mut() {
            links.push(c.measure().await?);
        }
        crate::coordinator::wakes_beside(conns, &mut links).await?;
        for (r, l) in reports.iter_mut().zip(&links) {
            r.link = Some(*l);
        }
    }
    Ok(links)
}

/// The model's shape as the planner sees it: the token's return trip on the wire (the last
/// device sends the coordinator the argmax when greedy, else the last position's full
/// logits, and the coordinator samples), and the longest step (a prompt), which sizes every
/// device's working buffers.
fn planning_shape(manifest: &Manifest, opts: &SessionOptions) -> ModelShape {
    let shape = crate::shape::shape_from_manifest(&opts.shape_name, manifest);
    let r = if opts.greedy {
        ARGMAX_RETURN_BYTES
    } else {
        shape.logits_return_bytes()
    };
    let mut shape = shape.with_return_bytes(r);
    shape.step_tokens = Some(opts.max_step_tokens.max(1) as u64);
    shape
}

/// Probes the devices without a profile on layer 0 (shipped first): blocks one at a time;
/// loads with the blocks, or all devices together (`opts.probe_loads_together`). With
/// `opts.shared_disk` (and loads probed one at a time) the loaders are then also probed all
/// at once: the sum of their rates is the disk's rate for several readers (bytes/s; 0 when
/// not measured).
async fn probe_devices(
    slices: &Slices,
    workers: &[WorkerSpec],
    conns: &mut Vec<Conn>,
    reports: &mut [DeviceReport],
    opts: &SessionOptions,
) -> Result<(Vec<Option<ProbeResult>>, f64), ClusterError> {
    let (model_dir, manifest) = (&slices.dir, &slices.manifest);
    let together = opts.probe_loads_together;
    let mut probes: Vec<Option<ProbeResult>> = vec![None; workers.len()];
    for (i, (w, c)) in workers.iter().zip(conns.iter_mut()).enumerate() {
        if w.profile.is_none() {
            let s = c
                .ship(
                    model_dir,
                    manifest,
                    &[SliceKind::Attn(0), SliceKind::Mlp(0)],
                    opts.on_ship.as_ref(),
                )
                .await?;
            reports[i].shipped.sent.extend(s.sent);
            reports[i].shipped.sent_bytes += s.sent_bytes;
            probes[i] = Some(c.probe(manifest, true, !together).await?);
        }
    }
    if together {
        probe_loads_together(manifest, conns, &mut probes).await?;
        return Ok((probes, 0.0));
    }
    let probed = probes.iter().filter(|p| p.is_some()).count();
    if !opts.shared_disk || probed < 2 {
        return Ok((probes, 0.0));
    }
    let mut at_once = probes.clone();
    probe_loads_together(manifest, conns, &mut at_once).await?;
    // Each loader's rate at once, at the size it read (layer 0's blocks, two reads): the
    // fit's `β` alone can run far off when `λ` takes the time, its time at the probed size
    // does not.
    let bytes: u64 = [SliceKind::Attn(0), SliceKind::Mlp(0)]
        .iter()
        .filter_map(|k| manifest.slice(*k).map(|e| e.size))
        .sum();
    let rate: f64 = at_once
        .iter()
        .flatten()
        .map(|p| {
            let l = match opts.loader {
                LoaderKind::Direct => p.direct,
                LoaderKind::Conventional => p.conventional,
            };
            bytes as f64 / l.load_time(bytes, 2)
        })
        .filter(|r| r.is_finite() && *r > 0.0)
        .sum();
    Ok((probes, rate))
}

/// Measures the loaders of the probed devices at the same time (devices emulated on one
/// machine share its SSD); `conns` keeps its order.
async fn probe_loads_together(
    manifest: &Manifest,
    conns: &mut Vec<Conn>,
    probes: &mut [Option<ProbeResult>],
) -> Result<(), ClusterError> {
    let mut tasks = Vec::new();
    for (i, c) in std::mem::take(conns).into_iter().enumerate() {
        let m = manifest.clone();
        let probe = probes[i].is_some();
        tasks.push(tokio::spawn(async move {
            let mut c = c;
            let r = if probe {
                Some(c.probe(&m, false, true).await)
            } else {
                None
            };
            (c, r)
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let (c, r) = t
            .await
            .map_err(|e| ClusterError::Invalid(format!("probe task: {e}")))?;
        conns.push(c);
        if let (Some(r), Some(p)) = (r, probes[i].as_mut()) {
            let r = r?;
            p.direct = r.direct;
            p.conventional = r.conventional;
            p.took_s += r.took_s;
        }
    }
    Ok(())
}

/// The cluster the planner plans over: each worker's profile (given, or from its probe) with
/// the budget it may use, the cost model's link (given, or from the measured links: the
/// peer links when `direct`, else the star's), and the shared disk. Returns the profiles too.
#[allow(clippy::too_many_arguments)]
fn describe_cluster(
    workers: &[WorkerSpec],
    conns: &[Conn],
    reports: &mut [DeviceReport],
    probes: Vec<Option<ProbeResult>>,
    shape: &ModelShape,
    links: &[LinkStats],
    direct: bool,
    opts: &SessionOptions,
) -> Result<(Cluster, Vec<(String, DeviceProfile)>), ClusterError> {
    let mut devices = Vec::new();
    let mut profiles = Vec::new();
    for ((w, c), (r, p)) in workers
        .iter()
        .zip(conns)
        .zip(reports.iter_mut().zip(probes))
    {
        let mem = w.mem.unwrap_or(c.info.mem_budget);
        let mut profile = match (&w.profile, p) {
            (Some(prof), _) => prof.clone(),
            (None, Some(p)) => {
                let prof = profile_from_probe(&w.endpoint.name, mem, shape, &p)?;
                r.probe = Some(p);
                prof
            }
            (None, None) => {
                return Err(ClusterError::Invalid(format!(
                    "device {} was not profiled",
                    w.endpoint.name
                )))
            }
        };
        profile.mem_budget = mem;
        if let Some(l) = r.link.filter(|l| l.wake_s > 0.0) {
            profile.hop_wake = l.wake_s.min(1.0); // measured now: the wake-up of a hop into it
        }
        profiles.push((w.endpoint.name.clone(), profile.clone()));
        devices.push(loip_plan::Device {
            name: w.endpoint.name.clone(),
            profile,
            reserve: w.reserve,
            addr: Some(w.endpoint.addr.clone()),
        });
    }
    let link = opts
        .link
        .unwrap_or_else(|| cost_link(links, direct, reports));
    let disks = if opts.shared_disk && devices.len() > 1 {
        vec![devices.iter().map(|d| d.name.clone()).collect()]
    } else {
        Vec::new()
    };
    let cluster = Cluster {
        devices,
        link,
        defaults: Default::default(),
        disks,
        disk_rates: Vec::new(),
        coordinator: 0.0,
    };
    Ok((cluster, profiles))
}

/// The cost model's link from the measured links: the star's, or with peer sessions
/// (`direct`) the slowest peer link.
fn cost_link(links: &[LinkStats], direct: bool, reports: &[DeviceReport]) -> LinkProfile {
    let star = star_link(links);
    if direct {
        direct_link(star, reports)
    } else {
        star
    }
}

/// The plan: the fixed one checked against the model and the cluster, or the planner's
/// (for admission when adapting online); the unreachable workers are listed as dropped.
fn make_plan(
    shape: &ModelShape,
    cluster: &Cluster,
    unreachable: &[(Endpoint, NetError)],
    opts: &SessionOptions,
) -> Result<Plan, ClusterError> {
    let mut plan = match &opts.plan {
        Some(p) => {
            p.validate(shape, cluster)?;
            p.clone()
        }
        None => {
            let req = PlanRequest {
                context: opts.context,
                pattern: opts.pattern,
                micro_batches: opts.micro_batches,
                loader: plan_loader(opts.loader),
                allow_drop: opts.allow_drop,
            };
            match opts.admitted {
                Some(n) => {
                    loip_plan::adapt::plan_for_admission(&opts.planner, shape, cluster, &req, n)
                }
                None => loip_plan::plan(&opts.planner, shape, cluster, &req),
            }
            .map_err(|e| left_out(unreachable, e.into()))?
        }
    };
    for (ep, e) in unreachable {
        plan.dropped.push(loip_plan::plan::DroppedDevice {
            name: ep.name.clone(),
            reason: format!("unreachable at start ({}): {}", ep.addr, e.source),
        });
    }
    Ok(plan)
}

/// The plan devices, opened.
struct Opened {
    /// one connection per plan device, in plan order
    conns: Vec<Conn>,
    /// each plan device's peer id (its index among the connected workers)
    peer_ids: Vec<u16>,
    /// each plan device's spec and how it spends its budget
    devices: Vec<(DeviceSpec, DeviceMemory)>,
}

/// Ships each plan device the slices it lacks and opens it with its spec; says goodbye to
/// the connected workers the plan does not use.
async fn ship_and_open(
    slices: &Slices,
    plan: &Plan,
    workers: &[WorkerSpec],
    conns: Vec<Conn>,
    reports: &mut [DeviceReport],
    opts: &SessionOptions,
) -> Result<Opened, ClusterError> {
    let (model_dir, manifest) = (&slices.dir, &slices.manifest);
    let mut peer_ids = Vec::new();
    let mut slots: Vec<Option<Conn>> = conns.into_iter().map(Some).collect();
    let mut plan_conns = Vec::new();
    let mut devices = Vec::new();
    for (i, d) in plan.devices.iter().enumerate() {
        let idx = workers
            .iter()
            .position(|w| w.endpoint.name == d.name)
            .ok_or_else(|| {
                ClusterError::Invalid(format!(
                    "the plan names device `{}`, which is not in the cluster",
                    d.name
                ))
            })?;
        peer_ids.push(idx as u16);
        let mut c = slots[idx].take().ok_or_else(|| {
            ClusterError::Invalid(format!("device `{}` appears twice in the plan", d.name))
        })?;
        let kinds = device_slices(plan, i, manifest.config.tie_word_embeddings);
        let s = c
            .ship(model_dir, manifest, &kinds, opts.on_ship.as_ref())
            .await?;
        let r = &mut reports[idx];
        r.shipped.reused = s.reused;
        r.shipped.sent_bytes += s.sent_bytes;
        r.shipped.sent.extend(s.sent);
        let context = (opts.context as usize).min(manifest.config.max_position_embeddings);
        let spec = device_spec(
            plan,
            i,
            opts.loader,
            opts.max_step_tokens,
            context,
            Some(c.info.mem_budget),
        );
        let spec = DeviceSpec {
            max_step_seqs: opts.max_step_seqs.max(1),
            ..spec
        };
        let memory = c.load(manifest, &spec).await?;
        r.memory = Some(memory);
        devices.push((spec, memory));
        plan_conns.push(c);
    }
    for c in slots.into_iter().flatten() {
        c.bye().await;
    }
    Ok(Opened {
        conns: plan_conns,
        peer_ids,
        devices,
    })
}

/// Which hops of `route` go device to device, given which connected worker reaches which
/// (`reach`, by peer id; empty: every hop relayed).
fn hop_links(route: &Route, peer_ids: Vec<u16>, reach: &[Vec<bool>]) -> HopLinks {
    let reaches = |a: usize, b: usize| {
        let (a, b) = (peer_ids[a] as usize, peer_ids[b] as usize);
        reach
            .get(a)
            .and_then(|r| r.get(b))
            .copied()
            .unwrap_or(false)
    };
    let direct: Vec<bool> = (0..route.hops.len())
        .map(|h| h > 0 && reaches(route.hops[h - 1].device, route.hops[h].device))
        .collect();
    let n = peer_ids.len();
    let reach = (0..n)
        .map(|a| (0..n).map(|b| a != b && reaches(a, b)).collect())
        .collect();
    HopLinks {
        direct,
        peer_ids,
        reach,
    }
}

/// The spec of plan device `i`: one stage per plan stage, residency per block.
/// `context` is the longest context of one sequence (tokens).
pub fn device_spec(
    plan: &Plan,
    i: usize,
    loader: LoaderKind,
    max_step_tokens: usize,
    context: usize,
    mem_budget: Option<u64>,
) -> DeviceSpec {
    let d = &plan.devices[i];
    DeviceSpec {
        stages: crate::adapt::stage_specs(&d.stages),
        embed: d.holds_embedding,
        head: d.holds_head,
        loader,
        overlap: plan.mode == ExecMode::Overlapped,
        mem_budget,
        max_step_tokens: max_step_tokens.max(1),
        max_step_seqs: 1,
        context: context.max(1),
    }
}

/// The slices plan device `i` reads: its layers' blocks, the embedding (first device, and a
/// tied head's device) and the head (last device).
pub fn device_slices(plan: &Plan, i: usize, tied: bool) -> Vec<SliceKind> {
    let d = &plan.devices[i];
    let mut v = Vec::new();
    if d.holds_embedding || (d.holds_head && tied) {
        v.push(SliceKind::Embed);
    }
    for s in &d.stages {
        for l in &s.layers {
            v.push(SliceKind::Attn(l.layer as usize));
            v.push(SliceKind::Mlp(l.layer as usize));
        }
    }
    if d.holds_head {
        v.push(SliceKind::Head);
    }
    v
}

fn plan_loader(k: LoaderKind) -> loip_plan::LoaderKind {
    match k {
        LoaderKind::Direct => loip_plan::LoaderKind::Direct,
        LoaderKind::Conventional => loip_plan::LoaderKind::Conventional,
    }
}

/// The cost model's link for a star over `links`.
pub fn star_link(links: &[LinkStats]) -> LinkProfile {
    let bw = links
        .iter()
        .flat_map(|l| [l.up_bps, l.down_bps])
        .fold(f64::INFINITY, f64::min);
    let lat = links.iter().map(|l| l.latency_s).fold(0.0, f64::max);
    if bw.is_finite() && bw > 0.0 {
        LinkProfile {
            bandwidth: bw / 2.0,
            latency: 2.0 * lat,
        }
    } else {
        LinkProfile {
            bandwidth: 125e6,
            latency: 1e-4,
        }
    }
}
