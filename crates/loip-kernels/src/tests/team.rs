//! The step's team (`crate::team`): the same bits as plain rayon for every parallel kernel,
//! every chunk of a region run exactly once (also across parks and wake-ups), nested steps
//! and regions, and panics in a region propagated to the caller with the pool still usable.

use super::{bits, random_f32, random_matrix};
use crate::attention::{attention_at, attention_causal_at};
use crate::canon::Act;
use crate::dtype::{DType, Matrix};
use crate::elementwise::act_mul_par;
use crate::matmul::{matmul_at, matmul_many_at};
use crate::ops::on_pool;
use crate::simd::{supported, Level};
use crate::team;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicUsize, Ordering};

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool")
}

/// Every parallel kernel of a step, run once; the outputs concatenated.
fn step(level: Level, ws: &[Matrix], x: &[f32], kv: (&[f32], &[f32])) -> Vec<f32> {
    let mut out = Vec::new();
    for n in [1, 3, 8] {
        for w in ws {
            let mut y = vec![f32::NAN; n * w.rows];
            matmul_at(level, w, &x[..n * w.cols], &mut y).expect("matmul");
            out.extend(y);
        }
        let refs: Vec<&Matrix> = ws.iter().collect();
        let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n * w.rows]).collect();
        let mut slices: Vec<&mut [f32]> = ys.iter_mut().map(|y| y.as_mut_slice()).collect();
        matmul_many_at(level, &refs, &x[..n * ws[0].cols], &mut slices).expect("matmul_many");
        out.extend(ys.into_iter().flatten());
    }
    let (k, v) = kv;
    let (heads, kv_heads, hd) = (9, 3, 64);
    let ctx = k.len() / (kv_heads * hd);
    let q = &x[..4 * heads * hd];
    let mut o = vec![f32::NAN; heads * hd];
    attention_at(
        level,
        &q[..heads * hd],
        k,
        v,
        ctx,
        heads,
        kv_heads,
        hd,
        &mut o,
    );
    out.extend(o);
    let mut o = vec![f32::NAN; 4 * heads * hd];
    let start = ctx - 4;
    attention_causal_at(level, q, k, v, start, (heads, kv_heads, hd), &mut o);
    out.extend(o);
    // the activations of a prompt's MLP, long enough to be split over the threads
    let len = x.len() * 10 + 37;
    let up: Vec<f32> = x.iter().cycle().skip(5).take(len).copied().collect();
    for act in [Act::Silu, Act::GeluTanh] {
        let mut g: Vec<f32> = x.iter().cycle().take(len).map(|v| v * 3.0).collect();
        act_mul_par(level, act, &mut g, &up);
        out.extend(g);
    }
    out
}

#[test]
fn team_gives_the_bits_of_plain_rayon() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let shapes = [
        (192, 576, DType::Q4_1),
        (300, 256, DType::Q8_0),
        (96, 576, DType::Q4_1),
    ];
    let datas: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&(r, c, d)| random_matrix(d, r, c, &mut rng))
        .collect();
    let ws: Vec<Matrix> = shapes
        .iter()
        .zip(&datas)
        .map(|(&(r, c, d), b)| Matrix::new(d, r, c, b).expect("shape"))
        .collect();
    let ws_many: Vec<Matrix> = ws.iter().filter(|w| w.cols == 576).copied().collect();
    let x = random_f32(8 * 576, &mut rng);
    let ctx = 200;
    let k = random_f32(ctx * 3 * 64, &mut rng);
    let v = random_f32(ctx * 3 * 64, &mut rng);
    for level in [Level::Scalar, Level::Avx2, Level::Avx512, Level::Neon] {
        if !supported(level) {
            continue;
        }
        let want = pool(1).install(|| step(level, &ws_many, &x, (&k, &v)));
        for threads in [2, 3, 4] {
            let p = pool(threads);
            for _ in 0..3 {
                let got = p.install(|| on_pool(|| step(level, &ws_many, &x, (&k, &v))));
                assert_eq!(bits(&got), bits(&want), "{level:?} threads={threads}");
                // from outside the pool too (one hand-off, as the engine's step)
                let got = p.install(|| {
                    std::thread::scope(|s| {
                        s.spawn(|| on_pool(|| step(level, &ws_many, &x, (&k, &v))))
                            .join()
                            .expect("step")
                    })
                });
                assert_eq!(bits(&got), bits(&want), "{level:?} threads={threads}");
            }
        }
    }
    // the plain matmuls too (a shape that is not in `matmul_many`'s list)
    let w = &ws[1];
    let mut want = vec![0f32; 8 * w.rows];
    matmul_at(Level::Scalar, w, &x[..8 * w.cols], &mut want).expect("matmul");
    let mut got = vec![f32::NAN; 8 * w.rows];
    pool(3)
        .install(|| on_pool(|| matmul_at(Level::Scalar, w, &x[..8 * w.cols], &mut got)))
        .expect("matmul");
    assert_eq!(bits(&got), bits(&want));
}

#[test]
fn every_chunk_runs_once_across_parks_and_nesting() {
    for threads in [2, 3, 4] {
        let p = pool(threads);
        p.install(|| {
            on_pool(|| {
                // under Miri (`cargo +nightly miri test`) a few rounds check the protocol
                let (rounds, nest_every, park_every) = if cfg!(miri) {
                    (12, 5, 4)
                } else {
                    (300usize, 50, 100)
                };
                for round in 0..rounds {
                    let n = 1 + round % 97;
                    let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                    team::par_for(n, |i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                        if i == 0 && round % nest_every == 0 {
                            // a nested region runs serially on the leader, on rayon elsewhere
                            let inner = AtomicUsize::new(0);
                            team::par_for(10, |_| {
                                inner.fetch_add(1, Ordering::Relaxed);
                            });
                            assert_eq!(inner.load(Ordering::Relaxed), 10);
                            // and a nested step is part of this one
                            assert_eq!(on_pool(|| 7), 7);
                        }
                    });
                    assert!(
                        hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                        "round {round}"
                    );
                    if round % park_every == park_every - 1 {
                        // longer than the helpers' spin: they park and must wake again
                        std::thread::sleep(std::time::Duration::from_millis(2));
                    }
                }
                let mut v = vec![0usize; 1000];
                team::par_chunks_mut(&mut v, 7, |i, c| c.iter_mut().for_each(|e| *e = i));
                assert!(v.iter().enumerate().all(|(j, &e)| e == j / 7));
            })
        });
    }
}

#[test]
fn a_panic_in_a_region_reaches_the_caller_and_the_pool_still_works() {
    let p = pool(3);
    for who in [0, 37, 63] {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.install(|| {
                on_pool(|| {
                    team::par_for(64, |i| {
                        if i == who {
                            panic!("chunk {i}");
                        }
                    })
                })
            })
        }));
        assert!(r.is_err());
        let sum = AtomicUsize::new(0);
        p.install(|| {
            on_pool(|| {
                team::par_for(64, |i| {
                    sum.fetch_add(i, Ordering::Relaxed);
                })
            })
        });
        assert_eq!(sum.load(Ordering::Relaxed), 64 * 63 / 2);
    }
    // a panic in the step itself (outside a region) dismisses the team too
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        p.install(|| on_pool(|| panic!("step")))
    }));
    assert!(r.is_err());
    assert_eq!(p.install(|| on_pool(|| 1)), 1);
}
