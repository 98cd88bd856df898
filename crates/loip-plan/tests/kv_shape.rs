//! The KV size of a shape with sliding-window layers (Gemma 3's pattern): which layers slide,
//! and the KV-size methods every plan and cost uses, which count a sliding layer at
//! `min(context, window)` because the engine's cache keeps only its window (the runtime's
//! `kv_shape` test checks the count against the cache the engine fills).

use loip_plan::ModelShape;

fn gemma_like() -> ModelShape {
    // Gemma 3 270M's dimensions: 18 layers, every 6th full, window 512
    let layers: Vec<bool> = (0..18).map(|i| i % 6 < 5).collect();
    ModelShape::from_dims(
        "gemma3-270m",
        640,
        2048,
        18,
        4,
        1,
        256,
        262_144,
        true,
        2.0,
        4,
    )
    .with_sliding_window(Some(512), layers)
}

#[test]
fn sliding_layers_are_read() {
    let s = gemma_like();
    assert_eq!(s.layer_window(0), Some(512));
    assert_eq!(s.layer_window(5), None);
    assert_eq!(s.layer_window(6), Some(512));
    assert_eq!((0..18).filter(|&l| s.layer_window(l).is_some()).count(), 15);
    // one window on every layer (Mistral)
    let m = ModelShape::from_dims("m", 64, 128, 4, 4, 2, 16, 256, false, 2.0, 4)
        .with_sliding_window(Some(8), Vec::new());
    assert!((0..4).all(|l| m.layer_window(l) == Some(8)));
    // no window: no layer flags kept
    let n = ModelShape::from_dims("n", 64, 128, 2, 4, 2, 16, 256, false, 2.0, 4)
        .with_sliding_window(None, vec![true, false]);
    assert_eq!((n.layer_window(0), n.sliding_layers.len()), (None, 0));
}

#[test]
fn kv_bytes_counts_what_the_cache_holds() {
    let s = gemma_like();
    let per_token_layer = 2 * 256 * 4;
    assert_eq!(s.kv_bytes_per_token, per_token_layer);
    for context in [0, 1, 511, 512, 513, 4096] {
        // 15 sliding layers stop at the window, 3 full ones keep every position
        let sliding = context.min(512);
        assert_eq!(s.kv_bytes(18, context), (3 * context + 15 * sliding) * per_token_layer);
        // any 3 layers: at most 3 full ones
        assert_eq!(s.kv_bytes(3, context), 3 * context * per_token_layer);
        assert_eq!(s.kv_bytes(5, context), (3 * context + 2 * sliding) * per_token_layer);
        // given layers: exact
        assert_eq!(s.kv_bytes_of(0..6, context), (context + 5 * sliding) * per_token_layer);
        assert_eq!(s.kv_bytes_of([0, 1], context), 2 * sliding * per_token_layer);
        assert_eq!(s.kv_bytes_of(0..18, context), s.kv_bytes(18, context));
    }
    // one window everywhere (Mistral): the whole model stops growing at the window
    let m = ModelShape::from_dims("m", 64, 128, 4, 4, 2, 16, 256, false, 2.0, 4)
        .with_sliding_window(Some(8), Vec::new());
    assert_eq!(m.kv_bytes(4, 100), m.kv_bytes(4, 8));
    assert_eq!(m.kv_tokens_within(4, 1 << 30), u64::MAX);
}

#[test]
fn tokens_within_a_budget_invert_the_count() {
    let s = gemma_like();
    for bytes in [0, 1000, 18 * 2048 * 512, 18 * 2048 * 513, 1 << 30] {
        let t = s.kv_tokens_within(18, bytes);
        assert!(s.kv_bytes(18, t) <= bytes, "{bytes}: {t}");
        assert!(s.kv_bytes(18, t + 1) > bytes, "{bytes}: {t} is the most");
    }
    let plain = ModelShape::from_dims("p", 64, 128, 2, 4, 2, 16, 256, false, 2.0, 4);
    assert_eq!(plain.kv_tokens_within(2, 1000), 1000 / (2 * plain.kv_bytes_per_token));
}

#[test]
fn shapes_without_windows_still_parse() {
    let s = gemma_like();
    let text = serde_json::to_string(&s).unwrap();
    assert_eq!(serde_json::from_str::<ModelShape>(&text).unwrap(), s);
    let plain = ModelShape::from_dims("p", 64, 128, 2, 4, 2, 16, 256, false, 2.0, 4);
    let text = serde_json::to_string(&plain).unwrap();
    assert!(!text.contains("sliding"), "{text}");
    assert_eq!(serde_json::from_str::<ModelShape>(&text).unwrap(), plain);
}
