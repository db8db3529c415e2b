"""`make interop`: run our heads through the consumers' own code, and their checkpoints through ours.

    .venv/bin/python scripts/interop/run.py [--only vllm,speculators,...] [--prompts 8 --max-tokens 128]

Each consumer lives in its own venv under .venv-interop/ (scripts/interop/setup_<name>.sh, run
here when missing). Export direction: the shipped SmolLM2 head (or, for EAGLE-1 / Medusa, a seeded
head on the tiny fixture target) is exported with `drafthead export`, loaded by the consumer's
own loader, and the consumer's outputs are compared with ours on the same inputs, or, where the
consumer only generates (vLLM, llama.cpp), its acceptance is compared with our engine's on the same
prompts. Per target family (speculators, vLLM, SGLang, llama.cpp): one row per tiny target of
tests/tiny.py, each with the EAGLE-3 head family_heads.py builds on it (FAMILY_ROWS; where an
engine cannot run a family on the CPU, the row says which part ran and quotes the engine's error).
Import direction: the consumer's own classes write a checkpoint (fixtures_<name>.py), we
import it and compare with the consumer's own forward. Training (speculators): its own EAGLE-3
loss and gradients beside ours on one batch from the same initial weights, and its trainer on CPU
(check_speculators_trainer.py; docs/training.md "Compared with speculators' trainer"). Prints one table; writes
out/interop/report.json and out/interop/report.md. docs/formats.md says what each layout is.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests/interop.py: the comparison rules the test suite applies too
from tests.interop import our_outputs, reference_as_ours, target_as_producer_saw  # noqa: E402
from family_heads import SKIPPED_BY_NAME, family_head  # noqa: E402  (beside this file)

SCRIPTS = ROOT / "scripts" / "interop"
VENVS = ROOT / ".venv-interop"
FIX = ROOT / "tests" / "fixtures" / "interop"
OUT = ROOT / "out" / "interop"
SHIPPED = ROOT / "heads" / "pretrained" / "smollm2-135m"
DRAFTHEAD = [sys.executable, "-m", "drafthead.cli"]

CONSUMERS = ("speculators", "vllm", "sglang", "llamacpp", "eagle", "medusa", "dflash")
LABEL = {"speculators": "speculators", "vllm": "vLLM CPU", "sglang": "SGLang (model + loader code)"}  # in the table
PYTHONS = {  # consumer -> its venv's python
    "vllm": VENVS / "vllm" / "bin" / "python",
    "speculators": VENVS / "speculators" / "bin" / "python",
    "sglang": VENVS / "sglang" / "bin" / "python",
    "specforge": VENVS / "specforge" / "bin" / "python",
    "llamacpp": VENVS / "llamacpp" / "venv" / "bin" / "python",
    "eagle": VENVS / "eagle" / "bin" / "python",
    "medusa": VENVS / "medusa" / "bin" / "python",
    "dflash": VENVS / "dflash" / "bin" / "python",
}
TOLERANCE = 1e-4  # max |logit difference| that counts as the same maths in float32


@dataclass
class Row:
    consumer: str
    direction: str  # "export" (ours -> theirs) or "import" (theirs -> ours)
    what: str
    loaded: bool
    max_diff: float | None = None
    acceptance: str = "-"
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.loaded and (self.max_diff is None or self.max_diff <= TOLERANCE)


# ----------------------------------------------------------------------------- plumbing


def sh(cmd, log: Path, timeout: int = 3600, env=None) -> subprocess.CompletedProcess:
    """Run cmd with its output in `log`; raises with the log's tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = log.read_text()[-1500:]
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} ... exited {proc.returncode} (log {log}):\n{tail}")
    return proc


def last_json(log: Path) -> dict:
    for line in reversed(log.read_text().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON result line in {log}")


def setup(consumer: str) -> None:
    names = ("sglang", "specforge") if consumer == "sglang" else (consumer,)
    for name in names:
        script = SCRIPTS / f"setup_{name}.sh"
        if script.exists():
            print(f"[interop] setting up {name} (log out/interop/setup_{name}.log)", flush=True)
            sh(["bash", script], OUT / f"setup_{name}.log", timeout=5400)


@functools.lru_cache(maxsize=1)
def smollm2():
    """SmolLM2-135M in float32, loaded once for the whole run (every check reads the same target)."""
    from drafthead.ground.target.load import load_target

    return load_target("smollm2-135m")


def smollm2_dir() -> Path:
    return smollm2().path


def export(head: Path, fmt: str, out: Path, target: str | Path | None = None) -> Path:
    """`drafthead export` through its function (the fixture target has no tokenizer for the CLI)."""
    from drafthead.heads.formats import export_head

    model = None
    if target == "smollm2-135m":
        model = smollm2().model
    elif target is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    return export_head(head, out, fmt, target_model=model, overwrite=True)  # a rerun replaces its exports


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def compare(ours: dict, theirs: dict) -> float:
    keys = sorted(set(ours) & set(theirs))
    if not keys:
        raise RuntimeError(f"nothing to compare: ours {sorted(ours)}, theirs {sorted(theirs)}")
    return max(max_diff(ours[k], theirs[k]) for k in keys)


def smollm2_inputs(path: Path) -> Path:
    """Real features of SmolLM2 on one chat prompt, for the shipped head (layers 2, 15, 27)."""
    from drafthead.heads.formats import import_head

    t = smollm2()
    head = import_head(SHIPPED, t.model, t.tokenizer)
    ids = t.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three rivers in Europe."}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    with torch.no_grad():
        hs = t.model(ids, output_hidden_states=True).hidden_states
    T = ids.shape[1] - 1  # column t: feature of t beside token t + 1
    save_file({"input_ids": ids[:, 1:].contiguous(), "features3": torch.cat([hs[i][:, :T] for i in head.feature_layers], -1).contiguous()}, str(path))
    return path


# ----------------------------------------------------------------------------- checks


def check_speculators(args) -> list[Row]:
    from drafthead.heads.formats import import_head

    py, rows = PYTHONS["speculators"], []
    exp = export(SHIPPED, "speculators", OUT / "exports" / "speculators", "smollm2-135m")
    inputs = smollm2_inputs(OUT / "smollm2_inputs.safetensors")
    log = OUT / "speculators_export.log"
    sh([py, SCRIPTS / "check_speculators.py", "--head", exp, "--inputs", inputs, "--out", OUT / "speculators_export"], log)
    theirs = load_file(str(OUT / "speculators_export.safetensors"))
    t = smollm2()
    ours = our_outputs(import_head(SHIPPED, t.model, t.tokenizer), load_file(str(inputs)))
    rows.append(
        Row(
            "speculators",
            "export",
            "shipped EAGLE-3 head, Eagle3DraftModel.from_pretrained",
            True,
            compare(ours, theirs),
            note=f"{last_json(log).get('note', '')}",
        )
    )
    rows += fixture_imports("speculators", ("speculators-eagle3", "speculators-eagle3-nbr", "speculators-eagle3-train", "speculators-eagle3-window"))
    rows += family_rows("speculators", speculators_family_row)
    return rows + [speculators_dspark_row()] + speculators_trainer_rows(py)


# The parity with speculators' trainer (check_speculators_trainer.py): our EAGLE-3 head in two
# layer variants, our default and the one `speculators train` builds for EAGLE-3, on one batch of
# self-distilled SmolLM2 chats, unrolled 1..3 TTT steps under the same per-step decay.
TRAINER_HEADS = {"ours": {}, "speculators-train": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True}}
TRAINER_STEPS, TRAINER_DECAY, TRAINER_DRAFT_VOCAB = (1, 2, 3), 0.8, 512
TRAINER_LR, TRAINER_RUN_STEPS = 1e-4, 3  # the side-by-side runs: AdamW, linear decay to 0, no warmup


def trainer_batch(folder: Path):
    """Four self-distilled SmolLM2 chats (`drafthead data regenerate`, greedy, 40 new tokens),
    formatted and captured by our pipeline: (samples, FeatureBatch with the EAGLE-3 layers, the
    last decoder layer's output before the final norm [B, T, H], which speculators' data holds,
    the aux layers)."""
    from drafthead.heads.config import default_eagle3_layers
    from drafthead.train.data.chat_format import format_row
    from drafthead.train.capture.features import collate, target_features
    from drafthead.train.data.samples import token_sample

    regen = folder / "regen.jsonl"
    if not regen.exists():
        sh(
            DRAFTHEAD
            + [
                "data",
                "regenerate",
                "--target",
                "smollm2-135m",
                "--source",
                "sharegpt",
                "--limit",
                12,
                "--max-turns",
                1,
                "--max-new-tokens",
                40,
                "--max-prompt-tokens",
                80,
                "--batch-size",
                4,
                "--dtype",
                "float32",
                "--threads",
                1,
                "--out",
                regen,
            ],
            folder / "regen.log",
        )
    t = smollm2()
    rows = [json.loads(line) for line in regen.read_text().splitlines()][:4]
    samples = [token_sample(format_row(t.tokenizer, row, 256)) for row in rows]
    batch = collate(samples, t.tokenizer.pad_token_id or 0)
    L = t.model.config.num_hidden_layers
    pre_norm = {}
    hook = t.model.model.norm.register_forward_pre_hook(lambda m, a: pre_norm.__setitem__("h", a[0].detach()))
    aux = default_eagle3_layers(L)
    try:
        batch.hidden_states = target_features(t.model, batch.input_ids, batch.attention_mask, (*aux, L))
    finally:
        hook.remove()
    return samples, batch, pre_norm["h"], aux


def trainer_head(flags: dict, samples, folder: Path):
    """A seeded EAGLE-3 head for SmolLM2 (draft vocab from the batch's assistant tokens), saved and
    exported in the speculators layout: (head, export dir)."""
    from drafthead.heads.registry import build_head, make_config
    from drafthead.train.data.samples import label_token_counts

    t = smollm2()
    shutil.rmtree(folder, ignore_errors=True)  # a fresh head and export each run
    config = make_config(
        "eagle3",
        t.model,
        t.tokenizer,
        "smollm2-135m",
        draft_vocab_size=TRAINER_DRAFT_VOCAB,
        ttt_steps=max(TRAINER_STEPS),
        ttt_decay=TRAINER_DECAY,
        ttt_ramp=0.0,
        **flags,
    )
    counts = label_token_counts(samples, t.model.config.vocab_size)
    torch.manual_seed(0)  # the fresh init and the offsets below: the same head every run
    head = build_head(config, t.model, token_counts=counts, dtype=torch.float32)
    with torch.no_grad():  # off the fresh init (unit norms), so a swapped or skipped norm shows
        for p in head.parameters():
            p.add_(0.02 * torch.randn_like(p))
    head.save_pretrained(folder / "head")
    return head, export(folder / "head", "speculators", folder / "speculators", "smollm2-135m")


def our_trainer_reference(head, batch) -> dict[str, torch.Tensor]:
    """Our loss for 1..3 TTT steps (the default soft CE, and KL(p || q) = loss lk_lambda at
    lk_eta 0: speculators' kl_div) and the CE run's gradients under speculators' tensor names."""
    from drafthead.heads.formats.speculators import tensor_name

    head.train()
    cfg, out = head.config, {}
    for k in TRAINER_STEPS:
        cfg.ttt_steps = k
        cfg.loss, cfg.lk_eta = "lk_lambda", 0.0
        out[f"k{k}/loss_kl"] = head.compute_loss(batch)[0].detach()
        cfg.loss = "ce"
        head.zero_grad(set_to_none=True)
        loss, _ = head.compute_loss(batch)
        loss.backward()
        out[f"k{k}/loss_ce"] = loss.detach()
        out.update({f"k{k}/grad/{tensor_name(n)}": p.grad.detach().clone() for n, p in head.named_parameters() if p.grad is not None})
    return out


def our_trainer_run(folder: Path, head_dir: Path) -> list[float]:
    """`drafthead train` from `head_dir` on the first three chats (speculators' train split of the
    four at --train-data-ratio 0.75), one batch a step, with the settings its run gets: the loss
    logged at each step (before that step's update)."""
    out = folder / "ours-run"
    sh(
        DRAFTHEAD
        + [
            "train",
            "--config",
            "eagle3",
            "--overwrite",
            "data.source=regenerated",
            f"data.path={folder / 'regen.jsonl'}",
            "data.limit=3",
            "data.eval_fraction=0",
            "data.max_length=256",
            "features.mode=online",
            "target_dtype=float32",
            'mixed_precision="no"',
            f"head.draft_vocab_size={TRAINER_DRAFT_VOCAB}",
            f"head.ttt_steps={max(TRAINER_STEPS)}",
            f"head.ttt_decay={TRAINER_DECAY}",
            "head.ttt_ramp=0",
            f"init_from={head_dir}",
            "batch_size=3",
            "grad_accum=1",
            f"lr={TRAINER_LR}",
            "betas=[0.9,0.999]",
            "weight_decay=0.01",
            "schedule=linear",
            "warmup_steps=0",
            "min_lr_ratio=0",
            f"max_steps={TRAINER_RUN_STEPS}",
            "clip_norm=1.0",
            "log_every=1",
            "eval_every=1000",
            "checkpoint_every=1000",
            "replay.sequences=0",
            "report_to=none",
            "threads=1",
            f"output_dir={out}",
        ],
        folder / "ours-run.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("split") == "train"]


def speculators_trainer_rows(py, smoke: bool = True) -> list[Row]:
    """speculators' EAGLE-3 training loss and gradients (its own loader, data shift, packing and
    forward) against ours on the same batch and initial weights; one row per head and TTT depth.
    max_diff is the largest relative gradient difference over every draft parameter, with the
    loss mask read as ours reads it; the note gives both losses and the native-mask figures."""
    folder = OUT / "trainer"
    folder.mkdir(parents=True, exist_ok=True)
    samples, batch, pre_norm, aux = trainer_batch(folder)
    flat = {}
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        flat.update(
            {
                f"{b}/input_ids": s["input_ids"],
                f"{b}/loss_mask": s["loss_mask"],
                f"{b}/hidden_states": torch.cat([batch.hidden_states[i][b, :n] for i in aux], -1),
                f"{b}/verifier_last_hidden_states": pre_norm[b, :n],
            }
        )
    save_file({k: v.contiguous() for k, v in flat.items()}, str(folder / "batch.safetensors"))
    cmd = [
        py,
        SCRIPTS / "check_speculators_trainer.py",
        "--batch",
        folder / "batch.safetensors",
        "--target",
        smollm2_dir(),
        "--out",
        folder / "theirs",
        "--decay",
        TRAINER_DECAY,
        "--steps",
        *TRAINER_STEPS,
    ]
    for name, flags in TRAINER_HEADS.items():
        head, exp = trainer_head(flags, samples, folder / name)
        save_file(our_trainer_reference(head, batch), str(folder / f"{name}_ours.safetensors"))
        cmd += ["--head", f"{name}={exp}", "--reference", f"{name}={folder / f'{name}_ours.safetensors'}"]
    if smoke:
        cmd += ["--trainer-smoke", folder / "smoke", "--lr", TRAINER_LR, "--train-steps", TRAINER_RUN_STEPS]
    sh(cmd, folder / "check.log", env={"OMP_NUM_THREADS": "1"})
    result = json.loads((folder / "theirs.json").read_text())
    rows = []
    for name, res in result["heads"].items():
        if "error" in res:
            rows.append(Row("speculators", "trainer", f"{name} head, training loss", False, note=res["error"][:200]))
            continue
        runs = {(r["mask"], r["ttt_steps"]): r for r in res["runs"]}
        for k in TRAINER_STEPS:
            same, native = runs[("ours", k)], runs[("native", k)]
            what = f"{name} head, {k} TTT step(s), same batch and weights (max diff: relative gradient)"
            unmatched = f"; tensors on one side only: {same['unmatched']}" if same["unmatched"] else ""
            rows.append(
                Row(
                    "speculators",
                    "trainer",
                    what,
                    not same["unmatched"],
                    max(same["max_rel_grad_diff"].values()),
                    note=f"loss theirs {same['loss']:.6f} / ours KL {same['ours_kl']:.6f} (CE "
                    f"{same['ours_ce']:.6f}); their native mask: loss {native['loss']:.6f}, "
                    f"grad diff {max(native['max_rel_grad_diff'].values()):.1e}{unmatched}",
                )
            )
    if smoke:
        rows.append(trainer_smoke_row(result["trainer_smoke"], our_trainer_run(folder, folder / "ours" / "head")))
    return rows


def trainer_smoke_row(smoke: dict, ours: list[float]) -> Row:
    """`speculators train` on CPU: where it stops as shipped, and its losses with its device calls
    patched, beside our trainer's on the same chats, initial weights and schedule."""
    shipped, patched = smoke["as shipped"], smoke["device calls patched"]
    stop = next((f.split("site-packages/")[-1] for f in reversed(shipped["last_frames"]) if "site-packages/speculators/" in f), "-")
    theirs = [round(m["loss"], 3) for m in patched["metrics"]]
    note = (
        f"as shipped: {shipped['error'] or 'ran'} at {stop}; device calls patched: exit {patched['returncode']}, "
        f"loss per step (KL, its mask, lm_head frozen) {theirs}; ours (CE, our mask, lm_head trained) "
        f"{[round(x, 3) for x in ours]}"
    )
    return Row(
        "speculators",
        "trainer",
        f"`speculators train` on CPU from our export, {TRAINER_RUN_STEPS} steps",
        patched["returncode"] == 0 and len(theirs) == TRAINER_RUN_STEPS,
        note=note,
    )


# ----------------------------------------------------------------------------- per target family

# the tiny targets of the per-family rows (tests/tiny.py families; scripts/interop/family_heads.py
# builds them and the seeded head): heads of 32, the narrowest vLLM's CPU attention takes, and
# positions for the longest MT-bench prompt in the tiny tokenizer's ids (261)
FAMILY_TARGET = {"hidden": 128, "head_dim": 32, "max_position_embeddings": 1024}
# per family, sizes at FAMILY_TARGET's hidden size: Mamba-2 heads x head size = 2 x hidden;
# vLLM's CPU Gated DeltaNet kernel takes Qwen3-Next's head size, 128
FAMILY_SIZES = {"granitemoehybrid": {"mamba_d_head": 64}, "qwen3_next": {"linear_key_head_dim": 128, "linear_value_head_dim": 128}}
# vLLM's CPU Gated DeltaNet runs in bf16 only
FAMILY_VLLM_DTYPE = {"qwen3_next": "bfloat16"}
# the families each consumer's rows run, with the draft layer (the engines' Llama layer, or
# "target": the family's own, which only speculators serves, as its Qwen3 draft layer)
FAMILY_ROWS = {
    "speculators": (("qwen3", "llama"), ("qwen3_moe", "llama"), ("gpt_oss", "llama"), ("qwen3", "target")),
    "vllm": (
        ("llama", "llama"),
        ("qwen3", "llama"),
        ("qwen3_moe", "llama"),
        ("gpt_oss", "llama"),
        ("qwen3_next", "llama"),
        ("granitemoehybrid", "llama"),
    ),  # hybrids: docs/trees.md "Hybrid targets"
    "sglang": (("llama", "llama"), ("qwen3", "llama"), ("qwen3_moe", "llama"), ("gpt_oss", "llama")),
}
FAMILY_PROMPTS, FAMILY_TOKENS = 4, 32  # the most the vLLM family rows generate: a 2-core machine
# the head's draft vocabulary is the tokens most frequent in the target's greedy answers to the 8
# MT-bench prompts after those, and it learns those answers for 200 steps: an untrained head on a
# random target accepts next to nothing, so that acceptance could not tell the engines apart
FAMILY_VOCAB_PROMPTS, FAMILY_FIT_STEPS = 8, 200


@dataclass
class FamilyCase:
    """One tiny target family with the seeded head on it, and the inputs every consumer's forward
    is compared on: 8 random ids and the target's features at the head's layers."""

    family: str
    draft_layer: str
    out: Path
    target_dir: Path
    head_dir: Path
    model: object
    inputs: Path

    @property
    def what(self) -> str:
        return f"{self.family} tiny target, EAGLE-3 head ({self.draft_layer} draft layer)"

    def export(self, fmt: str) -> Path:
        from drafthead.heads.formats import export_head

        return export_head(self.head_dir, self.out / fmt, fmt, target_model=self.model, overwrite=True)

    def ours(self) -> dict:
        from drafthead.heads.formats import import_head

        return our_outputs(import_head(self.head_dir, self.model), load_file(str(self.inputs)))


@functools.lru_cache(maxsize=None)
def family_case(family: str, draft_layer: str = "llama") -> FamilyCase:
    from drafthead.heads.formats import import_head
    from drafthead.inference.bench.prompts import load_prompts

    out = OUT / "families" / f"{family}-{draft_layer}"
    vocab_from = load_prompts("mt-bench", FAMILY_PROMPTS + FAMILY_VOCAB_PROMPTS)[FAMILY_PROMPTS:]
    target_dir, head_dir, model = family_head(family, out, draft_layer, vocab_from, FAMILY_FIT_STEPS, **FAMILY_TARGET, **FAMILY_SIZES.get(family, {}))
    head = import_head(head_dir, model)
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    save_file({"input_ids": ids, "features3": torch.cat([hs[i] for i in head.feature_layers], -1).contiguous()}, str(out / "inputs.safetensors"))
    return FamilyCase(family, draft_layer, out, target_dir, head_dir, model, out / "inputs.safetensors")


def loader_note(mapped: int, missing, unexpected, skipped=(), shared=()) -> str:
    """What a consumer's loader did with an export: the one wording of every family row."""
    note = f"{mapped} tensors mapped; missing {len(missing)} {list(missing)[:3]}, unexpected {len(unexpected)} {list(unexpected)[:3]}"
    if skipped:
        note += f"; skipped by name: {', '.join(skipped)}"
    if shared:
        note += f"; from the target: {', '.join(shared)}"
    return note


def family_rows(consumer: str, row) -> list[Row]:
    """`row(case)` for each family of FAMILY_ROWS[consumer]; a family whose target or head cannot
    be built is a row saying so."""
    rows = []
    for family, layer in FAMILY_ROWS[consumer]:
        try:
            rows.append(row(family_case(family, layer)))
        except Exception as e:  # the row says why
            rows.append(
                Row(
                    LABEL[consumer],
                    "export",
                    f"{family} tiny target, EAGLE-3 head ({layer} draft layer)",
                    False,
                    note=" ".join(str(e).split())[-300:],
                )
            )
    return rows


def speculators_family_row(case: FamilyCase) -> Row:
    """speculators' loader on our EAGLE-3 export: tensors it maps (missing / unexpected, from its own
    model's state dict), and its forward against ours."""
    exp = case.export("speculators")
    sh(
        [
            PYTHONS["speculators"],
            SCRIPTS / "check_speculators.py",
            "--head",
            exp,
            "--inputs",
            case.inputs,
            "--out",
            case.out / "speculators_theirs",
            "--target",
            case.target_dir,
        ],
        case.out / "speculators.log",
    )
    res = json.loads((case.out / "speculators_theirs.json").read_text())
    keys = res.get("keys", {})
    missing, unexpected = keys.get("missing_in_file", ["?"]), keys.get("unexpected_in_file", ["?"])
    diff = compare(case.ours(), load_file(str(case.out / "speculators_theirs.safetensors")))
    return Row(
        LABEL["speculators"],
        "export",
        case.what,
        not missing and not unexpected,
        diff,
        note=loader_note(len(res["file_tensors"]) - len(unexpected), missing, unexpected),
    )


def fixture_imports(consumer: str, names, convention: str | None = None, producer: str | None = None) -> list[Row]:
    """Regenerate the consumer-written fixtures with its own code, import each, compare."""
    from transformers import AutoModelForCausalLM

    from drafthead.heads.formats import import_head

    producer = producer or consumer
    sh([PYTHONS[producer], SCRIPTS / f"fixtures_{producer}.py"], OUT / f"fixtures_{producer}.log")
    target = AutoModelForCausalLM.from_pretrained(FIX / "target", dtype=torch.float32).eval()
    inputs = load_file(str(FIX / "inputs.safetensors"))
    rows = []
    for name in names:
        meta = json.loads((FIX / name / "meta.json").read_text())
        try:
            head = import_head(FIX / name, target_as_producer_saw(target, FIX / name), convention=convention)
        except Exception as e:  # the row says why
            rows.append(Row(consumer, "import", f"{name} ({meta['writer'].split(' ')[0]})", False, note=str(e)[:200]))
            continue
        ref = reference_as_ours(head, load_file(str(FIX / name / "reference.safetensors")))
        rows.append(Row(consumer, "import", f"{name} ({meta['package']} {meta['version']})", True, compare(our_outputs(head, inputs), ref)))
    return rows


def our_chain_acceptance(
    args, tdir: Path, k: int, limit: int | None = None, head: Path = SHIPPED, max_tokens: int | None = None, where: Path = OUT
) -> tuple[list[float], dict]:
    """Our engine, `head` drafting a chain of k (no tree, no lookup), on the same first MT-bench
    prompts as the consumer. One thread: only acceptance is compared, and spinning OpenMP threads
    beside another busy process slowed this 10x."""
    limit, max_tokens = limit or args.prompts, max_tokens or args.max_tokens
    out = where / f"ours_chain{k}_{limit}.json"
    sh(
        DRAFTHEAD
        + [
            "bench",
            "--target",
            tdir,
            "--proposer",
            "head",
            "--head",
            head,
            "--num-draft",
            k,
            "--tree-depth",
            k,
            "--tree-branch",
            1,
            "--lookup-nodes",
            0,
            "--dataset",
            "mt-bench",
            "--limit",
            limit,
            "--max-new-tokens",
            max_tokens,
            "--dtype",
            "float32",
            "--threads",
            1,
            "--out",
            out,
        ],
        where / f"ours_chain{k}_{limit}.log",
        timeout=7200,
    )
    report = json.loads(out.read_text())
    return report["per_position_acceptance"][:k], report


def run_check_vllm(
    target: Path,
    head: Path,
    method: str,
    k: int,
    n_prompts: int,
    n_tokens: int,
    prefix: Path,
    loader_only: bool = False,
    dtype: str = "float32",
    inputs: Path | None = None,
) -> dict:
    """check_vllm.py in vLLM's venv: its summary (PREFIX.json), also when it exits 1 for a phase
    that failed (the summary names it); raises when there is none."""
    from drafthead.inference.bench.prompts import mt_bench_path

    Path(f"{prefix}.json").unlink(missing_ok=True)  # a failed run must not leave an earlier run's summary to read
    try:
        sh(
            [
                PYTHONS["vllm"],
                SCRIPTS / "check_vllm.py",
                "--target",
                target,
                "--head",
                head,
                "--method",
                method,
                "--num-spec-tokens",
                k,
                "--prompts",
                n_prompts,
                "--max-tokens",
                n_tokens,
                "--dtype",
                dtype,
                "--prompt-file",
                mt_bench_path(),
                "--out",
                prefix,
            ]
            + (["--loader-only"] if loader_only else [])
            + (["--inputs", inputs] if inputs else []),
            Path(f"{prefix}.log"),
            timeout=7200,
        )
    except RuntimeError:
        if not Path(f"{prefix}.json").exists():
            raise
    return json.loads(Path(f"{prefix}.json").read_text())


def check_vllm(args) -> list[Row]:
    tdir, k, rows = smollm2_dir(), 3, []
    ours, report = our_chain_acceptance(args, tdir, k)
    runs = (
        ("shipped head", SHIPPED, "vllm", "eagle3", args.prompts, args.max_tokens),
        ("shipped head", SHIPPED, "speculators", "eagle3", args.prompts, args.max_tokens),
        # loading is the point here: an untrained head accepts ~nothing
        ("untrained EAGLE-1 head", smollm2_untrained("eagle1", OUT / "smollm2-eagle1"), "vllm", "eagle", 2, 32),
        ("untrained Medusa head", smollm2_untrained("medusa1", OUT / "smollm2-medusa1", num_heads=3), "medusa", "medusa", 2, 32),
        # vLLM reads "peagle" as EAGLE-3 with parallel drafting (check_vllm passes the flag)
        (
            "untrained P-EAGLE head (parallel drafting)",
            smollm2_untrained("peagle", OUT / "smollm2-peagle", draft_vocab_size=49152, parallel_depth=3, mask_token_id=16),
            "speculators",
            "eagle3",
            2,
            32,
        ),
        # DFlash: one block of k + 1 (the bonus token and k masks), drafted non-causally
        ("untrained DFlash head", smollm2_untrained("dflash", OUT / "smollm2-dflash", block_size=k + 1, mask_token_id=16), "dflash", "dflash", 2, 32),
    )
    for label, head, fmt, method, n_prompts, n_tokens in runs:
        # the head's folder in the names: the shipped EAGLE-3 head and P-EAGLE share method and format
        exp = export(head, fmt, OUT / "exports" / f"vllm-{method}-{fmt}-{Path(head).name}", "smollm2-135m")
        prefix = OUT / f"vllm_{method}_{fmt}_{Path(head).name}"
        what = f"{label}, --format {fmt} (method {method}, chain {k})"
        try:
            res = run_check_vllm(tdir, exp, method, k, n_prompts, n_tokens, prefix)
            if not res["loaded"]:
                raise RuntimeError(res.get("root_cause") or res.get("error"))
        except Exception as e:
            rows.append(Row(LABEL["vllm"], "export", what, False, note=str(e)[-300:]))
            continue
        theirs = [round(x, 3) for x in res["accepted_per_pos"]]
        same = sum(bool(x) for x in res["outputs_equal"])
        acceptance = f"vLLM {theirs}" + (f" / ours {[round(x, 3) for x in ours]}, aligned {aligned_acceptance(report, k)}" if head == SHIPPED else "")
        note = f"vLLM speculative == vLLM plain on {same}/{len(res['outputs_equal'])} prompts"
        if head == SHIPPED:
            note += f"; ours == plain generate() on {report['identical_fraction']:.0%}"
            if fmt == "vllm":
                note += f"; vLLM plain == transformers generate() on {hf_agreement(res, smollm2().model)} prompts"
        rows.append(Row(LABEL["vllm"], "export", what, bool(res["loaded"]), acceptance=acceptance, note=note))
    return rows + vllm_dspark_rows(tdir) + family_rows("vllm", lambda case: vllm_family_row(args, case, k))


def smollm2_dspark() -> tuple[Path, Path]:
    """An untrained SmolLM2 DSpark head (a block of 4) and our Markov bias and confidence on 8
    random (previous token, slot state) pairs, two blocks' worth: what the consumers' heads must give."""
    from safetensors.torch import save_file

    from drafthead.heads.registry import load_head

    head_dir = smollm2_untrained("dspark", OUT / "smollm2-dspark", block_size=4, mask_token_id=16)
    t = smollm2()
    head, _ = load_head(head_dir, t.model, t.tokenizer)
    g = torch.Generator().manual_seed(0)
    prev = torch.randint(0, head.config.vocab_size, (8,), generator=g)
    hidden = torch.randn(8, head.config.hidden_size, generator=g)
    reference = OUT / "dspark_reference.safetensors"
    with torch.no_grad():
        save_file(
            {
                "prev": prev,
                "hidden": hidden,
                "bias": head.markov_head.bias(head.markov_head.embed(prev)).float().contiguous(),
                "confidence": torch.sigmoid(head.confidence_logit(hidden, prev)).float(),
            },
            str(reference),
        )
    return head_dir, reference


def speculators_dspark_row() -> Row:
    """speculators' DSparkDraftModel.from_pretrained on our --format speculators DSpark export."""
    head_dir, reference = smollm2_dspark()
    exp = export(head_dir, "speculators", OUT / "exports" / "speculators-dspark", "smollm2-135m")
    what = "untrained DSpark head, --format speculators (DSparkDraftModel; loader and Markov/confidence heads)"
    try:
        sh(
            [
                PYTHONS["speculators"],
                SCRIPTS / "check_speculators_dspark.py",
                "--head",
                exp,
                "--inputs",
                reference,
                "--out",
                OUT / "speculators_dspark",
            ],
            OUT / "speculators_dspark.log",
            timeout=1800,
        )
        res = json.loads((OUT / "speculators_dspark.json").read_text())
    except Exception as e:
        return Row("speculators", "export", what, False, note=str(e)[-300:])
    note = loader_note(res["mapped"], res["missing"], res["unexpected"], shared=res["from_verifier"])
    note += f"; Markov bias max diff {res['markov_bias_max_diff']:.2g}, confidence max diff {res['confidence_max_diff']:.2g}"
    ok = (
        res["mapped"] == res["tensors"]
        and not res["missing"]
        and not res["unexpected"]
        and not res["changed"]
        and max(res["markov_bias_max_diff"], res["confidence_max_diff"]) < 1e-5
    )
    return Row("speculators", "export", what, ok, note=note + f" (speculators {res['version']})")


def vllm_dspark_rows(tdir: Path) -> list[Row]:
    """vLLM's Qwen3DSparkForCausalLM and its load_weights on our DSpark exports (--format dspark,
    DeepSeek's layout, and --format speculators, through vLLM's speculators reader), then its
    Markov bias and confidence on inputs our head scored (check_vllm.py: the CPU build refuses
    DSpark's engine, which runs on the V2 model runner only)."""
    head_dir, reference = smollm2_dspark()
    rows = []
    for fmt in ("dspark", "speculators"):
        exp = export(head_dir, fmt, OUT / "exports" / f"vllm-dspark-{fmt}", "smollm2-135m")
        what = f"untrained DSpark head, --format {fmt} (method dspark; loader and Markov/confidence heads)"
        try:
            res = run_check_vllm(tdir, exp, "dspark", 4, 1, 1, OUT / f"vllm_dspark_{fmt}", loader_only=True, inputs=reference)
        except Exception as e:
            rows.append(Row(LABEL["vllm"], "export", what, False, note=str(e)[-300:]))
            continue
        load = res.get("loader") or {}
        if not load.get("ok"):
            rows.append(Row(LABEL["vllm"], "export", what, False, note=f"vLLM's loader failed: {load.get('error')}"))
            continue
        unexpected = load["refused"] + load["skipped"]
        forward = load.get("draft_forward") or {}
        note = loader_note(sum(bool(r["params"]) for r in load["per_tensor"].values()), load["missing"], unexpected, shared=load["from_target"])
        note += (
            f"; unused placeholder: {', '.join(load['placeholders'])}; Markov bias max diff "
            f"{forward.get('markov_bias_max_diff')}, confidence max diff {forward.get('confidence_max_diff')}"
        )
        ok = (
            not load["missing"]
            and not unexpected
            and not load["not_intact"]
            and max(forward.get("markov_bias_max_diff", 1.0), forward.get("confidence_max_diff", 1.0)) < 1e-5
        )
        rows.append(Row(LABEL["vllm"], "export", what, ok, note=note))
    return rows


def vllm_family_row(args, case: FamilyCase, k: int) -> Row:
    """vLLM's draft class and loader on our `vllm` export (check_vllm.py's load phase: each tensor
    through its load_weights), then, where vLLM's CPU engine runs the family, its greedy
    speculative decoding on the first MT-bench prompts, acceptance against our engine's."""
    n_prompts, n_tokens = min(args.prompts, FAMILY_PROMPTS), min(args.max_tokens, FAMILY_TOKENS)
    res = run_check_vllm(
        case.target_dir, case.export("vllm"), "eagle3", k, n_prompts, n_tokens, case.out / "vllm", dtype=FAMILY_VLLM_DTYPE.get(case.family, "float32")
    )
    load = res.get("loader") or {}
    if not load.get("ok"):
        return Row(LABEL["vllm"], "export", case.what, False, note=f"vLLM's loader failed: {load.get('root_cause') or load.get('error')}")
    per_tensor = load["per_tensor"]
    unexpected = load["refused"] + [n for n in load["skipped"] if n not in SKIPPED_BY_NAME]
    note = loader_note(
        sum(bool(r["params"]) for r in per_tensor.values()),
        load["missing"],
        unexpected,
        [n for n in load["skipped"] if n in SKIPPED_BY_NAME],
        load["from_target"],
    )
    if load["not_intact"]:
        note += f"; values changed on the way: {load['not_intact']}"
    loaded = not load["missing"] and not unexpected and not load["not_intact"]
    if not res["loaded"]:  # the engine: vLLM's own error, from its worker's log where it has one
        cause = res.get("plain_root_cause") or res.get("plain_error") or res.get("root_cause") or res.get("error")
        part = "target alone" if res.get("plain_error") else "target + draft"
        return Row(
            LABEL["vllm"],
            "export",
            case.what,
            loaded,
            note=f"{note}; loader only ({load['draft_class']}): the CPU engine failed on the {part}: {' '.join(str(cause).split())[:300]}",
        )
    ours, report = our_chain_acceptance(args, case.target_dir, k, n_prompts, case.head_dir, n_tokens, case.out)
    same = sum(bool(x) for x in res["outputs_equal"])
    return Row(
        LABEL["vllm"],
        "export",
        case.what,
        loaded,
        acceptance=f"vLLM {[round(x, 3) for x in res['accepted_per_pos']]} / ours aligned "
        f"{aligned_acceptance(report, k)} (chain {k}, {n_prompts} prompts x {n_tokens})",
        note=f"{note}; vLLM speculative == vLLM plain on {same}/{len(res['outputs_equal'])}, vLLM plain == "
        f"transformers generate() on {hf_agreement(res, case.model)}",
    )


def aligned_acceptance(report: dict, k: int) -> list[float]:
    """Our per-position acceptance counted as vLLM counts its drafts: vLLM's first token per prompt
    comes from the prefill, undrafted, where our first round drafts from the prompt alone; and we
    shorten the last chains to the tokens left, where vLLM drafts k and discards. So: drop each
    prompt's first round and the rounds that drafted fewer than k."""
    rounds = [a for p in report["prompts"] for a, d in zip(p["accepted_lengths"][1:], p["drafted"][1:]) if d == k]
    return [round(sum(a - 1 >= depth for a in rounds) / len(rounds), 3) for depth in range(1, k + 1)]


def hf_agreement(res: dict, model) -> str:
    """How many of vLLM's plain greedy outputs equal transformers' generate() on the same prompt ids."""
    same = 0
    for prompt, theirs in zip(res["prompt_token_ids"], res["plain_token_ids"]):
        ids = torch.tensor([prompt])
        with torch.no_grad():  # the mask is explicit: SmolLM2's pad id is <|im_end|>, which chat prompts contain
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=len(theirs),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=model.config.pad_token_id,
            )
        same += out[0, ids.shape[1] :].tolist() == list(theirs)
    return f"{same}/{len(res['plain_token_ids'])}"


def smollm2_untrained(kind: str, folder: Path, **overrides) -> Path:
    """An untrained (target-initialised, seeded) head for SmolLM2, to show vLLM loads the layout."""
    from drafthead.heads.registry import build_head, make_config

    t = smollm2()
    torch.manual_seed(0)
    head = build_head(make_config(kind, t.model, t.tokenizer, "smollm2-135m", **overrides), t.model)
    with torch.no_grad():  # non-zero blocks, so that a dropped bias or weight would show
        for p in head.parameters():
            p.add_(0.01 * torch.randn_like(p))
    head.save_pretrained(folder)
    return folder


def check_sglang(args) -> list[Row]:
    rows = []
    tdir = smollm2_dir()
    exp = export(SHIPPED, "sglang", OUT / "exports" / "sglang")
    log = OUT / "sglang_export.log"
    try:
        sh([PYTHONS["sglang"], SCRIPTS / "check_sglang.py", "--head", exp, "--target", tdir, "--out", OUT / "sglang_export"], log)
        res = last_json(log)
        captured = res.get("captured_hidden_state_indices")
        want = list(json.loads((SHIPPED / "config.json").read_text())["config"]["aux_layers"])
        ok = bool(res.get("loaded")) and captured == want
        rows.append(
            Row(
                LABEL["sglang"],
                "export",
                "shipped head, --format sglang",
                ok,
                res.get("max_abs_diff"),
                note=f"SGLang captures {captured}, trained on {want}; {res.get('note', '')}",
            )
        )
    except Exception as e:
        rows.append(Row(LABEL["sglang"], "export", "shipped head, --format sglang", False, note=str(e)[-300:]))
    if (SCRIPTS / "fixtures_specforge.py").exists():
        rows += fixture_imports("SpecForge", ("specforge-sglang", "specforge-hf"), convention="sglang", producer="specforge")
    return rows + family_rows("sglang", sglang_family_row)


def sglang_family_row(case: FamilyCase) -> Row:
    """SGLang's draft class and loader on our `sglang` export (check_sglang.py): tensors mapped, its
    draft forward on the case's inputs against ours, and its own target class for the family
    capturing the aux hidden states our head was trained on, where its CPU path runs that class."""
    prefix = case.out / "sglang"
    sh(
        [
            PYTHONS["sglang"],
            SCRIPTS / "check_sglang.py",
            "--head",
            case.export("sglang"),
            "--target",
            case.target_dir,
            "--inputs",
            case.inputs,
            "--out",
            prefix,
        ],
        case.out / "sglang.log",
    )
    res = json.loads(Path(f"{prefix}.json").read_text())
    if not res.get("loaded"):
        return Row(LABEL["sglang"], "export", case.what, False, note=str(res.get("error"))[:300])
    load = res["loader"]
    theirs = load_file(f"{prefix}.safetensors")
    diff = compare(case.ours(), {"hidden": theirs["inputs_hidden"], "logits": theirs["inputs_logits"]})
    unexpected = load["unexpected"] + [n for n in load["skipped"] if n not in SKIPPED_BY_NAME]
    note = loader_note(len(load["mapped"]), load["missing"], unexpected, [n for n in load["skipped"] if n in SKIPPED_BY_NAME], load["from_target"])
    if load["not_intact"]:
        note += f"; values changed on the way: {load['not_intact']}"
    if res.get("target_error"):
        err = res["target_error"]
        note += f"; draft only: SGLang's {res.get('target_class', 'target class')} stopped at {err['stage']}: {err['error'][:200]}"
    else:
        note += (
            f"; its {res['target_class']} captures HF hidden states {res['captured_hidden_state_indices']}, "
            f"trained on {res['trained_hidden_state_indices']}"
        )
    ok = not load["missing"] and not unexpected and not load["not_intact"] and res.get("ids_match_training") is not False
    return Row(LABEL["sglang"], "export", case.what, ok, diff, note=note)


def check_llamacpp(args) -> list[Row]:
    from transformers import AutoModelForCausalLM

    from drafthead.heads.formats import import_head

    tdir, k = smollm2_dir(), 3
    n_prompts = min(args.prompts, 4)
    exp = export(SHIPPED, "llama.cpp", OUT / "exports" / "llamacpp")
    log = OUT / "llamacpp_export.log"
    rows = []
    what = f"shipped head, --format llama.cpp, converted by convert_hf_to_gguf.py (chain {k})"
    try:  # --aux-ids off: the harness must not patch our config.json; our layout must be enough
        sh(
            [
                PYTHONS["llamacpp"],
                SCRIPTS / "check_llamacpp.py",
                "--head",
                exp,
                "--target",
                tdir,
                "--prompts",
                n_prompts,
                "--max-tokens",
                args.max_tokens,
                "--draft-max",
                k,
                "--aux-ids",
                "off",
                "--threads",
                1,
                "--work",
                OUT / "llamacpp-work",
                "--out",
                OUT / "llamacpp_export",
            ],
            log,
            timeout=7200,
        )
        res = json.loads((OUT / "llamacpp_export.json").read_text())
        summary = res["summary"]
        ours, _ = our_chain_acceptance(args, tdir, k, limit=n_prompts)
        rows.append(
            Row(
                "llama.cpp",
                "export",
                what,
                bool(res["loaded"]) and bool(res.get("aux_ids_ok")),
                acceptance=f"llama.cpp {[round(x, 3) for x in summary['acc_rate_per_pos_pooled']]} / ours {[round(x, 3) for x in ours]}",
                note=f"aux ids in the GGUF {res.get('aux_ids_written')}; llama.cpp speculative == plain on all "
                f"{summary['n_prompts']} prompts: {summary['all_spec_equal_plain']}",
            )
        )
        draft = Path(res["draft_gguf"]["path"])
        t = smollm2()
        back = import_head(draft, t.model, t.tokenizer)
        shipped = import_head(SHIPPED, t.model, t.tokenizer)
        diff = max(max_diff(a, b) for a, b in zip(back.state_dict().values(), shipped.state_dict().values()))
        rows.append(Row("llama.cpp", "import", "that GGUF read back into our head", True, diff, note="every tensor compared with the shipped head's"))
    except Exception as e:
        rows.append(Row("llama.cpp", "export", what, False, note=str(e)[-300:]))
    try:  # a GGUF llama.cpp's converter wrote, checked against llama.cpp's own eagle3 graphs
        sh([PYTHONS["llamacpp"], SCRIPTS / "fixtures_llamacpp.py"], OUT / "fixtures_llamacpp.log", timeout=3600)
        target = AutoModelForCausalLM.from_pretrained(FIX / "target", dtype=torch.float32).eval()
        head = import_head(FIX / "llamacpp-eagle3" / "draft.gguf", target)
        ref = load_file(str(FIX / "llamacpp-eagle3" / "reference.safetensors"))
        rows.append(
            Row(
                "llama.cpp",
                "import",
                "llamacpp-eagle3/draft.gguf (its converter; reference: its eagle3 graphs)",
                True,
                compare(our_outputs(head, load_file(str(FIX / "inputs.safetensors"))), ref),
            )
        )
    except Exception as e:
        rows.append(Row("llama.cpp", "import", "fixture GGUF", False, note=str(e)[-300:]))
    return rows + [llamacpp_dspark_row(tdir)] + llamacpp_family_rows()


def llamacpp_dspark_row(tdir: Path) -> Row:
    """llama.cpp's converter on our --format dspark export: every tensor into its DSpark GGUF."""
    from gguf import GGUFReader
    from safetensors import safe_open

    from drafthead.inference.llamacpp.convert import converter

    head_dir, _ = smollm2_dspark()
    exp = export(head_dir, "dspark", OUT / "exports" / "llamacpp-dspark", "smollm2-135m")
    out = OUT / "dspark.gguf"
    what = "untrained DSpark head, --format dspark, converted by convert_hf_to_gguf.py"
    try:
        sh(
            [sys.executable, converter(), exp, "--outtype", "f32", "--outfile", out, "--target-model-dir", tdir],
            OUT / "llamacpp_dspark.log",
            timeout=1800,
        )
    except Exception as e:
        return Row("llama.cpp", "export", what, False, note=str(e)[-300:])
    with safe_open(str(exp / "model.safetensors"), "pt") as f:
        ours = len(list(f.keys()))
    reader = GGUFReader(str(out))
    names = [t.name for t in reader.tensors]
    flags = {
        k.split(".", 1)[1]: bool(reader.fields[k].parts[reader.fields[k].data[0]][0])
        for k in reader.fields
        if k.endswith(("sample_from_anchor", "has_confidence_head"))
    }
    ok = len(names) == ours and {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight"} <= set(names)
    return Row(
        "llama.cpp",
        "export",
        what,
        ok,
        note=f"{ours} tensors in, {len(names)} in the GGUF (markov_w1/w2, conf_proj, fc, ...); {flags}; llama.cpp's DSpark graph is not run here",
    )


def llamacpp_family_rows() -> list[Row]:
    """Our EAGLE-3 export on every tiny target family through llama.cpp's converter and libllama
    (check_llamacpp_families.py, on the libllama `make llamacpp` builds): one row per family."""
    out = OUT / "llamacpp_families.json"
    out.unlink(missing_ok=True)
    try:  # exit 1 when a family fails: its rows say which
        sh([sys.executable, SCRIPTS / "check_llamacpp_families.py", "--out", out], OUT / "llamacpp_families.log")
    except RuntimeError as e:
        if not out.exists():
            return [Row("llama.cpp", "export", "EAGLE-3 head per tiny target family", False, note=str(e)[-300:])]
    rows = []
    for r in json.loads(out.read_text())["families"]:
        loader = r.get("loader", {})
        note = (
            r.get("refusal")
            or r.get("error")
            or loader.get("error")
            or f"{len(r['exported'])} tensors exported, {len(r['gguf'])} in the GGUF (dropped {r['dropped']}, added {r['added']})"
        )
        rows.append(Row("llama.cpp", "export", f"{r['family']} tiny target, EAGLE-3 head, converter + libllama", r["status"] == "loads", note=note))
    return rows


def tiny_head(kind: str, folder: Path) -> Path:
    """A seeded head of `kind` on the fixture target, saved in our format (EAGLE-1 at RoPE base 10000,
    the only base upstream EAGLE runs)."""
    from transformers import AutoModelForCausalLM

    from drafthead.heads.registry import build_head, make_config

    target = AutoModelForCausalLM.from_pretrained(FIX / "target", dtype=torch.float32).eval()
    extra = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}} if kind == "eagle1" else {"num_heads": 3, "num_layers": 1}
    head = build_head(make_config(kind, target, None, name="fixture-target", **extra), target)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    head.save_pretrained(folder)
    return folder


def check_upstream(consumer: str, kind: str, fixture: str, convention: str | None) -> list[Row]:
    from transformers import AutoModelForCausalLM

    from drafthead.heads.formats import import_head

    label = {"eagle": "eagle-llm (upstream EAGLE)", "medusa": "medusa-llm (upstream Medusa)"}[consumer]
    ours_dir = tiny_head(kind, OUT / f"tiny-{kind}")
    exp = export(ours_dir, consumer, OUT / "exports" / consumer, FIX / "target")
    log = OUT / f"{consumer}_export.log"
    rows = []
    try:
        sh(
            [
                PYTHONS[consumer],
                SCRIPTS / f"check_{consumer}.py",
                "--head",
                exp,
                "--target",
                FIX / "target",
                "--inputs",
                FIX / "inputs.safetensors",
                "--out",
                OUT / f"{consumer}_export",
            ],
            log,
        )
        theirs = load_file(str(OUT / f"{consumer}_export.safetensors"))
        target = AutoModelForCausalLM.from_pretrained(FIX / "target", dtype=torch.float32).eval()
        ours = our_outputs(import_head(ours_dir, target), load_file(str(FIX / "inputs.safetensors")))
        rows.append(Row(label, "export", f"seeded {kind} head on the fixture target", True, compare(ours, theirs)))
    except Exception as e:
        rows.append(Row(label, "export", f"seeded {kind} head on the fixture target", False, note=str(e)[-300:]))
    rows += [
        Row(label, r.direction, r.what, r.loaded, r.max_diff, r.acceptance, r.note)
        for r in fixture_imports(consumer, (fixture,), convention=convention)
    ]
    return rows


def check_dflash(args) -> list[Row]:
    """z-lab's `dflash` package loads our DFlash export (a trained head with --dflash-head, else an
    untrained one) and generates with it on SmolLM2; its output and acceptance per verify are
    compared with our engine's chain drafting of the same head on the same prompts."""
    from drafthead.inference.drafters.parallel import DFlashDrafter
    from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
    from drafthead.inference.bench.prompts import encode_chat, load_prompts

    rows, t = [], smollm2()
    head_dir = Path(args.dflash_head) if args.dflash_head else smollm2_untrained("dflash", OUT / "smollm2-dflash", block_size=4, mask_token_id=16)
    what = f"{'DFlash head ' + head_dir.name if args.dflash_head else 'untrained DFlash head'}, --format dflash"
    exp = export(head_dir, "dflash", OUT / "exports" / "dflash")
    prompts = [encode_chat(t.tokenizer, p)[0].tolist() for p in load_prompts("mt-bench", args.prompts)]
    (OUT / "dflash_prompts.json").write_text(json.dumps({"prompt_token_ids": prompts}))
    try:
        sh(
            [
                PYTHONS["dflash"],
                SCRIPTS / "check_dflash.py",
                "--head",
                exp,
                "--target",
                smollm2_dir(),
                "--prompts",
                OUT / "dflash_prompts.json",
                "--max-tokens",
                args.max_tokens,
                "--out",
                OUT / "dflash_export",
            ],
            OUT / "dflash_export.log",
            timeout=7200,
        )
        theirs = json.loads((OUT / "dflash_export.json").read_text())
    except Exception as e:
        return [Row("dflash (z-lab)", "export", what, False, note=str(e)[-300:])]
    from drafthead.heads.registry import load_head

    head, _ = load_head(head_dir, t.model, t.tokenizer)
    same_tokens, same_rounds, ours_all, theirs_all = 0, 0, [], []
    for ids, new, lengths in zip(prompts, theirs["new_tokens"], theirs["acceptance_lengths"]):
        result = speculative_generate(t.model, DFlashDrafter(head), torch.tensor([ids]), GenerationConfig(max_new_tokens=len(new)))
        rounds = result.accepted_lengths  # tokens each round emitted, the target's own included
        same_tokens += result.new_tokens[0].tolist() == new
        # the package's first token comes from its prefill, our first round's from drafting on the
        # prompt: when that round accepted nothing, our rounds 2.. are its verify steps 1..; its last
        # block is cut to the tokens left, so that one is not compared
        aligned = rounds[1 : len(lengths)] if rounds[0] == 1 else None
        same_rounds += aligned == lengths[:-1]
        ours_all += rounds[1 : len(lengths)]
        theirs_all += lengths[:-1]
    n = len(prompts)
    mean = lambda xs: round(sum(xs) / max(len(xs), 1), 3)  # noqa: E731
    rows.append(
        Row(
            "dflash (z-lab)",
            "export",
            what,
            True,
            acceptance=f"dflash tau {mean(theirs_all)} / ours {mean(ours_all)} (block {theirs['block_size']})",
            note=f"same tokens on {same_tokens}/{n} prompts, same acceptance every round on {same_rounds}/{n}; dflash {theirs['versions']['dflash']}",
        )
    )
    return rows + [dflash_fixture_import()]


def dflash_fixture_import() -> Row:
    """The package writes a draft (fixtures_dflash.py); we import it and draft the same block."""
    from transformers import AutoModelForCausalLM

    from drafthead.heads.formats import import_head

    sh([PYTHONS["dflash"], SCRIPTS / "fixtures_dflash.py"], OUT / "fixtures_dflash.log")
    meta = json.loads((FIX / "dflash" / "meta.json").read_text())
    what = f"dflash fixture ({meta['package']} {meta['version']})"
    target = AutoModelForCausalLM.from_pretrained(FIX / "target", dtype=torch.float32).eval()
    try:
        head = import_head(FIX / "dflash", target)
    except Exception as e:  # the row says why
        return Row("dflash (z-lab)", "import", what, False, note=str(e)[:200])
    ref = load_file(str(FIX / "dflash" / "reference.safetensors"))
    n = ref["context"].shape[1]
    with torch.no_grad():
        hs = target(ref["context"], output_hidden_states=True).hidden_states
        context = head.context(head.fuse([hs[i] for i in head.feature_layers]), torch.arange(n)[None])
        logits = head.draft_logits(ref["block"][:, 0], n, context)
    return Row("dflash (z-lab)", "import", what, True, max_diff(logits, ref["logits"]))


CHECKS = {
    "speculators": check_speculators,
    "vllm": check_vllm,
    "sglang": check_sglang,
    "llamacpp": check_llamacpp,
    "eagle": lambda args: check_upstream("eagle", "eagle1", "eagle1", "eagle"),
    "medusa": lambda args: check_upstream("medusa", "medusa1", "medusa", None),
    "dflash": check_dflash,
}


# ----------------------------------------------------------------------------- report


def table(rows: list[Row]) -> str:
    lines = [
        "| consumer | direction | what | loaded | max logit diff | acceptance (per position) | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        diff = "-" if r.max_diff is None else f"{r.max_diff:.1e}"
        lines.append(
            f"| {r.consumer} | {r.direction} | {r.what} | {'yes' if r.ok else 'NO'} | {diff} | {r.acceptance} | {r.note.replace('|', '/')} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(CONSUMERS), help=f"comma-separated subset of {','.join(CONSUMERS)}")
    p.add_argument("--prompts", type=int, default=8, help="MT-bench first turns for the generation checks")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-setup", action="store_true", help="use the venvs as they are")
    p.add_argument("--dflash-head", help="a trained DFlash head folder (ours) for the dflash check")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for consumer in [c for c in args.only.split(",") if c]:
        if consumer not in CHECKS:
            p.error(f"unknown consumer {consumer!r}")
        start = time.time()
        try:
            if not args.no_setup:
                setup(consumer)
            rows += CHECKS[consumer](args)
        except Exception as e:  # one consumer's failure is a row, not the end of the run
            rows.append(Row(consumer, "-", "setup / run", False, note=" ".join(str(e).split())[-300:]))
        print(f"[interop] {consumer}: {time.time() - start:.0f} s", flush=True)
        (OUT / "report.json").write_text(json.dumps([{**asdict(r), "ok": r.ok} for r in rows], indent=1))
    text = table(rows)
    (OUT / "report.md").write_text(text + "\n")
    print(text)
    return 0 if rows and all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
