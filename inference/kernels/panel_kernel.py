"""Panel linears: our own CPU kernel for the target's linears at decode and verify row counts.

The kernel (inference/kernels/csrc/panel_linear.cpp) stores a weight [N, K] as column panels
[ceil(N/16), K, 16] and streams each panel once per call, in fp32 arithmetic; a bf16 weight is
read as bf16, half the bytes of fp32. docs/cpu-measurements.md "Panel linears" has why and what it
measured. It is compiled on first use with torch's C++ extension builder (a C++ compiler and
ninja; ~1 min once, cached under ~/.cache/torch_extensions), together with the row-invariant
attention and bf16 linears (`SOURCES`), and only on x86-64 CPUs with AVX2 and FMA. Where it
cannot be built or loaded, `why_unavailable()` says why and the engine keeps the other kernels
(inference/kernels/target_linears.py); nothing else changes. DRAFTHEAD_PANEL_KERNEL=0 keeps the
engine's fastest-kernel dispatch off it (`enabled()`); `load()` still builds it, so its own tests
run with the switch off too.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch
from torch import nn

SOURCE = Path(__file__).parent / "csrc" / "panel_linear.cpp"
# built into the same library: row-invariant attention (inference/engine/invariant.py) and the
# row-invariant bf16 linears (inference/kernels/invariant_linear.py)
ATTENTION_SOURCE = Path(__file__).parent / "csrc" / "row_attention.cpp"
INVARIANT_SOURCE = Path(__file__).parent / "csrc" / "invariant_linear.cpp"
SOURCES = (SOURCE, ATTENTION_SOURCE, INVARIANT_SOURCE)
CFLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp")  # no fused a * b + c the source does not write: one order
ENV_SWITCH = "DRAFTHEAD_PANEL_KERNEL"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str once load() ran


def _cpu_supports() -> str | None:
    """None when this CPU can run the kernel, else why not."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel is x86-64 AVX2 code, this is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2/FMA (torch reports {capability})"
    return None


def _ensure_ninja_on_path() -> None:
    # torch's builder runs `ninja`; a venv's ninja sits beside its python, which a non-activated
    # venv does not put on PATH
    if shutil.which("ninja") is None:
        os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


def library_name() -> str:
    """The compiled library's name, keyed by its sources and flags: torch's builder keeps one build
    folder per name (shared by every checkout of a user), so two checkouts with different kernels
    must not build into the same one."""
    digest = hashlib.sha1("\0".join(CFLAGS).encode())
    for source in SOURCES:
        digest.update(source.read_bytes())
    return f"drafthead_kernels_{digest.hexdigest()[:12]}"


def load() -> bool:
    """Build (first time) and load the kernel; False when this CPU or toolchain cannot
    (`why_unavailable()` says why). The switch plays no part here: see `enabled()`."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        why = _cpu_supports()
        if why is None:
            try:
                from torch.utils.cpp_extension import load as build

                _ensure_ninja_on_path()
                build(
                    library_name(),
                    [str(source) for source in SOURCES],
                    is_python_module=False,
                    verbose=False,
                    extra_cflags=list(CFLAGS),
                    extra_ldflags=["-fopenmp"],
                )
                torch.ops.drafthead_panel.linear  # noqa: B018  (raises if the library did not register)
                torch.ops.drafthead_attention.row_attention  # noqa: B018
                torch.ops.drafthead_invariant.linear  # noqa: B018
            except Exception as error:  # a missing compiler or ninja, a failed build: keep the other kernels
                why = f"could not build {SOURCE.name}: {type(error).__name__}: {str(error).strip().splitlines()[-1:]}"
        _state["ok"], _state["why"] = why is None, why or ""
        return why is None


def switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "1") == "0"


def enabled() -> bool:
    """Whether the engine may dispatch to the kernel: not switched off, and it loads."""
    return not switched_off() and load()


def why_unavailable() -> str:
    """Why `enabled()` is False ('' when it is True)."""
    if switched_off():
        return f"{ENV_SWITCH}=0"
    load()
    return str(_state["why"])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (fp32 or bf16, CPU) -> panels [ceil(N/16), K, 16] of the same dtype."""
    if not load():
        raise RuntimeError(f"panel kernel unavailable: {why_unavailable()}")
    return torch.ops.drafthead_panel.pack(weight.detach())


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] (fp32 or bf16) @ W^T + bias -> [..., N] in x's dtype, W given as `pack(W)`."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.drafthead_panel.linear(rows, panels, bias, out_features)
    return out.reshape(*x.shape[:-1], out_features)


def exact_in_bfloat16(weight: torch.Tensor) -> bool:
    """Whether every value of an fp32 weight is a bf16 value (a bf16 checkpoint loaded in fp32, or
    a target rounded by `round_weights_to_bfloat16`): then its panels can hold bf16 and lose
    nothing."""
    return weight.dtype == torch.float32 and bool(torch.equal(weight, weight.to(torch.bfloat16).to(torch.float32)))


def panel_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a weight's panels hold: bf16 where that is exact (half the bytes to stream), else
    the weight's own."""
    if weight.dtype == torch.bfloat16 or exact_in_bfloat16(weight):
        return torch.bfloat16
    return weight.dtype


def runs_inference(x: torch.Tensor, weight: torch.Tensor, made_for: torch.dtype) -> bool:
    """Whether a layer whose kernel copy was made from a `made_for` CPU weight may run it on x:
    inference only (as kernels.PackedLinear), and neither x nor the layer moved off that dtype or
    the CPU (`.to()` moves the Parameters, never the copy). Else the layer runs F.linear."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return x.dtype == weight.dtype == made_for and x.device.type == weight.device.type == "cpu"


class PanelLinear(nn.Module):
    """An nn.Linear's forward on the panel kernel: the layer's own Parameters, plus its panels."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.weight_dtype = linear.weight.dtype
        with torch.no_grad():
            self.panels = pack(linear.weight.detach().to(panel_dtype(linear.weight)))  # a plain attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not runs_inference(x, self.weight, self.weight_dtype):
            return nn.functional.linear(x, self.weight, self.bias)
        return panel_linear(x, self.panels, self.bias, self.out_features)

    @property
    def panel_bytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()
