"""speculators' own EAGLE-3 training loss and gradients on one batch, beside ours.

Run with the speculators venv (scripts/interop/setup_speculators.sh); scripts/interop/run.py
(`--only speculators`) writes the inputs with our code and reads the result:

    .venv-interop/speculators/bin/python scripts/interop/check_speculators_trainer.py \
        --batch BATCH.safetensors --head NAME=DIR [--head ...] --target DIR \
        --reference NAME=OURS.safetensors [...] --out PREFIX [--steps 1 2 3] [--decay 0.8] \
        [--trainer-smoke WORKDIR]

Inputs (written by run.py from our pipeline):
  BATCH   per sequence b, unshifted, as a speculators data file holds them:
            {b}/input_ids [T], {b}/loss_mask [T] (1 on assistant tokens, our chat formatting),
            {b}/hidden_states [T, 3H] (target inputs of the aux layers, concatenated),
            {b}/verifier_last_hidden_states [T, H] (the last decoder layer's output, before the
            target's final norm: what speculators' data holds and its verifier_norm expects)
  DIR     our EAGLE-3 head exported with `drafthead export --format speculators`
  OURS    our head's loss and gradients on the same batch (run.py: `k{k}/...` for k TTT steps)

What runs, all speculators' own code: `SpeculatorModel.from_pretrained(DIR)` (verifier path set
to --target, attention 'eager', float32, train mode); the samples through its dataset step
(lengths, position_ids 0..T-1), its EAGLE-3 `shift_batch` and its packing `CollateFn` (one row,
document ids); then its forward exactly as its Trainer calls it, `model(**batch, **train_kwargs)`
with the kwargs of `Eagle3DraftModel.get_trainer_kwargs` (loss kl_div, eager implementation,
--decay per TTT step), and `loss.backward()`. No autocast: its trainer runs the forward under
bf16 autocast, which would hide float32-level differences.

Two loss masks per batch:
  native   the loss_mask as a speculators dataset holds it (shift_batch pairs the mask of token
           t+1, the token fed at column t, with the prediction of token t+2)
  ours     the same mask read one token later (the mask of the predicted token, our convention:
           heads/io.py shifted_labels), so both sides weigh the same positions

speculators' trainer freezes the draft's lm_head (its verifier-weight loader sets
requires_grad False); the check turns it back on so that its gradient can be compared too, and
records which parameters the trainer would have trained.

--trainer-smoke WORKDIR: write the batch as a speculators data folder (save_to_disk rows,
hidden_states/hs_{i}.safetensors, d2t/t2d .npy) and run `speculators train` on it on CPU from the
first head's export (--from-pretrained) for --train-steps steps (AdamW at --lr, decaying
linearly to 0, no warmup, one packed batch a step) with eager attention and losses in float32
(its fused losses need Triton; its flex attention has no backward on CPU): as shipped, then
with its two device calls patched (_PATCHED_CLI); PREFIX.json records how far each got (the
exception, file and line where it stopped) and the metrics it logged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

PARAM_GROUPS = (  # (group, name prefix): the first match names a parameter's group
    ("fc", "fc."),
    ("input_norm", "input_norm."),
    ("fc_norm", "fc_norm."),
    ("attention", "layers.0.self_attn."),
    ("mlp", "layers.0.mlp."),
    ("layer norms", "layers.0."),
    ("final norm", "norm."),
    ("lm_head", "lm_head."),
)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--head", action="append", required=True, help="NAME=DIR (speculators export)")
    ap.add_argument("--reference", action="append", default=[], help="NAME=FILE (our loss and gradients)")
    ap.add_argument("--target", required=True, help="local verifier folder (SmolLM2-135M)")
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--decay", type=float, default=0.8, help="ttt_step_loss_decay (ours: ttt_decay)")
    ap.add_argument("--out", required=True, help="PREFIX: PREFIX.json (+ PREFIX.safetensors, their gradients)")
    ap.add_argument("--trainer-smoke", default=None, help="WORKDIR: also try `speculators train` on CPU")
    ap.add_argument("--lr", type=float, default=1e-4, help="--trainer-smoke: AdamW learning rate (linear decay)")
    ap.add_argument("--train-steps", type=int, default=3, help="--trainer-smoke: optimizer steps")
    return ap.parse_args()


def pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def where(e: BaseException) -> list[str]:
    """The last frames of an exception's traceback, as file:line:function."""
    return [f"{f.filename}:{f.lineno}:{f.name}" for f in traceback.extract_tb(e.__traceback__)][-4:]


def read_samples(path: str) -> list[dict]:
    from safetensors.torch import load_file

    flat = load_file(path)
    n = 1 + max(int(k.split("/")[0]) for k in flat)
    return [{k.split("/", 1)[1]: v for k, v in flat.items() if k.startswith(f"{b}/")} for b in range(n)]


def load_draft(head: str, target: str):
    """speculators' loader, as check_speculators.py's harness load: verifier path := target."""
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(head)
    cfg.speculators_config.verifier.name_or_path = target
    cfg.transformer_layer_config._attn_implementation = "eager"  # noqa: SLF001
    return SpeculatorModel.from_pretrained(head, config=cfg).float().train()


def packed_batch(samples: list[dict], mask: str, hidden_size: int) -> dict:
    """speculators' own data path on our samples: its dataset step (lengths, position_ids), its
    EAGLE-3 shift_batch and its packing CollateFn, one row holding every sequence."""
    import torch

    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    rows = []
    for s in samples:
        T = s["input_ids"].shape[0]
        loss_mask = s["loss_mask"].bool()
        if mask == "ours":  # read one token later: the mask of the predicted token
            loss_mask = torch.cat([loss_mask[1:], loss_mask.new_zeros(1)])
        rows.append(
            {
                "input_ids": s["input_ids"].long(),
                "hidden_states": s["hidden_states"].float(),
                "verifier_last_hidden_states": s["verifier_last_hidden_states"].float(),
                "loss_mask": loss_mask,
                "lengths": torch.tensor([T]),
                "position_ids": torch.arange(T),
            }
        )
    max_len = sum(r["input_ids"].shape[0] - 1 for r in rows)
    return CollateFn(max_len, hidden_size, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch)(rows)


def group_of(name: str) -> str:
    return next(g for g, prefix in PARAM_GROUPS if name.startswith(prefix))


def compare_grads(theirs: dict, ours: dict) -> dict:
    """Per parameter group: the largest max|g_theirs - g_ours| / max|g_ours| over its tensors."""
    groups: dict[str, float] = {}
    missing = sorted(set(theirs) ^ set(ours))
    for name in sorted(set(theirs) & set(ours)):
        a, b = theirs[name].float(), ours[name].float()
        rel = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        groups[group_of(name)] = max(groups.get(group_of(name), 0.0), rel)
    return {"max_rel_grad_diff": groups, "unmatched": missing}


def parity(args, samples: list[dict], head: str, reference: str | None) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    from speculators.models.eagle3 import Eagle3DraftModel

    model = load_draft(head, args.target)
    trained_by_their_trainer = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    model.lm_head.weight.requires_grad_(True)
    ours = load_file(reference) if reference else {}
    result = {"trained_by_their_trainer": trained_by_their_trainer, "runs": []}
    grads_out = {}
    for mask in ("native", "ours"):
        batch = packed_batch(samples, mask, model.config.transformer_layer_config.hidden_size)
        for k in args.steps:
            kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
                ttt_steps=k, ttt_step_loss_decay=args.decay, loss_fn="kl_div", loss_implementation="eager"
            )
            model.zero_grad(set_to_none=True)
            _, loss, metrics = model(**batch, **kwargs)
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            grads_out.update({f"{mask}/k{k}/{n}": g for n, g in grads.items()})
            run = {"mask": mask, "ttt_steps": k, "loss": float(loss), "step_losses": [float(metrics[f"loss_{i}_sum"]) for i in range(k)]}
            if ours:
                mine = {n[len(f"k{k}/grad/") :]: g for n, g in ours.items() if n.startswith(f"k{k}/grad/")}
                run.update({"ours_kl": float(ours[f"k{k}/loss_kl"]), "ours_ce": float(ours[f"k{k}/loss_ce"]), **compare_grads(grads, mine)})
            result["runs"].append(run)
    return result, grads_out


# ----------------------------------------------------------------------------- trainer smoke


def write_data_folder(samples: list[dict], head: str, work: Path) -> Path:
    """The batch as a speculators data folder: save_to_disk rows (input_ids, loss_mask, seq_len),
    hidden_states/hs_{i}.safetensors (token_ids, hidden_states [T, 4, H]: the three aux layers then
    the last one) and the head's own draft vocabulary as d2t-/t2d-{size}.npy."""
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file, save_file

    data = work / "data"
    rows = {
        "input_ids": [s["input_ids"].tolist() for s in samples],
        "loss_mask": [s["loss_mask"].long().tolist() for s in samples],
        "seq_len": [int(s["input_ids"].shape[0]) for s in samples],
    }
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(data))
    (data / "hidden_states").mkdir(exist_ok=True)
    for i, s in enumerate(samples):
        T, H = s["verifier_last_hidden_states"].shape
        hs = torch.cat([s["hidden_states"].float().reshape(T, 3, H), s["verifier_last_hidden_states"].float()[:, None]], 1)
        save_file({"token_ids": s["input_ids"].long(), "hidden_states": hs.contiguous()}, str(data / "hidden_states" / f"hs_{i}.safetensors"))
    weights = load_file(str(Path(head) / "model.safetensors"))
    d2t, t2d = weights["d2t"], weights["t2d"]
    np.save(data / f"d2t-{d2t.numel()}.npy", d2t.numpy())
    np.save(data / f"t2d-{d2t.numel()}.npy", t2d.numpy())
    return data


# The second attempt's driver: speculators' CLI with the two device calls that have no CPU form
# patched: its Trainer moves the model to `get_local_rank()` (device index 0; here "cpu"), and its
# step timer calls torch.accelerator.synchronize() on every logged step (here a no-op). Each
# metrics record its trainer logs is printed as one JSON line.
_PATCHED_CLI = """
import json, logging, sys
import torch
import speculators.train.trainer as trainer
trainer.get_local_rank = lambda: "cpu"
torch.accelerator.synchronize = lambda *a, **k: None
class Lines(logging.Handler):
    def emit(self, record):
        if isinstance(record.msg, dict) and "train" in record.msg:
            print("METRICS " + json.dumps({"step": record.msg["global_step"], "lr": record.msg["lr"],
                  **{k: v for k, v in record.msg["train"].items() if k.startswith(("loss", "full_acc"))}}), flush=True)
import speculators.train.cli as cli
configure = cli.setup_metric_logger
def setup_metric_logger(*a, **k):  # its logging config replaces earlier handlers: add ours after it
    configure(*a, **k)
    logging.getLogger("speculators.metrics").addHandler(Lines())
cli.setup_metric_logger = setup_metric_logger
from speculators.__main__ import app
sys.argv = ["speculators", *sys.argv[1:]]
app()
"""


def trainer_smoke(args, samples: list[dict], head: str) -> dict:
    """`speculators train` on CPU, as small as it goes, starting from our export
    (--from-pretrained): as shipped, then with its device calls patched (_PATCHED_CLI).
    For each: the error and the last frames where it stopped, or the metrics it logged."""
    work = Path(args.trainer_smoke)
    work.mkdir(parents=True, exist_ok=True)
    data = write_data_folder(samples, head, work)
    start = work / "init"  # the export, its verifier pointed at the local target folder
    start.mkdir(exist_ok=True)
    cfg = json.loads((Path(head) / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = args.target
    (start / "config.json").write_text(json.dumps(cfg, indent=1))
    (start / "model.safetensors").unlink(missing_ok=True)
    (start / "model.safetensors").symlink_to(Path(head).resolve() / "model.safetensors")
    flags = [
        "train",
        "--speculator-type",
        "eagle3",
        "--verifier-name-or-path",
        args.target,
        "--from-pretrained",
        str(start),
        "--data-path",
        str(data),
        "--draft-vocab-size",
        str(cfg["draft_vocab_size"]),
        "--total-seq-len",
        "512",
        "--train-data-ratio",
        "0.75",
        "--hidden-states-dtype",
        "float32",
        "--num-workers",
        "0",
        "--draft-attn-impl",
        "eager",
        "--loss-implementation",
        "eager",
        "--loss-fn",
        "kl_div",
        "--ttt-steps",
        str(max(args.steps)),
        "--ttt-step-loss-decay",
        str(args.decay),
        "--optimizer",
        "adamw",
        "--lr",
        str(args.lr),
        "--max-steps",
        str(args.train_steps),
        "--epochs",
        str(args.train_steps),
        "--on-missing",
        "raise",
        "--logger",
        "",
        "--no-resume-from-checkpoint",
    ]
    # plain tracebacks (typer's framed ones hide the file names) so the stopping frame can be read
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "_TYPER_STANDARD_TRACEBACK": "1"}
    bin_dir = Path(sys.executable).parent
    attempts = {"as shipped": [str(bin_dir / "speculators")], "device calls patched": [sys.executable, "-c", _PATCHED_CLI]}
    out = {}
    for name, launcher in attempts.items():
        tag = name.split()[0]
        cmd = launcher + flags + ["--save-path", str(work / tag / "checkpoints"), "--log-dir", str(work / tag / "logs")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        log = proc.stdout + proc.stderr
        (work / f"{tag}.log").write_text(log)
        frames = [line.strip() for line in log.splitlines() if line.strip().startswith('File "')]
        errors = [line for line in log.splitlines() if line and not line.startswith(" ") and "Error" in line.split(":")[0]]
        out[name] = {
            "returncode": proc.returncode,
            "last_frames": frames[-4:] if proc.returncode else [],
            "error": errors[-1] if errors and proc.returncode else None,
            "log": str(work / f"{tag}.log"),
            "metrics": [json.loads(line[len("METRICS ") :]) for line in log.splitlines() if line.startswith("METRICS ")],
        }
    out["flags"] = " ".join(flags)
    return out


def main() -> int:
    args = parse()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import importlib.metadata as md

    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    samples = read_samples(args.batch)
    heads, refs = pairs(args.head), pairs(args.reference)
    result: dict = {
        "versions": {n: md.version(n) for n in ("speculators", "torch", "transformers")},
        "sequences": len(samples),
        "tokens": [int(s["input_ids"].shape[0]) for s in samples],
        "decay": args.decay,
        "heads": {},
    }
    grads = {}
    ok = True
    for name, head in heads.items():
        try:
            result["heads"][name], g = parity(args, samples, head, refs.get(name))
            grads.update({f"{name}/{k}": v for k, v in g.items()})
        except Exception as e:  # noqa: BLE001  (the JSON says where)
            result["heads"][name] = {"error": f"{type(e).__name__}: {e}"[:800], "where": where(e)}
            ok = False
    if args.trainer_smoke:
        result["trainer_smoke"] = trainer_smoke(args, samples, next(iter(heads.values())))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in grads.items()}, f"{args.out}.safetensors")
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"ok": ok, "out": f"{args.out}.json"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
