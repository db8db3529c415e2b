"""The target's linears dispatched by row count inside the engine (inference/kernels/target_linears.py),
and the panel kernel it can dispatch to (inference/kernels/panel_kernel.py)."""

import pytest
import torch
from torch import nn

from drafthead.inference.kernels import panel_kernel, target_linears
from drafthead.inference.drafters.draft_model import DraftModelDrafter
from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.kernels.target_linears import ROW_BUCKETS, RowDispatchLinear, engine_linears, fastest, fits_in_memory, kernel_for_rows
from tests.tiny import left_padded, prompts_of
from tests.tiny import FAMILIES, plain_greedy, repetitive_prompt, tiny_causal_lm
from tests.forced_kernels import force_kernel

PACKING = torch.backends.mkldnn.is_available()
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]


def test_the_smallest_bucket_at_or_above_the_row_count_decides():
    choices = ("plain", "plain", "packed", "panel", "panel", "plain", "plain", "packed", "panel", "packed")  # 1, 2, 4, ... 512
    assert [kernel_for_rows(r, choices) for r in (1, 2, 3, 4, 5, 16, 17, 33, 64, 65, 128, 129, 256, 257, 512)] == [
        "plain",
        "plain",
        "packed",
        "packed",
        "panel",
        "panel",
        "plain",
        "plain",
        "plain",
        "packed",
        "packed",
        "panel",
        "panel",
        "packed",
        "packed",
    ]
    assert ROW_BUCKETS[-1] == 512 and kernel_for_rows(513, choices) == "plain"  # past the last bucket: MKL's regime
    assert kernel_for_rows(4000, ("panel",) * len(ROW_BUCKETS)) == "plain"


def test_the_fastest_kernel_must_beat_f_linear_by_the_margin():
    assert fastest({"plain": 1.0, "packed": 0.5, "panel": 0.3}) == "panel"
    assert fastest({"plain": 1.0, "packed": 0.5, "panel": 0.6}) == "packed"
    assert fastest({"plain": 1.0, "packed": 0.95}) == "plain"  # a near-tie keeps F.linear
    assert fastest({"plain": 1.0, "panel": 0.89}, margin=0.9) == "panel"
    assert fastest({"plain": 1.0}) == "plain"


def test_a_calibration_is_measured_once_per_machine_and_kept_on_disk(tmp_path, monkeypatch):
    """The second process on this machine reads the first one's measurement from the cache folder."""
    monkeypatch.setenv("DRAFTHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(target_linears, "_CALIBRATION", {})
    layer = nn.Linear(24, 40)
    layers = [{"plain": layer, "packed": None, "panel": None}]
    timed = []
    monkeypatch.setattr(target_linears, "_best_seconds", lambda fn, x, sample, repeats: timed.append(x.shape[0]) or 1.0)
    first = target_linears.calibrate(layers)
    assert first == ("plain",) * len(ROW_BUCKETS) and timed == list(ROW_BUCKETS)
    assert (tmp_path / "kernels" / target_linears.CALIBRATION_FILE).is_file()
    monkeypatch.setattr(target_linears, "_CALIBRATION", {})  # a new process: nothing in memory
    assert target_linears.calibrate(layers) == first and timed == list(ROW_BUCKETS)  # nothing timed again
    monkeypatch.setattr(target_linears, "_CALIBRATION", {})
    monkeypatch.setenv("DRAFTHEAD_RECALIBRATE", "1")
    target_linears.calibrate(layers)
    assert timed == list(ROW_BUCKETS) * 2  # asked to: timed again


def test_packed_copies_are_made_only_where_they_fit():
    gib = 1 << 30
    assert fits_in_memory(540 << 20, 24 * gib)  # SmolLM2's fp32 linears on this machine
    assert not fits_in_memory(32 * gib, 64 * gib)  # an 8B target's on a 64 GB machine
    assert fits_in_memory(32 * gib, None)  # memory unknown: pack


@pytest.fixture
def packed_everywhere(monkeypatch):
    force_kernel(monkeypatch, "packed")


def _linear_types(model) -> set[type]:
    return {type(m) for m in model.modules() if isinstance(m, (nn.Linear, RowDispatchLinear))}


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN")
def test_the_swap_lasts_only_the_block_and_leaves_the_state_dict(packed_everywhere):
    target = tiny_causal_lm("llama")
    keys = list(target.state_dict())
    with engine_linears(target):
        assert _linear_types(target) == {RowDispatchLinear}
        assert list(target.state_dict()) == keys
        with engine_linears(target):  # nested: the outer swap stands
            assert _linear_types(target) == {RowDispatchLinear}
        assert _linear_types(target) == {RowDispatchLinear}
    assert _linear_types(target) == {nn.Linear}
    assert list(target.state_dict()) == keys
    with engine_linears(target, enabled=False):
        assert _linear_types(target) == {nn.Linear}


def _round_to_bfloat16(model):
    """The model with every weight rounded to a bf16 value (as a bf16 checkpoint loaded in fp32):
    its panels then hold bf16."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).to(param.dtype))
    return model


KERNELS = ["panel", "panel-bf16"] + (["packed"] if PACKING else [])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_with_each_kernel_for_the_target_linears_equals_plain_greedy(family, kernel, monkeypatch):
    force_kernel(monkeypatch, kernel.removesuffix("-bf16"))
    target = tiny_causal_lm(family, layers=3)
    if kernel == "panel-bf16":
        _round_to_bfloat16(target)
    prompt = repetitive_prompt(96, seed=5)
    reference = plain_greedy(target, prompt, 40)
    for drafter in (DraftModelDrafter(tiny_causal_lm(family, seed=7), choices=TREE), PromptLookupDrafter(length=6)):
        result = speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=40))
        assert result.new_tokens[0].tolist() == reference, family
    layers = [m for m in target.modules() if isinstance(m, RowDispatchLinear)]  # none: the swap is over
    assert not layers
    # and at batch 3, prompts of different lengths: every row is its prompt's own plain output
    prompts = prompts_of((4, 11, 19), seed=3)
    ids, mask = left_padded(prompts)
    batched = speculative_generate(target, DraftModelDrafter(target, choices=TREE), ids, GenerationConfig(max_new_tokens=24), attention_mask=mask)
    assert [row.new_tokens[0].tolist() for row in batched.rows] == [plain_greedy(target, p[None], 24) for p in prompts]


def test_panels_hold_bf16_only_where_every_weight_value_is_a_bf16_value(monkeypatch):
    force_kernel(monkeypatch, "panel")
    target = tiny_causal_lm("llama")
    with engine_linears(target):
        assert {m.kernels["panel"].panels.dtype for m in target.modules() if isinstance(m, RowDispatchLinear)} == {torch.float32}
    _round_to_bfloat16(target)  # an in-place change: the panels are rebuilt
    with engine_linears(target):
        layers = [m for m in target.modules() if isinstance(m, RowDispatchLinear)]
        assert layers and {m.kernels["panel"].panels.dtype for m in layers} == {torch.bfloat16}


@pytest.mark.skipif(not PACKING, reason="this torch build has no oneDNN")
def test_packed_copies_follow_an_in_place_weight_change(packed_everywhere):
    """load_state_dict writes into the same storage: a stale packed copy would decode the old model."""
    target = tiny_causal_lm("qwen2")
    prompt = repetitive_prompt(96, seed=2)
    drafter = PromptLookupDrafter(length=6)
    speculative_generate(target, drafter, prompt, GenerationConfig(max_new_tokens=8))  # packs the weights
    other = tiny_causal_lm("qwen2", seed=3)
    target.load_state_dict(other.state_dict())
    result = speculative_generate(target, PromptLookupDrafter(length=6), prompt, GenerationConfig(max_new_tokens=30))
    assert result.new_tokens[0].tolist() == plain_greedy(other, prompt, 30)


# ---------------------------------------------------------------------------------------------
# The panel kernel against a float64 matmul
# ---------------------------------------------------------------------------------------------


def test_panels_are_the_weight_column_blocks_k_major_and_zero_padded():
    assert panel_kernel.load(), panel_kernel.why_unavailable()
    w = torch.randn(37, 5)
    panels = panel_kernel.pack(w)
    assert panels.shape == (3, 5, 16)  # ceil(37 / 16) panels
    for p in range(3):
        for k in range(5):
            for j in range(16):
                n = 16 * p + j
                assert panels[p, k, j].item() == (w[n, k].item() if n < 37 else 0.0)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features,bias", [(37, 29, True), (16, 8, False), (5, 3, True), (96, 130, False)])
def test_panel_linear_equals_a_float64_matmul(out_features, in_features, bias, weight_dtype, x_dtype):
    """Rows 1..13 and 40 cross the 6-row tiles; N = 37 and 5 leave partial panels."""
    assert panel_kernel.load(), panel_kernel.why_unavailable()
    g = torch.Generator().manual_seed(out_features * in_features)
    w = torch.randn(out_features, in_features, generator=g).to(weight_dtype)
    b = torch.randn(out_features, generator=g) if bias else None
    panels = panel_kernel.pack(w)
    assert panels.dtype == weight_dtype
    for rows in list(range(1, 14)) + [40]:
        x = torch.randn(2, rows, in_features, generator=g).to(x_dtype)  # leading dims are flattened
        got = panel_kernel.panel_linear(x, panels, b, out_features)
        assert got.shape == (2, rows, out_features) and got.dtype == x_dtype
        want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        scale = want.abs().max().item()
        # fp32 sums (1e-6 of the largest output); a bf16 input's output is rounded to bf16 once
        tol = 1e-6 if x_dtype == torch.float32 else 2**-8
        assert (got.double() - want).abs().max().item() <= tol * scale, rows


def test_panel_linear_refuses_mismatched_shapes():
    assert panel_kernel.load(), panel_kernel.why_unavailable()
    panels = panel_kernel.pack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="features"):
        panel_kernel.panel_linear(torch.randn(3, 9), panels, None, 20)
    with pytest.raises(RuntimeError, match="panels"):
        panel_kernel.panel_linear(torch.randn(3, 8), panels, None, 40)
