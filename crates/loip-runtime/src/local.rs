//! One device running the whole model from slice files under a memory budget: the
//! single-device offloading path (`loip generate --mem`).
//!
//! Every layer is its own stage on this device, so the slot holds one layer's offloaded
//! blocks and the loader fetches the next offloaded layer as soon as the previous one ran.
//! Which blocks are offloaded follows a simple rule until the planner chooses: from the last
//! layer backwards (MLP block first, then attention) until the budget holds, or a forced
//! choice (`--offload-blocks`).

use std::path::Path;

use loip_engine::{BatchBackend, EngineError, Rewind, StepBackend, TokenPos};
use loip_model::slice::{Manifest, SliceKind};

use crate::executor::{
    working_bytes, BlockPlacement, Device, DeviceSpec, PressureGuard, StageLayer, StageSpec,
};
use crate::loader::LoaderKind;
use crate::RuntimeError;

/// Which blocks to offload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadRule {
    /// as few as the budget needs, from the last layer backwards
    #[default]
    Auto,
    /// none
    None,
    /// every MLP block
    Mlp,
    /// every attention block
    Attn,
    /// every block
    All,
    /// both blocks of every other layer (odd layers): half the model offloaded, each load
    /// overlapping the next resident layer's compute
    Alternate,
    /// what the `loip` planner chooses for this one device under the budget (stage count and
    /// blocks), with this machine's preset profile (`host-zen5-2c`) for its times
    Plan,
}

impl std::str::FromStr for OffloadRule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "auto" => OffloadRule::Auto,
            "none" => OffloadRule::None,
            "mlp" => OffloadRule::Mlp,
            "attn" | "attention" => OffloadRule::Attn,
            "all" => OffloadRule::All,
            "alternate" => OffloadRule::Alternate,
            "plan" => OffloadRule::Plan,
            _ => return Err(format!("unknown offload rule {s:?}; expected auto, none, mlp, attn, all, alternate or plan")),
        })
    }
}

/// Options of a single-device run.
#[derive(Debug, Clone)]
pub struct LocalOptions {
    /// memory budget, bytes
    pub mem_budget: Option<u64>,
    /// which blocks to offload
    pub rule: OffloadRule,
    /// loading path
    pub loader: LoaderKind,
    /// overlap loads with compute
    pub overlap: bool,
    /// tokens of context to reserve KV for (prompt + new tokens)
    pub context: usize,
    /// most tokens in one step (the prompt)
    pub max_step_tokens: usize,
}

fn size(m: &Manifest, k: SliceKind) -> Result<u64, RuntimeError> {
    m.slice(k)
        .map(|s| s.size)
        .ok_or_else(|| RuntimeError::Invalid(format!("slice {} missing", k.id())))
}

/// The single-device spec for `opts` on the model in `m` (one sequence at a time).
pub fn local_spec(m: &Manifest, opts: &LocalOptions) -> Result<DeviceSpec, RuntimeError> {
    local_spec_for(m, opts, 1)
}

/// The single-device spec for `opts` serving up to `max_seqs` sequences at once: KV for
/// `max_seqs × context` tokens, working buffers for steps of `max_step_tokens` tokens over
/// `max_seqs` sequences.
pub fn local_spec_for(
    m: &Manifest,
    opts: &LocalOptions,
    max_seqs: usize,
) -> Result<DeviceSpec, RuntimeError> {
    let max_seqs = max_seqs.max(1);
    if opts.rule == OffloadRule::Plan {
        return planned_spec(m, opts);
    }
    let n = m.config.num_layers;
    let (attn_off, mlp_off) = match opts.rule {
        OffloadRule::None | OffloadRule::Auto | OffloadRule::Alternate | OffloadRule::Plan => {
            (false, false)
        }
        OffloadRule::Mlp => (false, true),
        OffloadRule::Attn => (true, false),
        OffloadRule::All => (true, true),
    };
    let place = |off: bool| {
        if off {
            BlockPlacement::Offloaded
        } else {
            BlockPlacement::Resident
        }
    };
    let mut layers: Vec<StageLayer> = (0..n)
        .map(|layer| StageLayer {
            layer,
            attn: place(attn_off),
            mlp: place(mlp_off),
        })
        .collect();
    if opts.rule == OffloadRule::Alternate {
        for l in layers.iter_mut().filter(|l| l.layer % 2 == 1) {
            l.attn = BlockPlacement::Offloaded;
            l.mlp = BlockPlacement::Offloaded;
        }
    }
    // a sliding-window layer's cache stops at its window
    let kv_rows: u64 = (0..n)
        .map(|l| {
            m.config
                .layer_window(l)
                .map_or(opts.context, |w| w.min(opts.context)) as u64
        })
        .sum();
    let kv_bytes = (kv_rows * max_seqs as u64)
        .saturating_mul(2 * (m.config.num_kv_heads * m.config.head_dim) as u64 * 4);
    let working = working_bytes(m, opts.max_step_tokens, max_seqs, opts.context);
    let need = |layers: &[StageLayer]| -> Result<u64, RuntimeError> {
        let mut resident = size(m, SliceKind::Embed)? + size(m, SliceKind::Head)?;
        let mut slot = 0;
        for l in layers {
            let (a, p) = (
                size(m, SliceKind::Attn(l.layer))?,
                size(m, SliceKind::Mlp(l.layer))?,
            );
            let mut off = 0;
            match l.attn {
                BlockPlacement::Resident => resident += a,
                BlockPlacement::Offloaded => off += a,
            }
            match l.mlp {
                BlockPlacement::Resident => resident += p,
                BlockPlacement::Offloaded => off += p,
            }
            slot = slot.max(off);
        }
        Ok(resident + slot + kv_bytes + working)
    };
    if let (OffloadRule::Auto, Some(budget)) = (opts.rule, opts.mem_budget) {
        'outer: for i in (0..n).rev() {
            for block in 0..2 {
                if need(&layers)? <= budget {
                    break 'outer;
                }
                if block == 0 {
                    layers[i].mlp = BlockPlacement::Offloaded;
                } else {
                    layers[i].attn = BlockPlacement::Offloaded;
                }
            }
        }
    }
    if let Some(budget) = opts.mem_budget {
        let total = need(&layers)?;
        if total > budget {
            return Err(RuntimeError::KvDoesNotFit {
                budget,
                needed: total,
                kv: kv_bytes,
                working,
                context: opts.context,
                seqs: max_seqs,
            });
        }
    }
    Ok(DeviceSpec {
        stages: layers
            .into_iter()
            .map(|l| StageSpec { layers: vec![l] })
            .collect(),
        embed: true,
        head: true,
        loader: opts.loader,
        overlap: opts.overlap,
        mem_budget: opts.mem_budget,
        max_step_tokens: opts.max_step_tokens,
        max_step_seqs: max_seqs,
        context: opts.context,
    })
}

/// The `loip` planner's choice for a one-device cluster under the budget.
fn planned_spec(m: &Manifest, opts: &LocalOptions) -> Result<DeviceSpec, RuntimeError> {
    let budget = opts
        .mem_budget
        .ok_or_else(|| RuntimeError::Invalid("--offload-blocks plan needs --mem".into()))?;
    let mut profile = loip_plan::profile::preset("host-zen5-2c").ok_or_else(|| {
        RuntimeError::Invalid("the host-zen5-2c profile preset is missing".into())
    })?;
    profile.mem_budget = budget;
    let link = loip_plan::LinkProfile {
        bandwidth: 1e12,
        latency: 0.0,
    };
    let cluster = loip_plan::Cluster::new(vec![("this-device".into(), profile)], link);
    let shape = crate::shape::shape_from_manifest("model", m);
    let req = loip_plan::PlanRequest {
        context: opts.context as u64,
        loader: match opts.loader {
            LoaderKind::Direct => loip_plan::LoaderKind::Direct,
            LoaderKind::Conventional => loip_plan::LoaderKind::Conventional,
        },
        ..Default::default()
    };
    let plan =
        loip_plan::plan("loip", &shape, &cluster, &req).map_err(|e| RuntimeError::OverBudget {
            budget,
            detail: e.to_string(),
        })?;
    let mut spec = crate::cluster_run::device_spec(
        &plan,
        0,
        opts.loader,
        opts.max_step_tokens,
        opts.context,
        Some(budget),
    );
    spec.overlap = opts.overlap;
    Ok(spec)
}

/// A whole model on one device, run from its slice directory.
pub struct LocalModel {
    /// the device
    pub device: Device,
    /// sheds the device's blocks when the kernel reports memory pressure
    guard: PressureGuard,
}

impl LocalModel {
    /// Opens the model in `dir` under `opts`.
    pub fn open(dir: &Path, opts: &LocalOptions) -> Result<LocalModel, RuntimeError> {
        let m = Manifest::load(dir)?;
        let spec = local_spec(&m, opts)?;
        Ok(LocalModel {
            device: Device::open(dir, &m, spec)?,
            guard: PressureGuard::new(),
        })
    }

    /// Opens the model in `dir` under `opts` for up to `max_seqs` sequences at once (the
    /// batched server): the budget holds their KV and the working buffers of a batched step.
    pub fn open_batched(
        dir: &Path,
        opts: &LocalOptions,
        max_seqs: usize,
    ) -> Result<LocalModel, RuntimeError> {
        let m = Manifest::load(dir)?;
        let spec = local_spec_for(&m, opts, max_seqs)?;
        Ok(LocalModel {
            device: Device::open(dir, &m, spec)?,
            guard: PressureGuard::new(),
        })
    }

    /// Runs `ids` at `batch` through every stage; returns the hidden states.
    pub fn forward_hidden(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
    ) -> Result<Vec<f32>, RuntimeError> {
        self.guard.check(&mut self.device);
        self.device.reserve(ids.len())?;
        let mut x = self.device.embed(ids)?;
        for k in 0..self.device.stages() {
            self.device.run_stage(k, &mut x, batch)?;
        }
        Ok(x)
    }
}

fn engine_err(e: RuntimeError) -> EngineError {
    match e {
        RuntimeError::Engine(e) => e,
        other => EngineError::Backend(other.to_string()),
    }
}

/// Many sequences in one step: every stage runs once over the whole batch, so each offloaded
/// block is read once per step for all of them.
impl BatchBackend for LocalModel {
    fn forward_rows(
        &mut self,
        ids: &[u32],
        batch: &[TokenPos],
        rows: &[usize],
    ) -> Result<Vec<f32>, EngineError> {
        let x = self.forward_hidden(ids, batch).map_err(engine_err)?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.device.head(&x, rows).map_err(engine_err)
    }

    fn release(&mut self, seq: u64) {
        self.device.kv.remove(seq);
    }

    fn rewind(&mut self, seq: u64, len: usize) -> Result<(), EngineError> {
        self.device.kv.truncate(seq, len);
        Ok(())
    }

    fn can_rewind(&self) -> bool {
        true
    }

    /// A prompt shared by several sequences is computed once: its KV rows are copied within
    /// the device's cache (and its budget).
    fn fork(&mut self, from: u64, to: u64, len: usize) -> Result<(), EngineError> {
        self.device.kv.fork(from, to, len)
    }

    fn can_fork(&self) -> bool {
        true
    }

    fn vocab_size(&self) -> usize {
        self.device.tf.cfg.vocab_size
    }
}

/// Speculative decoding from slice files: a verify step of `k + 1` positions reads each
/// offloaded block once; the rejected positions' KV is truncated here.
impl Rewind for LocalModel {
    fn allow_rewind(&mut self, k: usize) {
        self.device.kv.widen_windows(k);
    }

    fn max_positions(&self) -> Option<usize> {
        Some(self.device.tf.cfg.max_position_embeddings)
    }
}

impl StepBackend for LocalModel {
    fn step(&mut self, seq: u64, ids: &[u32], start_pos: usize) -> Result<Vec<f32>, EngineError> {
        let batch: Vec<TokenPos> = (0..ids.len())
            .map(|i| TokenPos {
                seq,
                pos: start_pos + i,
            })
            .collect();
        let run = |me: &mut Self| -> Result<Vec<f32>, RuntimeError> {
            let x = me.forward_hidden(ids, &batch)?;
            me.device.head(&x, &[ids.len() - 1])
        };
        run(self).map_err(engine_err)
    }
}
