//! Regression tests for the findings of the worker security review, one per finding, named
//! after it: a peer that can reach a worker's port must not be able to read outside its
//! store, exhaust its memory, lock it out, keep it busy forever, panic it, or tamper with a
//! session. Plus a bounded fuzz run of frames before and after the handshake, and the peer
//! sessions of direct forwarding (token, role, pipeline key, announced steps, frame limit).

mod dist_common;

use std::time::{Duration, Instant};

use dist_common::raw::{self, Raw};
use loip_engine::TokenPos;
use loip_model::slice::Manifest;
use loip_runtime::coordinator::{Conn, ConnectOptions, Endpoint};
use loip_runtime::executor::{BlockPlacement, DeviceSpec, StageLayer, StageSpec};
use loip_runtime::net::token;
use loip_runtime::wire::{self, FrameKind, Role, StepHeader, ToCoordinator, ToWorker, WireError};
use loip_runtime::worker::{Worker, WorkerOptions};
use loip_runtime::LoaderKind;
use rand::{Rng, SeedableRng};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[test]
fn dist_worker_entry() {
    dist_common::worker_entry();
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

const TOKEN: &str = "a-test-token-of-some-length";

/// A worker in this process whose store holds the tiny fixture's slices.
async fn start(name: &str, tweak: impl FnOnce(&mut WorkerOptions)) -> (String, std::path::PathBuf) {
    let store = store_with_slices(name);
    let mut o = WorkerOptions::new("127.0.0.1:0", 256 << 20, &store);
    o.token = Some(TOKEN.into());
    o.name = Some(name.into());
    o.handshake_timeout = Duration::from_secs(2);
    tweak(&mut o);
    let w = Worker::bind(o).await.unwrap();
    let addr = w.local_addr().to_string();
    tokio::spawn(w.serve());
    (addr, store)
}

/// A fresh store holding copies of the tiny fixture's slice files.
fn store_with_slices(name: &str) -> std::path::PathBuf {
    dist_common::store_with_slices(name, "security")
}

fn manifest() -> Manifest {
    Manifest::load(&dist_common::slices_of(
        &dist_common::fixture("tiny-llama"),
        "security",
    ))
    .unwrap()
}

/// Everything resident, embed and head here, for steps of up to `max_tokens` tokens.
fn spec(m: &Manifest, max_tokens: usize) -> DeviceSpec {
    let layers = (0..m.config.num_layers)
        .map(|layer| StageLayer {
            layer,
            attn: BlockPlacement::Resident,
            mlp: BlockPlacement::Resident,
        })
        .collect();
    DeviceSpec {
        stages: vec![StageSpec { layers }],
        embed: true,
        head: true,
        loader: LoaderKind::Direct,
        overlap: true,
        mem_budget: None,
        max_step_tokens: max_tokens,
        max_step_seqs: 1,
        context: 256,
    }
}

fn ep(addr: &str) -> Endpoint {
    Endpoint {
        name: "dev".into(),
        addr: addr.into(),
    }
}

fn opts() -> ConnectOptions {
    ConnectOptions {
        token: Some(TOKEN.into()),
        connect_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

async fn load(s: &mut Raw, m: &Manifest, spec: DeviceSpec) -> ToCoordinator {
    s.control(&ToWorker::Load {
        manifest: m.clone(),
        spec,
    })
    .await;
    s.recv_control().await
}

fn failed_message(reply: ToCoordinator) -> String {
    match reply {
        ToCoordinator::Failed { message, .. } => message,
        other => panic!("expected a failure, got {other:?}"),
    }
}

async fn still_serves(addr: &str) {
    let mut c = Conn::connect(&ep(addr), &opts()).await.unwrap();
    assert!(c.rtt().await.unwrap() < 2.0);
    c.bye().await;
}

#[test]
fn finding_1_slice_names_outside_the_store_are_refused_before_anything_is_opened() {
    rt().block_on(async {
        let (addr, store) = start("f1", |_| {}).await;
        for evil in [
            "../../../../etc/passwd",
            "/etc/passwd",
            "../x.slice",
            "a/b.slice",
        ] {
            let mut m = manifest();
            m.slices[0].file = evil.into();
            for probe in [false, true] {
                let mut s = raw::authed(&addr, Some(TOKEN)).await;
                let msg = if probe {
                    s.control(&ToWorker::Probe {
                        manifest: m.clone(),
                        compute: true,
                        loads: true,
                    })
                    .await;
                    failed_message(s.recv_control().await)
                } else {
                    failed_message(load(&mut s, &m, spec(&m, 8)).await)
                };
                assert!(msg.contains("not a plain store name"), "{msg}");
                assert!(
                    !msg.contains("passwd") && !msg.contains(&*store.to_string_lossy()),
                    "{msg}"
                );
                // the session goes on
                s.control(&ToWorker::Ping { id: 1 }).await;
                assert!(matches!(
                    s.recv_control().await,
                    ToCoordinator::Pong { id: 1 }
                ));
            }
        }
        // no manifest naming them was saved in the store
        let saved = std::fs::read_to_string(store.join("manifest.json")).unwrap_or_default();
        assert!(!saved.contains("passwd"));
        still_serves(&addr).await;
    });
}

fn step(n: usize, head: bool) -> (StepHeader, Vec<u8>) {
    let h = StepHeader {
        step: 7,
        embed: true,
        head,
        keep: false,
        stages: vec![0],
        batch: (0..n)
            .map(|i| TokenPos {
                seq: 1,
                pos: i % 200,
            })
            .collect(),
        rows: if head { vec![0] } else { vec![] },
        argmax: None,
        row_masks: vec![],
        rewind: vec![],
    };
    (h, wire::u32_bytes(&vec![1u32; n]))
}

#[test]
fn finding_2_a_huge_step_on_a_small_budget_is_an_error_and_the_worker_keeps_serving() {
    rt().block_on(async {
        let (addr, _) = start("f2", |o| o.mem_budget = 64 << 20).await;
        let m = manifest();
        let mut s = raw::authed(&addr, Some(TOKEN)).await;
        assert!(matches!(
            load(&mut s, &m, spec(&m, 16)).await,
            ToCoordinator::Loaded { .. }
        ));
        // 2^16 tokens fit a frame: the step is refused by the device's limits, at once
        let (h, ids) = step(1 << 16, true);
        let t = Instant::now();
        s.send(FrameKind::Step, &wire::encode_step(&h, &ids)).await;
        let msg = failed_message(s.recv_control().await);
        assert!(
            msg.contains("65536 tokens") && msg.contains("at most 16"),
            "{msg}"
        );
        assert!(t.elapsed() < Duration::from_secs(5));
        // and a proper step still runs on the same session
        let (h, ids) = step(3, true);
        s.send(FrameKind::Step, &wire::encode_step(&h, &ids)).await;
        let f = s.recv().await.unwrap();
        assert_eq!(f.kind, FrameKind::Output);
        // 2^20 tokens do not even fit a frame of this device: that session closes, the worker lives
        let (h, ids) = step(1 << 20, false);
        let _ =
            s.wr.write(FrameKind::Step, &wire::encode_step(&h, &ids))
                .await;
        let msg = s.error_then_close().await.unwrap_or_default();
        assert!(msg.contains("exceeds the limit"), "{msg}");
        still_serves(&addr).await;
    });
}

#[test]
fn finding_3_a_worker_off_loopback_needs_a_token_and_makes_one() {
    let dir = dist_common::scratch("f3");
    let (t, made) = token::for_worker(None, "0.0.0.0:7001", &dir).unwrap();
    let path = made.expect("a token was made");
    let t = t.unwrap();
    assert!(t.len() >= 32);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // kept across restarts, and a given token wins
    assert_eq!(
        token::for_worker(None, "0.0.0.0:7001", &dir).unwrap().0,
        Some(t)
    );
    let given = Some("given-token-0123456789".to_string());
    assert_eq!(
        token::for_worker(given.clone(), "0.0.0.0:1", &dir)
            .unwrap()
            .0,
        given
    );
    // loopback may run without one
    assert_eq!(
        token::for_worker(None, "127.0.0.1:0", &dir).unwrap().0,
        None
    );
    // weak tokens are refused where they come in
    assert!(token::from_sources(None, Some("short")).is_err());
}

#[test]
fn finding_4_silent_peers_after_hello_do_not_lock_out_the_coordinator() {
    rt().block_on(async {
        let (addr, _) = start("f4", |o| o.handshake_timeout = Duration::from_secs(30)).await;
        // (three: a fourth would use up this host's share of handshake slots, see below)
        let mut silent = Vec::new();
        for _ in 0..3 {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            raw::hello(&mut s).await.unwrap();
            silent.push(s); // and say nothing more
        }
        let t = Instant::now();
        let o = ConnectOptions {
            connect_timeout: Duration::from_secs(2),
            ..opts()
        };
        Conn::connect(&ep(&addr), &o).await.unwrap().bye().await;
        assert!(t.elapsed() < Duration::from_secs(2));
        drop(silent);
    });
}

#[test]
fn finding_4_too_many_unauthenticated_connections_are_closed_at_once() {
    rt().block_on(async {
        let (addr, _) = start("f4cap", |o| {
            o.max_unauthenticated = 2;
            o.handshake_timeout = Duration::from_secs(30);
        })
        .await;
        let a = TcpStream::connect(&addr).await.unwrap();
        let b = TcpStream::connect(&addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        // the next four take the fast lane: a hello, then closed within its 1 s deadline
        let mut fast = Vec::new();
        for _ in 0..4 {
            let mut c = TcpStream::connect(&addr).await.unwrap();
            let f = wire::read_frame(&mut c, 1 << 16).await.unwrap();
            assert_eq!(f.kind, FrameKind::Hello);
            fast.push(c);
        }
        let mut c = TcpStream::connect(&addr).await.unwrap();
        // the seventh is closed without a hello
        let f = tokio::time::timeout(Duration::from_secs(5), wire::read_frame(&mut c, 1 << 16))
            .await
            .expect("closed at once");
        assert!(
            matches!(f, Err(WireError::Closed)) || matches!(f, Err(WireError::Io(_))),
            "{f:?}"
        );
        let t = Instant::now();
        let f = wire::read_frame(&mut fast[0], 1 << 16).await;
        assert!(f.is_err(), "{f:?}");
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        drop((a, b));
    });
}

#[test]
fn finding_5_an_idle_session_ends_and_frees_the_worker() {
    rt().block_on(async {
        let (addr, _) = start("f5", |o| o.idle_timeout = Duration::from_secs(1)).await;
        let mut s = raw::authed(&addr, Some(TOKEN)).await;
        let t = Instant::now();
        let msg = s.error_then_close().await.unwrap_or_default();
        assert!(msg.contains("sent nothing for 1 s"), "{msg}");
        assert!(t.elapsed() < Duration::from_secs(5));
        // a real coordinator's keepalives keep its session open past the idle limit
        let mut c = Conn::connect(&ep(&addr), &opts()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(c.rtt().await.is_ok());
        c.bye().await;
    });
}

fn vm(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

#[test]
fn finding_6_unread_outputs_keep_the_worker_within_its_budget() {
    const MEM: u64 = 200 << 20;
    const OVERHEAD: u64 = 48 << 20; // the process itself: code, runtime, test harness
    let store = store_with_slices("f6");
    let w = dist_common::spawn_worker(&dist_common::W {
        name: "f6".into(),
        mem: MEM,
        store,
        token: Some(TOKEN.into()),
        ..Default::default()
    });
    let addr = w.addr.clone();
    let pid = w.pid;
    rt().block_on(async {
        let m = manifest();
        let hidden = m.config.hidden_size;
        let tokens = (8 << 20) / (hidden * 4); // 8 MiB of hidden rows per step
        let mut s = raw::authed(&addr, Some(TOKEN)).await;
        assert!(matches!(
            load(&mut s, &m, spec(&m, tokens)).await,
            ToCoordinator::Loaded { .. }
        ));
        let h = StepHeader {
            step: 1,
            embed: false,
            head: false,
            keep: false,
            stages: vec![], // an echo: the rows come back as they went
            batch: (0..tokens)
                .map(|i| TokenPos {
                    seq: 1,
                    pos: i % 200,
                })
                .collect(),
            rows: vec![],
            argmax: None,
            row_masks: vec![],
            rewind: vec![],
        };
        let frame = wire::encode_step(&h, &vec![0u8; tokens * hidden * 4]);
        // 48 steps, never reading an output; the worker must slow us down, not grow
        let Raw { mut wr, rd, .. } = s;
        let sender = tokio::spawn(async move {
            for _ in 0..48 {
                if wr.write(FrameKind::Step, &frame).await.is_err() {
                    break;
                }
            }
            wr
        });
        tokio::time::sleep(Duration::from_secs(6)).await;
        let peak = vm(pid, "VmHWM:");
        assert!(
            peak <= MEM + OVERHEAD,
            "worker peak RSS {} MiB over --mem {} MiB + {} MiB",
            peak >> 20,
            MEM >> 20,
            OVERHEAD >> 20
        );
        eprintln!(
            "worker peak RSS {} MiB for --mem {} MiB",
            peak >> 20,
            MEM >> 20
        );
        sender.abort();
        drop(rd);
    });
    drop(w);
}

#[test]
fn finding_7_tensor_ranges_past_their_slice_are_refused_at_once() {
    rt().block_on(async {
        let (addr, _) = start("f7", |_| {}).await;
        let cases: [fn(&mut Manifest); 3] = [
            |m| m.slices[1].tensors[0].offset = m.slices[1].size,
            |m| m.slices[1].tensors[0].offset = u64::MAX - 1,
            |m| m.slices[1].tensors[0].nbytes += 4,
        ];
        for (i, bad) in cases.iter().enumerate() {
            let mut m = manifest();
            bad(&mut m);
            let mut s = raw::authed(&addr, Some(TOKEN)).await;
            let t = Instant::now();
            let msg = failed_message(load(&mut s, &m, spec(&m, 8)).await);
            assert!(t.elapsed() < Duration::from_secs(5), "case {i}");
            assert!(
                msg.contains("slice ") && msg.contains("tensor "),
                "case {i}: {msg}"
            );
        }
        // a config that asks for absurd sizes is refused the same way
        let mut m = manifest();
        m.config.num_layers = 1 << 31;
        let mut s = raw::authed(&addr, Some(TOKEN)).await;
        let msg = failed_message(load(&mut s, &m, spec(&manifest(), 8)).await);
        assert!(msg.contains("num_layers"), "{msg}");
        drop(s);
        still_serves(&addr).await;
    });
}

#[test]
fn finding_12_tampered_injected_and_replayed_frames_close_the_session() {
    rt().block_on(async {
        let (addr, _) = start("f12", |_| {}).await;
        // injected: a plaintext frame in the middle of a sealed session
        let mut s = raw::authed(&addr, Some(TOKEN)).await;
        let ping = wire::control_payload(&ToWorker::Ping { id: 3 }).unwrap();
        wire::write_frame(s.wr.get_mut(), FrameKind::Control, &ping, None)
            .await
            .unwrap();
        let msg = s.error_then_close().await.unwrap_or_default();
        assert!(msg.contains("failed authentication"), "{msg}");
        // modified and replayed: capture a sealed frame's bytes, then change one / send it twice
        for replay in [false, true] {
            let mut s = raw::authed(&addr, Some(TOKEN)).await;
            s.control(&ToWorker::Ping { id: 1 }).await;
            assert!(matches!(
                s.recv_control().await,
                ToCoordinator::Pong { id: 1 }
            ));
            // a second, hand-made frame with the session's counter is impossible to forge;
            // sending garbage with a valid header is what an injector can do
            let mut bytes = vec![0u8; 5 + 16 + 20];
            bytes[..4].copy_from_slice(&((16 + 20) as u32).to_le_bytes());
            bytes[4] = FrameKind::Control as u8;
            if replay {
                // the same bytes twice: at least the first is refused
                bytes.extend_from_slice(&bytes.clone());
            }
            s.wr.get_mut().write_all(&bytes).await.unwrap();
            let msg = s.error_then_close().await.unwrap_or_default();
            assert!(msg.contains("failed authentication"), "{msg}");
        }
        // a coordinator without the token is refused
        // (unit tests in net::handshake cover the Noise messages; here the wrong token end to end)
        let bad = ConnectOptions {
            token: Some("not-the-token-at-all".into()),
            ..opts()
        };
        let e = Conn::connect(&ep(&addr), &bad)
            .await
            .err()
            .expect("refused");
        assert!(matches!(e.source, WireError::AuthRefused(_)), "{e}");
        still_serves(&addr).await;
    });
}

#[test]
fn finding_12_the_coordinator_reads_no_large_frame_before_the_worker_is_authenticated() {
    rt().block_on(async {
        let fake = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = fake.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = fake.accept().await.unwrap();
            let _ = wire::write_frame(
                &mut s,
                FrameKind::Hello,
                &wire::hello_payload(Role::Worker, wire::PROTOCOL_VERSION),
                None,
            )
            .await;
            // a 64 MiB "challenge"
            let len = (64u32 << 20).to_le_bytes();
            let _ = s
                .write_all(&[len[0], len[1], len[2], len[3], FrameKind::Control as u8])
                .await;
            tokio::time::sleep(Duration::from_secs(10)).await;
        });
        let t = Instant::now();
        let e = Conn::connect(&ep(&addr), &opts())
            .await
            .err()
            .expect("refused");
        assert!(matches!(e.source, WireError::TooLarge { .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3));
    });
}

#[test]
fn finding_13_errors_sent_to_a_peer_carry_no_store_path() {
    rt().block_on(async {
        let (addr, store) = start("f13", |_| {}).await;
        let m = manifest();
        let file = m.slices[1].file.clone();
        std::fs::remove_file(store.join(&file)).unwrap();
        // the worker's inventory no longer lists it; loading anyway names the slice only
        let mut s = raw::authed(&addr, Some(TOKEN)).await;
        let msg = failed_message(load(&mut s, &m, spec(&m, 8)).await);
        let dir = store.to_string_lossy().into_owned();
        assert!(!msg.contains(&dir), "{msg}");
        assert!(msg.contains(&file), "{msg}");
    });
}

#[test]
fn fuzz_frames_before_and_after_the_handshake_never_take_the_worker_down() {
    const CASES: usize = 300;
    rt().block_on(async {
        let (addr, _) = start("fuzz", |o| o.handshake_timeout = Duration::from_millis(500)).await;
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        let kinds = [1u8, 2, 3, 4, 5, 6, 7, 0, 99];
        for i in 0..CASES {
            let len = rng.gen_range(0..256usize);
            let mut payload: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            let kind = kinds[rng.gen_range(0..kinds.len())];
            if i % 2 == 0 {
                // before authentication: random bytes, or a hello then random frames
                let mut s = TcpStream::connect(&addr).await.unwrap();
                if rng.gen_bool(0.5) {
                    let _ = raw::hello(&mut s).await;
                }
                let mut head = (payload.len() as u32).to_le_bytes().to_vec();
                head.push(kind);
                let _ = s.write_all(&head).await;
                let _ = s.write_all(&payload).await;
                drop(s);
            } else {
                // after authentication: sealed frames with random content, or mutated real
                // control messages
                let mut s = raw::authed(&addr, Some(TOKEN)).await;
                if rng.gen_bool(0.5) {
                    let mut json =
                        serde_json::to_vec(&ToWorker::Release { seqs: vec![1, 2] }).unwrap();
                    let at = rng.gen_range(0..json.len());
                    json[at] = rng.gen();
                    payload = json;
                }
                let k = FrameKind::from_u8(kind).unwrap_or(FrameKind::Error);
                let _ = s.wr.write(k, &payload).await;
                s.control(&ToWorker::Bye).await;
                drop(s);
            }
        }
        eprintln!("{CASES} fuzzed connections, worker still serving");
        still_serves(&addr).await;
    });
}

#[test]
fn finding_4_one_host_cannot_use_up_the_handshake_slots_of_all() {
    rt().block_on(async {
        let (addr, _) = start("f4host", |o| o.handshake_timeout = Duration::from_secs(30)).await;
        // 16 slots in all, 4 per host: four silent connections from 127.0.0.1 use its share
        let mut silent = Vec::new();
        for _ in 0..4 {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            raw::hello(&mut s).await.unwrap();
            silent.push(s);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        // a fifth from the same host gets only a fast-lane slot: its hello, then it is closed
        // unless it proves the token within 1 s
        let mut fifth = TcpStream::connect(&addr).await.unwrap();
        let hello = wire::read_frame(&mut fifth, 1 << 16).await.unwrap();
        assert_eq!(hello.kind, FrameKind::Hello);
        let f = tokio::time::timeout(
            Duration::from_secs(5),
            wire::read_frame(&mut fifth, 1 << 16),
        )
        .await
        .expect("closed within the fast lane's deadline");
        assert!(f.is_err(), "{f:?}");
        // a coordinator on another host (127.0.0.2) still gets in
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let s = sock.connect(addr.parse().unwrap()).await.unwrap();
        let (mut rd, mut wr) = s.into_split();
        let me = loip_runtime::coordinator::coordinator_identity();
        let hs = loip_runtime::net::handshake::connect(&mut rd, &mut wr, TOKEN, me)
            .await
            .unwrap();
        let (mut rd, _wr) = hs.keys.seal(Role::Coordinator, rd, wr, None);
        let f = rd.read(wire::MAX_FRAME).await.unwrap();
        assert!(matches!(
            wire::parse_control::<ToCoordinator>(&f).unwrap(),
            ToCoordinator::Welcome { .. }
        ));
        drop(silent);
    });
}

/// Runs the handshake with a hello of `role`. Returns the worker's answer (its
/// confirmation, or the error it sent). (Both hellos are the Noise prologue: a hello rewritten
/// on the way fails the handshake, see `net::handshake`'s tests.)
async fn handshake_as(addr: &str, role: Role) -> Result<(), String> {
    let s = TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let me = loip_runtime::net::identity::Identity::generate();
    loip_runtime::net::handshake::connect_as(&mut rd, &mut wr, TOKEN, &me, role)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[test]
fn peer_sessions_need_the_token_their_role_the_key_and_announced_steps() {
    use loip_runtime::net::direct::{self, PeerRef, PeersMsg};
    use loip_runtime::net::peer;
    rt().block_on(async {
        let (addr, _) = start("peer", |_| {}).await;
        let mut c = raw::authed(&addr, Some(TOKEN)).await;
        let key = "ab".repeat(32);
        // the test poses as device 1 with its own static key
        let id = loip_runtime::net::identity::Identity::generate();
        let up = PeerRef {
            device: 1,
            name: "up".into(),
            addr: String::new(),
            key: id.fingerprint(),
        };
        let msg = PeersMsg {
            key: key.clone(),
            me: 0,
            expect: vec![up],
            connect: vec![],
            measure: false,
        };
        c.control(&ToWorker::Peers(msg)).await;
        assert!(matches!(
            c.recv_control().await,
            ToCoordinator::PeersReady { links } if links.is_empty()
        ));
        let me = PeerRef {
            device: 0,
            name: "peer".into(),
            addr: addr.clone(),
            key: c.key.clone(),
        };
        let auth = |me: u16, key: &'static str, token: &'static str| peer::PeerAuth {
            me,
            key,
            identity: &id,
            token,
        };
        let key: &'static str = Box::leak(key.into_boxed_str());
        let other_key: &'static str = Box::leak("cd".repeat(32).into_boxed_str());
        let to = Duration::from_secs(5);
        let refused = |r: Result<peer::PeerConn, WireError>| match r {
            Ok(_) => panic!("a peer session was opened"),
            Err(e) => e.to_string(),
        };
        // the token, the pipeline's key, a device the worker expects
        let e = refused(peer::connect(&me, &auth(1, key, "wrong"), to, None).await);
        assert!(e.contains("authentication"), "{e}");
        let e = refused(peer::connect(&me, &auth(1, other_key, TOKEN), to, None).await);
        assert!(e.contains("key"), "{e}");
        let e = refused(peer::connect(&me, &auth(2, key, TOKEN), to, None).await);
        assert!(e.contains("does not hand rows"), "{e}");
        // the connecting side checks the name it was given
        let other = PeerRef {
            name: "other".into(),
            ..me.clone()
        };
        let e = refused(peer::connect(&other, &auth(1, key, TOKEN), to, None).await);
        assert!(e.contains("expected device other"), "{e}");
        // a hello must name a connecting role
        let e = handshake_as(&addr, Role::Worker).await.unwrap_err();
        assert!(e.contains("connecting role"), "{e}");
        handshake_as(&addr, Role::Peer).await.unwrap();
        // rows for a step the coordinator did not announce close the peer session
        let open = || async {
            for _ in 0..100 {
                match peer::connect(&me, &auth(1, key, TOKEN), to, None).await {
                    Ok(p) => return p,
                    Err(e) if e.to_string().contains("already has a session") => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            panic!("the earlier peer session stayed")
        };
        let mut p = open().await;
        p.wr.write(FrameKind::Hand, &direct::encode_hand(77, 1, &[0u8; 64]))
            .await
            .unwrap();
        let f =
            p.rd.read_timeout(1 << 16, Duration::from_secs(20), "the error")
                .await
                .unwrap();
        let text = String::from_utf8_lossy(&f.payload).into_owned();
        assert!(
            f.kind == FrameKind::Error && text.contains("did not announce"),
            "{text}"
        );
        drop(p);
        // a frame over the session's limit (16 MiB before a device is loaded)
        let mut p = open().await;
        let mut head = (((16 << 20) + 17) as u32).to_le_bytes().to_vec();
        head.push(FrameKind::Hand as u8);
        p.wr.get_mut().write_all(&head).await.unwrap();
        let f =
            p.rd.read_timeout(1 << 16, Duration::from_secs(10), "the error")
                .await
                .unwrap();
        let text = String::from_utf8_lossy(&f.payload).into_owned();
        assert!(
            f.kind == FrameKind::Error && text.contains("exceeds the limit"),
            "{text}"
        );
        // a coordinator's request on a peer session is refused
        let mut p = open().await;
        let m = Manifest::load(&dist_common::slices_of(
            &dist_common::fixture("tiny-llama"),
            "security",
        ))
        .unwrap();
        let bye = wire::control_payload(&ToWorker::Load {
            spec: spec(&m, 16),
            manifest: m,
        })
        .unwrap();
        p.wr.write(FrameKind::Control, &bye).await.unwrap();
        let f =
            p.rd.read_timeout(1 << 16, Duration::from_secs(10), "the error")
                .await
                .unwrap();
        assert_eq!(f.kind, FrameKind::Error);
        // the coordinator's session is untouched
        c.control(&ToWorker::Ping { id: 1 }).await;
        assert!(matches!(
            c.recv_control().await,
            ToCoordinator::Pong { id: 1 }
        ));
    });
}
