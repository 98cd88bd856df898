//! The planner's KV size of a sliding-window model (the shape `loip plan` builds from a
//! checkpoint) is what the engine's cache holds, below and above the window: every position
//! of a full-attention layer, the last `window` of a sliding one (for the whole model, and
//! for the layers of each stage), in one prompt or chunk by chunk.

use loip_engine::{Model, TokenPos};
use loip_model::Checkpoint;

#[test]
fn planner_kv_size_is_what_the_cache_holds() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-gemma3");
    let ck = Checkpoint::open(&dir).unwrap();
    let c = &ck.config;
    let shape = loip_runtime::shape::shape_from_checkpoint("tiny-gemma3", &ck);
    assert_eq!(shape.sliding_window, c.sliding_window.map(|w| w as u64));
    assert!(shape.layer_window(0).is_some() && shape.layer_window(5).is_none());
    let model = Model::from_checkpoint(&ck).unwrap();
    let w = c.sliding_window.unwrap();
    for n in [1, 3, w - 1, w, w + 1, 12, 30] {
        for chunk in [1, 5, n] {
            let input: Vec<u32> = (0..n).map(|i| 3 + 7 * i as u32).collect();
            let mut kv = model.new_cache(None);
            for (k, part) in input.chunks(chunk).enumerate() {
                let batch: Vec<TokenPos> = (0..part.len())
                    .map(|i| TokenPos {
                        seq: 0,
                        pos: k * chunk + i,
                    })
                    .collect();
                model.forward_hidden(part, &batch, &mut kv).unwrap();
            }
            let held = shape.kv_bytes(c.num_layers as u64, n as u64);
            assert_eq!(kv.used_bytes(), held, "{n} positions in chunks of {chunk}");
            let per = kv.bytes_per_token_layer();
            for stage in [0..2u32, 3..6, 5..6] {
                let rows: usize = stage.clone().map(|l| kv.len(0, l as usize)).sum();
                assert_eq!(shape.kv_bytes_of(stage, n as u64), rows as u64 * per);
            }
        }
    }
}
