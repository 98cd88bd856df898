"""Decode ms/token of llama.cpp's CPU backend (through llama-cpp-python) on a GGUF file.

usage: python3 llama_cpp_decode.py MODEL.gguf THREADS [TOKENS]

Prints one number: the best of 3 runs of TOKENS single-token evaluations after a short
prompt (the same work as `loip generate --ignore-eos`: one forward pass per new token).
"""
import sys
import time

from llama_cpp_common import load


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    llm = load(path, threads)
    prompt = llm.tokenize(b"The capital of France is")
    best = float("inf")
    for _ in range(3):
        llm.reset()
        llm.eval(prompt)
        tok = prompt[-1]
        start = time.perf_counter()
        for _ in range(tokens):
            llm.eval([tok])
        best = min(best, (time.perf_counter() - start) / tokens * 1e3)
    print(f"{best:.2f}")


if __name__ == "__main__":
    main()
