"""Row-invariant linears (inference/kernels/invariant_linear.py) on every path this CPU has:

  * a row's output is the same bits alone and among 1..64 rows (each path sums each output's K
    products in one order whatever the row count);
  * each path is within its rounding bound of a float64 matmul: bf16 paths within one bf16
    rounding of the exact result plus the fp32 accumulation bound, the fp32 panel within the
    fp32 accumulation bound;
  * the path is chosen by CPU feature and dtype, DRAFTHEAD_INVARIANT_PATH names another, and a
    layer under autograd or moved to another dtype runs F.linear.

A path this CPU lacks is not run here (each CPU runs its own: AMX on the Xeons with amx_bf16,
avx512_bf16 on Zen 4, the panel kernel everywhere with AVX2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from drafthead.inference.kernels import invariant_linear, panel_kernel
from drafthead.inference.kernels.invariant_linear import PATHS, cpu_paths, invariant_layer, path_for

pytestmark = pytest.mark.skipif(not panel_kernel.load(), reason=f"no CPU kernels here: {panel_kernel.why_unavailable()}")

# (in, out, bias): K off the 32-blocks and odd, N off the 16- and 32-column panels, a real shape
SHAPES = [(48, 80, True), (99, 70, True), (100, 33, False), (576, 1536, False)]
ROWS = 64


def cases():
    """(path, dtype) for every path and the dtypes it computes."""
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    return [pytest.param(path, dtype, id=f"{path}-{name}") for path in PATHS for name, dtype in dtypes.items() if invariant_linear.takes(path, dtype)]


def needs(path: str) -> None:
    """Skip a native path this CPU lacks (the panel kernel's own tests run even with
    DRAFTHEAD_PANEL_KERNEL=0, which only keeps the engine off it)."""
    if path != "panel" and path not in cpu_paths():
        pytest.skip(f"this CPU has no {path} path (it has {', '.join(cpu_paths())})")


def layer_on(path: str, dtype: torch.dtype, in_features: int, out_features: int, bias: bool, seed: int = 0) -> tuple[nn.Linear, nn.Module]:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    return linear, invariant_layer(linear, path)


@pytest.mark.parametrize("path,dtype", cases())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}{'+b' if s[2] else ''}")
def test_a_row_has_the_same_bits_alone_and_among_1_to_64_rows(path, dtype, shape):
    needs(path)
    _, layer = layer_on(path, dtype, *shape)
    x = torch.randn(ROWS, shape[0], generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(ROWS)])
        for m in range(2, ROWS + 1):
            assert torch.equal(layer(x[:m]), alone[:m]), f"{m} rows"
        assert torch.equal(layer(x[:10].reshape(2, 5, -1)), alone[:10].reshape(2, 5, -1))  # leading dims are rows
    assert alone.dtype == dtype


@pytest.mark.parametrize("path,dtype", cases())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}{'+b' if s[2] else ''}")
def test_each_path_is_within_its_rounding_bound_of_a_float64_matmul(path, dtype, shape):
    """|y - exact| <= (one rounding to the output dtype) + 2 K 2^-24 sum_k |x_k w_k| (+ |b|): fp32
    accumulation of exact products in any order (the bf16 instructions and the panel kernel alike),
    doubled for the second-order terms. bf16 rounds to 8 significant bits (2^-8 relative), fp32 to
    24."""
    needs(path)
    linear, layer = layer_on(path, dtype, *shape, seed=2)
    x = torch.randn(33, shape[0], generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.inference_mode():
        got = layer(x).double()
    w, xd = linear.weight.double(), x.double()
    b = linear.bias.double() if linear.bias is not None else torch.zeros(shape[1], dtype=torch.float64)
    exact = xd @ w.T + b
    magnitude = xd.abs() @ w.abs().T + b.abs()
    rounding = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    bound = rounding * exact.abs() + 2 * shape[0] * 2.0**-24 * magnitude
    assert bool(((got - exact).abs() <= bound).all()), float(((got - exact).abs() / bound).max())


def test_the_path_follows_the_cpu_and_the_dtype(monkeypatch):
    monkeypatch.delenv(invariant_linear.ENV_PATH, raising=False)
    here = cpu_paths()
    assert ("panel" in here) == panel_kernel.enabled()  # the fallback, wherever it loads and is not switched off
    if "panel" in here:
        assert path_for(torch.float32) == "panel"  # the native paths compute bf16 only
    assert path_for(torch.bfloat16) == here[0]  # the fastest this CPU has
    for path in here:
        monkeypatch.setenv(invariant_linear.ENV_PATH, path)
        assert path_for(torch.bfloat16) == path
    for path in set(PATHS) - set(here):
        monkeypatch.setenv(invariant_linear.ENV_PATH, path)
        with pytest.raises(ValueError, match="this CPU runs"):
            path_for(torch.bfloat16)
    for path in set(invariant_linear.BF16_ONLY) & set(here):
        monkeypatch.setenv(invariant_linear.ENV_PATH, path)
        with pytest.raises(ValueError, match="bfloat16 only"):
            path_for(torch.float32)


@pytest.mark.parametrize("path", invariant_linear.BF16_ONLY)
def test_a_native_layer_under_autograd_or_in_another_dtype_runs_f_linear(path):
    needs(path)
    linear, layer = layer_on(path, torch.bfloat16, 40, 24, True, seed=4)
    x = torch.randn(4, 40).to(torch.bfloat16).requires_grad_(True)
    layer(x).float().square().sum().backward()
    grads = (x.grad.clone(), linear.weight.grad.clone())
    x.grad, linear.weight.grad = None, None
    linear(x).float().square().sum().backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], linear.weight.grad)
    layer.to(torch.float64)  # moves the Parameters; the packed copy stays bf16
    x64 = torch.randn(3, 40, dtype=torch.float64)
    with torch.inference_mode():
        assert torch.equal(layer(x64), F.linear(x64, layer.weight, layer.bias))


@pytest.mark.parametrize("path", invariant_linear.BF16_ONLY)
def test_a_layer_a_native_path_cannot_compute_runs_on_the_panel_kernel(path):
    """An fp32 layer kept in a bf16 model (a router, a gate): one fixed kernel for it too."""
    needs(path)
    assert isinstance(invariant_layer(nn.Linear(8, 8), path), panel_kernel.PanelLinear)
    assert isinstance(invariant_layer(nn.Linear(8, 8).to(torch.bfloat16), path), invariant_linear.NativeInvariantLinear)
