"""Benchmark: plain `generate()` against speculative generation on the same model, prompt by prompt.

For each prompt, in one process and interleaved (so drifts in machine load hit both sides alike):
plain `model.generate()`, then `speculative_generate` with a fresh drafter, then optionally HF's
own prompt lookup (`prompt_lookup_num_tokens`). Wall times include the prefill on every side.

Definitions (one home; report.py only renders them):
    tau                     total emitted tokens / total verification rounds, over all prompts
                            (the target's own token counted: tau >= 1; docs/acceptance.md)
    tokens_per_s            total new tokens / total wall seconds of the calls (each side)
    speedup                 tokens_per_s / baseline_tokens_per_s
    identical_fraction      share of prompts whose speculative tokens equal the plain tokens
    shared_speedup          the speedup over the text both sides emitted, the common prefix of each
                            prompt's two outputs (all of it where they are identical): plain's
                            seconds to its last shared token / ours (TokenClock), summed over
                            prompts. When outputs differ, `speedup` compares two different texts
                            (one may have run into easy repetition) and this one does not
    per_position_acceptance [d-1] = share of rounds whose accepted draft length is >= d
    tau_by_context          tau of the rounds whose context (prompt + tokens emitted before the round)
                            falls in each CONTEXT_BUCKETS bucket
    repetition              share of repeated n-grams (n=4) in outputs: docs/cpu-measurements.md asks for
                            it, since n-gram drafting thrives on repetitive text
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..kernels import panel_kernel
from ..kernels.machine import cpu_model
from ..engine.cost import sync_device
from ..engine.drafter import RootOnlyDrafter
from ...ground.target.load import context_limit
from ..engine.generate import GenerationConfig, PromptTooLong, speculative_generate
from ..engine.rounds import acceptance_histogram, per_position_acceptance, tau_by_context, tau_of
from .prompts import Prompt, encode_chat
from ..engine.sampling import SamplingConfig


@dataclass
class BenchSettings:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0  # sampling runs seed prompt i with seed + i on every side
    eos_token_ids: tuple[int, ...] = ()
    compare_hf_prompt_lookup: bool = False
    hf_prompt_lookup_num_tokens: int = 10  # docs/cpu-measurements.md: measured with 10
    profile: bool = False  # synchronise the device around engine phases so timings are exact
    warmup_tokens: int = 8  # a short generation on each side before timing; 0: none
    keep_text: bool = False  # put decoded outputs in the per-prompt records
    progress: bool = True  # tqdm bar over prompts (stderr)
    repetition_ngram: int = 4
    info: dict = field(default_factory=dict)  # recorded verbatim under report["settings"]
    sizing: str = "fixed"  # how each round is sized (inference/engine/sizing.py); a load policy learns over every prompt
    engine: dict = field(default_factory=dict)  # GenerationConfig's engine fields (static_cache, compile)
    # what verifies the trees when it is not the torch target (a LlamaCppTarget): then both sides
    # decode on it, plain being our engine with no drafting (the backend's own greedy decoding)
    verifier: object = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.repetition_ngram < 1:
            raise ValueError(f"repetition_ngram must be >= 1, got {self.repetition_ngram}")


# ---------------------------------------------------------------------------------------------
# Pure metrics
# ---------------------------------------------------------------------------------------------


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (a length difference counts at
    the shorter length); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


NEAR_TIE_GAP = 0.5  # logits; bf16 spacing is 0.125 at |logit| 16-32, and a forward adds a few roundings


def is_near_tie(divergence: dict) -> bool:
    """A greedy divergence is a near-tie when the speculative token's logit is within NEAR_TIE_GAP
    of the plain token's at that position (either may lead: the full forward that reads them
    rounds differently again; a three-way tie puts the speculative token third)."""
    return abs(divergence.get("gap", float("inf"))) <= NEAR_TIE_GAP


def speed_ceiling(tau: float, totals: dict, profile_seconds: dict) -> dict | None:
    """Where a run stands against its physical limit (docs/cpu-measurements.md), in plain-step units.

    A plain step costs plain_seconds / plain_new_tokens (prefill amortised in, as in the
    baseline's tokens/s). If drafting and bookkeeping were free, a round would cost one verify
    forward, so tau / verify_in_plain_steps is the ceiling; tau / round_in_plain_steps is what the
    measured round cost allows (it equals the measured speedup up to the prefill and timer reads).
    None without verify timings or without rounds."""
    rounds, verify = totals.get("rounds", 0), profile_seconds.get("verify")
    if not rounds or not verify or not totals.get("plain_new_tokens") or not totals.get("plain_seconds"):
        return None
    plain_step = totals["plain_seconds"] / totals["plain_new_tokens"]
    verify_steps = verify / rounds / plain_step
    round_steps = totals["seconds"] / rounds / plain_step
    return {
        "plain_step_seconds": plain_step,
        "verify_seconds_per_round": verify / rounds,
        "verify_in_plain_steps": verify_steps,
        "round_in_plain_steps": round_steps,
        "verify_only_ceiling": tau / verify_steps,
        "round_cost_speedup": tau / round_steps,
    }


def repeated_ngrams(tokens: Sequence[int], n: int = 4) -> tuple[int, int]:
    """(repeated, total) n-grams: an n-gram is repeated each time it occurs after its first time."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) - len(set(grams)), len(grams)


def repetition_fraction(outputs: Sequence[Sequence[int]], n: int = 4) -> float:
    """Share of repeated n-grams over all outputs (each output counted on its own)."""
    rep = total = 0
    for tokens in outputs:
        r, t = repeated_ngrams(tokens, n)
        rep, total = rep + r, total + t
    return rep / total if total else 0.0


# ---------------------------------------------------------------------------------------------
# Measurement helpers
# ---------------------------------------------------------------------------------------------


class PeakMemory:
    """Peak process RSS (MB) while the block runs; on CUDA also the peak allocated device memory.

    On Linux the kernel keeps the peak itself (VmHWM), reset on entry through /proc/self/clear_refs,
    so nothing runs beside the block: a sampling thread that woke every few ms slowed a 2-core
    decode by about 5% (docs/results.md 2026-12-04). Elsewhere a thread samples every `interval`
    seconds."""

    def __init__(self, device: torch.device, interval: float = 0.05):
        self.device = device
        self.interval = interval
        self.rss_mb = 0.0
        self.cuda_mb: float | None = None

    def __enter__(self) -> "PeakMemory":
        import psutil

        self._process = psutil.Process()
        self.rss_mb = self._process.memory_info().rss / 2**20
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._thread = None
        if not _reset_peak_rss():
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.rss_mb = max(self.rss_mb, self._process.memory_info().rss / 2**20)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.rss_mb = max(self.rss_mb, _peak_rss_mb())
        self.rss_mb = max(self.rss_mb, self._process.memory_info().rss / 2**20)
        if self.device.type == "cuda":
            self.cuda_mb = torch.cuda.max_memory_allocated(self.device) / 2**20


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux: `5` to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    """The kernel's peak RSS of this process since its last reset (VmHWM), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def hf_generation_config(sampling: SamplingConfig, max_new_tokens: int, eos_token_ids, pad_token_id, **extra):
    """The transformers GenerationConfig matching our sampling settings, every field explicit so
    the model's own generation_config defaults (e.g. a shipped temperature) cannot leak in."""
    from transformers import GenerationConfig as HFGenerationConfig

    kwargs = dict(
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        do_sample=not sampling.greedy,
        repetition_penalty=sampling.repetition_penalty,
        eos_token_id=list(eos_token_ids) or None,
        pad_token_id=pad_token_id,
        use_cache=True,
    )
    if sampling.greedy:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    kwargs.update(extra)
    return HFGenerationConfig(**kwargs)


class TokenClock:
    """A transformers-style streamer that notes when each new token arrived: the first `put` is
    the prompt, each later one new tokens (one by one from generate(), a round's at once from
    ours). `seconds_to(k)`: seconds from `start` to the arrival of the k-th new token."""

    def __init__(self) -> None:
        self.start, self.prompt_seen = 0.0, False
        self.arrivals: list[tuple[int, float]] = []  # (tokens so far, time)

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        count = (self.arrivals[-1][0] if self.arrivals else 0) + int(value.numel())
        self.arrivals.append((count, time.perf_counter()))

    def end(self) -> None:
        pass

    def seconds_to(self, k: int) -> float:
        if k <= 0:
            return 0.0
        for count, at in self.arrivals:
            if count >= k:
                return at - self.start
        return self.arrivals[-1][1] - self.start if self.arrivals else 0.0


def _hf_generate(model, input_ids, config, seed: int | None, memory: PeakMemory, clock: TokenClock | None = None):
    """Run model.generate; returns (new tokens list, wall seconds)."""
    if seed is not None:
        torch.manual_seed(seed)
    attention_mask = torch.ones_like(input_ids)
    sync_device(input_ids.device)
    with memory:
        start = time.perf_counter()
        if clock is not None:
            clock.start = start
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config, streamer=clock)
        sync_device(input_ids.device)
        seconds = time.perf_counter() - start
    return out[0, input_ids.shape[1] :].tolist(), seconds


@torch.inference_mode()
def divergence_detail(target, tokenizer, prompt_ids, plain_tokens, spec_tokens, position: int) -> dict:
    """Where plain and speculative greedy output part: the target's logits for the token at
    `position` after the shared prefix (one full forward in the target's dtype), the two tokens,
    the plain token's lead over the speculative one, and the speculative token's rank."""
    detail = {"position": position, "context": tokenizer.decode(plain_tokens[max(0, position - 12) : position])}
    if position >= min(len(plain_tokens), len(spec_tokens)):
        return dict(detail, reason="length")  # one side stopped (EOS or a stop string) earlier
    prefix = torch.tensor([plain_tokens[:position]], device=prompt_ids.device, dtype=prompt_ids.dtype)
    logits = target(input_ids=torch.cat([prompt_ids, prefix], dim=1), logits_to_keep=1).logits[0, -1].float()
    a, b = plain_tokens[position], spec_tokens[position]
    return dict(
        detail,
        plain_token=tokenizer.decode([a]),
        speculative_token=tokenizer.decode([b]),
        plain_logit=float(logits[a]),
        speculative_logit=float(logits[b]),
        gap=float(logits[a] - logits[b]),
        speculative_rank=int((logits > logits[b]).sum()),
    )


def _spec_generate(model, drafter, input_ids, config, tokenizer, memory: PeakMemory, clock: TokenClock | None = None):
    sync_device(input_ids.device)
    with memory:
        start = time.perf_counter()
        if clock is not None:
            clock.start = start
        result = speculative_generate(model, drafter, input_ids, config, tokenizer=tokenizer, streamer=clock)
        sync_device(input_ids.device)
        seconds = time.perf_counter() - start
    return result, seconds


# ---------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------


def run_bench(
    target,
    tokenizer,
    drafter_factory: Callable[[], object],
    prompts: Sequence[Prompt],
    settings: BenchSettings,
) -> dict:
    """Benchmark `drafter_factory()` drafters on `target` over `prompts`; returns the report dict
    (JSON-ready; see the module docstring for the definitions)."""
    if not prompts:
        raise ValueError("no prompts to benchmark")
    device = next(target.parameters()).device
    encoded = [encode_chat(tokenizer, p).to(device) for p in prompts]
    ctx = context_limit(target.config)
    for prompt, ids in zip(prompts, encoded):
        if ctx is not None and ids.shape[1] >= ctx:
            raise PromptTooLong(f"prompt {prompt.id!r} has {ids.shape[1]} tokens: no room left in a context of {ctx}")
    eos = tuple(settings.eos_token_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)

    def new_token_limit(ids) -> int:
        # Both sides stop at the context limit: give HF the same limit the engine would reach.
        return settings.max_new_tokens if ctx is None else min(settings.max_new_tokens, ctx - ids.shape[1])

    sampled = not settings.sampling.greedy
    if settings.warmup_tokens > 0:  # first calls pay for allocations and lazy inits
        ids = encoded[0]
        n = min(settings.warmup_tokens, new_token_limit(ids))
        _bench_prompt(target, tokenizer, drafter_factory, ids, n, settings.seed, settings, eos, pad, _MemoryPeaks(device))

    from tqdm.auto import tqdm

    records = []
    peaks = _MemoryPeaks(device)
    bar = tqdm(list(zip(prompts, encoded)), desc="bench", unit="prompt", disable=not settings.progress)
    for i, (prompt, ids) in enumerate(bar):
        record = _bench_prompt(
            target, tokenizer, drafter_factory, ids, new_token_limit(ids), settings.seed + i if sampled else None, settings, eos, pad, peaks
        )
        records.append({"id": prompt.id, "category": prompt.category, **record})
        running = summarize(records, settings)
        bar.set_postfix(tau=f"{running['tau']:.2f}", speedup=f"{running['speedup']:.2f}x")
    bar.close()

    report = summarize(records, settings)
    report.update(peaks.report())
    report["settings"] = _settings_record(target, settings, len(prompts))
    for record in records:
        del record["_tokens"]
    report["prompts"] = records
    return report


class _MemoryPeaks:
    """The highest memory seen while plain and speculative calls ran (process RSS; CUDA too)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: defaultdict[str, float] = defaultdict(float)

    def add(self, plain: PeakMemory, speculative: PeakMemory) -> None:
        self.peak["plain"] = max(self.peak["plain"], plain.rss_mb)
        self.peak["speculative"] = max(self.peak["speculative"], speculative.rss_mb)
        if self.device.type == "cuda":
            assert plain.cuda_mb is not None and speculative.cuda_mb is not None  # measured on CUDA (PeakMemory.__exit__)
            self.peak["plain_cuda"] = max(self.peak["plain_cuda"], plain.cuda_mb)
            self.peak["speculative_cuda"] = max(self.peak["speculative_cuda"], speculative.cuda_mb)

    def report(self) -> dict:
        """{"peak_rss_mb": {plain, speculative, ratio}} and, on CUDA, "peak_cuda_mb" alike."""
        kinds = [("peak_rss_mb", "")] + ([("peak_cuda_mb", "_cuda")] if self.device.type == "cuda" else [])
        out = {}
        for key, suffix in kinds:
            plain, spec = self.peak["plain" + suffix], self.peak["speculative" + suffix]
            out[key] = {"plain": round(plain, 1), "speculative": round(spec, 1), "ratio": spec / plain if plain else None}
        return out


def _bench_prompt(
    target,
    tokenizer,
    drafter_factory,
    ids: torch.Tensor,
    n: int,
    seed: int | None,
    settings: BenchSettings,
    eos: tuple,
    pad: int,
    peaks: _MemoryPeaks,
) -> dict:
    """One prompt, `n` new tokens: plain `generate()`, ours with a fresh drafter and (optionally)
    transformers' prompt lookup, in that order; its record (with `_tokens` for the summary)."""
    device = ids.device
    mem_plain, mem_spec, mem_hf = PeakMemory(device), PeakMemory(device), PeakMemory(device)
    config = GenerationConfig(
        max_new_tokens=n,
        sampling=settings.sampling,
        eos_token_ids=eos,
        seed=seed,
        profile=settings.profile,
        sizing=settings.sizing,
        **settings.engine,
    )
    verifier = settings.verifier
    plain_clock, spec_clock = TokenClock(), TokenClock()
    if verifier is None and not settings.engine.get("row_invariant"):
        plain_tokens, plain_s = _hf_generate(target, ids, hf_generation_config(settings.sampling, n, eos, pad), seed, mem_plain, plain_clock)
    else:  # plain decoding through the same kernels: the reference a row-invariant or llama.cpp run matches
        plain_config = GenerationConfig(max_new_tokens=n, sampling=settings.sampling, eos_token_ids=eos, seed=seed, **settings.engine)
        plain, plain_s = _spec_generate(verifier or target, RootOnlyDrafter(), ids, plain_config, tokenizer, mem_plain, plain_clock)
        plain_tokens = plain.new_tokens[0].tolist()
    result, spec_s = _spec_generate(verifier or target, drafter_factory(), ids, config, tokenizer, mem_spec, spec_clock)
    spec_tokens = result.new_tokens[0].tolist()
    diff = first_difference(spec_tokens, plain_tokens)
    shared = len(plain_tokens) if diff is None else diff  # tokens both sides emitted alike
    record = {
        "prompt_tokens": ids.shape[1],
        "plain_new_tokens": len(plain_tokens),
        "new_tokens": len(spec_tokens),
        "plain_seconds": plain_s,
        "seconds": spec_s,
        "plain_tokens_per_s": len(plain_tokens) / plain_s,
        "tokens_per_s": len(spec_tokens) / spec_s,
        "tau": result.tau,
        "rounds": result.num_rounds,
        "identical": diff is None,
        "first_difference": diff,
        "shared_tokens": shared,
        "plain_seconds_shared": plain_clock.seconds_to(shared),
        "seconds_shared": spec_clock.seconds_to(shared),
        # (the torch target's logits: a llama.cpp verifier's own are not at hand)
        "divergence": None if diff is None or verifier is not None else divergence_detail(target, tokenizer, ids, plain_tokens, spec_tokens, diff),
        "finish_reason": result.finish_reason,
        "accepted_lengths": list(result.accepted_lengths),
        "drafted": list(result.drafted),
        "timings": dict(result.timings, prefill=result.prefill_seconds),
        "plain_repetition": repetition_fraction([plain_tokens], settings.repetition_ngram),
        "repetition": repetition_fraction([spec_tokens], settings.repetition_ngram),
    }
    peaks.add(mem_plain, mem_spec)
    if settings.compare_hf_prompt_lookup:
        lookup = hf_generation_config(settings.sampling, n, eos, pad, prompt_lookup_num_tokens=settings.hf_prompt_lookup_num_tokens)
        hf_tokens, hf_s = _hf_generate(target, ids, lookup, seed, mem_hf)
        record.update(
            hf_prompt_lookup_new_tokens=len(hf_tokens),
            hf_prompt_lookup_seconds=hf_s,
            hf_prompt_lookup_tokens_per_s=len(hf_tokens) / hf_s,
            hf_prompt_lookup_identical=hf_tokens == plain_tokens,
        )
    if settings.keep_text:
        record["output"] = tokenizer.decode(spec_tokens, skip_special_tokens=True)
        record["plain_output"] = tokenizer.decode(plain_tokens, skip_special_tokens=True)
    record["_tokens"] = (plain_tokens, spec_tokens)
    return record


def shared_speedup(records: list[dict]) -> float:
    """The speedup over the text both sides emitted (module docstring); 0.0 when none was shared."""
    ours = sum(r["seconds_shared"] for r in records)
    return sum(r["plain_seconds_shared"] for r in records) / ours if ours else 0.0


def summarize(records: list[dict], settings: BenchSettings) -> dict:
    """Aggregate per-prompt records (with their `_tokens`) into the report's headline numbers."""
    accepted = [a for r in records for a in r["accepted_lengths"]]
    plain_tokens = sum(r["plain_new_tokens"] for r in records)
    spec_tokens = sum(r["new_tokens"] for r in records)
    plain_s = sum(r["plain_seconds"] for r in records)
    spec_s = sum(r["seconds"] for r in records)
    baseline = plain_tokens / plain_s if plain_s else 0.0
    ours = spec_tokens / spec_s if spec_s else 0.0
    by_category: dict[str, list[int]] = defaultdict(list)
    for r in records:
        by_category[r["category"]].extend(r["accepted_lengths"])
    timings: dict[str, float] = defaultdict(float)
    for r in records:
        for key, value in r["timings"].items():
            timings[key] += value
    total_timed = sum(timings.values())
    n = settings.repetition_ngram
    report: dict[str, Any] = {
        "num_prompts": len(records),
        "tau": tau_of(accepted),
        "tokens_per_s": ours,
        "baseline_tokens_per_s": baseline,
        "speedup": ours / baseline if baseline else 0.0,
        "identical_fraction": sum(r["identical"] for r in records) / len(records) if records else 0.0,
        "shared_speedup": shared_speedup(records),
        "per_position_acceptance": per_position_acceptance(accepted),
        "acceptance_length_histogram": acceptance_histogram(accepted),
        "per_category_tau": {c: tau_of(a) for c, a in sorted(by_category.items())},
        "tau_by_context": tau_by_context([(r["prompt_tokens"], r["accepted_lengths"]) for r in records]),
        "repetition": {
            "ngram": n,
            "plain": repetition_fraction([r["_tokens"][0] for r in records], n),
            "speculative": repetition_fraction([r["_tokens"][1] for r in records], n),
        },
        "profile": {
            "seconds": dict(timings),
            "fractions": {k: v / total_timed for k, v in timings.items()} if total_timed else {},
        },
        "totals": {
            "plain_new_tokens": plain_tokens,
            "new_tokens": spec_tokens,
            "rounds": len(accepted),
            "plain_seconds": plain_s,
            "seconds": spec_s,
        },
    }
    report["ceiling"] = speed_ceiling(report["tau"], report["totals"], report["profile"]["seconds"])
    divergences = [r["divergence"] for r in records if r.get("divergence")]
    near = [d for d in divergences if is_near_tie(d)]
    report["divergences"] = {
        "count": len(divergences),
        "near_ties": len(near),
        "near_tie_gap": NEAR_TIE_GAP,
        "example": (near or divergences or [None])[0],
    }
    if records and "hf_prompt_lookup_seconds" in records[0]:
        hf_tokens = sum(r["hf_prompt_lookup_new_tokens"] for r in records)
        hf_s = sum(r["hf_prompt_lookup_seconds"] for r in records)
        report["hf_prompt_lookup_tokens_per_s"] = hf_tokens / hf_s if hf_s else 0.0
        report["hf_prompt_lookup_speedup"] = report["hf_prompt_lookup_tokens_per_s"] / baseline if baseline else 0.0
        report["hf_prompt_lookup_identical_fraction"] = sum(r["hf_prompt_lookup_identical"] for r in records) / len(records)
    return report


def _settings_record(target, settings: BenchSettings, num_prompts: int) -> dict:
    import transformers

    param = next(target.parameters())
    record = {
        "max_new_tokens": settings.max_new_tokens,
        "sampling": asdict(settings.sampling),
        "seed": settings.seed,
        "eos_token_ids": list(settings.eos_token_ids),
        "compare_hf_prompt_lookup": settings.compare_hf_prompt_lookup,
        "hf_prompt_lookup_num_tokens": settings.hf_prompt_lookup_num_tokens,
        "warmup_tokens": settings.warmup_tokens,
        "num_prompts": num_prompts,
        "model_dtype": str(param.dtype).removeprefix("torch."),
        "device": str(param.device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        # our CPU kernel for the target's linears (inference/kernels/panel_kernel.py), or why it is off
        "panel_kernel": "available" if panel_kernel.enabled() else panel_kernel.why_unavailable(),
        # plain is then our engine through the same kernels (inference/engine/invariant.py)
        "row_invariant": bool(settings.engine.get("row_invariant")),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if param.device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(param.device)
    record.update(settings.info)
    return record
