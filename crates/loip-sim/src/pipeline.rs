//! Executes a pipeline plan (interleaved stages, with or without offloading) event by event.
//!
//! Per decoding step and micro-batch (one sequence each), stages run in round-robin order
//! (device 1 stage 1, device 2 stage 1, …). A stage is split where its offloaded blocks sit:
//! the blocks before the offloaded run, the run, the blocks after it. Tasks:
//!
//! - **overlapped** (LOIP): one load per (step, stage) into the device's slot, started when
//!   the slot is released — after the previous stage's offloaded run finished for the last
//!   micro-batch — and needed before the run starts; every micro-batch of the stage uses it.
//! - **sequential** (conventional offloading): each micro-batch runs the stage on its own;
//!   each offloaded block is read into a one-block buffer after the blocks before it ran (and
//!   once the buffer's previous block was computed), then computed. Every micro-batch reads
//!   the blocks again, as the runtime does, so a step reads a stage's offloaded bytes `b`
//!   times (the cost model's sequential bursty round).
//! - activations (`(1 + e)·h` bytes) go from a stage to the next device on the sender's egress
//!   port; the last stage's device runs the LM head and returns `r` bytes to the first device
//!   (`r` = [`ModelShape::return_bytes_per_token`]: the shape's `return_bytes`, else `h`, as
//!   the cost model prices the return trip);
//! - lent KV (see [`crate::adapt`]) leaves after a stage's last micro-batch; the next stage's
//!   lent KV comes back into the same buffer once that send is done. Both are background
//!   transfers that never delay an activation; a stage waits for its KV to be back.
//!
//! Compute, loader and egress port of each device serve their tasks in program order
//! (step, stage, micro-batch), so a faster link or device never delays anything.

use crate::adapt::{Adapter, DevState, Measure, Models};
use crate::compute::DeviceModel;
use crate::engine::{Engine, ResId, TaskId, Work};
use crate::error::SimError;
use crate::sim::{DeviceReport, MemorySample, SimConfig, SimReport, Status};
use loip_plan::{Cluster, ExecMode, ModelShape, Plan, StagePlan};

/// Where a stage's offloaded blocks sit: block index `2·l` is layer `l`'s attention, `2·l + 1`
/// its MLP.
struct Segments {
    /// (attention, MLP) blocks before the offloaded run, in it, after it.
    pre: (u32, u32),
    run: (u32, u32),
    post: (u32, u32),
    /// Blocks of the run in order: (is attention, is offloaded).
    run_blocks: Vec<(bool, bool)>,
    /// Offloaded bytes and reads.  // bytes, count
    off_bytes: u64,
    reads: u32,
}

fn segments(stage: &StagePlan, shape: &ModelShape) -> Segments {
    let blocks: Vec<(bool, bool)> = stage
        .layers
        .iter()
        .flat_map(|l| [(true, l.attn.is_offloaded()), (false, l.mlp.is_offloaded())])
        .collect();
    let count = |r: &[(bool, bool)]| {
        let a = r.iter().filter(|b| b.0).count() as u32;
        (a, r.len() as u32 - a)
    };
    let first = blocks.iter().position(|b| b.1);
    let last = blocks.iter().rposition(|b| b.1);
    let (_, a, m) = stage.counts();
    match (first, last) {
        (Some(f), Some(l)) => Segments {
            pre: count(&blocks[..f]),
            run: count(&blocks[f..=l]),
            post: count(&blocks[l + 1..]),
            run_blocks: blocks[f..=l].to_vec(),
            off_bytes: stage.offloaded_bytes(shape),
            reads: a + m,
        },
        _ => Segments {
            pre: count(&blocks),
            run: (0, 0),
            post: (0, 0),
            run_blocks: Vec::new(),
            off_bytes: 0,
            reads: 0,
        },
    }
}

/// Resources and cross-step bookkeeping of one device.
struct Dev {
    comp: ResId,
    loader: ResId,
    egress: ResId,
    /// Task after which the slot is free (last offloaded run; sequential: the last offloaded
    /// block's compute).
    slot_free: Option<TaskId>,
    /// Per stage: (send task, bytes, peer) of KV lent after its last run.
    lent: Vec<Option<(TaskId, f64, usize)>>,
    /// The latest lent-KV send of this device (its buffer is free once it is done).
    last_send: Option<TaskId>,
}

struct Pipeline<'a> {
    shape: &'a ModelShape,
    eng: Engine,
    ad: Adapter<'a, Models<'a>>,
    devs: Vec<Dev>,
    b: u32,
    prompt: u32,
    /// Per micro-batch: the task that makes its next token available to the first device.
    token: Vec<Option<TaskId>>,
    step_end: Vec<TaskId>,
    /// Memory of every device for each emitted step not yet finished (time filled at its end).
    pending: std::collections::VecDeque<Vec<MemorySample>>,
    /// A framework's fixed cost per pass of a micro-batch through a stage.  // seconds
    pass_overhead: f64,
    /// Per device: the runtime's wake-up of a hop into it (profile `hop_wake` + `hop_extra`).  // seconds
    wakes: Vec<f64>,
    /// What the devices' `hop_extra` add to a round ([`loip_plan::cost::round_extra`]): an
    /// overlapped load lasts that much longer, since no load progresses in them (the run
    /// queue the loaders share), as the cost model prices it.  // seconds
    load_extra: f64,
    /// The coordinator (its part of a step, seconds, on its own resource), when modelled.
    coordinator: Option<(ResId, f64)>,
}

impl Pipeline<'_> {
    fn dur(seg: (u32, u32), ta: f64, tm: f64) -> f64 {
        seg.0 as f64 * ta + seg.1 as f64 * tm
    }

    /// Hands micro-batch `j`'s output of stage task `lt` on device `i` on: the activation to
    /// the next device, or (after the last stage) the LM head and the token's `r` bytes back to
    /// device 1.
    #[allow(clippy::too_many_arguments)]
    fn hand_on(
        &mut self,
        i: usize,
        j: usize,
        lt: TaskId,
        global_last: bool,
        h: f64,
        t_head: f64,
        incoming: &mut [Option<TaskId>],
        ends: &mut Vec<TaskId>,
    ) {
        let nd = self.devs.len();
        incoming[j] = Some(if global_last {
            let hd = self
                .eng
                .task(Some(self.devs[i].comp), Work::Secs(t_head), &[lt]);
            let tok = if nd > 1 {
                let r = self.shape.return_bytes_per_token() as f64; // bytes
                let back = self
                    .eng
                    .task(Some(self.devs[i].egress), Work::Transfer(r), &[hd]);
                self.wake(0, back)
            } else {
                hd
            };
            let tok = match self.coordinator {
                Some((res, co)) => self.eng.task(Some(res), Work::Secs(co), &[tok]),
                None => tok,
            };
            self.token[j] = Some(tok);
            ends.push(tok);
            tok
        } else if nd == 1 {
            lt
        } else {
            let sent = self
                .eng
                .task(Some(self.devs[i].egress), Work::Transfer(h), &[lt]);
            self.wake((i + 1) % nd, sent)
        });
    }

    /// The wake-up of device `to` after hop `hop` arrived there (nothing when it has none).
    fn wake(&mut self, to: usize, hop: TaskId) -> TaskId {
        match self.wakes.get(to) {
            Some(&w) if w > 0.0 => self.eng.task(None, Work::Secs(w), &[hop]),
            _ => hop,
        }
    }

    /// Decides and emits every task of decoding step `t`.
    fn emit_step(&mut self, t: u32, measure: Option<Measure>) {
        self.ad.decide(t, measure);
        self.pending.push_back(
            (0..self.devs.len())
                .map(|i| self.ad.sample(i, t, f64::NAN))
                .collect(),
        );
        let nd = self.devs.len();
        let b = self.b as usize;
        let e = self.ad.evict;
        let n_ctx = self.prompt as u64 + t as u64 + 1;
        let h = (1 + e) as f64 * self.shape.act_bytes_per_token as f64;
        let kv = self.shape.kv_bytes_per_token as f64;
        let s = self
            .ad
            .devs
            .iter()
            .map(|d| d.stages.len())
            .max()
            .unwrap_or(0);
        let mut incoming: Vec<Option<TaskId>> = self.token.clone();
        let last_dev = nd - 1;
        let t_head = self.ad.clock.0[last_dev].head(1);
        let mut ends = Vec::with_capacity(b);
        for k in 0..s {
            for i in 0..nd {
                let Some(stage) = self.ad.devs[i].stages.get(k) else {
                    continue;
                };
                let seg = segments(stage, self.shape);
                let stage_layers = stage.layers.len() as f64;
                let model = self.ad.clock.0[i];
                let (ta, tm) = (model.attn(1, 1 + e, n_ctx, 1.0), model.mlp(1 + e, 1.0));
                let loader = self.ad.loaders[i];
                let global_last = k + 1 == s && i == last_dev;
                // Lent KV of this stage comes back once the previous send freed the buffer.
                let mut fetch = None;
                if let Some((send, bytes, peer)) = self.devs[i].lent[k].take() {
                    let deps: Vec<TaskId> = std::iter::once(send)
                        .chain(self.devs[i].last_send)
                        .collect();
                    fetch = Some(self.eng.background(
                        self.devs[peer].egress,
                        Work::Transfer(bytes),
                        &deps,
                    ));
                }
                let comp = self.devs[i].comp;
                let mut last_tasks: Vec<TaskId> = Vec::with_capacity(b);
                match self.ad.mode {
                    ExecMode::Overlapped => {
                        let load = (seg.reads > 0).then(|| {
                            let deps: Vec<TaskId> = self.devs[i].slot_free.into_iter().collect();
                            let secs = loader.load_time(seg.off_bytes, seg.reads) + self.load_extra;
                            self.eng
                                .task(Some(self.devs[i].loader), Work::Secs(secs), &deps)
                        });
                        let mut last_run = None;
                        for j in 0..b {
                            let mut deps: Vec<TaskId> =
                                incoming[j].iter().copied().chain(fetch).collect();
                            let mut prev = None;
                            // The pass's fixed cost goes with its first task.
                            let mut fw = self.pass_overhead;
                            if seg.pre != (0, 0) || load.is_none() {
                                let p = self.eng.task(
                                    Some(comp),
                                    Work::Secs(Self::dur(seg.pre, ta, tm) + fw),
                                    &deps,
                                );
                                fw = 0.0;
                                prev = Some(p);
                                deps = vec![p];
                            }
                            if let Some(l) = load {
                                deps.push(l);
                                let r = self.eng.task(
                                    Some(comp),
                                    Work::Secs(Self::dur(seg.run, ta, tm) + fw),
                                    &deps,
                                );
                                last_run = Some(r);
                                prev = Some(r);
                                if seg.post != (0, 0) {
                                    prev = Some(self.eng.task(
                                        Some(comp),
                                        Work::Secs(Self::dur(seg.post, ta, tm)),
                                        &[r],
                                    ));
                                }
                            }
                            if let Some(lt) = prev {
                                last_tasks.push(lt);
                                self.hand_on(
                                    i,
                                    j,
                                    lt,
                                    global_last,
                                    h,
                                    t_head,
                                    &mut incoming,
                                    &mut ends,
                                );
                            }
                        }
                        if last_run.is_some() {
                            self.devs[i].slot_free = last_run;
                        }
                    }
                    ExecMode::Sequential => {
                        // Each micro-batch runs the stage on its own and reads every
                        // offloaded block again into the one-block buffer (as the runtime
                        // does): a read waits for the buffer's previous block to be computed.
                        for j in 0..b {
                            let mut deps: Vec<TaskId> =
                                incoming[j].iter().copied().chain(fetch).collect();
                            let mut prev = None;
                            let mut fw = self.pass_overhead;
                            if seg.pre != (0, 0) || seg.run_blocks.is_empty() {
                                let p = self.eng.task(
                                    Some(comp),
                                    Work::Secs(Self::dur(seg.pre, ta, tm) + fw),
                                    &deps,
                                );
                                fw = 0.0;
                                prev = Some(p);
                                deps = vec![p];
                            }
                            for &(is_attn, off) in &seg.run_blocks {
                                let (bytes, t1) = if is_attn {
                                    (self.shape.attn_bytes, ta)
                                } else {
                                    (self.shape.mlp_bytes, tm)
                                };
                                if off {
                                    deps.extend(self.devs[i].slot_free);
                                    let l = self.eng.task(
                                        Some(self.devs[i].loader),
                                        Work::Secs(loader.load_time(bytes, 1)),
                                        &deps,
                                    );
                                    deps = vec![l];
                                }
                                let c = self.eng.task(Some(comp), Work::Secs(t1 + fw), &deps);
                                fw = 0.0;
                                if off {
                                    self.devs[i].slot_free = Some(c);
                                }
                                prev = Some(c);
                                deps = vec![c];
                            }
                            if !seg.run_blocks.is_empty() && seg.post != (0, 0) {
                                prev = Some(self.eng.task(
                                    Some(comp),
                                    Work::Secs(Self::dur(seg.post, ta, tm)),
                                    &deps,
                                ));
                            }
                            if let Some(lt) = prev {
                                last_tasks.push(lt);
                                self.hand_on(
                                    i,
                                    j,
                                    lt,
                                    global_last,
                                    h,
                                    t_head,
                                    &mut incoming,
                                    &mut ends,
                                );
                            }
                        }
                    }
                }
                // KV lent after the stage's last micro-batch.
                if let Some((peer, tokens)) = self.ad.devs[i].lend {
                    let bytes = tokens as f64 * stage_layers * kv;
                    if let Some(&lt) = last_tasks.last() {
                        let send =
                            self.eng
                                .background(self.devs[i].egress, Work::Transfer(bytes), &[lt]);
                        self.devs[i].lent[k] = Some((send, bytes, peer));
                        self.devs[i].last_send = Some(send);
                    }
                }
            }
        }
        let end = self.eng.task(None, Work::Secs(0.0), &ends);
        self.step_end.push(end);
    }
}

/// Simulates `plan` on `cluster` (devices looked up by name). OOM when a device's weights,
/// slot and buffers exceed its budget; KV growth is then handled by `cfg.kv_policy`.
pub fn simulate_pipeline(
    plan: &Plan,
    shape: &ModelShape,
    cluster: &Cluster,
    cfg: &SimConfig,
) -> Result<SimReport, SimError> {
    let mut profiles = Vec::with_capacity(plan.devices.len());
    let mut budgets = Vec::with_capacity(plan.devices.len());
    for d in &plan.devices {
        let dev = cluster
            .device(&d.name)
            .ok_or_else(|| loip_plan::PlanError::UnknownDevice(d.name.clone()))?;
        profiles.push(&dev.profile);
        budgets.push(dev.budget());
    }
    if plan.devices.is_empty() || plan.devices.iter().any(|d| d.stages.is_empty()) {
        return Err(SimError::Invalid {
            field: "plan",
            reason: "a device has no stage".into(),
        });
    }
    let b = cfg.sequences.max(1);
    let steps = cfg.output_tokens.max(1);
    let devs: Vec<DevState> = plan
        .devices
        .iter()
        .zip(&budgets)
        .map(|(d, &budget)| DevState {
            budget,
            stages: d.stages.clone(),
            embed: d.holds_embedding,
            head: d.holds_head,
            layers: d.layer_count() as u64,
            n_max: d
                .stages
                .iter()
                .map(|s| s.layers.len() as u32)
                .max()
                .unwrap_or(0),
            lend: None,
            peak: 0,
        })
        .collect();
    let ad = Adapter {
        shape,
        mode: plan.mode,
        b,
        policy: cfg.kv_policy,
        cfg: cfg.adapt,
        prompt: cfg.prompt_tokens,
        steps,
        latency: cfg.latency,
        devs,
        clock: Models(
            profiles
                .iter()
                .map(|p| DeviceModel::new(p, shape))
                .collect(),
        ),
        loaders: profiles.iter().map(|p| *p.loader(plan.loader)).collect(),
        evict: 0,
        events: Vec::new(),
    };
    for i in 0..plan.devices.len() {
        let base = ad.base(i, &ad.devs[i].stages);
        if base > ad.devs[i].budget {
            return Ok(SimReport::oom(format!(
                "device `{}`: weights, slot and buffers need {} bytes, budget is {}",
                plan.devices[i].name, base, ad.devs[i].budget
            )));
        }
    }
    let thresholds: Vec<Option<u64>> = (0..plan.devices.len())
        .map(|i| ad.first_threshold(i))
        .collect();
    let mut eng = Engine::new(cfg.bandwidth.at(0), cfg.latency);
    let s = ad.devs.iter().map(|d| d.stages.len()).max().unwrap_or(1);
    let pdevs: Vec<Dev> = (0..plan.devices.len())
        .map(|_| Dev {
            comp: eng.resource(),
            loader: eng.resource(),
            egress: eng.resource(),
            slot_free: None,
            lent: vec![None; s],
            last_send: None,
        })
        .collect();
    let mut p = Pipeline {
        shape,
        eng,
        ad,
        devs: pdevs,
        b,
        prompt: cfg.prompt_tokens,
        token: vec![None; b as usize],
        step_end: Vec::new(),
        pending: Default::default(),
        pass_overhead: cfg.pass_overhead_s,
        wakes: profiles.iter().map(|p| p.hop_wake + p.hop_extra).collect(),
        load_extra: loip_plan::cost::round_extra(
            &profiles.iter().map(|p| p.hop_extra).collect::<Vec<_>>(),
            b,
            cfg.pattern == loip_plan::Pattern::Bursty,
        ),
        coordinator: None,
    };
    if cluster.coordinator > 0.0 {
        p.coordinator = Some((p.eng.resource(), cluster.coordinator));
    }
    let mut report = SimReport::oom(String::new());
    report.status = Status::Ok;
    report.note = None;
    report.memory = vec![Vec::new(); plan.devices.len()];
    for t in 0..steps.min(2) {
        p.emit_step(t, None);
    }
    let limit = cfg.oot_limit_ms();
    let mut prev_end = 0.0;
    for t in 0..steps {
        let end = p.eng.run_until(p.step_end[t as usize])?;
        report.step_end_s.push(end);
        if let Some(samples) = p.pending.pop_front() {
            if cfg.record_memory {
                for (i, mut m) in samples.into_iter().enumerate() {
                    m.time_s = end;
                    report.memory[i].push(m);
                }
            }
        }
        let measure = Measure {
            step_s: end - prev_end,
            bandwidth: p.eng.bandwidth(),
        };
        prev_end = end;
        p.eng.set_bandwidth(cfg.bandwidth.at(t + 1));
        let mean_ms = end * 1e3 / ((t + 1) as f64 * b as f64);
        if cfg.stop_when_oot && t >= 7 && mean_ms > 1.2 * limit {
            break;
        }
        if cfg.stop_after_s.is_some_and(|s| end > s) && t + 1 < steps {
            break;
        }
        if t + 2 < steps {
            p.emit_step(t + 2, Some(measure));
        }
    }
    report.finish(b, limit, steps);
    report.events = std::mem::take(&mut p.ad.events);
    report.devices = (0..p.devs.len())
        .map(|i| DeviceReport {
            name: plan.devices[i].name.clone(),
            budget: p.ad.devs[i].budget,
            peak_memory: p.ad.devs[i].peak,
            first_threshold: thresholds[i],
            compute_s: p.eng.busy(p.devs[i].comp),
            load_s: p.eng.busy(p.devs[i].loader),
            bytes_sent: p.eng.bytes(p.devs[i].egress),
        })
        .collect();
    Ok(report)
}
