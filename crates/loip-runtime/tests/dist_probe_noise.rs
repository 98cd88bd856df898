//! Manual experiment (ignored): raw direct-loader times on a store, alone and with
//! `LOIP_NOISE_THREADS` loaders reading at once. `LOIP_NOISE_DIR=<store with manifest>`.
use loip_model::slice::{Manifest, SliceKind};
use loip_runtime::{Loader, LoaderKind};
use std::path::PathBuf;

#[test]
#[ignore]
fn raw_loader_times() {
    let Ok(dir) = std::env::var("LOIP_NOISE_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let m = Manifest::load(&dir).unwrap();
    let threads: usize = std::env::var("LOIP_NOISE_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (dir, m) = (dir.clone(), m.clone());
            std::thread::spawn(move || {
                let a = m.slice(SliceKind::Attn(2 * t)).unwrap().clone();
                let p = m.slice(SliceKind::Mlp(2 * t)).unwrap().clone();
                let groups = vec![vec![a.clone()], vec![p.clone()], vec![a, p]];
                let mut ld = Loader::new(LoaderKind::Direct, &dir, &groups).unwrap();
                let mut out = Vec::new();
                for _ in 0..6 {
                    for g in 0..3 {
                        ld.start(g).unwrap();
                        ld.wait(g).unwrap();
                        out.push(format!(
                            "g{g} {:.1}ms {:.2}GB/s",
                            ld.last.load_s * 1e3,
                            ld.last.bytes as f64 / ld.last.load_s / 1e9
                        ));
                    }
                }
                out
            })
        })
        .collect();
    for (t, h) in hs.into_iter().enumerate() {
        eprintln!("thread {t}: {}", h.join().unwrap().join(" | "));
    }
}
