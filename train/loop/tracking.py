"""Where a run reports: `output_dir/metrics.jsonl`, a tqdm bar, wandb (offline by default), and
at the end `output_dir/eval.png`, the eval curves (train/loop/curves.py).

Only the main process reports (docs/style.md 8); on other processes every method is a no-op.
wandb runs offline unless the user set WANDB_MODE: nothing here reaches a server by default.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from ...ground.files import atomic_write
from .curves import EVAL_PLOT, plot_eval_curves

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id"


class RunLog:
    def __init__(
        self,
        output_dir: str | Path,
        *,
        is_main: bool,
        total_steps: int,
        initial_step: int = 0,
        report_to: str = "none",
        project: str = "drafthead",
        run_name: str | None = None,
        config: dict | None = None,
        progress: bool = True,
    ) -> None:
        self.is_main = is_main
        self.dir = Path(output_dir)
        self.bar = None
        self.wandb = None
        if not is_main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if initial_step > 0:  # a resume runs the steps after its checkpoint again: log them once
            drop_metrics_after(self.dir / METRICS_FILE, initial_step)
        self._file = open(self.dir / METRICS_FILE, "a")
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True)
        if report_to == "wandb":
            os.environ.setdefault("WANDB_MODE", "offline")  # the user's choice wins
            import wandb

            id_file = self.dir / WANDB_ID_FILE  # the same wandb run continues after --resume
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            id_file.write_text(run_id)
            self.wandb = wandb.init(project=project, name=run_name, id=run_id, resume="allow", dir=str(self.dir), config=config or {})

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def event(self, name: str, message: str | None = None, **info: Any) -> None:
        """A one-off record (start, resume, checkpoint, end), printed when `message` is given."""
        if not self.is_main:
            return
        self._write({"event": name, "time": time.time(), **info})
        if message:
            self.write(message)

    def metrics(self, step: int, split: str, values: dict[str, float]) -> None:
        """One line in metrics.jsonl and `split/<name>` in wandb."""
        if not self.is_main:
            return
        self._write({"step": step, "split": split, "time": time.time(), **values})
        if self.wandb is not None:
            self.wandb.log({f"{split}/{k}": v for k, v in values.items()}, step=step)

    def progress(self, step: int, **postfix: Any) -> None:
        if self.bar is None:
            return
        self.bar.n = step
        if postfix:
            self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()}, refresh=False)
        self.bar.refresh()

    def write(self, message: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        self._file.close()
        try:  # a picture that cannot be drawn must not cost the run it describes
            plot_eval_curves(self.dir / METRICS_FILE, self.dir / EVAL_PLOT)
        except Exception as e:  # noqa: BLE001 - said on stderr, the run's files are already written
            print(f"drafthead: eval curves not drawn ({type(e).__name__}: {e})", flush=True)


def drop_metrics_after(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl without the train and eval records of steps after `step` (a run
    stopped after logging them, before their checkpoint: the resume from `step` logs them anew)
    and without a line a kill cut short; events stay, as history. Unchanged when there is none."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # cut short mid-write
        if isinstance(record, dict) and "split" in record and isinstance(record.get("step"), int) and record["step"] > step:
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        atomic_write(path, lambda tmp: Path(tmp).write_text("".join(kept), encoding="utf-8"))
