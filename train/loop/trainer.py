"""The training loop: a head (and for Medusa-2 the target's LoRA) on FeatureBatches.

One code path for one process and for `accelerate launch` / `torchrun` (docs/style.md 8): the
`Accelerator` says how many processes there are; each reads its own slice of every shuffled
epoch; only the main process writes checkpoints, metrics and the final head.

Data position is a single counter, `micro_step` (micro-batches consumed by each process): the
epoch is `micro_step // batches_per_epoch` and the batch within it `micro_step %
batches_per_epoch`; epoch e is shuffled by a generator seeded with `sampler_seed + e`. So a
checkpoint holding `micro_step`, the model/optimizer/scheduler states and every RNG state
resumes exactly where the run stopped.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn

from ...heads.batch import FeatureBatch
from ...heads.config import Eagle3Config
from ...heads.io import DraftHeadBase, shifted_labels
from ...ground.outdir import OVERWRITE_FLAG, OutputExistsError, check_replaceable, clear_output, files_under, fresh_folder, is_empty, mark_output
from .best import BEST_DIR, best_so_far, improves, write_record
from .checkpoint import (
    CHECKPOINT_DIR,
    LATEST,
    TMP_PREFIX,
    Checkpoint,
    TrainState,
    capture_rng_state,
    checkpoint_name,
    checkpoint_root,
    latest_checkpoint,
    load_checkpoint,
    remove_partial_checkpoints,
    restore_rng_state,
    save_checkpoint,
    saved_run_config,
)
from .config import ConfigError, TrainConfig, check_resume, data_replicas
from .evaluate import WEIGHT_KEY, MetricMean, summarize
from ..capture.features import OnlineFeaturizer, collate, target_mask_kwargs
from ..data.samples import IndexedSamples
from ..capture.packing import collate_packed
from ..capture.split_target import SplitFeaturizer, split_refusal
from . import sharding
from ...ground.clock import PhaseClock
from .curves import EVAL_PLOT
from .tracking import METRICS_FILE, WANDB_ID_FILE, RunLog

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from ..data.streaming import TokenStream

FINAL_DIR = "final"
CONFIG_FILE = "config.yaml"
# What a run writes in its output_dir (its marker names them: ground/outdir.py MARKER_FILE); wandb's
# offline files go under wandb/. final/ and best/ hold markers of their own, which name their files.
RUN_FILES = (
    CONFIG_FILE,
    METRICS_FILE,
    WANDB_ID_FILE,
    EVAL_PLOT,
    "wandb/*",
    f"{CHECKPOINT_DIR}/{LATEST}",
    f"{CHECKPOINT_DIR}/step-*/*",
    f"{CHECKPOINT_DIR}/{TMP_PREFIX}*/*",
    f"{BEST_DIR}/*",  # a best/ whose marker a kill kept from being written
)


class NonFiniteLossError(RuntimeError):
    """The loss (or gradient norm) became NaN/inf; nothing was written after the last checkpoint."""


# ----------------------------------------------------------------------------------------------
# Pure rules
# ----------------------------------------------------------------------------------------------


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based): linear warmup to 1 over
    `warmup_steps`, then cosine / linear decay to `min_ratio` at `total_steps`, or constant."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps)))
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    raise ValueError(f"unknown schedule {schedule!r}")


def batches_per_epoch(num_samples: int, batch_size: int, world_size: int) -> int:
    """Whole batches each process gets per epoch; the remainder of the shuffle is dropped so all
    processes take the same number of steps."""
    return num_samples // (batch_size * world_size)


def epoch_batches(num_samples: int, batch_size: int, world_size: int, rank: int, seed: int, epoch: int) -> list[list[int]]:
    """This process's batches (sample indices) of one epoch: shuffle with seed + epoch, drop the
    remainder, deal samples round-robin to processes (like DistributedSampler), then chunk."""
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(num_samples, generator=g).tolist()
    n_batches = batches_per_epoch(num_samples, batch_size, world_size)
    mine = perm[: n_batches * batch_size * world_size][rank::world_size]
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


def split_indices(n: int, eval_fraction: float, eval_size: int | None, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) sample indices: a seeded shuffle, `eval_fraction` of n capped at `eval_size`
    held out (at least one sample when the fraction is > 0 and n > 1)."""
    k = int(round(n * eval_fraction))
    if eval_fraction > 0 and n > 1:
        k = max(1, k)
    if eval_size is not None:
        k = min(k, eval_size)
    k = min(k, n - 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[k:]), sorted(perm[:k])


# ----------------------------------------------------------------------------------------------
# What is differentiated: wrappers whose forward is the loss, so DDP sees a forward call
# ----------------------------------------------------------------------------------------------


class HeadLoss(nn.Module):
    """Frozen target: loss = head.compute_loss(batch) on precomputed features."""

    def __init__(self, head: DraftHeadBase) -> None:
        super().__init__()
        self.head = head

    def forward(self, batch: FeatureBatch):
        return self.head.compute_loss(batch)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds: the head's own tensors (weights and buffers such as d2t)."""
        return {f"head.{k}": v for k, v in self.head.state_dict().items()}

    def load_trainable_state(self, weights: dict[str, torch.Tensor]) -> None:
        own = {k[len("head.") :]: v for k, v in weights.items() if k.startswith("head.")}
        self.head.load_state_dict(own, strict=True)


class JointLoss(HeadLoss):
    """Medusa-2 (Cai et al. 2024, sec. 2.3.2): the target, wrapped with LoRA, is trained with its
    own LM loss on assistant tokens while the heads learn on its (now differentiable) hidden state:

        loss = lm_weight * CE(target logits_t, token_{t+1}) + head_weight * head loss
    """

    def __init__(self, head: DraftHeadBase, target: nn.Module, layers: tuple[int, ...], lm_weight: float, head_weight: float):
        super().__init__(head)
        self.target = target  # peft model: only the LoRA weights require grad
        self.layers = tuple(layers)
        self.lm_weight, self.head_weight = lm_weight, head_weight

    def forward(self, batch: FeatureBatch):
        if batch.images is not None:
            raise ValueError("Medusa-2 adapts the target on text rows; rows with images are not built for it")
        out = self.target(
            input_ids=batch.input_ids,
            **target_mask_kwargs(self.target, batch.attention_mask, batch.position_ids),
            output_hidden_states=list(self.layers),
            use_cache=False,
        )
        labels, valid = shifted_labels(batch.input_ids, batch.loss_mask, batch.attention_mask, 1, batch.position_ids)
        logits = out.logits[valid].float()  # [N, V]: only labelled positions
        lm_loss = F.cross_entropy(logits, labels[valid]) if logits.shape[0] else logits.sum() * 0.0
        feats = FeatureBatch(
            batch.input_ids, batch.attention_mask, batch.loss_mask, {i: out.hidden_states[i] for i in self.layers}, batch.position_ids
        )
        head_loss, metrics = self.head.compute_loss(feats)
        loss = self.lm_weight * lm_loss + self.head_weight * head_loss
        metrics = dict(metrics, head_loss=float(head_loss.detach()), lm_loss=float(lm_loss.detach()), loss=float(loss.detach()))
        return loss, metrics

    def trainable_state(self) -> dict[str, torch.Tensor]:
        state = super().trainable_state()
        state.update({f"target.{n}": p for n, p in self.target.named_parameters() if p.requires_grad})
        return state

    def load_trainable_state(self, weights: dict[str, torch.Tensor]) -> None:
        super().load_trainable_state(weights)
        params = dict(self.target.named_parameters())
        lora = {k[len("target.") :]: v for k, v in weights.items() if k.startswith("target.")}
        expected = {n for n, p in params.items() if p.requires_grad}
        if set(lora) != expected:
            raise ValueError(
                f"checkpoint LoRA weights do not match the model: missing {sorted(expected - set(lora))[:3]}, "
                f"unexpected {sorted(set(lora) - expected)[:3]}"
            )
        with torch.no_grad():
            for n, v in lora.items():
                params[n].copy_(v)


# ----------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainData:
    """Samples (dicts for `features.collate`) and how a token batch becomes a FeatureBatch."""

    train: IndexedSamples | TokenStream
    eval: IndexedSamples | None = None
    # FeatureBatch (tokens only) -> FeatureBatch with hidden states; None: samples carry them
    featurize: Callable[[FeatureBatch], FeatureBatch] | None = None
    pad_token_id: int = 0
    # packed rows of at most this many tokens (train/capture/packing.py); None: one sample per row
    pack_length: int | None = None


@dataclass
class TrainResult:
    state: TrainState
    final_dir: Path | None  # None when the run stopped before the end (stop_after_steps)
    last_checkpoint: Path | None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    train_metrics: dict[str, float] = field(default_factory=dict)  # means over the last log window


def resolve_mixed_precision(setting: str, native_bf16: bool) -> str:
    """`mixed_precision: auto` -> "bf16" where bf16 matmuls are native, else "no" (fp32).
    On a CPU without AVX512-BF16 or AMX, bf16 autocast is emulated: an EAGLE-3 step on SmolLM2
    trained 2.1x slower than in fp32 (docs/cpu-measurements.md "Training throughput")."""
    return ("bf16" if native_bf16 else "no") if setting == "auto" else setting


def make_accelerator(config: TrainConfig):
    """An Accelerator for the machine at hand: CPU processes when there is no CUDA (docs/launching.md:
    without cpu=True each CPU process of `accelerate launch` would see DistributedType.NO)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    from ...ground.target.load import has_native_bf16

    precision = resolve_mixed_precision(config.mixed_precision, has_native_bf16())
    if AcceleratorState._shared_state and PartialState().num_processes == 1:
        # accelerate keeps one process-wide state and refuses a second Accelerator with another
        # mixed_precision; a single process may train several runs in turn (tests, notebooks)
        if AcceleratorState._shared_state.get("_mixed_precision") != precision:
            AcceleratorState._reset_state()
    return Accelerator(mixed_precision=precision, cpu=not torch.cuda.is_available())


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        head: DraftHeadBase,
        data: TrainData,
        *,
        accelerator=None,
        target: nn.Module | None = None,
        layers: tuple[int, ...] = (),
        frozen_target: nn.Module | None = None,
        replay: Callable[[nn.Module], dict[str, float]] | None = None,
    ):
        """head: a fresh (or to-be-resumed) head. target: the LoRA-wrapped target for medusa2
        (trained jointly; `layers` are the hidden states the head reads); None otherwise.
        frozen_target: the target behind `data.featurize`, sharded with the head under FSDP.
        replay: head -> replay_* metrics, run by the main process at each eval (train/loop/replay_eval.py)."""
        self.config = config
        self.replay = replay
        self.accelerator = accelerator or make_accelerator(config)
        self.data = data
        self.head = head
        self.target = target
        self.frozen_target = frozen_target
        self.fsdp = False  # set by fit(): the modules are sharded with fully_shard (train/loop/sharding.py)
        self.target_forward: str | None = None  # set by fit() under context_parallel: how online features are made
        self.data_sha256: str | None = None  # the data file's content (run_training sets it): kept in each checkpoint
        self._bpe: int | None = None
        if target is not None:
            lora = config.lora
            self.module: HeadLoss = JointLoss(head, target, layers, lora.lm_loss_weight, lora.head_loss_weight)
        else:
            self.module = HeadLoss(head)
        self.module.to(self.accelerator.device)
        self.optimizer = self._build_optimizer()
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None  # set by fit()

    # -- setup ---------------------------------------------------------------------------------

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW; no weight decay on biases and norms (1-D tensors); LoRA at its own LR."""
        cfg = self.config
        lora_lr = cfg.lora.lr if cfg.lora.lr is not None else cfg.lr * cfg.lora.lr_scale
        groups: dict[tuple[float, float], list] = {}
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            lr = lora_lr if name.startswith("target.") else cfg.lr
            wd = cfg.weight_decay if p.dim() >= 2 else 0.0
            groups.setdefault((lr, wd), []).append(p)
        if not groups:
            raise ValueError("nothing to train: the head has no parameter that requires grad")
        params = [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cast(tuple[float, float], tuple(cfg.betas)), weight_decay=cfg.weight_decay)

    def data_world(self) -> tuple[int, int]:
        """(data-parallel replicas, this process's replica): with context_parallel = c, the c
        consecutive ranks of a group read the same batches."""
        acc, cp = self.accelerator, self.config.context_parallel
        return data_replicas(acc.num_processes, cp), acc.process_index // cp

    def batches_per_epoch(self) -> int:
        """Batches each process takes per epoch; a stream (train/data/streaming.py) counts them in one pass."""
        cfg, (world, _) = self.config, self.data_world()
        if self._bpe is None:
            if is_stream(self.data.train):
                self._bpe = self.data.train.count_batches(cfg.batch_size, world)
            else:
                self._bpe = batches_per_epoch(len(self.data.train), cfg.batch_size, world)
        return self._bpe

    def total_steps(self) -> int:
        cfg = self.config
        if cfg.max_steps is not None:
            return cfg.max_steps
        assert cfg.epochs is not None  # TrainConfig refuses neither being set
        return max(1, math.ceil(cfg.epochs * self.batches_per_epoch() / cfg.grad_accum))

    # -- batches -------------------------------------------------------------------------------

    def _batch(self, samples: list[dict], clock: PhaseClock | None = None) -> FeatureBatch:
        clock = clock or PhaseClock()
        with clock("data"):
            if self.data.pack_length is not None:
                batch = collate_packed(samples, self.data.pack_length, self.data.pad_token_id)
            else:
                batch = collate(samples, self.data.pad_token_id)
        if self.data.featurize is not None:
            with clock("target"):  # the frozen target's forward (online features)
                batch = self.data.featurize(batch)
        batch = batch.to(self.accelerator.device)
        # Heads keep fp32 master weights; captured / bf16-target features are cast up here, and
        # autocast (mixed_precision) decides the compute dtype.
        dtype = next(p for p in self.head.parameters() if p.is_floating_point()).dtype
        batch.hidden_states = {k: v.to(dtype) for k, v in batch.hidden_states.items()}
        return batch

    # -- the loop ------------------------------------------------------------------------------

    def fit(self, *, resume: bool = False, overwrite: bool = False, stop_after_steps: int | None = None, progress: bool = True) -> TrainResult:
        """Train to the configured length. resume: continue from the newest checkpoint in
        output_dir (a fresh start if there is none), whose config must agree with this one
        (train/loop/config.py check_resume). overwrite: delete what output_dir holds first; without it
        a non-empty output_dir is refused unless resumed. stop_after_steps: return after that many
        steps of this call without the final save (what an interruption leaves behind)."""
        from accelerate.utils import set_seed

        cfg, acc = self.config, self.accelerator
        out = Path(cfg.output_dir)
        world, rank = acc.num_processes, acc.process_index
        self._choose_parallelism(world)
        data_world, data_rank = self.data_world()
        bpe = self.batches_per_epoch()
        n_train = bpe * cfg.batch_size * data_world if is_stream(self.data.train) else len(self.data.train)  # a stream: the samples used
        if bpe == 0:
            raise ValueError(f"{n_train} training samples do not fill one batch of {cfg.batch_size} on {data_world} data-parallel process(es)")
        total = self.total_steps()
        ckpt, changes = self._start_point(out, resume=resume, overwrite=overwrite)

        set_seed(cfg.seed + rank)  # fresh start; a resume overwrites every RNG below
        model, optimizer, held = self._prepare()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_factor, warmup_steps=cfg.warmup_steps, total_steps=total, schedule=cfg.schedule, min_ratio=cfg.min_lr_ratio)
        )
        state = TrainState(
            sampler_seed=cfg.seed,
            world_size=world,
            parallelism=("fsdp" if self.fsdp else "ddp") + (f"+cp{cfg.context_parallel}" if cfg.context_parallel > 1 else ""),
            data_sha256=self.data_sha256,
        )
        if ckpt is not None:
            state = self._restore(ckpt, optimizer, state)
            state.data_sha256 = self.data_sha256 or state.data_sha256  # the same content: run_training checked it

        if acc.is_main_process:  # before the run writes there: its files are its own
            out.mkdir(parents=True, exist_ok=True)
            mark_output(out, "training run", RUN_FILES)
        log = RunLog(
            out,
            is_main=acc.is_main_process,
            total_steps=total,
            initial_step=state.step,
            report_to=cfg.report_to,
            project=cfg.wandb_project,
            run_name=cfg.run_name,
            config=cfg.to_dict(),
            progress=progress,
        )
        if acc.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            cfg.save(out / CONFIG_FILE)
        self._announce(log, ckpt, changes, state, held, n_train=n_train, bpe=bpe, total=total)

        last_ckpt = ckpt.path if ckpt is not None else None
        window, window_tokens, window_start, window_steps = MetricMean(), 0, time.perf_counter(), 0
        clock = PhaseClock()  # where a step's time goes, reported with every log line
        eval_metrics: dict[str, float] = {}
        train_metrics: dict[str, float] = {}
        bar_eval: dict[str, float] = {}  # the last eval's acc_0 / tau_est / replay_tau, kept on the progress bar
        best = best_so_far(out, cfg.keep_best) if ckpt is not None else None  # a fresh run starts its own
        params = [p for p in self.module.parameters() if p.requires_grad]
        read = EpochReader(self.data.train, cfg.batch_size, data_world, data_rank, state.sampler_seed)
        steps_this_call = 0
        model.train()
        final_dir = None
        ended = False  # the loop returned: done, or stopped after stop_after_steps
        try:
            while state.step < total and (stop_after_steps is None or steps_this_call < stop_after_steps):
                if hasattr(self.head, "train_progress"):  # progressive TTT (heads/eagle3.py ttt_depth)
                    setattr(self.head, "train_progress", state.step / total)  # a float, which nn.Module's __setattr__ is not typed for
                for m in range(cfg.grad_accum):
                    window_tokens += self._micro_step(model, read, state, bpe, window, clock, last_ckpt, m)
                grad_norm = self._optimizer_step(optimizer, params, state, clock, last_ckpt)
                steps_this_call += 1
                window_steps += 1
                done = state.step == total

                if state.step % cfg.log_every == 0 or done:
                    train_metrics = self._log_train(
                        log, state, window, window_tokens, time.perf_counter() - window_start, window_steps, grad_norm, clock, bar_eval
                    )
                    window, window_tokens, window_start, window_steps = MetricMean(), 0, time.perf_counter(), 0
                if self.data.eval is not None and len(self.data.eval) and ((cfg.eval_every and state.step % cfg.eval_every == 0) or done):
                    eval_metrics, bar_eval, best = self._eval(log, state.step, best)
                if cfg.checkpoint_every and (state.step % cfg.checkpoint_every == 0 or done):
                    last_ckpt = self._save_checkpoint(state, optimizer, log)
            if state.step >= total:
                final_dir = self._save_final(out, state, log, eval_metrics)
            ended = True
        finally:
            log.close()
            if not ended and ckpt is None and state.step == 0 and acc.is_main_process:
                # a fresh run stopped before its first step (a refusal at the first batch, Ctrl-C):
                # its config.yaml and metrics.jsonl would make the corrected rerun refuse output_dir
                clear_output(out)
        return TrainResult(state=state, final_dir=final_dir, last_checkpoint=last_ckpt, eval_metrics=eval_metrics, train_metrics=train_metrics)

    def _choose_parallelism(self, world: int) -> None:
        """Sets self.fsdp and refuses what FSDP cannot run. accelerate's own FSDP launch (a GPU
        config) gets the same fully_shard path as parallelism: fsdp."""
        from accelerate.utils import DistributedType

        cfg, acc = self.config, self.accelerator
        self.fsdp = world > 1 and (cfg.parallelism == "fsdp" or acc.distributed_type == DistributedType.FSDP)
        if self.fsdp and self.target is not None:
            raise NotImplementedError("medusa2 (LoRA on the target) under FSDP is not supported: use parallelism: ddp")
        if self.fsdp and acc.mixed_precision == "fp16":
            raise NotImplementedError("fp16 under FSDP needs a sharded grad scaler: use mixed_precision: bf16 or no")
        if self.fsdp and (self.replay is not None or cfg.keep_best != "none"):
            raise NotImplementedError("replay and keep_best need the whole head on one process: use parallelism: ddp")
        if cfg.context_parallel > 1:
            self._split_rows()

    def _split_rows(self) -> None:
        """context_parallel = c: groups of c consecutive ranks, each group one process group of its
        own (its all-gathers never queue behind DDP's all-reduces), and the head told its rank in
        its group (heads/context_split.py)."""
        import torch.distributed as dist

        from ...heads.context_split import ContextSplit

        cfg, cp = self.config, self.config.context_parallel
        replicas, replica = self.data_world()  # refuses a world that cp does not divide
        if not hasattr(self.head, "context_split"):
            raise NotImplementedError(
                f"context_parallel splits EAGLE-3's training-time-test rows (eagle3, eagle31); {cfg.head['kind']} does not split them"
            )
        groups = [dist.new_group(list(range(g * cp, (g + 1) * cp))) for g in range(replicas)]  # every rank makes every group
        split = ContextSplit(self.accelerator.process_index % cp, cp, groups[replica])
        setattr(self.head, "context_split", split)  # not a Module, which nn.Module's __setattr__ is typed for
        featurize = self.data.featurize
        if isinstance(featurize, OnlineFeaturizer):  # online features: the target's forward is split too, where it can be
            refusal = split_refusal(featurize.model)
            if refusal is None:
                hcfg = cast(Eagle3Config, self.head.config)  # heads with context_split are EAGLE-3's
                self.data.featurize = SplitFeaturizer(featurize.model, featurize.layers, split, hcfg.final_layer, halo=hcfg.ttt_steps)
            self.target_forward = f"split across {cp} ranks" if refusal is None else f"whole on every rank: {refusal}"

    def _restore(self, ckpt: Checkpoint, optimizer, state: TrainState) -> TrainState:
        """The head, optimizer, scheduler, grad scaler and this rank's RNG as `ckpt` left them;
        returns its TrainState. Refuses a checkpoint of another world size or parallelism."""
        acc = self.accelerator
        if ckpt.state.world_size != state.world_size:
            raise ValueError(
                f"checkpoint {ckpt.path} was written by {ckpt.state.world_size} process(es), this run has {state.world_size}: "
                "the data order would differ; resume with the same number of processes"
            )
        if ckpt.state.parallelism != state.parallelism:
            raise ValueError(
                f"checkpoint {ckpt.path} was written under {ckpt.state.parallelism}, this run is {state.parallelism}: "
                "their optimizer states are keyed differently; resume with the same parallelism"
            )
        if self.fsdp:
            sharding.load_gathered_state(self.module, optimizer, ckpt.weights, ckpt.optimizer_state)
        else:
            self.module.load_trainable_state({k: v.to(acc.device) for k, v in ckpt.weights.items()})
            optimizer.load_state_dict(ckpt.optimizer_state)
        assert self.scheduler is not None  # fit() makes it before restoring
        self.scheduler.load_state_dict(ckpt.scheduler_state)
        if ckpt.scaler_state is not None and acc.scaler is not None:
            acc.scaler.load_state_dict(ckpt.scaler_state)
        restore_rng_state(ckpt.rng_states[acc.process_index])
        return ckpt.state

    def _announce(
        self, log: RunLog, ckpt: Checkpoint | None, changes: list[str], state: TrainState, held: dict, *, n_train: int, bpe: int, total: int
    ) -> None:
        """The run's first event: start or resume, its size and what this rank holds."""
        acc, world = self.accelerator, self.accelerator.num_processes
        log.event(
            "resume" if ckpt is not None else "start",
            f"{'resuming from ' + str(ckpt.path) if ckpt is not None else 'training'}"
            + (f" with changed settings ({'; '.join(changes)})" if changes else "")
            + f": world size {world} "
            f"({acc.distributed_type}), device {acc.device}, {n_train} train samples, {bpe} batches/epoch/process, "
            f"{total} steps; {state.parallelism}: this rank holds "
            + ", ".join(f"{mine:,} of {whole:,} {part} parameters" for part, (mine, whole) in held.items())
            + (f"; the target's forward runs {self.target_forward}" if self.target_forward else ""),
            world_size=world,
            distributed_type=str(acc.distributed_type),
            device=str(acc.device),
            parallelism=state.parallelism,
            mixed_precision=acc.mixed_precision,
            **{f"{part}_params_local": mine for part, (mine, _) in held.items()},
            train_samples=n_train,
            eval_samples=len(self.data.eval) if self.data.eval is not None else 0,
            batches_per_epoch=bpe,
            total_steps=total,
            step=state.step,
            changed_settings=changes,
            target_forward=self.target_forward,
        )

    def _micro_step(self, model, read: EpochReader, state: TrainState, bpe: int, window: MetricMean, clock: PhaseClock, last_ckpt, m: int) -> int:
        """Micro-batch m of grad_accum: forward and backward (gradients synchronised on the last);
        adds its metrics to `window`; returns its token count."""
        cfg, acc = self.config, self.accelerator
        epoch, index = divmod(state.micro_step, bpe)
        with clock("data"):  # a stream reads and tokenizes here
            samples = read(epoch, index)
        batch = self._batch(samples, clock)
        last_micro = m == cfg.grad_accum - 1
        with self._accumulating(model, not last_micro):
            with clock("head"), acc.autocast() if self.fsdp else contextlib.nullcontext():  # DDP's prepare wraps forward in it
                loss, metrics = model(batch)
            self._check_finite(loss, "loss", state.step + 1, last_ckpt, m)
            with clock("backward"):  # under DDP/FSDP this includes the gradient all-reduce
                # split rows: DDP and FSDP average over every rank, and a group's shares add up to
                # its rows' loss, so each share counts context_parallel times (heads/context_split.py)
                acc.backward(loss * cfg.context_parallel / cfg.grad_accum)
        window.add(metrics, float(metrics.get(WEIGHT_KEY, batch.loss_mask.sum())))
        state.micro_step += 1
        state.epoch, state.batch_index = divmod(state.micro_step, bpe)
        split = getattr(self.head, "context_split", None)
        return int(batch.attention_mask.sum()) if split is None or split.rank == 0 else 0  # a group's tokens once

    def _optimizer_step(self, optimizer, params: list, state: TrainState, clock: PhaseClock, last_ckpt):
        """Clip, step the optimizer and the schedule, count the step; returns the gradient norm."""
        cfg, acc = self.config, self.accelerator
        with clock("optimizer"):
            max_norm = cfg.clip_norm if cfg.clip_norm else float("inf")
            grad_norm = sharding.clip_grad_norm(params, max_norm) if self.fsdp else acc.clip_grad_norm_(params, max_norm)
            if acc.mixed_precision != "fp16":  # fp16: the grad scaler skips overflowing steps itself
                self._check_finite(grad_norm, "gradient norm", state.step + 1, last_ckpt)
            optimizer.step()
            assert self.scheduler is not None  # made by fit()
            self.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        state.step += 1
        return grad_norm

    def _log_train(
        self,
        log: RunLog,
        state: TrainState,
        window: MetricMean,
        window_tokens: int,
        elapsed: float,
        window_steps: int,
        grad_norm,
        clock: PhaseClock,
        bar_eval: dict,
    ) -> dict[str, float]:
        """The training metrics of the steps since the last log line, over all processes."""
        acc = self.accelerator
        assert self.scheduler is not None  # made by fit()
        tokens = int(acc.reduce(torch.tensor(window_tokens, device=acc.device), "sum"))
        state.tokens += tokens
        metrics = summarize(reduce_means(acc, window))  # all processes' batches
        metrics.update(
            lr=cast(float, self.scheduler.get_last_lr()[0]),  # the groups' lrs are floats (the config's)
            grad_norm=float(grad_norm),
            tokens_per_s=tokens / max(elapsed, 1e-9),
            epoch=state.epoch,
            s_step=elapsed / window_steps,
            **clock.take(window_steps),
        )
        log.metrics(state.step, "train", metrics)
        log.progress(
            state.step,
            loss=metrics.get("loss", float("nan")),
            acc_0=metrics.get("acc_0", float("nan")),
            tok_s=round(metrics["tokens_per_s"]),
            **bar_eval,
        )
        return metrics

    def _eval(self, log: RunLog, step: int, best: float | None) -> tuple[dict[str, float], dict[str, float], float | None]:
        """Held-out metrics (and the replayed ones), logged; the head saved as the best when it
        improves `keep_best`. Returns (metrics, their progress-bar share, the best value)."""
        cfg = self.config
        metrics = self.evaluate()
        if self.replay is not None and self.accelerator.is_main_process:
            metrics.update(self.replay(self.head))
        log.metrics(step, "eval", metrics)
        bar = {f"eval_{k}": metrics[k] for k in ("acc_0", "tau_est", "replay_tau") if k in metrics}
        log.progress(step, **bar)
        log.write(f"step {step}: eval " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith(("acc_", "tau", "loss", "replay_"))))
        if cfg.keep_best != "none" and improves(metrics.get(cfg.keep_best), best):
            best = metrics[cfg.keep_best]
            self._save_best(step, best, log)
        return metrics, bar, best

    def _save_final(self, out: Path, state: TrainState, log: RunLog, eval_metrics: dict) -> Path:
        """The trained head in output_dir/final, whole or not at all (written by the main process)."""
        acc = self.accelerator
        final_dir = out / FINAL_DIR
        head_state = None
        if self.fsdp:  # gathered on every rank (a collective), written by the main one
            weights = sharding.gathered_weights(self.module)
            head_state = {k[len("head.") :]: v for k, v in weights.items() if k.startswith("head.")}
        if acc.is_main_process:
            with fresh_folder(final_dir, overwrite=True) as tmp:
                self.head.save_pretrained(tmp, adapter_model=self.target, state=head_state)
            log.event(
                "end", f"saved the head to {final_dir}", step=state.step, path=str(final_dir), **{f"eval_{k}": v for k, v in eval_metrics.items()}
            )
        acc.wait_for_everyone()
        return final_dir

    def _start_point(self, out: Path, *, resume: bool, overwrite: bool) -> tuple[Checkpoint | None, list[str]]:
        """(the checkpoint to continue from or None, the settings a resume changes), after
        checking output_dir (check_output_dir) and clearing it for `overwrite` (main process)."""
        acc = self.accelerator
        existing = latest_checkpoint(out)
        check_output_dir(out, existing, resume=resume, overwrite=overwrite)
        # every process has checked before the main one writes (or clears) anything: a slower
        # rank would otherwise find the main one's new metrics.jsonl and refuse the folder
        acc.wait_for_everyone()
        if overwrite:
            if acc.is_main_process:
                check_replaceable(out, what="output_dir")
                clear_output(out)
            acc.wait_for_everyone()
            return None, []
        if acc.is_main_process:  # what a killed checkpoint write left fills the disk until removed
            remove_partial_checkpoints(out)
        if not resume or existing is None:
            return None, []
        changes = check_resume(saved_run_config(existing), self.config, str(existing))
        return load_checkpoint(existing), changes

    def _save_best(self, step: int, value: float, log: RunLog) -> None:
        """The head as it is now in output_dir/best, with the eval that put it there (train/loop/best.py)."""
        if not self.accelerator.is_main_process:
            return
        folder = Path(self.config.output_dir) / BEST_DIR
        self.head.save_pretrained(folder, adapter_model=self.target)
        write_record(folder, step, self.config.keep_best, value)
        mark_output(folder, "the best head so far", files_under(folder))
        log.event(
            "best",
            f"step {step}: {self.config.keep_best}={value:.4g}, the best so far: head saved to {folder}",
            step=step,
            metric=self.config.keep_best,
            value=value,
            path=str(folder),
        )

    def _save_checkpoint(self, state: TrainState, optimizer, log: RunLog) -> Path:
        """Every process contributes its RNG state; the main process writes. Returns the folder."""
        from accelerate.utils import gather_object

        acc, cfg = self.accelerator, self.config
        rng_states = gather_object([capture_rng_state()])  # in rank order
        path = checkpoint_root(cfg.output_dir) / checkpoint_name(state.step)
        if self.fsdp:
            weights, optimizer_state = sharding.gathered_state(self.module, optimizer)  # every rank takes part
        elif acc.is_main_process:
            weights, optimizer_state = self.module.trainable_state(), optimizer.state_dict()
        if acc.is_main_process:
            assert self.scheduler is not None  # made by fit()
            path = save_checkpoint(
                cfg.output_dir,
                state,
                weights,
                optimizer_state,
                self.scheduler.state_dict(),
                rng_states,
                scaler_state=acc.scaler.state_dict() if acc.scaler is not None else None,
                keep=cfg.keep_checkpoints,
                config=cfg.to_dict(),
            )
            log.event("checkpoint", step=state.step, path=str(path))
        acc.wait_for_everyone()
        return path

    def _prepare(self):
        """(model, optimizer, held): DDP-wrapped by accelerate, or sharded by us under FSDP (with the
        optimizer rebuilt over the sharded parameters). held: {part: (parameters on this rank, in
        all)} for the head and the frozen target, for the start log."""
        if self.fsdp:
            if self.frozen_target is not None and self.config.shard_target:
                sharding.shard_frozen_target(self.frozen_target)
            sharding.shard_trainable(self.module)
            self.optimizer = self._build_optimizer()  # over the sharded (DTensor) parameters
            model, optimizer = self.module, self.optimizer
        else:
            model, optimizer = self.accelerator.prepare(self.module, self.optimizer)
        parts = {"head": self.module, "target": self.frozen_target}
        # a DTensor's numel() is its whole (global) size, its local shard what this rank stores
        held = {part: (sharding.local_numel(m.parameters()), sum(p.numel() for p in m.parameters())) for part, m in parts.items() if m is not None}
        return model, optimizer, held

    def _accumulating(self, model, accumulate: bool):
        """A context in which backward keeps gradients local (a micro-batch before the last)."""
        if not accumulate:
            return contextlib.nullcontext()
        if self.fsdp:
            model.set_requires_gradient_sync(False)
            return _restore_sync(model)
        return self.accelerator.no_sync(model)

    def _check_finite(self, value: torch.Tensor, what: str, step: int, last_ckpt: Path | None, micro: int | None = None) -> None:
        """Stop every process together when `value` is NaN/inf (a lone raise would leave the others
        waiting in the next all-reduce)."""
        acc = self.accelerator
        bad = torch.tensor(0.0 if bool(torch.isfinite(value.detach()).all()) else 1.0, device=acc.device)
        if acc.num_processes > 1:
            bad = acc.reduce(bad, "sum")
        if float(bad) > 0:
            where = f"step {step}" + (f" (micro-batch {micro + 1} of {self.config.grad_accum})" if micro is not None else "")
            kept = f"the last good checkpoint is {last_ckpt}" if last_ckpt is not None else "no checkpoint was written yet"
            raise NonFiniteLossError(f"{what} is not finite (here: {float(value.detach().float())}) at {where}; training stopped, {kept}")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean metrics over held-out batches (each process its share, then summed), + tau_est.

        Runs the unwrapped module: a DDP forward may broadcast buffers, a collective that would
        hang when processes have different numbers of eval batches."""
        cfg, acc = self.config, self.accelerator
        world, rank = self.data_world()
        assert self.data.eval is not None  # called only with held-out samples
        batches: list[list[int] | None] = list(eval_batches(len(self.data.eval), cfg.batch_size, world, rank, cfg.eval_batches))
        if self.fsdp:
            # a sharded forward is a collective: every rank runs as many batches as the busiest one
            # (rank 0: samples are dealt from it), a rank with fewer repeats its first and ignores the result
            busiest = len(eval_batches(len(self.data.eval), cfg.batch_size, world, 0, cfg.eval_batches))
            batches = batches + [None] * (busiest - len(batches))
        mean = MetricMean()
        was_training = self.module.training
        self.module.eval()
        try:
            filler = next((b for b in batches if b), [0])
            for idx in batches:
                batch = self._batch([self.data.eval[i] for i in (idx if idx is not None else filler)])
                with acc.autocast():
                    _, metrics = self.module(batch)
                if idx is not None:
                    mean.add(metrics, float(metrics.get(WEIGHT_KEY, batch.loss_mask.sum())))
        finally:
            self.module.train(was_training)
        return summarize(reduce_means(acc, mean))


def check_output_dir(out: Path, existing: Path | None, *, resume: bool, overwrite: bool) -> None:
    """Refuse an output_dir that holds something this run would mix with or replace: checkpoints
    without `resume`, or another run's files (a finished head, logs) with no checkpoint to resume.
    existing: output_dir's newest checkpoint (latest_checkpoint) or None."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in output_dir, --overwrite replaces it: pass one of them")
    if overwrite or (resume and existing is not None):
        return
    if existing is not None:
        raise OutputExistsError(
            f"{out} already has checkpoints ({existing.name}): pass --resume to continue, "
            f"{OVERWRITE_FLAG} to replace the run, or use another output_dir"
        )
    if not is_empty(out):
        held = ", ".join(sorted(p.name for p in out.iterdir())[:4])
        raise OutputExistsError(
            f"output_dir {out} holds another run's files ({held}) and no checkpoint to resume: "
            f"pass {OVERWRITE_FLAG} to replace it, or use another output_dir"
        )


def is_stream(train: object) -> TypeIs[TokenStream]:
    """Training data read lazily in order (train/data/streaming.py TokenStream) rather than by index."""
    return hasattr(train, "batches") and hasattr(train, "count_batches")


class EpochReader:
    """This process's batches (lists of samples) by (epoch, batch index): read in order, and
    reopened at the asked-for batch after a jump (a resume, or the next epoch).

    Indexed data: `epoch_batches`' shuffle of the sample indices. A stream: its own seeded order,
    the first `index` batches skipped by reading them (train/data/streaming.py)."""

    def __init__(self, train, batch_size: int, world_size: int, rank: int, seed: int):
        self.train, self.batch_size, self.world_size, self.rank, self.seed = train, batch_size, world_size, rank, seed
        self._next: tuple[int, int] | None = None
        self._batches = iter(())

    def __call__(self, epoch: int, index: int) -> list[dict]:
        if self._next != (epoch, index):
            self._batches = self._open(epoch, index)
        self._next = (epoch, index + 1)
        return next(self._batches)

    def _open(self, epoch: int, index: int):
        if is_stream(self.train):
            return iter(self.train.batches(self.batch_size, rank=self.rank, world_size=self.world_size, seed=self.seed, epoch=epoch, skip=index))
        batches = epoch_batches(len(self.train), self.batch_size, self.world_size, self.rank, self.seed, epoch)
        return ([self.train[i] for i in indices] for indices in batches[index:])


def eval_batches(num_samples: int, batch_size: int, world_size: int, rank: int, cap: int | None) -> list[list[int]]:
    """This process's held-out batches: samples dealt round-robin, chunked, at most cap // world."""
    indices = list(range(num_samples))[rank::world_size]
    batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    return batches[: max(1, cap // world_size)] if cap is not None else batches


@contextlib.contextmanager
def _restore_sync(model):
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def reduce_means(acc, mean: MetricMean) -> dict[str, float]:
    """Sum every process's weighted metric sums and weights, then divide."""
    from accelerate.utils import gather_object

    parts = gather_object([(mean.sums, mean.weight)]) if acc.num_processes > 1 else [(mean.sums, mean.weight)]
    total = MetricMean()
    for sums, weight in parts:
        for k, v in sums.items():
            total.sums[k] = total.sums.get(k, 0.0) + v
        total.weight += weight
    return total.means()
