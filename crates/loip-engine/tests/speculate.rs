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

/// A draft model: the target itself (every draft accepted), another model with the same
/// vocabulary (tokens still the target's), and a model with other special ids (refused).
#[test]
fn a_draft_model_gives_the_targets_tokens_and_itself_is_always_accepted() {
    use loip_engine::speculate::draft::{vocab_matches, ModelDrafter};
    use loip_engine::speculate::{generate_speculative, SpecOptions};
    use loip_engine::Flow;

    let open = |n: &str| Checkpoint::open(&fixture(n)).unwrap();
    let (target_ck, other_ck, qwen_ck) = (
        open("tiny-llama"),
        open("tiny-llama-bf16-tied"),
        open("tiny-qwen3"),
    );
    let target = Model::from_checkpoint(&target_ck).unwrap();
    let other = Model::from_checkpoint(&other_ck).unwrap();
    assert!(vocab_matches(&target_ck.config, &other_ck.config).is_ok());
    let refused = vocab_matches(&target_ck.config, &qwen_ck.config).unwrap_err();
    assert!(refused.contains("BOS"), "{refused}");
    for c in spec_common::cases(256, &[2]) {
        let (want, want_rows) = spec_common::reference(&target, &c);
        for (draft, is_self) in [(&target, true), (&other, false)] {
            for k in [1, 3, 6] {
                let mut rec = spec_common::Rec::new(Generator::new(&target, None));
                let mut drafter = ModelDrafter::new(Generator::new(draft, None), 7);
                let spec = SpecOptions {
                    k_max: k,
                    adaptive: false,
                    ..Default::default()
                };
                let got = generate_speculative(
                    &mut rec,
                    7,
                    &c.prompt,
                    &c.opts,
                    &mut drafter,
                    &spec,
                    &mut |_| Flow::Continue,
                )
                .unwrap();
                let tag = format!("self={is_self} k={k}");
                assert_eq!(got.out.new_ids, want, "{tag}");
                for (pos, l) in &want_rows {
                    assert!(rec.rows.get(pos) == Some(l), "{tag}: logits at {pos}");
                }
                let s = got.stats;
                // the draft does not mask EOS before `min_tokens`, and a drafted EOS that ends
                // the request is not counted as accepted: only the plain greedy case is exact
                if is_self && c.opts.sampling.temperature == 0.0 && c.opts.min_tokens == 0 {
                    assert!(s.drafted - s.accepted <= 1, "{tag}: {s:?}");
                }
            }
        }
    }
}

/// A self-draft (the target's first layers, final norm and head): the target's tokens and
/// kept logits, greedy and sampled, on a full-attention and a sliding-window model; all
/// the layers or none are refused.
#[test]
fn a_self_draft_gives_the_targets_tokens() {
    use loip_engine::speculate::draft::{self_draft, self_draft_layers, ModelDrafter};
    use loip_engine::speculate::{generate_speculative, SpecOptions};
    use loip_engine::Flow;

    assert_eq!(self_draft_layers("self:2").unwrap(), Some(2));
    assert_eq!(self_draft_layers("smollm2").unwrap(), None);
    assert!(self_draft_layers("self:x").is_err());
    for name in ["tiny-llama", "tiny-gemma3"] {
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let target = Model::from_checkpoint(&ckpt).unwrap();
        let all = ckpt.config.num_layers;
        assert!(self_draft(&ckpt, 0).is_err() && self_draft(&ckpt, all).is_err());
        let draft = self_draft(&ckpt, all / 2).unwrap();
        let vocab = ckpt.config.vocab_size as u32;
        for (ci, c) in spec_common::cases(vocab, &[2]).iter().enumerate() {
            let (want, want_rows) = spec_common::reference(&target, c);
            let mut rec = spec_common::Rec::new(Generator::new(&target, None));
            let mut drafter = ModelDrafter::new(Generator::new(&draft, None), 7)
                .sampling(&c.opts.sampling)
                .unwrap();
            let spec = SpecOptions {
                k_max: 4,
                adaptive: false,
                ..Default::default()
            };
            let got = generate_speculative(
                &mut rec,
                7,
                &c.prompt,
                &c.opts,
                &mut drafter,
                &spec,
                &mut |_| Flow::Continue,
            )
            .unwrap();
            let tag = format!("{name} case {ci}");
            if c.opts.sampling.temperature == 0.0 {
                // greedy: the tokens and each kept token's logits are the target's
                assert_eq!(got.out.new_ids, want, "{tag}");
                for (pos, l) in &want_rows {
                    assert!(rec.rows.get(pos) == Some(l), "{tag}: logits at {pos}");
                }
            } else {
                // sampled drafts: the target's law, not its seeded tokens
                assert_eq!(got.out.new_ids.len(), want.len(), "{tag}");
            }
            assert!(got.stats.accepted <= got.stats.drafted, "{tag}");
        }
    }
}
