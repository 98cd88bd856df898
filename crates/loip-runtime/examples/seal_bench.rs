//! What sealing costs per hop: seal + open of one activation frame, in memory (no socket), for
//! a SmolLM2 activation (576 f32 = 2,304 bytes) and a 70B-sized one (8,192 f32 = 32 KiB), plus
//! a 1 MiB frame for the throughput, with the keys of a real Noise handshake (also timed).
//! `cargo run --release -p loip-runtime --example seal_bench`

use std::time::Instant;

use loip_runtime::net::handshake::{self, Handshake};
use loip_runtime::net::identity::Identity;
use loip_runtime::wire::{self, FrameKind, Role};

/// Both sides of one handshake over an in-memory pipe.
async fn handshake_pair() -> (Handshake, Handshake) {
    let (a, b) = tokio::io::duplex(1 << 16);
    let (mut ar, mut aw) = tokio::io::split(a);
    let (mut br, mut bw) = tokio::io::split(b);
    let (ci, wi) = (Identity::generate(), Identity::generate());
    let c = handshake::connect(&mut ar, &mut aw, "bench-token", &ci);
    let w = handshake::accept_role(&mut br, &mut bw, "bench-token", &wi);
    let (c, w) = tokio::join!(c, w);
    (c.expect("handshake"), w.expect("handshake").0)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut hs = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        rt.block_on(handshake_pair());
        hs.push(t.elapsed().as_secs_f64());
    }
    println!(
        "Noise_XXpsk3_25519_ChaChaPoly_BLAKE2s handshake, both sides in one thread: {:.0} µs (median of 200)\n",
        median(hs) * 1e6
    );
    println!("| frame | bytes | plaintext write + read, µs | sealed write + read, µs | sealing adds, µs |");
    println!("|---|---|---|---|---|");
    for (name, bytes) in [
        ("SmolLM2 activation", 576 * 4),
        ("70B activation", 8192 * 4),
        ("1 MiB", 1 << 20),
    ] {
        let (c, w) = rt.block_on(handshake_pair());
        let payload = vec![7u8; bytes];
        let times = rt.block_on(async {
            let (a, b) = tokio::io::duplex(4 << 20);
            let (_ar, aw) = tokio::io::split(a);
            let (br, _bw) = tokio::io::split(b);
            let (_x, mut tx) = c.keys.seal(Role::Coordinator, tokio::io::empty(), aw, None);
            let (mut rx, _y) = w.keys.seal(Role::Worker, br, tokio::io::sink(), None);
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
