"""Loads a GGUF file with llama-cpp-python for the comparison scripts.

With LLAMA_NO_EXTRA_BUFTS=1 the model is loaded without llama.cpp's extra buffer types (weight
repacking and the AMX backend): on VMs whose CPU flags list AMX but whose kernel does not grant
the tile state, the AMX matmul dies with SIGILL (`tilezero`); compare_llama_cpp.sh probes
this once and sets the variable.
"""
import os

import llama_cpp.llama_cpp as lib
from llama_cpp import Llama

if os.environ.get("LLAMA_NO_EXTRA_BUFTS") == "1":
    _defaults = lib.llama_model_default_params

    def _no_extra_bufts():
        params = _defaults()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = _no_extra_bufts


def load(path: str, threads: int, n_ctx: int = 512) -> Llama:
    return Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                 n_ctx=n_ctx, n_batch=512, verbose=False, seed=0)
