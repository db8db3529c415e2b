"""Chat samples streamed from a local file larger than memory (docs/models-and-data.md, "Data
formats and streaming").

Nothing is materialised: records are read lazily (parquet / csv / arrow through
`datasets.load_dataset(..., streaming=True)`, JSON arrays and JSON lines through our incremental
record decoder in train/data/sources.py, `save_to_disk` folders memory-mapped), normalised as in the
cached path, then `.map`-ped through the chat template into samples shaped like
`TokenDataset.__getitem__` (train/data/samples.py): `{"input_ids": LongTensor [T], "loss_mask": BoolTensor [T]}`.
Memory is bounded by the shuffle buffer (`shuffle_buffer` tokenized samples) plus one read chunk.

The sample stream, in file order, is split and batched so that a trainer on several processes
stays in step (docs/style.md 8):

    usable samples:  e0 .. e{E-1} | t0 t1 t2 ...
                     eval set     | training: shuffled by a buffer seeded with (seed, epoch)
    training, cut into chunks of world_size * batch_size:
                     chunk k = batch k of every rank; rank r takes samples [r*B, (r+1)*B) of it;
                     an incomplete last chunk is dropped on every rank.

Every rank reads (and tokenizes) the whole stream: which samples are usable is known only after
tokenization, and only a shared view lets all ranks agree on the epoch's end without talking.
Resuming skips the batches already consumed by reading them again: exact, at the cost of
re-tokenizing that part of the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, TypeVar

import datasets
import torch

from .chat_format import format_row, has_loss
from .samples import label_token_counts, token_sample
from .sources import EmptySourceError, SourceReport, empty_source_error, iter_conversations, resolve_source, source_format

T = TypeVar("T")


def rank_batches(samples: Iterable[T], batch_size: int, rank: int = 0, world_size: int = 1, skip: int = 0) -> Iterator[list[T]]:
    """Rank `rank`'s batches of a sample stream that all `world_size` ranks read alike.

    The stream is cut into chunks of world_size * batch_size; chunk k is batch k on every rank,
    rank r taking samples [r*batch_size, (r+1)*batch_size) of it. An incomplete last chunk is
    dropped on every rank, so all ranks end the epoch after the same number of batches. The
    first `skip` chunks are read and dropped: resuming after `skip` consumed batches.
    """
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size or skip < 0:
        raise ValueError(f"need batch_size >= 1, 0 <= rank < world_size, skip >= 0; got {batch_size=}, {rank=}, {world_size=}, {skip=}")
    chunk_size = world_size * batch_size
    chunk: list[T] = []
    k = 0
    for sample in samples:
        chunk.append(sample)
        if len(chunk) == chunk_size:
            if k >= skip:
                yield chunk[rank * batch_size : (rank + 1) * batch_size]
            chunk, k = [], k + 1


def _conversations(file: str, fmt: str, report: SourceReport, limit: int | None) -> Iterator[dict]:
    # no duplicate-id renaming: it would remember every id (unbounded memory); ids are not used here
    yield from iter_conversations(Path(file), fmt, report, limit, rename_duplicates=False)


@dataclass
class TokenStream:
    """The usable token samples of one local source, streamed; see the module docstring.

    `limit` keeps the first N usable conversations (as in the cached path); `eval_size` usable
    samples at the head of the stream (never shuffled) are the eval set and never trained on;
    `shuffle_buffer` <= 1 trains in file order. `report` is the SourceReport of the latest pass
    (live while it runs), e.g. for logging what was dropped after an epoch.
    """

    source: str
    path: str | None
    tokenizer: Any = field(repr=False)
    max_length: int
    eval_size: int = 0
    shuffle_buffer: int = 0
    limit: int | None = None
    report: SourceReport | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.file = resolve_source(self.source, self.path)
        if not self.file.exists():
            raise FileNotFoundError(f"source file {self.file} does not exist")
        self.format = source_format(self.source, self.file)
        if self.eval_size < 0 or self.shuffle_buffer < 0 or (self.limit is not None and self.limit <= 0):
            raise ValueError(f"need eval_size >= 0, shuffle_buffer >= 0, limit > 0; got {self.eval_size}, {self.shuffle_buffer}, {self.limit}")

    def samples(self) -> datasets.IterableDataset:
        """Rows {id, input_ids, loss_mask, ...} of every usable sample, in file order (a fresh pass, fresh `report`)."""
        self.report = SourceReport(source=self.source if self.source == "sharegpt" else str(self.file))
        # gen_kwargs reach the generator as they are (not copied), so `report` fills in live
        rows = datasets.IterableDataset.from_generator(
            _conversations, gen_kwargs={"file": str(self.file), "fmt": self.format, "report": self.report, "limit": self.limit}
        )
        tokenizer, max_length = self.tokenizer, self.max_length
        return rows.map(lambda row: format_row(tokenizer, row, max_length), remove_columns=["messages", "answer_token_ids"]).filter(
            has_loss, input_columns="n_loss"
        )

    def eval_samples(self) -> list[dict[str, torch.Tensor]]:
        """The first `eval_size` usable samples (fewer if the stream is shorter)."""
        if self.eval_size == 0:
            return []
        return [token_sample(row) for row in self.samples().take(self.eval_size)]

    def _train_rows(self, seed: int, epoch: int) -> datasets.IterableDataset:
        rows = self.samples().skip(self.eval_size)
        if self.shuffle_buffer > 1:
            rows = rows.shuffle(seed=seed, buffer_size=self.shuffle_buffer)
            rows.set_epoch(epoch)  # datasets shifts the buffer's generator by the epoch
        return rows

    def train_samples(self, seed: int = 0, epoch: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        """The samples after the eval set, in an order fixed by (seed, epoch)."""
        return map(token_sample, self._train_rows(seed, epoch))

    def batches(
        self, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0, epoch: int = 0, skip: int = 0
    ) -> Iterator[list[dict[str, torch.Tensor]]]:
        """This rank's batches (lists of samples) of one epoch, after `skip` batches already consumed
        (see `rank_batches`). Raises EmptySourceError, on every rank alike, when the epoch has no batch."""
        n = 0
        for rows in rank_batches(self._train_rows(seed, epoch), batch_size, rank, world_size, skip):
            n += 1
            yield [token_sample(row) for row in rows]  # tensors only for this rank's share
        if n == 0 and skip == 0:
            raise self._too_short(batch_size * world_size)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """[V] label-token counts of the training samples (one pass), as TokenDataset.token_counts."""
        return label_token_counts(self.train_samples(), vocab_size)

    def count_batches(self, batch_size: int, world_size: int = 1) -> int:
        """Batches per rank in one epoch (the same for every seed and epoch): one pass over the file."""
        usable = sum(1 for _ in self.samples())
        n = max(0, usable - self.eval_size) // (batch_size * world_size)
        if n == 0:
            raise self._too_short(batch_size * world_size)
        return n

    def _too_short(self, chunk: int) -> EmptySourceError:
        report = self.report
        if report is not None and report.conversations == 0:
            return empty_source_error(self.file, report)
        return EmptySourceError(
            f"{self.file}: too few usable samples to train on: {self.eval_size} go to the eval set and a batch "
            f"needs world_size * batch_size = {chunk} more ({report.summary() if report else ''})"
        )
