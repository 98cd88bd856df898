//! Sanity of the cost model and planners: breakdowns add up, more memory never hurts `loip`,
//! more bandwidth never hurts `pp`, `edgeshard` or `loip`, `loip` beats every planner in its
//! search space, and plan helpers / validation behave.

mod common;

use common::{instance, llama13b, llama70b, preset_cluster, qwen32b};
use loip_plan::planners::{plan_all, planner_names, PlanRequest};
use loip_plan::{cost, render, ExecMode, Pattern, Plan, PlanError, PlanInvalid, Residency};
use proptest::prelude::*;

fn le(a: f64, b: f64) -> bool {
    a <= b + 1e-9 * b.abs().max(1e-9)
}

fn paper_setups() -> Vec<(loip_plan::ModelShape, loip_plan::Cluster)> {
    vec![
        (
            llama70b(),
            preset_cluster(&["orin64", "orin32", "orin32", "orin32", "nx16"], 100.0),
        ),
        (llama13b(), preset_cluster(&["orin32", "nx16"], 100.0)),
        (
            qwen32b(),
            preset_cluster(&["orin64", "orin32", "nx16"], 200.0),
        ),
        (
            llama70b(),
            preset_cluster(&["orin64", "orin64", "orin32", "nx16"], 200.0),
        ),
        (llama70b(), preset_cluster(&["orin32", "nx16"], 100.0)),
    ]
}

#[test]
fn breakdown_adds_up_for_every_planner() {
    let mut planned = 0;
    for (shape, cluster) in paper_setups() {
        for pattern in [Pattern::Sporadic, Pattern::Bursty] {
            for context in [0, 2048, 16384] {
                let req = PlanRequest {
                    context,
                    pattern,
                    ..PlanRequest::default()
                };
                for (name, r) in plan_all(&shape, &cluster, &req) {
                    let Ok(p) = r else { continue };
                    planned += 1;
                    let b = &p.breakdown;
                    assert!(
                        (b.total_ms() - p.predicted_ms_per_token).abs()
                            < 1e-9 * p.predicted_ms_per_token,
                        "{name}"
                    );
                    assert!(
                        b.compute_ms > 0.0 && b.comm_ms >= 0.0 && b.uncovered_load_ms >= 0.0,
                        "{name}"
                    );
                    p.validate(&shape, &cluster)
                        .unwrap_or_else(|e| panic!("{name}: {e}"));
                    let again = cost::evaluate(&p, &shape, &cluster).unwrap();
                    assert_eq!(again.ms_per_token, p.predicted_ms_per_token);
                    if p.mode == ExecMode::Sequential && pattern == Pattern::Sporadic {
                        let loads: f64 = p.devices.iter().map(|d| d.load_ms).sum();
                        assert!(
                            (loads - b.uncovered_load_ms).abs() < 1e-6,
                            "{name}: sequential loads are all uncovered"
                        );
                    }
                }
            }
        }
    }
    assert!(planned > 100, "{planned}");
}

#[test]
fn loip_is_best_in_its_search_space() {
    for (shape, cluster) in paper_setups() {
        for pattern in [Pattern::Sporadic, Pattern::Bursty] {
            let req = PlanRequest {
                context: 4096,
                pattern,
                ..PlanRequest::default()
            };
            let results = plan_all(&shape, &cluster, &req);
            let loip = results
                .iter()
                .find(|r| r.0 == "loip")
                .unwrap()
                .1
                .as_ref()
                .map(|p| p.predicted_ms_per_token);
            for (name, r) in &results {
                // pp-offload runs in sequential mode, outside loip's space; the loader ablation
                // is priced differently.
                if name == "pp-offload" || name == "loip-conventional-load" {
                    continue;
                }
                if let Ok(p) = r {
                    let l = *loip
                        .as_ref()
                        .unwrap_or_else(|e| panic!("loip failed where {name} planned: {e}"));
                    assert!(
                        le(l, p.predicted_ms_per_token),
                        "{name} {} beats loip {l}",
                        p.predicted_ms_per_token
                    );
                }
            }
        }
    }
}

#[test]
fn memory_constrained_70b_offloads_and_fits() {
    let shape = llama70b();
    let mut cluster = preset_cluster(&["orin64", "orin32", "orin32", "orin32", "nx16"], 100.0);
    // Reservation (iii): 5 GB on the Orin64, 3 GB on two Orin32, 1 GB on the NX.
    for (i, r) in [(0, 5e9), (1, 3e9), (2, 3e9), (4, 1e9)] {
        cluster.devices[i].reserve = r as u64;
    }
    let req = PlanRequest {
        context: 4096,
        ..PlanRequest::default()
    };
    let p = loip_plan::plan("loip", &shape, &cluster, &req).unwrap();
    p.validate(&shape, &cluster).unwrap();
    for d in &p.devices {
        assert!(d.memory_bytes <= d.budget_bytes);
    }
    assert!(render::plan_table(&p).contains("orin64-0"));
}

#[test]
fn does_not_fit_names_device_and_bytes() {
    let shape = llama70b();
    let mut cluster = preset_cluster(&["nx16"], 100.0);
    // 1 GiB left: less than embedding + head + buffers.
    cluster.devices[0].reserve = 12 << 30;
    let req = PlanRequest::default();
    for name in planner_names() {
        match loip_plan::plan(name, &shape, &cluster, &req) {
            Err(PlanError::DoesNotFit {
                device,
                lacks_bytes,
                planner,
            }) => {
                assert_eq!(device, "nx16-0");
                assert!(lacks_bytes > 0, "{name}");
                assert_eq!(planner, name);
            }
            other => panic!("{name}: {other:?}"),
        }
    }
    let table = render::compare_table(&plan_all(&shape, &cluster, &req));
    assert!(table.contains("OOM"), "{table}");
}

#[test]
fn unknown_planner_lists_valid_names() {
    let err = loip_plan::plan(
        "magic",
        &llama13b(),
        &preset_cluster(&["orin32"], 100.0),
        &PlanRequest::default(),
    )
    .unwrap_err();
    let msg = err.to_string();
    for n in [
        "loip",
        "loip-paper",
        "loip-uniform",
        "pp",
        "pp-offload",
        "edgeshard",
    ] {
        assert!(msg.contains(n), "{msg}");
    }
}

#[test]
fn plan_helpers_and_json_round_trip() {
    let shape = llama70b();
    let cluster = preset_cluster(&["orin32", "orin32", "nx16"], 100.0);
    let req = PlanRequest {
        context: 2048,
        allow_drop: false,
        ..PlanRequest::default()
    };
    let p = loip_plan::plan("loip", &shape, &cluster, &req).unwrap();
    assert!(
        p.stages_per_device > 1,
        "70B on 72 GiB must offload with several stages"
    );
    let back = Plan::from_json(&p.to_json()).unwrap();
    assert_eq!(back, p);
    back.validate(&shape, &cluster).unwrap();
    // stage_order covers 0..L contiguously, round-robin.
    let order = p.stage_order();
    assert_eq!(order.len(), p.devices.len() * p.stages_per_device as usize);
    let mut next = 0;
    for (k, r) in order.iter().enumerate() {
        assert_eq!(r.device, k % p.devices.len());
        assert_eq!(r.stage, k / p.devices.len());
        assert_eq!(r.layers.start, next);
        next = r.layers.end;
        for l in r.layers.clone() {
            assert_eq!(p.device_of_layer(l), Some(r.device));
        }
    }
    assert_eq!(next, shape.layers);
    assert_eq!(p.device_of_layer(shape.layers), None);
    for (i, d) in p.devices.iter().enumerate() {
        let largest = d
            .stages
            .iter()
            .map(|s| s.offloaded_bytes(&shape))
            .max()
            .unwrap();
        assert_eq!(p.slot_bytes(&shape, i), largest);
        assert_eq!(d.slot_bytes, largest);
    }
    // Thresholds: TS¹ = ⌊Left / (s·n·κ)⌋ and the KV at the planned context fits under it.
    for t in cost::thresholds(&p, &shape, &cluster).unwrap() {
        let d = p.devices.iter().find(|d| d.name == t.name).unwrap();
        assert_eq!(
            t.first_threshold,
            t.left_bytes / (d.layer_count() as u64 * shape.kv_bytes_per_token)
        );
        assert!(t.first_threshold >= p.context);
    }
}

#[test]
fn validate_rejects_hand_edits() {
    let shape = llama13b();
    let cluster = preset_cluster(&["orin32", "nx16"], 100.0);
    let req = PlanRequest {
        context: 1024,
        allow_drop: false,
        ..PlanRequest::default()
    };
    let p = loip_plan::plan("loip", &shape, &cluster, &req).unwrap();
    p.validate(&shape, &cluster).unwrap();

    let mut q = p.clone();
    let moved = q.devices[0].stages[0].layers.pop().unwrap();
    q.devices[1].stages[0].layers.insert(0, moved);
    // Still contiguous and in order: valid unless it breaks memory.
    let _ = q.validate(&shape, &cluster);

    let mut q = p.clone();
    q.devices[0].stages[0].layers.swap(0, 1);
    assert!(matches!(
        q.validate(&shape, &cluster),
        Err(PlanError::Invalid(PlanInvalid::LayerOrder { .. }))
    ));

    // A model with one more layer than the plan places.
    let mut longer = shape.clone();
    longer.layers += 1;
    assert!(matches!(
        p.validate(&longer, &cluster),
        Err(PlanError::Invalid(PlanInvalid::LayerCount {
            placed: 40,
            layers: 41
        }))
    ));

    let mut q = p.clone();
    q.devices[1].stages[0].layers.clear();
    assert!(matches!(
        q.validate(&shape, &cluster),
        Err(PlanError::Invalid(PlanInvalid::EmptyStage { .. }))
    ));

    let mut q = p.clone();
    q.stages_per_device += 1;
    assert!(matches!(
        q.validate(&shape, &cluster),
        Err(PlanError::Invalid(PlanInvalid::StageCount { .. }))
    ));

    let mut q = p.clone();
    q.devices[0].holds_head = true;
    assert!(matches!(
        q.validate(&shape, &cluster),
        Err(PlanError::Invalid(PlanInvalid::Roles(_)))
    ));

    let mut q = p.clone();
    q.devices[0].name = "nobody".into();
    assert!(matches!(
        q.validate(&shape, &cluster),
        Err(PlanError::UnknownDevice(_))
    ));

    // Over budget: retain every block and give the NX all but one layer.
    let mut q = p.clone();
    let all: Vec<_> = q
        .devices
        .iter()
        .flat_map(|d| d.stages.iter().flat_map(|s| s.layers.clone()))
        .collect();
    q.stages_per_device = 1;
    q.devices[0].stages = vec![loip_plan::StagePlan {
        layers: all[..1].to_vec(),
    }];
    q.devices[1].stages = vec![loip_plan::StagePlan {
        layers: all[1..].to_vec(),
    }];
    for l in q
        .devices
        .iter_mut()
        .flat_map(|d| d.stages.iter_mut().flat_map(|s| s.layers.iter_mut()))
    {
        l.attn = Residency::Retained;
        l.mlp = Residency::Retained;
    }
    assert!(matches!(
        q.validate(&shape, &cluster),
        Err(PlanError::Invalid(PlanInvalid::OverBudget { .. }))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

    #[test]
    fn more_memory_never_hurts_loip(inst in instance(4, 10), dev in 0usize..4, extra in 0.01..1.0f64) {
        let before = loip_plan::plan("loip", &inst.shape, &inst.cluster(), &inst.request());
        let mut more = inst.clone();
        let j = dev % more.devs.len();
        more.devs[j].mem_frac += extra;
        let after = loip_plan::plan("loip", &more.shape, &more.cluster(), &more.request());
        if let Ok(b) = before {
            let a = after.expect("more memory cannot make loip fail");
            prop_assert!(le(a.predicted_ms_per_token, b.predicted_ms_per_token), "{} > {}", a.predicted_ms_per_token, b.predicted_ms_per_token);
        }
    }

    #[test]
    fn more_bandwidth_never_hurts(inst in instance(4, 10), factor in 1.0..100.0f64, lat in 0.0..1.0f64) {
        let mut fast = inst.clone();
        fast.bandwidth *= factor;
        fast.latency *= lat;
        for name in ["loip", "pp", "edgeshard"] {
            let before = loip_plan::plan(name, &inst.shape, &inst.cluster(), &inst.request());
            let after = loip_plan::plan(name, &fast.shape, &fast.cluster(), &fast.request());
            if let Ok(b) = before {
                let a = after.expect("more bandwidth cannot make a planner fail");
                prop_assert!(le(a.predicted_ms_per_token, b.predicted_ms_per_token), "{name}: {} > {}", a.predicted_ms_per_token, b.predicted_ms_per_token);
            }
        }
    }

    #[test]
    fn every_plan_is_valid_and_adds_up(inst in instance(4, 10)) {
        let cluster = inst.cluster();
        for (name, r) in plan_all(&inst.shape, &cluster, &inst.request()) {
            match r {
                Ok(p) => {
                    p.validate(&inst.shape, &cluster).map_err(|e| TestCaseError::fail(format!("{name}: {e}")))?;
                    prop_assert!((p.breakdown.total_ms() - p.predicted_ms_per_token).abs() <= 1e-9 * p.predicted_ms_per_token.max(1e-9));
                }
                Err(PlanError::DoesNotFit { lacks_bytes, .. }) => prop_assert!(lacks_bytes > 0, "{name}: lacks 0 bytes"),
                Err(PlanError::BadRequest(_)) => prop_assert!(inst.shape.layers < inst.devs.len() as u32),
                Err(e) => prop_assert!(false, "{name}: {e}"),
            }
        }
    }
}

#[test]
fn render_tables() {
    let shape = llama70b();
    let cluster = preset_cluster(&["orin32", "orin32", "nx16"], 100.0);
    let req = PlanRequest {
        context: 4096,
        allow_drop: false,
        ..PlanRequest::default()
    };
    let p = loip_plan::plan("loip", &shape, &cluster, &req).unwrap();
    let t = render::plan_table(&p);
    for d in &p.devices {
        assert!(t.contains(&d.name), "{t}");
    }
    assert!(
        t.contains("ms/token") && t.contains("GiB") && t.contains("[E]") && t.contains("[H]"),
        "{t}"
    );
    assert!(
        t.contains("(off:"),
        "a 70B plan on these budgets offloads: {t}"
    );
    let rows = plan_all(&shape, &cluster, &req);
    let c = render::compare_table(&rows);
    for (name, _) in &rows {
        assert!(c.contains(name.as_str()), "{c}");
    }
    assert!(c.contains("best"), "{c}");
    // One stage's summary: ranges and offloaded blocks.
    let st = loip_plan::StagePlan::with_offload(10, 5, 2, 3);
    assert_eq!(render::stage_summary(&st), "10-14 (off: A13-14 P12-14)");
}

#[test]
fn hand_written_plan_without_derived_fields() {
    let shape = loip_plan::ModelShape::from_dims("tiny", 64, 128, 4, 4, 2, 16, 100, true, 2.0, 2);
    let cluster = preset_cluster(&["orin32", "nx16"], 100.0);
    let text = r#"{
      "shape": "tiny", "planner": "hand", "stages_per_device": 2, "pattern": "sporadic",
      "context": 128, "micro_batches": 1, "mode": "overlapped", "loader": "direct",
      "devices": [
        { "name": "orin32-0", "holds_embedding": true, "holds_head": false, "stages": [
            { "layers": [ { "layer": 0, "attn": "retained", "mlp": "retained" } ] },
            { "layers": [ { "layer": 2, "attn": "retained", "mlp": "offloaded" } ] } ] },
        { "name": "nx16-1", "holds_embedding": false, "holds_head": true, "stages": [
            { "layers": [ { "layer": 1, "attn": "retained", "mlp": "retained" } ] },
            { "layers": [ { "layer": 3, "attn": "offloaded", "mlp": "offloaded" } ] } ] }
      ]
    }"#;
    let mut p = Plan::from_json(text).unwrap();
    p.validate(&shape, &cluster).unwrap();
    p.reprice(&shape, &cluster).unwrap();
    assert!(p.predicted_ms_per_token > 0.0);
    assert_eq!(p.devices[1].slot_bytes, shape.layer_bytes());
    assert_eq!(p.devices[0].slot_bytes, shape.mlp_bytes);
    let order: Vec<_> = p
        .stage_order()
        .into_iter()
        .map(|r| (r.device, r.stage, r.layers))
        .collect();
    assert_eq!(
        order,
        vec![(0, 0, 0..1), (1, 0, 1..2), (0, 1, 2..3), (1, 1, 3..4)]
    );
}
