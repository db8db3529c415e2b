"""Target features for training: computed online inside the step, or captured ahead into shards.

Both paths produce the same `FeatureBatch` (heads/batch.py), so the trainer never knows which it
has (docs/style.md 9). Capturing once and reusing the shards across epochs is the default for real
targets on CPU: a target forward with all hidden states runs at ~1,600 tokens/s here (docs/cpu-measurements.md).

Shard layout (`drafthead data capture`): `<dir>/index.json` plus `shard-00000.safetensors`, ...
Each shard holds `shard_samples` consecutive samples flattened over tokens (no padding on disk):

    offsets        int64 [n+1]    sample i is tokens offsets[i]:offsets[i+1]
    input_ids      int64 [N]
    attention_mask uint8 [N]      all ones: padding is added when batching
    loss_mask      bool  [N]
    hidden.{l}     [N, H]         output_hidden_states[l], stored in `dtype` (bf16 halves the disk)

Hidden states at a sample's real tokens do not depend on the right padding added for batching,
except for float rounding of differently shaped matmuls (~1e-7 in fp32): capture with the
training batch size and order to get bit-identical batches.

Several processes (`accelerate launch`, `torchrun`) share a capture shard by shard: a shard's
samples and batches are the same whichever process runs it, so the shards and the index are
byte-identical to one process's (docs/launching.md "Data work on several processes").
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ...heads.batch import FeatureBatch
from ...ground.target.identity import text_config
from ...ground.files import read_json
from ...ground.outdir import mark_output, reported_as
from ...ground.target.media import PromptImages, deepstack_inputs, forward_inputs, with_deepstack
from ...ground.target.load import resolve_dtype
from ..data.samples import IndexedSamples, label_token_counts
from .workshare import WorkShare, write_atomically

INDEX_FILE = "index.json"
SERVED_TRAFFIC = "served traffic"  # an index meta's "source" for samples of served answers (train/adapt/): no data section behind them
CAPTURE_PLAN = "capture.json"  # the settings of a capture in progress (a rerun continues it)
CAPTURE_FILES = (INDEX_FILE, CAPTURE_PLAN, "shard-*.safetensors", "shard-*.tmp")  # what a capture writes in its folder (its marker names them)
# 2: the meta records what the capture was made from (data content, target identity and weights)
FORMAT_VERSION = 2


def required_layers(head_config, num_hidden_layers: int) -> tuple[int, ...]:
    """output_hidden_states indices a head trains on: its `feature_layers`, the final normed state
    (index L = num_hidden_layers) when it `needs_last_hidden` (Medusa), and whatever else its
    config lists in `train_hidden_layers` (heads/config.py: EAGLE-3's soft targets read L)."""
    layers = {int(i) for i in head_config.feature_layers}
    layers |= {int(i) for i in getattr(head_config, "train_hidden_layers", ())}
    if head_config.needs_last_hidden:
        layers.add(num_hidden_layers)
    bad = sorted(i for i in layers if not 0 <= i <= num_hidden_layers)
    if bad:
        raise ValueError(f"feature layers {bad} out of range 0..{num_hidden_layers} for this target")
    return tuple(sorted(layers))


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------


def collate(samples: Sequence[dict[str, Any]], pad_token_id: int = 0) -> FeatureBatch:
    """Right-pad samples {input_ids [T], loss_mask [T], hidden_states {l: [T, H]}?} into a FeatureBatch."""
    lengths = [len(s["input_ids"]) for s in samples]
    B, T = len(samples), max(lengths)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    hidden = {}
    images = [s.get("images") for s in samples]  # media.PromptImages or None per row
    for b, (s, n) in enumerate(zip(samples, lengths)):
        input_ids[b, :n] = torch.as_tensor(s["input_ids"], dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.as_tensor(s["loss_mask"], dtype=torch.bool)
        for layer, h in (s.get("hidden_states") or {}).items():
            if layer not in hidden:
                hidden[layer] = torch.zeros((B, T, h.shape[-1]), dtype=h.dtype)  # [B, T, H]
            hidden[layer][b, :n] = h
    return FeatureBatch(input_ids, attention_mask, loss_mask, hidden, images=images if any(im is not None for im in images) else None)


# ----------------------------------------------------------------------------------------------
# Online
# ----------------------------------------------------------------------------------------------


def target_mask_kwargs(model, attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """How a target's forward is told which tokens see which: the padding mask [B, T] for rows of
    one conversation; for packed rows (position_ids [B, T], restarting at each conversation) no
    mask and the position ids, from which transformers builds a block-diagonal causal mask (its
    sliding windows and chunks measured by those positions too). Multimodal-RoPE targets (Qwen-VL)
    take them as [4, B, T]: the text positions, then the same for each of the three M-RoPE sections
    (text carries equal ones). train/capture/packing.py `packing_refusal` checks a target keeps them apart."""
    if position_ids is None:
        return {"attention_mask": attention_mask}
    rope = getattr(text_config(model), "rope_parameters", None) or {}
    if "mrope_section" in rope:
        position_ids = position_ids[None].expand(4, *position_ids.shape)
    return {"attention_mask": None, "position_ids": position_ids}


@torch.no_grad()
def target_features(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    layers: Sequence[int],
    position_ids: torch.Tensor | None = None,
    images: list[PromptImages | None] | None = None,
) -> dict[int, torch.Tensor]:
    """{layer: [B, T, H]} target hidden states (output_hidden_states indices), without gradients.

    Runs only the decoder stack (`get_decoder()`), skipping the LM head: for SmolLM2 that head is
    28M of 135M parameters (docs/cpu-measurements.md). Passing the indices to `output_hidden_states`
    keeps only those states alive. Padded positions are zeroed, as `collate` pads captured states:
    their values are meaningless and must not differ between the two paths. position_ids: packed
    rows (train/capture/packing.py), each conversation seen alone (`target_mask_kwargs`). images: one
    media.PromptImages or None per row of a vision-language target: the whole model runs, its
    vision tower filling the image tokens, with Qwen3-VL's deepstack inputs put back
    (ground/target/media.py).
    """
    device = next(model.parameters()).device
    masks = target_mask_kwargs(model, attention_mask, position_ids)
    media = {}
    if images is not None and any(row is not None for row in images):
        if position_ids is not None:
            raise ValueError("rows with images are not packed: their positions are the model's own (M-RoPE)")
        media = forward_inputs(model, input_ids.to(device), images)
    # the decoder stack alone skips the LM head; with images the multimodal model embeds them
    decoder = model if media else model.get_decoder() if hasattr(model, "get_decoder") else model
    with deepstack_inputs(model) as deepstack:
        out = decoder(
            input_ids=input_ids.to(device),
            **{k: v.to(device) if v is not None else None for k, v in masks.items()},
            **media,
            output_hidden_states=True if media else list(layers),
            use_cache=False,
            **({"logits_to_keep": 1} if media else {}),
        )
    hidden = with_deepstack(out.hidden_states, deepstack)
    real = attention_mask.to(device)[..., None].bool()  # [B, T, 1]
    return {layer: hidden[layer].masked_fill(~real, 0.0) for layer in layers}


class OnlineFeaturizer:
    """FeatureBatch without hidden states -> with them, by running the frozen target."""

    def __init__(self, model, layers: Sequence[int]):
        self.model, self.layers = model, tuple(layers)

    def __call__(self, batch: FeatureBatch) -> FeatureBatch:
        device = next(self.model.parameters()).device
        hidden = target_features(self.model, batch.input_ids, batch.attention_mask, self.layers, batch.position_ids, batch.images)
        return FeatureBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, hidden, batch.position_ids).to(device)


# ----------------------------------------------------------------------------------------------
# Captured shards
# ----------------------------------------------------------------------------------------------


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def capture_features(
    model,
    samples: IndexedSamples,
    layers: Sequence[int],
    out_dir: str | Path,
    *,
    batch_size: int = 4,
    shard_samples: int = 256,
    dtype: str | torch.dtype = "float32",
    pad_token_id: int = 0,
    meta: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
    share: WorkShare | None = None,
    featurize: Callable[..., dict[int, torch.Tensor]] | None = None,
) -> Path:
    """Run the target over `samples` (TokenDataset-like) and write hidden states to shards.

    featurize(input_ids, attention_mask, layers) -> {layer: [B, T, H]}: another engine's forward
    in place of `target_features` on `model` (the llama.cpp backend's `hidden_states`).

    Resumable: a shard covers samples [k*shard_samples, (k+1)*shard_samples) and is written to a
    temp file then renamed, so complete shards from an interrupted run are kept and skipped.
    share: this process's part of a job run by several (WorkShare; default alone). The missing
    shards are dealt round-robin, so a rerun after a rank died spreads what is left over all
    ranks; the main rank writes the index once every shard is on disk.
    `progress(n)` is called with the number of samples done after each batch (this rank's, plus
    the kept shards on the main rank). Returns the index path.
    """
    share = share or WorkShare()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store_dtype = resolve_dtype(dtype)
    layers = tuple(sorted(layers))
    n = len(samples)
    plan = {
        "version": FORMAT_VERSION,
        "layers": list(layers),
        "dtype": str(store_dtype).removeprefix("torch."),
        "num_samples": n,
        "shard_samples": shard_samples,
        "batch_size": batch_size,
        "meta": meta or {},
    }
    plan_file = out_dir / CAPTURE_PLAN
    if plan_file.exists():
        changed = plan_changes(read_json(plan_file), plan)
        if changed:
            raise ValueError(
                f"{out_dir} holds a capture made otherwise ({'; '.join(changed)}): pass --overwrite to "
                "capture again from scratch, or use another --out"
            )
    if share.is_main:
        remove_partial_shards(out_dir)
        mark_output(out_dir, "capture folder", CAPTURE_FILES)
        write_atomically(plan_file, json.dumps(plan, indent=1))

    bounds = [(k, start, min(n, start + shard_samples)) for k, start in enumerate(range(0, n, shard_samples))]
    missing = [k for k, _, _ in bounds if not (out_dir / _shard_name(k)).exists()]
    share.barrier()  # all ranks have listed the missing shards before any rank writes one
    # each rank writes the shards it was dealt (that is the sharing); the index is the main rank's
    mine, kept = set(share.mine(missing)), set(range(len(bounds))) - set(missing)
    for k, start, stop in bounds:
        path = out_dir / _shard_name(k)
        if k in mine:
            tensors = _capture_shard(
                featurize or partial(target_features, model), samples, range(start, stop), layers, batch_size, store_dtype, pad_token_id, progress
            )
            tmp = path.with_suffix(".tmp")
            try:
                with reported_as(path):
                    save_file(tensors, str(tmp))
            except BaseException:
                tmp.unlink(missing_ok=True)  # free what the failed write took
                raise
            os.replace(tmp, path)
        elif k in kept and share.is_main and progress is not None:
            progress(stop - start)

    share.barrier()  # every shard is on disk
    index_file = out_dir / INDEX_FILE
    if share.is_main:
        shards = []
        hidden_size = None
        for k, start, stop in bounds:
            path = out_dir / _shard_name(k)
            with safe_open(str(path), "pt") as f:
                num_tokens = f.get_slice("input_ids").get_shape()[0]
                hidden_size = f.get_slice(f"hidden.{layers[0]}").get_shape()[1]
            shards.append({"file": path.name, "num_samples": stop - start, "num_tokens": num_tokens})
        write_atomically(index_file, json.dumps(dict(plan, hidden_size=hidden_size, shards=shards), indent=1))
    share.barrier()  # no rank returns the index path before the index is there
    return index_file


def plan_changes(saved: dict, plan: dict, prefix: str = "") -> list[str]:
    """'key: saved -> now' for every field of a capture plan that differs (nested: meta.data_sha256)."""
    changes = []
    for key in sorted(set(saved) | set(plan)):
        a, b = saved.get(key, "<unset>"), plan.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            changes += plan_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            short = lambda v: f"{v[:12]}..." if isinstance(v, str) and len(v) == 64 else repr(v)  # noqa: E731  a sha256
            changes.append(f"{prefix}{key}: {short(a)} -> {short(b)}")
    return changes


def remove_partial_shards(out_dir: Path) -> list[Path]:
    """Delete the temp files killed writes left in a capture folder (`shard-*.tmp`, and atomic
    writes' `.*.tmp`). Only the main rank calls it, before any rank writes a shard."""
    gone = sorted(p for p in out_dir.glob("*.tmp") if p.is_file())
    for p in gone:
        p.unlink()
    return gone


def _capture_shard(featurize, samples, indices, layers, batch_size, store_dtype, pad_token_id, progress) -> dict[str, torch.Tensor]:
    ids, att, lm, offsets = [], [], [], [0]
    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    indices = list(indices)
    for b0 in range(0, len(indices), batch_size):
        chunk = [samples[i] for i in indices[b0 : b0 + batch_size]]
        batch = collate(chunk, pad_token_id)
        feats = featurize(batch.input_ids, batch.attention_mask, layers)
        for b, s in enumerate(chunk):
            t = len(s["input_ids"])
            ids.append(batch.input_ids[b, :t])
            att.append(batch.attention_mask[b, :t].to(torch.uint8))
            lm.append(batch.loss_mask[b, :t])
            offsets.append(offsets[-1] + t)
            for layer in layers:
                hidden[layer].append(feats[layer][b, :t].to("cpu", store_dtype))
        if progress is not None:
            progress(len(chunk))
    tensors = {
        "offsets": torch.tensor(offsets, dtype=torch.long),
        "input_ids": torch.cat(ids),
        "attention_mask": torch.cat(att),
        "loss_mask": torch.cat(lm),
    }
    tensors.update({f"hidden.{layer}": torch.cat(hs).contiguous() for layer, hs in hidden.items()})
    return tensors


class CapturedFeatures(torch.utils.data.Dataset):
    """Samples {input_ids, loss_mask, hidden_states} read lazily (memory-mapped) from captured shards."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        index_file = self.dir / INDEX_FILE
        if not index_file.exists():
            raise FileNotFoundError(f"no captured features at {self.dir} (missing {INDEX_FILE}); run `drafthead data capture`")
        self.index = read_json(index_file)  # bad JSON or bytes: one line naming the file
        if self.index.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{index_file}: format version {self.index.get('version')}, expected {FORMAT_VERSION}: capture "
                "again (`drafthead data capture --overwrite`), which records what the features were made from"
            )
        self.layers: tuple[int, ...] = tuple(self.index["layers"])
        self.hidden_size: int = self.index["hidden_size"]
        self._starts = []  # first global sample index of each shard
        total = 0
        for shard in self.index["shards"]:
            self._starts.append(total)
            total += shard["num_samples"]
        self._len = total
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        for k in range(len(self.index["shards"])):  # a damaged shard fails now, not at its first batch
            self._shard(k)

    def __len__(self) -> int:
        return self._len

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self._len:
            raise IndexError(i)
        k = max(j for j, s in enumerate(self._starts) if s <= i)
        return k, i - self._starts[k]

    def _shard(self, k: int):
        if k not in self._handles:
            path = self.dir / self.index["shards"][k]["file"]
            try:
                self._handles[k] = safe_open(str(path), "pt")
            except SafetensorError as e:  # cut short or damaged after it was renamed into place
                raise ValueError(
                    f"captured shard {path} is truncated or corrupt ({e}): delete it and rerun "
                    "`drafthead data capture` with the same settings, which writes the missing shards"
                ) from e
            self._offsets[k] = self._handles[k].get_tensor("offsets")
        return self._handles[k], self._offsets[k]

    def __getitem__(self, i: int, *, with_hidden: bool = True) -> dict[str, Any]:
        return self._sample(i, with_hidden)

    def _sample(self, i: int, with_hidden: bool) -> dict[str, Any]:
        k, j = self._locate(int(i))
        f, offsets = self._shard(k)
        a, b = int(offsets[j]), int(offsets[j + 1])
        sample = {
            "input_ids": f.get_slice("input_ids")[a:b],
            "loss_mask": f.get_slice("loss_mask")[a:b],
        }
        if with_hidden:
            sample["hidden_states"] = {layer: f.get_slice(f"hidden.{layer}")[a:b] for layer in self.layers}
        return sample

    def token_counts(self, vocab_size: int, indices: Iterable[int] | None = None) -> torch.Tensor:
        """[V] how often each token id is a loss-masked (assistant) token in the given samples."""
        indices = range(len(self)) if indices is None else indices
        return label_token_counts((self._sample(i, with_hidden=False) for i in indices), vocab_size)

    def __getstate__(self):  # safe_open handles do not pickle (DataLoader workers): reopen lazily
        state = dict(self.__dict__)
        state["_handles"], state["_offsets"] = {}, {}
        return state
