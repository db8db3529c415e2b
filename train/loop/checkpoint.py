"""Training checkpoints: everything needed to continue a run as if it had never stopped.

    output_dir/checkpoints/step-00000200/
        trainable.safetensors   head weights + buffers (d2t/t2d), and the LoRA weights for medusa2
        optimizer.pt            AdamW state (moments, step counts)
        scheduler.pt            LR scheduler state
        rng.pt                  python / numpy / torch / cuda RNG states of every process (list by rank)
        scaler.pt               fp16 grad scaler state (only with mixed_precision=fp16)
        trainer_state.json      step, data position (epoch, batch index, sampler seed), world size
        run_config.json         the run config that wrote it (what `--resume` compares against)
    output_dir/checkpoints/latest  name of the newest complete checkpoint

A checkpoint is written into a temp folder and renamed into place, then `latest` is replaced
atomically, so a crash mid-write leaves the previous checkpoint as the one `--resume` finds.
Only the main process calls the writers (docs/style.md 8).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ...ground.outdir import reported_as

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "trainable.safetensors"
RUN_CONFIG_FILE = "run_config.json"
TMP_PREFIX = ".tmp-"  # a checkpoint being written: checkpoints/.tmp-step-N-<pid>


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    micro_step: int = 0  # micro-batches consumed per process (data position)
    epoch: int = 0  # micro_step // batches_per_epoch
    batch_index: int = 0  # micro_step % batches_per_epoch: next batch of `epoch`
    sampler_seed: int = 0  # epoch e is shuffled with seed sampler_seed + e
    world_size: int = 1
    tokens: int = 0  # real tokens seen by all processes, counted at each log step
    parallelism: str = "ddp"  # ddp (or one process) | fsdp: how weights and optimizer state were kept
    data_sha256: str | None = None  # the content of the data file trained on (train/data/sources.py data_fingerprint); None: not known

    def to_dict(self) -> dict:
        return asdict(self)


def capture_rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_DIR


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(
    output_dir: str | Path,
    state: TrainState,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict,
    scheduler_state: dict,
    rng_states: list[dict[str, Any]],
    *,
    scaler_state: dict | None = None,
    keep: int = 2,
    config: dict | None = None,
) -> Path:
    """Write one checkpoint atomically; keep the newest `keep`. Returns its folder."""
    root = checkpoint_root(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(state.step)
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with reported_as(root):  # a full disk: one line naming the folder, not the writer's error
            _write_files(tmp, weights, optimizer_state, scheduler_state, rng_states, scaler_state, config, state)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the disk it filled is freed again
        raise
    if final.exists():  # same step written again (a resumed run re-reaching it): replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest_tmp = root / f".{LATEST}.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / LATEST)
    _prune(root, keep, final.name)
    return final


def _write_files(tmp: Path, weights, optimizer_state, scheduler_state, rng_states, scaler_state, config, state) -> None:
    # contiguous CPU copies: safetensors refuses shared or strided storage
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in weights.items()}, str(tmp / WEIGHTS_FILE))
    torch.save(optimizer_state, tmp / "optimizer.pt")
    torch.save(scheduler_state, tmp / "scheduler.pt")
    torch.save(rng_states, tmp / "rng.pt")
    if scaler_state is not None:
        torch.save(scaler_state, tmp / "scaler.pt")
    if config is not None:
        (tmp / RUN_CONFIG_FILE).write_text(json.dumps(config, indent=1))
    (tmp / STATE_FILE).write_text(json.dumps(state.to_dict(), indent=1))


def remove_partial_checkpoints(output_dir: str | Path) -> list[Path]:
    """Delete what killed checkpoint writes left in output_dir/checkpoints (`.tmp-step-*` folders,
    the `latest` pointer's temp file). Call it on the main process holding the output_dir lock
    (ground/outdir.py output_lock), under which no other writer is at work. Returns what went."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    gone = sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX) or p.name == f".{LATEST}.tmp")
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return gone


def _prune(root: Path, keep: int, newest: str) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and (p / STATE_FILE).exists())
    for old in done[: max(0, len(done) - keep)]:
        if old.name != newest:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None. Temp folders of interrupted writes are ignored."""
    root = checkpoint_root(output_dir)
    pointer = root / LATEST
    if pointer.exists():
        candidate = root / pointer.read_text().strip()
        if (candidate / STATE_FILE).exists():
            return candidate
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).exists())
    return done[-1] if done else None


@dataclass
class Checkpoint:
    path: Path
    state: TrainState
    weights: dict[str, torch.Tensor]
    optimizer_state: dict
    scheduler_state: dict
    rng_states: list[dict[str, Any]]
    scaler_state: dict | None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    """The checkpoint at `path`; a file in it that is cut short or damaged (a disk fault: writes
    are atomic) is a ValueError naming the checkpoint and the way on."""
    path = Path(path)
    try:
        return _load_checkpoint(path, map_location)
    # torch.load meets a damaged file as an unpickling, EOF or zip error (RuntimeError), safetensors
    # as a SafetensorError, the JSON state as a ValueError
    except (SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError, KeyError) as e:
        raise ValueError(
            f"checkpoint {path} is truncated or corrupt ({' '.join(str(e).split())[:200]}): delete it to "
            f"resume from the one before (checkpoints/{LATEST} names the newest), or start anew"
        ) from e


def saved_state(path: Path) -> TrainState:
    """The TrainState of the checkpoint at `path` (its STATE_FILE alone: nothing else is read)."""
    return TrainState(**json.loads((path / STATE_FILE).read_text()))


def check_same_data(path: Path, data_sha256: str, data_name: str) -> None:
    """Refuse to resume from the checkpoint at `path` when the data it trained on had other
    content than `data_sha256` (data_name: the file, for the message). A checkpoint that does
    not record it passes."""
    saved = saved_state(path).data_sha256
    if saved is not None and saved != data_sha256:
        raise ValueError(
            f"--resume: the content of {data_name} changed since {path} was written (sha256 {saved[:12]}... -> "
            f"{data_sha256[:12]}...): the run would go on over other samples; resume with the data it trained on, or start "
            "a new phase from a saved head: init_from=HEAD_DIR output_dir=NEW_DIR"
        )


def _load_checkpoint(path: Path, map_location) -> Checkpoint:
    # weights_only=False: these are our own files, and numpy's RNG state is not a tensor
    load = lambda name: torch.load(path / name, map_location=map_location, weights_only=False)  # noqa: E731
    return Checkpoint(
        path=path,
        state=saved_state(path),
        weights=load_file(str(path / WEIGHTS_FILE)),
        optimizer_state=load("optimizer.pt"),
        scheduler_state=load("scheduler.pt"),
        rng_states=load("rng.pt"),
        scaler_state=load("scaler.pt") if (path / "scaler.pt").exists() else None,
    )


def saved_run_config(path: str | Path) -> dict | None:
    """The run config that wrote the checkpoint at `path` (its RUN_CONFIG_FILE), None where it has
    none. Reads no tensors: cheap enough to check a resume before the target loads."""
    own = Path(path) / RUN_CONFIG_FILE
    return json.loads(own.read_text()) if own.exists() else None
