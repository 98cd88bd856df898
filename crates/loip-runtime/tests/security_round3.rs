//! Regression tests for the worker findings of the third security review, named after them:
//! a token holder cannot use a worker to map its network (`peers` errors) nor read outside
//! its store through a planted link.

mod dist_common;

use std::time::Duration;

use dist_common::raw;
use loip_model::slice::Manifest;
use loip_runtime::net::direct::{PeerRef, PeersMsg};
use loip_runtime::net::store::Store;
use loip_runtime::wire::{ToCoordinator, ToWorker};
use loip_runtime::worker::{Worker, WorkerOptions};
use tokio::io::AsyncWriteExt;

#[test]
fn dist_worker_entry() {
    dist_common::worker_entry();
}

const TOKEN: &str = "a-test-token-of-some-length";

use dist_common::rt;

async fn start(name: &str) -> (String, std::path::PathBuf) {
    let store = dist_common::store_with_slices(name, "security-round3");
    let mut o = WorkerOptions::new("127.0.0.1:0", 256 << 20, &store);
    o.token = Some(TOKEN.into());
    o.name = Some(name.into());
    o.handshake_timeout = Duration::from_secs(2);
    let w = Worker::bind(o).await.unwrap();
    let addr = w.local_addr().to_string();
    tokio::spawn(w.serve());
    (addr, store)
}

/// Item 1: strangers hold every handshake slot with silent connections from five addresses
/// (4 each: the 16 slots and more); a coordinator with the token still gets in, through the
/// fast lane or a slot freed by the hello wait, every time.
#[test]
fn finding_1_silent_connections_from_five_addresses_do_not_keep_the_coordinator_out() {
    use loip_runtime::coordinator::{Conn, ConnectOptions, Endpoint};
    rt().block_on(async {
        let (addr, _) = start("r3-slots").await;
        let mut silent = Vec::new();
        for host in 2..=6 {
            for _ in 0..4 {
                let sock = tokio::net::TcpSocket::new_v4().unwrap();
                sock.bind(format!("127.0.0.{host}:0").parse().unwrap())
                    .unwrap();
                silent.push(sock.connect(addr.parse().unwrap()).await.unwrap());
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let ep = Endpoint {
            name: "dev".into(),
            addr: addr.clone(),
        };
        let opts = ConnectOptions {
            token: Some(TOKEN.into()),
            connect_timeout: Duration::from_secs(10),
            ..Default::default()
        };
        for i in 0..5 {
            let c = Conn::connect(&ep, &opts).await;
            assert!(c.is_ok(), "connect {i} refused: {:?}", c.err());
            c.unwrap().bye().await;
        }
        drop(silent);
    });
}

/// Item 4: the coordinator names a closed port and a host speaking another protocol as
/// peers; the worker answers "unreachable" for both, without "refused" or a frame length
/// decoded from the other side's banner.
#[test]
fn finding_4_peers_errors_say_only_unreachable() {
    rt().block_on(async {
        let (addr, _) = start("r3-peers").await;
        // a closed port: bind, note the port, close
        let closed = {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap().to_string()
        };
        // a server with a banner of another protocol
        let ssh = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ssh_addr = ssh.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = ssh.accept().await {
                let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n").await;
            }
        });
        let mut c = raw::authed(&addr, Some(TOKEN)).await;
        let peer = |device: u16, a: &str| PeerRef {
            device,
            name: format!("p{device}"),
            addr: a.to_string(),
            key: String::new(),
        };
        c.control(&ToWorker::Peers(PeersMsg {
            key: "ab".repeat(32),
            me: 0,
            expect: vec![],
            connect: vec![peer(1, &closed), peer(2, &ssh_addr)],
            measure: false,
        }))
        .await;
        let links = match c.recv_control().await {
            ToCoordinator::PeersReady { links } => links,
            other => panic!("expected PeersReady, got {other:?}"),
        };
        assert_eq!(links.len(), 2);
        for l in links {
            assert!(!l.reachable);
            let e = l.error.unwrap_or_default();
            assert!(e.starts_with("unreachable"), "{e}");
            for leak in ["refused", "length", "SSH", "bytes"] {
                assert!(!e.contains(leak), "{e}");
            }
        }
    });
}

/// Item 6: a link planted in the store to a file outside it is neither listed (with its size
/// and CRC) nor read when a manifest names it.
#[test]
fn finding_6_a_link_planted_in_the_store_is_not_listed_or_read() {
    let store = dist_common::store_with_slices("r3-link", "security-round3");
    let outside = dist_common::scratch("r3-outside").join("secret.bin");
    std::fs::write(&outside, vec![42u8; 4096]).unwrap();
    // named like a slice the manifest has, so a load would open it
    let m = Manifest::load(&dist_common::slices_of(
        &dist_common::fixture("tiny-llama"),
        "security-round3",
    ))
    .unwrap();
    let victim = m.slices[0].file.clone();
    std::fs::remove_file(store.join(&victim)).unwrap();
    std::os::unix::fs::symlink(&outside, store.join(&victim)).unwrap();
    let s = Store::open(&store).unwrap();
    assert!(
        s.inventory().iter().all(|e| e.file != victim),
        "the link is listed: {:?}",
        s.inventory()
    );
    // and a device opening it is refused rather than reading through the link
    let e = loip_runtime::resident::Resident::load(&store, &m.slices[..1])
        .err()
        .expect("reading through the link is refused");
    assert!(!e.to_string().contains("secret"), "{e}");
}

/// Item 5: a token holder that knows the pipeline's key claims lender 1's index on a peer
/// session. Lender 1's static key is not its own, so the session is refused before it can
/// fetch, put or drain lender 1's rows; the device that holds that key is admitted.
#[test]
fn finding_5_a_token_holder_claiming_lender_1_is_refused() {
    use loip_runtime::net::identity::Identity;
    use loip_runtime::net::peer::{self, PeerAuth};
    rt().block_on(async {
        let (addr, _) = start("r3-identity").await;
        let mut c = raw::authed(&addr, Some(TOKEN)).await;
        let lender = Identity::generate(); // lender 1's key, as the coordinator pinned it
        let key = "ab".repeat(32);
        c.control(&ToWorker::Peers(PeersMsg {
            key: key.clone(),
            me: 0,
            expect: vec![PeerRef {
                device: 1,
                name: "lender".into(),
                addr: String::new(),
                key: lender.fingerprint(),
            }],
            connect: vec![],
            measure: false,
        }))
        .await;
        assert!(matches!(
            c.recv_control().await,
            ToCoordinator::PeersReady { .. }
        ));
        let borrower = PeerRef {
            device: 0,
            name: "r3-identity".into(),
            addr: addr.clone(),
            key: c.key.clone(),
        };
        let to = Duration::from_secs(5);
        let attacker = Identity::generate();
        let claim = |identity| PeerAuth {
            me: 1,
            key: &key,
            identity,
            token: TOKEN,
        };
        let e = match peer::connect(&borrower, &claim(&attacker), to, None).await {
            Ok(_) => panic!("a session claiming lender 1 was opened with another device's key"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("static key") && e.contains("device 1"), "{e}");
        // the connecting side checks the accepting one's key too: a worker that is not the
        // device the coordinator named gets nothing, not even the pipeline's key
        let impostor = PeerRef {
            key: attacker.fingerprint(),
            ..borrower.clone()
        };
        let e = match peer::connect(&impostor, &claim(&lender), to, None).await {
            Ok(_) => panic!("a session to a device with another key was opened"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("another static key"), "{e}");
        // lender 1 itself gets in
        peer::connect(&borrower, &claim(&lender), to, None)
            .await
            .expect("the device with lender 1's key is admitted");
    });
}

/// Item 4 (`--peer-allow`): a worker that accepts only 127.0.0.2 closes a connection from
/// 127.0.0.1 at accept, before its hello, and lets the coordinator on 127.0.0.2 in.
#[test]
fn finding_4_peer_allow_refuses_connections_from_outside_at_accept() {
    use loip_runtime::coordinator::coordinator_identity;
    use loip_runtime::net::handshake;
    rt().block_on(async {
        let store = dist_common::store_with_slices("r3-allow", "security-round3");
        let mut o = WorkerOptions::new("127.0.0.1:0", 256 << 20, &store);
        o.token = Some(TOKEN.into());
        o.peer_allow = vec!["127.0.0.2/32".parse().unwrap()];
        let w = Worker::bind(o).await.unwrap();
        let addr = w.local_addr().to_string();
        tokio::spawn(w.serve());
        let from = |host: &'static str| {
            let addr = addr.clone();
            async move {
                let sock = tokio::net::TcpSocket::new_v4().unwrap();
                sock.bind(format!("{host}:0").parse().unwrap()).unwrap();
                sock.connect(addr.parse().unwrap()).await.unwrap()
            }
        };
        // outside: closed with nothing said
        let mut s = from("127.0.0.1").await;
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            loip_runtime::wire::read_frame(&mut s, 1 << 16),
        )
        .await
        .expect("closed at once");
        assert!(r.is_err(), "a connection from outside got {r:?}");
        // inside: the whole handshake
        let s = from("127.0.0.2").await;
        let (mut rd, mut wr) = s.into_split();
        handshake::connect(&mut rd, &mut wr, TOKEN, coordinator_identity())
            .await
            .expect("a coordinator inside --peer-allow is served");
    });
}

/// Item 9 (tokens): a token file that other users may read is refused, naming `chmod 600`;
/// the same file at mode 0600 is read.
#[test]
fn finding_9_a_group_or_world_readable_token_file_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = dist_common::scratch("r3-token-file");
    let path = dir.join("token");
    std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
    for mode in [0o644, 0o640, 0o604] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = loip_runtime::net::token::from_sources(Some(&path), None)
            .expect_err("a token file others may read is refused")
            .to_string();
        assert!(e.contains(&format!("chmod 600 {}", path.display())), "{e}");
    }
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let t = loip_runtime::net::token::from_sources(Some(&path), None).unwrap();
    assert_eq!(t.as_deref(), Some(TOKEN));
}

/// Noise sessions: the coordinator pins each device's static key on first contact; a device
/// answering under the same name with another key (its store replaced, or another machine at
/// its address) is refused with an error naming the device and how to accept the new key,
/// and accepted when told.
#[test]
fn noise_sessions_pin_each_device_key_and_refuse_a_changed_one() {
    use loip_runtime::coordinator::{Conn, ConnectOptions, Endpoint};
    use loip_runtime::net::known::KnownDevices;
    use std::sync::Arc;
    rt().block_on(async {
        let pins = dist_common::scratch("r3-pins").join("known_devices");
        let opts = |accept: Vec<String>| ConnectOptions {
            token: Some(TOKEN.into()),
            connect_timeout: Duration::from_secs(5),
            known_devices: Some(Arc::new(KnownDevices::new(&pins, accept))),
            ..Default::default()
        };
        let ep = |addr: &str| Endpoint {
            name: "edge-1".into(),
            addr: addr.to_string(),
        };
        let (first, _) = start("r3-pin-a").await;
        let c = Conn::connect(&ep(&first), &opts(vec![])).await.unwrap();
        let pinned = loip_runtime::wire::hex(&c.device_key);
        c.bye().await;
        let text = std::fs::read_to_string(&pins).unwrap();
        assert!(text.contains(&format!("edge-1 {pinned}")), "{text}");
        // the same device again: its key is the pinned one
        Conn::connect(&ep(&first), &opts(vec![]))
            .await
            .unwrap()
            .bye()
            .await;
        // another worker (another store, another key) under the same name
        let (second, _) = start("r3-pin-b").await;
        let e = Conn::connect(&ep(&second), &opts(vec![]))
            .await
            .err()
            .expect("a changed key is refused")
            .to_string();
        assert!(
            e.contains("edge-1") && e.contains("--accept-new-key edge-1"),
            "{e}"
        );
        assert!(e.contains(&pins.display().to_string()), "{e}");
        let c = Conn::connect(&ep(&second), &opts(vec!["edge-1".into()]))
            .await
            .unwrap();
        let now = loip_runtime::wire::hex(&c.device_key);
        c.bye().await;
        assert_ne!(now, pinned);
        let text = std::fs::read_to_string(&pins).unwrap();
        assert!(
            text.contains(&format!("edge-1 {now}")) && !text.contains(&pinned),
            "{text}"
        );
    });
}
