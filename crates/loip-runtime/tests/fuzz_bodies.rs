//! The bodies of the fuzz targets in `fuzz/bodies/` (the Noise handshake, `peers` lists,
//! lent-KV frames) run on stable over a stated number of seeded inputs, random and mutated
//! from valid ones, so CI exercises the same code as `cargo fuzz` (which needs nightly).
//! A panic fails the test; each run prints how many inputs it fed and how long they took.

#[path = "../../../fuzz/bodies/lent_kv.rs"]
mod lent_kv;
#[path = "../../../fuzz/bodies/mutate.rs"]
mod mutate;
#[path = "../../../fuzz/bodies/noise.rs"]
mod noise;
#[path = "../../../fuzz/bodies/peers.rs"]
mod peers;

use loip_runtime::net::direct::{self, PeerRef, PeersMsg, ToPeer};
use loip_runtime::wire::{self, lend, FrameKind, ToWorker};
use rand::Rng;

/// Feeds `count` inputs of at most `max_len` bytes to `body`; prints the count.
fn feed(name: &str, count: usize, seeds: &[Vec<u8>], max_len: usize, body: fn(&[u8])) {
    let mut rng = mutate::rng(0x10_1f ^ name.len() as u64);
    let t = std::time::Instant::now();
    for _ in 0..count {
        body(&mutate::input(&mut rng, seeds, max_len));
    }
    eprintln!(
        "fuzz body {name}: {count} inputs ({} seeds) in {:.1} s, no panic",
        seeds.len(),
        t.elapsed().as_secs_f64()
    );
}

/// A pick byte, then `rest`.
fn picked(pick: u8, rest: Vec<u8>) -> Vec<u8> {
    let mut v = vec![pick];
    v.extend(rest);
    v
}

fn random(rng: &mut impl Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.gen()).collect()
}

#[test]
fn fuzz_body_noise_handshake_messages_10k() {
    let mut rng = mutate::rng(1);
    let hs = |p: Vec<u8>| noise::frame(FrameKind::Handshake, &p);
    let mut seeds = Vec::new();
    for pick in 0..4u8 {
        // the worker's side reads -> e (32 bytes), then -> s, se, psk (64); the connecting
        // side reads <- e, ee, s, es (96), then the sealed confirmation (16)
        let (a, b) = if pick & 1 == 0 { (32, 64) } else { (96, 16) };
        let mut rest = hs(random(&mut rng, a));
        rest.extend(hs(random(&mut rng, b)));
        seeds.push(picked(pick, rest));
        seeds.push(picked(
            pick,
            noise::frame(FrameKind::Error, b"refused: wrong token"),
        ));
    }
    feed("noise", 10_000, &seeds, 512, noise::run);
}

#[test]
fn fuzz_body_peers_lists_100k() {
    let peer = |device: u16| PeerRef {
        device,
        name: format!("dev-{device}"),
        addr: format!("10.0.0.{device}:7001"),
        key: "cd".repeat(32),
    };
    let msg = ToWorker::Peers(PeersMsg {
        key: "ab".repeat(32),
        me: 0,
        expect: vec![peer(1), peer(2)],
        connect: vec![peer(3)],
        measure: true,
    });
    let hello = ToPeer::Hello {
        key: "ab".repeat(32),
        from: 1,
    };
    let seeds = vec![
        wire::control_payload(&msg).unwrap(),
        wire::control_payload(&hello).unwrap(),
        direct::encode_hand(7, 1, &[0u8; 16]),
        direct::encode_routed(
            &direct::Routed {
                hop: 1,
                from: Some(0),
                to: None,
            },
            &[0u8; 24],
        ),
    ];
    feed("peers", 100_000, &seeds, 1024, peers::run);
}

#[test]
fn fuzz_body_lent_kv_frames_100k() {
    let rows: lend::LentRows = vec![(3, 2), (9, 1)];
    let blob = lend::encode_blob(&rows, &[0.5f32; 3 * 2 * 2 * 4]);
    let put = lend::KvHeader {
        op: lend::KvOp::Put,
        lender: 3,
        stage: 1,
    };
    let seeds = vec![
        lend::encode_kv(put, &blob),
        lend::encode_kv(
            lend::KvHeader {
                op: lend::KvOp::Data,
                ..put
            },
            &blob,
        ),
        wire::control_payload(&ToWorker::Borrow {
            lender: 1,
            bytes: 4096,
            via: Some(1),
        })
        .unwrap(),
        wire::control_payload(&ToWorker::KvFetch {
            lender: 1,
            stage: 0,
        })
        .unwrap(),
    ];
    feed("lent_kv", 100_000, &seeds, 1024, lent_kv::run);
}
