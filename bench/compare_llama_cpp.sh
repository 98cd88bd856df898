#!/usr/bin/env bash
# SmolLM2-135M Q4_1 decode and prefill (a 256-token prompt) ms/token: loip vs llama.cpp's CPU
# backend, same GGUF, same thread counts (1 and 2), runs interleaved (shared machines drift by
# tens of percent within minutes), then the medians over the rounds and loip / llama.cpp.
#
# usage: bench/compare_llama_cpp.sh [ROUNDS]
# LEVELS (default "native avx2"): loip's SIMD paths to run, "native" being the best this CPU
# has, "avx2" LOIP_SIMD=avx2 (the AVX2 figures on an AVX-512 machine) and "lanes" the AVX2
# path with its token-lane prefill tiles (LOIP_SIMD=avx2 LOIP_GEMM=lanes; bit-identical, an
# A/B of speed against "avx2").
# Each loip level is compared with a llama.cpp build of the same instruction set: "native"
# with llama.cpp built for this CPU (target/llama-venv), "avx2" and "lanes" with llama.cpp
# built for AVX2 + FMA + F16C without AVX-512 (target/llama-venv-avx2). On a CPU without
# AVX-512 the two builds run the same instructions. LLAMA_AVX2=0 compares every level with
# the native build instead (and skips the second install).
# Needs a release build (`cargo build --release -p loip-cli`). The first run installs
# llama-cpp-python (a build of llama.cpp from source, several minutes each) into the venvs.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
levels=${LEVELS:-native avx2}
# the llama.cpp build each loip level is compared with
build_of() {
    if [ "$1" = native ] || [ "${LLAMA_AVX2:-1}" = 0 ]; then echo native; else echo avx2; fi
}
venv_of() {
    if [ "$1" = native ]; then echo target/llama-venv; else echo target/llama-venv-avx2; fi
}
install_llama() { # BUILD: installs llama-cpp-python into that build's venv unless present
    local venv
    venv=$(venv_of "$1")
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
        return
    fi
    python3 -m venv "$venv"
    local cmake_args=${CMAKE_ARGS:-}
    if [ "$1" = avx2 ]; then
        cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
        cmake_args+=" -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF"
        cmake_args+=" -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
    fi
    # --no-cache-dir: pip would otherwise reuse the first build's wheel for the second venv
    # (the CMake flags are not part of its cache key), silently giving both one instruction set
    CMAKE_ARGS=$cmake_args CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$venv/bin/python" -m pip install --quiet --no-cache-dir llama-cpp-python
}
builds=$(for level in $levels; do build_of "$level"; done | sort -u)
for b in $builds; do install_llama "$b"; done
loip=target/release/loip
model=$("$loip" fetch smollm2 | tail -n 1)
for b in $builds; do
    "$(venv_of "$b")/bin/python" -c "import llama_cpp; print('llama.cpp ($b build)', llama_cpp.__version__, 'system info:', llama_cpp.llama_print_system_info().decode().strip())"
done
# llama.cpp's AMX matmul dies with SIGILL where the CPU lists AMX but the VM does not grant it:
# a build that fails so runs without its extra buffer types (AMX, repacking)
declare -A no_bufts=()
llama_py() { # BUILD SCRIPT ARGS...: a comparison script on that llama.cpp build
    local b=$1
    shift
    LLAMA_NO_EXTRA_BUFTS=${no_bufts[$b]:-0} "$(venv_of "$b")/bin/python" "$@"
}
for b in $builds; do
    if ! llama_py "$b" bench/llama_cpp_decode.py "$model" 1 1 >/dev/null 2>&1; then
        no_bufts[$b]=1
        echo "llama.cpp ($b build) failed with its extra buffer types (AMX, repacking): running without them"
    fi
done
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
printf "%-6s %-8s %-7s %-7s %12s %17s %13s %18s\n" round threads level llama "loip decode" \
    "llama.cpp decode" "loip prefill" "llama.cpp prefill"
for r in $(seq 1 "$rounds"); do
    for t in 1 2; do
        declare -A c=() cp=()
        for b in $builds; do
            c[$b]=$(llama_py "$b" bench/llama_cpp_decode.py "$model" "$t" 64)
            cp[$b]=$(llama_py "$b" bench/llama_cpp_prefill.py "$model" "$t" "$ids")
        done
        for level in $levels; do
            b=$(build_of "$level")
            l=$(loip_run "$level" --model "$model" --threads "$t" \
                --prompt "The capital of France is" -n 64 --ignore-eos --json |
                json_field decode_ms_per_token)
            lp=$(loip_run "$level" --model "$model" --threads "$t" --prompt-ids "$ids" -n 1 \
                --ignore-eos --json | json_field prompt_ms_per_token)
            printf "%-6s %-8s %-7s %-7s %12s %17s %13s %18s\n" "$r" "$t" "$level" "$b" "$l" \
                "${c[$b]}" "$lp" "${cp[$b]}"
            echo "$t $level $b $l ${c[$b]} $lp ${cp[$b]}" >>"$rows"
        done
        unset c cp
    done
done
echo
echo "medians over $rounds rounds (ms/token; ratio = loip / llama.cpp, below 1 is faster; load: $(cut -d" " -f1-3 /proc/loadavg))"
python3 - "$rows" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
keys = sorted({(int(r[0]), r[1], r[2]) for r in rows}, key=lambda k: (k[1], k[0]))
print(f"{'threads':<8} {'level':<7} {'llama':<7} {'loip decode':>12} {'llama.cpp':>10} {'ratio':>6}"
      f" {'loip prefill':>13} {'llama.cpp':>10} {'ratio':>6}")
for t, level, build in keys:
    sel = [r for r in rows if int(r[0]) == t and r[1] == level]
    m = [statistics.median(float(r[i]) for r in sel) for i in (3, 4, 5, 6)]
    print(f"{t:<8} {level:<7} {build:<7} {m[0]:>12.2f} {m[1]:>10.2f} {m[0] / m[1]:>6.2f}"
          f" {m[2]:>13.2f} {m[3]:>10.2f} {m[2] / m[3]:>6.2f}")
PY
