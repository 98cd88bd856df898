//! `--preview` as a person uses it before committing a cluster: `loip api` and `loip serve`
//! print the plan over their workers (per device: stages, resident/offloaded blocks, memory
//! against budget, predicted ms/token and its breakdown) and stop without loading; the
//! workers are free for the next coordinator. Helpers in `common/api.rs`.

mod common;
use common::api::*;
use common::*;

use std::process::Stdio;

#[test]
fn preview_prints_the_plan_and_loads_nothing() {
    let model = fixture("tiny-qwen3");
    let (dir, workers, cluster) = workers_and_cluster("preview", 2);
    let plan_json = dir.join("plan.json");
    for cmd in ["api", "serve"] {
        let out = loip()
            .args([cmd, "--model", &model, "--cluster"])
            .arg(&cluster)
            .args([
                "--token",
                TEST_TOKEN,
                "--planner",
                "loip-uniform",
                "--preview",
            ])
            .arg("--plan-out")
            .arg(&plan_json)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{cmd}: {err}");
        for want in [
            "device w1",
            "device w2",
            "resident",
            "offload",
            "memory / budget",
            "predicted",
            "ms/token",
            "preview only",
        ] {
            assert!(err.contains(want), "{cmd}: no {want:?} in\n{err}");
        }
        // stopped before loading: no server, no prompt loop, no slices beyond the probe's
        assert!(!err.contains("listening on"), "{cmd}: {err}");
        assert!(!err.contains("ready:"), "{cmd}: {err}");
        let plan: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&plan_json).unwrap()).unwrap();
        assert_eq!(plan["devices"].as_array().map(Vec::len), Some(2), "{plan}");
    }
    drop(workers);
    let _ = std::fs::remove_dir_all(&dir);
}
