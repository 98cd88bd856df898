//! Lossless speculative decoding from slice files: with every block, the MLP blocks, or
//! every other layer offloaded, speculation gives the in-memory engine's tokens and
//! bit-identical logits for every draft length and drafter of the matrix, and a verify step
//! reads each offloaded block once for all its positions (fewer bytes than decoding one
//! position per step whenever drafts are accepted).

#[path = "../../loip-engine/tests/spec_common/mod.rs"]
mod spec_common;

use std::path::{Path, PathBuf};

use loip_engine::Model;
use loip_model::slice::{self, Manifest, SliceKind, SplitProgress};
use loip_model::Checkpoint;
use loip_runtime::local::{LocalModel, LocalOptions, OffloadRule};
use loip_runtime::LoaderKind;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn split(ckpt: &Checkpoint, tag: &str) -> TempDir {
    let p = std::env::temp_dir().join(format!("loip-spec-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    slice::split(
        ckpt,
        &p,
        SplitProgress {
            on_bytes: &|_, _| {},
        },
    )
    .unwrap();
    TempDir(p)
}

/// Bytes of the blocks `rule` offloads.
fn offloaded_bytes(dir: &Path, rule: OffloadRule) -> u64 {
    let m = Manifest::load(dir).unwrap();
    (0..m.config.num_layers)
        .flat_map(|l| {
            let attn = matches!(rule, OffloadRule::All | OffloadRule::Attn)
                || (rule == OffloadRule::Alternate && l % 2 == 1);
            let mlp = matches!(rule, OffloadRule::All | OffloadRule::Mlp)
                || (rule == OffloadRule::Alternate && l % 2 == 1);
            [(attn, SliceKind::Attn(l)), (mlp, SliceKind::Mlp(l))]
        })
        .filter(|(off, _)| *off)
        .map(|(_, k)| m.slice(k).unwrap().size)
        .sum()
}

fn check(name: &str, rules: &[OffloadRule]) {
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
    let model = Model::from_checkpoint(&ckpt).unwrap();
    let dir = split(&ckpt, name);
    for &rule in rules {
        let per_pass = offloaded_bytes(&dir.0, rule);
        let open = || {
            let opts = LocalOptions {
                mem_budget: None,
                rule,
                loader: LoaderKind::Direct,
                overlap: true,
                context: 64,
                max_step_tokens: 32,
            };
            LocalModel::open(&dir.0, &opts).unwrap()
        };
        let hits = spec_common::check_matrix(&model, name, open, |tag, rec, _| {
            // each forward reads every offloaded block once (a prefetch of the next step's
            // first blocks may be in flight when the run ends)
            let loaded = rec.inner.device.take_times().loaded_bytes;
            let forwards = rec.forwards as u64;
            assert!(
                loaded >= forwards * per_pass && loaded <= (forwards + 1) * per_pass,
                "{tag} {rule:?}: {loaded} bytes loaded over {forwards} forwards of {per_pass}"
            );
        });
        assert!(hits > 0, "{name} {rule:?}: prompt lookup never hit");
    }
}

#[test]
fn speculation_offloaded_is_lossless_and_loads_once_per_step() {
    check("tiny-llama", &[OffloadRule::All, OffloadRule::Alternate]);
    check("tiny-gemma3", &[OffloadRule::Mlp]);
}
