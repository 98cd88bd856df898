//! What sealing costs per hop: seal + open of one activation frame, in memory (no socket), for
//! a SmolLM2 activation (576 f32 = 2,304 bytes) and a 70B-sized one (8,192 f32 = 32 KiB), plus
//! a 1 MiB frame for the throughput. `cargo run --release -p loip-runtime --example seal_bench`

use std::time::Instant;

use loip_runtime::net::session::{Ephemeral, SessionKeys, TranscriptParts};
use loip_runtime::wire::{self, FrameKind, Role};

fn keys() -> (SessionKeys, SessionKeys) {
    let (ec, ew) = (Ephemeral::new(), Ephemeral::new());
    let (nc, kc, nw, kw) = (ec.nonce, ec.public, ew.nonce, ew.public);
    let parts = TranscriptParts {
        hello_c: b"c",
        hello_w: b"w",
        nonce_w: &nw,
        key_w: &kw,
        nonce_c: &nc,
        key_c: &kc,
    };
    let c = SessionKeys::derive("bench-token", ec, &kw, &parts).expect("keys");
    let w = SessionKeys::derive("bench-token", ew, &kc, &parts).expect("keys");
    (c, w)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!("| frame | bytes | plaintext write + read, µs | sealed write + read, µs | sealing adds, µs |");
    println!("|---|---|---|---|---|");
    for (name, bytes) in [
        ("SmolLM2 activation", 576 * 4),
        ("70B activation", 8192 * 4),
        ("1 MiB", 1 << 20),
    ] {
        let (c, w) = keys();
        let payload = vec![7u8; bytes];
        let times = rt.block_on(async {
            let (a, b) = tokio::io::duplex(4 << 20);
            let (_ar, aw) = tokio::io::split(a);
            let (br, _bw) = tokio::io::split(b);
            let (_x, mut tx) = c.seal(Role::Coordinator, tokio::io::empty(), aw, None);
            let (mut rx, _y) = w.seal(Role::Worker, br, tokio::io::sink(), None);
            let mut v = Vec::new();
            for _ in 0..2000 {
                let t = Instant::now();
                tx.write(FrameKind::Step, &payload).await.expect("write");
                let f = rx.read(8 << 20).await.expect("read");
                v.push(t.elapsed().as_secs_f64());
                assert_eq!(f.payload.len(), bytes);
            }
            v
        });
        let plain = rt.block_on(async {
            let (mut a, mut b) = tokio::io::duplex(4 << 20);
            let mut v = Vec::new();
            for _ in 0..2000 {
                let t = Instant::now();
                wire::write_frame(&mut a, FrameKind::Step, &payload, None)
                    .await
                    .expect("write");
                let f = wire::read_frame(&mut b, 8 << 20).await.expect("read");
                v.push(t.elapsed().as_secs_f64());
                assert_eq!(f.payload.len(), bytes);
            }
            v
        });
        let (p, s) = (median(plain), median(times));
        println!(
            "| {name} | {bytes} | {:.1} | {:.1} | {:.1} |",
            p * 1e6,
            s * 1e6,
            (s - p) * 1e6
        );
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
