"""The target's linears on the faster CPU kernel per row count, inside our engine only.

A decode or verify forward multiplies a few rows (1 to a few dozen) by every weight of the
target, and which CPU kernel does that fastest depends on the shape, the row count, the dtype and
the CPU. Three compete:

    plain    F.linear (MKL for fp32)
    packed   a oneDNN-packed copy of the weight (inference/kernels/packed.py)
    panel    our own kernel over column panels of the weight (inference/kernels/panel_kernel.py), which
             reads a weight whose values are all bf16 as bf16: half the bytes of fp32

Measured on the 2-core dev machine's AMD EPYC (AVX2, no AVX-512; docs/cpu-measurements.md "Panel
linears"), SmolLM2-135M shapes, fp32 weights streaming from memory, microseconds per call:

    rows   576 -> 1536: plain / packed / panels fp32 / panels bf16     LM head 576 -> 49152
       1   610 / 438 / 241 / 184                                       18111 / 9957 / 9174 / 4082
      16   1156 / 687 / 546 / 395                                      45125 / 16768 / 15683 / 9657

and on an Intel CPU with AVX-512 the packed kernel beat F.linear from 4 rows on, not at 1.

So it is measured: once per machine, shape, dtype and thread count (kept in the cache folder), at
ROW_BUCKETS rows, over the target's layers of that shape in turn (so the weights stream from memory
as in a forward, not from cache), the fastest kernel is kept for each bucket (`calibrate`,
`fastest`). A forward with M rows uses the choice of the smallest bucket >= M (`kernel_for_rows`,
a pure function).

Scope: `engine_linears(target)` swaps the dispatching layers in for the duration of our engine's
calls and puts the target's own `nn.Linear`s back afterwards, so transformers' `generate()`,
training and saving see the unmodified model. The packed and panel copies are kept on the model
(each up to one extra copy of every linear weight: ~540 MB for SmolLM2 in fp32, half that for
bf16 panels) and rebuilt when a weight changes; copies that win at no row count are dropped, and
a target whose copies would take over a quarter of physical memory is left alone.

Compiled forwards (inference/engine/compiled.py): dynamo cannot trace an opaque packed weight, so a
dispatching layer appears in a compiled graph as one custom op (`drafthead::row_dispatch_linear`)
that makes the same choice at run time, and inductor fuses the elementwise work around it.

Exactness: each kernel computes the same fp32 products (a bf16 panel holds exactly the weight's
values) and sums them in its own order (results agree within ~1e-6 relative), exactly as a tree
forward over 17 rows already rounds differently from a one-row step. The guarantee stays the one
docs/acceptance.md states: fp32 greedy output equals plain greedy output token for token, which
the tests assert with each kernel forced on.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import os
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ...ground.files import atomic_write, cache_root
from . import invariant_linear, panel_kernel
from .packed import pack_linear
from .machine import cpu_model

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
WIN_MARGIN = 0.9  # another kernel replaces F.linear where it takes under 90% of F.linear's time
STREAM_BYTES = 64 << 20  # calibrate over at least this many bytes of weights: more than a CPU's cache
STREAM_ROWS = 32  # up to this many rows a call streams its weight; past it the arithmetic dominates
CALIBRATION_FILE = "linears-calibration.json"  # under ground/files.py cache_root() / "kernels"


def kernel_for_rows(rows: int, choices: tuple[str, ...], buckets: tuple[int, ...] = ROW_BUCKETS) -> str:
    """The kernel ('plain', 'packed', 'panel') for a forward over `rows` rows, from the per-bucket
    choice `choices[i]` (bucket i = buckets[i] rows): the smallest bucket >= rows decides; beyond
    the last bucket, F.linear (a prefill's large matmuls are MKL's regime)."""
    i = bisect.bisect_left(buckets, rows)
    if i == len(buckets):
        return "plain"
    return choices[i]


def fastest(seconds: dict[str, float], margin: float = WIN_MARGIN) -> str:
    """The kernel to keep at one row count, from each kernel's measured time ('plain' required):
    the fastest other kernel where it takes under `margin` of plain's time, else 'plain' (a
    near-tie is not worth another copy of the weights)."""
    best = min((name for name in seconds if name != "plain"), key=seconds.__getitem__, default=None)
    if best is not None and seconds[best] < margin * seconds["plain"]:
        return best
    return "plain"


def _best_seconds(fn, x: torch.Tensor, layers: list, repeats: int) -> float:
    """Seconds of one call, from the best of `repeats` passes over every layer (after a warm-up
    pass: first-call allocations and kernel selection)."""
    best = float("inf")
    for attempt in range(repeats + 1):
        start = time.perf_counter()
        for layer in layers:
            fn(layer, x)
        if attempt:
            best = min(best, (time.perf_counter() - start) / len(layers))
    return best


_CALIBRATION: dict[str, tuple[str, ...]] = {}


def _calibration_path() -> Path:
    return cache_root() / "kernels" / CALIBRATION_FILE


def _stored_calibration() -> dict[str, list[str]]:
    try:
        return json.loads(_calibration_path().read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measure again


def _store_calibration(key: str, choices: tuple[str, ...]) -> None:
    """Add one measurement to the file (read again first: another process may have added its own)."""
    stored = _stored_calibration()
    stored[key] = list(choices)
    try:
        atomic_write(_calibration_path(), lambda tmp: Path(tmp).write_text(json.dumps(stored, indent=1, sort_keys=True)))
    except OSError:
        pass  # a read-only home: the process keeps its own measurement


@functools.cache  # hashed once per process, not once per shape calibrated
def _kernel_source_tag() -> str:
    return hashlib.sha1(panel_kernel.SOURCE.read_bytes()).hexdigest()[:12]


@torch.inference_mode()
def calibrate(layers: list[dict]) -> tuple[str, ...]:
    """Per ROW_BUCKETS entry, the fastest kernel for layers of one shape. layers: the target's
    layers of that shape, each {'plain': nn.Linear, 'packed': PackedLinear | None, 'panel':
    PanelLinear | None}. Up to STREAM_ROWS rows, timed over enough of them to stream
    STREAM_BYTES of weights; past it over two. Measured once per machine (CPU model, torch,
    threads, shape, dtypes and kernel source) and kept in the cache folder, since timing every
    bucket of a 135M target takes ~10 s on 2 cores; DRAFTHEAD_CACHE moves that folder, and
    DRAFTHEAD_RECALIBRATE=1 measures again (a measurement taken while the machine was busy)."""
    linear = layers[0]["plain"]
    panel = layers[0].get("panel")
    key = json.dumps(
        [
            cpu_model(),
            torch.__version__,
            torch.get_num_threads(),
            linear.in_features,
            linear.out_features,
            str(linear.weight.dtype),
            linear.bias is not None,
            None if panel is None else str(panel.panels.dtype),
            layers[0].get("packed") is not None,
            _kernel_source_tag(),
            ROW_BUCKETS,
        ]
    )
    if key not in _CALIBRATION:
        stored = None if os.environ.get("DRAFTHEAD_RECALIBRATE") == "1" else _stored_calibration().get(key)
        if stored is not None and len(stored) == len(ROW_BUCKETS):
            _CALIBRATION[key] = tuple(stored)
            return _CALIBRATION[key]
        per_layer = linear.weight.numel() * linear.weight.element_size()
        streaming = layers[: max(1, min(len(layers), -(-STREAM_BYTES // per_layer)))]
        # each (layer's kernels, x) -> y
        kernels: dict[str, Callable[..., torch.Tensor]] = {"plain": lambda k, x: F.linear(x, k["plain"].weight, k["plain"].bias)}
        for name in ("packed", "panel"):
            if layers[0].get(name) is not None:
                kernels[name] = lambda k, x, name=name: k[name](x)
        choices = []
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows)).to(linear.weight.dtype)
            sample, repeats = (streaming, 2) if rows <= STREAM_ROWS else (layers[:2], 1)
            choices.append(fastest({name: _best_seconds(fn, x, sample, repeats) for name, fn in kernels.items()}))
        _CALIBRATION[key] = tuple(choices)
        _store_calibration(key, _CALIBRATION[key])
    return _CALIBRATION[key]


_LAYERS: "weakref.WeakValueDictionary[int, RowDispatchLinear]" = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count()


@torch.library.custom_op("drafthead::row_dispatch_linear", mutates_args=())
def row_dispatch_linear(x: torch.Tensor, key: int) -> torch.Tensor:
    """The dispatching layer registered under `key`, run eagerly: what a compiled graph calls."""
    return _LAYERS[key].dispatch(x)


@row_dispatch_linear.register_fake
def _(x: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[key].out_features))


class RowDispatchLinear(nn.Module):
    """An nn.Linear's forward on F.linear, a packed weight or weight panels, chosen by the row count."""

    linear: nn.Linear  # plain attributes (object.__setattr__ in __init__), not submodules
    kernels: dict[str, nn.Module]

    def __init__(self, linear: nn.Linear, kernels: dict[str, nn.Module], choices: tuple[str, ...]) -> None:
        super().__init__()
        # The layer's own Parameters under their own names, and the rest as plain attributes (not
        # submodules): while swapped in, the target's parameters and state_dict are unchanged.
        self.weight, self.bias = linear.weight, linear.bias
        object.__setattr__(self, "linear", linear)
        # only the kernels some bucket chose: the others' copies are dropped
        object.__setattr__(self, "kernels", {name: kernels[name] for name in set(choices) - {"plain"}})
        self.choices = choices
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.key = next(_NEXT_KEY)  # for the custom op a compiled graph calls
        _LAYERS[self.key] = self

    def extra_repr(self) -> str:
        chosen = ", ".join(f"{rows}: {name}" for rows, name in zip(ROW_BUCKETS, self.choices))
        return f"in_features={self.in_features}, out_features={self.out_features}, kernels by rows {{{chosen}}}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return row_dispatch_linear(x, self.key)
        return self.dispatch(x)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        name = kernel_for_rows(x.numel() // self.in_features, self.choices)
        if name == "plain":
            return F.linear(x, self.weight, self.bias)
        return self.kernels[name](x)  # each falls back to F.linear itself under autograd or another dtype


MEMORY_SHARE = 0.25  # make copies only while they take at most this share of physical memory


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def fits_in_memory(extra_bytes: int, total_bytes: int | None, share: float = MEMORY_SHARE) -> bool:
    """Whether copies of `extra_bytes` may be made on a machine of `total_bytes` (unknown: yes).
    A 135M target's ~540 MB fits anywhere; an 8B target's 32 GB of fp32 linears does not fit a
    64 GB machine, where the copy would cost more than the kernel saves."""
    return total_bytes is None or extra_bytes <= share * total_bytes


def _panel_layer(module: nn.Linear):
    weight = module.weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not panel_kernel.enabled():
        return None
    return panel_kernel.PanelLinear(module)


def _build(target: nn.Module) -> dict[str, RowDispatchLinear]:
    """{qualified name: dispatching layer} for the target's nn.Linears where another kernel beats
    F.linear at some row count ({} when the copies would not fit in memory)."""
    named = [(name, m) for name, m in target.named_modules() if type(m) is nn.Linear]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for _, m in named)
    # the packed copy and the panels (at most the weight's own size each) exist together until
    # calibrated; where only one copy fits, the panels alone
    memory = physical_memory_bytes()
    if not fits_in_memory(weight_bytes, memory):
        return {}
    with_packed = fits_in_memory(2 * weight_bytes, memory)
    groups: dict[tuple, list[tuple[str, dict]]] = {}
    for name, module in named:
        kernels = {"plain": module, "packed": pack_linear(module, rows_hint=16) if with_packed else None, "panel": _panel_layer(module)}
        shape = (
            module.in_features,
            module.out_features,
            module.bias is not None,
            module.weight.dtype,
            None if kernels["panel"] is None else kernels["panel"].panels.dtype,
        )
        groups.setdefault(shape, []).append((name, kernels))
    layers = {}
    for members in groups.values():
        measured = calibrate([kernels for _, kernels in members])
        for name, kernels in members:
            # a kernel this layer lacks (its packing failed alone in its group) is F.linear's bucket
            choices = tuple(c if kernels.get(c) is not None else "plain" for c in measured)
            if set(choices) != {"plain"}:
                layers[name] = RowDispatchLinear(kernels["plain"], kernels, choices)
    return layers


def dispatch_linears(module: nn.Module) -> int:
    """Replace, for good, every nn.Linear under `module` that another kernel beats by its
    RowDispatchLinear; returns how many. For a drafter's head, which only ever runs inference
    once loaded: its draft steps multiply a few rows by every head weight, the regime the faster
    kernels are for. Parameters and state_dict keys stay the same; a no-op off the CPU."""
    param = next(module.parameters(), None)
    if param is None or param.device.type != "cpu":
        return 0
    layers = _build(module)
    _swap(module, layers)
    return len(layers)


def _weights_key(target: nn.Module) -> tuple:
    param = next(target.parameters())
    return (
        param.device,
        param.dtype,
        torch.get_num_threads(),
        # _version counts in-place writes (load_state_dict copies into the same storage)
        tuple((m.weight.data_ptr(), m.weight._version) for m in target.modules() if type(m) is nn.Linear),
    )


_ATTR = "_drafthead_engine_linears"
_ACTIVE = "_drafthead_engine_linears_active"


def _swap(target: nn.Module, layers: Mapping[str, nn.Module]) -> None:
    for name, layer in layers.items():
        parent_name, _, child = name.rpartition(".")
        setattr(target.get_submodule(parent_name) if parent_name else target, child, layer)


@contextmanager
def engine_linears(target: nn.Module, enabled: bool = True):
    """Within the block the target's linears dispatch by row count (module docstring); on exit
    its own nn.Linear modules are back. A no-op off the CPU, or when `enabled` is False."""
    param = next(target.parameters(), None)
    if not enabled or param is None or param.device.type != "cpu" or getattr(target, _ACTIVE, False):
        # off, not a CPU, or inside an enclosing block already
        yield
        return
    key = _weights_key(target)
    cached = getattr(target, _ATTR, None)
    if cached is None or cached[0] != key:
        cached = (key, _build(target))
        object.__setattr__(target, _ATTR, cached)  # a plain attribute: not a submodule, not in state_dict
    layers = cached[1]
    originals = {name: layer.linear for name, layer in layers.items()}
    _swap(target, layers)
    object.__setattr__(target, _ACTIVE, True)
    try:
        yield
    finally:
        _swap(target, originals)
        object.__setattr__(target, _ACTIVE, False)


_INVARIANT_ATTR = "_drafthead_invariant_linears"


@contextmanager
def invariant_linears(target: nn.Module):
    """Within the block every nn.Linear of the target runs on the row-invariant kernel this CPU
    has for its dtype (inference/kernels/invariant_linear.py `path_for`): each output sums its K
    products in one order whatever the row count, so a row's result does not depend on the rows
    computed with it (inference/engine/invariant.py). Raises where no such kernel can run (not a
    CPU, another dtype, no AVX2 build)."""
    param = next(target.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            "row-invariant decoding runs on the CPU's row-invariant kernels, in float32 or bfloat16; "
            f"this target is {param.dtype} on {param.device.type}"
        )
    path = invariant_linear.path_for(param.dtype)
    key = (_weights_key(target), path)
    cached = getattr(target, _INVARIANT_ATTR, None)
    if cached is None or cached[0] != key:
        named = [(name, m) for name, m in target.named_modules() if type(m) is nn.Linear]
        cached = (key, {name: invariant_linear.invariant_layer(m, path) for name, m in named})
        object.__setattr__(target, _INVARIANT_ATTR, cached)
    layers = cached[1]
    originals = {name: target.get_submodule(name) for name in layers}
    _swap(target, layers)
    try:
        yield
    finally:
        _swap(target, originals)
