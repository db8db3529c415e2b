"""The target KV cache lifecycle around a verified tree (docs/style.md 6).

    new_cache()                        an empty transformers DynamicCache
    new_cache(capacity=S)              or one of fixed slot count S (static, docs/trees.md "Static cache")
    (verification forward appends the N tree nodes after `past_len` committed positions)
    keep_path(cache, past_len, path)   keep the accepted nodes' K/V, drop the rest

so after every round the cache again holds one linear sequence (per row: `keep_paths` for a
batch whose rows have accepted different numbers of tokens).

A dynamic layer's tensors are cut to the kept length; a static layer's never change shape (a
compiled forward needs fixed addresses and shapes): its write position, transformers'
`cumulative_length`, is set back to the kept length instead, and the slots after it are stale.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, StaticLayer


def new_cache(num_layers: int | None = None, capacity: int | None = None) -> Cache:
    """A dynamic cache, or with `capacity` a static one of `num_layers` layers holding `capacity`
    slots per row (allocated at the first forward, in the K/V's own dtype and device)."""
    # Every layer is a plain full-length layer, so cropping and gathering act the same on all
    # layers; sliding windows are applied through the attention mask instead.
    if capacity is None:
        return DynamicCache()
    if num_layers is None:
        raise ValueError("a static cache needs the target's layer count")
    return Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(num_layers)])


def cache_capacity(cache: Cache) -> int | None:
    """Slots per row of a static cache (its attention masks span all of them); None for a dynamic one."""
    layers = getattr(cache, "layers", None) or []
    if layers and isinstance(layers[0], StaticLayer):
        return layers[0].max_cache_len
    return None


def _cut(layer, end: int) -> None:
    """Make slot `end` the layer's next write position: a static layer moves its counter (in place,
    its address is static), a dynamic one drops the slots from `end` on."""
    if isinstance(layer, StaticLayer):
        layer.cumulative_length.fill_(end)
    else:
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]


def cache_kwargs(model, cache) -> dict:
    """`{name: cache}` for the model's forward: transformers renamed `past_key_values` to `cache`."""
    name = _CACHE_ARG.get(type(model))
    if name is None:
        params = inspect.signature(type(model).forward).parameters
        name = _CACHE_ARG[type(model)] = "cache" if "cache" in params else "past_key_values"
    return {name: cache}


_CACHE_ARG: dict[type, str] = {}


def _layers(cache: Cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise NotImplementedError(f"unsupported cache type {type(cache).__name__}: expected a layered DynamicCache")
    return layers


def keep_path(cache: Cache, past_len: int, path: list[int] | torch.Tensor) -> None:
    """Keep positions [0, past_len) and the tree nodes `path` (indices into the N appended nodes,
    in order), dropping the other tree nodes, in every layer. In place.

    K/V per layer: [B, kv_heads, past_len + N, d] -> [B, kv_heads, past_len + len(path), d].
    """
    end = past_len + len(path)
    moved = not _is_contiguous_run(path)  # a chain's accepted path is already a prefix of the nodes
    for layer in _layers(cache):
        if not has_kv(layer):
            continue
        if moved:
            # Move the path's K/V up behind the committed prefix in place (the right-hand side is
            # gathered first, so the overlap is safe); the prefix itself is never copied.
            index = torch.as_tensor(path, dtype=torch.long, device=layer.keys.device) + past_len
            layer.keys[:, :, past_len:end] = layer.keys[:, :, index]
            layer.values[:, :, past_len:end] = layer.values[:, :, index]
        _cut(layer, end)


def keep_paths(cache: Cache, lengths: list[int], past_len: int, paths: list[list[int]]) -> int:
    """Batched keep_path for rows of different lengths (docs/trees.md "Batches"). Row b holds its
    committed K/V in slots [0, lengths[b]) of the `past_len` cached ones, and the tree nodes were
    appended at slots past_len + i; its accepted `paths[b]` move to slots lengths[b] onwards.
    The cache is cut to the longest row; slots past a row's own end are stale, hidden by the mask.
    Returns the new slot count. In place.
    """
    ends = [length + len(path) for length, path in zip(lengths, paths)]
    end = max(ends)
    if len(paths) == 1 and lengths[0] == past_len:
        keep_path(cache, past_len, paths[0])
        return end
    width = max(len(path) for path in paths)
    src, dst = [], []
    for length, path in zip(lengths, paths):
        pad = width - len(path)  # repeat the last move: the same value written twice
        src.append([past_len + i for i in path] + [past_len + path[-1]] * pad)
        dst.append(list(range(length, length + len(path))) + [length + len(path) - 1] * pad)
    for layer in _layers(cache):
        if not has_kv(layer):
            continue
        src_t = torch.tensor(src, device=layer.keys.device)[:, None, :, None]  # [B, 1, width, 1]
        dst_t = torch.tensor(dst, device=layer.keys.device)[:, None, :, None]
        # keys and values may differ in width: MLA caches its latent and its rope key (docs/families.md)
        for t in (layer.keys, layer.values):
            shape = (t.shape[0], t.shape[1], width, t.shape[3])
            # gathered before any write, so a destination that overlaps a source is safe
            t.scatter_(2, dst_t.expand(shape), t.gather(2, src_t.expand(shape)))
        _cut(layer, end)
    return end


def select_rows(cache: Cache, rows: list[int], length: int) -> None:
    """Keep batch rows `rows` (in that order) and slots [0, length). In place."""
    for layer in _layers(cache):
        if has_kv(layer):
            index = torch.tensor(rows, device=layer.keys.device)
            # a static layer gets new (narrower) tensors too: a compiled forward sees a new shape
            layer.keys = layer.keys[index]
            layer.values = layer.values[index]
            _cut(layer, length)


def crop(cache: Cache, length: int) -> None:
    """Drop every position at or after `length`."""
    for layer in _layers(cache):
        if has_kv(layer):
            _cut(layer, length)


def has_kv(layer) -> bool:
    """Whether the layer holds K/V: a recurrent layer of a hybrid target has none (recurrent.py),
    and a layer the forward has not reached yet holds nothing."""
    keys = getattr(layer, "keys", None)
    return getattr(layer, "is_initialized", True) and keys is not None and keys.numel() > 0


def _is_contiguous_run(path) -> bool:
    values = path.tolist() if isinstance(path, torch.Tensor) else list(path)
    return values == list(range(len(values)))
