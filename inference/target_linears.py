"""The target's linears on the faster CPU kernel per row count, inside our engine only.

On a CPU without bf16 instructions, fp32 `F.linear` (MKL) is slow in the regime a verify forward
lives in: a few to a few dozen rows. Measured on the 2-core dev machine (docs/cpu-measurements.md
"Linears by row count"), SmolLM2-135M shapes, fp32, F.linear vs a oneDNN-packed weight:

    rows   576 -> 1536 (up)   576 -> 576 (q)   576 -> 49152 (lm_head)
       1   0.11 / 0.19 ms     0.03 / 0.10      5.0 / 5.5
       4   0.17 / 0.21        0.25 / 0.09      10.1 / 5.6
      16   0.70 / 0.23        0.24 / 0.09      23.2 / 8.4
      64   0.66 / 0.62        0.18 / 0.29      26.0 / 18.4

Which kernel wins depends on the shape, the row count, the dtype and the CPU, so it is measured:
once per (in, out, dtype, threads) and process, at ROW_BUCKETS rows, the faster kernel is kept
for each bucket (`calibrate`). A forward with M rows uses the choice of the smallest bucket
>= M (`kernel_for_rows`, a pure function).

Scope: `engine_linears(target)` swaps the dispatching layers in for the duration of our engine's
calls and puts the target's own `nn.Linear`s back afterwards, so transformers' `generate()`,
training and saving see the unmodified model. The packed copies are kept on the model (one extra
copy of every linear weight: ~540 MB for SmolLM2 in fp32) and rebuilt when a weight changes; a
target whose copies would take over a quarter of physical memory is left unpacked.

Compiled forwards (inference/compiled.py): dynamo cannot trace an opaque packed weight, so a
dispatching layer appears in a compiled graph as one custom op (`drafthead::row_dispatch_linear`)
that makes the same choice at run time, and inductor fuses the elementwise work around it.

Exactness: a packed kernel sums in another order than MKL (fp32 results agree within ~1e-6
relative), exactly as a tree forward over 17 rows already rounds differently from a one-row
step. The guarantee stays the one docs/acceptance.md states: fp32 greedy output equals plain
greedy output token for token, which the tests assert with this path on.
"""
from __future__ import annotations

import bisect
import itertools
import os
import time
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import pack_linear

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
WIN_MARGIN = 0.9  # the packed kernel is kept where it takes under 90% of F.linear's time


def kernel_for_rows(rows: int, packed_wins: tuple[bool, ...], buckets: tuple[int, ...] = ROW_BUCKETS) -> str:
    """'packed' or 'plain' for a forward over `rows` rows, from the per-bucket measurement
    `packed_wins[i]` (bucket i = buckets[i] rows): the smallest bucket >= rows decides; beyond the
    last bucket, F.linear (large matmuls are MKL's regime)."""
    i = bisect.bisect_left(buckets, rows)
    if i == len(buckets):
        return "plain"
    return "packed" if packed_wins[i] else "plain"


def _best_ms(fn, x, repeats: int = 3) -> float:
    fn(x)  # warm-up: first-call allocations and kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - start)
    return best


_CALIBRATION: dict[tuple, tuple[bool, ...]] = {}


@torch.inference_mode()
def calibrate(linear: nn.Linear, packed) -> tuple[bool, ...]:
    """Per ROW_BUCKETS entry, whether the packed kernel beat F.linear on this layer's shape
    (measured once per shape, dtype and thread count in a process; the minimum of 3 calls each)."""
    key = (linear.in_features, linear.out_features, linear.weight.dtype, linear.bias is not None, torch.get_num_threads())
    if key not in _CALIBRATION:
        wins = []
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows)).to(linear.weight.dtype)
            plain = _best_ms(lambda v: F.linear(v, linear.weight, linear.bias), x)
            fast = _best_ms(packed, x)
            wins.append(fast < WIN_MARGIN * plain)
        _CALIBRATION[key] = tuple(wins)
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
    """An nn.Linear's forward on F.linear or a packed weight, chosen by the row count."""

    def __init__(self, linear: nn.Linear, packed, packed_wins: tuple[bool, ...]) -> None:
        super().__init__()
        # The layer's own Parameters under their own names, and the rest as plain attributes (not
        # submodules): while swapped in, the target's parameters and state_dict are unchanged.
        self.weight, self.bias = linear.weight, linear.bias
        object.__setattr__(self, "linear", linear)
        object.__setattr__(self, "packed", packed)  # a kernels.PackedLinear on the same weight
        self.packed_wins = packed_wins
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.key = next(_NEXT_KEY)  # for the custom op a compiled graph calls
        _LAYERS[self.key] = self

    def extra_repr(self) -> str:
        rows = [r for r, w in zip(ROW_BUCKETS, self.packed_wins) if w]
        return f"in_features={self.in_features}, out_features={self.out_features}, packed at rows {rows}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return row_dispatch_linear(x, self.key)
        return self.dispatch(x)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if kernel_for_rows(rows, self.packed_wins) == "packed":
            return self.packed(x)  # falls back to F.linear itself under autograd or another dtype
        return F.linear(x, self.weight, self.bias)


MEMORY_SHARE = 0.25  # pack only while the extra copies take at most this share of physical memory


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def fits_in_memory(extra_bytes: int, total_bytes: int | None, share: float = MEMORY_SHARE) -> bool:
    """Whether packed copies of `extra_bytes` may be made on a machine of `total_bytes` (unknown:
    yes). A 135M target's ~540 MB fits anywhere; an 8B target's 32 GB of fp32 linears does not
    fit a 64 GB machine, where the copy would cost more than the kernel saves."""
    return total_bytes is None or extra_bytes <= share * total_bytes


def _build(target: nn.Module) -> dict[str, RowDispatchLinear]:
    """{qualified name: dispatching layer} for the target's nn.Linears that gain from packing
    ({} when the copies would not fit in memory)."""
    linears = [m for m in target.modules() if type(m) is nn.Linear]
    if not fits_in_memory(sum(m.weight.numel() * m.weight.element_size() for m in linears), physical_memory_bytes()):
        return {}
    layers = {}
    for name, module in target.named_modules():
        if type(module) is not nn.Linear:
            continue
        packed = pack_linear(module, rows_hint=16)
        if packed is None:
            continue
        wins = calibrate(module, packed)
        if any(wins):
            layers[name] = RowDispatchLinear(module, packed, wins)
    return layers


def _weights_key(target: nn.Module) -> tuple:
    param = next(target.parameters())
    return (param.device, param.dtype, torch.get_num_threads(),
            # _version counts in-place writes (load_state_dict copies into the same storage)
            tuple((m.weight.data_ptr(), m.weight._version) for m in target.modules() if type(m) is nn.Linear))


_ATTR = "_drafthead_engine_linears"
_ACTIVE = "_drafthead_engine_linears_active"


def _swap(target: nn.Module, layers: dict[str, nn.Module]) -> None:
    for name, layer in layers.items():
        parent_name, _, child = name.rpartition(".")
        setattr(target.get_submodule(parent_name) if parent_name else target, child, layer)


@contextmanager
def engine_linears(target: nn.Module, enabled: bool = True):
    """Within the block the target's linears dispatch by row count (module docstring); on exit
    its own nn.Linear modules are back. A no-op off the CPU, or when `enabled` is False."""
    param = next(target.parameters(), None)
    if (not enabled or param is None or param.device.type != "cpu" or not torch.backends.mkldnn.is_available()
            or getattr(target, _ACTIVE, False)):  # off, not a CPU, or inside an enclosing block already
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
