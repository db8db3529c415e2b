"""A run's eval curves as a picture: output_dir/eval.png, drawn from metrics.jsonl when the run ends.

Left panel, tokens per round against the step: `tau_est` (a product of per-depth top-1
accuracies, train/loop/evaluate.py) beside the replayed `replay_tau` and `replay_tree_tau`
(train/loop/replay_eval.py), so the gap between the estimate and what an engine measures is visible
over the whole run. Right panel, per depth at the last eval: the share of rounds keeping draft i
as tau_est assumes it, prod_{j<=i} acc_j, against the replayed share `replay_acc_i`. A resumed run appends to metrics.jsonl, so the picture
covers every sitting.
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from pathlib import Path

EVAL_PLOT = "eval.png"
_DEPTH = re.compile(r"^(acc|replay_acc)_(\d+)$")


def eval_records(metrics_file: str | Path) -> list[dict]:
    """The eval lines of a metrics.jsonl, in step order (a resumed run's repeated steps: the last wins)."""
    by_step: dict[int, dict] = {}
    for line in Path(metrics_file).read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("split") == "eval":
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def plot_eval_curves(metrics_file: str | Path, path: str | Path) -> Path | None:
    """Draw eval.png from `metrics_file`; None (nothing drawn) when it holds no eval."""
    records = eval_records(metrics_file)
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (taus, depths) = plt.subplots(1, 2, figsize=(12, 4.2))
    for key, style in (("tau_est", "--"), ("replay_tau", "-"), ("replay_tree_tau", ":"), ("replay_vllm_tau", "-.")):
        points = [(s, r[key]) for s, r in zip(steps, records) if key in r]
        if points:
            taus.plot(*zip(*points), style, marker="o", label=key)
    taus.set(title="tokens per round", xlabel="step", ylabel="tau")
    taus.legend()
    last = records[-1]
    accs = sorted((int(m.group(2)), v) for k, v in last.items() if (m := _DEPTH.match(k)) and m.group(1) == "acc")
    if accs:  # tau_est's assumption: draft i is kept with probability prod_{j<=i} acc_j
        depths.plot(
            [i for i, _ in accs],
            list(itertools.accumulate((v for _, v in accs), operator.mul)),
            "--",
            marker="o",
            label="prod of acc_j, j <= i (tau_est)",
        )
    replayed = sorted((int(m.group(2)), v) for k, v in last.items() if (m := _DEPTH.match(k)) and m.group(1) == "replay_acc")
    if replayed:
        depths.plot(*zip(*replayed), "-", marker="o", label="replay_acc_i")
    depths.set(title=f"draft i kept, at step {last['step']}", xlabel="depth i", ylabel="share of rounds", ylim=(0, 1))
    depths.xaxis.get_major_locator().set_params(integer=True)
    depths.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
