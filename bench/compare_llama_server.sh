#!/usr/bin/env bash
# Serving side by side: `loip api --parallel 8` against `llama-server --parallel 8
# --cont-batching` (llama.cpp built for this CPU, bench/llama_cpp_build.sh) on the same GGUF,
# both loaded by `loip bench serve` (streaming completions, greedy, ignore_eos) with 1 client
# (2 requests) and 8 clients (8 requests, closed loop), in interleaved rounds; output tokens/s
# and the median time to first token, then one table of the medians over the rounds. Each load
# sends new random prompts (its own seed), the same to both servers. With TURNS=T each client
# holds conversations of T requests whose prompts grow by PROMPT_LEN words a turn (a chat
# client resends the conversation; both servers keep finished prompts' KV: loip's prompt
# cache, llama-server's cache_prompt), and the TTFT column is the later turns' median.
#
# usage: bench/compare_llama_server.sh [ROUNDS]
# MODELS (default "gemma3-270m qwen2.5-coder-0.5b"), THREADS (default 2), CLIENTS (default
# "1 8"), PROMPT_LEN (words, default 16), OUTPUT_LEN (default 64), TURNS (default 1),
# LOIP_SIMD as for loip.
# Needs a release build (`cargo build --release -p loip-cli`); the first run compiles
# llama-server (tens of minutes on a shared 2-core machine). The table also goes to
# target/compare_llama_server.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
models=${MODELS:-gemma3-270m qwen2.5-coder-0.5b}
threads=${THREADS:-2}
clients=${CLIENTS:-1 8}
prompt_len=${PROMPT_LEN:-16}
output_len=${OUTPUT_LEN:-64}
turns=${TURNS:-1}
loip=target/release/loip
. bench/llama_cpp_build.sh
. bench/bench_models.sh
server=$(llama_server_bin native)
work=$(mktemp -d)
pids=()
stop() { # the servers this script started
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}
trap 'stop; rm -rf "$work"' EXIT
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_ready() { # URL NAME: until the server answers /v1/models (at most 10 minutes)
    for _ in $(seq 1 600); do
        if curl -sf -o /dev/null "$1/v1/models"; then return; fi
        sleep 1
    done
    echo "$2 did not come up at $1" >&2
    exit 1
}
bench() { # URL CLIENTS SEED: tokens/s and TTFT p50 (ms) of one load
    local n=$2
    [ "$n" = 1 ] && n=2
    "$loip" bench serve --url "$1" --requests "$((n * turns))" --concurrency "$2" \
        --seed "$3" --turns "$turns" --prompt-len "$prompt_len" --output-len "$output_len" \
        --json "$work/r.json" >/dev/null
    python3 -c "import json; r=json.load(open('$work/r.json')); assert r['failed'] == 0, r['errors']; print(r['tokens_per_s'], r['ttft_later_turns' if $turns > 1 else 'ttft']['p50_ms'])"
}
rows=$work/rows
printf "%-6s %-19s %-8s %14s %14s %15s %15s\n" round model clients "loip tok/s" "llama tok/s" \
    "loip TTFT ms" "llama TTFT ms"
for m in $models; do
    model=$(model_path "$m")
    lp=$(free_port)
    "$loip" api -m "$model" --parallel 8 --threads "$threads" --listen "127.0.0.1:$lp" \
        2>"$work/loip.log" &
    pids+=($!)
    cp=$(free_port)
    # 8 slots of 1024 tokens each
    "$server" -m "$model" --parallel 8 --cont-batching -t "$threads" -tb "$threads" \
        -c 8192 --host 127.0.0.1 --port "$cp" >"$work/llama.log" 2>&1 &
    pids+=($!)
    wait_ready "http://127.0.0.1:$lp" "loip api"
    wait_ready "http://127.0.0.1:$cp" llama-server
    for r in $(seq 1 "$rounds"); do
        for c in $clients; do
            # the same prompts for both servers, new ones for each load: with prompts seen
            # before, llama-server reuses a slot's cached prompt KV (cache_prompt) and its
            # times to first token and tokens/s measure that cache, not serving
            seed=$((1000 * r + c))
            l=$(bench "http://127.0.0.1:$lp" "$c" "$seed")
            o=$(bench "http://127.0.0.1:$cp" "$c" "$seed")
            read -r lt lf <<<"$l"
            read -r ct cf <<<"$o"
            printf "%-6s %-19s %-8s %14s %14s %15s %15s\n" "$r" "$m" "$c" "$lt" "$ct" "$lf" "$cf"
            echo "$m $c $lt $ct $lf $cf" >>"$rows"
        done
    done
    stop
done
echo
{
    echo "medians over $rounds rounds ($threads threads, prompt $prompt_len words, $output_len tokens, $turns turns; load: $(cut -d" " -f1-3 /proc/loadavg))"
    python3 - "$rows" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
keys = list(dict.fromkeys((r[0], int(r[1])) for r in rows))
print("| model | clients | loip tokens/s | llama-server tokens/s | ratio | loip TTFT p50 ms"
      " | llama-server TTFT p50 ms |")
print("|---|---|---|---|---|---|---|")
for model, c in keys:
    sel = [r for r in rows if (r[0], int(r[1])) == (model, c)]
    m = [statistics.median(float(r[i]) for r in sel) for i in (2, 3, 4, 5)]
    print(f"| {model} | {c} | {m[0]:.1f} | {m[1]:.1f} | {m[0] / m[1]:.2f} | {m[2]:.0f} | {m[3]:.0f} |")
PY
} | tee target/compare_llama_server.txt
