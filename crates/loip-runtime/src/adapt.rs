//! Online memory adaptation in the running cluster (design §6): the coordinator's side.
//!
//! The coordinator sees every step's tokens, so it knows the KV each device holds without
//! asking: `Σ_seq (last position + 1)` tokens, times the bytes one token costs over the
//! device's layers. Before a step enters the pipeline, [`Adapter::before_step`] checks every
//! device against its threshold `TS` (the KV tokens its current layout leaves room for);
//! a device the step would carry past it gets a plan switch first: α/β attention/MLP blocks
//! offloaded per stage (or brought back), chosen by the shared policy
//! ([`loip_plan::adapt::choose_switch`]) for the least added load among the layouts that
//! hold the KV of [`AdaptConfig::horizon_tokens`] more tokens per sequence (or, failing
//! that, of this step). The switch travels as a [`ToWorker::Switch`] on the device's
//! connection ahead of the step, so the worker applies it between two steps
//! ([`crate::executor::Device::switch`]), re-accounting resident set + slot + KV within its
//! budget; the worker answers [`ToCoordinator::Switched`] with its own accounting.
//!
//! Last resort: a step that starts a sequence (a new admission) whose KV no layout can hold
//! next to what other sequences hold is held back ([`Verdict::Hold`]) until sequences are
//! released; an admitted sequence's steps are never held (one that outgrows every layout
//! fails on the device with a typed KV-budget error; the budget is never exceeded).
//!
//! Prices of layouts come from the manifest's slice sizes, the same function the worker
//! accounts with ([`crate::executor::layout_bytes`]), so both sides agree to the byte.
//!
//! [`ToCoordinator::Switched`]: crate::wire::ToCoordinator::Switched

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use loip_engine::TokenPos;
use loip_model::slice::Manifest;
use loip_plan::adapt::{
    choose_switch, counts_max, stage_layout, AdaptConfig, AdaptEvent, MemorySample,
};
use loip_plan::{cost, DeviceProfile, ModelShape, Plan, Residency, StagePlan};
use serde::Serialize;

use crate::executor::{layout_bytes, BlockPlacement, Device, DeviceSpec, StageLayer, StageSpec};
use crate::wire::{DeviceMemory, ToCoordinator, ToWorker};

/// A threshold a device's KV reached.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Crossing {
    /// decision step (steps admitted so far)
    pub step: u32,
    /// KV tokens held, summed over sequences, with the step  // tokens
    pub tokens: u64,
    /// the threshold `TS` crossed  // tokens
    pub threshold: u64,
    /// seconds since the pipeline started  // seconds
    pub time_s: f64,
}

/// One device's adaptation, as reported.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceAdapt {
    /// device name
    pub name: String,
    /// its budget  // bytes
    pub budget: u64,
    /// KV held now  // bytes
    pub kv_bytes: u64,
    /// most KV held  // bytes
    pub kv_peak_bytes: u64,
    /// KV room of the current layout  // bytes
    pub kv_budget: u64,
    /// current threshold `TS`  // tokens
    pub threshold: Option<u64>,
    /// thresholds reached, in order
    pub crossings: Vec<Crossing>,
    /// switches applied (acknowledged by the worker)
    pub switches_applied: u32,
    /// (attention, MLP) blocks offloaded per stage now
    pub offloaded: (u32, u32),
}

/// What adaptation did over the run (`loip local --json` "adaptation").
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AdaptReport {
    /// per plan device
    pub devices: Vec<DeviceAdapt>,
    /// switches decided, in the simulator's terms (step = decision step)
    pub events: Vec<AdaptEvent>,
    /// steps of new sequences held back because nothing could free enough
    pub held_admissions: u64,
    /// KV tokens held now, summed over sequences  // tokens
    pub tokens: u64,
    /// memory of every device at every switch and crossing: (seconds, device, KV bytes,
    /// weights + slot + working bytes)
    pub samples: Vec<(f64, usize, u64, u64)>,
    /// memory of every plan device at every step admitted, `memory[device][k]`
    pub memory: Vec<Vec<MemorySample>>,
}

/// What to do with a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// send it, after these switches (plan device, its new stages)
    Go(Vec<(usize, Vec<StageSpec>)>),
    /// hold it back until sequences are released (a new admission that does not fit),
    /// after these switches (they only make room)
    Hold(Vec<(usize, Vec<StageSpec>)>),
}

struct Dev {
    spec: DeviceSpec,            // current stages and what the worker opened
    plan_stages: Vec<StagePlan>, // the same, in plan terms
    budget: u64,                 // bytes
    working: u64,                // bytes
    kv_budget: u64,              // bytes, of the current layout
    kv_per_token: u64,           // bytes per token over the device's layers
    n_max: u32,                  // layers of its largest stage
    attn_s: f64,                 // attention block time  // seconds
    mlp_s: f64,                  // MLP block time  // seconds
    loader: loip_plan::LoaderProfile,
}

/// The coordinator's adaptation state (see the module docs).
pub struct Adapter {
    devs: Vec<Dev>,
    manifest: Manifest,
    shape: ModelShape,
    cfg: AdaptConfig,
    held: BTreeMap<u64, u64>, // seq → tokens cached
    step: u32,
    started: Instant,
    report: Arc<Mutex<AdaptReport>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// `stages` in the runtime's terms.
pub fn stage_specs(stages: &[StagePlan]) -> Vec<StageSpec> {
    let place = |r: Residency| match r {
        Residency::Retained => BlockPlacement::Resident,
        Residency::Offloaded => BlockPlacement::Offloaded,
    };
    stages
        .iter()
        .map(|s| StageSpec {
            layers: s
                .layers
                .iter()
                .map(|l| StageLayer {
                    layer: l.layer as usize,
                    attn: place(l.attn),
                    mlp: place(l.mlp),
                })
                .collect(),
        })
        .collect()
}

impl Adapter {
    /// The adaptation of `plan` as opened: `specs` and `memory` per plan device (what each
    /// worker reported when it loaded), `profiles` per plan device.
    pub fn new(
        plan: &Plan,
        manifest: &Manifest,
        shape: &ModelShape,
        specs: &[DeviceSpec],
        memory: &[DeviceMemory],
        profiles: &[DeviceProfile],
        cfg: AdaptConfig,
    ) -> Adapter {
        let c = &manifest.config;
        let per_layer = 2 * (c.num_kv_heads * c.head_dim) as u64 * 4; // bytes per token
        let n = (plan.context / plan.micro_batches.max(1) as u64).max(1);
        let devs: Vec<Dev> = plan
            .devices
            .iter()
            .zip(specs)
            .zip(memory)
            .zip(profiles)
            .map(|(((d, spec), mem), prof)| Dev {
                spec: spec.clone(),
                plan_stages: d.stages.clone(),
                budget: mem.budget,
                working: mem.working,
                kv_budget: mem.kv_budget,
                kv_per_token: d.layer_count() as u64 * per_layer,
                n_max: d
                    .stages
                    .iter()
                    .map(|s| s.layers.len() as u32)
                    .max()
                    .unwrap_or(0),
                attn_s: prof.attn_time(shape, 1, n),
                mlp_s: prof.mlp_time(shape, 1),
                loader: *prof.loader(plan.loader),
            })
            .collect();
        let report = AdaptReport {
            devices: plan
                .devices
                .iter()
                .zip(&devs)
                .map(|(d, v)| DeviceAdapt {
                    name: d.name.clone(),
                    budget: v.budget,
                    kv_bytes: 0,
                    kv_peak_bytes: 0,
                    kv_budget: v.kv_budget,
                    threshold: v.threshold(),
                    crossings: Vec::new(),
                    switches_applied: 0,
                    offloaded: counts_max(&v.plan_stages),
                })
                .collect(),
            ..Default::default()
        };
        Adapter {
            devs,
            manifest: manifest.clone(),
            shape: shape.clone(),
            cfg,
            held: BTreeMap::new(),
            step: 0,
            started: Instant::now(),
            report: Arc::new(Mutex::new(report)),
        }
    }

    /// The adaptation of a session's plan: `opened` is (spec, what the worker reported) per
    /// plan device; profiles from `cluster` by name (setup checked every plan device is
    /// there; a missing one would leave the devices after it unadapted); default knobs.
    pub fn for_session(
        plan: &Plan,
        manifest: &Manifest,
        shape: &ModelShape,
        cluster: &loip_plan::Cluster,
        opened: &[(DeviceSpec, DeviceMemory)],
    ) -> Adapter {
        let profiles: Vec<DeviceProfile> = plan
            .devices
            .iter()
            .filter_map(|d| {
                cluster
                    .devices
                    .iter()
                    .find(|c| c.name == d.name)
                    .map(|c| c.profile.clone())
            })
            .collect();
        let (specs, memory): (Vec<DeviceSpec>, Vec<DeviceMemory>) = opened.iter().cloned().unzip();
        Adapter::new(
            plan,
            manifest,
            shape,
            &specs,
            &memory,
            &profiles,
            AdaptConfig::default(),
        )
    }

    /// The report, shared (it fills as the run goes).
    pub fn report(&self) -> Arc<Mutex<AdaptReport>> {
        self.report.clone()
    }

    fn total(&self) -> u64 {
        self.held.values().sum()
    }

    /// Resident + slot + working bytes of device `i` with `a`/`m` offloaded blocks per
    /// stage, and those stages; `None` if the manifest lacks a slice.
    fn price(&self, i: usize, a: u32, m: u32) -> Option<(u64, Vec<StagePlan>)> {
        let d = &self.devs[i];
        let stages = stage_layout(&d.plan_stages, a, m);
        let spec = DeviceSpec {
            stages: stage_specs(&stages),
            ..d.spec.clone()
        };
        let (res, slot) = layout_bytes(&self.manifest, &spec).ok()?;
        Some((res + slot + d.working, stages))
    }

    /// The threshold switch of device `i` for `tokens` held (see the module docs).
    fn choose(&self, i: usize, tokens: u64, seqs: u64) -> Option<(u32, u32)> {
        let d = &self.devs[i];
        let cur = counts_max(&d.plan_stages);
        let g = |a: u32, m: u32| {
            let (a, m) = (a.min(d.n_max), m.min(d.n_max));
            let bytes = a as u64 * self.shape.attn_bytes + m as u64 * self.shape.mlp_bytes;
            d.loader.load_time(bytes, a + m) + cost::span(a, m, d.attn_s, d.mlp_s)
        };
        let holds = |want: u64| {
            move |a: u32, m: u32| {
                self.price(i, a, m).is_some_and(|(base, _)| {
                    base.saturating_add(want.saturating_mul(d.kv_per_token)) <= d.budget
                })
            }
        };
        let ahead = tokens + seqs * self.cfg.horizon_tokens as u64;
        choose_switch(d.n_max, cur, holds(ahead), g)
            .or_else(|| choose_switch(d.n_max, cur, holds(tokens), g))
    }

    /// Decides what happens before a step of `batch` enters the pipeline (module docs).
    pub fn before_step(&mut self, batch: &[TokenPos]) -> Verdict {
        let mut after = self.held.clone();
        let mut new_seq = false;
        for t in batch {
            let e = after.entry(t.seq).or_insert_with(|| {
                new_seq = true;
                0
            });
            *e = (*e).max(t.pos as u64 + 1);
        }
        let tokens: u64 = after.values().sum();
        let seqs = after.len() as u64;
        let mut switches = Vec::new();
        let mut fits_all = true;
        let step = self.step;
        let now = self.started.elapsed().as_secs_f64();
        let mut rep = lock(&self.report);
        for i in 0..self.devs.len() {
            let d = &self.devs[i];
            if tokens.saturating_mul(d.kv_per_token) <= d.kv_budget {
                continue;
            }
            let threshold = d.threshold().unwrap_or(0);
            let to = self.choose(i, tokens, seqs);
            let from = counts_max(&d.plan_stages);
            match to.and_then(|to| self.price(i, to.0, to.1).map(|p| (to, p))) {
                Some((to, (base, stages))) if to != from => {
                    tracing::info!(
                        "device {}: KV of {tokens} tokens passes its threshold {threshold}; \
                         switching offloaded blocks per stage {from:?} -> {to:?}",
                        rep.devices[i].name
                    );
                    let d = &mut self.devs[i];
                    d.kv_budget = d.budget.saturating_sub(base);
                    d.plan_stages = stages;
                    d.spec.stages = stage_specs(&d.plan_stages);
                    switches.push((i, d.spec.stages.clone()));
                    let r = &mut rep.devices[i];
                    r.crossings.push(Crossing {
                        step,
                        tokens,
                        threshold,
                        time_s: now,
                    });
                    r.kv_budget = d.kv_budget;
                    r.threshold = d.threshold();
                    r.offloaded = to;
                    rep.samples.push((now, i, tokens * d.kv_per_token, base));
                    rep.events.push(AdaptEvent::Switch {
                        step,
                        device: i,
                        tokens,
                        from,
                        to,
                    });
                }
                _ => fits_all = false,
            }
        }
        if !fits_all && new_seq && !self.held.is_empty() {
            // Nothing frees enough: hold the new admission (the switches decided stay: they
            // only make room).
            rep.held_admissions += 1;
            tracing::warn!("a new sequence does not fit yet; held until one is released");
            return Verdict::Hold(switches);
        }
        if !fits_all {
            tracing::warn!(
                "the KV of {tokens} tokens outgrows a device that cannot offload more; the step \
                 will fail on it"
            );
        }
        self.held = after;
        self.step += 1;
        rep.tokens = tokens;
        rep.memory.resize(self.devs.len(), Vec::new());
        for (i, d) in self.devs.iter().enumerate() {
            let r = &mut rep.devices[i];
            r.kv_bytes = tokens.saturating_mul(d.kv_per_token);
            r.kv_peak_bytes = r.kv_peak_bytes.max(r.kv_bytes);
            let (weights, kv) = (d.budget.saturating_sub(d.kv_budget), r.kv_bytes);
            rep.memory[i].push(MemorySample {
                time_s: now,
                step,
                tokens,
                total: weights + kv,
                weights,
                kv_local: kv,
                kv_lent: 0,
                kv_borrowed: 0,
                kv_evicted: 0,
            });
        }
        Verdict::Go(switches)
    }

    /// Sequences released: their KV is gone everywhere.
    pub fn release(&mut self, seqs: &[u64]) {
        for s in seqs {
            self.held.remove(s);
        }
        let tokens = self.total();
        let mut rep = lock(&self.report);
        rep.tokens = tokens;
        for (i, d) in self.devs.iter().enumerate() {
            rep.devices[i].kv_bytes = tokens.saturating_mul(d.kv_per_token);
        }
    }

    /// A worker applied a switch and reports its accounting (the truth).
    pub fn on_switched(&mut self, device: usize, memory: DeviceMemory) {
        let Some(d) = self.devs.get_mut(device) else {
            return;
        };
        d.kv_budget = memory.kv_budget;
        let mut rep = lock(&self.report);
        if let Some(r) = rep.devices.get_mut(device) {
            r.switches_applied += 1;
            r.kv_budget = memory.kv_budget;
            r.threshold = d.threshold();
        }
    }
}

impl Dev {
    fn threshold(&self) -> Option<u64> {
        (self.kv_per_token > 0).then(|| self.kv_budget / self.kv_per_token)
    }
}

/// The worker's side: applies a switch to the loaded device, or says why not.
pub(crate) fn apply_switch(device: Option<&mut Device>, stages: Vec<StageSpec>) -> ToCoordinator {
    let r = match device {
        Some(d) => d.switch(stages),
        None => Err(crate::RuntimeError::Invalid("no device is loaded".into())),
    };
    match r {
        Ok(m) => {
            tracing::info!(
                "plan switch applied: resident {} B, slot {} B, KV room {} B",
                m.resident,
                m.slot,
                m.kv_budget
            );
            ToCoordinator::Switched { memory: m.into() }
        }
        Err(e) => ToCoordinator::Failed {
            step: None,
            message: format!("plan switch refused: {e}"),
        },
    }
}

/// The control frame of a switch to `stages`, ready for a device's writer.
pub(crate) fn switch_payload(stages: Vec<StageSpec>) -> Option<Vec<u8>> {
    crate::wire::control_payload(&ToWorker::Switch { stages }).ok()
}
