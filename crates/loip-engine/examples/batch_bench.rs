//! Aggregate decode throughput of continuous batching on SmolLM2-135M (Q4_1), one device:
//! 1, 2, 4 and 8 concurrent sequences through the batch runner ([`Serving`]) against the same
//! requests one at a time through `generate`. Prints a table; asserts nothing about speed
//! (it does check that both give the same tokens).
//!
//! `cargo run --release -p loip-engine --example batch_bench [-- NEW_TOKENS [PROMPT_LEN]]`
//! (defaults 64 and 16). Threads: the kernels' pool (`RAYON_NUM_THREADS`). `LOIP_BENCH_SEQS`
//! (e.g. `1,8`) runs only those batch sizes (for profiling one of them);
//! `LOIP_BENCH_MATMUL=0` skips the matmul table; `LOIP_BENCH_ALONE=0` skips the
//! one-at-a-time runs (and the check against them).

use std::time::Instant;

use loip_engine::{
    generate, one_device_limits, Flow, GenerateOptions, Generator, Model, SamplingParams, SeqEvent,
    Serving,
};
use loip_model::Checkpoint;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let new_tokens: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(64);
    let prompt_len: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(16);
    let ckpt = Checkpoint::open(&loip_model::fetch::fetch_smollm2()?)?;
    let model = Model::from_checkpoint(&ckpt)?;
    let vocab = ckpt.config.vocab_size;
    let opts = GenerateOptions {
        max_tokens: new_tokens,
        sampling: SamplingParams::default(),
        eos_ids: ckpt.config.eos_token_ids.clone(),
        min_tokens: new_tokens,
    };
    let prompt = |s: usize| -> Vec<u32> {
        (0..prompt_len)
            .map(|i| ((s * 7919 + i * 104_729 + 1) % vocab) as u32)
            .collect()
    };
    println!(
        "SmolLM2-135M Q4_1, {} threads, prompt {prompt_len}, {new_tokens} new tokens each (greedy)",
        rayon::current_num_threads()
    );
    println!(
        "{:>4} {:>16} {:>16} {:>9} {:>14} {:>12}",
        "seqs", "one-at-a-time/s", "batched tok/s", "speedup", "vs 1 batched", "ms/step"
    );
    let seqs: Vec<usize> = match std::env::var("LOIP_BENCH_SEQS") {
        Ok(v) => v
            .split(',')
            .map(|s| s.trim().parse())
            .collect::<Result<_, _>>()?,
        Err(_) => vec![1, 2, 4, 8],
    };
    let mut base = None;
    for n in seqs {
        // One at a time.
        let t0 = Instant::now();
        let mut alone = Vec::new();
        let skip_alone = std::env::var("LOIP_BENCH_ALONE").is_ok_and(|v| v == "0");
        for s in (0..n).filter(|_| !skip_alone) {
            let mut gen = Generator::new(&model, None);
            let out = generate(&mut gen, s as u64, &prompt(s), &opts, &mut |_| {
                Flow::Continue
            })?;
            alone.push(out.new_ids);
        }
        let seq_rate = (n * new_tokens) as f64 / t0.elapsed().as_secs_f64();
        // All at once through the scheduler.
        let mut serving = Serving::new(
            one_device_limits(&model, None),
            Generator::new(&model, None),
        )?;
        let t1 = Instant::now();
        let now = |t: Instant| t.elapsed().as_secs_f64();
        for s in 0..n {
            serving.submit(now(t1), s as u64, &prompt(s), &opts)?;
        }
        let mut done = vec![Vec::new(); n];
        let mut steps = 0usize;
        while !serving.is_idle() && steps < 100_000 {
            for e in serving.step(&mut || now(t1))? {
                if let SeqEvent::Done { seq, new_ids, .. } = e {
                    done[seq as usize] = new_ids;
                }
            }
            steps += 1;
        }
        let secs = t1.elapsed().as_secs_f64();
        let rate = (n * new_tokens) as f64 / secs;
        if !skip_alone && done != alone {
            return Err("batched tokens differ from one-at-a-time".into());
        }
        let b1 = *base.get_or_insert(rate);
        println!(
            "{n:>4} {seq_rate:>16.1} {rate:>16.1} {:>8.2}x {:>13.2}x {:>12.2}",
            rate / seq_rate,
            rate / b1,
            secs * 1e3 / steps as f64
        );
    }
    if std::env::var("LOIP_BENCH_MATMUL").map_or(true, |v| v != "0") {
        matmul_table(&ckpt)?;
    }
    Ok(())
}

/// The n > 1 matmul on its own: time per call of one MLP gate matrix and of the LM head with
/// n activation rows. Reading the weights once for n rows should keep the time per call
/// nearly flat in n while decoding is memory-bound; a time growing ~linearly in n means the
/// kernel's per-row compute, not the weight reads, bounds a batched step.
fn matmul_table(ckpt: &Checkpoint) -> Result<(), Box<dyn std::error::Error>> {
    let cfg = &ckpt.config;
    let mlp = loip_engine::MlpWeights::bind(ckpt, cfg, 0)?;
    let head = loip_engine::HeadWeights::bind(ckpt, cfg)?;
    println!("\nmatmul alone (µs per call, median of 15; the kernels' pool)");
    println!(
        "{:>4} {:>14} {:>10} {:>14} {:>10}",
        "rows", "gate (1536x576)", "x n=1", "lm_head", "x n=1"
    );
    let mut base = None;
    for n in [1usize, 2, 4, 8] {
        let mut t = [0f64; 2];
        for (k, w) in [mlp.gate, head.lm_head].iter().enumerate() {
            let x: Vec<f32> = (0..n * w.cols)
                .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
                .collect();
            let mut y = vec![0f32; n * w.rows];
            let mut times: Vec<f64> = (0..15)
                .map(|_| {
                    let t0 = Instant::now();
                    loip_kernels::on_pool(|| loip_kernels::matmul(w, &x, &mut y))?;
                    Ok(t0.elapsed().as_secs_f64() * 1e6)
                })
                .collect::<Result<_, loip_kernels::KernelError>>()?;
            times.sort_by(f64::total_cmp);
            t[k] = times[7];
        }
        let b = *base.get_or_insert(t);
        println!(
            "{n:>4} {:>14.1} {:>9.2}x {:>14.1} {:>9.2}x",
            t[0],
            t[0] / b[0],
            t[1],
            t[1] / b[1]
        );
    }
    Ok(())
}
