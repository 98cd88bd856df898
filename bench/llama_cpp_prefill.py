"""Prefill ms/token of llama.cpp's CPU backend (through llama-cpp-python) on a GGUF file.

usage: python3 llama_cpp_prefill.py MODEL.gguf THREADS IDS

IDS: comma-separated token ids, evaluated as one batch (n_batch 512). Prints one number: the
best of 3 runs, ms per prompt token (the same work as `loip generate --prompt-ids IDS -n 1`).
"""
import sys
import time

from llama_cpp_common import load


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    ids = [int(i) for i in sys.argv[3].split(",")]
    llm = load(path, threads, n_ctx=max(512, len(ids) + 8))
    best = float("inf")
    for _ in range(3):
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        best = min(best, (time.perf_counter() - start) / len(ids) * 1e3)
    print(f"{best:.2f}")


if __name__ == "__main__":
    main()
