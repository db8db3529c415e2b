"""Faster CPU linears for drafter heads: oneDNN-packed weights (inference/kernels/packed.py), weight
panels (inference/kernels/panel_kernel.py), and the per-row-count choice between them and F.linear
(inference/kernels/target_linears.py `dispatch_linears`)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from drafthead.inference.kernels import panel_kernel
from drafthead.inference.kernels.packed import pack_linear
from drafthead.inference.kernels.target_linears import RowDispatchLinear, dispatch_linears
from tests.forced_kernels import force_kernel

PACKING = torch.backends.mkldnn.is_available()  # where oneDNN is missing, nothing is packed
# oneDNN packs bf16 weights only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT
BF16_PACKING = PACKING and pack_linear(nn.Linear(8, 8).to(torch.bfloat16)) is not None
KERNELS = ["panel"] + (["packed"] if PACKING else [])


def _mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 32, bias=False)).to(dtype).eval()


@pytest.fixture
def force(monkeypatch):
    """force(kernel): every layer takes `kernel` at every measured row count, whatever this CPU's
    timings say."""
    return lambda kernel: force_kernel(monkeypatch, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_dispatched_bfloat16_linears_match_f_linear_and_keep_the_state_dict(kernel, force):
    """oneDNN's packed bf16 kernel is bit-identical to F.linear; the panels sum in another order,
    then round to bf16 once (within one bf16 step of the output). Where this CPU cannot pack bf16,
    the layers stay nn.Linear."""
    force(kernel)
    model = _mlp(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = [torch.randn(rows, 48).to(torch.bfloat16) for rows in (1, 3, 4, 9)] + [torch.randn(2, 5, 48).to(torch.bfloat16)]
    with torch.inference_mode():
        want = [model(x) for x in inputs]
    expected = 2 if kernel == "panel" or BF16_PACKING else 0
    assert dispatch_linears(model) == expected
    assert all(isinstance(m, RowDispatchLinear) == (expected == 2) for m in (model[0], model[2]))
    with torch.inference_mode():
        got = [model(x) for x in inputs]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if kernel == "packed":
            assert torch.equal(g, w)
        else:
            assert torch.allclose(g.float(), w.float(), rtol=2**-7, atol=2**-7)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_packed_float32_linear_is_close_and_autograd_falls_back_to_the_plain_kernel():
    torch.manual_seed(1)
    linear = nn.Linear(40, 24)
    packed = pack_linear(linear)
    if not PACKING:
        assert packed is None
        return
    x = torch.randn(4, 40)
    with torch.no_grad():
        assert torch.allclose(packed(x), linear(x), atol=1e-5, rtol=1e-5)
    # training through a packed layer: gradients are F.linear's, exactly
    xg = x.clone().requires_grad_(True)
    packed(xg).square().sum().backward()
    grad_packed = (xg.grad.clone(), linear.weight.grad.clone())
    xg.grad, linear.weight.grad = None, None
    linear(xg).square().sum().backward()
    assert torch.equal(grad_packed[0], xg.grad) and torch.equal(grad_packed[1], linear.weight.grad)


def test_a_panel_linear_under_autograd_runs_f_linear():
    assert panel_kernel.load(), panel_kernel.why_unavailable()
    torch.manual_seed(2)
    linear = nn.Linear(40, 24)
    panel = panel_kernel.PanelLinear(linear)
    x = torch.randn(4, 40, requires_grad=True)
    panel(x).square().sum().backward()
    grads = (x.grad.clone(), linear.weight.grad.clone())
    x.grad, linear.weight.grad = None, None
    linear(x).square().sum().backward()
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], linear.weight.grad)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_dispatched_model_moved_to_another_dtype_falls_back_to_the_plain_kernel(kernel, force):
    force(kernel)
    model = _mlp(torch.bfloat16)
    dispatch_linears(model)
    model.to(torch.float64)  # moves the Parameters; the packed copies and panels stay bf16
    x = torch.randn(3, 48, dtype=torch.float64)
    with torch.inference_mode():
        hidden = F.silu(F.linear(x, model[0].weight, model[0].bias))
        want = F.linear(hidden, model[2].weight)
        assert torch.equal(model(x), want)


def test_layers_no_kernel_takes_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8).double(), nn.Linear(8, 8).half())
    assert dispatch_linears(model) == 0
    assert all(type(m) is nn.Linear for m in model)
