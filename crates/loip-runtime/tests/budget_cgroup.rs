//! `--mem` as a contract the kernel enforces: worker processes whose whole-process budget is
//! exactly their memory cgroup's limit, driven by a hostile coordinator. The kernel judges:
//! each test reads the cgroup's peak charge (`memory.peak` / `max_usage_in_bytes`) and OOM
//! kills, prints them, and skips with a printed reason where memory cgroups cannot be made.

mod dist_common;

use std::time::Duration;

use dist_common::raw;
use loip_model::slice::Manifest;
use loip_runtime::cluster_run::WorkerProcess;
use loip_runtime::wire::lend::{encode_kv, KvHeader, KvOp};
use loip_runtime::wire::{FrameKind, ToCoordinator, ToWorker};

#[test]
fn dist_worker_entry() {
    dist_common::worker_entry();
}

const TOKEN: &str = "a-test-token-of-some-length";

use dist_common::rt;

fn store_with_slices(name: &str) -> std::path::PathBuf {
    dist_common::store_with_slices(name, "budget-cgroup")
}

fn manifest() -> Manifest {
    let slices = dist_common::slices_of(&dist_common::fixture("tiny-llama"), "budget-cgroup");
    Manifest::load(&slices).unwrap()
}

/// A worker process whose whole-process budget `mem` is its cgroup's limit; None (with the
/// reason printed) where cgroups cannot be made.
fn confined_worker(name: &str, mem: u64) -> Option<WorkerProcess> {
    if let Some(why) = dist_common::cgroup_skip_reason() {
        eprintln!("skipping: {why}");
        return None;
    }
    Some(dist_common::spawn_worker(&dist_common::W {
        name: name.into(),
        mem,
        store: store_with_slices(name),
        token: Some(TOKEN.into()),
        whole_process: true,
        cgroup: Some(mem),
        ..Default::default()
    }))
}

/// The kernel's verdict on `w`'s cgroup: no OOM kill, peak charge within `mem`.
fn judge(what: &str, w: &WorkerProcess, mem: u64) {
    let r = w.memory().expect("a confined worker");
    let peak = r.peak.unwrap_or(0);
    eprintln!(
        "{what}: cgroup limit {} MiB, peak charge {:.1} MiB, OOM kills {}, limit reached {} times",
        mem >> 20,
        peak as f64 / (1 << 20) as f64,
        r.oom_kills,
        r.pressure_events
    );
    assert_eq!(r.oom_kills, 0, "{what}: the kernel killed the worker");
    assert!(peak <= mem, "{what}: peak charge {peak} over {mem}");
}

/// 100 lent-KV `Data` frames of 4 MiB (400 MiB in all, twice the budget) that no stage asked
/// back, sent without reading a reply: each is refused before it is held, and the worker
/// answers a ping afterwards. (Before, they queued for the compute thread without bound.)
#[test]
fn lent_kv_frames_nobody_asked_for_are_refused_within_a_200mib_cgroup() {
    const MEM: u64 = 200 << 20;
    let Some(w) = confined_worker("kv-data", MEM) else {
        return;
    };
    rt().block_on(async {
        let mut s = raw::authed(&w.addr, Some(TOKEN)).await;
        let h = KvHeader {
            op: KvOp::Data,
            lender: 0,
            stage: 3,
        };
        let frame = encode_kv(h, &vec![7u8; (4 << 20) - 4096]);
        for _ in 0..100 {
            s.send(FrameKind::Kv, &frame).await;
        }
        for _ in 0..100 {
            match s.recv_control().await {
                ToCoordinator::Failed { message, .. } => {
                    assert!(message.contains("did not ask back"), "{message}")
                }
                other => panic!("expected a refusal, got {other:?}"),
            }
        }
        s.control(&ToWorker::Ping { id: 9 }).await;
        assert!(matches!(
            s.recv_control().await,
            ToCoordinator::Pong { id: 9 }
        ));
    });
    judge("lent-KV flood", &w, MEM);
}

/// A probe runs within the engine's share of a 64 MiB worker: its cache-flush buffer (96 MiB
/// before) and its KV rows are sized from the budget; repeated probes do not grow the charge.
#[test]
fn a_probe_fits_the_engine_share_of_a_64mib_cgroup() {
    const MEM: u64 = 64 << 20;
    let Some(w) = confined_worker("probe", MEM) else {
        return;
    };
    rt().block_on(async {
        let mut s = raw::authed(&w.addr, Some(TOKEN)).await;
        for _ in 0..3 {
            s.control(&ToWorker::Probe {
                manifest: manifest(),
                compute: true,
                loads: true,
            })
            .await;
            let reply = tokio::time::timeout(Duration::from_secs(60), s.recv_control())
                .await
                .expect("a probe answer");
            assert!(
                matches!(reply, ToCoordinator::Probed(_)),
                "expected a probe result, got {reply:?}"
            );
        }
    });
    judge("three probes", &w, MEM);
}
