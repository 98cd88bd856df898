//! Planning time of every planner for LLaMA-3.3-70B (80 layers) on 8 devices.
//!
//! `cargo run --release -p loip-plan --example plan_bench` prints a table (median and best of
//! several runs per planner and pattern) and the `loip` plan. Target: `loip` under 100 ms.

use loip_plan::planners::{planners, PlanRequest};
use loip_plan::{render, Cluster, LinkProfile, ModelShape, Pattern};
use std::time::Instant;

fn cluster(names: &[&str]) -> Cluster {
    let link = LinkProfile {
        bandwidth: 12.5e6,
        latency: 2e-3,
    };
    Cluster::of_presets(names, link).expect("shipped presets")
}

fn main() {
    let shape = ModelShape::from_dims(
        "llama3.3-70b",
        8192,
        28672,
        80,
        64,
        8,
        128,
        128256,
        false,
        2.0,
        2,
    );
    let setups: [(&str, Vec<&str>); 3] = [
        (
            "2x orin64 + 4x orin32 + 2x nx16 (fits in memory)",
            vec![
                "orin64", "orin64", "orin32", "orin32", "orin32", "orin32", "nx16", "nx16",
            ],
        ),
        (
            "2x orin32 + 6x nx16 (tight: some offloading)",
            vec![
                "orin32", "orin32", "nx16", "nx16", "nx16", "nx16", "nx16", "nx16",
            ],
        ),
        (
            "8x nx16 (104 GiB for a 131 GiB model: heavy offloading)",
            vec!["nx16"; 8],
        ),
    ];
    let runs = 7;
    println!("llama3.3-70b (80 layers) on 8 devices, 100 Mbit/s, 2 ms, context 2048; median and best of {runs} runs");
    for (title, names) in &setups {
        let cluster = cluster(names);
        println!("\n{title}");
        println!(
            "{:<24} {:<9} {:>12} {:>12} {:>12}",
            "planner", "pattern", "median ms", "best ms", "ms/token"
        );
        for pattern in [Pattern::Sporadic, Pattern::Bursty] {
            let req = PlanRequest {
                context: 2048,
                pattern,
                ..PlanRequest::default()
            };
            for p in planners() {
                let mut times = Vec::with_capacity(runs);
                let mut pred = String::new();
                for _ in 0..runs {
                    let t0 = Instant::now();
                    let r = p.plan(&shape, &cluster, &req);
                    times.push(t0.elapsed().as_secs_f64() * 1e3);
                    pred = match r {
                        Ok(plan) => format!("{:.1}", plan.predicted_ms_per_token),
                        Err(_) => "OOM".into(),
                    };
                }
                times.sort_by(f64::total_cmp);
                println!(
                    "{:<24} {:<9} {:>12.3} {:>12.3} {:>12}",
                    p.name(),
                    pattern.to_string(),
                    times[runs / 2],
                    times[0],
                    pred
                );
            }
        }
    }
    let req = PlanRequest {
        context: 2048,
        ..PlanRequest::default()
    };
    if let Ok(plan) = loip_plan::plan("loip", &shape, &cluster(&setups[2].1), &req) {
        println!("\n{}", render::plan_table(&plan));
    }
}
