"""The best head of a run by one eval metric (`keep_best`), kept in output_dir/best.

The folder is a head folder like `final` (loadable by bench, generate, export) plus best.json,
{"step", "metric", "value"}: the eval that put it there. A resumed run reads best.json first, so
it replaces the head only with a better one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

BEST_DIR = "best"
BEST_FILE = "best.json"


def improves(value: float | None, best: float | None) -> bool:
    """Whether an eval's `value` of the metric beats the best so far (None: there is none yet).
    Higher is better; a missing or non-finite value never wins."""
    if value is None or not math.isfinite(value):
        return False
    return best is None or value > best


def best_so_far(output_dir: str | Path, metric: str) -> float | None:
    """The value in output_dir/best/best.json when it was kept by `metric`, else None."""
    file = Path(output_dir) / BEST_DIR / BEST_FILE
    if not file.is_file():
        return None
    record = json.loads(file.read_text())
    return float(record["value"]) if record.get("metric") == metric else None


def write_record(folder: Path, step: int, metric: str, value: float) -> None:
    (folder / BEST_FILE).write_text(json.dumps({"step": step, "metric": metric, "value": value}) + "\n")
