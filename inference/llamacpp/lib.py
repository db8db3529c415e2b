"""libllama through ctypes: finding the library and declaring the calls the backend makes.

The library is llama.cpp's own, built once by `make llamacpp` (scripts/setup_libllama.sh) into
build/libllama/lib/, or wherever DRAFTHEAD_LIBLLAMA names the folder holding
libdrafthead_llama.so. Calls that take structs by value go through that small shim (shim.cpp);
the rest are libllama's C API as llama.h declares it (docs/llamacpp-backend.md).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

SHIM = "libdrafthead_llama.so"
ABI_VERSION = 2  # shim.cpp dh_abi_version: the calls below are the ones that shim takes
_REPO_BUILD = Path(__file__).resolve().parents[2] / "build" / "libllama" / "lib"

c_int32_p = ctypes.POINTER(ctypes.c_int32)
c_float_p = ctypes.POINTER(ctypes.c_float)


class LlamaBatch(ctypes.Structure):
    """llama.h `struct llama_batch`: n_tokens, then one array per field (embd unused: NULL)."""

    _fields_ = [
        ("n_tokens", ctypes.c_int32),
        ("token", c_int32_p),
        ("embd", c_float_p),
        ("pos", c_int32_p),
        ("n_seq_id", c_int32_p),
        ("seq_id", ctypes.POINTER(c_int32_p)),
        ("logits", ctypes.POINTER(ctypes.c_int8)),
    ]


class LibllamaMissing(NotImplementedError):
    """libllama (and our shim) is not built: `make llamacpp`. A missing feature of this install,
    which the CLI reports in one line (a NotImplementedError, so still a RuntimeError)."""


def library_dir() -> Path:
    env = os.environ.get("DRAFTHEAD_LIBLLAMA")
    return Path(env) if env else _REPO_BUILD


def why_unavailable() -> str | None:
    """None when the library loads; else one line saying what is missing."""
    try:
        load()
    except LibllamaMissing as e:
        return str(e)
    return None


_SIGNATURES = {
    # shim.c
    "dh_init": ([ctypes.c_bool], None),
    "dh_load_model": ([ctypes.c_char_p], ctypes.c_void_p),
    "dh_new_context": (
        [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_int, ctypes.c_bool, ctypes.c_int, ctypes.c_bool],
        ctypes.c_void_p,
    ),
    "dh_decode": ([ctypes.c_void_p, ctypes.POINTER(LlamaBatch)], ctypes.c_int32),
    "dh_greedy": (
        [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, c_int32_p, ctypes.c_int32, c_int32_p],
        ctypes.c_int32,
    ),
    "dh_quantize": ([ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int], ctypes.c_uint),
    "dh_set_layer_inp": ([ctypes.c_void_p, ctypes.c_uint, ctypes.c_bool], None),
    "dh_get_layer_inp": ([ctypes.c_void_p, ctypes.c_uint], c_float_p),
    # llama.h
    "llama_free": ([ctypes.c_void_p], None),
    "llama_model_free": ([ctypes.c_void_p], None),
    "llama_model_n_layer": ([ctypes.c_void_p], ctypes.c_int32),
    "llama_model_n_embd": ([ctypes.c_void_p], ctypes.c_int32),
    "llama_model_get_vocab": ([ctypes.c_void_p], ctypes.c_void_p),
    "llama_vocab_n_tokens": ([ctypes.c_void_p], ctypes.c_int32),
    "llama_n_ctx": ([ctypes.c_void_p], ctypes.c_uint32),
    "llama_get_memory": ([ctypes.c_void_p], ctypes.c_void_p),
    "llama_memory_clear": ([ctypes.c_void_p, ctypes.c_bool], None),
    "llama_memory_seq_rm": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32], ctypes.c_bool),
    "llama_memory_seq_cp": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32], None),
    "llama_memory_seq_pos_max": ([ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32),
    "llama_get_logits": ([ctypes.c_void_p], c_float_p),
    "llama_get_embeddings": ([ctypes.c_void_p], c_float_p),
    "llama_set_embeddings": ([ctypes.c_void_p, ctypes.c_bool], None),
    "llama_set_n_threads": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32], None),
}


@lru_cache(maxsize=1)
def load():
    """The shim (which pulls in libllama and ggml beside it), its calls declared, the backend
    initialised once per process."""
    path = library_dir() / SHIM
    if not path.exists():
        raise LibllamaMissing(
            f"llama.cpp backend not built: no {path} (run `make llamacpp`, or point DRAFTHEAD_LIBLLAMA at the folder holding {SHIM})"
        )
    try:
        libs = (ctypes.CDLL(str(path)), ctypes.CDLL(str(path.with_name("libllama.so"))))
    except OSError as e:
        raise LibllamaMissing(f"llama.cpp backend at {path} does not load: {e}") from e
    version = getattr(libs[0], "dh_abi_version", None)
    if version is None or version() != ABI_VERSION:
        raise LibllamaMissing(
            f"{path} was built from another drafthead (shim version {version() if version else 1}, not {ABI_VERSION}): run `make llamacpp` again"
        )
    calls = _Calls()
    for name, (args, result) in _SIGNATURES.items():
        fn = getattr(libs[0] if name.startswith("dh_") else libs[1], name, None)
        if fn is None:
            raise LibllamaMissing(f"{path} has no {name}: it was built from another drafthead version (run `make llamacpp` again)")
        fn.argtypes, fn.restype = args, result
        setattr(calls, name, fn)
    calls.dh_init(bool(os.environ.get("DRAFTHEAD_LLAMA_VERBOSE")))
    return calls


class _Calls:
    """The declared functions, as attributes (the shim's and libllama's in one namespace)."""
