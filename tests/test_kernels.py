"""Prepacked oneDNN linears for drafter weights (inference/kernels.py)."""
import torch
import torch.nn.functional as F
from torch import nn

from drafthead.inference.kernels import PackedLinear, pack_linear, pack_linears

PACKING = torch.backends.mkldnn.is_available()  # where oneDNN is missing, nothing is packed


def _mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 32, bias=False)).to(dtype).eval()


def test_packed_bfloat16_linears_give_bit_identical_outputs_and_keep_state_dict():
    model = _mlp(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = [torch.randn(rows, 48).to(torch.bfloat16) for rows in (1, 3, 4, 9)] + [torch.randn(2, 5, 48).to(torch.bfloat16)]
    with torch.inference_mode():
        want = [model(x) for x in inputs]
    assert pack_linears(model) == (2 if PACKING else 0)
    assert all(isinstance(m, PackedLinear) for m in (model[0], model[2])) == PACKING
    with torch.inference_mode():
        got = [model(x) for x in inputs]
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
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


def test_a_packed_model_moved_to_another_dtype_falls_back_to_the_plain_kernel():
    model = _mlp(torch.bfloat16)
    pack_linears(model)
    model.to(torch.float64)  # moves the Parameters; the packed copies stay bf16
    x = torch.randn(3, 48, dtype=torch.float64)
    with torch.inference_mode():
        hidden = F.silu(F.linear(x, model[0].weight, model[0].bias))
        want = F.linear(hidden, model[2].weight)
        assert torch.equal(model(x), want)


def test_layers_that_cannot_be_packed_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8).double(), nn.Linear(8, 8).half())
    assert pack_linears(model) == 0
    assert all(type(m) is nn.Linear for m in model)
