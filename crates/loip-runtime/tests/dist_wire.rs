//! The wire protocol against a real worker: versions, tokens, garbage, oversized and
//! malformed frames. The worker must refuse each with a clear message, close only that
//! connection, and go on serving.

mod dist_common;

use std::time::Duration;

use loip_runtime::coordinator::{Conn, ConnectOptions, Endpoint};
use loip_runtime::wire::{self, FrameKind, Role, ToCoordinator, ToWorker, WireError};
use loip_runtime::worker::{Worker, WorkerOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

async fn start_worker(name: &str, token: Option<&str>) -> String {
    let mut o = WorkerOptions::new("127.0.0.1:0", 1 << 30, dist_common::scratch(name));
    o.token = token.map(str::to_string);
    o.name = Some(name.to_string());
    o.handshake_timeout = Duration::from_secs(2);
    let w = Worker::bind(o).await.unwrap();
    let addr = w.local_addr().to_string();
    tokio::spawn(w.serve());
    addr
}

fn ep(name: &str, addr: &str) -> Endpoint {
    Endpoint {
        name: name.into(),
        addr: addr.into(),
    }
}

fn opts(token: Option<&str>) -> ConnectOptions {
    ConnectOptions {
        token: token.map(str::to_string),
        connect_timeout: Duration::from_secs(3),
        ..Default::default()
    }
}

/// Reads frames until the worker closes; returns the text of its `Error` frame, if any.
async fn error_then_close(s: &mut TcpStream) -> Option<String> {
    let mut msg = None;
    loop {
        match tokio::time::timeout(Duration::from_secs(5), wire::read_frame(s, wire::MAX_FRAME))
            .await
        {
            Ok(Ok(f)) if f.kind == FrameKind::Error => {
                msg = Some(String::from_utf8_lossy(&f.payload).into_owned())
            }
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return msg,
            Err(_) => panic!("the worker kept the connection open"),
        }
    }
}

async fn authed_raw(addr: &str, token: Option<&str>) -> dist_common::raw::Raw {
    dist_common::raw::authed(addr, token).await
}

#[test]
fn right_token_is_accepted_and_wrong_token_refused_on_both_sides() {
    rt().block_on(async {
        let addr = start_worker("auth", Some("s3cret")).await;
        let c = Conn::connect(&ep("dev-a", &addr), &opts(Some("s3cret")))
            .await
            .unwrap();
        assert_eq!(c.info.name, "auth");
        c.bye().await;
        for bad in [Some("wrong"), None] {
            let e = Conn::connect(&ep("dev-a", &addr), &opts(bad))
                .await
                .err()
                .expect("refused");
            let text = e.to_string();
            assert!(matches!(e.source, WireError::AuthRefused(_)), "{text}");
            assert!(
                text.contains("dev-a") && text.contains(&addr) && text.contains("wrong token"),
                "{text}"
            );
        }
        // A worker without the token cannot pass as one: the coordinator checks it too.
        let open = start_worker("open", None).await;
        let e = Conn::connect(&ep("dev-b", &open), &opts(Some("s3cret")))
            .await
            .err()
            .expect("refused");
        // (the key schedule mixes the token in on both sides, so the open worker refuses
        // first; either way nobody gets in)
        assert!(matches!(e.source, WireError::AuthRefused(_)), "{e}");
        // Still serving after all that.
        Conn::connect(&ep("dev-a", &addr), &opts(Some("s3cret")))
            .await
            .unwrap()
            .bye()
            .await;
    });
}

#[test]
fn other_protocol_version_is_refused_naming_both_versions() {
    rt().block_on(async {
        let addr = start_worker("version", None).await;
        let mut s = TcpStream::connect(&addr).await.unwrap();
        wire::write_frame(
            &mut s,
            FrameKind::Hello,
            &wire::hello_payload(Role::Coordinator, 99),
            None,
        )
        .await
        .unwrap();
        let msg = error_then_close(&mut s).await.expect("an error frame");
        assert!(
            msg.contains(&format!("v{}", wire::PROTOCOL_VERSION))
                && msg.contains("v99")
                && msg.contains("version"),
            "{msg}"
        );

        // The coordinator side: a "worker" that speaks the next version.
        let fake = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let fake_addr = fake.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = fake.accept().await.unwrap();
            let _ = wire::write_frame(
                &mut s,
                FrameKind::Hello,
                &wire::hello_payload(Role::Worker, wire::PROTOCOL_VERSION + 1),
                None,
            )
            .await;
            let mut buf = [0u8; 64];
            let _ = s.read(&mut buf).await;
        });
        let e = Conn::connect(&ep("future", &fake_addr), &opts(None))
            .await
            .err()
            .expect("refused");
        assert!(
            matches!(
                e.source,
                WireError::VersionMismatch { ours, theirs }
                    if ours == wire::PROTOCOL_VERSION && theirs == ours + 1
            ),
            "{e}"
        );
        assert!(e.to_string().contains("future"), "{e}");
        Conn::connect(&ep("v", &addr), &opts(None))
            .await
            .unwrap()
            .bye()
            .await;
    });
}

#[test]
fn garbage_oversized_truncated_and_malformed_frames_close_only_that_connection() {
    rt().block_on(async {
        let addr = start_worker("garbage", Some("t")).await;
        // Plain garbage instead of a hello.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let msg = error_then_close(&mut s).await;
        assert!(msg.is_some_and(|m| m.contains("refused")));
        // Random bytes with a small length and an unknown kind.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(&[3, 0, 0, 0, 0xee, 1, 2, 3]).await.unwrap();
        error_then_close(&mut s).await;
        // An oversized frame after authentication.
        let mut s = authed_raw(&addr, Some("t")).await;
        let len = (wire::MAX_FRAME as u32 + 17).to_le_bytes();
        s.wr.get_mut().write_all(&[len[0], len[1], len[2], len[3], FrameKind::Step as u8]).await.unwrap();
        let msg = s.error_then_close().await.expect("error frame");
        assert!(msg.contains("exceeds the limit"), "{msg}");
        // A malformed step: a count far beyond the payload.
        let mut s = authed_raw(&addr, Some("t")).await;
        let mut p = 7u64.to_le_bytes().to_vec();
        p.push(0);
        p.extend_from_slice(&u32::MAX.to_le_bytes());
        s.send(FrameKind::Step, &p).await;
        let msg = s.error_then_close().await.expect("error frame");
        assert!(msg.contains("protocol error"), "{msg}");
        // Bad JSON in a control frame.
        let mut s = authed_raw(&addr, Some("t")).await;
        s.send(FrameKind::Control, b"{\"type\":\"launch_missiles\"}").await;
        assert!(s.error_then_close().await.is_some());
        // A frame cut short by the peer closing.
        let mut s = authed_raw(&addr, Some("t")).await;
        s.wr.get_mut().write_all(&[100, 0, 0, 0, FrameKind::Control as u8, b'{']).await.unwrap();
        drop(s);
        // A slice name that would escape the store.
        let mut s = authed_raw(&addr, Some("t")).await;
        let entry = serde_json::json!({"kind": "embed", "file": "../evil.slice", "size": 4096, "crc32": "0", "tensors": []});
        let msg = serde_json::json!({"type": "put_slice", "entry": entry});
        s.send(FrameKind::Control, msg.to_string().as_bytes()).await;
        let msg = s.error_then_close().await.expect("error frame");
        assert!(msg.contains("refusing slice file name"), "{msg}");
        // A step before any device is loaded fails that step only.
        let mut s = authed_raw(&addr, Some("t")).await;
        let h = wire::StepHeader { step: 5, embed: true, head: false, keep: false, stages: vec![0], batch: vec![loip_engine::TokenPos { seq: 1, pos: 0 }], rows: vec![], argmax: None, row_masks: vec![], rewind: vec![] };
        s.send(FrameKind::Step, &wire::encode_step(&h, &wire::u32_bytes(&[1]))).await;
        match s.recv_control().await {
            ToCoordinator::Failed { step: Some(5), message } => assert!(message.contains("no device"), "{message}"),
            other => panic!("{other:?}"),
        }
        s.control(&ToWorker::Ping { id: 9 }).await;
        assert!(matches!(s.recv_control().await, ToCoordinator::Pong { id: 9 }));
        drop(s);
        // After all of it the worker still serves a proper coordinator.
        let mut c = Conn::connect(&ep("ok", &addr), &opts(Some("t"))).await.unwrap();
        assert!(c.rtt().await.unwrap() < 1.0);
        c.bye().await;
    });
}

#[test]
fn a_second_coordinator_is_refused_while_one_is_served() {
    rt().block_on(async {
        let addr = start_worker("busy", None).await;
        let first = Conn::connect(&ep("w", &addr), &opts(None)).await.unwrap();
        let o = ConnectOptions {
            connect_timeout: Duration::from_millis(600),
            ..opts(None)
        };
        let e = Conn::connect(&ep("w", &addr), &o)
            .await
            .err()
            .expect("busy");
        assert!(e.to_string().contains("busy"), "{e}");
        first.bye().await;
        // Once the first one is gone, the next one gets in (retrying while the worker
        // finishes the old session).
        Conn::connect(&ep("w", &addr), &opts(None))
            .await
            .unwrap()
            .bye()
            .await;
    });
}
