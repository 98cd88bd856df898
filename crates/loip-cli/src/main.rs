//! `loip`: lossless LLM inference over a few memory-constrained edge devices.

mod backend;
mod cluster_ux;
mod cmd_api;
mod cmd_bench;
mod cmd_cache;
mod cmd_chat;
mod cmd_devices;
mod cmd_generate;
mod cmd_local;
mod cmd_pair;
mod cmd_plan;
mod cmd_profile;
mod cmd_pull;
mod cmd_serve;
mod cmd_simulate;
mod cmd_split;
mod cmd_synth;
mod cmd_worker;
mod model_shape;
mod progress;
mod request;
mod speculate;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Lossless LLM inference serving over a few heterogeneous, memory-constrained devices.
///
/// Models load from a local path (an HF directory with config.json + safetensors +
/// tokenizer.json, or a GGUF file), or the name `smollm2`, which is fetched, verified and
/// cached on first use.
#[derive(Parser)]
#[command(name = "loip", version, propagate_version = true)]
struct Cli {
    /// Compute threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the whole system on this machine: N local workers, the coordinator, one generation.
    Local(cmd_local::LocalArgs),
    /// Generate text on this machine, streaming it as it is produced.
    Generate(cmd_generate::GenerateArgs),
    /// Print the logits of every position of a prompt as JSON.
    Logits(cmd_generate::LogitsArgs),
    /// Download, verify and cache a known model (`smollm2`, `gemma3-270m`); prints its path.
    Fetch(cmd_generate::FetchArgs),
    /// Write a random-weight checkpoint of a real architecture's shape (for benchmarks).
    Synth(cmd_synth::SynthArgs),
    /// Simulate plans at paper scale (Jetson devices, 13B-70B models) and run the experiments.
    Simulate(cmd_simulate::SimulateArgs),
    /// Split a model into per-block slice files for offloading (or verify a split).
    Split(cmd_split::SplitArgs),
    /// Benchmarks: engine decode, block loading, single-device offloading.
    Bench(cmd_bench::BenchArgs),
    /// Run this machine as one device of a cluster (serves one coordinator at a time).
    Worker(cmd_worker::WorkerArgs),
    /// Coordinate a cluster of workers: plan, ship slices, serve prompts from stdin.
    Serve(cmd_serve::ServeArgs),
    /// Serve one model over an OpenAI-compatible HTTP API (completions, chat, streaming), on
    /// this machine or on a cluster.
    Api(cmd_api::ApiArgs),
    /// Measure this machine (block times, loader bandwidth) as a planner device profile.
    Profile(cmd_profile::ProfileArgs),
    /// Plan stages, layers and offloaded blocks for a cluster, and predict ms/token.
    Plan(cmd_plan::PlanArgs),
    /// Chat with a model: one turn per line of stdin, the history kept, on this machine or a
    /// cluster.
    Chat(cmd_chat::ChatArgs),
    /// Download a model (a GGUF file or an HF file set) into the cache: resumable, sha256
    /// checked when given, a progress bar.
    Pull(cmd_pull::PullArgs),
    /// List the cache: fetched models and slice directories, with their sizes.
    List(cmd_cache::ListArgs),
    /// Remove cache entries by the names `loip list` prints.
    Rm(cmd_cache::RmArgs),
    /// List the workers that answer on the LAN, paired or not.
    Devices(cmd_devices::DevicesArgs),
    /// Pair this coordinator with a worker, from the code the worker printed.
    Pair(cmd_pair::PairArgs),
}

fn main() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("LOIP_LOG").unwrap_or_else(|_| "warn".into());
    // colour only on a terminal: service logs get plain text
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    quiet_on_broken_pipe();
    // https (`loip pull`, `loip bench serve`): rustls with a pure-Rust crypto provider
    let _ = rustls_rustcrypto::provider().install_default();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        if is_broken_pipe(&e) {
            std::process::exit(0);
        }
        eprintln!("error: {}", describe(&e));
        std::process::exit(1);
    }
}

/// `e` and its causes, joined by ": ", each said once: a message that already quotes its
/// cause (an I/O error naming its file and the OS error) is not followed by it again.
fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for c in e.chain() {
        let s = c.to_string();
        if out.contains(&s) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&s);
    }
    out
}

/// `loip logits … | head`: when the reader closes stdout, the command ends quietly with
/// status 0, as a Unix filter does. The Rust runtime ignores SIGPIPE, so a write to the closed
/// pipe fails with EPIPE: `println!` panics on it (caught here, on every output path, by the
/// panic hook) and a `write!` returns it (caught by [`is_broken_pipe`] in `main`). SIGPIPE
/// itself stays ignored: a peer closing a socket must never kill a worker or a server.
fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let p = info.payload();
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if msg.starts_with("failed printing to stdout") && msg.contains("os error 32") {
            std::process::exit(0);
        }
        default(info)
    }));
}

/// Whether `e` is a write to a closed pipe.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()?;
    }
    match cli.command {
        Command::Local(a) => cmd_local::run(a),
        Command::Worker(a) => cmd_worker::run(a),
        Command::Serve(a) => cmd_serve::serve(a),
        Command::Api(a) => cmd_api::run(a),
        Command::Generate(a) => cmd_generate::generate(a),
        Command::Logits(a) => cmd_generate::logits(a),
        Command::Fetch(a) => cmd_generate::fetch(a),
        Command::Synth(a) => cmd_synth::run(a),
        Command::Plan(a) => cmd_plan::run(a),
        Command::Split(a) => cmd_split::run(a),
        Command::Bench(a) => cmd_bench::run(a),
        Command::Profile(a) => cmd_profile::run(a),
        Command::Simulate(a) => cmd_simulate::run(a),
        Command::Chat(a) => cmd_chat::run(a),
        Command::Pull(a) => cmd_pull::run(a),
        Command::List(a) => cmd_cache::list(a),
        Command::Rm(a) => cmd_cache::rm(a),
        Command::Devices(a) => cmd_devices::run(a),
        Command::Pair(a) => cmd_pair::run(a),
    }
}
