"""oneDNN linears on prepacked weights: one of the kernels our engine picks from per row count.

A draft step multiplies a handful of rows (1 to 8 frontier nodes) by every weight of the head,
and a verify forward a few dozen rows by every weight of the target. `F.linear` in that regime
can be slow on CPU: it repacks the weight on every call, where oneDNN can pack it once. Measured
on the 2-core dev machine (AVX512-BF16), rows x in -> out:

    4 x 576 -> 8192   bfloat16  F.linear 406 us   packed 123 us   (output bit-identical)
    4 x 576 -> 1536   bfloat16  F.linear 102 us   packed  41 us   (output bit-identical)
    4 x 576 -> 8192   float32   F.linear 1996 us  packed 248 us   (output within 1e-5)

On other CPUs the order changes (docs/cpu-measurements.md), so inference/kernels/target_linears.py
measures this kernel against F.linear and our panel kernel (inference/kernels/panel_kernel.py) and keeps
the fastest per row count, for the target inside our engine's calls and for drafter heads.
Packing is inference-only (a packed layer falls back to `F.linear` whenever autograd records),
CPU-only, and checked on a probe input at pack time: a build or dtype where the packed kernel is
missing or disagrees keeps the plain layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


class PackedLinear(nn.Module):
    """An `nn.Linear` whose forward runs on a oneDNN-packed copy of its weight.

    Shares the original layer's `weight` and `bias` Parameters (state_dict keys are unchanged);
    the packed copy does not follow later in-place edits of the weight: pack after loading.
    """

    def __init__(self, linear: nn.Linear, packed: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = packed  # opaque mkldnn tensor [out, in]; a plain attribute, not a buffer
        self.packed_dtype = linear.weight.dtype

    def _packed_applies(self, x: torch.Tensor) -> bool:
        # not under autograd, and neither x nor the layer moved off the packed copy's CPU dtype
        # (`.to()` moves the Parameters, never the packed copy)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return False
        return x.dtype == self.weight.dtype == self.packed_dtype and x.device.type == self.weight.device.type == "cpu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._packed_applies(x):
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features).contiguous()  # [M, in]
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linear(linear: nn.Linear, rows_hint: int = 4) -> PackedLinear | None:
    """A PackedLinear for `linear`, or None where packing is unavailable or disagrees with F.linear."""
    weight = linear.weight
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
            layer = PackedLinear(linear, packed)
            probe = torch.randn(rows_hint, linear.in_features, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            with torch.inference_mode():
                got, want = layer(probe), F.linear(probe, weight, linear.bias)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None  # no oneDNN kernel for this dtype on this CPU, or an older torch
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        return None
    return layer
