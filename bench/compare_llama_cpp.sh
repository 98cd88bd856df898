#!/usr/bin/env bash
# SmolLM2-135M Q4_1 decode ms/token: loip vs llama.cpp's CPU backend, same GGUF, same thread
# counts, runs interleaved (shared machines drift by tens of percent within minutes).
#
# usage: bench/compare_llama_cpp.sh [ROUNDS]
# Needs a release build (`cargo build --release -p loip-cli`). The first run installs
# llama-cpp-python (a native build of llama.cpp, several minutes) into target/llama-venv.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
venv=target/llama-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    python3 -m venv "$venv"
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$venv/bin/python" -m pip install --quiet llama-cpp-python
fi
loip=target/release/loip
model=$("$loip" fetch smollm2 | tail -n 1)
"$venv/bin/python" -c "import llama_cpp; print('llama.cpp build:', llama_cpp.llama_print_system_info().decode().strip())"
printf "%-6s %-8s %10s %12s\n" round threads "loip ms" "llama.cpp ms"
for r in $(seq 1 "$rounds"); do
    for t in 1 2; do
        l=$("$loip" generate --model "$model" --threads "$t" --prompt "The capital of France is" \
            -n 64 --ignore-eos --json | python3 -c "import json,sys; print(f\"{json.load(sys.stdin)['decode_ms_per_token']:.2f}\")")
        c=$("$venv/bin/python" bench/llama_cpp_decode.py "$model" "$t" 64)
        printf "%-6s %-8s %10s %12s\n" "$r" "$t" "$l" "$c"
    done
done
