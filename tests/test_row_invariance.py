"""Row invariance (inference/engine/invariant.py): with `row_invariant=True` a row's logits are the
same bits whether the target computes it alone or among the nodes of a tree and the rows of a
batch, so bf16 speculative output equals our bf16 plain decoding token for token.

  * each op that reduces (the linears on panels, the attention) gives a row the same bits alone
    and among 17 rows;
  * whole forwards: the logits of a 17-node tree's spine equal the same tokens' one-row forwards,
    bit for bit, on tiny bf16 targets of several families;
  * decoding: greedy speculative output, with drafts accepted to depth >= 2 (tests/oracle.py),
    equals plain decoding through the same kernels at batch 1 and 3;
  * what it cannot run (attention sinks, the llama.cpp backend, a compiled forward) is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from drafthead.inference.drafters.prompt_lookup import PromptLookupDrafter
from drafthead.inference.engine.drafter import RootOnlyDrafter
from drafthead.inference.engine.generate import GenerationConfig, generate_batch, speculative_generate
from drafthead.inference.engine import invariant
from drafthead.inference.engine.invariant import row_invariant_attention
from drafthead.inference.engine.backend import row_invariant_by_default, target_backend
from drafthead.inference.engine.torch_target import TorchTarget
from drafthead.inference.engine.tree import DraftTree
from drafthead.inference.kernels import panel_kernel
from drafthead.inference.kernels.invariant_linear import BF16_ONLY, ENV_PATH, PATHS, cpu_paths, path_for
from drafthead.inference.kernels.target_linears import invariant_linears
from tests.oracle import OracleDrafter, accepted_drafts, by_row, known_continuation, never
from tests.tiny import repetitive_prompt, tiny_causal_lm

pytestmark = pytest.mark.skipif(not panel_kernel.enabled(), reason=f"no panel kernel here: {panel_kernel.why_unavailable()}")

FAMILIES = ["llama", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe", "deepseek_v3"]
VOCAB = 96


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linears_give_a_row_the_same_bits_alone_and_among_17(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 80), nn.Linear(80, 33, bias=False)).to(dtype)
    x = torch.randn(17, 48).to(dtype)
    with torch.no_grad(), invariant_linears(model):
        together = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(17)])
    assert torch.equal(together, alone)
    assert all(type(m) is nn.Linear for m in model)  # the model's own layers are back


def tree_mask(seen: torch.Tensor) -> torch.Tensor:
    """bool [B, Tq, Tk] -> the engine's additive mask [B, 1, Tq, Tk] in bf16 (0: seen)."""
    return torch.where(seen, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)[:, None]


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_attention_gives_a_row_the_same_bits_alone_and_among_17(softcap):
    """A row among 17 queries and 30 keys, some masked, against the row alone over exactly the keys
    it sees: what its own one-row forward would hold in the cache."""
    g = torch.Generator().manual_seed(1)
    B, heads, kv_heads, Tq, Tk, D = 2, 4, 2, 17, 30, 8
    q = torch.randn(B, heads, Tq, D, generator=g).to(torch.bfloat16)
    k = torch.randn(B, kv_heads, Tk, D, generator=g).to(torch.bfloat16)
    v = torch.randn(B, kv_heads, Tk, D, generator=g).to(torch.bfloat16)
    seen = torch.rand(B, Tq, Tk, generator=g) < 0.6
    seen[:, :, 0] = True
    module = nn.Module()
    together, _ = row_invariant_attention(module, q, k, v, tree_mask(seen), scaling=0.3, softcap=softcap)
    for b in range(B):
        for i in range(Tq):
            keys = seen[b, i].nonzero().squeeze(1)
            n = len(keys)
            alone, _ = row_invariant_attention(
                module,
                q[b : b + 1, :, i : i + 1],
                k[b : b + 1, :, keys],
                v[b : b + 1, :, keys],
                tree_mask(torch.ones(1, 1, n, dtype=torch.bool)),
                scaling=0.3,
                softcap=softcap,
            )
            assert torch.equal(together[b, i], alone[0, 0]), (b, i)


def reference_attention(q, k, v, seen, scaling, softcap=None):
    """float64 attention: q [B, h, Tq, D], k/v [B, hkv, Tk, D or Dv], seen bool [B, Tq, Tk] ->
    [B, Tq, h, Dv]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = q.double() @ k.transpose(-1, -2) * scaling
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores.masked_fill(~seen[:, None], -torch.inf), dim=-1)
    return (weights @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(8, 8), (36, 20), (64, 64), (130, 130)], ids=lambda d: f"D{d[0]}-Dv{d[1]}")
def test_attention_is_within_rounding_of_a_float64_softmax(dtype, dims):
    """Head sizes that leave tails past the 8-lane score blocks and the 64-wide value registers;
    any mask form; a strided query (as transformers hands it) reads as a contiguous one."""
    D, Dv = dims
    g = torch.Generator().manual_seed(5)
    B, heads, kv_heads, Tq, Tk = 2, 6, 2, 5, 37
    q = torch.randn(B, Tq, heads, D, generator=g).to(dtype).transpose(1, 2)  # [B, h, Tq, D], not contiguous
    k = torch.randn(B, kv_heads, Tk, D, generator=g).to(dtype)
    v = torch.randn(B, kv_heads, Tk, Dv, generator=g).to(dtype)
    seen = torch.rand(B, Tq, Tk, generator=g) < 0.5
    seen[:, :, 3] = True
    module = nn.Module()
    got, _ = row_invariant_attention(module, q, k, v, tree_mask(seen), scaling=D**-0.5, softcap=7.0)
    assert got.dtype == dtype and got.shape == (B, Tq, heads, Dv)
    for mask in (seen[:, None], torch.where(seen, 0.0, -torch.inf)[:, None]):  # boolean, fp32 additive
        again, _ = row_invariant_attention(module, q.contiguous(), k, v, mask, scaling=D**-0.5, softcap=7.0)
        assert torch.equal(again, got)
    want = reference_attention(q, k, v, seen, D**-0.5, 7.0)
    # fp32 arithmetic over <= 37 keys, then (bf16) one rounding of the output
    tol = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.double(), want, rtol=tol, atol=tol), float((got.double() - want).abs().max())


def test_attention_without_a_mask_sees_what_sdpa_sees():
    """An encoder layer (a vision tower's, in a prefill) may pass no mask: all keys where the layer
    is not causal, the causal triangle where it is."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 4, 6, 16, generator=g) for _ in range(3))
    encoder, decoder = nn.Module(), nn.Module()
    encoder.is_causal = False
    for module, causal in ((encoder, False), (decoder, True)):
        got, _ = row_invariant_attention(module, q, k, v, None, scaling=0.25)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.25).transpose(1, 2)
        assert torch.allclose(got, want, atol=1e-5), causal


def test_a_prompts_keys_and_values_are_the_same_bits_prefilled_alone_in_a_batch_and_token_by_token():
    """The prefill runs the row-invariant kernels too: a prompt's K/V do not depend on the length
    of the prompts it is padded to, nor on how many of its tokens one forward takes, so plain and
    speculative decoding start from the same cache whatever their batches (position 0 included)."""
    model = tiny_causal_lm("llama", vocab=VOCAB, layers=2, hidden=32, dtype=torch.bfloat16)
    prompt = repetitive_prompt(VOCAB, 12, seed=6)[0]  # 18 tokens: 17 prefilled
    longer = repetitive_prompt(VOCAB, 20, seed=7)[0]
    backend = TorchTarget(model, row_invariant=True)

    def keys_values(prompts, steps=()):
        with torch.inference_mode(), backend.engine_context(True):
            backend.start(prompts, (), False)
            length = prompts[0].numel() - 1
            for token in steps:
                backend.verify([DraftTree(torch.tensor([[token]]), torch.tensor([-1]))], [length], False)
                backend.keep([[0]], [length])
                length += 1
        n = prompt.numel() - 1
        return [torch.cat([layer.keys[0, :, :n], layer.values[0, :, :n]]) for layer in backend.cache.layers]

    alone = keys_values([prompt])
    batched = keys_values([prompt, longer])
    stepwise = keys_values([prompt[:2]], prompt[1:-1].tolist())
    for a, b, c in zip(alone, batched, stepwise):
        assert torch.equal(a, b) and torch.equal(a, c)


def spine_and_branches(pending: int, spine: list[int], extra: int, seed: int) -> DraftTree:
    """root (`pending`) -> spine[0] -> spine[1] ..., plus `extra` random nodes hung anywhere."""
    g = torch.Generator().manual_seed(seed)
    parents = list(range(-1, len(spine)))
    tokens = [pending, *spine]
    for i in range(len(tokens), len(tokens) + extra):
        parents.append(int(torch.randint(0, i, (1,), generator=g)))
        tokens.append(int(torch.randint(3, VOCAB, (1,), generator=g)))
    return DraftTree(torch.tensor([tokens]), torch.tensor(parents))


def tree_and_steps(family: str, row_invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 logits of a 17-node tree's spine (4 drafts, 12 branches) from one verify forward, and
    of the same tokens from one-row forwards one after another: ([5, V], [5, V])."""
    model = tiny_causal_lm(family, vocab=VOCAB, layers=2, hidden=32, dtype=torch.bfloat16)
    prompt = repetitive_prompt(VOCAB, 12, seed=3)[0]
    spine = [5, 17, 42, 8]
    backend = TorchTarget(model, row_invariant=row_invariant)
    with torch.inference_mode(), backend.engine_context(True):
        backend.start([prompt], (), False)
        length = prompt.numel() - 1
        tree = spine_and_branches(int(prompt[-1]), spine, 12, seed=4)
        together = backend.verify([tree], [length], False).logits[0, : len(spine) + 1]
        backend.discard(length)
        alone = []
        for token in [int(prompt[-1]), *spine]:
            one = DraftTree(torch.tensor([[token]]), torch.tensor([-1]))
            alone.append(backend.verify([one], [length], False).logits[0, 0])
            backend.keep([[0]], [length])
            length += 1
    return together, torch.stack(alone)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tree_forward_gives_each_node_the_bits_of_its_own_one_row_forward(family):
    together, alone = tree_and_steps(family, row_invariant=True)
    assert together.dtype == torch.bfloat16
    assert torch.equal(together, alone)


def test_the_fast_kernels_are_not_row_invariant():
    """The control: without the mode the same comparison fails (on the dev machine, 6 of these 7
    families), so the test above is one that can fail."""
    assert not all(torch.equal(*tree_and_steps(family, row_invariant=False)) for family in FAMILIES)


def plain_decoding(model, prompts: list[torch.Tensor], n: int) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=n, row_invariant=True)
    return [speculative_generate(model, RootOnlyDrafter(), p[None], config).new_tokens[0].tolist() for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_speculative_output_equals_plain_decoding_at_batch_1_and_3(family):
    model = tiny_causal_lm(family, vocab=VOCAB, layers=2, hidden=32, dtype=torch.bfloat16)
    prompts = [repetitive_prompt(VOCAB, length, seed=s)[0] for s, length in ((0, 12), (1, 9), (2, 15))]  # padded in a batch
    n = 24
    plain = plain_decoding(model, prompts, n)
    truth = known_continuation([p.tolist() + out for p, out in zip(prompts, plain)])
    config = GenerationConfig(max_new_tokens=n, row_invariant=True)

    def drafter(cut=never):
        return OracleDrafter(PromptLookupDrafter(length=4, num_draft=4), truth, VOCAB, cut)

    one = speculative_generate(model, drafter(), prompts[0][None], config)
    assert one.new_tokens[0].tolist() == plain[0]
    assert max(accepted_drafts(one)) >= 2, accepted_drafts(one)  # depth >= 2 was verified and kept
    batch = generate_batch(model, drafter(by_row), prompts, config)
    assert [row.new_tokens[0].tolist() for row in batch.rows] == plain
    assert len({sum(accepted_drafts(row)) for row in batch.rows}) > 1  # the rows kept different lengths


@pytest.mark.parametrize("path", PATHS)
def test_every_linear_path_this_cpu_has_keeps_trees_and_decoding_exact(path, monkeypatch):
    """The tests above run the path this CPU chooses; here every other path it has runs them too
    (DRAFTHEAD_INVARIANT_PATH), on a Llama: the spine's logits, and speculative output at batch 3."""
    if path not in cpu_paths():
        pytest.skip(f"this CPU has no {path} path (it has {', '.join(cpu_paths())})")
    monkeypatch.setenv(ENV_PATH, path)
    together, alone = tree_and_steps("llama", row_invariant=True)
    assert torch.equal(together, alone)
    test_bf16_speculative_output_equals_plain_decoding_at_batch_1_and_3("llama")


def test_what_row_invariance_cannot_run_is_refused():
    sinks = tiny_causal_lm("gpt_oss", vocab=VOCAB, layers=2, hidden=32, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        speculative_generate(sinks, RootOnlyDrafter(), repetitive_prompt(VOCAB)[:, :8], GenerationConfig(max_new_tokens=2, row_invariant=True))
    model = tiny_causal_lm("llama", vocab=VOCAB, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="drop --static-cache / --compile"):
        target_backend(model, static_cache=True, row_invariant=True)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        with invariant_linears(tiny_causal_lm("llama", vocab=VOCAB, dtype=torch.float16)):
            pass


def test_row_invariance_is_the_default_in_bf16_where_the_cpu_has_native_bf16_kernels(monkeypatch):
    """Nobody choosing (GenerationConfig.row_invariant None): on for a bf16 target on a CPU with AMX
    or avx512_bf16, off for fp32, off where the engine cannot run it; a choice always wins."""
    monkeypatch.delenv(ENV_PATH, raising=False)
    native = cpu_paths()[0] in BF16_ONLY
    bf16 = tiny_causal_lm("llama", vocab=VOCAB, dtype=torch.bfloat16)
    assert target_backend(bf16, row_invariant=None).row_invariant == native
    assert GenerationConfig().row_invariant is None  # the Python API's default is the same rule
    assert not target_backend(bf16, row_invariant=False).row_invariant  # --no-row-invariant
    assert target_backend(tiny_causal_lm("llama", vocab=VOCAB), row_invariant=True).row_invariant  # fp32 on request
    assert not row_invariant_by_default(tiny_causal_lm("llama", vocab=VOCAB))  # fp32 keeps the fastest kernels
    assert not row_invariant_by_default(bf16, static_cache=True) and not row_invariant_by_default(bf16, compile="inductor")
    assert not row_invariant_by_default(tiny_causal_lm("gpt_oss", vocab=VOCAB, dtype=torch.bfloat16))  # attention sinks
    monkeypatch.setenv(ENV_PATH, "panel")  # only the fallback path: the fastest kernels stay the default
    assert not row_invariant_by_default(bf16)
    monkeypatch.delenv(ENV_PATH)
    monkeypatch.setattr(invariant, "physical_memory_bytes", lambda: 1 << 16)  # no room for the kernels' weight copy
    assert not row_invariant_by_default(bf16)


@pytest.mark.parametrize("flag", [[], ["--no-row-invariant"]], ids=["default", "no-row-invariant"])
def test_bench_settles_row_invariance_for_the_target_and_reports_it(tmp_path, capsys, tiny_llama_dir, flag):
    import json

    from drafthead import cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "say a a a again"}) + "\n")
    out = tmp_path / "report.json"
    argv = ["bench", "--target", str(tiny_llama_dir), "--dataset", str(prompts), "--dtype", "bfloat16", "--threads", "1"]
    argv += ["--proposer", "prompt-lookup", "--max-new-tokens", "6", "--no-progress", "--out", str(out), *flag]
    assert cli.main(argv) == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    expected = not flag and path_for(torch.bfloat16) in BF16_ONLY  # DRAFTHEAD_INVARIANT_PATH included
    assert report["settings"]["row_invariant"] is expected
    assert ("plain (ours, row-invariant)" in capsys.readouterr().out) == expected
    if expected:
        assert all(r["identical"] for r in report["prompts"])


def test_bench_with_row_invariance_compares_against_our_plain_decoding(tmp_path, capsys, tiny_llama_dir):
    """`bench --row-invariant` in bf16: the plain side is our engine through the same kernels,
    the report says so, and every output is identical to it, at batch 1 and 2."""
    import json

    from drafthead import cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {w} {w} {w} again"}) + "\n" for w in ("a", "bb", "ccc")))
    for extra in ([], ["--batch-size", "2"]):
        out = tmp_path / f"report{len(extra)}.json"
        argv = [
            "bench",
            "--target",
            str(tiny_llama_dir),
            "--dataset",
            str(prompts),
            "--dtype",
            "bfloat16",
            "--threads",
            "1",
            "--proposer",
            "prompt-lookup",
            "--max-new-tokens",
            "12",
            "--no-progress",
            "--row-invariant",
            "--out",
            str(out),
        ]
        assert cli.main(argv + extra) == 0, capsys.readouterr().err
        report = json.loads(out.read_text())
        assert report["settings"]["row_invariant"] is True
        assert "plain (ours, row-invariant)" in capsys.readouterr().out
        rows = report["prompts"] if not extra else report["prompts"]["speculative"]
        assert len(rows) == 3 and all(r["identical"] for r in rows), rows
