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
//! that, of this step), unless evicting other sequences costs less than the switch adds
//! until its next threshold (`adapt/switch_or_evict.rs`, the simulator's rule). The switch
//! travels as a [`ToWorker::Switch`] on the device's
//! connection ahead of the step, so the worker applies it between two steps
//! ([`crate::executor::Device::switch`]), re-accounting resident set + slot + KV within its
//! budget; the worker answers [`ToCoordinator::Switched`] with its own accounting.
//!
//! Last resort: a step that starts a sequence (a new admission) whose KV no layout can hold
//! next to what other sequences hold is held back ([`Verdict::Hold`]) until sequences are
//! released; an admitted sequence's steps are never held for long: with steps in flight
//! they wait for them (one may finish), with none the newest-admitted other sequences are
//! evicted and recomputed when they run again (`adapt/evict.rs`, lossless). A micro-batch
//! whose own sequences no layout holds together is split ([`Verdict::Split`],
//! `adapt/split.rs`): its sequences run as sub-steps one group after another, each evicting
//! the others' KV if it must. Only a sequence that alone outgrows every layout fails, on the
//! device, with a typed KV-budget error; the budget is never exceeded.

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
    choose_switch, counts_max, lend_shrink, stage_layout, AdaptConfig, AdaptEvent, MemorySample,
};
use loip_plan::{cost, DeviceProfile, ModelShape, Plan, Residency, StagePlan};

use crate::executor::{layout_bytes, BlockPlacement, DeviceSpec, StageLayer, StageSpec};
use crate::wire::DeviceMemory;

mod evict;
mod lending;
mod report;
mod split;
mod switch_or_evict;
mod worker_side;

pub use report::{AdaptReport, Crossing, DeviceAdapt};
pub(crate) use worker_side::{apply_switch, switch_payload};

/// What the coordinator sends before a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// a plan switch: the device and its new stages (answered)
    Switch(usize, Vec<StageSpec>),
    /// ask `peer` to reserve `bytes` for `lender`'s KV (answered); once reserved, `lender`
    /// lends `tokens` per stage
    Borrow {
        /// the borrowing device
        peer: usize,
        /// the lending device
        lender: usize,
        /// bytes to reserve  // bytes
        bytes: u64,
        /// rows per stage to lend then  // tokens
        tokens: u64,
    },
    /// `device` lends `tokens` per stage from now (a shrink: no reservation needed)
    Lend {
        /// the lending device
        device: usize,
        /// rows per stage  // tokens
        tokens: u64,
    },
    /// the last resort: release these sequences' KV on every device (the coordinator keeps
    /// their ids and recomputes them when they run again)
    Evict(Vec<u64>),
    /// steps to run right before the step (re-prefilling evicted sequences, no output
    /// rows): (positions, ids) each
    Recompute(Vec<(Vec<TokenPos>, Vec<u32>)>),
}

impl Action {
    /// Whether the device answers it (the step waits for the answer).
    pub fn answered(&self) -> bool {
        matches!(self, Action::Switch(..) | Action::Borrow { .. })
    }
}

/// What to do with a step.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// send it, after these actions
    Go(Vec<Action>),
    /// hold it back until sequences are released or steps finish, after these actions
    /// (they only make room)
    Hold(Vec<Action>),
    /// the step's own sequences' KV fits no device together: run it as sub-steps of these
    /// sequences, one group after another, each decided on its own (module `split`)
    Split(Vec<Vec<u64>>),
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
    /// attention + MLP of one layer per token when re-prefilling (chunks of the step limit)
    recompute_s: f64, // seconds
    loader: loip_plan::LoaderProfile,
    /// before the switch sent last and not yet answered: (plan stages, KV room)
    prev: Option<(Vec<StagePlan>, u64)>,
    /// layouts this device refused since its memory last changed: (attention, MLP) counts
    refused: Vec<(u32, u32)>,
    stages: usize, // stages on the device
    layers: u64,   // layers on the device
    /// lending: (peer, rows per stage), and what it was before an unanswered reservation
    lend: Option<(usize, u64)>,
    lend_prev: Option<Option<(usize, u64)>>,
    /// the peer it lends to, once chosen (its lent rows are there)
    peer: Option<usize>,
    /// a peer refused to hold its KV since its memory last changed
    lend_refused: bool,
    /// reserved on its peer for its lent KV  // bytes
    lend_bytes: u64,
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
    /// before the last step admitted: (KV held per sequence, decision step)
    undo: Option<(BTreeMap<u64, u64>, u32)>,
    /// KV lending allowed
    lending: bool,
    /// no switches and no lending: only eviction + recomputation
    evict_only: bool,
    per_layer: u64, // KV bytes per token per layer
    act_bytes: u64, // hidden-row bytes per token
    /// last measured lent-KV transfer rate  // bytes/s
    bandwidth: Option<f64>,
    /// time between the last two steps entering  // seconds
    round_s: Option<f64>,
    last_entry: Option<Instant>,
    /// eviction and recomputation (the last resort)
    recomp: evict::Recompute,
    /// sequences of micro-batches split so far: admitted, never held as new admissions
    split: std::collections::BTreeSet<u64>,
    /// this step evicts rather than switch (cheaper over the rest of the run)
    evict_first: bool,
    /// sequences are evicted because that was cheaper than a switch
    chose_eviction: bool,
    /// KV tokens expected at the end, over all sequences (the plan's context)  // tokens
    context: u64,
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
                recompute_s: {
                    let c = spec.max_step_tokens.clamp(1, u32::MAX as usize) as u32;
                    (prof.attn_time(shape, c, n) + prof.mlp_time(shape, c)) / c as f64
                },
                loader: *prof.loader(plan.loader),
                prev: None,
                refused: Vec::new(),
                stages: d.stages.len(),
                layers: d.layer_count() as u64,
                lend: None,
                lend_prev: None,
                peer: None,
                lend_refused: false,
                lend_bytes: 0,
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
                    switches_refused: 0,
                    lent_to: None,
                    lent_tokens: 0,
                    lent_bytes: 0,
                    borrowed_bytes: 0,
                    fetches: 0,
                    kv_moved_bytes: 0,
                    evicted_bytes: 0,
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
            undo: None,
            lending: false,
            evict_only: false,
            per_layer,
            act_bytes: c.hidden_size as u64 * 4,
            bandwidth: None,
            round_s: None,
            last_entry: None,
            recomp: Default::default(),
            split: Default::default(),
            evict_first: false,
            chose_eviction: false,
            context: plan.context,
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

    /// Counts steps (and times the report) from the next one: the session's warm-up steps
    /// (`cluster_run::setup`) are not a request's, so its events number the request's
    /// steps as a run without a warm-up would. The per-step memory and the peaks start over.
    pub fn restart_count(&mut self) {
        self.step = 0;
        self.undo = None;
        self.started = Instant::now();
        self.round_s = None;
        self.last_entry = None;
        let mut rep = lock(&self.report);
        rep.memory.clear();
        rep.tokens = 0;
        for d in &mut rep.devices {
            d.kv_peak_bytes = 0;
        }
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

    /// `g = ld + span` of device `i` with `a`/`m` offloaded blocks per stage: what one
    /// stage's step grows with (the least-added-load choice of a switch).  // seconds
    fn g(&self, i: usize, a: u32, m: u32) -> f64 {
        let d = &self.devs[i];
        let (a, m) = (a.min(d.n_max), m.min(d.n_max));
        let bytes = a as u64 * self.shape.attn_bytes + m as u64 * self.shape.mlp_bytes;
        d.loader.load_time(bytes, a + m) + cost::span(a, m, d.attn_s, d.mlp_s)
    }

    /// The threshold switch of device `i` for `tokens` held (see the module docs); none
    /// when this step evicts instead (cheaper, `adapt/switch_or_evict.rs`).
    fn choose(&self, i: usize, tokens: u64, seqs: u64) -> Option<(u32, u32)> {
        if self.evict_first {
            return None;
        }
        self.choose_switch(i, tokens, seqs)
    }

    /// [`Adapter::choose`] whatever eviction would cost.
    fn choose_switch(&self, i: usize, tokens: u64, seqs: u64) -> Option<(u32, u32)> {
        if self.evict_only {
            return None;
        }
        let d = &self.devs[i];
        let cur = counts_max(&d.plan_stages);
        let g = |a: u32, m: u32| self.g(i, a, m);
        let holds = |want: u64| {
            move |a: u32, m: u32| {
                !d.refused.contains(&(a, m))
                    && self.price(i, a, m).is_some_and(|(base, _)| {
                        base.saturating_add(want.saturating_mul(d.kv_per_token)) <= d.budget
                    })
            }
        };
        let ahead = tokens + seqs * self.cfg.horizon_tokens as u64;
        choose_switch(d.n_max, cur, holds(ahead), g)
            .or_else(|| choose_switch(d.n_max, cur, holds(tokens), g))
    }

    /// Sets the knobs (the session's; defaults otherwise).
    pub fn set_config(&mut self, cfg: AdaptConfig) {
        self.cfg = cfg;
    }

    /// Allows KV lending (design §6; off by default).
    pub fn set_lending(&mut self, on: bool) {
        self.lending = on;
    }

    /// Eviction + recomputation only (`--evict-only`): no plan switch and no lending, ever;
    /// a device near its budget evicts other sequences (design: the last resort alone).
    pub fn set_evict_only(&mut self, on: bool) {
        self.evict_only = on;
    }

    /// Decides what happens before a step of `batch` enters the pipeline (module docs);
    /// `others_in_flight`: other steps are in the pipeline (an admitted sequence's step that
    /// nothing makes room for waits for them rather than fail).
    pub fn before_step(&mut self, batch: &[TokenPos], others_in_flight: bool) -> Verdict {
        let mut after = self.held.clone();
        let mut new_seq = false;
        for t in batch {
            // a sequence of a split micro-batch was admitted: its evicted KV is no new
            // admission
            let split = self.split.contains(&t.seq);
            let e = after.entry(t.seq).or_insert_with(|| {
                new_seq |= !split;
                0
            });
            *e = (*e).max(t.pos as u64 + 1);
        }
        self.evict_first = false;
        if let Some(groups) = self.split_for(batch, &after) {
            return Verdict::Split(groups);
        }
        // Evicting other sequences may cost less than the switch this step needs; and a
        // sequence evicted for that comes back without the switch (held until room).
        if self.recomp.evicted_tokens() == 0 {
            self.chose_eviction = false;
        }
        self.evict_first = if new_seq {
            self.chose_eviction && batch.iter().any(|t| self.recomp.is_evicted(t.seq))
        } else {
            self.eviction_cheaper(batch, &after)
        };
        // The last resort: an admitted sequence no layout holds next to the others, and no
        // step in flight that could finish and make room: evict others (module evict).
        let evicted = if !new_seq && !others_in_flight {
            self.evict_for(batch, &mut after)
        } else {
            Vec::new()
        };
        let tokens: u64 = after.values().sum();
        let seqs = after.len() as u64;
        let mut switches = Vec::new();
        if !evicted.is_empty() {
            switches.push(Action::Evict(evicted));
        }
        let mut fits_all = true;
        let step = self.step;
        let now = self.started.elapsed().as_secs_f64();
        let report = self.report.clone();
        let mut rep = lock(&report);
        let now_i = Instant::now();
        if let Some(t) = self.last_entry.replace(now_i) {
            self.round_s = Some(now_i.duration_since(t).as_secs_f64());
        }
        let n_ts = self.cfg.min_change_tokens as u64;
        let ahead = tokens + seqs * self.cfg.horizon_tokens as u64;
        for i in 0..self.devs.len() {
            // Lending: shrink at once what the measured link no longer carries; grow it
            // (a little before the threshold: it frees memory from the next stage run on)
            // when the device is near its room.
            if let Some((p, cur)) = self.devs[i].lend {
                if self.devs[i].lend_prev.is_none() {
                    // never below what the KV held now needs (the link's pace is a speed
                    // matter; failing the step is not)
                    let need = self.lend_needed(i, tokens);
                    let cap = self
                        .link_cap(i, seqs)
                        .max(need)
                        .min(tokens.saturating_sub(seqs));
                    if let Some(to) = lend_shrink(cur, cap, n_ts) {
                        self.set_lend(i, Some((p, to)), seqs);
                        tracing::info!(
                            "lending of device {i} shrinks {cur} -> {to} tokens per stage"
                        );
                        rep.events.push(AdaptEvent::Lend {
                            step,
                            device: i,
                            peer: p,
                            tokens: to,
                        });
                        let r = &mut rep.devices[i];
                        r.lent_tokens = to;
                        r.lent_bytes = to * self.devs[i].saving_pt(self.per_layer);
                        switches.push(Action::Lend {
                            device: i,
                            tokens: to,
                        });
                    }
                }
            }
            let soon = tokens + 2 * seqs;
            if soon.saturating_mul(self.devs[i].kv_per_token) > self.room(i) {
                let lend = self.try_lend(i, soon, ahead, tokens, seqs);
                if let Some(a) = lend {
                    if let Action::Borrow {
                        peer, tokens: to, ..
                    } = a
                    {
                        rep.events.push(AdaptEvent::Lend {
                            step,
                            device: i,
                            peer,
                            tokens: to,
                        });
                    }
                    switches.push(a);
                }
            }
            let d = &self.devs[i];
            if tokens.saturating_mul(d.kv_per_token) <= self.room(i) {
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
                    d.prev = Some((d.plan_stages.clone(), d.kv_budget));
                    d.kv_budget = d.budget.saturating_sub(base);
                    d.plan_stages = stages;
                    d.spec.stages = stage_specs(&d.plan_stages);
                    switches.push(Action::Switch(i, d.spec.stages.clone()));
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
        if !fits_all && !new_seq && others_in_flight {
            // An admitted sequence: wait for the steps in flight (a sequence may finish and
            // be released) rather than fail.
            rep.held_steps += 1;
            tracing::warn!(
                "the KV of {tokens} tokens does not fit yet; the step waits for the steps in \
                 flight"
            );
            return Verdict::Hold(switches);
        }
        if !fits_all {
            tracing::warn!(
                "the KV of {tokens} tokens outgrows a device that cannot offload more; the step \
                 will fail on it"
            );
        }
        self.undo = Some((std::mem::replace(&mut self.held, after), self.step));
        self.step += 1;
        rep.tokens = tokens;
        rep.memory.resize(self.devs.len(), Vec::new());
        let evicted_tokens = self.recomp.evicted_tokens();
        for (i, d) in self.devs.iter().enumerate() {
            let r = &mut rep.devices[i];
            r.kv_bytes = tokens.saturating_mul(d.kv_per_token);
            r.kv_peak_bytes = r.kv_peak_bytes.max(r.kv_bytes);
            let weights = d.budget.saturating_sub(d.kv_budget);
            let (lent, borrowed) = (r.lent_bytes, r.borrowed_bytes);
            let kv = r.kv_bytes.saturating_sub(lent);
            rep.memory[i].push(MemorySample {
                time_s: now,
                step,
                tokens,
                total: weights + kv + borrowed,
                weights,
                kv_local: kv,
                kv_lent: lent,
                kv_borrowed: borrowed,
                kv_evicted: evicted_tokens.saturating_mul(d.kv_per_token),
            });
        }
        drop(rep);
        switches.extend(self.recompute_for(batch));
        Verdict::Go(switches)
    }

    /// Sequences released: their KV is gone everywhere (layouts refused before may fit
    /// now).
    pub fn release(&mut self, seqs: &[u64]) {
        for s in seqs {
            self.held.remove(s);
            self.split.remove(s);
        }
        if let Some(u) = self.undo.as_mut() {
            for s in seqs {
                u.0.remove(s);
            }
        }
        self.release_recompute(seqs);
        for d in &mut self.devs {
            d.refused.clear();
        }
        let tokens = self.total();
        let mut rep = lock(&self.report);
        rep.tokens = tokens;
        for (i, d) in self.devs.iter().enumerate() {
            rep.devices[i].kv_bytes = tokens.saturating_mul(d.kv_per_token);
        }
    }

    /// Forgets the last step admitted by [`Adapter::before_step`] (it did not enter: a
    /// switch it needed was refused), so that it is decided again.
    pub fn undo_step(&mut self) {
        if let Some((held, step)) = self.undo.take() {
            self.held = held;
            self.step = step;
            self.undo_recompute();
            // the step's memory samples go with it (it is decided again)
            for m in &mut lock(&self.report).memory {
                if m.last().is_some_and(|s| s.step == step) {
                    m.pop();
                }
            }
        }
    }

    /// A worker refused a switch: it keeps the layout it had (`memory`, its accounting);
    /// that layout is not chosen again until its memory changes.
    pub fn on_refused(&mut self, device: usize, memory: DeviceMemory, message: &str) {
        let Some(d) = self.devs.get_mut(device) else {
            return;
        };
        let refused = counts_max(&d.plan_stages);
        if let Some((stages, _)) = d.prev.take() {
            d.plan_stages = stages;
            d.spec.stages = stage_specs(&d.plan_stages);
        }
        d.refused.push(refused);
        d.kv_budget = memory.kv_budget;
        adopt_budget(d, &memory);
        let mut rep = lock(&self.report);
        if let Some(r) = rep.devices.get_mut(device) {
            tracing::warn!(
                "device {}: plan switch to {refused:?} refused ({message}); keeping {:?}",
                r.name,
                counts_max(&d.plan_stages)
            );
            r.switches_refused += 1;
            r.kv_budget = memory.kv_budget;
            r.threshold = d.threshold();
            r.offloaded = counts_max(&d.plan_stages);
        }
    }

    /// A worker applied a switch and reports its accounting (the truth).
    pub fn on_switched(&mut self, device: usize, memory: DeviceMemory) {
        let Some(d) = self.devs.get_mut(device) else {
            return;
        };
        d.prev = None;
        d.refused.clear();
        d.kv_budget = memory.kv_budget;
        adopt_budget(d, &memory);
        let mut rep = lock(&self.report);
        if let Some(r) = rep.devices.get_mut(device) {
            r.switches_applied += 1;
            r.kv_budget = memory.kv_budget;
            r.threshold = d.threshold();
        }
    }
}

/// A worker that shed memory under pressure (`executor::shed`) runs on a smaller budget than
/// it opened with; its answers carry it, and layouts are chosen within it from then on.
fn adopt_budget(d: &mut Dev, memory: &DeviceMemory) {
    if memory.budget > 0 && memory.budget < d.budget {
        d.budget = memory.budget;
    }
}

impl Dev {
    fn threshold(&self) -> Option<u64> {
        (self.kv_per_token > 0).then(|| self.kv_budget / self.kv_per_token)
    }

    /// Bytes lending frees per token lent per stage: every stage's rows but one stage's
    /// (the one fetched back to run).  // bytes
    fn saving_pt(&self, per_layer: u64) -> u64 {
        if self.stages < 2 {
            return 0;
        }
        self.layers.saturating_sub(self.n_max as u64) * per_layer
    }
}
