"""The served traffic as training samples: what a head trains on, recorded from the verify
forwards the engine runs anyway (no extra target forward).

For each served answer the engine hands the observer (inference/engine/decoder.py `observers`)
the prompt's prefilled tokens, then every round's committed tokens, each with the target's hidden
states at the head's training layers (train/capture/features.py `required_layers`). A finished answer
becomes one sample, prompt + answer tokens (the answer's last token has no hidden state yet: it
was never fed back, so it is left out), the answer's tokens loss-masked: the same sample
`drafthead data capture` writes for a chat.

Samples go to shards in the capture format (train/capture/features.py), so `CapturedFeatures` and the
trainer read the buffer as they read a capture:

    DIR/buffer/index.json                  the shards in order (oldest first), written atomically
    DIR/buffer/shard-NNNNN.safetensors     `shard_samples` answers each, written whole then renamed

The buffer is bounded: when its tokens or bytes pass the caps, its oldest shards are dropped.
The engine thread copies the tensors and joins a shard's; a thread of its own writes the files
(and runs no torch op: see `flush`).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..capture.features import FORMAT_VERSION, INDEX_FILE
from ..capture.workshare import write_atomically

BUFFER_DIR = "buffer"


@dataclass
class _Answer:
    """One row's tokens and hidden states so far."""

    tokens: list[torch.Tensor] = field(default_factory=list)  # [k] each
    hidden: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> [k, H] each
    prompt_len: int = 0  # tokens before the answer (the prefilled ones and the pending one)


class TrafficBuffer:
    """Observer of a Decoder's rows (`record(row, tokens, features)`) and `finish(row)` when a row
    is done; writes the answers as capture shards under `folder`."""

    def __init__(
        self,
        folder: Path,
        layers: tuple[int, ...],
        *,
        meta: dict,
        dtype: torch.dtype = torch.bfloat16,
        shard_samples: int = 8,
        max_tokens: int = 200_000,
        max_bytes: int = 2 * 2**30,
        flush_seconds: float = 10.0,
    ):
        """A shard is written once `shard_samples` answers are done, or `flush_seconds` after the
        first of them (`flush_due`): light traffic still reaches the trainer."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.layers = tuple(sorted(layers))
        self.meta = meta
        self.dtype = dtype
        self.shard_samples = shard_samples
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.flush_seconds = flush_seconds
        self._first_done = 0.0  # when the oldest answer not yet in a shard finished
        self._open: dict[int, _Answer] = {}  # id(row) -> its answer so far
        self._done: list[dict[str, torch.Tensor]] = []  # finished samples not yet in a shard
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.index = self._read_index()
        self.tokens = sum(s["num_tokens"] for s in self.index["shards"])  # tokens in the written shards
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="drafthead-buffer", daemon=True)
        self._writer.start()

    # -- the engine thread -------------------------------------------------------------------------

    def record(self, row, tokens: torch.Tensor, features) -> None:
        """A Decoder observer: row's committed tokens [1, k] and the recorded layers at them."""
        if features is None:
            return
        answer = self._open.get(id(row))
        if answer is None:
            answer = self._open[id(row)] = _Answer(prompt_len=row.prompt_len)
        answer.tokens.append(tokens[0].detach().to("cpu"))
        for layer, h in zip(features.layers, features.hidden_states):
            answer.hidden.setdefault(layer, []).append(h[0].detach().to("cpu", self.dtype))

    def finish(self, row, keep: bool = True) -> None:
        """The row is done: its answer becomes a sample (kept: it answered; else it is dropped)."""
        answer = self._open.pop(id(row), None)
        if answer is None or not keep or not answer.tokens:
            return
        # the prompt and every emitted token but the last; a round cut by a stop recorded nodes past it
        length = answer.prompt_len + len(row.emitted) - 1
        ids = torch.cat(answer.tokens)[:length]
        if ids.numel() <= answer.prompt_len:  # no answer token has a hidden state
            return
        loss_mask = torch.zeros(ids.numel(), dtype=torch.bool)
        loss_mask[answer.prompt_len :] = True
        hidden = {f"hidden.{layer}": torch.cat(answer.hidden[layer])[: ids.numel()] for layer in self.layers}
        sample = {"input_ids": ids, "loss_mask": loss_mask, **hidden}
        if not self._done:
            self._first_done = time.monotonic()
        self._done.append(sample)
        if len(self._done) >= self.shard_samples:
            self.flush()

    def flush_due(self) -> None:
        """Flush when the oldest finished answer has waited `flush_seconds` (called between rounds)."""
        if self._done and time.monotonic() - self._first_done >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Queue the finished samples as a shard, its tensors joined here and written to disk on
        the writer thread. Joining here keeps torch's parallel ops off the writer thread: a
        second thread running them starts a second OpenMP team on the same cores, whose waiting
        threads slow the target's forward on this one (35 -> 20 tokens/s on 2 cores, docs/results.md)."""
        if self._done:
            self._queue.put(_shard_tensors(self._done))
            self._done = []

    def close(self) -> None:
        """Write what is finished and stop the writer (the samples of rows still open are lost)."""
        self.flush()
        self._queue.put(None)
        self._writer.join()

    # -- the writer thread -------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            tensors = self._queue.get()
            if tensors is None:
                return
            self._write_shard(tensors)

    def _write_shard(self, tensors: dict[str, torch.Tensor]) -> None:
        offsets = tensors["offsets"]
        num_samples, num_tokens = offsets.numel() - 1, int(offsets[-1])
        with self._lock:
            number = self.index["next_shard"]
            path = self.folder / f"shard-{number:05d}.safetensors"
            tmp = path.with_suffix(".tmp")
            try:
                save_file(tensors, str(tmp))
                os.replace(tmp, path)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
            entry = {"file": path.name, "num_samples": num_samples, "num_tokens": num_tokens, "bytes": path.stat().st_size}
            self.index["shards"].append(entry)
            self.index["next_shard"] = number + 1
            self.tokens += num_tokens
            dropped = self._bound()
            self._write_index()
            for old in dropped:  # after the index no longer lists them
                (self.folder / old["file"]).unlink(missing_ok=True)

    def _bound(self) -> list[dict]:
        """Drop the oldest shards past the caps (the newest always stays); returns them."""
        shards, dropped = self.index["shards"], []
        while len(shards) > 1 and (self.tokens > self.max_tokens or sum(s["bytes"] for s in shards) > self.max_bytes):
            old = shards.pop(0)
            self.tokens -= old["num_tokens"]
            dropped.append(old)
        return dropped

    def _read_index(self) -> dict:
        """The index on disk (a restart continues the buffer), its shards checked to be there."""
        path = self.folder / INDEX_FILE
        fresh = {
            "version": FORMAT_VERSION,
            "layers": list(self.layers),
            "dtype": str(self.dtype).removeprefix("torch."),
            "shard_samples": self.shard_samples,
            "batch_size": 1,
            "meta": self.meta,
            "hidden_size": None,
            "shards": [],
            "next_shard": 0,
        }
        for tmp in self.folder.glob("*.tmp"):  # a killed write's leftovers
            tmp.unlink()
        if not path.exists():
            return fresh
        index = json.loads(path.read_text())
        if index.get("layers") != list(self.layers) or index.get("meta", {}).get("target_identity") != self.meta.get("target_identity"):
            raise ValueError(f"{self.folder} holds traffic recorded for another head or target: choose another --adapt folder")
        index["shards"] = [s for s in index["shards"] if (self.folder / s["file"]).exists()]
        return index

    def _write_index(self) -> None:
        index = self.index
        if index["hidden_size"] is None and index["shards"]:
            with safe_open(str(self.folder / index["shards"][-1]["file"]), "pt") as f:
                index["hidden_size"] = f.get_slice(f"hidden.{self.layers[0]}").get_shape()[1]
        index["num_samples"] = sum(s["num_samples"] for s in index["shards"])
        write_atomically(self.folder / INDEX_FILE, json.dumps(index, indent=1))

    def snapshot(self) -> dict:
        """A copy of the index (what a reader may open now)."""
        with self._lock:
            return json.loads(json.dumps(self.index))


def _shard_tensors(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Samples joined as one capture shard's tensors (train/capture/features.py's layout)."""
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + s["input_ids"].numel())
    layers = [key for key in samples[0] if key.startswith("hidden.")]
    return {
        "offsets": torch.tensor(offsets, dtype=torch.long),
        "input_ids": torch.cat([s["input_ids"] for s in samples]),
        "attention_mask": torch.ones(offsets[-1], dtype=torch.uint8),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]),
        **{key: torch.cat([s[key] for s in samples]).contiguous() for key in layers},
    }
