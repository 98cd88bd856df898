//! A worker's store holds slices only up to its quota: a coordinator that sends more is
//! refused with an error that names the quota and the flag, before a byte is written, and
//! the worker keeps serving (a later session within the quota runs).

mod dist_common;

use std::time::Duration;

use dist_common::*;
use loip_model::slice::Manifest;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{uniform_plan, Session, SessionOptions};
use loip_runtime::worker::{run_blocking, WorkerOptions};

#[test]
fn dist_worker_entry() {
    worker_entry();
}

fn worker(store: std::path::PathBuf, quota: u64) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut o = WorkerOptions::new("127.0.0.1:0", 256 << 20, store);
    o.store_quota = Some(quota);
    std::thread::spawn(move || {
        let _ = run_blocking(o, |a| {
            let _ = tx.send(a);
        });
    });
    rx.recv_timeout(Duration::from_secs(60))
        .unwrap()
        .to_string()
}

fn session(slices: &std::path::Path, addr: &str) -> Result<Session, String> {
    session_with(slices, addr, None)
}

fn session_with(
    slices: &std::path::Path,
    addr: &str,
    on_ship: Option<loip_runtime::coordinator::OnShip>,
) -> Result<Session, String> {
    let m = Manifest::load(slices).unwrap();
    let names = vec!["dev1".to_string()];
    let plan = uniform_plan(
        "m",
        m.config.num_layers as u32,
        &names,
        1,
        ExecMode::Overlapped,
        &|_, n| (n, n),
    )
    .unwrap();
    let specs = dist_common::netns::worker_specs(&[addr.to_string()]);
    let opts = SessionOptions {
        plan: Some(plan),
        measure_links: false,
        shape_name: "m".into(),
        context: 64,
        max_step_tokens: 16,
        step_timeout: Duration::from_secs(60),
        on_ship,
        ..Default::default()
    };
    Session::start(slices, specs, opts).map_err(|e| e.to_string())
}

#[test]
fn slices_beyond_the_store_quota_are_refused_and_the_worker_lives() {
    let slices = slices_of(&fixture("tiny-llama"), "store-quota");
    let total: u64 = Manifest::load(&slices)
        .unwrap()
        .slices
        .iter()
        .map(|s| s.size)
        .sum();
    let root = scratch("store-quota");
    // a store whose quota holds half the model
    let store = root.join("half");
    let addr = worker(store.clone(), total / 2);
    let e = match session(&slices, &addr) {
        Ok(_) => panic!("a session beyond the quota started"),
        Err(e) => e,
    };
    eprintln!("refused: {e}");
    assert!(e.contains("quota") && e.contains("--store-quota"), "{e}");
    let held: u64 = std::fs::read_dir(&store)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".slice"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(
        held <= total / 2,
        "{held} bytes held over a quota of {}",
        total / 2
    );
    // a worker with room serves the same model; the progress callback sees every byte go
    let addr = worker(root.join("whole"), total + (1 << 20));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let on_ship = loip_runtime::coordinator::OnShip(std::sync::Arc::new(move |p| {
        log.lock()
            .unwrap()
            .push((p.device.to_string(), p.sent, p.total));
    }));
    let s = session_with(&slices, &addr, Some(on_ship)).unwrap_or_else(|e| panic!("session: {e}"));
    s.shutdown();
    let seen = seen.lock().unwrap();
    let (device, sent, total) = seen.last().cloned().expect("progress told");
    assert_eq!((device.as_str(), sent), ("dev1", total), "{seen:?}");
    assert!(
        seen.windows(2)
            .all(|w| w[0].1 <= w[1].1 || w[1].2 != w[0].2),
        "{seen:?}"
    );
}
