//! Network time per decode step, direct forwarding against relaying through the coordinator,
//! side by side in one run: 3 `loip worker` processes on loopback, each (and the coordinator)
//! sending at most the emulated bandwidth; one fixed plan (3 devices × 2 stages, nothing
//! offloaded); the runs alternate direct / relay. Prints the measured breakdown per run, the
//! cost model's communication figure for the same plan over the link that setup measured
//! (peer links when direct, the star's halved figure when relaying), and the bytes per link.
//!
//! `cargo run --release -p loip-runtime --example direct_bench -- LOIP_BINARY SLICES_DIR
//! [BANDWIDTH_BYTES_PER_S (6.25e6 = 50 Mbit/s)] [ROUNDS (2)] [TOKENS (32)]`

use std::process::Command;
use std::time::Duration;

use loip_engine::{GenerateOptions, SamplingParams};
use loip_model::slice::Manifest;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{
    uniform_plan, Breakdown, Session, SessionOptions, WorkerProcess, WorkerSpec,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: direct_bench LOIP_BINARY SLICES_DIR [BANDWIDTH] [ROUNDS] [TOKENS]");
        std::process::exit(2);
    }
    let (bin, dir) = (&args[1], std::path::PathBuf::from(&args[2]));
    let bw: f64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(6.25e6);
    let rounds: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(2);
    let tokens: usize = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(32);
    let token = "direct-bench-token-0123456789";
    let root = std::env::temp_dir().join(format!("loip-direct-bench-{}", std::process::id()));
    let names: Vec<String> = (1..=3).map(|i| format!("dev{i}")).collect();
    let workers: Vec<WorkerProcess> = names
        .iter()
        .map(|n| {
            let mut c = Command::new(bin);
            c.args([
                "worker",
                "--listen",
                "127.0.0.1:0",
                "--exit-with-parent",
                "--name",
                n,
            ])
            .args(["--mem", &(2u64 << 30).to_string()])
            .arg("--store")
            .arg(root.join(n))
            .args(["--bandwidth", &bw.to_string()])
            .env("LOIP_TOKEN", token);
            WorkerProcess::spawn(c, Duration::from_secs(60)).expect("worker")
        })
        .collect();
    let m = Manifest::load(&dir).expect("manifest");
    let plan = uniform_plan(
        "bench",
        m.config.num_layers as u32,
        &names,
        2,
        ExecMode::Overlapped,
        &|_, _| (0, 0),
    )
    .expect("plan");
    let gen = GenerateOptions {
        max_tokens: tokens,
        sampling: SamplingParams::default(),
        eos_ids: vec![],
        min_tokens: 0,
    };
    let prompt: Vec<u32> = vec![1, 504, 2030, 282, 260, 2358, 5045];
    println!("| run | step ms | compute ms | network ms | predicted comm ms | link used by the plan | coordinator bytes/step | worker↔worker bytes/step |");
    println!("|---|---|---|---|---|---|---|---|");
    for round in 0..rounds {
        for relay in [false, true] {
            let specs = names
                .iter()
                .zip(&workers)
                .map(|(n, w)| WorkerSpec {
                    profile: loip_plan::profile::preset("host-zen5-2c"),
                    ..WorkerSpec::new(n, &w.addr)
                })
                .collect();
            let mut o = SessionOptions {
                plan: Some(plan.clone()),
                shape_name: "bench".into(),
                context: 256,
                max_step_tokens: 32,
                greedy: true,
                relay,
                ..Default::default()
            };
            o.connect.token = Some(token.into());
            o.connect.bandwidth = Some(bw);
            let s = Session::start(&dir, specs, o).expect("session");
            let predicted = loip_plan::cost::evaluate(&s.plan, &s.shape, &s.cluster)
                .map(|c| c.breakdown.comm_ms)
                .unwrap_or(f64::NAN);
            let before = s.link_bytes();
            let _ = s.take_totals();
            let out = s
                .generate(&prompt, &gen, &mut |_| {
                    loip_engine::generate::Flow::Continue
                })
                .expect("generate");
            let b = Breakdown::of(&s.take_totals());
            let steps = (out.new_ids.len().max(2) - 1) as f64 + 1.0;
            let (mut coord, mut peer) = (0u64, 0u64);
            for l in s.link_bytes() {
                let was = before
                    .iter()
                    .find(|x| x.from == l.from && x.to == l.to)
                    .map_or(0, |x| x.bytes);
                if l.from == "coordinator" || l.to == "coordinator" {
                    coord += l.bytes - was;
                } else {
                    peer += l.bytes - was;
                }
            }
            let link = s.cluster.link;
            println!(
                "| {} {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} MB/s, {:.2} ms | {:.0} | {:.0} |",
                if relay { "relay" } else { "direct" },
                round + 1,
                b.step_ms,
                b.compute_ms,
                b.network_ms,
                predicted,
                link.bandwidth / 1e6,
                link.latency * 1e3,
                coord as f64 / steps,
                peer as f64 / steps,
            );
            s.shutdown();
        }
    }
    drop(workers);
    let _ = std::fs::remove_dir_all(&root);
}
