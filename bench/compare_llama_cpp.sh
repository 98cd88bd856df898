#!/usr/bin/env bash
# SmolLM2-135M Q4_1 decode and prefill (a 256-token prompt) ms/token: loip vs llama.cpp's CPU
# backend, same GGUF, same thread counts (1 and 2), runs interleaved (shared machines drift by
# tens of percent within minutes), then the medians over the rounds and loip / llama.cpp.
#
# usage: bench/compare_llama_cpp.sh [ROUNDS]
# LEVELS (default "native avx2"): loip's SIMD paths to run, "native" being the best this CPU
# has, "avx2" LOIP_SIMD=avx2 (the AVX2 figures on an AVX-512 machine) and "lanes" the AVX2
# path with its token-lane prefill tiles (LOIP_SIMD=avx2 LOIP_GEMM=lanes; bit-identical, an
# A/B of speed against "avx2"). llama.cpp runs its own native build once per round and thread count.
# Needs a release build (`cargo build --release -p loip-cli`). The first run installs
# llama-cpp-python (a native build of llama.cpp, several minutes) into target/llama-venv.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
levels=${LEVELS:-native avx2}
venv=target/llama-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    python3 -m venv "$venv"
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$venv/bin/python" -m pip install --quiet llama-cpp-python
fi
loip=target/release/loip
model=$("$loip" fetch smollm2 | tail -n 1)
"$venv/bin/python" -c "import llama_cpp; print('llama.cpp', llama_cpp.__version__, 'build:', llama_cpp.llama_print_system_info().decode().strip())"
# llama.cpp's AMX matmul dies with SIGILL where the CPU lists AMX but the VM does not grant it
if ! "$venv/bin/python" bench/llama_cpp_decode.py "$model" 1 1 >/dev/null 2>&1; then
    export LLAMA_NO_EXTRA_BUFTS=1
    echo "llama.cpp failed with its extra buffer types (AMX, repacking): running without them"
fi
# prefill: the same 256 token ids for both (cycling below SmolLM2's vocabulary of 49152)
ids=$(python3 -c "print(','.join(str((i * 7 + 1) % 49152) for i in range(256)))")
json_field() { python3 -c "import json,sys; print(f\"{json.load(sys.stdin)['$1']:.2f}\")"; }
loip_run() { # LEVEL ARGS...: loip generate on that SIMD level
    local level=$1
    shift
    if [ "$level" = native ]; then
        "$loip" generate "$@"
    elif [ "$level" = lanes ]; then
        LOIP_SIMD=avx2 LOIP_GEMM=lanes "$loip" generate "$@"
    else
        LOIP_SIMD=$level "$loip" generate "$@"
    fi
}
rows=$(mktemp)
trap 'rm -f "$rows"' EXIT
printf "%-6s %-8s %-7s %12s %17s %13s %18s\n" round threads level "loip decode" \
    "llama.cpp decode" "loip prefill" "llama.cpp prefill"
for r in $(seq 1 "$rounds"); do
    for t in 1 2; do
        c=$("$venv/bin/python" bench/llama_cpp_decode.py "$model" "$t" 64)
        cp=$("$venv/bin/python" bench/llama_cpp_prefill.py "$model" "$t" "$ids")
        for level in $levels; do
            l=$(loip_run "$level" --model "$model" --threads "$t" \
                --prompt "The capital of France is" -n 64 --ignore-eos --json |
                json_field decode_ms_per_token)
            lp=$(loip_run "$level" --model "$model" --threads "$t" --prompt-ids "$ids" -n 1 \
                --ignore-eos --json | json_field prompt_ms_per_token)
            printf "%-6s %-8s %-7s %12s %17s %13s %18s\n" "$r" "$t" "$level" "$l" "$c" "$lp" "$cp"
            echo "$t $level $l $c $lp $cp" >>"$rows"
        done
    done
done
echo
echo "medians over $rounds rounds (ms/token; ratio = loip / llama.cpp, below 1 is faster)"
python3 - "$rows" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
keys = sorted({(int(r[0]), r[1]) for r in rows}, key=lambda k: (k[1], k[0]))
print(f"{'threads':<8} {'level':<7} {'loip decode':>12} {'llama.cpp':>10} {'ratio':>6}"
      f" {'loip prefill':>13} {'llama.cpp':>10} {'ratio':>6}")
for t, level in keys:
    sel = [r for r in rows if int(r[0]) == t and r[1] == level]
    m = [statistics.median(float(r[i]) for r in sel) for i in (2, 3, 4, 5)]
    print(f"{t:<8} {level:<7} {m[0]:>12.2f} {m[1]:>10.2f} {m[0] / m[1]:>6.2f}"
          f" {m[2]:>13.2f} {m[3]:>10.2f} {m[2] / m[3]:>6.2f}")
PY
