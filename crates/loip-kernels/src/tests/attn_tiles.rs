//! The AVX-512 and AVX2 attention tiles (K transposed, scores 16 or 8 positions per vector,
//! query heads interleaved) against the scalar path, bit for bit: long prompts over several position
//! blocks, chunks starting mid-cache, head dims of 1 to 8 groups, scores that underflow
//! exp, zeros, and 1-3 threads.

use super::{bits, causal_on, random_f32, LEVELS};
use crate::attention::{attention_at, attention_window_at, tiles_usable};
use crate::simd::{supported, Level};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Queries of `m` tokens scaled by `spread`, and K, V of `n` rows, with exact zeros (signed
/// zero products) in some K rows.
fn inputs(
    rng: &mut ChaCha8Rng,
    (m, n): (usize, usize),
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    spread: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut q = random_f32(m * n_heads * hd, rng);
    q.iter_mut().for_each(|x| *x *= spread);
    let mut k = random_f32(n * n_kv * hd, rng);
    let v = random_f32(n * n_kv * hd, rng);
    for x in k.iter_mut() {
        if rng.gen_range(0..7) == 0 {
            *x = 0.0;
        }
    }
    (q, k, v)
}

#[test]
fn causal_tiles_match_scalar() {
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    for (start, m, n_heads, n_kv, hd, spread) in [
        (0, 300, 9, 3, 64, 1.0),
        (129, 40, 4, 1, 128, 1.0),
        (17, 33, 6, 2, 48, 1.0),
        (0, 5, 2, 2, 16, 1.0),
        (250, 20, 8, 2, 32, 30.0),
        (3, 61, 5, 5, 64, 30.0),
    ] {
        let n = start + m;
        let (q, k, v) = inputs(&mut rng, (m, n), n_heads, n_kv, hd, spread);
        let w = n_heads * hd;
        let mut want = vec![0f32; m * w];
        for (i, o) in want.chunks_exact_mut(w).enumerate() {
            let qi = &q[i * w..(i + 1) * w];
            attention_at(
                Level::Scalar,
                qi,
                &k,
                &v,
                start + i + 1,
                n_heads,
                n_kv,
                hd,
                o,
            );
        }
        for level in LEVELS.into_iter().filter(|&l| supported(l)) {
            for threads in [1, 2, 3] {
                let got = causal_on(
                    level,
                    threads,
                    &q,
                    &k,
                    &v,
                    start,
                    (n_heads, n_kv, hd),
                    m * w,
                );
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "tiles {start}+{m} {n_heads}/{n_kv} hd {hd} {level:?} threads={threads}"
                );
            }
        }
    }
}

/// Sliding-window prompt attention (tiled, or plain where the head dim is not whole vectors)
/// is each query's decode attention over exactly its window's rows, bit for bit, on every
/// level and thread count: windows of 1, 4, 17, 128 and at least the length; query runs
/// that start inside the window and past it.
#[test]
fn sliding_window_matches_each_query_alone() {
    let mut rng = ChaCha8Rng::seed_from_u64(43);
    for (start, m, n_heads, n_kv, hd, spread) in [
        (0, 300, 9, 3, 64, 1.0),
        (200, 40, 4, 1, 128, 1.0),
        (17, 33, 6, 2, 48, 1.0),
        (3, 61, 5, 5, 64, 30.0),
        (130, 17, 6, 1, 32, 1.0),
        (5, 20, 4, 2, 24, 1.0),
    ] {
        let n = start + m;
        let (q, k, v) = inputs(&mut rng, (m, n), n_heads, n_kv, hd, spread);
        let (w, stride) = (n_heads * hd, n_kv * hd);
        for window in [1, 4, 17, 128, n, n + 5] {
            let mut want = vec![0f32; m * w];
            for (i, o) in want.chunks_exact_mut(w).enumerate() {
                let end = start + i + 1;
                let f = end.saturating_sub(window);
                let (qi, kf, vf) = (&q[i * w..(i + 1) * w], &k[f * stride..], &v[f * stride..]);
                attention_at(Level::Scalar, qi, kf, vf, end - f, n_heads, n_kv, hd, o);
            }
            // K and V from the first query's first position on
            let base = (start + 1).saturating_sub(window);
            let (kb, vb) = (&k[base * stride..], &v[base * stride..]);
            for level in LEVELS.into_iter().filter(|&l| supported(l)) {
                for threads in [1, 2, 3] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .expect("pool");
                    let mut got = vec![f32::NAN; m * w];
                    let heads = (n_heads, n_kv, hd);
                    pool.install(|| {
                        attention_window_at(level, &q, kb, vb, (start, window), heads, &mut got)
                    });
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "window {window} {start}+{m} {n_heads}/{n_kv} hd {hd} {level:?} \
                         threads={threads}"
                    );
                }
            }
        }
    }
}

/// Both x86 SIMD levels take the tiles (so the test above compares them with scalar).
#[test]
fn tiles_serve_avx2_and_avx512() {
    for level in [Level::Avx2, Level::Avx512] {
        let x86 = cfg!(any(target_arch = "x86_64", target_arch = "x86"));
        assert_eq!(
            tiles_usable(level, 64),
            x86 && supported(level),
            "{level:?}"
        );
        assert!(
            !tiles_usable(level, 24),
            "{level:?}: head dim not whole groups"
        );
    }
    assert!(!tiles_usable(Level::Scalar, 64));
}
