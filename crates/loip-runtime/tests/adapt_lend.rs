//! KV lending in the running cluster (design §6): two worker processes, each with two
//! one-layer stages; the first has room for 12 tokens of KV, the second for thousands. With
//! lending on, the first lends the oldest rows of each stage's KV to the second after the
//! stage runs and fetches them back before it runs again: on their peer session where it is
//! up, else through the coordinator (`relay`, or the pair relayed by configuration). Tokens
//! and logits stay bit-identical to the single-device engine, lending on or off, direct or
//! relayed, and for a request that arrives while another holds lent KV. A borrower lost
//! mid-lend fails the step naming it, at once.

mod adapt_common;
mod dist_common;

use adapt_common::*;
use dist_common::*;
use std::time::{Duration, Instant};

use loip_engine::generate::{generate, Flow};
use loip_model::slice::Manifest;
use loip_model::Checkpoint;
use loip_plan::adapt::AdaptEvent;
use loip_runtime::adapt::AdaptReport;
use loip_runtime::cluster_run::{Session, SessionOptions, WorkerProcess};
use loip_runtime::coordinator::{next_seq_id, LinkBytes};

#[test]
fn dist_worker_entry() {
    worker_entry();
}

const PROMPT: &[u32] = &[1, 5, 9, 23, 42, 7];
const PROMPT_B: &[u32] = &[3, 14, 15, 92];

/// How hops and lent KV travel.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    /// on the peer sessions
    Direct,
    /// dev1 and dev2 relayed by configuration (as if they could not reach each other)
    RelayPair,
    /// everything through the coordinator (`--relay`)
    Relay,
}

/// Starts the two-worker session; `lending` and `via` as named.
fn start(lending: bool, via: Via, tag: &str) -> (Session, Vec<WorkerProcess>) {
    start_with(lending, via, tag, |_| {})
}

/// [`start`], the session's options changed by `tweak`.
fn start_with(
    lending: bool,
    via: Via,
    tag: &str,
    tweak: impl FnOnce(&mut SessionOptions),
) -> (Session, Vec<WorkerProcess>) {
    let path = fixture("tiny-llama");
    let slices = slices_of(&path, "tiny-llama");
    let m = Manifest::load(&slices).unwrap();
    let (names, plan, kv_per_token) = two_device_plan(&m);
    let held = [12, 4000];
    let root = scratch(tag);
    let workers: Vec<_> = (0..2)
        .map(|i| {
            spawn_worker(&W {
                name: names[i].clone(),
                mem: full_fixed(&m, &plan, i) + held[i] * kv_per_token,
                store: root.join(&names[i]),
                ..Default::default()
            })
        })
        .collect();
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    let specs = worker_specs(&names, &addrs);
    let relay_pairs = match via {
        Via::RelayPair => vec![(names[0].clone(), names[1].clone())],
        _ => Vec::new(),
    };
    let mut opts = SessionOptions {
        lending,
        relay: via == Via::Relay,
        relay_pairs,
        ..session_options(plan, PROMPT.len())
    };
    tweak(&mut opts);
    let s = Session::start(&slices, specs, opts).unwrap_or_else(|e| panic!("session: {e}"));
    (s, workers)
}

/// Generates `n_new` tokens of `prompt` as sequence `seq` and checks tokens and logits
/// against the single-device engine.
fn check(s: &Session, seq: u64, prompt: &[u32], n_new: usize, what: &str) {
    let ckpt = Checkpoint::open(&fixture("tiny-llama")).unwrap();
    let (want_ids, want_logits) = reference(&ckpt, prompt, &greedy(n_new));
    let (ids, logits) = recorded(s.pipeline().backend(), seq, prompt, &greedy(n_new))
        .unwrap_or_else(|e| panic!("{what}: generation: {e}"));
    assert_eq!(ids, want_ids, "{what}: tokens");
    assert_bits(what, &logits, &want_logits);
}

fn lends(ad: &AdaptReport) -> Vec<(usize, usize, u64)> {
    ad.events
        .iter()
        .filter_map(|e| match e {
            AdaptEvent::Lend {
                device,
                peer,
                tokens,
                ..
            } => Some((*device, *peer, *tokens)),
            _ => None,
        })
        .collect()
}

/// Bytes the link `from` → `to` carried.
fn carried(links: &[LinkBytes], from: &str, to: &str) -> u64 {
    links
        .iter()
        .filter(|l| l.from == from && l.to == to)
        .map(|l| l.bytes)
        .sum()
}

fn run_case(lending: bool, via: Via, tag: &str) -> (AdaptReport, Vec<LinkBytes>) {
    let (s, _w) = start(lending, via, tag);
    let seq = next_seq_id();
    check(&s, seq, PROMPT, 60, tag);
    s.pipeline().release(&[seq]);
    let ad = s.adaptation().expect("adaptation on");
    let links = s.link_bytes();
    eprintln!("{tag}: events {:?}", ad.events);
    eprintln!("{tag}: devices {:?}", ad.devices);
    eprintln!("{tag}: links {links:?}");
    s.shutdown();
    (ad, links)
}

/// Lending happened: dev1 lent to dev2 and fetched its rows back.
fn assert_lent(ad: &AdaptReport) {
    let l = lends(ad);
    assert!(
        l.iter().any(|&(d, p, t)| d == 0 && p == 1 && t > 0),
        "dev1 lends to dev2: {l:?}"
    );
    let d = &ad.devices;
    assert!(d[0].fetches > 0 && d[0].kv_moved_bytes > 0, "{d:?}");
    assert!(d[1].borrowed_bytes > 0, "{d:?}");
    assert_eq!(d[0].lent_to.as_deref(), Some("dev2"));
    assert!(ad.lend_bandwidth.is_some_and(|b| b > 0.0), "{ad:?}");
}

#[test]
fn lending_on_and_off_keep_tokens_and_logits_bit_identical() {
    let (off, off_links) = run_case(false, Via::Direct, "adapt-lend-off");
    assert!(lends(&off).is_empty(), "{:?}", off.events);
    let (on, links) = run_case(true, Via::Direct, "adapt-lend-on");
    assert_lent(&on);
    // the lent KV went on the peer session: dev1 hands every hop to dev2 directly, so only
    // its hops' notices go from dev1 to the coordinator, and the lending notices count the
    // KV on the peer link (at least what came back, both ways)
    let fetched = on.devices[0].kv_moved_bytes / 2;
    let to_coordinator = carried(&links, "dev1", "coordinator");
    assert_eq!(
        to_coordinator,
        carried(&off_links, "dev1", "coordinator"),
        "{links:?}"
    );
    assert!(carried(&links, "dev1", "dev2") >= fetched, "{links:?}");
    assert!(carried(&links, "dev2", "dev1") >= fetched, "{links:?}");
}

#[test]
fn lent_kv_through_relayed_hops() {
    let (on, links) = run_case(true, Via::Relay, "adapt-lend-relay");
    assert_lent(&on);
    let fetched = on.devices[0].kv_moved_bytes / 2;
    assert!(
        carried(&links, "dev1", "coordinator") >= fetched,
        "{links:?}"
    );
}

#[test]
fn lent_kv_between_a_pair_that_cannot_reach_each_other_goes_through_the_coordinator() {
    let (on, links) = run_case(true, Via::RelayPair, "adapt-lend-pair");
    assert_lent(&on);
    let fetched = on.devices[0].kv_moved_bytes / 2;
    assert!(
        carried(&links, "dev1", "coordinator") >= fetched,
        "{links:?}"
    );
    assert!(
        carried(&links, "coordinator", "dev1") >= fetched,
        "{links:?}"
    );
    assert_eq!(carried(&links, "dev1", "dev2"), 0, "{links:?}");
}

#[test]
fn a_lend_that_shrinks_to_nothing_lets_its_step_go_on() {
    // The first lend is sized before any fetch was measured; with a vanishing share of the
    // link, the first measured rate shrinks it to 0 at once: a decision with no switch or
    // reservation to wait for, which must not hold its step (it did: the falling-rate stall).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (s, _w) = start_with(true, Via::Direct, "adapt-lend-shrink", |o| {
            o.adapt.lend_link_fraction = 1e-12;
        });
        let seq = next_seq_id();
        check(&s, seq, PROMPT, 40, "a lend shrinking to nothing");
        let ad = s.adaptation().expect("adaptation on");
        s.shutdown();
        let _ = tx.send(ad);
    });
    let ad = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("the generation stalled (or failed: see its panic above)");
    let l = lends(&ad);
    eprintln!("lends {l:?}");
    let grown = l.iter().position(|&(d, _, t)| d == 0 && t > 0);
    let shrunk = l.iter().rposition(|&(d, _, t)| d == 0 && t == 0);
    assert!(
        matches!((grown, shrunk), (Some(g), Some(s)) if g < s),
        "dev1 lent, then stopped: {l:?}"
    );
}

#[test]
fn a_borrower_lost_mid_lend_fails_the_step_naming_it() {
    let (s, mut w) = start(true, Via::Direct, "adapt-lend-lost");
    let mut rec = Rec {
        inner: s.pipeline().backend(),
        logits: vec![],
    };
    let (mut n, mut killed) = (0, None);
    let r = generate(&mut rec, next_seq_id(), PROMPT, &greedy(60), &mut |_| {
        n += 1;
        if n == 20 {
            let ad = s.adaptation().expect("adaptation on");
            assert!(
                ad.devices[0].lent_tokens > 0,
                "lending by now: {:?}",
                ad.devices
            );
            w[1].kill();
            killed = Some(Instant::now());
        }
        Flow::Continue
    });
    let e = match r {
        Ok(_) => panic!("the generation went on without its borrower"),
        Err(e) => e.to_string(),
    };
    let waited = killed.expect("killed").elapsed();
    eprintln!("failed {waited:?} after the borrower was killed: {e}");
    assert!(e.contains("dev2"), "{e}");
    assert!(waited < Duration::from_secs(20), "{waited:?}");
    let h = s.pipeline().health();
    assert!(!h[1].alive && h[0].alive, "{h:?}");
    s.shutdown();
}

#[test]
fn a_request_arriving_while_another_holds_lent_kv() {
    let (s, _w) = start(true, Via::Direct, "adapt-lend-two");
    let a = next_seq_id();
    check(&s, a, PROMPT, 16, "first request");
    let ad = s.adaptation().expect("adaptation on");
    assert!(ad.devices[0].lent_tokens > 0, "{:?}", ad.devices);
    // the first sequence is not released: its rows stay lent while the second runs
    let b = next_seq_id();
    check(&s, b, PROMPT_B, 20, "second request");
    s.pipeline().release(&[a, b]);
    let ad = s.adaptation().expect("adaptation on");
    eprintln!("events {:?}", ad.events);
    assert_eq!(ad.held_admissions, 0, "{ad:?}");
    s.shutdown();
}

/// A peer session's next frame, which must be an `Error`: its text.
async fn error_of(p: &mut loip_runtime::net::peer::PeerConn) -> String {
    let f =
        p.rd.read_timeout(1 << 16, Duration::from_secs(10), "the error")
            .await
            .unwrap();
    assert_eq!(f.kind, loip_runtime::wire::FrameKind::Error);
    String::from_utf8_lossy(&f.payload).into_owned()
}

#[test]
fn hostile_lent_kv_frames_on_a_peer_session_are_refused() {
    use loip_runtime::net::direct::{PeerRef, PeersMsg};
    use loip_runtime::net::peer;
    use loip_runtime::wire::lend::{encode_kv, KvHeader, KvOp};
    use loip_runtime::wire::{FrameKind, ToCoordinator, ToWorker};
    use tokio::io::AsyncWriteExt;
    let addr = in_process_worker("borrower", 64 << 20, scratch("adapt-lend-hostile"), 0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut c = dist_common::raw::authed(&addr, None).await;
        let key = "ab".repeat(32);
        // the test poses as device 1 with its own static key
        let id = loip_runtime::net::identity::Identity::generate();
        let lender = PeerRef {
            device: 1,
            name: "lender".into(),
            addr: String::new(),
            key: id.fingerprint(),
        };
        let msg = PeersMsg {
            key: key.clone(),
            me: 0,
            expect: vec![lender],
            connect: vec![],
            measure: false,
        };
        c.control(&ToWorker::Peers(msg)).await;
        assert!(matches!(
            c.recv_control().await,
            ToCoordinator::PeersReady { .. }
        ));
        // no device is loaded: the reservation for device 1's rows is refused, so it lends
        // nothing here
        let borrow = ToWorker::Borrow {
            lender: 1,
            bytes: 4096,
            via: Some(1),
        };
        c.control(&borrow).await;
        assert!(matches!(
            c.recv_control().await,
            ToCoordinator::Borrowed { ok: false, .. }
        ));
        let me = PeerRef {
            device: 0,
            name: "borrower".into(),
            addr: addr.clone(),
            key: c.key.clone(),
        };
        let auth = peer::PeerAuth {
            me: 1,
            key: &key,
            identity: &id,
            token: "",
        };
        let open = || async {
            for _ in 0..100 {
                match peer::connect(&me, &auth, Duration::from_secs(5), None).await {
                    Ok(p) => return p,
                    Err(e) if e.to_string().contains("already has a session") => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            panic!("the earlier peer session stayed")
        };
        // lent KV from a peer that reserved nothing here: a put of any rows is over its
        // reservation, and an empty one names why
        let h = KvHeader {
            op: KvOp::Put,
            lender: 1,
            stage: 0,
        };
        for (blob, want) in [
            (&[0u8; 64][..], "exceeds the limit"),
            (&[][..], "lends nothing"),
        ] {
            let mut p = open().await;
            p.wr.write(FrameKind::Kv, &encode_kv(h, blob))
                .await
                .unwrap();
            let text = error_of(&mut p).await;
            assert!(text.contains(want), "{text}");
        }
        // a lent-KV frame over the reservation is refused before its body is read (the
        // header announces 1 MiB; nothing follows)
        let mut p = open().await;
        let mut head = ((1u32 << 20) + 16).to_le_bytes().to_vec();
        head.push(FrameKind::Kv as u8);
        p.wr.get_mut().write_all(&head).await.unwrap();
        let text = error_of(&mut p).await;
        assert!(text.contains("exceeds the limit"), "{text}");
        drop(p);
        // rows coming back are the borrower's to send, never the lender's
        let mut p = open().await;
        let h = KvHeader {
            op: KvOp::Data,
            lender: 1,
            stage: 0,
        };
        p.wr.write(FrameKind::Kv, &encode_kv(h, &[])).await.unwrap();
        let text = error_of(&mut p).await;
        assert!(
            text.contains("lends nothing") || text.contains("op"),
            "{text}"
        );
        // the coordinator's session is untouched
        c.control(&ToWorker::Ping { id: 1 }).await;
        assert!(matches!(
            c.recv_control().await,
            ToCoordinator::Pong { id: 1 }
        ));
    });
}
