//! One device's share of the model: its stages, run in round-robin order, with resident
//! blocks in memory and offloaded blocks streamed through the loader's slot.
//!
//! Within a stage the offloaded blocks are waited for just before the first of them runs,
//! and the slot is released right after the last of them ran; the loader then immediately
//! starts on the next stage's offloaded blocks (the "ready signal" of the design), so the
//! load overlaps everything this device computes in between and whatever the other devices
//! compute meanwhile.
//!
//! A plan switch ([`Device::switch`], design §6) changes which blocks of the stages are
//! resident and which offloaded, between two steps: the same layers in the same stages,
//! the KV cache kept as it is. Invariant: resident blocks + slot + working buffers + the KV
//! held never exceed the budget, before, during (the old blocks are freed before the new
//! ones are read) and after a switch; one that would is refused and changes nothing.

use std::path::{Path, PathBuf};
use std::time::Instant;

use loip_engine::forward::{param_dtype_of, Transformer};
use loip_engine::weights::{bind_embedding, AttnWeights, HeadWeights, MlpWeights};
use loip_engine::{KvCache, TokenPos};
use loip_model::slice::{Manifest, SliceEntry, SliceKind};
use serde::{Deserialize, Serialize};

use crate::loader::{Loader, LoaderKind};
use crate::resident::Resident;
use crate::RuntimeError;

mod shed;
pub use shed::{PressureGuard, ShedDone};

/// Where a block lives during the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockPlacement {
    /// kept in memory for the whole run
    Resident,
    /// read from the SSD into the slot each time its stage runs
    Offloaded,
}

/// One layer of a stage and where its two blocks live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageLayer {
    /// global layer index
    pub layer: usize,
    /// attention block
    pub attn: BlockPlacement,
    /// MLP block
    pub mlp: BlockPlacement,
}

/// One pipeline stage: contiguous layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageSpec {
    /// layers in order
    pub layers: Vec<StageLayer>,
}

impl StageSpec {
    fn offloaded(&self) -> Vec<SliceKind> {
        let mut v = Vec::new();
        for l in &self.layers {
            if l.attn == BlockPlacement::Offloaded {
                v.push(SliceKind::Attn(l.layer));
            }
            if l.mlp == BlockPlacement::Offloaded {
                v.push(SliceKind::Mlp(l.layer));
            }
        }
        v
    }
}

/// What one device runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// its stages, in execution order
    pub stages: Vec<StageSpec>,
    /// holds the embedding (first device)
    pub embed: bool,
    /// holds the final norm and LM head (last device)
    pub head: bool,
    /// loading path for offloaded blocks
    pub loader: LoaderKind,
    /// start loading the next stage's blocks as soon as the slot is free (false: load on
    /// demand, the conventional pipeline+offloading baseline)
    pub overlap: bool,
    /// memory budget, bytes (None: unlimited)
    pub mem_budget: Option<u64>,
    /// most tokens in one step (sizes the working buffers)
    pub max_step_tokens: usize,
    /// most sequences in one step (sizes the logits buffer)
    pub max_step_seqs: usize,
    /// longest context of one sequence, tokens (sizes the attention scratch)
    pub context: usize,
}

/// How the device's budget is spent, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryReport {
    /// the budget (0: unlimited)
    pub budget: u64,
    /// resident blocks (incl. embedding / head)
    pub resident: u64,
    /// the slot (largest stage's offloaded blocks)
    pub slot: u64,
    /// activations, logits and scratch at the largest step
    pub working: u64,
    /// what is left for the KV cache
    pub kv_budget: u64,
}

/// Time spent by the device, seconds, since the last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimes {
    /// computing blocks
    pub compute_s: f64,
    /// waiting for the loader
    pub stall_s: f64,
    /// bytes loaded
    pub loaded_bytes: u64,
    /// seconds the loader spent reading
    pub load_s: f64,
}

/// A device ready to run its stages.
pub struct Device {
    /// dims and RoPE
    pub tf: Transformer,
    resident: Resident,
    loader: Option<Loader>,
    groups: Vec<Vec<(Vec<SliceKind>, usize)>>, // per stage: (offloaded blocks, loader group)
    /// the KV cache of every layer this device holds
    pub kv: KvCache,
    spec: DeviceSpec,
    mem: MemoryReport,
    times: StepTimes,
    dir: PathBuf,
    manifest: Manifest,
    last_stage: Option<usize>, // the stage that ran last (where the next prefetch follows)
    /// with `LOIP_HOP_TRACE` only: the pool calls' and loader starts' times since the last
    /// [`Device::take_trace`]
    trace: crate::hop_trace::Inside,
}

/// What a device's stages read where: resident slices, loader groups and their bytes.
struct Layout {
    resident: Vec<SliceEntry>,
    groups: Vec<Vec<(Vec<SliceKind>, usize)>>, // per stage: (offloaded blocks, loader group)
    group_slices: Vec<Vec<SliceEntry>>,
    resident_need: u64, // bytes
    slot_need: u64,     // bytes
}

/// The layout of `spec`'s stages over the slices of `manifest`.
fn layout(manifest: &Manifest, spec: &DeviceSpec) -> Result<Layout, RuntimeError> {
    let cfg = &manifest.config;
    let get = |k: SliceKind| -> Result<SliceEntry, RuntimeError> {
        manifest.slice(k).cloned().ok_or_else(|| {
            RuntimeError::Invalid(format!("slice {} is not in the manifest", k.id()))
        })
    };
    let mut resident = Vec::new();
    let mut groups = Vec::new();
    let mut group_slices: Vec<Vec<SliceEntry>> = Vec::new();
    for stage in &spec.stages {
        for l in &stage.layers {
            if l.layer >= cfg.num_layers {
                return Err(RuntimeError::Invalid(format!(
                    "layer {} of a {}-layer model",
                    l.layer, cfg.num_layers
                )));
            }
            if l.attn == BlockPlacement::Resident {
                resident.push(get(SliceKind::Attn(l.layer))?);
            }
            if l.mlp == BlockPlacement::Resident {
                resident.push(get(SliceKind::Mlp(l.layer))?);
            }
        }
        // Overlapped: one group per stage (the slot holds the stage's offloaded blocks).
        // On demand: one group per block (a one-block buffer, loaded when needed).
        let mut stage_groups = Vec::new();
        let off = stage.offloaded();
        if spec.overlap && !off.is_empty() {
            stage_groups.push((off.clone(), group_slices.len()));
            group_slices.push(off.into_iter().map(get).collect::<Result<_, _>>()?);
        } else {
            for kind in off {
                stage_groups.push((vec![kind], group_slices.len()));
                group_slices.push(vec![get(kind)?]);
            }
        }
        groups.push(stage_groups);
    }
    // A tied head computes with the embedding matrix.
    if spec.embed || (spec.head && cfg.tie_word_embeddings) {
        resident.push(get(SliceKind::Embed)?);
    }
    if spec.head {
        resident.push(get(SliceKind::Head)?);
    }
    let slot_need: u64 = group_slices
        .iter()
        .map(|g| g.iter().map(|s| s.size).sum::<u64>())
        .max()
        .unwrap_or(0);
    let resident_need: u64 = resident.iter().map(|s| s.size).sum();
    Ok(Layout {
        resident,
        groups,
        group_slices,
        resident_need,
        slot_need,
    })
}

/// Resident and slot bytes `spec` needs on `manifest`'s slices: what [`Device::open`] and
/// [`Device::switch`] account (the coordinator prices switches with it).  // bytes
pub fn layout_bytes(manifest: &Manifest, spec: &DeviceSpec) -> Result<(u64, u64), RuntimeError> {
    let l = layout(manifest, spec)?;
    Ok((l.resident_need, l.slot_need))
}

/// The first loader group of the first stage after `k` (wrapping) that has one.
fn next_group(groups: &[Vec<(Vec<SliceKind>, usize)>], k: usize) -> Option<usize> {
    let s = groups.len();
    (1..=s)
        .map(|d| (k + d) % s)
        .find_map(|j| groups[j].first().map(|(_, g)| *g))
}

/// The transformer of a split model: its config, q/k layout, and the RoPE rounding of its
/// float dtype (read from the embedding's stored type).
pub(crate) fn transformer_of(m: &Manifest) -> Result<Transformer, RuntimeError> {
    let t = m
        .slice(SliceKind::Embed)
        .and_then(|s| {
            s.tensors
                .iter()
                .find(|t| t.name == loip_model::names::EMBED_TOKENS)
        })
        .ok_or_else(|| RuntimeError::Invalid("the manifest has no embedding".into()))?;
    Ok(Transformer::new(
        m.config.clone(),
        m.qk_permuted,
        param_dtype_of(t.dtype()?),
    ))
}

/// Working-buffer bytes of one step of `tokens` tokens and `seqs` sequences over at most
/// `context` positions: the planner's own formula ([`loip_plan::ModelShape::step_working_bytes`]),
/// so what a plan reserves and what the device accounts cannot drift apart.
pub fn working_bytes(m: &Manifest, tokens: usize, seqs: usize, context: usize) -> u64 {
    crate::shape::shape_from_config("", &m.config, 2.0).step_working_bytes(
        tokens as u64,
        seqs as u64,
        context as u64,
    )
}

impl Device {
    /// Opens the device's slices from `dir`: reads resident blocks, sizes the slot, checks the
    /// budget, and (with overlap) starts loading the first stage's offloaded blocks.
    pub fn open(dir: &Path, manifest: &Manifest, spec: DeviceSpec) -> Result<Device, RuntimeError> {
        let cfg = &manifest.config;
        let Layout {
            resident: resident_slices,
            groups,
            group_slices,
            resident_need,
            slot_need,
        } = layout(manifest, &spec)?;
        let layers: Vec<usize> = spec
            .stages
            .iter()
            .flat_map(|s| s.layers.iter().map(|l| l.layer))
            .collect();
        let working = working_bytes(
            manifest,
            spec.max_step_tokens,
            spec.max_step_seqs,
            spec.context,
        );
        let fixed = resident_need + slot_need + working;
        let kv_budget = match spec.mem_budget {
            Some(b) if fixed > b => {
                return Err(RuntimeError::OverBudget {
                    budget: b,
                    detail: format!(
                        "resident blocks need {resident_need}, the slot {slot_need}, working buffers {working} \
                         (total {fixed}); nothing would be left for the KV cache"
                    ),
                })
            }
            Some(b) => b - fixed,
            None => u64::MAX,
        };
        let resident = Resident::load(dir, &resident_slices)?;
        let loader = if group_slices.is_empty() {
            None
        } else {
            Some(Loader::new(spec.loader, dir, &group_slices)?)
        };
        let kv_dim = cfg.num_kv_heads * cfg.head_dim;
        let kv = KvCache::new(layers, kv_dim, spec.mem_budget.map(|_| kv_budget))
            .with_windows(|l| cfg.layer_window(l));
        let mem = MemoryReport {
            budget: spec.mem_budget.unwrap_or(0),
            resident: resident_need,
            slot: slot_need,
            working,
            kv_budget,
        };
        let mut dev = Device {
            tf: transformer_of(manifest)?,
            resident,
            loader,
            groups,
            kv,
            spec,
            mem,
            times: StepTimes::default(),
            dir: dir.to_path_buf(),
            manifest: manifest.clone(),
            last_stage: None,
            trace: Default::default(),
        };
        if dev.spec.overlap {
            if let Some(g) = dev.next_group(dev.spec.stages.len().saturating_sub(1)) {
                if let Some(l) = dev.loader.as_mut() {
                    l.start(g)?;
                }
            }
        }
        Ok(dev)
    }

    /// Switches the placement of the stages' blocks to `stages` (the same layers in the
    /// same stages; only resident/offloaded changes), between steps: frees the old resident
    /// blocks and the slot, reads the new resident set from the slice store, sizes the new
    /// slot and gives the KV cache what is left. Refused, changing nothing, when the new
    /// layout with the KV held would not fit the budget. On a read error afterwards the
    /// device is left without blocks (its next step fails with a typed error).
    pub fn switch(&mut self, stages: Vec<StageSpec>) -> Result<MemoryReport, RuntimeError> {
        let same = stages.len() == self.spec.stages.len()
            && stages.iter().zip(&self.spec.stages).all(|(a, b)| {
                a.layers.len() == b.layers.len()
                    && a.layers
                        .iter()
                        .zip(&b.layers)
                        .all(|(x, y)| x.layer == y.layer)
            });
        if !same {
            return Err(RuntimeError::Invalid(
                "a plan switch must keep the device's stages and layers".into(),
            ));
        }
        let spec = DeviceSpec {
            stages,
            ..self.spec.clone()
        };
        let l = layout(&self.manifest, &spec)?;
        let fixed = l.resident_need + l.slot_need + self.mem.working;
        let kv_budget = match spec.mem_budget {
            Some(b) if fixed.saturating_add(self.kv.used_bytes()) > b => {
                return Err(RuntimeError::OverBudget {
                    budget: b,
                    detail: format!(
                        "the switch needs {} for resident blocks, {} for the slot, {} for working \
                         buffers and {} for the KV cache held",
                        l.resident_need,
                        l.slot_need,
                        self.mem.working,
                        self.kv.used_bytes()
                    ),
                })
            }
            Some(b) => b - fixed,
            None => u64::MAX,
        };
        // Free first, then read: the budget holds during the switch too.
        self.loader = None;
        let held = std::mem::take(&mut self.resident);
        self.groups = l.groups;
        self.spec = spec;
        self.mem.resident = l.resident_need;
        self.mem.slot = l.slot_need;
        self.mem.kv_budget = kv_budget;
        self.kv.set_budget(self.spec.mem_budget.map(|_| kv_budget));
        // blocks that stay resident are kept, not read again (a switch took 30-100 ms of
        // reads before); those that leave are freed first
        self.resident = held.reload(&self.dir, &l.resident)?;
        if !l.group_slices.is_empty() {
            self.loader = Some(Loader::new(self.spec.loader, &self.dir, &l.group_slices)?);
        }
        if self.spec.overlap {
            let after = self
                .last_stage
                .unwrap_or(self.spec.stages.len().saturating_sub(1));
            if let (Some(g), Some(ld)) = (next_group(&self.groups, after), self.loader.as_mut()) {
                ld.start(g)?;
            }
        }
        Ok(self.mem)
    }

    /// How the memory budget is spent.
    pub fn memory(&self) -> MemoryReport {
        self.mem
    }

    /// Time spent since the last call, then resets.
    pub fn take_times(&mut self) -> StepTimes {
        let mut t = std::mem::take(&mut self.times);
        if let Some(l) = self.loader.as_mut() {
            t.stall_s = std::mem::take(&mut l.stall_s);
            t.load_s = std::mem::take(&mut l.busy_s);
            t.loaded_bytes = std::mem::take(&mut l.loaded_bytes);
        }
        t
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.spec.stages.len()
    }

    /// The first loader group of the first stage after `k` (wrapping) that has one.
    fn next_group(&self, k: usize) -> Option<usize> {
        next_group(&self.groups, k)
    }

    /// What this device was opened for.
    pub fn spec(&self) -> &DeviceSpec {
        &self.spec
    }

    /// Embeds `ids` into `(ids.len(), hidden)`.
    pub fn embed(&mut self, ids: &[u32]) -> Result<Vec<f32>, RuntimeError> {
        let t = Instant::now();
        let w = bind_embedding(&self.resident, &self.tf.cfg)?;
        let mut x = vec![0f32; ids.len() * self.tf.cfg.hidden_size];
        self.tf.embed(&w, ids, &mut x)?;
        self.times.compute_s += t.elapsed().as_secs_f64();
        Ok(x)
    }

    /// Checks that the KV cache can take `tokens` more tokens on every held layer.
    pub fn reserve(&self, tokens: usize) -> Result<(), RuntimeError> {
        Ok(self.kv.reserve(tokens)?)
    }

    /// Runs stage `k` on `x: (batch.len(), hidden)` in place, then releases the slot and (when
    /// overlapping) starts loading the next stage's offloaded blocks.
    pub fn run_stage(
        &mut self,
        k: usize,
        x: &mut [f32],
        batch: &[TokenPos],
    ) -> Result<(), RuntimeError> {
        self.run_stage_with(k, x, batch, true)
    }

    /// Runs stage `k` and keeps its offloaded blocks in the slot, for another micro-batch that
    /// passes the same stage next (bursty traffic: loads are amortised over the sequences).
    pub fn run_stage_keep(
        &mut self,
        k: usize,
        x: &mut [f32],
        batch: &[TokenPos],
    ) -> Result<(), RuntimeError> {
        self.run_stage_with(k, x, batch, false)
    }

    fn run_stage_with(
        &mut self,
        k: usize,
        x: &mut [f32],
        batch: &[TokenPos],
        release: bool,
    ) -> Result<(), RuntimeError> {
        self.last_stage = Some(k);
        // the whole stage on the compute pool: one hand-off, not one per matmul
        if !crate::hop_trace::on() {
            return loip_kernels::on_pool(|| self.run_stage_on_pool(k, x, batch, release));
        }
        let (r, call_s, in_s) =
            crate::hop_trace::timed_on_pool(|| self.run_stage_on_pool(k, x, batch, release));
        self.trace.add_pool(call_s, in_s);
        self.trace.stages += 1;
        r
    }

    /// With `LOIP_HOP_TRACE`: the device's times inside the hop since the last call (its
    /// compute and stall are [`Device::take_times`]'s, filled in by the caller), then resets.
    pub fn take_trace(&mut self) -> crate::hop_trace::Inside {
        std::mem::take(&mut self.trace)
    }

    fn run_stage_on_pool(
        &mut self,
        k: usize,
        x: &mut [f32],
        batch: &[TokenPos],
        release: bool,
    ) -> Result<(), RuntimeError> {
        let Device {
            tf,
            resident,
            loader,
            groups,
            kv,
            spec,
            times,
            trace,
            ..
        } = self;
        let stage = spec
            .stages
            .get(k)
            .ok_or_else(|| RuntimeError::Invalid(format!("no stage {k} on this device")))?;
        let cfg = &tf.cfg;
        // The loader group of each offloaded block, and the last block of each group.
        let group_of = |kind: SliceKind| {
            groups[k]
                .iter()
                .find(|(ks, _)| ks.contains(&kind))
                .map(|(_, g)| *g)
        };
        let last_of = |g: usize| {
            groups[k]
                .iter()
                .find(|(_, gg)| *gg == g)
                .and_then(|(ks, _)| ks.last().copied())
        };
        let mut view: Option<(usize, crate::loader::GroupView<'_>)> = None;
        for l in &stage.layers {
            for (kind, placement) in [
                (SliceKind::Attn(l.layer), l.attn),
                (SliceKind::Mlp(l.layer), l.mlp),
            ] {
                let offloaded = placement == BlockPlacement::Offloaded;
                if offloaded && view.as_ref().map(|v| v.0) != group_of(kind) {
                    let (Some(ld), Some(g)) = (loader.as_mut(), group_of(kind)) else {
                        return Err(RuntimeError::Invalid(format!(
                            "offloaded block {} without a loader",
                            kind.id()
                        )));
                    };
                    view = Some((g, ld.wait(g)?));
                }
                let t = Instant::now();
                match (kind, offloaded.then_some(()).and(view.as_ref())) {
                    (SliceKind::Attn(_), Some((_, v))) => {
                        tf.attention(l.layer, &AttnWeights::bind(v, cfg, l.layer)?, x, batch, kv)?
                    }
                    (SliceKind::Attn(_), None) => tf.attention(
                        l.layer,
                        &AttnWeights::bind(resident, cfg, l.layer)?,
                        x,
                        batch,
                        kv,
                    )?,
                    (_, Some((_, v))) => tf.mlp(&MlpWeights::bind(v, cfg, l.layer)?, x)?,
                    (_, None) => tf.mlp(&MlpWeights::bind(resident, cfg, l.layer)?, x)?,
                }
                times.compute_s += t.elapsed().as_secs_f64();
                let Some(g) = view.as_ref().map(|v| v.0) else {
                    continue;
                };
                if offloaded && last_of(g) == Some(kind) {
                    view = None;
                    if let Some(ld) = loader.as_mut() {
                        let last_group_of_stage = groups[k].last().map(|(_, gg)| *gg) == Some(g);
                        if spec.overlap && release && last_group_of_stage {
                            if let Some(next) = next_group(groups, k) {
                                if crate::hop_trace::on() {
                                    let t = Instant::now();
                                    ld.start(next)?;
                                    trace.start_s += t.elapsed().as_secs_f64();
                                } else {
                                    ld.start(next)?;
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Final norm and LM head on selected rows of `x`: `(rows.len(), vocab)`.
    pub fn head(&mut self, x: &[f32], rows: &[usize]) -> Result<Vec<f32>, RuntimeError> {
        if rows.is_empty() {
            // a micro-batch of prompt chunks only: no row needs a token yet
            return Ok(Vec::new());
        }
        let t = Instant::now();
        let h = self.tf.cfg.hidden_size;
        let mut sel = Vec::with_capacity(rows.len() * h);
        for &r in rows {
            sel.extend_from_slice(
                x.get(r * h..(r + 1) * h)
                    .ok_or_else(|| RuntimeError::Invalid(format!("no hidden row {r}")))?,
            );
        }
        let w = HeadWeights::bind(&self.resident, &self.tf.cfg)?;
        let mut out = vec![0f32; rows.len() * self.tf.cfg.vocab_size];
        if crate::hop_trace::on() {
            let (r, call_s, in_s) =
                crate::hop_trace::timed_on_pool(|| self.tf.head(&w, &sel, &mut out));
            r?;
            self.trace.add_pool(call_s, in_s);
        } else {
            loip_kernels::on_pool(|| self.tf.head(&w, &sel, &mut out))?;
        }
        self.times.compute_s += t.elapsed().as_secs_f64();
        Ok(out)
    }
}
