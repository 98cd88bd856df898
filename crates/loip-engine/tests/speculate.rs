//! Lossless speculative decoding in memory: every request decoded with speculation gets
//! the tokens of `generate` without it, and each kept token comes from bit-identical logits,
//! whatever the draft length (fixed 1, 2, 4, 7 or adaptive), the drafts (prompt lookup,
//! always right, always wrong, right then wrong), greedy or seeded sampling, an EOS mask
//! until `min_tokens`, and a sliding-window model (whose ring keeps `k` spare positions).

mod spec_common;

use std::path::PathBuf;

use loip_engine::{Generator, Model};
use loip_model::Checkpoint;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn check_model(name: &str) {
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let hits =
        spec_common::check_matrix(&model, name, || Generator::new(&model, None), |_, _, _| {});
    assert!(hits > 0, "{name}: prompt lookup never hit");
}

#[test]
fn speculation_is_lossless_on_tiny_llama() {
    check_model("tiny-llama");
}

#[test]
fn speculation_is_lossless_on_a_sliding_window_model() {
    check_model("tiny-gemma3");
}

#[test]
fn speculation_is_lossless_on_tiny_qwen3() {
    check_model("tiny-qwen3");
}
