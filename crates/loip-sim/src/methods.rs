//! The methods compared (design §9): each is a plan (from the planner crate, or a
//! tensor-parallel placement built in [`crate::tp`]) plus an execution mode and a KV policy.
//!
//! | method | placement | execution | KV overflow |
//! |---|---|---|---|
//! | `loip` | planner `loip` | overlapped slot loads | thresholds + lending (§6) |
//! | `loip-no-kvtransfer` | planner `loip` | overlapped | thresholds only |
//! | `loip-uniform` | planner `loip-uniform` | overlapped | thresholds + lending |
//! | `loip-conventional-load` | planner `loip-conventional-load` | overlapped, conventional loader | thresholds + lending |
//! | `loip-recompute` | planner `loip` | overlapped | evict + recompute only (no switch, no lending) |
//! | `pp` | planner `pp` | no offloading | evict + recompute |
//! | `pp-offload` | planner `pp-offload` (conventional loader) | sequential loads | evict + recompute |
//! | `edgeshard` | planner `edgeshard` | no offloading | evict + recompute |
//! | `galaxy` | [`TpKind::Galaxy`] | TP, ring syncs | evict + recompute |
//! | `tpi-llm` | [`TpKind::TpiLlm`] | TP, star syncs, sliding window from disk | window shrinks (evict + recompute past a one-layer window) |
//! | `tpi-llm-offload` | [`TpKind::TpiLlmOffload`] | as `tpi-llm` | as `tpi-llm` (same model, kept for the tables) |
//!
//! **Planned context** (design §4). The LOIP family, which adapts online (§6: thresholds
//! count from the placement), is placed for the KV the whole run holds, `b · (prompt +
//! output)` tokens, and also for less — the prompt, `b · prompt`, and, when the whole run
//! does not fit, the largest context that does — and each placement is simulated (a
//! candidate is stopped once it runs past the best one's end: it cannot win); the run kept is
//! the fastest that finishes (ties: the larger context), and [`MethodRun::planned_for`] says
//! which it was. The baselines run as their papers do: placed for the weights and the
//! prompt, and when the KV cache then overflows a device they evict the oldest overflowed KV
//! and recompute it in every forward pass — except TPI-LLM, whose sliding window of layer
//! shards shrinks instead (more shards stream from disk; [`crate::tp`]). A method is OOM only
//! when its weights (or TP slices, for TPI-LLM a one-layer window) and the prompt's KV cannot
//! be placed.
//! Baselines that read from disk (`pp-offload`, TPI-LLM) use the conventional loader: the
//! O_DIRECT slot path is LOIP's own (design §5).
//!
//! **Framework overhead** ([`Method::framework_pass_s`]). Every device preset deducts the
//! memory of a Python + PyTorch process, since the paper's LOIP and its baselines all run in
//! one. The time overhead is per method: the baselines run stock PyTorch modules and
//! `torch.distributed`, and pay [`FRAMEWORK_PASS_S`] per pass of a micro-batch through a
//! stage (per token and device under tensor parallelism); LOIP runs its own operators (the
//! paper's custom CUDA operators, this project's runtime) and pays only the profile's block
//! overhead. The figure and its source are in `docs/simulator.md`.

use crate::error::SimError;
use crate::pipeline::simulate_pipeline;
use crate::sim::{KvPolicy, SimConfig, SimReport, Status};
use crate::tp::{place_tp, simulate_tp, TpKind};
use loip_plan::{Cluster, LoaderKind, ModelShape, Plan, PlanError, PlanRequest};
use serde::{Deserialize, Serialize};

/// Fixed cost a Python + PyTorch baseline pays per pass of a micro-batch through a stage:
/// the Python calls of the stage's forward, the synchronisation that copies the activation
/// out and the `torch.distributed` send (module docs). Derived in `docs/simulator.md` from
/// the PyTorch team's published eager-mode overhead (LLaMA-7B on an A100, 25.5 against 107
/// tokens/s: 0.93 ms of dispatch per decoder layer) and a 2× slower Arm core.  // seconds
pub const FRAMEWORK_PASS_S: f64 = 2e-3;

/// A method of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Method {
    /// LOIP.
    Loip,
    /// LOIP without KV lending.
    LoipNoKvtransfer,
    /// LOIP with uniform consecutive layers instead of the scheduler.
    LoipUniform,
    /// LOIP with the conventional loading path.
    LoipConventionalLoad,
    /// LOIP's placement whose KV overflow is only evicted and recomputed (no threshold
    /// switch, no lending).
    LoipRecompute,
    /// Pipeline parallelism.
    Pp,
    /// Conventional pipeline + offloading.
    PpOffload,
    /// EdgeShard.
    Edgeshard,
    /// Galaxy.
    Galaxy,
    /// TPI-LLM.
    TpiLlm,
    /// TPI-LLM streaming more layers instead of recomputing.
    TpiLlmOffload,
}

impl Method {
    /// Every method.
    pub const ALL: [Method; 11] = [
        Method::Loip,
        Method::Pp,
        Method::PpOffload,
        Method::Edgeshard,
        Method::Galaxy,
        Method::TpiLlm,
        Method::TpiLlmOffload,
        Method::LoipNoKvtransfer,
        Method::LoipUniform,
        Method::LoipConventionalLoad,
        Method::LoipRecompute,
    ];
    /// The seven methods of the main comparison.
    pub const MAIN: [Method; 7] = [
        Method::Loip,
        Method::Pp,
        Method::PpOffload,
        Method::Edgeshard,
        Method::Galaxy,
        Method::TpiLlm,
        Method::TpiLlmOffload,
    ];
    /// LOIP and its three ablations.
    pub const ABLATION: [Method; 4] = [
        Method::Loip,
        Method::LoipNoKvtransfer,
        Method::LoipUniform,
        Method::LoipConventionalLoad,
    ];

    /// Name as used on the command line and in outputs.
    pub fn name(self) -> &'static str {
        match self {
            Method::Loip => "loip",
            Method::LoipNoKvtransfer => "loip-no-kvtransfer",
            Method::LoipUniform => "loip-uniform",
            Method::LoipConventionalLoad => "loip-conventional-load",
            Method::LoipRecompute => "loip-recompute",
            Method::Pp => "pp",
            Method::PpOffload => "pp-offload",
            Method::Edgeshard => "edgeshard",
            Method::Galaxy => "galaxy",
            Method::TpiLlm => "tpi-llm",
            Method::TpiLlmOffload => "tpi-llm-offload",
        }
    }

    /// The method called `name`.
    pub fn from_name(name: &str) -> Result<Method, SimError> {
        Method::ALL
            .into_iter()
            .find(|m| m.name() == name)
            .ok_or_else(|| SimError::UnknownMethod {
                name: name.to_string(),
                known: Method::ALL.map(|m| m.name()).join(", "),
            })
    }

    /// Whether it belongs to the LOIP family (adaptive, planned for the prompt).
    pub fn is_loip(self) -> bool {
        matches!(
            self,
            Method::Loip
                | Method::LoipNoKvtransfer
                | Method::LoipUniform
                | Method::LoipConventionalLoad
                | Method::LoipRecompute
        )
    }

    /// Its planner in the planner crate, `None` for the tensor-parallel ones.
    pub fn planner(self) -> Option<&'static str> {
        Some(match self {
            Method::Loip | Method::LoipNoKvtransfer | Method::LoipRecompute => "loip",
            Method::LoipUniform => "loip-uniform",
            Method::LoipConventionalLoad => "loip-conventional-load",
            Method::Pp => "pp",
            Method::PpOffload => "pp-offload",
            Method::Edgeshard => "edgeshard",
            Method::Galaxy | Method::TpiLlm | Method::TpiLlmOffload => return None,
        })
    }

    /// Its tensor-parallel kind, if it is one.
    pub fn tp_kind(self) -> Option<TpKind> {
        match self {
            Method::Galaxy => Some(TpKind::Galaxy),
            Method::TpiLlm => Some(TpKind::TpiLlm),
            Method::TpiLlmOffload => Some(TpKind::TpiLlmOffload),
            _ => None,
        }
    }

    /// How it handles KV overflow.
    pub fn kv_policy(self) -> KvPolicy {
        match self {
            Method::Loip | Method::LoipUniform | Method::LoipConventionalLoad => {
                KvPolicy::Adaptive { lending: true }
            }
            Method::LoipNoKvtransfer => KvPolicy::Adaptive { lending: false },
            _ => KvPolicy::Recompute,
        }
    }

    /// The runtime overhead it pays per pass of a micro-batch through a stage: the paper's
    /// baselines run stock PyTorch modules and `torch.distributed`; the LOIP family runs its
    /// own operators and pays none beyond the profile's block overhead.  // seconds
    pub fn framework_pass_s(self) -> f64 {
        if self.is_loip() {
            0.0
        } else {
            FRAMEWORK_PASS_S
        }
    }

    /// Loader its planner is asked to price with.
    pub fn loader(self) -> LoaderKind {
        match self {
            Method::PpOffload | Method::LoipConventionalLoad => LoaderKind::Conventional,
            _ => LoaderKind::Direct,
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Outcome of one method on one setup.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MethodRun {
    /// The simulation.
    pub report: SimReport,
    /// The planner's plan (pipeline methods that could be placed).
    pub plan: Option<Plan>,
    /// Cost-model prediction of the plan at its planned context.  // milliseconds
    pub predicted_ms_per_token: Option<f64>,
    /// KV tokens (all sequences) the placement was sized for.  // tokens
    pub planned_tokens: Option<u64>,
    /// What the placement was sized for: `run` (prompt + output), `prompt`, or `partial`
    /// (the largest context that fits, between the two); `None` when OOM.
    pub planned_for: Option<PlannedFor>,
}

/// What a placement was sized for (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlannedFor {
    /// The KV of the whole run, `b · (prompt + output)` tokens.
    Run,
    /// The largest context that fits, less than the whole run and more than the prompt.
    Partial,
    /// The KV held when decoding starts, `b · prompt` tokens.
    Prompt,
}

impl PlannedFor {
    /// Name as used in tables.
    pub fn name(self) -> &'static str {
        match self {
            PlannedFor::Run => "run",
            PlannedFor::Partial => "partial",
            PlannedFor::Prompt => "prompt",
        }
    }
}

fn oom(note: String) -> MethodRun {
    MethodRun {
        report: SimReport::oom(note),
        plan: None,
        predicted_ms_per_token: None,
        planned_tokens: None,
        planned_for: None,
    }
}

/// Plans and simulates `method`. The cluster's link is taken from `cfg` (bandwidth of the
/// first step, `cfg.latency`): planners see what the runtime would measure at start-up.
pub fn run_method(
    method: Method,
    shape: &ModelShape,
    cluster: &Cluster,
    cfg: &SimConfig,
) -> Result<MethodRun, SimError> {
    let mut cluster = cluster.clone();
    cluster.link.bandwidth = cfg.bandwidth.at(0);
    cluster.link.latency = cfg.latency;
    let b = cfg.sequences.max(1);
    let prompt = b as u64 * cfg.prompt_tokens as u64;
    let full = b as u64 * (cfg.prompt_tokens as u64 + cfg.output_tokens as u64);
    let mut cfg = cfg.clone();
    cfg.kv_policy = method.kv_policy();
    cfg.pass_overhead_s += method.framework_pass_s();
    if let Some(kind) = method.tp_kind() {
        // Placed for the weights and the prompt (module docs).
        return match place_tp(
            kind,
            shape,
            &cluster,
            b,
            prompt,
            prompt,
            cfg.tpi_window_layers,
        ) {
            Ok(place) => {
                let report = simulate_tp(&place, shape, &cluster, &cfg)?;
                Ok(MethodRun {
                    report,
                    plan: None,
                    predicted_ms_per_token: None,
                    planned_for: Some(if place.planned_tokens >= full {
                        PlannedFor::Run
                    } else {
                        PlannedFor::Prompt
                    }),
                    planned_tokens: Some(place.planned_tokens),
                })
            }
            Err(note) => Ok(oom(note)),
        };
    }
    let Some(planner) = method.planner() else {
        return Err(SimError::Invalid {
            field: "method",
            reason: format!("{method} has no planner"),
        });
    };
    // Ok(Err(note)): the planner says it does not fit.
    let place = |context: u64| -> Result<Result<Plan, String>, SimError> {
        let req = PlanRequest {
            context,
            pattern: cfg.pattern,
            micro_batches: Some(b),
            loader: method.loader(),
            allow_drop: true,
        };
        match loip_plan::plan(planner, shape, &cluster, &req) {
            Ok(plan) => Ok(Ok(plan)),
            Err(e @ PlanError::DoesNotFit { .. }) => Ok(Err(e.to_string())),
            Err(e) => Err(e.into()),
        }
    };
    let simulate = |plan: Plan, context: u64, planned_for: PlannedFor, stop: Option<f64>| {
        let mut cfg = cfg.clone();
        cfg.stop_after_s = stop;
        simulate_pipeline(&plan, shape, &cluster, &cfg).map(|report| MethodRun {
            report,
            predicted_ms_per_token: Some(plan.predicted_ms_per_token),
            planned_tokens: Some(context),
            planned_for: Some(planned_for),
            plan: Some(plan),
        })
    };
    if !method.is_loip() {
        return match place(prompt)? {
            Ok(plan) => simulate(plan, prompt, PlannedFor::Prompt, None),
            Err(note) => Ok(oom(note)),
        };
    }
    // The LOIP family: the whole run, then less (see the module docs).
    let whole = place(full)?;
    let mut candidates: Vec<(Plan, u64, PlannedFor)> = Vec::new();
    let fits_whole = whole.is_ok();
    let mut note = String::new();
    match whole {
        Ok(plan) => candidates.push((plan, full, PlannedFor::Run)),
        Err(n) => note = n,
    }
    if prompt < full {
        match place(prompt)? {
            Ok(plan) => {
                if !fits_whole {
                    if let Some((plan, context)) = largest_fit(&place, prompt, full)? {
                        candidates.push((plan, context, PlannedFor::Partial));
                    }
                }
                candidates.push((plan, prompt, PlannedFor::Prompt));
            }
            Err(n) => note = n,
        }
    }
    let mut best: Option<MethodRun> = None;
    for (plan, context, planned_for) in candidates {
        // A candidate still running when the best so far has finished cannot beat it.
        let stop = best
            .as_ref()
            .filter(|b| b.report.status == Status::Ok)
            .and_then(|b| b.report.step_end_s.last().copied());
        let run = simulate(plan, context, planned_for, stop)?;
        let better = match &best {
            None => true,
            Some(b) => rank(&run.report) < rank(&b.report),
        };
        if better {
            best = Some(run);
        }
    }
    Ok(best.unwrap_or_else(|| oom(note)))
}

/// Order of runs, best first: finished before OOT, then by ms/token. Equal runs keep the
/// first (the larger planned context).
fn rank(r: &SimReport) -> (u8, f64) {
    let status = match r.status {
        Status::Ok => 0,
        Status::Oot => 1,
        Status::Oom => 2,
    };
    let ms = if r.ms_per_token.is_finite() {
        r.ms_per_token
    } else {
        f64::INFINITY
    };
    (status, ms)
}

/// The largest context in `(lo, hi)` that `place` fits (bisection over tokens, to 1 %), with
/// its plan; `lo` must fit and `hi` must not.
fn largest_fit(
    place: &dyn Fn(u64) -> Result<Result<Plan, String>, SimError>,
    lo: u64,
    hi: u64,
) -> Result<Option<(Plan, u64)>, SimError> {
    let (mut lo, mut hi) = (lo, hi);
    let mut found = None;
    while hi > lo + 1 && (hi - lo) * 100 > hi {
        let mid = lo + (hi - lo) / 2;
        match place(mid)? {
            Ok(plan) => {
                found = Some((plan, mid));
                lo = mid;
            }
            Err(_) => hi = mid,
        }
    }
    Ok(found)
}
