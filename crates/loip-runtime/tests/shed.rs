//! Shedding under memory pressure is lossless and keeps the contract: a device that
//! offloads resident blocks mid-generation (`Device::shed`, what the pressure guard calls
//! between steps) gives logits bit-identical to one that never shed, frees what it says it
//! freed, lowers its budget by exactly that, and keeps its KV room; a device with nothing
//! left that frees memory says so and changes nothing.

use std::path::{Path, PathBuf};

use loip_engine::StepBackend;
use loip_model::slice::{self, SplitProgress};
use loip_model::Checkpoint;
use loip_runtime::executor::BlockPlacement;
use loip_runtime::local::{LocalModel, LocalOptions, OffloadRule};
use loip_runtime::LoaderKind;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// A slice directory of `name`, removed on drop.
struct Slices(PathBuf);
impl Slices {
    fn of(name: &str, tag: &str) -> Slices {
        let p = std::env::temp_dir().join(format!("loip-shed-{tag}-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let progress = SplitProgress {
            on_bytes: &|_, _| {},
        };
        slice::split(&ckpt, &p, progress).unwrap();
        Slices(p)
    }
}
impl Drop for Slices {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn open(dir: &Path, budget: u64) -> LocalModel {
    let opts = LocalOptions {
        mem_budget: Some(budget),
        rule: OffloadRule::None,
        loader: LoaderKind::Direct,
        overlap: true,
        context: 64,
        max_step_tokens: 16,
    };
    LocalModel::open(dir, &opts).unwrap()
}

const PROMPT: &[u32] = &[1, 5, 9, 23, 42, 7];

/// Greedy logits of the prompt and `n` steps; `at(i, model)` runs before step `i`.
fn run(m: &mut LocalModel, n: usize, mut at: impl FnMut(usize, &mut LocalModel)) -> Vec<Vec<f32>> {
    let mut logits = vec![m.step(0, PROMPT, 0).unwrap()];
    for i in 0..n {
        at(i, m);
        let next = loip_engine::sampling::argmax(logits.last().unwrap());
        logits.push(m.step(0, &[next], PROMPT.len() + i).unwrap());
    }
    logits
}

fn offloaded(m: &LocalModel) -> usize {
    m.device
        .spec()
        .stages
        .iter()
        .flat_map(|s| &s.layers)
        .map(|l| {
            (l.attn == BlockPlacement::Offloaded) as usize
                + (l.mlp == BlockPlacement::Offloaded) as usize
        })
        .sum()
}

#[test]
fn shedding_mid_run_is_bit_identical_and_keeps_the_kv_room() {
    for name in ["tiny-llama", "tiny-gemma3"] {
        let dir = Slices::of(name, "mid-run");
        let budget = 64 << 20;
        let want = run(&mut open(&dir.0, budget), 12, |_, _| {});
        let mut sheds = Vec::new();
        let got = run(&mut open(&dir.0, budget), 12, |i, m| {
            if i == 3 || i == 7 {
                let before = m.device.memory();
                let target = (before.resident / 4).max(1);
                let done = m.device.shed(target).unwrap().expect("blocks to offload");
                let after = m.device.memory();
                assert!(done.freed > 0, "{name}: {done:?}");
                assert_eq!(after, done.memory);
                assert_eq!(after.budget, before.budget - done.freed, "{name}");
                assert_eq!(
                    before.resident + before.slot - (after.resident + after.slot),
                    done.freed,
                    "{name}: freed what it says"
                );
                assert_eq!(after.kv_budget, before.kv_budget, "{name}: KV room");
                sheds.push((done.freed, done.blocks, offloaded(m)));
            }
        });
        eprintln!("{name}: sheds (freed, blocks, offloaded now) {sheds:?}");
        assert_eq!(sheds.len(), 2);
        assert!(
            sheds[1].2 > sheds[0].2,
            "{name}: the second shed offloads more"
        );
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name}: logits of step {i} differ after shedding");
        }
    }
}

#[test]
fn a_device_with_nothing_left_to_shed_changes_nothing() {
    let dir = Slices::of("tiny-llama", "nothing-left");
    let mut m = open(&dir.0, 64 << 20);
    // shed everything that frees memory, then once more
    let mut n = 0;
    while m.device.shed(u64::MAX).unwrap().is_some() {
        n += 1;
        assert!(n < 8, "shedding never ends");
    }
    let before = m.device.memory();
    assert!(m.device.shed(1 << 20).unwrap().is_none());
    assert_eq!(m.device.memory(), before);
    // and it still generates
    let want = run(&mut open(&dir.0, 64 << 20), 4, |_, _| {});
    let got = run(&mut m, 4, |_, _| {});
    assert_eq!(
        got.iter()
            .map(|r| loip_engine::sampling::argmax(r))
            .collect::<Vec<_>>(),
        want.iter()
            .map(|r| loip_engine::sampling::argmax(r))
            .collect::<Vec<_>>()
    );
}
