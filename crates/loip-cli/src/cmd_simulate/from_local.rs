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
    if args.json {
        let out = serde_json::json!({
            "runtime_ms_per_token": rt_ms,
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
