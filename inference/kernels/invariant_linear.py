"""Row-invariant linears: each output element sums its K products in one fixed order whatever the
number of rows, on the fastest kernel this CPU has (docs/acceptance.md "Row invariance").

A bf16 target's linears run on the CPU's native bf16 instructions where it has them
(inference/kernels/csrc/invariant_linear.cpp), an fp32 target's and every other CPU's on the
panel kernel (inference/kernels/panel_kernel.py):

    path          CPU feature                  arithmetic                              dtypes
    amx           amx_tile, amx_bf16           16 x 16 tiles, k in blocks of 32        bf16
    avx512_bf16   avx512_bf16 (+ f, bw, vl)    vdpbf16ps, 6-row x 64-column tiles      bf16
    panel         AVX2 and FMA                 fp32 FMA, 6-row x 16-column tiles       bf16, fp32

Each path gives a row the same bits alone or among any number of rows; two paths give different
bits (other summation orders), so one process runs one path for every row count
(`path_for`). `cpu_paths()` lists the paths this CPU and build can run, fastest first;
DRAFTHEAD_INVARIANT_PATH names another of them (to compare paths on one machine).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from . import panel_kernel

PATHS = ("amx", "avx512_bf16", "panel")  # fastest first
BF16_ONLY = ("amx", "avx512_bf16")
ENV_PATH = "DRAFTHEAD_INVARIANT_PATH"


def cpu_paths() -> tuple[str, ...]:
    """The paths this CPU and build can run, fastest first (none where the kernels do not load;
    no 'panel' where DRAFTHEAD_PANEL_KERNEL=0 keeps the engine off the panel kernel)."""
    if not panel_kernel.load():
        return ()
    runnable = set(torch.ops.drafthead_invariant.paths()) | ({"panel"} if panel_kernel.enabled() else set())
    return tuple(path for path in PATHS if path in runnable)


def path_for(dtype: torch.dtype) -> str:
    """The path a target of `dtype` runs on: DRAFTHEAD_INVARIANT_PATH where set, else the fastest of
    `cpu_paths()` that takes the dtype. Raises where that path cannot run here."""
    runnable = cpu_paths()
    asked = os.environ.get(ENV_PATH)
    if asked:
        if asked not in runnable:
            raise ValueError(f"{ENV_PATH}={asked}: this CPU runs {', '.join(runnable) or 'none of them'}")
        if not takes(asked, dtype):
            raise ValueError(f"{ENV_PATH}={asked} computes bfloat16 only, the target is {dtype}")
        return asked
    for path in runnable:
        if takes(path, dtype):
            return path
    raise ValueError(f"row-invariant decoding in {dtype} needs the panel kernel, which is unavailable: {panel_kernel.why_unavailable()}")


def takes(path: str, dtype: torch.dtype) -> bool:
    """Whether `path` computes a target of `dtype` (the table in the module docstring)."""
    return dtype == torch.bfloat16 or (dtype == torch.float32 and path not in BF16_ONLY)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 -> the layout the native bf16 paths read (csrc/invariant_linear.cpp)."""
    return torch.ops.drafthead_invariant.pack(weight.detach())


def invariant_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, path: str) -> torch.Tensor:
    """x [..., K] bf16 @ W^T + bias -> [..., N] bf16 on a native path, W given as `pack(W)`."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.drafthead_invariant.linear(rows, packed, bias, out_features, path)
    return out.reshape(*x.shape[:-1], out_features)


class NativeInvariantLinear(nn.Module):
    """An nn.Linear's bf16 forward on a native path ('amx', 'avx512_bf16'): the layer's own
    Parameters, plus the packed weight."""

    def __init__(self, linear: nn.Linear, path: str) -> None:
        super().__init__()
        if path not in BF16_ONLY or linear.weight.dtype != torch.bfloat16:
            raise ValueError(f"the {path} path is not a native bf16 path, or the weight ({linear.weight.dtype}) is not bf16")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.path = path
        with torch.no_grad():
            self.packed = pack(linear.weight)  # a plain attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not panel_kernel.runs_inference(x, self.weight, torch.bfloat16):
            return nn.functional.linear(x, self.weight, self.bias)
        return invariant_linear(x, self.packed, self.bias, self.out_features, self.path)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}"


def invariant_layer(linear: nn.Linear, path: str) -> nn.Module:
    """`linear`'s forward on `path` (from `path_for`); a layer the path cannot compute (an fp32
    layer kept in a bf16 model) on the panel kernel: one fixed kernel per layer either way."""
    if not takes(path, linear.weight.dtype) or path == "panel":
        return panel_kernel.PanelLinear(linear)
    return NativeInvariantLinear(linear, path)
