//! Faults and restarts with real worker processes: a worker killed mid-generation fails the
//! request with an error naming it while the coordinator stays up and re-plans over the
//! others; a stuck worker times out; a wrong token is refused; a restarted worker is not sent
//! its weights again, and a damaged slice is sent again alone. With direct forwarding (the
//! default) and with `relay`: a killed worker is named whether its peer or the coordinator
//! notices first, the worker that waited for its rows does not hang (it serves the re-plan),
//! and a step that fails on one device leaves nothing behind on the others.

mod dist_common;

use std::time::Duration;

use dist_common::*;
use loip_engine::generate::Flow;
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::ExecMode;
use loip_runtime::cluster_run::{uniform_plan, Session, SessionOptions, WorkerSpec};
use loip_runtime::coordinator::ClusterError;

#[test]
fn dist_worker_entry() {
    worker_entry();
}

fn specs(workers: &[loip_runtime::cluster_run::WorkerProcess]) -> Vec<WorkerSpec> {
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    dist_common::netns::worker_specs(&addrs)
}

fn opts(plan: loip_plan::Plan, token: Option<&str>) -> SessionOptions {
    let mut o = SessionOptions {
        plan: Some(plan),
        measure_links: false,
        shape_name: "m".into(),
        context: 128,
        max_step_tokens: 16,
        ..Default::default()
    };
    o.connect.token = token.map(str::to_string);
    o.connect.connect_timeout = Duration::from_secs(5);
    o
}

fn plan(n: usize, stages: u32, layers: u32) -> loip_plan::Plan {
    let names: Vec<String> = (1..=n).map(|i| format!("dev{i}")).collect();
    uniform_plan(
        "m",
        layers,
        &names,
        stages,
        ExecMode::Overlapped,
        &|_, n| (0, 1.min(n)),
    )
    .unwrap()
}

#[test]
fn killed_worker_fails_the_request_by_name_and_the_coordinator_replans() {
    killed_worker(false);
}

#[test]
fn killed_worker_is_named_and_replanned_when_relaying_too() {
    killed_worker(true);
}

fn killed_worker(relay: bool) {
    let path = fixture("tiny-llama");
    let ckpt = Checkpoint::open(&path).unwrap();
    let slices = slices_of(&path, "tiny-llama");
    let prompt = [1u32, 5, 9, 23, 42];
    let (want, _) = reference(&ckpt, &prompt, &greedy(12));
    let root = scratch("kill");
    let mut workers = spawn_workers(&root, 3, 1 << 30, Some("k"));
    let victim_addr = workers[1].addr.clone();
    let mut o = opts(plan(3, 1, 4), Some("k"));
    o.relay = relay;
    let mut s = Session::start(&slices, specs(&workers), o).unwrap();
    assert_eq!(s.hop_links().direct, [false, !relay, !relay]);
    let mut produced = 0;
    let err = s
        .generate(&prompt, &greedy(12), &mut |_| {
            produced += 1;
            if produced == 3 {
                workers[1].kill();
            }
            Flow::Continue
        })
        .expect_err("the generation must fail");
    let text = err.to_string();
    assert!(matches!(err, ClusterError::DeviceGone { .. }), "{text}");
    assert!(
        text.contains("dev2") && text.contains(&victim_addr),
        "{text}"
    );
    let h = s.health();
    assert!(h[0].alive && !h[1].alive && h[2].alive, "{h:?}");
    // The coordinator is still up: new requests fail fast with the same diagnosis...
    let again = s
        .generate(&prompt, &greedy(2), &mut |_| Flow::Continue)
        .expect_err("still broken");
    assert!(again.to_string().contains("dev2"), "{again}");
    // ...until it re-plans over the devices left, which still hold the model.
    let gone = s.replan().unwrap();
    assert_eq!(gone, vec!["dev2".to_string()]);
    // (The planner may also leave out a device it does not need for a model this small.)
    assert!(
        !s.plan.devices.is_empty() && s.plan.devices.iter().all(|d| d.name != "dev2"),
        "{:?}",
        s.plan.devices
    );
    let out = s
        .generate(&prompt, &greedy(12), &mut |_| Flow::Continue)
        .unwrap();
    assert_eq!(out.new_ids, want);
    s.shutdown();
}

#[test]
fn a_step_that_fails_on_one_device_leaves_nothing_behind_on_the_others() {
    let path = fixture("tiny-llama");
    let ckpt = Checkpoint::open(&path).unwrap();
    let slices = slices_of(&path, "tiny-llama");
    let prompt = [1u32, 5, 9, 23, 42];
    let (want, _) = reference(&ckpt, &prompt, &greedy(6));
    let root = scratch("failed-step");
    let workers = spawn_workers(&root, 3, 1 << 30, None);
    let s = Session::start(&slices, specs(&workers), opts(plan(3, 1, 4), None)).unwrap();
    assert_eq!(s.hop_links().direct, [false, true, true]);
    // 20 tokens on devices opened for 16: the first device refuses; the others had been told
    // about the step's hops and forget them.
    for _ in 0..3 {
        let seq = loip_runtime::coordinator::next_seq_id();
        let err = s
            .pipeline()
            .step_blocking(seq, &[1; 20], 0, &[19])
            .expect_err("too many tokens");
        s.pipeline().release(&[seq]);
        assert!(
            matches!(err, ClusterError::StepFailed { ref device, .. } if device == "dev1"),
            "{err}"
        );
    }
    let out = s
        .generate(&prompt, &greedy(6), &mut |_| Flow::Continue)
        .unwrap();
    assert_eq!(out.new_ids, want);
    assert!(s.health().iter().all(|h| h.alive));
    s.shutdown();
}

#[test]
fn a_stuck_worker_times_out_by_name() {
    let path = fixture("tiny-qwen3");
    let slices = slices_of(&path, "tiny-qwen3");
    let root = scratch("stuck");
    let workers = spawn_workers(&root, 2, 1 << 30, None);
    let mut o = opts(plan(2, 1, 4), None);
    o.step_timeout = Duration::from_millis(1500);
    let s = Session::start(&slices, specs(&workers), o).unwrap();
    let pid = workers[1].pid.to_string();
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap();
    assert!(stop.success());
    let err = s
        .generate(&[1, 2, 3], &greedy(3), &mut |_| Flow::Continue)
        .expect_err("timeout");
    let _ = std::process::Command::new("kill")
        .args(["-CONT", &pid])
        .status();
    let text = err.to_string();
    assert!(
        text.contains("dev2") && text.contains("did not answer"),
        "{text}"
    );
}

#[test]
fn a_wrong_token_is_refused_naming_the_device() {
    let path = fixture("tiny-llama");
    let slices = slices_of(&path, "tiny-llama");
    let root = scratch("token");
    let workers = spawn_workers(&root, 2, 1 << 30, Some("right"));
    let err = Session::start(&slices, specs(&workers), opts(plan(2, 1, 4), Some("wrong")))
        .err()
        .expect("refused");
    let text = err.to_string();
    assert!(
        text.contains("dev1") && text.contains("wrong token"),
        "{text}"
    );
    let ok = Session::start(&slices, specs(&workers), opts(plan(2, 1, 4), Some("right"))).unwrap();
    ok.shutdown();
}

#[test]
fn a_restarted_worker_keeps_its_slices_and_a_damaged_one_is_sent_again() {
    let path = fixture("tiny-llama-bf16-tied");
    let ckpt = Checkpoint::open(&path).unwrap();
    let slices = slices_of(&path, "tiny-llama-bf16-tied");
    let m = Manifest::load(&slices).unwrap();
    let prompt = [1u32, 9, 8, 7];
    let (want, _) = reference(&ckpt, &prompt, &greedy(5));
    let store = scratch("restart").join("dev1");
    let w = |_: ()| {
        spawn_worker(&W {
            name: "dev1".into(),
            mem: 1 << 30,
            store: store.clone(),
            ..Default::default()
        })
    };
    let run = |worker: &loip_runtime::cluster_run::WorkerProcess| {
        let s = Session::start(
            &slices,
            specs(std::slice::from_ref(worker)),
            opts(plan(1, 2, 4), None),
        )
        .unwrap();
        let out = s
            .generate(&prompt, &greedy(5), &mut |_| Flow::Continue)
            .unwrap();
        assert_eq!(out.new_ids, want);
        let r = s.reports[0].shipped.clone();
        s.shutdown();
        r
    };
    let first = w(());
    let shipped = run(&first);
    assert_eq!(
        shipped.sent.len(),
        m.slices.len(),
        "first run ships everything: {shipped:?}"
    );
    drop(first);
    assert!(store.join(".verified.json").is_file());

    let second = w(());
    let shipped = run(&second);
    assert!(
        shipped.sent.is_empty(),
        "a restart re-sent {:?}",
        shipped.sent
    );
    assert_eq!(shipped.reused, m.slices.len());
    drop(second);

    // Damage one slice in place: the restarted worker re-verifies it and gets only it again.
    let victim = &m.slices[2].file;
    let p = store.join(victim);
    let mut bytes = std::fs::read(&p).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x5a;
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(&p, bytes).unwrap();
    let third = w(());
    let shipped = run(&third);
    assert_eq!(shipped.sent, vec![victim.clone()]);
}

#[test]
fn an_unreachable_worker_at_start_is_left_out_when_the_model_fits_on_the_others() {
    let path = fixture("tiny-llama");
    let ckpt = Checkpoint::open(&path).unwrap();
    let slices = slices_of(&path, "tiny-llama");
    let prompt = [1u32, 5, 9, 23, 42];
    let (want, _) = reference(&ckpt, &prompt, &greedy(6));
    let root = scratch("unreachable");
    let workers = spawn_workers(&root, 2, 1 << 30, Some("u"));
    // An address nobody listens on: bind a port, then close it.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let mut sp = specs(&workers);
    sp.insert(
        1,
        WorkerSpec {
            profile: loip_plan::profile::preset("host-zen5-2c"),
            ..WorkerSpec::new("dev-dead", &dead)
        },
    );
    let mut o = opts(plan(2, 1, 4), Some("u"));
    o.plan = None;
    // With a fixed plan the devices are given: an unreachable one is an error naming it.
    let fixed = {
        let mut f = opts(plan(3, 1, 4), Some("u"));
        f.plan.as_mut().unwrap().devices[1].name = "dev-dead".into();
        f
    };
    let err = Session::start(&slices, sp.clone(), fixed)
        .err()
        .expect("fixed plan over a dead device");
    assert!(err.to_string().contains("dev-dead"), "{err}");
    // Planned over the reachable ones, saying which device was left out and why.
    let s = Session::start(&slices, sp, o).unwrap();
    assert!(
        s.plan.devices.iter().all(|d| d.name != "dev-dead"),
        "{:?}",
        s.plan.devices
    );
    let d = s
        .plan
        .dropped
        .iter()
        .find(|d| d.name == "dev-dead")
        .expect("reported as left out");
    assert!(
        d.reason.contains("unreachable") && d.reason.contains(&dead),
        "{}",
        d.reason
    );
    assert_eq!(s.reports.len(), 2);
    let out = s
        .generate(&prompt, &greedy(6), &mut |_| Flow::Continue)
        .unwrap();
    assert_eq!(out.new_ids, want);
    s.shutdown();
}
