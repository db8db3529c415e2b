"""Tokenized chats as training samples: `{input_ids [T] long, loss_mask [T] bool, images?}`, the
form the featurizers, the packer and the trainer read, and the label counts EAGLE-3's draft
vocabulary is chosen from."""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import torch


def token_sample(row: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A tokenized row (train/data/chat_format.py) as a training sample: {input_ids [T] long, loss_mask [T] bool}."""
    return {"input_ids": torch.tensor(row["input_ids"], dtype=torch.long), "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.bool)}


def label_token_counts(samples: Iterable[dict[str, Any]], vocab_size: int) -> torch.Tensor:
    """[V] how often each token id is a loss-masked (assistant) token in `samples`: what EAGLE-3's
    reduced draft vocabulary is chosen from."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=vocab_size)[:vocab_size]
    return counts


class IndexedSamples(Protocol):
    """Samples read by index: TokenDataset, CapturedFeatures, a Subset of one, a list of sample dicts."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int, /) -> dict[str, Any]: ...


class TokenDataset(torch.utils.data.Dataset):
    """Samples {input_ids, loss_mask, images?} of a tokenized `datasets.Dataset`
    (train/data/chat_format.py). processor: the target's, which turns a row's image files into pixel
    inputs (train/data/image_chats.py) when the sample is read."""

    def __init__(self, dataset, processor=None):
        self.dataset, self.processor = dataset, processor

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.dataset[int(i)]
        sample = token_sample(row)
        if row.get("images"):
            from .image_chats import prompt_images

            sample["images"] = prompt_images(self.processor, row["images"])
        return sample

    def token_counts(self, vocab_size: int, indices: Iterable[int] | None = None) -> torch.Tensor:
        """[V] how often each token id is a loss-masked (assistant) token in the given samples."""
        return label_token_counts((self[i] for i in (range(len(self)) if indices is None else indices)), vocab_size)
