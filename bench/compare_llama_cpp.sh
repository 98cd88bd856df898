#!/usr/bin/env bash
# SmolLM2-135M Q4_1 decode and prefill (a 256-token prompt) ms/token: loip vs llama.cpp's CPU
# backend, same GGUF, same thread counts, runs interleaved (shared machines drift by tens of
# percent within minutes).
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
# prefill: the same 256 token ids for both (cycling below SmolLM2's vocabulary of 49152)
ids=$(python3 -c "print(','.join(str((i * 7 + 1) % 49152) for i in range(256)))")
printf "%-6s %-8s %14s %18s %16s %20s\n" round threads "loip decode" "llama.cpp decode" \
    "loip prefill" "llama.cpp prefill"
for r in $(seq 1 "$rounds"); do
    for t in 1 2; do
        l=$("$loip" generate --model "$model" --threads "$t" --prompt "The capital of France is" \
            -n 64 --ignore-eos --json | python3 -c "import json,sys; print(f\"{json.load(sys.stdin)['decode_ms_per_token']:.2f}\")")
        c=$("$venv/bin/python" bench/llama_cpp_decode.py "$model" "$t" 64)
        lp=$("$loip" generate --model "$model" --threads "$t" --prompt-ids "$ids" -n 1 \
            --ignore-eos --json | python3 -c "import json,sys; print(f\"{json.load(sys.stdin)['prompt_ms_per_token']:.2f}\")")
        cp=$("$venv/bin/python" - "$model" "$t" "$ids" <<'PY'
import sys, time
from llama_cpp import Llama
path, threads, ids = sys.argv[1], int(sys.argv[2]), [int(i) for i in sys.argv[3].split(",")]
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512,
            n_batch=512, verbose=False, seed=0)
best = float("inf")
for _ in range(3):
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    best = min(best, (time.perf_counter() - start) / len(ids) * 1e3)
print(f"{best:.2f}")
PY
)
        printf "%-6s %-8s %14s %18s %16s %20s\n" "$r" "$t" "$l" "$c" "$lp" "$cp"
    done
done
