//! `loip bench`: benchmark programs that print tables (never timed assertions).
//!
//! - `engine`: decode ms/token of the single-device engine at 1 and 2 threads; with `--seqs`,
//!   the batched decode step of several sequences (one forward for all, as the server runs
//!   them) and its throughput against one sequence's.
//! - `loader`: one block's load latency and GB/s from a cold cache: the raw `O_DIRECT` read
//!   rate of the same file at the loader's request size and queue depth, next to the direct
//!   and conventional loaders (interleaved rounds, medians), and load + compute of that block.
//! - `offload`: decode ms/token of one device with half its layers offloaded, with and
//!   without overlap and with the conventional loader, next to the ideal max(compute, load).
//! - `speculate`: decode with and without speculative decoding (`cmd_bench/spec.rs`).
//! - `model`: one model's prefill and decode, best of rounds, as the llama.cpp comparison
//!   measures llama.cpp (`cmd_bench/side.rs`).

mod serve;
mod side;
mod spec;
mod spec_batch;
mod spec_drafts;
mod spec_local;

use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use loip_engine::generate::{generate, Flow};
use loip_engine::weights::MlpWeights;
use loip_engine::{GenerateOptions, Generator, Model, SamplingParams, StepBackend};
use loip_model::slice::{Manifest, SliceKind};
use loip_runtime::loader::{drop_cache, Loader, RawReader};
use loip_runtime::local::{LocalModel, LocalOptions, OffloadRule};
use loip_runtime::LoaderKind;
use serde_json::json;

/// Arguments of `loip bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchWhat,
    /// Also write the results as JSON to this file.
    #[arg(long, global = true)]
    out: Option<std::path::PathBuf>,
}

#[derive(Subcommand, Debug)]
enum BenchWhat {
    /// Decode ms/token of the in-memory engine at 1 and 2 threads.
    Engine {
        /// Model: a known name (`smollm2`, `gemma3-270m`), an HF directory or a GGUF file.
        #[arg(long, default_value = "smollm2")]
        model: String,
        /// Tokens to decode per measurement.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// Also time batched decode steps of these numbers of sequences (e.g. `1,8`): each
        /// step advances every sequence by one token in one forward; alternating rounds.
        #[arg(long, value_delimiter = ',')]
        seqs: Vec<usize>,
    },
    /// One block's load from a cold cache: raw O_DIRECT read, direct and conventional loaders.
    Loader {
        /// A slice directory (`loip split`), or a model to split into the cache.
        #[arg(long)]
        model: String,
        /// Rounds (each: raw read, direct loader, conventional loader; blocks alternate).
        #[arg(long, default_value_t = 16)]
        repeats: usize,
    },
    /// Decode with half the layers offloaded: overlap, no overlap, conventional.
    Offload {
        /// A slice directory (`loip split`), or a model to split into the cache.
        #[arg(long)]
        model: String,
        /// Tokens to decode per measurement.
        #[arg(long, default_value_t = 8)]
        tokens: usize,
    },
    /// Load an OpenAI-compatible server: throughput, TTFT and inter-token percentiles.
    Serve(serve::ServeBenchArgs),
    /// Decode with and without speculative decoding (prompt lookup): ms/token, acceptance.
    Speculate(spec::SpecBenchArgs),
    /// One model's prefill and decode ms/token at `--threads`, best of rounds in one process
    /// (what bench/compare_llama_cpp.sh sets beside llama.cpp).
    Model(side::ModelBenchArgs),
}

/// `loip bench`.
pub fn run(a: BenchArgs) -> Result<()> {
    let result = match a.what {
        BenchWhat::Engine {
            model,
            tokens,
            seqs,
        } => {
            let mut v = engine(&model, tokens)?;
            if !seqs.is_empty() {
                v = json!({"decode": v, "batched": batched(&model, tokens, &seqs)?});
            }
            v
        }
        BenchWhat::Loader { model, repeats } => loader(&model, repeats)?,
        BenchWhat::Offload { model, tokens } => offload(&model, tokens)?,
        BenchWhat::Serve(s) => serve::run(s)?,
        BenchWhat::Speculate(s) => spec::run(s)?,
        BenchWhat::Model(s) => side::run(s)?,
    };
    if let Some(path) = a.out {
        std::fs::write(&path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

pub(super) fn greedy(max: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: max,
        sampling: SamplingParams::default(),
        eos_ids: vec![],
        min_tokens: 0,
    }
}

fn decode_ms<B: StepBackend>(b: &mut B, tokens: usize) -> Result<f64> {
    let out = generate(b, 0, &[1, 2, 3, 4], &greedy(tokens + 1), &mut |_| {
        Flow::Continue
    })?;
    Ok(out.decode_ms_per_token)
}

/// Prompt length of the prefill column of `loip bench engine`.
const PREFILL_TOKENS: usize = 256;

/// A prefill prompt of `len` token ids cycling below the model's vocabulary (the same ids as
/// `bench/compare_llama_cpp.sh` gives llama.cpp, for a vocabulary of at least 49152).
pub(super) fn prefill_prompt(m: &Model<'_>, len: usize) -> Vec<u32> {
    let vocab = m.tf.cfg.vocab_size.max(1) as u32;
    (0..len as u32).map(|i| (i * 7 + 1) % vocab).collect()
}

fn engine(model: &str, tokens: usize) -> Result<serde_json::Value> {
    let ckpt = loip::model::open(model)?;
    let m = Model::from_checkpoint(&ckpt)?;
    let mut rows = vec![];
    // a 256-token prompt (token ids cycling below the vocabulary) for the prefill column
    let prompt = prefill_prompt(&m, PREFILL_TOKENS);
    println!(
        "| model | threads | decode ms/token | tokens/s | prefill ms/token ({PREFILL_TOKENS}-token prompt) |\n|---|---|---|---|---|"
    );
    for threads in [1, 2] {
        let pool = compute_pool(threads)?;
        let (ms, prefill) = pool.install(|| -> Result<(f64, f64)> {
            let mut g = Generator::new(&m, None);
            decode_ms(&mut g, 4)?; // warm-up
            let mut g = Generator::new(&m, None);
            let ms = decode_ms(&mut g, tokens)?;
            let mut g = Generator::new(&m, None);
            let out = generate(&mut g, 0, &prompt, &greedy(1), &mut |_| Flow::Continue)?;
            Ok((ms, out.prompt_ms / PREFILL_TOKENS as f64))
        })?;
        println!(
            "| {model} | {threads} | {ms:.2} | {:.1} | {prefill:.2} |",
            1e3 / ms
        );
        rows.push(
            json!({"model": model, "threads": threads, "decode_ms_per_token": ms,
            "prefill_ms_per_token": prefill}),
        );
    }
    Ok(json!(rows))
}

/// Rounds of the batched-decode table (each round times every batch size once).
const BATCH_ROUNDS: usize = 5;

/// `loip bench engine --seqs`: ms per decode step of `n` sequences (each a different
/// 4-token prompt, then `tokens` steps), at 1 and 2 threads, the batch sizes alternating
/// within each round; medians.
fn batched(model: &str, tokens: usize, seqs: &[usize]) -> Result<serde_json::Value> {
    use loip_engine::batch::{BatchRunner, Feed};
    let ckpt = loip::model::open(model)?;
    let m = Model::from_checkpoint(&ckpt)?;
    let vocab = m.tf.cfg.vocab_size.max(1) as u32;
    let tokens = tokens.max(1);
    let mut rows = vec![];
    println!(
        "\n| threads | sequences | ms/step | tokens/s | step / one-sequence step | tokens/s / one sequence's |\n|---|---|---|---|---|---|"
    );
    for threads in [1, 2] {
        let pool = compute_pool(threads)?;
        let mut times: Vec<Vec<f64>> = vec![vec![]; seqs.len()];
        for round in 0..=BATCH_ROUNDS {
            for (k, &n) in seqs.iter().enumerate() {
                let n = n.max(1);
                let ms = pool.install(|| -> Result<f64> {
                    let mut r = BatchRunner::new(Generator::new(&m, None));
                    for s in 0..n {
                        let prompt: Vec<u32> = (0..4)
                            .map(|i| (s as u32 * 31 + i * 7 + 1) % vocab)
                            .collect();
                        r.add(s as u64, &prompt, &greedy(tokens + 1))?;
                    }
                    let prefill: Vec<Feed> = (0..n)
                        .map(|s| Feed {
                            seq: s as u64,
                            len: 4,
                        })
                        .collect();
                    r.run_step(&prefill)?;
                    let step: Vec<Feed> = (0..n)
                        .map(|s| Feed {
                            seq: s as u64,
                            len: 1,
                        })
                        .collect();
                    let t = Instant::now();
                    for _ in 0..tokens {
                        r.run_step(&step)?;
                    }
                    Ok(t.elapsed().as_secs_f64() * 1e3 / tokens as f64)
                })?;
                // round 0 warms the caches up
                if round > 0 {
                    times[k].push(ms);
                }
            }
        }
        let ms: Vec<f64> = times.iter_mut().map(|t| median(t)).collect();
        let base = seqs.iter().position(|&n| n <= 1).map(|k| ms[k]);
        for (k, &n) in seqs.iter().enumerate() {
            let tps = n.max(1) as f64 * 1e3 / ms[k];
            let (step_ratio, tps_ratio) = match base {
                Some(b) => (format!("{:.2}", ms[k] / b), format!("{:.2}", tps * b / 1e3)),
                None => ("-".into(), "-".into()),
            };
            println!(
                "| {threads} | {n} | {:.2} | {tps:.1} | {step_ratio} | {tps_ratio} |",
                ms[k]
            );
            rows.push(json!({"threads": threads, "seqs": n, "ms_per_step": ms[k],
                "tokens_per_s": tps}));
        }
    }
    Ok(json!(rows))
}

/// A pool of `threads` compute threads for one table's column.
fn compute_pool(threads: usize) -> Result<rayon::ThreadPool> {
    Ok(rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()?)
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// One block's load from a cold cache: the raw `O_DIRECT` read of the same file (io_uring,
/// the loader's request size and queue depth, no checksum), the direct loader and the
/// conventional one, interleaved round by round; medians.
fn loader(model: &str, repeats: usize) -> Result<serde_json::Value> {
    let dir = crate::progress::slices_for(model)?;
    let m = Manifest::load(&dir)?;
    let blocks: Vec<_> = (0..2)
        .map(|l| {
            m.slice(SliceKind::Mlp(l))
                .cloned()
                .context("the model needs two layers")
        })
        .collect::<Result<_>>()?;
    let tf = loip_engine::forward::Transformer::new(
        m.config.clone(),
        m.qk_permuted,
        loip_kernels::DType::F32,
    );
    let groups = vec![vec![blocks[0].clone()], vec![blocks[1].clone()]];
    let mut raw = RawReader::new(&blocks)?;
    let mut loaders = [LoaderKind::Direct, LoaderKind::Conventional]
        .into_iter()
        .map(|kind| Ok(Loader::new(kind, &dir, &groups)?))
        .collect::<Result<Vec<_>>>()?;
    // per path: (load seconds, load + compute seconds) of every round
    let mut times: Vec<(Vec<f64>, Vec<f64>)> = vec![Default::default(); 1 + loaders.len()];
    for i in 0..repeats {
        let g = i % 2;
        let file = dir.join(&blocks[g].file);
        drop_cache(&file);
        let s = raw.read(&dir, &blocks[g])?;
        times[0].0.push(s.load_s);
        for (k, ld) in loaders.iter_mut().enumerate() {
            drop_cache(&file);
            let t = Instant::now();
            ld.start(g)?;
            let view = ld.wait(g)?;
            let w = MlpWeights::bind(&view, &m.config, g)?;
            let mut x = vec![0.01f32; m.config.hidden_size];
            tf.mlp(&w, &mut x)?;
            times[k + 1].1.push(t.elapsed().as_secs_f64());
            times[k + 1].0.push(ld.last.load_s);
        }
    }
    let bytes = blocks[0].size.max(blocks[1].size);
    println!(
        "| read path | block bytes | load ms (median) | GB/s | of raw O_DIRECT | load + compute ms |\n|---|---|---|---|---|---|"
    );
    let raw_ms = median(&mut times[0].0) * 1e3;
    let names = [
        "raw O_DIRECT (io_uring)",
        "direct loader",
        "conventional loader",
    ];
    let mut rows = vec![];
    for (name, (load, total)) in names.iter().zip(times.iter_mut()) {
        let ms = median(load) * 1e3;
        let gbps = bytes as f64 / ms / 1e6;
        let of_raw = raw_ms / ms;
        let total_ms = median(total) * 1e3;
        let total_txt = if total.is_empty() {
            String::new()
        } else {
            format!("{total_ms:.2}")
        };
        println!(
            "| {name} | {bytes} | {ms:.2} | {gbps:.2} | {:.0}% | {total_txt} |",
            of_raw * 100.0
        );
        rows.push(json!({"path": name, "block_bytes": bytes, "load_ms": ms, "gb_per_s": gbps,
            "fraction_of_raw": of_raw, "load_plus_compute_ms": (!total.is_empty()).then_some(total_ms),
            "rounds": repeats, "chunk_bytes": loip_runtime::loader::CHUNK,
            "queue_depth": loip_runtime::loader::IN_FLIGHT}));
    }
    Ok(json!(rows))
}

fn offload(model: &str, tokens: usize) -> Result<serde_json::Value> {
    let dir = crate::progress::slices_for(model)?;
    let m = Manifest::load(&dir)?;
    let opts = |rule, loader, overlap| LocalOptions {
        mem_budget: None,
        rule,
        loader,
        overlap,
        context: 4 + tokens + 2,
        max_step_tokens: 4,
    };
    let offloaded: u64 = (0..m.config.num_layers)
        .filter(|l| l % 2 == 1)
        .flat_map(|l| [SliceKind::Attn(l), SliceKind::Mlp(l)])
        .filter_map(|k| m.slice(k).map(|s| s.size))
        .sum();
    // Compute alone: everything resident.
    let mut all = LocalModel::open(&dir, &opts(OffloadRule::None, LoaderKind::Direct, true))?;
    decode_ms(&mut all, 2)?;
    all.device.kv.remove(0);
    let compute_ms = decode_ms(&mut all, tokens)?;
    drop(all);
    // Load alone: the direct loader's measured bandwidth on those blocks.
    let mut rows = vec![];
    println!(
        "offloaded {:.0} MB per token ({} of {} layers)\n| run | decode ms/token | load ms/token | load GB/s | stall ms/token | ideal max(compute, load) ms |\n|---|---|---|---|---|---|",
        offloaded as f64 / 1e6,
        m.config.num_layers / 2,
        m.config.num_layers
    );
    println!("| all resident (compute) | {compute_ms:.1} | 0 | | 0 | |");
    for (name, loader, overlap) in [
        ("direct, overlapped", LoaderKind::Direct, true),
        ("direct, not overlapped", LoaderKind::Direct, false),
        ("conventional, overlapped", LoaderKind::Conventional, true),
        (
            "conventional, not overlapped",
            LoaderKind::Conventional,
            false,
        ),
    ] {
        let mut lm = LocalModel::open(&dir, &opts(OffloadRule::Alternate, loader, overlap))?;
        decode_ms(&mut lm, 1)?;
        lm.device.kv.remove(0);
        lm.device.take_times();
        let ms = decode_ms(&mut lm, tokens)?;
        let times = lm.device.take_times();
        let load_gbps = times.loaded_bytes as f64 / times.load_s.max(1e-9) / 1e9;
        let stall = times.stall_s * 1e3 / (tokens + 1) as f64;
        let load_ms = times.load_s * 1e3 / (tokens + 1) as f64;
        let ideal = compute_ms.max(load_ms);
        println!("| {name} | {ms:.1} | {load_ms:.1} | {load_gbps:.2} | {stall:.1} | {ideal:.1} |");
        rows.push(json!({"run": name, "decode_ms_per_token": ms, "stall_ms_per_token": stall,
            "ideal_ms_per_token": ideal, "compute_ms_per_token": compute_ms, "load_ms_per_token": load_ms,
            "offloaded_bytes_per_token": offloaded, "effective_load_gb_per_s": load_gbps}));
    }
    Ok(json!(rows))
}
