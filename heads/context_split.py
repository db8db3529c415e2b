"""Context parallelism for a draft layer: one sequence's columns split across the ranks of a group.

Each of `size` ranks holds `shard` consecutive columns of every row (the last rank's tail padded):
rank r computes columns [r * shard, (r + 1) * shard). Everything a draft layer does per column
(fc, norms, MLP, the LM head and the loss) runs on the local columns only. Causal attention needs
the keys of every earlier column: `gather` all-gathers the local keys along the sequence, with a
backward that sums every rank's gradient into the keys' owner (torch.distributed.nn's all_gather).
That is the all-gather form of context parallelism: activations and scores split by `size`, the
keys and values (a few [T, kv_heads, D] per step) whole on every rank. It needs no head count
divisible by the group size, which Ulysses' all-to-all does, and keeps attention masks in their
global column numbering, which ring attention does not.

Losses are means over the whole sequence: each rank sums its columns' terms over the group's count
(`all_sum`), so the group's partial losses add up to the unsplit loss, and so do its gradients.
What weighs a row's positions together is computed over the whole row: LK^lambda's weight from the
group's mean acceptance, the entropy curriculum's cut from every rank's entropies
(`gather_ragged`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ContextSplit:
    """rank: this process's place in the group (0..size-1); group: the torch.distributed process
    group of the ranks that share each row (None: the default group)."""

    rank: int
    size: int
    group: object = None

    def shard(self, length: int) -> int:
        """Columns per rank for rows of `length` (the last rank's tail padded)."""
        return -(-length // self.size)

    def bounds(self, length: int) -> tuple[int, int]:
        """(first, end) of this rank's columns in the padded row of shard(length) * size columns."""
        s = self.shard(length)
        return self.rank * s, (self.rank + 1) * s

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `local` (same shape), concatenated along `dim` in rank order; differentiable."""
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(local.contiguous(), group=self.group), dim=dim)

    def gather_ragged(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's 1-D `local`, whatever its length, in rank order; no gradient."""
        sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([local.numel()], device=local.device), group=self.group)
        width = max(int(n) for n in sizes)
        padded = torch.zeros(width, dtype=local.dtype, device=local.device)
        padded[: local.numel()] = local.detach()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return [part[: int(n)] for part, n in zip(parts, sizes)]

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over the group of a tensor that needs no gradient (counts, metrics)."""
        out = value.detach().clone()
        dist.all_reduce(out, group=self.group)
        return out


def pad_positions(position_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[B, T] positions padded to [B, length]: the padding continues the last conversation."""
    tail = position_ids[:, -1:] + torch.arange(1, length - position_ids.shape[1] + 1, device=position_ids.device)
    return torch.cat([position_ids, tail], dim=1)


def pad_columns(x: torch.Tensor, length: int, fill=0) -> torch.Tensor:
    """x [B, T, ...] padded with `fill` to [B, length, ...] (length >= T)."""
    if x.shape[1] == length:
        return x
    pad = torch.full((x.shape[0], length - x.shape[1], *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)
