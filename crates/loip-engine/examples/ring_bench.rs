//! Sliding-window KV as a ring against a cache that keeps every position, on Gemma 3 270M
//! (Q4_K_M; 15 of 18 layers slide, window 512): a prompt of PROMPT tokens in chunks of 256,
//! then NEW decode steps, each way in turn (ROUNDS rounds, interleaved). Prints decode ms per
//! token and KV bytes held; checks that both give bit-identical logits; asserts nothing about
//! speed.
//!
//! `cargo run --release -p loip-engine --example ring_bench [-- PROMPT [NEW [ROUNDS]]]`
//! (defaults 1024, 32, 3).

use std::time::Instant;

use loip_engine::{KvCache, Model, TokenPos};
use loip_model::Checkpoint;

fn run(model: &Model, kv: &mut KvCache, prompt: &[u32], new: usize) -> (f64, Vec<f32>) {
    let mut pos = 0;
    for part in prompt.chunks(256) {
        let batch: Vec<TokenPos> = (pos..pos + part.len())
            .map(|pos| TokenPos { seq: 0, pos })
            .collect();
        model.forward_hidden(part, &batch, kv).expect("prefill");
        pos += part.len();
    }
    let mut logits = Vec::new();
    let t = Instant::now();
    for i in 0..new {
        let id = prompt[i % prompt.len()];
        let x = model
            .forward_hidden(&[id], &[TokenPos { seq: 0, pos }], kv)
            .expect("decode");
        logits = model.logits(&x, &[0]).expect("logits");
        pos += 1;
    }
    (t.elapsed().as_secs_f64() * 1e3 / new as f64, logits)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut arg = |d: usize| -> Result<usize, std::num::ParseIntError> {
        args.next().map_or(Ok(d), |a| a.parse())
    };
    let (n_prompt, new, rounds) = (arg(1024)?, arg(32)?, arg(3)?);
    let ckpt = Checkpoint::open(&loip_model::fetch::fetch_gemma3_270m()?)?;
    let model = Model::from_checkpoint(&ckpt)?;
    let c = &ckpt.config;
    let prompt: Vec<u32> = (0..n_prompt).map(|i| 100 + (i as u32 * 37) % 5000).collect();
    println!("prompt {n_prompt}, {new} decode steps, window {:?}", c.sliding_window);
    for r in 0..rounds {
        let mut ring = model.new_cache(None);
        let (ms_ring, l_ring) = run(&model, &mut ring, &prompt, new);
        let mut full = KvCache::new(0..c.num_layers, model.tf.kv_dim(), None);
        let (ms_full, l_full) = run(&model, &mut full, &prompt, new);
        assert_eq!(l_ring, l_full, "ring and full cache differ");
        println!(
            "round {r}: ring {ms_ring:.2} ms/token, {} KV bytes | full {ms_full:.2} ms/token, {} KV bytes | ratio {:.3}",
            ring.used_bytes(),
            full.used_bytes(),
            ms_ring / ms_full
        );
    }
    Ok(())
}
