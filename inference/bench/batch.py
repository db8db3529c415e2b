"""Benchmark at batch B: plain batched `generate()` against our batched speculative decoding.

Prompts are taken B at a time in order, left-padded with an attention mask (as a serving batch
would be), and each group runs, interleaved: transformers `generate()` on the batch, then
`speculative_generate` on the same batch, then optionally our engine with no drafting (the same
forward, cache and acceptance code; its gap to `generate()` is the engine's own speed, separate
from what speculation adds). Wall times include the prefill on every side.

    tokens_per_s        all rows' new tokens / the batch calls' wall seconds (each side)
    tau                 all rows' emitted tokens / all rows' verification rounds
    per_row_tau         each prompt's own tau
    identical_fraction  share of rows whose tokens equal that prompt's own plain `generate()` at batch 1
                        (untimed; the exactness reference: batched `generate()` is not it, since
                        padding and batch shapes round differently and flip near-ties)
    identical_to_batched_plain_fraction   the same against the row of the batched `generate()` run
    peak_rss_mb         peak process RSS during each side's calls
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from .run import BenchSettings, PeakMemory, _settings_record, hf_generation_config
from ..engine.cost import sync_device
from ..engine.drafter import RootOnlyDrafter
from ..engine.generate import GenerationConfig, generate_batch
from ..engine.sizing import load_policy
from .prompts import Prompt, encode_chat
from .report import plain_label


def left_pad(prompts: Sequence[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and attention mask for prompts [1, P_b], shorter ones padded on the left."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long, device=prompts[0].device)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[1] :] = p[0]
        mask[b, width - p.shape[1] :] = 1
    return ids, mask


def until_eos(tokens: list[int], eos: Sequence[int]) -> list[int]:
    """A row of batched generate() output up to its first EOS (kept); the rest is padding."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _timed(fn, device, memory: PeakMemory):
    sync_device(device)
    with memory:
        start = time.perf_counter()
        out = fn()
        sync_device(device)
        seconds = time.perf_counter() - start
    return out, seconds


def run_batch_bench(
    target,
    tokenizer,
    methods: dict[str, tuple[Callable[[], object], str]],
    prompts: Sequence[Prompt],
    settings: BenchSettings,
    batch_size: int,
    engine_plain: bool = True,
    check_identity: bool = True,
) -> dict:
    """The report dict at `batch_size` (module docstring) for each method name -> (drafter
    factory, sizing: inference/engine/sizing.py). A load policy's estimates carry over from batch
    to batch."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if not prompts:
        raise ValueError("no prompts to benchmark")
    device = next(target.parameters()).device
    encoded = [encode_chat(tokenizer, p).to(device) for p in prompts]
    eos = tuple(settings.eos_token_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    verifier = settings.verifier  # a llama.cpp backend: plain is then our engine on it, not generate()
    # row-invariant decoding: plain is our engine through the same kernels, the reference it matches
    ours_plain = verifier is not None or bool(settings.engine.get("row_invariant"))
    engine_plain = engine_plain and not ours_plain

    def ours(ids, mask, drafter, n, seed, sizing):
        config = GenerationConfig(max_new_tokens=n, sampling=settings.sampling, eos_token_ids=eos, seed=seed, sizing=sizing, **settings.engine)
        prompts_b = [row[m.bool()] for row, m in zip(ids, mask)]
        with torch.inference_mode():
            return generate_batch(verifier or target, drafter, prompts_b, config, tokenizer=tokenizer)

    def plain(ids, mask, n, seed):
        if ours_plain:
            return [r.new_tokens[0].tolist() for r in ours(ids, mask, RootOnlyDrafter(), n, seed, "fixed").rows]
        if seed is not None:
            torch.manual_seed(seed)
        config = hf_generation_config(settings.sampling, n, eos, pad)
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=mask, generation_config=config)
        return [until_eos(row, eos) for row in out[:, ids.shape[1] :].tolist()]

    groups = [encoded[i : i + batch_size] for i in range(0, len(encoded), batch_size)]
    if settings.warmup_tokens > 0:
        ids, mask = left_pad(groups[0], pad)
        plain(ids, mask, settings.warmup_tokens, settings.seed)
        if engine_plain:  # a compiled engine (--compile) builds its one-token graph here
            ours(ids, mask, RootOnlyDrafter(), settings.warmup_tokens, settings.seed, "fixed")
        for factory, sizing in methods.values():  # a policy's cold start (its first probe) falls here,
            ours(ids, mask, factory(), settings.warmup_tokens, settings.seed, sizing)  # as in a server already serving

    from tqdm.auto import tqdm

    sampled = not settings.sampling.greedy
    sides = {"plain": [0, 0.0], "engine_plain": [0, 0.0], **{name: [0, 0.0] for name in methods}}  # tokens, seconds
    peak = {k: 0.0 for k in sides}
    records: dict[str, list] = {name: [] for name in methods}
    forwards = {name: 0 for name in methods}
    for g, group in enumerate(tqdm(groups, desc=f"bench (batch {batch_size})", unit="batch", disable=not settings.progress)):
        ids, mask = left_pad(group, pad)
        seed = settings.seed + g if sampled else None
        n = settings.max_new_tokens
        memories = {k: PeakMemory(device) for k in sides}
        plain_rows, seconds = _timed(lambda: plain(ids, mask, n, seed), device, memories["plain"])
        sides["plain"][0] += sum(len(r) for r in plain_rows)
        sides["plain"][1] += seconds
        if engine_plain:
            base, seconds = _timed(lambda: ours(ids, mask, RootOnlyDrafter(), n, seed, "fixed"), device, memories["engine_plain"])
            sides["engine_plain"][0] += base.num_new_tokens
            sides["engine_plain"][1] += seconds
        alone = [plain(p, torch.ones_like(p), n, seed)[0] for p in group] if check_identity else [None] * len(group)
        for name, (factory, sizing) in methods.items():
            spec, seconds = _timed(lambda: ours(ids, mask, factory(), n, seed, sizing), device, memories[name])
            forwards[name] += spec.num_forwards
            sides[name][0] += spec.num_new_tokens
            sides[name][1] += seconds
            for b, (row, ref) in enumerate(zip(spec.rows, plain_rows)):
                tokens = row.new_tokens[0].tolist()
                records[name].append(
                    {
                        "prompt_tokens": group[b].shape[1],
                        "new_tokens": len(tokens),
                        "plain_new_tokens": len(ref),
                        "tau": row.tau,
                        "rounds": row.num_rounds,
                        "identical": None if alone[b] is None else tokens == alone[b],
                        "identical_to_batched_plain": tokens == ref,
                        "finish_reason": row.finish_reason,
                        "accepted_lengths": row.accepted_lengths,
                    }
                )
        for k, m in memories.items():
            peak[k] = max(peak[k], m.rss_mb)
    rate = {k: (t / s if s else 0.0) for k, (t, s) in sides.items()}
    return {
        "batch_size": batch_size,
        "num_prompts": len(encoded),
        "baseline_tokens_per_s": rate["plain"],
        "engine_plain_tokens_per_s": rate["engine_plain"] if engine_plain else None,
        "methods": {
            name: _method_summary(records[name], rate[name], rate["plain"], forwards[name], _policy(verifier or target, m, settings))
            for name, m in methods.items()
        },
        "peak_rss_mb": {k: round(v, 1) for k, v in peak.items() if v},
        "settings": _settings_record(target, settings, len(prompts)),
        "prompts": records,
    }


def _policy(verifier, method: tuple[Callable[[], object], str], settings: BenchSettings):
    """The load policy a method's rounds ran under (the engine keeps one per verifier and drafter
    class: inference/engine/sizing.py), for its report; None under the other rules."""
    factory, sizing = method
    return load_policy(verifier, factory(), bool(settings.engine.get("row_invariant"))) if sizing == "policy" else None


def _method_summary(records: list[dict], rate: float, baseline: float, forwards: int, policy) -> dict:
    accepted = [a for r in records for a in r["accepted_lengths"]]
    checked = [r["identical"] for r in records if r["identical"] is not None]
    return {
        "tokens_per_s": rate,
        "speedup": rate / baseline if baseline else 0.0,
        "tau": sum(accepted) / len(accepted) if accepted else 0.0,
        "per_row_tau": [r["tau"] for r in records],
        "identical_fraction": sum(checked) / len(checked) if checked else None,
        "identical_to_batched_plain_fraction": sum(r["identical_to_batched_plain"] for r in records) / len(records),
        "num_forwards": forwards,
        "policy": None
        if policy is None
        else {
            "mean_nodes": sum(policy.decisions) / max(1, len(policy.decisions)),
            "plain_rounds": sum(1 for d in policy.decisions if d == 1) / max(1, len(policy.decisions)),
        },
    }


def format_batch_table(report: dict) -> str:
    """Terminal summary of a batch report."""
    plain = plain_label(report["settings"])
    lines = [f"batch {report['batch_size']}, {report['num_prompts']} prompts:", f"  {plain:<20} {report['baseline_tokens_per_s']:8.1f} tokens/s"]
    if report.get("engine_plain_tokens_per_s"):
        lines.append(f"  ours, no drafting    {report['engine_plain_tokens_per_s']:8.1f} tokens/s")
    for name, m in report["methods"].items():
        same = m["identical_fraction"]
        lines.append(
            f"  ours, {name:<14} {m['tokens_per_s']:8.1f} tokens/s  ({m['speedup']:.2f}x), tau {m['tau']:.2f}, "
            f"identical to batch-1 plain: {'-' if same is None else f'{100 * same:.0f}%'}, "
            f"to batched plain: {100 * m['identical_to_batched_plain_fraction']:.0f}%"
        )
        if m["policy"]:
            p = m["policy"]
            lines.append(f"    policy: {p['mean_nodes']:.1f} nodes a row per round on average, plain in {100 * p['plain_rounds']:.0f}% of rounds")
    lines.append("  peak RSS: " + ", ".join(f"{k} {v:.0f} MB" for k, v in report["peak_rss_mb"].items()))
    return "\n".join(lines)
