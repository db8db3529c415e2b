"""Subcommands of the `drafthead` CLI, one module each (`add_parser(subparsers)`, `run(args) -> int`).

The options several commands share are defined once here, with the helpers that turn parsed
arguments into the objects the library functions take (docs/style.md 7: parse, build, call).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ..draft_spec import BACKENDS, PROPOSERS
from ..inference.engine.sizing import SIZINGS

DEFAULT_TARGET = "smollm2-135m"


def launch_rank() -> int:
    """This process's rank under `accelerate launch` / `torchrun` (they set RANK), 0 alone: the
    main process speaks for the launch and takes its outputs' locks."""
    return int(os.environ.get("RANK", "0"))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(value: str) -> str:
    if value == "cpu" or value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got '{value}'")


def _int(value: str) -> int:
    """A whole number as text: its range is the setting's own rule (DraftSpec checks the drafting options')."""
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{value}'") from None


def _whole_number(value: str, minimum: int) -> int:
    n = _int(value)
    if n < minimum:
        raise argparse.ArgumentTypeError(f"expected a number >= {minimum}, got {n}")
    return n


def _positive_int(value: str) -> int:
    return _whole_number(value, 1)


def _non_negative_int(value: str) -> int:
    return _whole_number(value, 0)


def _positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{value}'") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value}")
    return x


class DeclaredChoices(Sequence):
    """An option's choices, the tuple `name` of `module`, read when argparse first asks for them
    (a parse, the option's own help, a refusal) rather than when the parser is built: building
    it imports no torch, so `drafthead --help` stays quick (heads.formats imports every format
    module to collect its declarations; docs/style.md 20). Give the option a metavar, or
    argparse reads the choices at once to write its usage line."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def _values(self) -> tuple[str, ...]:
        return getattr(importlib.import_module(self.module), self.name)

    def __getitem__(self, index):
        return self._values()[index]

    def __len__(self) -> int:
        return len(self._values())

    def __contains__(self, value) -> bool:
        return value in self._values()


# ---------------------------------------------------------------------------------------------
# Shared options
# ---------------------------------------------------------------------------------------------


def add_target_options(parser: argparse.ArgumentParser, *, dtype: str = "float32", threads: int | None = None) -> None:
    g = parser.add_argument_group("target")
    g.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help=f"built-in name (smollm2-135m, gemma3-270m), a local Hugging Face folder or a .gguf file (default {DEFAULT_TARGET})",
    )
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "auto"),
        default=dtype,
        help=f"target dtype; auto: bfloat16 where the device runs it natively, else float32 (default {dtype})",
    )
    g.add_argument(
        "--round-weights",
        choices=("bfloat16",),
        default=None,
        help="round the target's weights to bf16 values, computed in --dtype: the model a bf16 "
        "checkpoint or bf16 GGUF holds; on CPU our engine then streams them as bf16",
    )
    add_device_option(g)
    g.add_argument("--threads", type=_positive_int, default=threads, help="torch CPU threads")


def parse_with_overrides(parser: argparse.ArgumentParser, argv: list[str] | None):
    """parser.parse_args, where KEY=VALUE overrides may also come after options (`train --config c
    --resume lr=1e-4`): argparse fills a positional list once, so words it leaves over that look
    like overrides join `args.overrides`; anything else is still an error."""
    args, extra = parser.parse_known_args(argv)
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    if extra and (stray or not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = list(args.overrides or []) + extra
    return args


def add_overwrite_option(parser) -> None:
    from ..ground.outdir import OVERWRITE_FLAG

    parser.add_argument(
        OVERWRITE_FLAG,
        action="store_true",
        help="replace a non-empty output: the new one is written beside it and swapped in whole (docs/reliability.md)",
    )


def add_device_option(parser) -> None:
    parser.add_argument("--device", type=_device, default=None, help="cpu | cuda | cuda:N (default: cuda when available)")


def add_proposer_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("drafting")
    g.add_argument(
        "--proposer",
        choices=PROPOSERS,
        default=None,
        help="who drafts (default: the head shipped for the target, else prompt lookup)",
    )
    g.add_argument("--head", default=None, metavar="DIR", help="trained head folder (proposer head)")
    g.add_argument("--draft-model", default=None, metavar="NAME", help="draft LM sharing the target's vocabulary")
    g.add_argument(
        "--num-draft",
        type=_int,
        default=None,
        metavar="N",
        help="draft nodes per round (default: the proposer's, or the head folder's drafting.json); "
        "with --sizing confidence, the most a round may keep",
    )
    g.add_argument(
        "--sizing",
        choices=SIZINGS,
        default=None,
        help="how each round's tree is sized: fixed (every round the drafter's tree); policy: the node "
        "count, down to plain decoding, that pays at the batch size, from the target's measured "
        "forward cost; confidence (EAGLE and DSpark heads): the drafter's own estimate of "
        "acceptance against that cost (default: drafting.json's, else fixed)",
    )
    g.add_argument(
        "--lookup-nodes",
        type=_int,
        default=None,
        metavar="N",
        help="heads: merge up to N prompt-lookup nodes into each tree (0: off; default: the head folder's drafting.json, else 0)",
    )
    g.add_argument(
        "--lookup-streak",
        type=_int,
        default=None,
        metavar="N",
        help="prompt lookup (alone or merged into a head's tree): after a round that accepted a "
        "whole continuation, draft one N tokens long (0: off; default: drafting.json for heads, "
        "32 for prompt lookup alone)",
    )
    g.add_argument("--tree-depth", type=_int, default=None, metavar="D", help="EAGLE heads: draft steps per round (default: drafting.json, else 5)")
    g.add_argument(
        "--chain",
        type=_int,
        default=None,
        metavar="K",
        help="heads: a chain of K top-1 drafts a round instead of the head's tree (what vLLM and SGLang serve)",
    )
    g.add_argument(
        "--tree-branch",
        type=_int,
        default=None,
        metavar="K",
        help="EAGLE heads: children expanded per node and step (default: drafting.json, else 6)",
    )
    g = parser.add_argument_group("engine")
    g.add_argument("--static-cache", action="store_true", help="a fixed-size KV cache for the target (no per-round reallocation)")
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile (inductor) the target's round forward, with a static cache (the first "
        'generation compiles: minutes on a small CPU; docs/trees.md "Static cache")',
    )
    g.add_argument(
        "--row-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every forward row-invariant: a row's logits are the same bits alone or in a tree, so "
        "bf16 output equals plain decoding through the same kernels, which becomes the reference "
        "(CPU only). Default: on in bfloat16 where the CPU has native bf16 (AMX or avx512_bf16), "
        'off otherwise; --no-row-invariant: the fastest kernels (docs/acceptance.md "Row invariance")',
    )
    g.add_argument(
        "--backend",
        choices=BACKENDS,
        default="torch",
        help="the target's forward: torch (transformers), or llama.cpp's through libllama on a GGUF "
        "of the target (`make llamacpp` builds it; docs/llamacpp-backend.md). Drafters stay in torch",
    )
    g.add_argument(
        "--gguf-type",
        choices=("f32", "bf16", "q8_0", "q4_0"),
        default=None,
        help="llama.cpp backend: the GGUF's weight type (default: the one --dtype holds, f32 or bf16); "
        "quantized types are a different model from the torch target, decoded exactly",
    )


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def engine_options(args) -> dict:
    """GenerationConfig's engine fields from --static-cache / --compile / --row-invariant (once
    `drafting_from_args` settled the last for the loaded target)."""
    return {
        "static_cache": bool(getattr(args, "static_cache", False)),
        "compile": "inductor" if getattr(args, "compile", False) else None,
        "row_invariant": bool(getattr(args, "row_invariant", False)),
    }


def add_sampling_options(parser: argparse.ArgumentParser, *, max_new_tokens: int = 256) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-new-tokens", type=_positive_int, default=max_new_tokens)


# ---------------------------------------------------------------------------------------------
# From arguments to objects
# ---------------------------------------------------------------------------------------------


def resolve_device(device: str | None) -> str:
    """--device, or cuda when available; a CUDA device asked for on a machine without one is an error."""
    device = device or default_device()
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is available")
    return device


# --backend values whose forward runs on the CPU (libllama; vLLM's CPU build): the torch target
# beside them loads on the CPU too
CPU_BACKENDS = ("llama.cpp", "vllm")


def backend_device(device: str | None, backend: str) -> str | None:
    """--device for a command run with --backend `backend`: "cpu" for the CPU backends, where
    another device is refused before anything loads; else --device as given."""
    if backend not in CPU_BACKENDS:
        return device
    if device not in (None, "cpu"):
        raise ValueError(f"--backend {backend} runs on the CPU: drop --device {device}")
    return "cpu"


def require_backend(backend: str) -> None:
    """The llama.cpp backend's library, loaded now: where it is not built, one line before any
    model loads (inference/llamacpp/lib.py LibllamaMissing)."""
    if backend == "llama.cpp":
        from ..inference.llamacpp import lib

        lib.load()


def load_target_from_args(args):
    from ..ground.target.load import load_target

    args.device = backend_device(args.device, getattr(args, "backend", "torch"))
    resolve_dtype_arg(args)
    return load_target(
        args.target, dtype=args.dtype, device=resolve_device(args.device), threads=args.threads, round_weights=getattr(args, "round_weights", None)
    )


def resolve_dtype_arg(args) -> str:
    """--dtype auto becomes the dtype it stands for on this device (in place), so every later
    message and report names the dtype that ran."""
    from ..ground.target.load import resolve_dtype

    args.dtype = str(resolve_dtype(args.dtype, resolve_device(args.device))).removeprefix("torch.")
    return args.dtype


def sampling_from_args(args):
    from ..inference.engine.sampling import SamplingConfig

    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty)


def add_typical_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--typical-acceptance",
        nargs="?",
        const="0.09,0.3",
        default=None,
        metavar="EPS,DELTA",
        help="LOSSY: Medusa's typical acceptance instead of the exact rule (sampling only; the output "
        "is no longer the target's distribution). Default thresholds 0.09,0.3",
    )


def typical_from_args(args):
    """--typical-acceptance EPS,DELTA -> TypicalAcceptance (lossy), or None (the exact rule)."""
    value = getattr(args, "typical_acceptance", None)
    if value is None:
        return None
    from ..inference.engine.acceptance import TypicalAcceptance

    try:
        epsilon, delta = (float(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"--typical-acceptance takes EPS,DELTA (e.g. 0.09,0.3), got {value!r}") from None
    return TypicalAcceptance(epsilon=epsilon, delta=delta)


def draft_spec_from_args(args):
    """The DraftSpec of the drafting options, checked before any model loads (its backend's
    library too)."""
    from ..draft_spec import DraftSpec

    spec = DraftSpec.from_args(args)
    require_backend(spec.backend)
    return spec


def drafting_from_args(args, spec, loaded, sampling=None):
    """spec.build for the loaded target, with the engine options the load policy's timing needs.
    Settles --row-invariant first where it was not given: the engine's default for this target
    (inference/engine/backend.py row_invariant_by_default), which every later step reads."""
    if getattr(args, "row_invariant", False) is None:
        from ..inference.engine.backend import row_invariant_by_default

        torch_backend = getattr(args, "backend", "torch") == "torch"
        args.row_invariant = torch_backend and row_invariant_by_default(
            loaded.model, bool(getattr(args, "static_cache", False)), "inductor" if getattr(args, "compile", False) else None
        )
    return spec.build(
        loaded,
        sampling=sampling,
        seed=getattr(args, "seed", None),
        threads=args.threads,
        row_invariant=bool(getattr(args, "row_invariant", False)),
        note=note,
    )


def note(message: str) -> None:
    """A status line for the user, on stderr so stdout stays the answer / report."""
    print(message, file=sys.stderr, flush=True)
