"""The background trainer of `drafthead serve --adapt DIR`: a process of its own, started by the
server with `threads` torch threads at the idle priority (`_yield_to_serving`), stopped with it.

    python -m drafthead.train.adapt.worker DIR

Each round, once the buffer (train/adapt/buffer.py) has taken `min_new_tokens` since the last:
1. the buffer's answers split by time: the newest `holdout` are held out, the rest train;
2. a copy of the live head (train/adapt/versions.py) is fine-tuned on them for `steps` optimizer
   steps by the Trainer `drafthead train` runs (captured-features mode: the same loss, optimizer
   and schedule code);
3. the gate (train/adapt/gate.py) replays the live and the candidate drafter, with the served
   drafting settings, on the held-out answers; a candidate that beats the live head by `margin`
   is installed as the next version and logged `accepted` (the server swaps it in), else logged
   `rejected` with its figures;
4. when the candidate fails and the live head is not the one the server started with (v0000),
   v0000 is replayed on the same answers: if it beats the live head by `margin` (the traffic moved
   away from what the adapted heads learned), a copy of it is installed as the next version and
   logged `accepted` with `"restores": 0`.

Its settings are DIR/adapt.json, written by the server (`AdaptSettings`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

SETTINGS_FILE = "adapt.json"
PRIORITIES = ("idle", "low")
WORK_DIR = "work"


@dataclass(frozen=True)
class AdaptSettings:
    target: str  # what load_target reads (a built-in name or a folder)
    target_dtype: str = "float32"
    target_name: str | None = None  # the served target's name (head identity checks)
    drafting: dict = field(default_factory=dict)  # how the served head drafts (HeadDrafting.to_dict: DraftSpec's, resolved)
    threads: int = 1  # torch threads of the trainer
    priority: str = "idle"  # PRIORITIES: idle (SCHED_IDLE) or low (nice 10)
    min_new_tokens: int = 2000  # buffered answer tokens between rounds
    holdout: int = 16  # newest answers held out for the gate
    steps: int = 60  # optimizer steps a round
    lr: float = 1e-4
    batch_size: int = 4
    margin: float = 0.02  # the candidate's replayed tau must beat the live one's by this share
    poll: float = 2.0  # seconds between looks at the buffer

    def __post_init__(self) -> None:
        for name in ("threads", "min_new_tokens", "holdout", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--adapt-{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"--adapt-priority must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")
        if not (0 < self.lr < 1) or not (0 <= self.margin < 10):
            raise ValueError(f"--adapt-lr must be in (0, 1) and --adapt-margin in [0, 10), got {self.lr}, {self.margin}")

    def save(self, folder: Path) -> None:
        from ..capture.workshare import write_atomically

        write_atomically(Path(folder) / SETTINGS_FILE, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, folder: Path) -> "AdaptSettings":
        return cls(**json.loads((Path(folder) / SETTINGS_FILE).read_text()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the background trainer of drafthead serve --adapt")
    parser.add_argument("folder")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    settings = AdaptSettings.load(folder)
    _stop_with_parent()
    _yield_to_serving(settings.priority)
    import torch

    torch.set_num_threads(settings.threads)
    Worker(folder, settings).run()
    return 0


def _yield_to_serving(priority: str) -> None:
    """idle: train only on the cycles serving leaves (Linux SCHED_IDLE: the trainer runs when no
    other task wants the core; elsewhere nice 19). low: nice 10, a small share of a busy CPU,
    taken from the target's threads' time slices."""
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            pass
    os.nice(19 if priority == "idle" else 10)


def _stop_with_parent() -> None:
    """SIGTERM when the server dies (Linux prctl PR_SET_PDEATHSIG), and exit on SIGTERM."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


class Worker:
    def __init__(self, folder: Path, settings: AdaptSettings):
        from ...ground.target.identity import text_config
        from ...ground.target.load import load_target

        self.folder, self.settings = folder, settings
        self.loaded = load_target(settings.target, dtype=settings.target_dtype)
        self.num_layers = text_config(self.loaded.model).num_hidden_layers
        self.trained_upto = -1  # the newest buffer shard the last round saw

    def run(self) -> None:
        from .buffer import BUFFER_DIR

        buffer = self.folder / BUFFER_DIR
        while True:
            index = _read_index(buffer)
            new = sum(s["num_tokens"] for s in index.get("shards", []) if _number(s) > self.trained_upto)
            if new < self.settings.min_new_tokens or not index.get("shards"):
                time.sleep(self.settings.poll)
                continue
            self.trained_upto = max(_number(s) for s in index["shards"])
            self.round(buffer)

    def round(self, buffer: Path) -> None:
        """One round: train a candidate from the live version, gate it, log what happened."""
        from .gate import gate, replayed_tau
        from .versions import append_event, install_version, live_version, version_dir

        samples = _open_features(buffer)
        n = len(samples)
        holdout = min(self.settings.holdout, max(1, n // 4))
        if n - holdout < 1:
            return
        parent = live_version(self.folder)
        candidate_dir = self.train(samples, range(n - holdout), version_dir(self.folder, parent.version))
        held_out = [samples[i] for i in range(n - holdout, n)]
        result = gate(
            self.drafter(version_dir(self.folder, parent.version)), self.drafter(candidate_dir), held_out, self.num_layers, self.settings.margin
        )
        figures = {**result.to_dict(), "train_answers": n - holdout, "train_tokens": _tokens(samples, range(n - holdout))}
        if not result.passed and parent.version != 0:
            # the traffic may have moved away from what the live head learned: the head the server
            # started with, replayed on the same newest answers, comes back when it beats the live one
            base_tau, base_rounds = replayed_tau(self.drafter(version_dir(self.folder, 0)), held_out, self.num_layers)
            base = replace(result, candidate_tau=base_tau, rounds=base_rounds)  # the live head's replay is result's
            if base.passed:
                candidate_dir, result = version_dir(self.folder, 0), base
                figures |= {**base.to_dict(), "restores": 0, "rejected_candidate_tau": figures["candidate_tau"]}
        now = live_version(self.folder)
        if not result.passed or now.version != parent.version:  # the server rolled back while this trained
            reason = result.reason if not result.passed else f"version {parent.version} is no longer live (now {now.version})"
            append_event(self.folder, {"event": "rejected", "parent": parent.version, "gate": figures, "reason": reason})
            return
        version = now.latest + 1
        install_version(self.folder, version, candidate_dir)
        append_event(self.folder, {"event": "accepted", "version": version, "parent": parent.version, "gate": figures})

    def train(self, samples, indices, parent_dir: Path) -> Path:
        """A copy of the head at `parent_dir` fine-tuned on samples[indices]; -> its folder."""
        import torch

        from ...heads.registry import load_head
        from ..loop.config import DataConfig, FeaturesConfig, TrainConfig
        from ..loop.run import pad_token_id
        from ..loop.trainer import TrainData, Trainer

        s = self.settings
        head, _ = load_head(parent_dir, self.loaded.model, self.loaded.tokenizer, s.target_name, dtype=torch.float32)
        out = self.folder / WORK_DIR / "candidate"
        shutil.rmtree(out, ignore_errors=True)  # the last round's scratch: only this worker writes there
        config = TrainConfig(
            target=s.target,
            head={"kind": head.kind},
            features=FeaturesConfig(mode="captured", path=str(self.folder)),
            data=DataConfig(packing=False),  # served answers run up to the server's context, past any packed row
            batch_size=s.batch_size,
            lr=s.lr,
            schedule="constant",
            max_steps=s.steps,
            checkpoint_every=0,
            eval_every=0,
            log_every=max(1, s.steps // 4),
            output_dir=str(out),
            threads=s.threads,
        )
        data = TrainData(
            train=torch.utils.data.Subset(samples, list(indices)), eval=None, featurize=None, pad_token_id=pad_token_id(self.loaded.tokenizer)
        )
        result = Trainer(config, head.train(), data).fit(progress=False)
        assert result.final_dir is not None  # a whole run ends with its final head
        drafting = parent_dir / "drafting.json"
        if drafting.exists():  # the served drafting settings travel with every version
            shutil.copy(drafting, result.final_dir / "drafting.json")
        return result.final_dir

    def drafter(self, head_dir: Path):
        from ...inference.drafters.load import load_head_drafter
        from ...inference.drafters.settings import HeadDrafting

        drafting = HeadDrafting.from_dict(self.settings.drafting) if self.settings.drafting else HeadDrafting()
        drafter, _ = load_head_drafter(head_dir, self.loaded.model, self.loaded.tokenizer, self.settings.target_name, drafting)
        return drafter


def _read_index(buffer: Path) -> dict:
    try:
        return json.loads((buffer / "index.json").read_text())
    except (OSError, ValueError):
        return {}


def _number(shard: dict) -> int:
    return int(shard["file"].removeprefix("shard-").removesuffix(".safetensors"))


def _open_features(buffer: Path, tries: int = 5):
    """The buffer as CapturedFeatures; a shard the writer dropped between reading the index and
    opening it is a retry, not an error."""
    from ..capture.features import CapturedFeatures

    for attempt in range(tries):
        try:
            return CapturedFeatures(buffer)
        except (FileNotFoundError, ValueError):
            if attempt == tries - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def _tokens(samples, indices) -> int:
    return sum(int(samples.__getitem__(i, with_hidden=False)["input_ids"].numel()) for i in indices)


if __name__ == "__main__":
    sys.exit(main())
