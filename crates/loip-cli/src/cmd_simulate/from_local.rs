//! `loip simulate --from-local run.json`: a `loip local --json` run replayed in the
//! simulator, the runtime's threshold switches and ms/token beside the simulator's.

use std::path::Path;

use anyhow::{bail, Context, Result};
use loip_sim::replay::{switches, ReplayRun};
use loip_sim::KvPolicy;

use super::SimulateArgs;

/// `--from-local`: the runtime's run against the simulator's replay of it.
pub(super) fn from_local(args: &SimulateArgs, path: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .map(serde_json::from_str)
        .transpose()?
        .with_context(|| format!("{}: no JSON object (`loip local --json`)", path.display()))?;
    let run = ReplayRun::from_local_json(&v)?;
    // The runtime does not lend KV yet: its threshold switches are what both can compare.
    let policy = match args.kv_policy.as_str() {
        "auto" | "no-lending" => KvPolicy::Adaptive { lending: false },
        "adaptive" => KvPolicy::Adaptive { lending: true },
        "recompute" => KvPolicy::Recompute,
        other => bail!("--kv-policy {other}: must be auto, adaptive, no-lending or recompute"),
    };
    let report = run.simulate(policy)?;
    let runtime_events: Vec<loip_sim::AdaptEvent> = v
        .pointer("/adaptation/events")
        .cloned()
        .map(serde_json::from_value)
        .transpose()?
        .unwrap_or_default();
    let rt = switches(&runtime_events, false);
    let sim = switches(&report.events, true);
    let same = loip_sim::replay::same_switches(&rt, &sim, run.sequences);
    let rt_ms = v
        .get("ms_per_token")
        .and_then(|x| x.as_f64())
        .unwrap_or(f64::NAN);
    // The plan as it started streams less than the run did once its devices switched past
    // their thresholds: the cost model prices each decode step with the placement in force
    // (the run's decode steps are its last `steps`, after the prompt's).
    let steps = v
        .pointer("/breakdown/steps")
        .and_then(|x| x.as_u64())
        .unwrap_or(0) as u32;
    let first = run.new_tokens.saturating_sub(steps) + 1;
    // A switch parks the step that needs it: priced at the run's own mean park (the runtime
    // times each, `breakdown.switch_ms` over `switch_parks`), as a device profile would state it.
    let mut cluster = run.cluster.clone();
    let parks = v
        .pointer("/breakdown/switch_parks")
        .and_then(|x| x.as_u64())
        .unwrap_or(0);
    let park_ms = v
        .pointer("/breakdown/switch_ms")
        .and_then(|x| x.as_f64())
        .unwrap_or(0.0);
    if parks > 0 && park_ms.is_finite() && park_ms > 0.0 {
        let each_s = (park_ms * steps as f64 / parks as f64 / 1e3).clamp(0.0, 60.0);
        for d in &mut cluster.devices {
            d.profile.switch_s = each_s;
        }
    }
    let switched = loip_plan::adapt::evaluate_switched(
        &run.plan,
        &run.shape,
        &cluster,
        &runtime_events,
        first,
        steps,
    )?;
    let mut terms = CostTerms::of(&v, &run.plan, switched, rt_ms);
    let weights = match &args.reprice_weights {
        None => loip_plan::calibrate::REPRICE_WEIGHTS,
        Some(s) => {
            let (c, l) = s
                .split_once(',')
                .with_context(|| format!("--reprice-weights {s}: COMPUTE,LOADS"))?;
            loip_plan::calibrate::Weights {
                compute: c.trim().parse()?,
                loads: l.trim().parse()?,
            }
        }
    };
    let repriced = repriced(
        &v,
        &run,
        &cluster,
        &runtime_events,
        first,
        steps,
        rt_ms,
        weights,
    )?;
    if let Some(r) = &repriced {
        terms.repriced = r.ms / r.measured_ms;
    }
    if args.json {
        let out = serde_json::json!({
            "runtime_ms_per_token": rt_ms,
            "predicted_ms_per_token": run.plan.predicted_ms_per_token,
            "predicted_over_switches_ms_per_token": terms.predicted_ms,
            "repriced": repriced,
            "terms": terms,
            "simulated_ms_per_token": report.ms_per_token,
            "runtime_switches": rt,
            "simulated_switches": sim,
            "same_switches": same,
            "status": report.status,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{} + {} tokens, {} plan on {} device(s)",
        run.prompt_tokens,
        run.new_tokens,
        run.plan.planner,
        run.plan.devices.len()
    );
    println!("runtime    {rt_ms:>9.2} ms/token (decode, measured)");
    println!(
        "cost model {:>9.2} ms/token over the run's switches (predicted ÷ measured {:.2}); \
         {:.2} for the plan as it started ({:.2})",
        terms.predicted_ms,
        terms.predicted_ms / rt_ms,
        run.plan.predicted_ms_per_token,
        run.plan.predicted_ms_per_token / rt_ms
    );
    let wakes: Vec<String> = run
        .cluster
        .devices
        .iter()
        .map(|d| format!("{:.0}", d.profile.hop_wake * 1e6))
        .collect();
    let extra = run
        .cluster
        .devices
        .iter()
        .map(|d| d.profile.hop_extra)
        .fold(0.0, f64::max);
    println!(
        "fixed costs measured at setup: hop wake-ups {} us (per device), coordinator {:.0} us a step, \
         {:.0} us more a hop from the warm-up steps",
        wakes.join(", "),
        run.cluster.coordinator * 1e6,
        extra * 1e6
    );
    if let Some(r) = &repriced {
        println!(
            "re-priced  {:>9.2} ms/token over steps {}-{}, fed the first {} decode steps \
             (compute x{:.2}, {:.0} us more a hop, loads x{:.2}); those steps measured {:.2} \
             (re-priced ÷ measured {:.2})",
            r.ms,
            r.from,
            r.to,
            r.fed_steps,
            r.compute_scale,
            r.hop_extra_us,
            r.load_scale,
            r.measured_ms,
            r.ms / r.measured_ms
        );
    }
    println!("{}", CostTerms::HEADER);
    println!("{}", terms.row());
    print_placements(&run, &cluster, &runtime_events, first, steps)?;
    println!(
        "simulator  {:>9.2} ms/token ({:+.1} %), status {}",
        report.ms_per_token,
        (report.ms_per_token / rt_ms - 1.0) * 100.0,
        report.status
    );
    println!("| step | device | tokens | runtime (a,m) | simulator (a,m) |");
    println!("|---:|---|---:|---|---|");
    let name = |d: usize| {
        run.plan
            .devices
            .get(d)
            .map_or_else(|| d.to_string(), |p| p.name.clone())
    };
    let cell = |s: Option<&loip_sim::replay::Switch>| {
        s.map_or("–".to_string(), |s| {
            format!("{:?} → {:?} @{} tok", s.from, s.to, s.tokens)
        })
    };
    for k in 0..rt.len().max(sim.len()) {
        let (a, b) = (rt.get(k), sim.get(k));
        let head = a.or(b).map(|s| (s.step, s.device)).unwrap_or((0, 0));
        println!(
            "| {} | {} | {} | {} | {} |",
            head.0,
            name(head.1),
            a.or(b).map_or(0, |s| s.tokens),
            cell(a),
            cell(b)
        );
    }
    println!(
        "{}",
        if same {
            "same threshold switches"
        } else {
            "the threshold switches differ"
        }
    );
    Ok(())
}

/// The re-priced prediction of a run ([`loip_plan::calibrate::reprice`]) against its
/// measured steps after the first few.  // milliseconds
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct Repriced {
    /// decode steps it was fed (the first not parked for a switch)
    fed_steps: u32,
    /// the steps it priced, `from..=to` (the run's numbering)
    from: u32,
    to: u32,
    /// its ms/token over them
    ms: f64,
    /// the run's over them: its ms/token shifted by the wall and coordinator's part of
    /// those steps against all decode steps'
    measured_ms: f64,
    compute_scale: f64,
    hop_extra_us: f64,
    load_scale: f64,
}

/// The cost model fed the run's first decode steps not parked for a switch
/// (`breakdown.early_*` in the run's JSON;
/// `None` for a run without them), over its remaining steps on `cluster` (the run's, its
/// switch parks priced as in the other columns): the same pure function as the runtime's
/// `repriced_ms`.
#[allow(clippy::too_many_arguments)] // the run, its cluster, its steps and the weights
fn repriced(
    v: &serde_json::Value,
    run: &ReplayRun,
    cluster: &loip_plan::Cluster,
    events: &[loip_sim::AdaptEvent],
    first: u32,
    steps: u32,
    rt_ms: f64,
    weights: loip_plan::calibrate::Weights,
) -> Result<Option<Repriced>> {
    let m = |k: &str| {
        v.pointer(&format!("/breakdown/{k}"))
            .and_then(|x| x.as_f64())
            .unwrap_or(0.0)
    };
    let (k, span) = (m("early_steps") as u32, m("early_span") as u32);
    if k == 0 || span >= steps || !rt_ms.is_finite() {
        return Ok(None);
    }
    let fed = loip_plan::calibrate::WarmupStep {
        group: 0,
        wall_s: m("early_step_ms") / 1e3,
        compute_s: m("early_compute_ms") / 1e3,
        stall_s: m("early_stall_ms") / 1e3,
        coordinator_s: m("early_coordinator_ms") / 1e3,
    };
    let probed: Vec<String> = v
        .get("devices")
        .and_then(|d| d.as_array())
        .map(|a| {
            a.iter()
                .filter(|r| r.get("probe").is_some_and(|p| !p.is_null()))
                .filter_map(|r| r.pointer("/endpoint/name").and_then(|n| n.as_str()))
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let Some(r) = loip_plan::calibrate::reprice(
        &run.plan, &run.shape, cluster, events, first, span, steps, &fed, &probed, weights,
    )?
    else {
        return Ok(None);
    };
    let (n, sf) = (steps as f64, span as f64);
    let all = m("step_ms") + m("coordinator_ms");
    let rest = (n * all - sf * m("early_span_ms")) / (n - sf);
    let c = &r.calibration;
    Ok(Some(Repriced {
        fed_steps: k,
        from: first + span,
        to: first + steps - 1,
        ms: r.ms_per_token,
        measured_ms: rt_ms + rest - all,
        compute_scale: c.compute_scale,
        hop_extra_us: c.hop_extra * 1e6,
        load_scale: c.load_scale,
    }))
}

/// The cost model per placement the run held (between its threshold switches), one line
/// each: `placement steps A-B: priced … ms/token, stall … ms` (decode steps `A..=B`, the
/// run's numbering; `bench/runtime_vs_sim.sh` with `TRACE=1` sets the run's own stall per
/// placement beside it from the workers' hop traces).
fn print_placements(
    run: &ReplayRun,
    cluster: &loip_plan::Cluster,
    events: &[loip_sim::AdaptEvent],
    first: u32,
    steps: u32,
) -> Result<()> {
    let end = first.saturating_add(steps);
    let mut at: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            loip_sim::AdaptEvent::Switch { step, .. } if *step > first && *step < end => {
                Some(*step)
            }
            _ => None,
        })
        .collect();
    at.sort_unstable();
    at.dedup();
    let bounds: Vec<u32> = std::iter::once(first)
        .chain(at)
        .chain(std::iter::once(end))
        .collect();
    for w in bounds.windows(2) {
        let (a, b) = (w[0], w[1]);
        if b <= a {
            continue;
        }
        let (ms, p) =
            loip_plan::adapt::evaluate_switched(&run.plan, &run.shape, cluster, events, a, b - a)?;
        println!(
            "placement steps {a}-{}: priced {ms:.2} ms/token, stall {:.2} ms",
            b - 1,
            p.uncovered_load_ms
        );
    }
    Ok(())
}

/// A run's terms, measured (the run's `breakdown`, means per decode step) against the cost
/// model's (over the run's threshold switches, `adapt::evaluate_switched`; the plan as it
/// started beside it); the measured parts add up to the measured ms/token.
/// // milliseconds
#[derive(Debug, Clone, Copy, serde::Serialize)]
struct CostTerms {
    measured_ms: f64,
    predicted_ms: f64,
    /// the plan as it started, before any switch
    plan_ms: f64,
    /// blocks (and the head) on the devices
    compute: (f64, f64),
    /// a token's hops: the run's network, queueing and what the workers spend outside blocks
    /// and loads (the compute thread's and pool's wake-ups, frames), less the switches'
    /// parks; the model's `comm`
    hops: (f64, f64),
    /// of the measured hops: inside the workers, outside blocks, loads and queues
    other: f64,
    /// load stall (measured) and uncovered load (predicted)
    loads: (f64, f64),
    coordinator: (f64, f64),
    /// steps parked for threshold switches, per token
    switch: (f64, f64),
    loaded_bytes: f64,
    /// the re-priced prediction over the measured, both over the steps after the first
    /// few (NaN: not re-priced)
    repriced: f64,
}

impl CostTerms {
    /// The markdown header of [`CostTerms::row`].
    const HEADER: &'static str = "| measured ms/token | predicted ÷ measured | compute meas./pred. | hops meas./pred. | (of which in-worker) | load stall meas./pred. | coordinator meas./pred. | switch parks meas./pred. | loaded MB/token | plan as started ÷ measured | re-priced ÷ measured, after 8 steps |\n|---:|---:|---|---|---:|---|---|---|---:|---:|---:|";

    fn of(
        v: &serde_json::Value,
        plan: &loip_plan::Plan,
        (predicted_ms, p): (f64, loip_plan::CostBreakdown),
        measured_ms: f64,
    ) -> CostTerms {
        let m = |k: &str| {
            v.pointer(&format!("/breakdown/{k}"))
                .and_then(|x| x.as_f64())
                .unwrap_or(0.0)
        };
        let known = m("compute_ms")
            + m("network_ms")
            + m("queued_ms")
            + m("load_stall_ms")
            + m("coordinator_ms");
        let other = measured_ms - known;
        // the parks are inside the parked steps' wall, in the run's `queued_ms` (a step waits
        // from its creation to its dispatch)
        let park = m("switch_ms");
        CostTerms {
            measured_ms,
            predicted_ms,
            plan_ms: plan.predicted_ms_per_token,
            compute: (m("compute_ms"), p.compute_ms),
            hops: (m("network_ms") + m("queued_ms") + other - park, p.comm_ms),
            other,
            loads: (m("load_stall_ms"), p.uncovered_load_ms),
            coordinator: (m("coordinator_ms"), p.coordinator_ms),
            switch: (park, p.switch_ms),
            loaded_bytes: m("loaded_bytes"),
            repriced: f64::NAN,
        }
    }

    /// One markdown row.
    fn row(&self) -> String {
        let pair = |x: (f64, f64)| format!("{:.2} / {:.2}", x.0, x.1);
        format!(
            "| {:.2} | {:.2} | {} | {} | {:.2} | {} | {} | {} | {:.1} | {:.2} | {:.2} |",
            self.measured_ms,
            self.predicted_ms / self.measured_ms,
            pair(self.compute),
            pair(self.hops),
            self.other,
            pair(self.loads),
            pair(self.coordinator),
            pair(self.switch),
            self.loaded_bytes / 1e6,
            self.plan_ms / self.measured_ms,
            self.repriced
        )
    }
}
