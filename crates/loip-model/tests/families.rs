//! Every family's tensors land in the slice of the block that binds them: Gemma 3's
//! `post_attention_layernorm` normalizes the attention output, so it travels with the
//! attention block; Qwen2's biases with theirs. A split of each tiny fixture holds exactly
//! the tensors the config implies, each in its block's slice.

mod common;

use common::{fixture, TempDir};
use loip_model::names::TensorGroup;
use loip_model::slice::{slice_of_in, split, Manifest, SliceKind, SplitProgress};
use loip_model::{model_tensors, Checkpoint};

#[test]
fn each_family_splits_into_the_blocks_the_engine_binds() {
    for name in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-mistral",
        "tiny-gemma3",
    ] {
        let ck = Checkpoint::open(&fixture(name)).unwrap();
        for spec in model_tensors(&ck.config) {
            let want = match spec.group {
                TensorGroup::Embedding => SliceKind::Embed,
                TensorGroup::Attention(l) => SliceKind::Attn(l),
                TensorGroup::Mlp(l) => SliceKind::Mlp(l),
                TensorGroup::Head => SliceKind::Head,
            };
            assert_eq!(
                slice_of_in(&ck.config, &spec.name),
                Some(want),
                "{name}: {}",
                spec.name
            );
        }
        let dir = TempDir::new("families");
        split(
            &ck,
            dir.path(),
            SplitProgress {
                on_bytes: &|_, _| {},
            },
        )
        .unwrap();
        let m = Manifest::load(dir.path()).unwrap();
        assert_eq!(m.config, ck.config, "{name}");
        let held: usize = m.slices.iter().map(|s| s.tensors.len()).sum();
        assert_eq!(held, model_tensors(&ck.config).len(), "{name}");
    }
}
