//! The planner's KV size of a sliding-window model (the shape `loip plan` builds from a
//! checkpoint) is what the engine's cache holds after a prompt longer than the window: every
//! position of every layer, so the planner never counts a sliding layer at its window while
//! the cache keeps more.

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
    for n in [1, 3, 4, 5, 12] {
        let input: Vec<u32> = (0..n).map(|i| 3 + 7 * i as u32).collect();
        let mut kv = model.new_cache(None);
        let batch: Vec<TokenPos> = (0..n).map(|pos| TokenPos { seq: 0, pos }).collect();
        model.forward_hidden(&input, &batch, &mut kv).unwrap();
        let held = shape.kv_bytes(c.num_layers as u64, n as u64);
        assert_eq!(kv.used_bytes(), held, "{n} positions");
    }
}
