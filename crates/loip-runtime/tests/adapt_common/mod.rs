//! What the adaptation tests share: budgets of a fixed plan and workers in this process.
#![allow(dead_code)]

use std::time::Duration;

use loip_model::slice::{Manifest, SliceKind};
use loip_runtime::executor::working_bytes;
use loip_runtime::worker::{run_blocking, WorkerOptions};

/// Most tokens in one step of these tests.
pub const MAX_STEP: usize = 16;
/// Context of these tests.  // tokens
pub const CONTEXT: usize = 256;

/// Bytes of one slice.
pub fn size(m: &Manifest, k: SliceKind) -> u64 {
    m.slice(k).map(|s| s.size).unwrap_or(0)
}

/// Resident bytes of plan device `i` with everything resident, plus its working buffers.
pub fn full_fixed(m: &Manifest, plan: &loip_plan::Plan, i: usize) -> u64 {
    let d = &plan.devices[i];
    let mut b = working_bytes(m, MAX_STEP, 1, CONTEXT);
    if d.holds_embedding || (d.holds_head && m.config.tie_word_embeddings) {
        b += size(m, SliceKind::Embed);
    }
    if d.holds_head {
        b += size(m, SliceKind::Head);
    }
    for s in &d.stages {
        for l in &s.layers {
            b += size(m, SliceKind::Attn(l.layer as usize))
                + size(m, SliceKind::Mlp(l.layer as usize));
        }
    }
    b
}

/// The tests' fixed plan: two devices `dev1`, `dev2` of two one-layer stages each, nothing
/// offloaded; its device names and the KV bytes per token of one device (two layers, K and V,
/// f32).
pub fn two_device_plan(m: &Manifest) -> (Vec<String>, loip_plan::Plan, u64) {
    let names: Vec<String> = vec!["dev1".into(), "dev2".into()];
    let plan = loip_runtime::cluster_run::uniform_plan(
        "m",
        m.config.num_layers as u32,
        &names,
        2,
        loip_plan::ExecMode::Overlapped,
        &|_, _| (0, 0),
    )
    .unwrap();
    let c = &m.config;
    let kv_per_token = 2 * (c.num_kv_heads * c.head_dim) as u64 * 4 * 2;
    (names, plan, kv_per_token)
}

/// A plan over `names`, two one-layer stages each, every block offloaded.
pub fn offloaded_plan(m: &Manifest, names: &[String]) -> loip_plan::Plan {
    loip_runtime::cluster_run::uniform_plan(
        "m",
        m.config.num_layers as u32,
        names,
        2,
        loip_plan::ExecMode::Overlapped,
        &|_, n| (n, n),
    )
    .unwrap()
}

/// Worker specs of `names` at `addrs`. The fixed plan is checked against the planner's
/// working allowance (16 MiB of scratch); the worker opens with its own, small budget, which
/// is the truth.
pub fn worker_specs(
    names: &[String],
    addrs: &[String],
) -> Vec<loip_runtime::cluster_run::WorkerSpec> {
    names
        .iter()
        .zip(addrs)
        .map(|(n, a)| loip_runtime::cluster_run::WorkerSpec {
            profile: loip_plan::profile::preset("host-zen5-2c"),
            mem: Some(1 << 30),
            ..loip_runtime::cluster_run::WorkerSpec::new(n, a)
        })
        .collect()
}

/// The session options of these tests: the fixed `plan`, direct loader, `admitted` prompt
/// tokens planned for at admission.
pub fn session_options(
    plan: loip_plan::Plan,
    admitted: usize,
) -> loip_runtime::cluster_run::SessionOptions {
    loip_runtime::cluster_run::SessionOptions {
        plan: Some(plan),
        measure_links: false,
        loader: loip_runtime::LoaderKind::Direct,
        shape_name: "m".into(),
        context: CONTEXT as u64,
        max_step_tokens: MAX_STEP,
        max_step_seqs: 1,
        step_timeout: Duration::from_secs(120),
        admitted: Some(admitted as u64),
        ..Default::default()
    }
}

/// The store quota of an in-process worker: explicit, so a test does not depend on the
/// disk's free space (the default, free space less 5 %, is 0 B on a nearly full disk).
/// Tests ship a few tiny models. // bytes
pub const STORE_QUOTA: u64 = 4 << 30;

/// Starts a worker in this process (its own runtime on a thread, its store's quota
/// [`STORE_QUOTA`]); its address.
pub fn in_process_worker(name: &str, mem: u64, store: std::path::PathBuf, refuse: u32) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut o = WorkerOptions::new("127.0.0.1:0", mem, store);
    o.name = Some(name.to_string());
    o.store_quota = Some(STORE_QUOTA);
    o.refuse_switches = refuse;
    std::thread::spawn(move || {
        let _ = run_blocking(o, |a| {
            let _ = tx.send(a);
        });
    });
    rx.recv_timeout(Duration::from_secs(60))
        .unwrap()
        .to_string()
}
