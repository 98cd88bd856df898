//! The AVX-512 and AVX2 attention tiles (K transposed, scores 16 or 8 positions per vector,
//! query heads interleaved) against the scalar path, bit for bit: long prompts over several position
//! blocks, chunks starting mid-cache, head dims of 1 to 8 groups, scores that underflow
//! exp, zeros, and 1-3 threads.

use super::{bits, causal_on, random_f32, LEVELS};
use crate::attention::{attention_at, tiles_usable};
use crate::simd::{supported, Level};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

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
        let mut q = random_f32(m * n_heads * hd, &mut rng);
        q.iter_mut().for_each(|x| *x *= spread);
        let mut k = random_f32(n * n_kv * hd, &mut rng);
        let v = random_f32(n * n_kv * hd, &mut rng);
        // exact zeros (signed zero products) in some K rows
        for x in k.iter_mut() {
            if rng.gen_range(0..7) == 0 {
                *x = 0.0;
            }
        }
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
