//! `loip api`: an OpenAI-compatible HTTP server for one model, run by this machine's engine
//! (in memory, or from slice files with `--mem`) or, with `--cluster FILE`, by a cluster of
//! workers. This module only turns flags into a backend (through [`backend::open`], as
//! `loip generate` and `loip serve` do) and a [`ServerConfig`]; the routes, validation and
//! limits are `loip-server`'s.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use loip_plan::Pattern;
use loip_server::{Limits, ServedModel, ServerConfig};

use crate::backend::{self, ClusterArgs, OffloadArgs};
use loip::fit;

/// Arguments of `loip api`.
#[derive(Args, Debug)]
#[command(after_long_help = "\
Endpoints:
  GET  /health               ok and the model (with --cluster: each device's state; 503 when one is gone,
                             \"replanning\" while a device is left out or taken back)
  GET  /v1/models[/ID]       the served model (or an --alias); another id is 404
  POST /v1/completions       prompt: text or token ids; max_tokens, temperature, top_p, top_k,
                             seed, stop, stream, logprobs, frequency_penalty, presence_penalty,
                             logit_bias, repetition_penalty, ignore_eos, min_tokens,
                             return_token_ids
  POST /v1/chat/completions  messages [{role, content}] rendered with the model's chat template;
                             the same sampling fields, logprobs: true with top_logprobs
  POST /tokenize, /detokenize  text to ids and back (llama-server's shapes)
  GET  /metrics              Prometheus text
  GET  /                     the dashboard: devices, memory, blocks, live compute/network/stall,
                             KV, queue and throughput (a page polling /dashboard.json and /metrics)

A field the server does not implement is refused with 400 naming it. Without a seed each
request draws a fresh one; responses report it.

Greedy requests (temperature 0) give exactly the tokens of `loip generate`. Bad requests get
HTTP 400 with {\"error\": {\"message\", \"type\"}}, bodies over 1 MiB 413, unknown paths 404.
With an API key (--api-key, --api-key-file or LOIP_API_KEY), /v1/* and /metrics need
`Authorization: Bearer KEY` (401 otherwise), and so does /dashboard.json (the page asks for
the key and keeps it in the browser); /health stays open but names devices,
addresses and failure reasons only with the key.

Example:
  loip api --listen 127.0.0.1:8080 --model smollm2 &
  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 32}'")]
pub struct ApiArgs {
    /// Address to listen on; port 0 picks a free one. The bound address is printed on stderr
    /// as `listening on http://ADDR`.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Model: `smollm2`, an HF directory, or a GGUF file (with --cluster also a slice directory).
    #[arg(long, short = 'm', default_value = "smollm2")]
    pub model: String,
    /// Model id the API reports (default: the model's file or directory name).
    #[arg(long)]
    pub name: Option<String>,
    /// Another id a request's `model` may name (repeatable); any other is answered 404
    /// `model_not_found`. A request without `model` gets the served model.
    #[arg(long = "alias")]
    pub aliases: Vec<String>,
    /// Generations run at once; further requests wait in a queue (default 4; with --mem
    /// and no --parallel, the most up to 4 that fit beside the context).
    #[arg(long)]
    pub parallel: Option<usize>,
    /// Longest prompt accepted, tokens; it also sizes the working buffers (default 2048;
    /// with --mem and no --max-prompt, at most half the context chosen).
    #[arg(long)]
    pub max_prompt: Option<usize>,
    /// Finished requests whose KV is kept, so that a later prompt that begins with the same
    /// tokens (a chat client resends the whole conversation each turn) computes only the
    /// rest; the same tokens either way (default: --parallel; 0 turns it off). The kept KV
    /// uses only room no running request holds and yields to new requests at once. Turn it
    /// off where a client must not learn, from a quicker first token, that another client's
    /// prompt began the same way.
    #[arg(long)]
    pub prompt_cache: Option<usize>,
    /// Largest `max_tokens` a request may ask for; also the most a request without one gets.
    #[arg(long, default_value_t = 4096)]
    pub max_tokens_limit: usize,
    /// With --cluster: do not re-plan over the remaining devices when one fails (requests
    /// then fail with 503 until a restart). Without it, a worker that is missing (gone, or
    /// unreachable at start) and answers again is taken back with a re-plan, logged.
    #[arg(long)]
    pub no_replan: bool,
    /// With --cluster: connect, measure, profile and plan as a start does, print the plan
    /// (per device: stages, resident/offloaded blocks, memory, predicted ms/token and its
    /// breakdown) and stop before shipping or loading anything.
    #[arg(long)]
    pub preview: bool,
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// Require `Authorization: Bearer KEY` on /v1/*. Visible in `ps`: prefer --api-key-file
    /// or the LOIP_API_KEY environment variable.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Let browsers call the API from this origin (e.g. `https://app.example`, or `*`):
    /// responses carry `Access-Control-Allow-Origin`, preflight requests are answered.
    #[arg(long)]
    pub cors: Option<String>,
    /// Read the API key from the first line of this file.
    #[arg(long, conflicts_with = "api_key")]
    pub api_key_file: Option<PathBuf>,
    /// Most HTTP connections open at once; one more is answered 503 and closed at once.
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Most HTTP connections open at once from one address (an IPv6 /64 counts as one);
    /// one more is answered 503 and closed. Raise it behind a reverse proxy.
    #[arg(long, default_value_t = 64)]
    pub max_connections_per_addr: usize,
    /// Most requests waiting for a generation's place (default: 16 × --parallel); one more
    /// is answered 429 with `Retry-After`.
    #[arg(long)]
    pub max_queue: Option<usize>,
    /// Seconds a client has to send a request's headers; an idle keep-alive connection is
    /// closed after as long.
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// Seconds a client has to send a request's body.
    #[arg(long, default_value_t = 30)]
    pub body_timeout: u64,
    /// With --cluster or --mem: planned context, KV tokens held summed over the sequences in
    /// flight; it also bounds one request's prompt + max_tokens (default 4096, at most the
    /// model's limit; with --mem and no --context, the largest down to 256 that fits).
    #[arg(long)]
    pub context: Option<u64>,
    /// On this machine: a memory budget (`--mem`), which blocks to offload and how they are
    /// loaded (on the workers with --cluster), as for `loip generate`; --mem or any
    /// --offload-blocks but auto serves from slice files, and the KV cache of all requests in
    /// flight shares what the budget leaves.
    #[command(flatten)]
    pub offload: OffloadArgs,
    /// With --cluster: plan for this request pattern, sporadic or bursty.
    #[arg(long, default_value = "sporadic")]
    pub pattern: Pattern,
    /// With --cluster: sequences in flight for bursty traffic (default: number of devices).
    #[arg(long)]
    pub micro_batches: Option<u32>,
    /// Speculative decoding of requests that do not say (their `speculate` field): `lookup`
    /// (drafts from n-gram matches in the prompt and the output so far, verified in the
    /// shared steps; the same tokens) or `off`. On this machine (not with --cluster).
    #[arg(long, default_value = "off")]
    pub speculate: loip_engine::Speculate,
    /// Most draft tokens verified in one step of a speculating request (1 to 16).
    #[arg(long, default_value_t = 8)]
    pub speculate_k: usize,
}

/// `loip api`: load the model (or bring the cluster up), then serve until Ctrl-C or SIGTERM.
pub fn run(mut a: ApiArgs) -> Result<()> {
    crate::cluster_ux::discover(&mut a.cluster)?;
    if a.parallel == Some(0) || a.max_prompt == Some(0) || a.max_tokens_limit == 0 {
        bail!("--parallel, --max-prompt and --max-tokens-limit must be at least 1");
    }
    if a.max_connections == 0
        || a.max_connections_per_addr == 0
        || a.max_queue == Some(0)
        || a.header_timeout == 0
        || a.body_timeout == 0
    {
        bail!(
            "--max-connections, --max-connections-per-addr, --max-queue, --header-timeout and \
             --body-timeout must be at least 1"
        );
    }
    if !(1..=loip_server::serving::MAX_DRAFTS).contains(&a.speculate_k) {
        bail!(
            "--speculate-k must be from 1 to {}",
            loip_server::serving::MAX_DRAFTS
        );
    }
    if a.speculate == loip_engine::Speculate::Draft {
        bail!(
            "loip api speculates with prompt lookup (--speculate lookup); a draft model is not \
         served in batches"
        )
    }
    let api_key = api_key(a.api_key.as_deref(), a.api_key_file.as_deref())?;
    let name = a.name.clone().unwrap_or_else(|| default_name(&a.model));
    let (src, info) = backend::source(&a.model, &a.offload, &a.cluster)?;
    let limit = info.config.max_position_embeddings;
    let offload = a.offload.options()?;
    let sizes = match (&src, offload.mem) {
        (backend::Source::Slices(dir), Some(mem)) => {
            let asked = fit::Asked {
                context: a.context.map(|c| usize::try_from(c).unwrap_or(usize::MAX)),
                parallel: a.parallel,
                max_prompt: a.max_prompt,
            };
            let s = fit::fit(dir, &offload, mem, limit, asked)?;
            eprintln!("{}", s.why);
            s.sizes
        }
        _ => fit::Limits {
            context: limit.min(a.context.map_or(fit::DEFAULT_CONTEXT, |c| {
                usize::try_from(c).unwrap_or(usize::MAX)
            })),
            parallel: a.parallel.unwrap_or(fit::DEFAULT_PARALLEL),
            max_prompt: a.max_prompt.unwrap_or(fit::DEFAULT_MAX_PROMPT),
        },
    };
    let (context, parallel, max_prompt) = (sizes.context, sizes.parallel, sizes.max_prompt);
    let how = backend::How {
        offload: &a.offload,
        cluster: &a.cluster,
        sizes: backend::Sizes {
            model: &a.model,
            loader: a.offload.loader,
            parallel,
            max_step_tokens: max_prompt,
            context,
            pattern: a.pattern,
            micro_batches: a.micro_batches,
            planned_context: a.context.unwrap_or(fit::DEFAULT_CONTEXT as u64),
            greedy: false,
            no_replan: a.no_replan,
            // any request may speculate (its `speculate` field)
            speculate_k: a.speculate_k,
        },
        quiet: false,
    };
    if a.preview {
        return match &src {
            backend::Source::Cluster(dir) => crate::cluster_ux::preview(dir, &how),
            _ => bail!("--preview previews a cluster's plan: give --cluster FILE"),
        };
    }
    let in_memory = matches!(src, backend::Source::Memory(_));
    let opened = backend::open(src, &how)?;
    if let Some(m) = &opened.memory {
        backend::print_memory(m);
        eprintln!();
    }
    let backend = opened.backend;
    if let Some(n) = a.prompt_cache {
        backend.set_prompt_cache(loip_engine::PromptCacheOptions::keep(n));
    }
    if !a.no_replan {
        crate::cluster_ux::watch_rejoin(&backend);
    }
    // In memory, a request's context is the model's own limit.
    let context = if in_memory {
        info.config.max_position_embeddings
    } else {
        context
    };
    let cfg = ServerConfig {
        name,
        aliases: a.aliases.clone(),
        parallel,
        max_queue: a.max_queue.unwrap_or(parallel.saturating_mul(16)),
        max_prompt,
        max_tokens_limit: a.max_tokens_limit,
        context,
        api_key,
        cors: a.cors.clone(),
        limits: Limits {
            max_connections: a.max_connections,
            max_connections_per_addr: a.max_connections_per_addr,
            header_timeout: Duration::from_secs(a.header_timeout),
            body_timeout: Duration::from_secs(a.body_timeout),
        },
        speculate: a.speculate,
        speculate_k: a.speculate_k,
    };
    loip_server::serve(&a.listen, cfg, served(info), backend)?;
    Ok(())
}

/// The server's view of the model; why a tokenizer or template is missing is logged here
/// (it may name files), clients are only told that it is.
fn served(info: loip::model::ModelInfo) -> ServedModel {
    let tokenizer = info
        .tokenizer
        .map_err(|e| eprintln!("warning: no tokenizer ({e:#}); only token-id prompts are accepted"))
        .ok();
    let chat = info
        .chat
        .map_err(|e| eprintln!("warning: the model's chat template did not load: {e:#}"))
        .ok()
        .flatten();
    ServedModel {
        config: info.config,
        tokenizer,
        chat,
    }
}

/// The API key from `--api-key`, else `--api-key-file` (its first line), else the
/// `LOIP_API_KEY` environment variable; `None` when none is set. An empty key is refused.
fn api_key(flag: Option<&str>, file: Option<&Path>) -> Result<Option<String>> {
    let key = match (flag, file) {
        (Some(k), _) => Some(k.to_string()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the API key from {}", path.display()))?;
            Some(text.lines().next().unwrap_or_default().to_string())
        }
        (None, None) => std::env::var("LOIP_API_KEY").ok(),
    };
    match key.map(|k| k.trim().to_string()) {
        Some(k) if k.is_empty() => bail!("the API key is empty"),
        k => Ok(k),
    }
}

/// The model id for `model`: its file stem, or directory name.
fn default_name(model: &str) -> String {
    let p = Path::new(model.trim_end_matches('/'));
    let part = if p.is_dir() {
        p.file_name()
    } else {
        p.file_stem()
    };
    part.map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| model.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_keys_are_trimmed_and_never_empty() {
        assert!(api_key(Some("  "), None).is_err());
        assert_eq!(
            api_key(Some(" k "), None).ok().flatten().as_deref(),
            Some("k")
        );
    }
}
