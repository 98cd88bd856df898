//! `loip bench serve`: a bounded load generator against any OpenAI-compatible server.
//!
//! It sends `--requests` streaming completions (`stream: true` with usage), either closed
//! loop (`--concurrency C` clients back to back) or open loop at `--rate` requests/s with
//! a seeded arrival pattern (sporadic: evenly spaced; bursty: `--burst` at once; Poisson),
//! and prints aggregate tokens/s and time-to-first-token / inter-token percentiles. With
//! `--turns T` the requests come as conversations of `T` turns, each turn's prompt the last
//! one's followed by `--prompt-len` new words or ids (a chat client resends the whole
//! conversation; the answers are left out), sent in order by one client: what a server's
//! prompt cache saves shows in the later turns' time to first token.
//!
//! Invariants: the run is bounded (N requests, each with a `--timeout`, a response at most
//! 16 MiB); the client speaks plain HTTP (no TLS), meant for servers on a trusted network; a
//! failed request is counted, never retried.

mod client;

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde_json::{json, Value};

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Arrival {
    /// `--concurrency` clients, each sending its next request when the last one ends
    Closed,
    /// evenly spaced at `--rate`
    Sporadic,
    /// bursts of `--burst` requests at once, at `--rate` on average
    Bursty,
    /// a Poisson process of `--rate` (seeded)
    Poisson,
}

/// Arguments of `loip bench serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// The server, e.g. http://127.0.0.1:8080 (plain HTTP).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The model name to send (default: none, the server's model).
    #[arg(long)]
    model: Option<String>,
    /// Requests in all.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Clients at once (closed loop).
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Arrival pattern.
    #[arg(long, value_enum, default_value_t = Arrival::Closed)]
    arrival: Arrival,
    /// Requests per second (open-loop patterns).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// Requests per burst (bursty).
    #[arg(long, default_value_t = 4)]
    burst: usize,
    /// Prompt length: words of text, or token ids with --token-prompt.
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Requests per conversation: each turn's prompt is the last turn's followed by
    /// --prompt-len new words (or ids), sent by one client after the last turn ended; the
    /// summary gives the first and the later turns' time to first token apart.
    #[arg(long, default_value_t = 1)]
    turns: usize,
    /// New tokens per request (sent as max_tokens with ignore_eos).
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Send prompts as token ids below --vocab instead of text.
    #[arg(long)]
    token_prompt: bool,
    /// Token ids of --token-prompt are below this.
    #[arg(long, default_value_t = 256)]
    vocab: u32,
    /// Seed of prompts and arrivals.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Bearer key, if the server needs one.
    #[arg(long)]
    api_key: Option<String>,
    /// Seconds one request may take.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// splitmix64: a small seeded generator (prompts and arrivals only).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// uniform in (0, 1]
    fn unit(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
}

const WORDS: &[&str] = &[
    "the", "river", "light", "stone", "quiet", "morning", "garden", "window", "story", "north",
    "paper", "music", "early", "winter", "bridge", "forest",
];

/// One request's measurements.
#[derive(Debug, Clone, Default)]
struct Sample {
    ok: bool,
    tokens: usize,      // completion tokens (usage, else content chunks)
    ttft_s: f64,        // start to first content  // s
    itl_s: Option<f64>, // mean gap between tokens after the first  // s
    latency_s: f64,     // start to end  // s
    error: Option<String>,
    turn: usize, // of its conversation, from 0
}

/// `loip bench serve`: runs the load and returns the results as JSON.
pub fn run(a: ServeBenchArgs) -> Result<Value> {
    if a.requests == 0
        || a.concurrency == 0
        || a.output_len == 0
        || a.prompt_len == 0
        || a.turns == 0
    {
        bail!(
            "--requests, --concurrency, --output-len, --prompt-len and --turns must be at least 1"
        );
    }
    if a.arrival != Arrival::Closed && !(a.rate.is_finite() && a.rate > 0.0) {
        bail!("--rate must be a positive number");
    }
    let url = completions_url(&a.url)?;
    // A connection per request, as separate clients would open: a server may close an idle
    // kept-alive connection just as the next request goes out on it (llama-server does),
    // which failed that request.
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(0)
        .build()
        .context("building the HTTP client")?;
    let mut rng = Rng(a.seed);
    let bodies = conversations(&a, &mut rng);
    let starts = arrivals(&a, bodies.len(), &mut rng);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the client runtime")?;
    let t0 = Instant::now();
    let samples: Vec<Sample> = rt.block_on(async {
        let timeout = Duration::from_secs(a.timeout);
        let mut tasks = Vec::new();
        if a.arrival == Arrival::Closed {
            let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let bodies = std::sync::Arc::new(bodies);
            for _ in 0..a.concurrency.min(a.requests) {
                let (next, bodies) = (next.clone(), bodies.clone());
                let (client, url, key) = (client.clone(), url.clone(), a.api_key.clone());
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(turns) = bodies.get(i) else { break };
                        for (turn, b) in turns.iter().enumerate() {
                            let s = client::one(&client, &url, key.as_deref(), b, timeout).await;
                            out.push(Sample { turn, ..s });
                        }
                    }
                    out
                }));
            }
        } else {
            for (turns, at) in bodies.into_iter().zip(starts) {
                let (client, url, key) = (client.clone(), url.clone(), a.api_key.clone());
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(tokio::time::Instant::from_std(t0) + at).await;
                    let mut out = Vec::new();
                    for (turn, b) in turns.iter().enumerate() {
                        let s = client::one(&client, &url, key.as_deref(), b, timeout).await;
                        out.push(Sample { turn, ..s });
                    }
                    out
                }));
            }
        }
        let mut all = Vec::new();
        for t in tasks {
            match t.await {
                Ok(s) => all.extend(s),
                Err(e) => all.push(Sample {
                    error: Some(e.to_string()),
                    ..Sample::default()
                }),
            }
        }
        all
    });
    let wall = t0.elapsed().as_secs_f64();
    let result = summarize(&a, &samples, wall);
    print_summary(&result);
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if samples.iter().all(|s| !s.ok) {
        bail!(
            "every one of the {} requests failed (first errors: {})",
            samples.len(),
            result["errors"]
        );
    }
    Ok(result)
}

/// The completions endpoint of the server at `url` (plain HTTP).
fn completions_url(url: &str) -> Result<reqwest::Url> {
    let base = reqwest::Url::parse(url).with_context(|| format!("--url {url}"))?;
    if base.scheme() != "http" {
        bail!("--url must start with http:// (plain HTTP)");
    }
    if base.host_str().is_none_or(str::is_empty) {
        bail!("--url has no host");
    }
    Ok(base.join("/v1/completions")?)
}

/// The requests' bodies, grouped by conversation (`--turns` each; the last may be shorter),
/// `--requests` in all.
fn conversations(a: &ServeBenchArgs, rng: &mut Rng) -> Vec<Vec<String>> {
    let turns = a.turns.max(1);
    let mut all = Vec::new();
    let mut left = a.requests;
    while left > 0 {
        let (mut ids, mut words) = (Vec::new(), Vec::new());
        let n = turns.min(left);
        let conv = (0..n)
            .map(|_| {
                let prompt = if a.token_prompt {
                    let v = u64::from(a.vocab.max(1));
                    ids.extend((0..a.prompt_len).map(|_| rng.next() % v));
                    json!(ids)
                } else {
                    words.extend(
                        (0..a.prompt_len)
                            .map(|_| WORDS[(rng.next() % WORDS.len() as u64) as usize]),
                    );
                    json!(words.join(" "))
                };
                body(a, prompt, rng)
            })
            .collect();
        all.push(conv);
        left -= n;
    }
    all
}

fn body(a: &ServeBenchArgs, prompt: Value, rng: &mut Rng) -> String {
    let mut body = json!({
        "prompt": prompt, "max_tokens": a.output_len,
        "min_tokens": a.output_len, "ignore_eos": true, "temperature": a.temperature,
        "seed": rng.next() % 1_000_000, "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let (Some(m), Some(o)) = (&a.model, body.as_object_mut()) {
        o.insert("model".into(), json!(m));
    }
    body.to_string()
}

/// When each of `n` conversations (a request each without `--turns`) starts, after the
/// run's start (open-loop patterns).
fn arrivals(a: &ServeBenchArgs, n: usize, rng: &mut Rng) -> Vec<Duration> {
    let mut t = 0.0f64;
    (0..n)
        .map(|i| {
            let at = t;
            t += match a.arrival {
                Arrival::Closed => 0.0,
                Arrival::Sporadic => 1.0 / a.rate,
                Arrival::Bursty if (i + 1) % a.burst.max(1) == 0 => a.burst.max(1) as f64 / a.rate,
                Arrival::Bursty => 0.0,
                Arrival::Poisson => -rng.unit().ln() / a.rate,
            };
            Duration::from_secs_f64(at.min(86_400.0))
        })
        .collect()
}

/// p50/p90/p99/max of `v` (seconds) in ms, from a histogram of microseconds (3
/// significant digits).
fn dist(v: Vec<f64>) -> Value {
    // bounded: `saturating_record` never grows an auto-resizing histogram (`new` tracks 1..2 µs)
    let Ok(mut h) = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 1 << 40, 3) else {
        return json!({});
    };
    for x in &v {
        // saturating: a NaN or negative time counts as 0
        h.saturating_record((x * 1e6).max(0.0) as u64);
    }
    let ms = |us: u64| (!v.is_empty()).then(|| (us as f64 / 100.0).round() / 10.0);
    json!({"p50_ms": ms(h.value_at_quantile(0.50)), "p90_ms": ms(h.value_at_quantile(0.90)),
           "p99_ms": ms(h.value_at_quantile(0.99)), "max_ms": ms(h.max())})
}

fn summarize(a: &ServeBenchArgs, samples: &[Sample], wall: f64) -> Value {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let tokens: usize = ok.iter().map(|s| s.tokens).sum();
    let errors: Vec<&str> = samples
        .iter()
        .filter_map(|s| s.error.as_deref())
        .take(5)
        .collect();
    let ttft_turns = |later: bool| {
        dist(
            ok.iter()
                .filter(|s| (s.turn > 0) == later)
                .map(|s| s.ttft_s)
                .collect(),
        )
    };
    json!({
        "url": a.url,
        "requests": samples.len(),
        "ok": ok.len(),
        "failed": samples.len() - ok.len(),
        "errors": errors,
        "arrival": format!("{:?}", a.arrival).to_lowercase(),
        "concurrency": a.concurrency,
        "rate": a.rate,
        "prompt_len": a.prompt_len,
        "turns": a.turns,
        "output_len": a.output_len,
        "wall_s": (wall * 1e3).round() / 1e3,
        "output_tokens": tokens,
        "tokens_per_s": if wall > 0.0 { (tokens as f64 / wall * 10.0).round() / 10.0 } else { 0.0 },
        "requests_per_s": if wall > 0.0 { ok.len() as f64 / wall } else { 0.0 },
        "ttft": dist(ok.iter().map(|s| s.ttft_s).collect()),
        "ttft_first_turn": ttft_turns(false),
        "ttft_later_turns": ttft_turns(true),
        "inter_token": dist(ok.iter().filter_map(|s| s.itl_s).collect()),
        "latency": dist(ok.iter().map(|s| s.latency_s).collect()),
    })
}

fn print_summary(r: &Value) {
    println!(
        "{} requests ({} ok, {} failed), {} output tokens in {} s: {} tokens/s",
        r["requests"], r["ok"], r["failed"], r["output_tokens"], r["wall_s"], r["tokens_per_s"]
    );
    let turns = r["turns"].as_u64().unwrap_or(1) > 1;
    for (name, key) in [
        ("time to first token", "ttft"),
        ("first turns' TTFT", "ttft_first_turn"),
        ("later turns' TTFT", "ttft_later_turns"),
        ("inter-token", "inter_token"),
        ("latency", "latency"),
    ] {
        if key.starts_with("ttft_") && !turns {
            continue;
        }
        let d = &r[key];
        println!(
            "{name:>20}: p50 {} ms, p90 {} ms, p99 {} ms, max {} ms",
            d["p50_ms"], d["p90_ms"], d["p99_ms"], d["max_ms"]
        );
    }
    if let Some(errors) = r["errors"].as_array().filter(|e| !e.is_empty()) {
        for e in errors {
            println!("error: {}", e.as_str().unwrap_or(""));
        }
    }
}
