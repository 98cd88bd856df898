//! KV lending on the peer session against lending through the coordinator, side by side in
//! one run: the `adapt_lend` setup (tiny-llama fixture, two workers in this process with two
//! one-layer stages each, the first with room for 12 tokens of KV, so it lends to the second
//! from the 11th token on), every worker and the coordinator sending at most the emulated
//! bandwidth. The runs alternate direct (hops and lent KV on the peer sessions), `relay`
//! (everything through the coordinator), and the two without lending. Prints per run: ms per decode token, the lent KV's
//! fetch-back round trip (request to last byte; timed by the lender on the peer session, by
//! the coordinator when relayed), fetches, bytes per fetch, and whether the tokens match the
//! first run's.
//!
//! `cargo run --release -p loip-runtime --example lend_bench -- [BANDWIDTH_BYTES_PER_S
//! (1.25e6 = 10 Mbit/s)] [ROUNDS (3)] [TOKENS (60)]`

#[path = "../tests/adapt_common/mod.rs"]
mod adapt_common;
#[path = "../tests/dist_common/mod.rs"]
mod dist_common;

use std::time::Duration;

use adapt_common::{full_fixed, session_options, two_device_plan, worker_specs};
use dist_common::{fixture, greedy, recorded, scratch, slices_of};
use loip_model::slice::Manifest;
use loip_runtime::cluster_run::{Session, SessionOptions};
use loip_runtime::coordinator::next_seq_id;
use loip_runtime::worker::{run_blocking, WorkerOptions};

const PROMPT: &[u32] = &[1, 5, 9, 23, 42, 7];

/// A worker on its own thread and runtime, sending at most `bw` bytes/s; its address.
fn worker(name: &str, mem: u64, store: std::path::PathBuf, bw: f64) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut o = WorkerOptions::new("127.0.0.1:0", mem, store);
    o.name = Some(name.to_string());
    o.bandwidth = Some(bw);
    std::thread::spawn(move || {
        let _ = run_blocking(o, |a| {
            let _ = tx.send(a);
        });
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("worker")
        .to_string()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bw: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1.25e6);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3);
    let tokens: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(60);
    let slices = slices_of(&fixture("tiny-llama"), "tiny-llama");
    let m = Manifest::load(&slices).expect("manifest");
    let (names, plan, kv_per_token) = two_device_plan(&m);
    let held = [12, 4000];
    println!(
        "lending at {:.1} Mbit/s per sender, {tokens} tokens a run",
        bw * 8.0 / 1e6
    );
    println!("| run | lent KV | ms/token | fetch round trip ms | fetches | bytes/fetch | lent tokens/stage | tokens |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut first: Option<Vec<u32>> = None;
    for round in 0..rounds {
        for (relay, lending) in [(false, true), (true, true), (false, false), (true, false)] {
            let root = scratch(&format!("lend-bench-{round}-{relay}-{lending}"));
            let addrs: Vec<String> = (0..2)
                .map(|i| {
                    let mem = full_fixed(&m, &plan, i) + held[i] * kv_per_token;
                    worker(&names[i], mem, root.join(&names[i]), bw)
                })
                .collect();
            let mut opts = SessionOptions {
                lending,
                relay,
                ..session_options(plan.clone(), PROMPT.len())
            };
            opts.connect.bandwidth = Some(bw);
            let s = Session::start(&slices, worker_specs(&names, &addrs), opts).expect("session");
            let seq = next_seq_id();
            let _ = s.take_totals();
            let (ids, _) =
                recorded(s.pipeline().backend(), seq, PROMPT, &greedy(tokens)).expect("generate");
            let t = s.take_totals();
            let l = s.pipeline().lend_totals();
            let ad = s.adaptation().expect("adaptation");
            let path = match (relay, lending) {
                (false, true) => "direct",
                (true, true) => "relayed",
                (false, false) => "off (hops direct)",
                (true, false) => "off (relayed)",
            };
            s.pipeline().release(&[seq]);
            s.shutdown();
            let fetches = l.direct_fetches + l.relayed_fetches;
            let per = |x: f64, n: u64| if n > 0 { x / n as f64 } else { 0.0 };
            let same = match &first {
                None => {
                    first = Some(ids.clone());
                    "reference"
                }
                Some(f) if *f == ids => "identical",
                Some(_) => "DIFFERENT",
            };
            println!(
                "| {} | {} | {:.2} | {:.2} | {fetches} | {:.0} | {} | {same} |",
                round + 1,
                path,
                per(t.decode.wall_s * 1e3, t.decode_steps),
                per(l.fetch_s * 1e3, fetches),
                per(l.bytes as f64, fetches),
                ad.devices[0].lent_tokens,
            );
        }
    }
}
