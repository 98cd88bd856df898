//! Shedding memory under pressure (design: survive pressure instead of dying): the device
//! offloads resident blocks, between steps, until it has freed what was asked, and its
//! budget shrinks by what it freed, so the room its KV cache has — what the coordinator's
//! thresholds count — does not change. Lossless: a block computes the same whether it is
//! resident or streamed into the slot.
//!
//! Which blocks: one at a time, the block whose offloading frees the most (a block's bytes,
//! less what the slot grows by when its stage becomes the one with the most offloaded
//! bytes); ties go to the later layer and to the MLP block first (the single-device rule).
//! A block that frees nothing may still be taken when it lets later ones free their bytes
//! (the first offloaded block of a device only sizes its slot).

use std::time::Instant;

use loip_model::slice::Manifest;
use loip_plan::units::format_bytes;

use super::{layout, BlockPlacement, Device, DeviceSpec, MemoryReport, StageSpec};
use crate::memory::pressure::{self, Sampler, Watch};
use crate::RuntimeError;

/// What a shed did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShedDone {
    /// bytes freed (resident and slot together)
    pub freed: u64,
    /// blocks newly offloaded
    pub blocks: usize,
    /// how the budget is spent now
    pub memory: MemoryReport,
}

/// Resident + slot bytes of `stages` on this device.  // bytes
fn held(m: &Manifest, spec: &DeviceSpec, stages: &[StageSpec]) -> Result<u64, RuntimeError> {
    let s = DeviceSpec {
        stages: stages.to_vec(),
        ..spec.clone()
    };
    let l = layout(m, &s)?;
    Ok(l.resident_need + l.slot_need)
}

/// The stages with more blocks offloaded that free at least `target` bytes (or as much as
/// offloading can), and the bytes freed and blocks moved; `None` when nothing can be freed.
pub(crate) fn shed_layout(
    m: &Manifest,
    spec: &DeviceSpec,
    target: u64,
) -> Result<Option<(Vec<StageSpec>, u64, usize)>, RuntimeError> {
    let start = held(m, spec, &spec.stages)?;
    let mut stages = spec.stages.clone();
    let (mut best, mut moved) = (None::<(Vec<StageSpec>, u64, usize)>, 0);
    loop {
        let now = held(m, spec, &stages)?;
        // (freed by this block, layer, MLP first, stage, index, which)
        let mut pick: Option<(i128, usize, bool, usize, usize)> = None;
        for (k, st) in stages.iter().enumerate() {
            for (i, l) in st.layers.iter().enumerate() {
                for mlp in [true, false] {
                    let place = if mlp { l.mlp } else { l.attn };
                    if place == BlockPlacement::Offloaded {
                        continue;
                    }
                    let mut t = stages.clone();
                    let b = &mut t[k].layers[i];
                    *(if mlp { &mut b.mlp } else { &mut b.attn }) = BlockPlacement::Offloaded;
                    let freed = now as i128 - held(m, spec, &t)? as i128;
                    let key = (freed, l.layer, mlp, k, i);
                    if pick.is_none_or(|p| (key.0, key.1, key.2) > (p.0, p.1, p.2)) {
                        pick = Some(key);
                    }
                }
            }
        }
        let Some((freed, _, mlp, k, i)) = pick else {
            break; // every block is offloaded
        };
        if freed < 0 {
            break;
        }
        let b = &mut stages[k].layers[i];
        *(if mlp { &mut b.mlp } else { &mut b.attn }) = BlockPlacement::Offloaded;
        moved += 1;
        let total = start.saturating_sub(held(m, spec, &stages)?);
        if total > best.as_ref().map_or(0, |b| b.1) {
            best = Some((stages.clone(), total, moved));
        }
        if total >= target {
            break;
        }
    }
    Ok(best)
}

impl Device {
    /// Offloads resident blocks until `target` bytes are freed (or as many as offloading
    /// frees), and lowers the budget by what was freed: the KV cache keeps its room. `None`
    /// when nothing is left to offload that frees memory. Between steps only.
    pub fn shed(&mut self, target: u64) -> Result<Option<ShedDone>, RuntimeError> {
        let Some((stages, freed, blocks)) = shed_layout(&self.manifest, &self.spec, target)? else {
            return Ok(None);
        };
        let old = self.spec.mem_budget;
        self.spec.mem_budget = old.map(|b| b.saturating_sub(freed));
        match self.switch(stages) {
            Ok(mut memory) => {
                self.mem.budget = self.spec.mem_budget.unwrap_or(0);
                memory.budget = self.mem.budget;
                Ok(Some(ShedDone {
                    freed,
                    blocks,
                    memory,
                }))
            }
            Err(e) => {
                self.spec.mem_budget = old;
                Err(e)
            }
        }
    }
}

/// Watches the memory the process lives in and sheds a device's blocks under pressure
/// ([`pressure`]): call [`PressureGuard::check`] between steps.
#[derive(Debug)]
pub struct PressureGuard {
    sampler: Sampler,
    watch: Watch,
    /// nothing was left to shed at the last pressure (said once)
    exhausted: bool,
}

impl Default for PressureGuard {
    fn default() -> Self {
        PressureGuard::new()
    }
}

impl PressureGuard {
    /// A guard watching this process's memory cgroup (nothing when it has no limit).
    pub fn new() -> PressureGuard {
        PressureGuard {
            sampler: Sampler::new(),
            watch: Watch::default(),
            exhausted: false,
        }
    }

    /// Sheds `d`'s blocks if the kernel reports pressure; logs what it did. Errors leave the
    /// device as [`Device::switch`] does (its next step reports them).
    pub fn check(&mut self, d: &mut Device) {
        let now = Instant::now();
        let Some(sample) = self.sampler.sample(now) else {
            return;
        };
        let Some(shed) = self.watch.observe(sample, now) else {
            if !Watch::near(&sample) {
                self.exhausted = false;
                pressure::set_exhausted(false);
            }
            return;
        };
        match d.shed(shed.bytes) {
            Ok(Some(done)) => {
                self.exhausted = false;
                pressure::set_exhausted(false);
                pressure::record(done.freed);
                tracing::warn!(
                    "memory pressure ({}): shed {} by offloading {} block(s); engine budget \
                     now {}, KV room unchanged",
                    shed.why,
                    format_bytes(done.freed),
                    done.blocks,
                    format_bytes(done.memory.budget),
                );
            }
            Ok(None) => {
                pressure::record(0);
                if !self.exhausted {
                    tracing::warn!(
                        "memory pressure ({}): nothing left to shed (every block that frees \
                         memory is offloaded)",
                        shed.why
                    );
                }
                self.exhausted = true;
                pressure::set_exhausted(true);
            }
            Err(e) => tracing::error!("memory pressure ({}): shedding failed: {e}", shed.why),
        }
    }
}
