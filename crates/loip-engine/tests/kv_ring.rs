//! Sliding-window layers keep only their window (a ring), bit-identically: chunked prefill
//! with chunks longer than the window, one token at a time and a cache that keeps every
//! position all give the same logits; the ring's bytes stop growing at the window; lending
//! (the KV export/import) takes and returns a ring layer's oldest held rows byte for byte.

use std::path::PathBuf;

use loip_engine::{KvCache, Model, TokenPos};
use loip_model::Checkpoint;

fn open(name: &str) -> Checkpoint {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    Checkpoint::open(&dir).unwrap()
}

fn prompt(n: usize) -> Vec<u32> {
    (0..n).map(|i| 3 + (7 * i as u32) % 250).collect()
}

/// Logits of every position of `ids`, run in steps of `chunk` tokens on `kv`.
fn chunked(model: &Model, kv: &mut KvCache, ids: &[u32], chunk: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for (c, part) in ids.chunks(chunk).enumerate() {
        let batch: Vec<TokenPos> = (0..part.len())
            .map(|i| TokenPos {
                seq: 0,
                pos: c * chunk + i,
            })
            .collect();
        let x = model.forward_hidden(part, &batch, kv).unwrap();
        let rows: Vec<usize> = (0..part.len()).collect();
        out.extend(model.logits(&x, &rows).unwrap());
    }
    out
}

#[test]
fn ring_layers_are_bit_identical_to_keeping_everything() {
    for name in ["tiny-gemma3", "tiny-mistral-windowed"] {
        let mut ck = open(if name == "tiny-gemma3" { name } else { "tiny-mistral" });
        if name == "tiny-mistral-windowed" {
            ck.config.sliding_window = Some(5);
        }
        let c = ck.config.clone();
        let model = Model::bind(&ck, &c, ck.qk_permuted).unwrap();
        let ids = prompt(23);
        let mut full = KvCache::new(0..c.num_layers, model.tf.kv_dim(), None);
        let reference = chunked(&model, &mut full, &ids, ids.len());
        for chunk in [1, 2, 3, 4, 5, 7, 11, 23] {
            let mut kv = model.new_cache(None);
            assert_eq!(chunked(&model, &mut kv, &ids, chunk), reference, "{name} chunk {chunk}");
            let w = c.sliding_window.unwrap();
            for l in 0..c.num_layers {
                let want = c.layer_window(l).map_or(ids.len(), |w| w.min(ids.len()));
                assert_eq!(kv.len(0, l), want, "{name} layer {l}");
                assert_eq!(kv.next_pos(0, l), ids.len());
            }
            let rows: usize = (0..c.num_layers).map(|l| kv.len(0, l)).sum();
            assert_eq!(kv.used_bytes(), rows as u64 * kv.bytes_per_token_layer());
            assert!(kv.used_bytes() < full.used_bytes(), "window {w}");
        }
    }
}

#[test]
fn ring_bytes_stop_growing_at_the_window() {
    let ck = open("tiny-gemma3");
    let c = &ck.config;
    let model = Model::from_checkpoint(&ck).unwrap();
    let w = c.sliding_window.unwrap();
    let sliding = (0..c.num_layers).filter(|&l| c.is_sliding_layer(l)).count();
    let per = model.new_cache(None).bytes_per_token_layer();
    let ids = prompt(3 * w);
    let mut kv = model.new_cache(None);
    for (p, &id) in ids.iter().enumerate() {
        model
            .forward_hidden(&[id], &[TokenPos { seq: 0, pos: p }], &mut kv)
            .unwrap();
        let n = p + 1;
        let want = ((c.num_layers - sliding) * n + sliding * n.min(w)) as u64 * per;
        assert_eq!(kv.used_bytes(), want, "{n} positions");
    }
}

#[test]
fn ring_rows_lend_and_return_byte_for_byte() {
    let ck = open("tiny-gemma3");
    let c = &ck.config;
    let model = Model::from_checkpoint(&ck).unwrap();
    let ids = prompt(13);
    let mut whole = model.new_cache(None);
    let reference = chunked(&model, &mut whole, &ids, ids.len());
    let vocab = c.vocab_size;

    let mut kv = model.new_cache(None);
    let first = chunked(&model, &mut kv, &ids[..9], 4);
    assert_eq!(first, reference[..9 * vocab]);
    let ring = (0..c.num_layers).find(|&l| c.is_sliding_layer(l)).unwrap();
    let full = (0..c.num_layers).find(|&l| !c.is_sliding_layer(l)).unwrap();
    let w = c.sliding_window.unwrap();
    assert_eq!((kv.len(0, ring), kv.len(0, full)), (w, 9));
    // the window's oldest rows are positions 9 - w.. of the sequence
    let held: Vec<f32> = kv.rows(0, ring, 9 - w, 9).unwrap().0.to_vec();
    assert!(kv.rows(0, ring, 0, 9).is_err(), "dropped positions are not read");
    assert!(kv.lend_rows(0, ring, w + 1).is_err(), "only held rows are lent");
    let used = kv.used_bytes();
    let mut out = Vec::new();
    for l in 0..c.num_layers {
        let n = w - 1; // what lending takes: all but the newest row of the stage's layers
        out.push(kv.lend_rows(0, l, n).unwrap());
        assert_eq!(kv.lent(0, l), n);
    }
    assert_eq!(kv.used_bytes(), used - (c.num_layers * (w - 1)) as u64 * kv.bytes_per_token_layer());
    assert!(kv.rows(0, ring, 9 - w, 9).is_err(), "no read while rows are out");
    for (l, (k, v)) in out.iter().enumerate() {
        kv.return_rows(0, l, k, v).unwrap();
    }
    assert_eq!(kv.used_bytes(), used);
    assert_eq!(kv.rows(0, ring, 9 - w, 9).unwrap().0, &held[..]);
    // and the sequence goes on as if nothing had moved
    let batch: Vec<TokenPos> = (9..13).map(|pos| TokenPos { seq: 0, pos }).collect();
    let x = model.forward_hidden(&ids[9..], &batch, &mut kv).unwrap();
    let rest = model.logits(&x, &[0, 1, 2, 3]).unwrap();
    assert_eq!(rest, reference[9 * vocab..]);
}

#[test]
fn ring_rollback_of_one_token_keeps_the_window() {
    let ck = open("tiny-gemma3");
    let c = &ck.config;
    let model = Model::from_checkpoint(&ck).unwrap();
    let ids = prompt(10);
    let mut whole = model.new_cache(None);
    let reference = chunked(&model, &mut whole, &ids, ids.len());
    let mut kv = model.new_cache(None);
    chunked(&model, &mut kv, &ids[..9], 9);
    // a decode step that is rolled back, then run again: the same logits
    let step = [TokenPos { seq: 0, pos: 9 }];
    model.forward_hidden(&[ids[0]], &step, &mut kv).unwrap();
    kv.truncate(0, 9);
    let x = model.forward_hidden(&ids[9..], &step, &mut kv).unwrap();
    assert_eq!(model.logits(&x, &[0]).unwrap(), reference[9 * c.vocab_size..]);
    // a longer step rolled back past the window cannot be re-read: a typed error
    let long: Vec<TokenPos> = (10..16).map(|pos| TokenPos { seq: 0, pos }).collect();
    model.forward_hidden(&prompt(6), &long, &mut kv).unwrap();
    kv.truncate(0, 10);
    let again = model.forward_hidden(&prompt(6), &long, &mut kv);
    assert!(again.is_err(), "{again:?}");
}
