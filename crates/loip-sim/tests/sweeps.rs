//! Acceptance checks of the sweeps (issue 16) on small versions of them: deterministic for a
//! seed, budgets below the weight bytes leave `pp`, `edgeshard` and `galaxy` OOM, `loip`
//! finishes wherever any method does and is never slower than `pp-offload`.

use loip_plan::Pattern;
use loip_sim::experiments::{
    experiments, run_experiments, sweep_base_setups, sweep_setups, Experiment, ExperimentConfig,
    Record, Results, SWEEP_RATIOS,
};
use loip_sim::{report, Bandwidth, Method, Status};
use std::collections::BTreeMap;

/// (setup, pattern, bandwidth, output, sequences) → records of every method.
fn rows(records: &[Record]) -> BTreeMap<(String, String, String, u32, u32), Vec<&Record>> {
    let mut m: BTreeMap<_, Vec<&Record>> = BTreeMap::new();
    for r in records {
        m.entry((
            r.setup.clone(),
            r.pattern.to_string(),
            format!("{:?}", r.bandwidth_mbps),
            r.output_tokens,
            r.sequences,
        ))
        .or_default()
        .push(r);
    }
    m
}

/// The checks on every row of `res`.
fn check(res: &Results) {
    for (k, row) in rows(&res.records) {
        let get = |m: Method| row.iter().find(|r| r.method == m.name()).copied();
        let loip = get(Method::Loip).expect("loip ran");
        if loip.budget_ratio < 1.0 {
            for m in [Method::Pp, Method::Edgeshard, Method::Galaxy] {
                if let Some(r) = get(m) {
                    assert_eq!(r.status, Status::Oom, "{m} at {k:?}");
                }
            }
        }
        if row.iter().any(|r| r.status == Status::Ok) {
            assert_eq!(loip.status, Status::Ok, "loip at {k:?}");
            assert!(loip.planned_for.is_some(), "{k:?}");
        }
        if let Some(po) = get(Method::PpOffload) {
            if po.status == Status::Ok {
                let (l, p) = (loip.ms_per_token.unwrap(), po.ms_per_token.unwrap());
                assert!(
                    l <= p * (1.0 + 1e-9),
                    "{k:?}: loip {l} ms/token, pp-offload {p}"
                );
            }
        }
    }
}

fn small_memory_sweep() -> Experiment {
    let mut e = experiments("memory-sweep").unwrap().remove(0);
    let bases: Vec<_> = sweep_base_setups()
        .into_iter()
        .filter(|s| s.name == "32b-3dev")
        .collect();
    e.setups = sweep_setups(&bases, &[1.2, 1.0, 0.8, 0.5, 0.1]).unwrap();
    e.methods = Method::MAIN.to_vec();
    e.bandwidths = vec![Bandwidth::Mbps(100.0)];
    e
}

#[test]
fn memory_sweep_is_deterministic_and_loip_places_where_anyone_does() {
    let cfg = ExperimentConfig {
        output_tokens: 32,
        ..Default::default()
    };
    let a = run_experiments(vec![small_memory_sweep()], &cfg, &|_, _| {}).unwrap();
    let b = run_experiments(vec![small_memory_sweep()], &cfg, &|_, _| {}).unwrap();
    assert_eq!(a.records, b.records);
    assert_eq!(a.records.len(), 5 * 2 * 7);
    check(&a);
    for r in &a.records {
        let want: f64 = r.setup.split('@').nth(1).unwrap().parse().unwrap();
        assert!(
            (r.budget_ratio - want).abs() < 1e-3,
            "{} {}",
            r.setup,
            r.budget_ratio
        );
        assert_eq!(r.output_tokens, 32);
    }
    // Below the weight bytes only offloading places the model; at a tenth no pipeline does
    // and nothing finishes (TPI-LLM, split by memory, still places its window, too slowly).
    let loip_ok = |ratio: &str, p: Pattern| {
        a.records.iter().any(|r| {
            r.method == "loip"
                && r.setup.ends_with(ratio)
                && r.pattern == p
                && r.status == Status::Ok
        })
    };
    assert!(loip_ok("@0.80", Pattern::Sporadic) && loip_ok("@0.80", Pattern::Bursty));
    assert!(a
        .records
        .iter()
        .filter(|r| r.setup.ends_with("@0.10"))
        .all(|r| r.status != Status::Ok
            && (r.method.starts_with("tpi-llm") || r.status == Status::Oom)));
    let j = serde_json::to_value(report::json_records(&a.records)).unwrap();
    assert!(j[0]["budget_ratio"].as_f64().is_some());
    assert_eq!(j[0]["output_tokens"], 32);
}

#[test]
fn context_sweep_adapts_and_loip_never_loses_to_pp_offload() {
    // 32B on 3 devices with just above the weight bytes: the KV of 2·|D| sequences does not
    // fit for the whole run at the longer output.
    let mut e = experiments("context-sweep").unwrap().remove(0);
    let bases: Vec<_> = sweep_base_setups()
        .into_iter()
        .filter(|s| s.name == "32b-3dev")
        .collect();
    e.setups = sweep_setups(&bases, &[1.05]).unwrap();
    e.outputs = vec![64, 2048];
    e.methods = vec![
        Method::Loip,
        Method::LoipNoKvtransfer,
        Method::Pp,
        Method::PpOffload,
        Method::Edgeshard,
    ];
    let cfg = ExperimentConfig::default();
    let res = run_experiments(vec![e.clone()], &cfg, &|_, _| {}).unwrap();
    assert_eq!(res.records.len(), 2 * 2 * 5);
    check(&res);
    let seqs: Vec<u32> = res.records.iter().map(|r| r.sequences).collect();
    assert!(seqs.contains(&3) && seqs.contains(&6));
    // The baselines recompute at the longest output with 2·|D| sequences: the whole run does
    // not fit, so they were placed for the prompt.
    let long = |m: &str| {
        res.records
            .iter()
            .find(|r| r.method == m && r.output_tokens == 2048 && r.sequences == 6)
            .unwrap()
    };
    let pp = long("pp");
    assert_eq!(pp.planned_for.as_deref(), Some("prompt"), "{pp:?}");
    assert!(pp.evicted_tokens > 0 || pp.status != Status::Ok, "{pp:?}");
    assert!(long("loip").status == Status::Ok);
    // The markdown has the sweep columns and the ablation summary.
    let md = report::markdown(&res);
    assert!(md.contains("| budget ratio |") && md.contains("loip placed for"));
    assert!(md.contains("Where each LOIP component matters"));
}

#[test]
fn sweep_definitions_reach_the_premise() {
    assert!(SWEEP_RATIOS.len() >= 10);
    assert_eq!(SWEEP_RATIOS[0], 1.3);
    let ms = experiments("memory-sweep").unwrap().remove(0);
    let bases: Vec<&str> = ms.setups.iter().map(|s| s.base_name()).collect();
    for b in ["70b-5dev", "70b-4dev", "32b-3dev"] {
        assert_eq!(
            bases.iter().filter(|&&x| x == b).count(),
            SWEEP_RATIOS.len()
        );
    }
    for s in &ms.setups {
        let want: f64 = s.name.split('@').nth(1).unwrap().parse().unwrap();
        assert!((s.budget_ratio().unwrap() - want).abs() < 1e-3);
    }
    assert_eq!(ms.patterns.len(), 2);
    assert_eq!(ms.bandwidths.len(), 2);
    let cs = experiments("context-sweep").unwrap().remove(0);
    assert_eq!(cs.outputs.first(), Some(&512));
    assert_eq!(cs.outputs.last(), Some(&8192));
    assert_eq!(cs.sequence_factors, vec![1, 2]);
    let all: Vec<String> = experiments("all")
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(all.contains(&"memory-sweep".to_string()));
    assert!(all.contains(&"context-sweep".to_string()));
}
