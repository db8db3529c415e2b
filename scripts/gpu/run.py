"""The GPU run's phases (scripts/gpu/run.sh; docs/testing.md "The GPU run"), on the bundle
`scripts/gpu/stage.py --run` staged, in one process, each phase within its share of the budget:

 1. target      the built-in target dequantized from the bundle's GGUF; its weights' digest is
                compared with the staging machine's (the same target, to the bit, or flagged)
 2. regenerate  the target answers the bundle's conversations greedily, turn by turn, `rows`
                prompts at a time through one recorded decode step a turn
                (inference/engine/greedy_graph.py), until the answered conversations hold
                `regen_tokens` tokens (10x the shipped head's 671k) or `regen_s` pass
 3. train       an EAGLE-3 head on them, features online, shaped as the shipped head (draft vocab
                8,192, 3 training-time-test steps): a pilot prices a step, then as many steps as
                fit `train_s` (`drafthead train`)
 4. bring back  the head in bf16 with the shipped head's drafting settings, as a tar in parts of at
                most 15 MiB in $OUT/head (scripts/gpu/parts.py) for scripts/gpu/check_head.py
 5. bench       in fp32 on MT-bench prompts: transformers' generate(), our plain decoding and ours
                with the new head as a chain of 3, the last two on recorded steps
                (compile="graphs", GraphedChainDrafter): tokens/s and whether the outputs agree

    python3 scripts/gpu/run.py --bundle .gpu-run/bundle --work /tmp/drafthead-gpu-run --out $OUT

A phase that fails is recorded in the summary and the run goes on with what does not need it
(the bench on the shipped head when no new head came). Prints one JSON summary line and writes
`summary.json` to --out; exits 1 if a phase failed. `--budget dry`: the same phases
on the CPU at a size that runs in seconds (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import lzma
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parts import send  # noqa: E402  (a sibling script)

SHIPPED_TOKENS = 671_000  # the shipped head's training data (heads/pretrained/README.md)
HEAD_PART_BYTES = 15 * 2**20  # a file the device tool brings back holds at most 16 MiB


@dataclass(frozen=True)
class Budget:
    """How large each phase runs (BUDGETS)."""

    rows: int  # prompts answered together
    max_new_tokens: int  # answer length cap
    max_prompt_tokens: int  # a later turn's prompt (the conversation so far) longer than this is not answered
    regen_tokens: int  # stop answering once the data holds this many tokens (prompts + answers)
    regen_s: float  # ... or after this long
    train_s: float  # training time after the pilot, at most
    deadline_s: float  # the whole run's: training stops in time for the phases after it
    tail_s: float  # what those take: the run's start and end, the export, the bench
    pilot_steps: int  # 0: train exactly `steps`
    steps: int  # the training steps when there is no pilot
    batch_size: int
    max_length: int  # packed training rows of this many tokens
    eval_size: int  # held-out conversations
    num_proc: int | None  # processes for the training data's chat-template map (None: this one)
    warmup_steps: int
    bench_prompts: int
    bench_new_tokens: int
    device: str


BUDGETS = {
    # an H100 or H200 in about 9 minutes, sized from estimates, not yet measured: answers at
    # ~100k tokens/s through the recorded step (a step reads the whole static cache's K/V: 16 GB
    # at 1,024 rows x 704 slots for first turns, 31 GB at 1,344 for later ones, a few ms on HBM3),
    # training at 20k to 40k tokens/s (docs/results.md 2026-12-04 measured 19,372 with 7
    # training-time-test steps at batch 8; these rows take 3, and a batch twice as large)
    "gpu": Budget(
        rows=1024,
        max_new_tokens=320,
        max_prompt_tokens=1024,
        regen_tokens=10 * SHIPPED_TOKENS + 100_000,
        regen_s=90,
        train_s=270,
        deadline_s=500,  # the call's 600 s, less the install and the check of the recorded steps before it
        tail_s=150,
        pilot_steps=8,
        steps=0,
        batch_size=16,
        max_length=2048,
        eval_size=64,
        num_proc=8,
        warmup_steps=20,
        bench_prompts=6,
        bench_new_tokens=128,
        device="cuda",
    ),
    "dry": Budget(
        rows=4,
        max_new_tokens=8,
        max_prompt_tokens=1024,
        regen_tokens=10**9,
        regen_s=120,
        train_s=0,
        deadline_s=600,
        tail_s=0,
        pilot_steps=0,
        steps=2,
        batch_size=2,
        max_length=128,
        eval_size=2,
        num_proc=None,
        warmup_steps=1,
        bench_prompts=1,
        bench_new_tokens=8,
        device="cpu",
    ),
}


def say(message: str) -> None:
    print(f"[gpu-run {time.strftime('%H:%M:%S')}] {message}", flush=True)


def install_target(bundle: Path) -> dict:
    """Phase 1: the bundle's GGUF dequantized into the cache as the built-in target; the weights'
    digest compared with the staging machine's."""
    from drafthead.ground.target.load import install_builtin, weights_digest

    expected = json.loads((bundle / "target.json").read_text())
    folder = install_builtin(expected["name"], bundle / "target.gguf")
    digest = weights_digest(folder)
    same = digest == expected["weights_sha256"]
    if not same:  # the run goes on (a head for nearly the same target is still worth its minutes), flagged
        say(f"the target's weights here are NOT the staging machine's: digest {digest[:12]}, staged {expected['weights_sha256'][:12]}")
    return {"name": expected["name"], "weights_sha256": digest, "same_weights_as_staged": same}


def regenerate(name: str, bundle: Path, out: Path, budget: Budget) -> dict:
    """Phase 2: the target's answers to the bundle's conversations, turn by turn (turn k's prompt
    holds its own answers to the turns before), as training records in the form `drafthead data
    regenerate` writes (each answer's own token ids on its message). Turn k of every conversation
    is answered before turn k + 1 of any, through one GreedyDecoder a turn."""
    import torch

    from drafthead.ground.target.chat import render_chat
    from drafthead.inference.engine.graphs import EAGER, GRAPH
    from drafthead.inference.engine.greedy_graph import GreedyDecoder
    from drafthead.ground.target.load import load_target
    from drafthead.train.data.chat_format import decode_answer, stop_token_ids
    from drafthead.train.regeneration.regenerate import strip_stop

    start = time.perf_counter()
    dtype = "bfloat16" if budget.device == "cuda" else "float32"
    loaded = load_target(name, dtype=dtype, device=budget.device)
    tokenizer = loaded.tokenizer
    stops = stop_token_ids(tokenizer)
    with lzma.open(bundle / "conversations.jsonl.xz", "rt", encoding="utf-8") as f:
        conversations = [json.loads(line) for line in f]
    history: list[list[dict]] = [[] for _ in conversations]  # messages answered so far
    length = [0] * len(conversations)  # tokens of each conversation so far
    answered = cut = 0
    failed, mode = None, GRAPH if budget.device == "cuda" else EAGER

    def over() -> bool:
        return sum(length) >= budget.regen_tokens or time.perf_counter() - start > budget.regen_s

    with torch.inference_mode():
        for k in range(max(len(c["turns"]) for c in conversations)):
            # turn k of the conversations that have one and whose turns before it were answered,
            # rendered as encode_chat renders a prompt and tokenized in one call (the tokenizer's
            # own threads, not a call per prompt: 13,590 of them in the first turn)
            ready = [c for c, conversation in enumerate(conversations) if len(conversation["turns"]) > k and len(history[c]) == 2 * k]
            texts = [
                render_chat(tokenizer, history[c] + [{"role": "user", "content": conversations[c]["turns"][k]}], add_generation_prompt=True)
                for c in ready
            ]
            encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
            todo = [(c, torch.tensor(ids, device=budget.device)) for c, ids in zip(ready, encoded) if len(ids) <= budget.max_prompt_tokens]
            if not todo or over():
                break
            slots = max(len(ids) for _, ids in todo) + budget.max_new_tokens
            decoder = GreedyDecoder(loaded.model, budget.rows, slots, mode=mode)
            for b0 in range(0, len(todo), budget.rows):
                batch = todo[b0 : b0 + budget.rows]
                prompts = [ids for _, ids in batch]
                try:
                    answers = decoder.run(prompts, budget.max_new_tokens, stops)
                except RuntimeError as e:  # a step this GPU would not record: carry on without graphs
                    if decoder.mode != GRAPH:
                        raise
                    failed, mode = " ".join(str(e).split())[:300], EAGER
                    say(f"recording the decode step failed, answering eagerly: {failed}")
                    decoder = GreedyDecoder(loaded.model, budget.rows, slots, mode=mode)
                    answers = decoder.run(prompts, budget.max_new_tokens, stops)
                for (c, ids), new in zip(batch, answers):
                    own = strip_stop(new, stops)
                    if not own:  # an empty answer ends its conversation
                        continue
                    history[c] += [
                        {"role": "user", "content": conversations[c]["turns"][k]},
                        {"role": "assistant", "content": decode_answer(tokenizer, own), "token_ids": own},
                    ]
                    length[c] = len(ids) + len(new)
                    answered += 1
                    cut += len(own) == len(new)
                if over():
                    break
            del decoder
    with open(out, "w", encoding="utf-8") as f:
        for conversation, messages in zip(conversations, history):
            if messages:
                f.write(json.dumps({"id": conversation["id"], "messages": messages}, ensure_ascii=False) + "\n")
    seconds, tokens = time.perf_counter() - start, sum(length)
    del loaded
    if budget.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "conversations": sum(1 for m in history if m),
        "turns_answered": answered,
        "answers_cut": cut,
        "tokens": tokens,
        "tokens_x_shipped": round(tokens / SHIPPED_TOKENS, 2),
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds),
        "mode": mode,
        "capture_failed": failed,
    }


def train_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == "train"]


def drafthead(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "drafthead", *args], check=True)


def train(name: str, data: Path, work: Path, budget: Budget, left_s) -> dict:
    """Phase 3: `drafthead train`, a pilot first when the budget has one, then as many steps as
    fit train_s and the time `left_s()` says is left before the phases after it. Tokens trained:
    the sum over log windows of tokens/s x seconds."""
    common = [
        "--config",
        "eagle3",
        f"target={name}",
        "target_dtype=auto",
        "features.mode=online",
        "data.source=json",
        f"data.path={data}",
        "data.limit=null",
        f"data.max_length={budget.max_length}",
        f"data.eval_size={budget.eval_size}",
        f"data.num_proc={'null' if budget.num_proc is None else budget.num_proc}",
        f"batch_size={budget.batch_size}",
        "grad_accum=1",
        "head.ttt_steps=3",
        "lr=1e-3",
        "epochs=null",
        "replay.sequences=0",
        "keep_best=none",
        "checkpoint_every=0",
        "eval_batches=4",
        "log_every=1",
        "report_to=none",
    ]
    start = time.perf_counter()
    steps = budget.steps
    if budget.pilot_steps:
        drafthead("train", *common, f"max_steps={budget.pilot_steps}", "warmup_steps=1", "eval_every=0", f"output_dir={work / 'pilot'}")
        s_step = train_rows(work / "pilot")[-1]["s_step"]
        steps = max(budget.pilot_steps, int(min(budget.train_s, left_s() - budget.tail_s) / s_step))
    run = work / "run"
    drafthead("train", *common, f"max_steps={steps}", f"warmup_steps={min(budget.warmup_steps, steps)}", f"eval_every={steps}", f"output_dir={run}")
    rows, last_step, tokens, seconds = train_rows(run), 0, 0.0, 0.0
    for row in rows:
        seconds += row["s_step"] * (row["step"] - last_step)
        tokens += row["tokens_per_s"] * row["s_step"] * (row["step"] - last_step)
        last_step = row["step"]
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held_out = next((r for r in reversed(evals) if r.get("split") == "eval"), {})
    return {
        "steps": steps,
        "tokens": round(tokens),
        "tokens_x_shipped": round(tokens / SHIPPED_TOKENS, 2),
        "tokens_per_s": round(tokens / max(seconds, 1e-9)),
        "seconds": round(time.perf_counter() - start, 1),
        "loss": rows[-1].get("loss"),
        "held_out": {k: held_out[k] for k in ("acc_0", "acc_1", "acc_2", "tau_est") if k in held_out},
        "final": str(run / "final"),
    }


def bring_back(final: Path, work: Path, out: Path) -> dict:
    """Phase 4: the head in bf16, the shipped head's drafting.json beside it, packed and split into
    out/head."""
    from drafthead.heads import pretrained

    head = work / "head"
    drafthead("export", str(final), "--format", "ours", "--dtype", "bfloat16", "--out", str(head))
    shutil.copy(Path(pretrained.__file__).parent / "smollm2-135m" / "drafting.json", head / "drafting.json")
    manifest = send(head, out / "head", HEAD_PART_BYTES)
    return {"folder": str(out / "head"), "bytes": manifest["bytes"], "parts": len(manifest["parts"])}


def bench(name: str, head: Path, bundle: Path, budget: Budget) -> dict:
    """Phase 5: per method, tokens/s over the prompts after one warm-up generation (graphs are
    recorded there), and whether every method gave generate()'s tokens, in fp32."""
    import torch

    from drafthead.inference.bench.prompts import encode_chat
    from drafthead.inference.drafters.chain_graph import GraphedChainDrafter
    from drafthead.heads.registry import load_head
    from drafthead.inference.engine.drafter import RootOnlyDrafter
    from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
    from drafthead.ground.target.identity import eos_token_ids
    from drafthead.ground.target.load import load_target

    loaded = load_target(name, dtype="float32", device=budget.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = eos_token_ids(model, tokenizer)
    head_module, _ = load_head(head, model, tokenizer, target_name=loaded.name)
    head_module.eval()
    prompts = [json.loads(line)["prompt"] for line in (bundle / "mt-bench.jsonl").read_text().splitlines()][: budget.bench_prompts]
    ids = [encode_chat(tokenizer, p).to(budget.device) for p in prompts]
    settings = {"compile": "graphs", "mode": None}  # "graphs-eager" and "eager" once a recording failed

    def generate(prompt):
        out = model.generate(prompt, max_new_tokens=budget.bench_new_tokens, do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0])
        return out[0, prompt.shape[1] :].tolist(), None

    def ours(make_drafter):
        def run(prompt):
            # engine_linears off: the CPU's kernel dispatch is a no-op on a GPU, and its calibration
            # would cost the dry run more than its bench
            config = GenerationConfig(
                max_new_tokens=budget.bench_new_tokens, eos_token_ids=eos, static_cache=True, compile=settings["compile"], engine_linears=False
            )
            try:
                result = speculative_generate(model, make_drafter(settings["mode"]), prompt, config)
            except RuntimeError as e:  # a step this GPU would not record: carry on without graphs
                if settings["mode"] is not None:
                    raise
                settings.update(compile="graphs-eager", mode="eager", capture_failed=" ".join(str(e).split())[:300])
                say(f"recording a step failed, decoding on eager steps: {settings['capture_failed']}")
                return run(prompt)
            return result.new_tokens[0].tolist(), result.accepted_lengths

        return run

    methods = {
        "generate()": generate,
        "ours, plain (graphs)": ours(lambda mode: RootOnlyDrafter()),
        "ours, head chain 3 (graphs)": ours(lambda mode: GraphedChainDrafter(head_module, 3, mode=mode)),
    }
    sync = torch.cuda.synchronize if budget.device == "cuda" else (lambda: None)
    table, outputs = {}, {}
    with torch.inference_mode():
        for method, run in methods.items():
            run(ids[0][:, : max(2, ids[0].shape[1] // 2)])  # warm-up: CUDA's start, the recorded steps
            sync()
            start, tokens, rounds, texts = time.perf_counter(), 0, [], []
            for prompt in ids:
                new, accepted = run(prompt)
                texts.append(new)
                tokens += len(new)
                rounds += accepted or []
            sync()
            seconds = time.perf_counter() - start
            table[method] = {"tokens_per_s": round(tokens / seconds, 1), "tau": round(tokens / len(rounds), 3) if rounds else None}
            outputs[method] = texts
    reference = outputs["generate()"]
    for method, texts in outputs.items():
        table[method]["identical"] = sum(a == b for a, b in zip(texts, reference)) / len(reference)
        table[method]["speedup"] = round(table[method]["tokens_per_s"] / table["generate()"]["tokens_per_s"], 2)
    return {
        "dtype": "float32",
        "prompts": len(ids),
        "max_new_tokens": budget.bench_new_tokens,
        "steps": "eager (recording failed)" if settings["mode"] else ("recorded" if budget.device == "cuda" else "eager"),
        "capture_failed": settings.get("capture_failed"),
        "methods": table,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", default=".gpu-run/bundle")
    p.add_argument("--work", default="/tmp/drafthead-gpu-run", help="data, runs and the exported head (too large for --out)")
    p.add_argument("--out", required=True, help="what comes back: the head's parts and summary.json")
    p.add_argument("--budget", choices=sorted(BUDGETS), default="gpu")
    args = p.parse_args(argv)
    budget = BUDGETS[args.budget]
    bundle, work, out = Path(args.bundle), Path(args.work), Path(args.out)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    if budget.device == "cuda" and not torch.cuda.is_available():
        print("drafthead: error: --budget gpu needs a CUDA device; the CPU runs --budget dry", file=sys.stderr)
        return 2
    start = time.perf_counter()
    summary: dict = {"budget": args.budget, "settings": asdict(budget), "torch": torch.__version__}
    summary["device"] = torch.cuda.get_device_name() if budget.device == "cuda" else "cpu"

    def phase(key: str, work_of) -> bool:
        """Run one phase into summary[key]; a phase that fails is recorded and the run goes on
        with what does not need it (the bench runs on the shipped head when no new one came)."""
        say(f"{key} ...")
        t0 = time.perf_counter()
        try:
            summary[key] = work_of()
        except Exception as e:  # noqa: BLE001  (every failure is the summary's to report)
            summary[key] = {"failed": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"}
            traceback.print_exc()
        say(f"{key}: {json.dumps(summary[key])} ({time.perf_counter() - t0:.0f} s)")
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")  # what a timeout leaves still says how far it got
        return "failed" not in summary[key]

    from drafthead.heads import pretrained

    head = Path(pretrained.__file__).parent / "smollm2-135m"  # the bench's head unless a new one comes
    if phase("target", lambda: install_target(bundle)):
        name = summary["target"]["name"]
        left_s = lambda: budget.deadline_s - (time.perf_counter() - start)  # noqa: E731
        if (
            phase("regenerate", lambda: regenerate(name, bundle, work / "regen.jsonl", budget))
            and phase("train", lambda: train(name, work / "regen.jsonl", work, budget, left_s))
            and phase("head", lambda: bring_back(Path(summary["train"]["final"]), work, out))
        ):
            head = work / "head"
        phase("bench", lambda: bench(name, head, bundle, budget))
    summary["wall_s"] = round(time.perf_counter() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    return 1 if any(isinstance(v, dict) and "failed" in v for v in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
