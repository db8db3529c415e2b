"""The target's forward in llama.cpp: one `llama_decode` verifies every row's whole tree
(docs/llamacpp-backend.md).

Sequences of one unified KV cache (sequences.py):

    row b (its committed text)     sequence b
    row b's tree leaves            sequences first_leaf(b) + k, rebuilt each round (a chain,
                                   plain decoding included, runs on sequence b itself)
    keep(path)                     the accepted nodes join sequence b (seq_cp from the leaf below
                                   the deepest accepted node); every leaf sequence is removed,
                                   which frees the cells of the rejected nodes

With `streams` (`open(..., streams=True)`, what `drafthead serve` runs), each row is instead a
stream of its own: a sequence of a non-unified cache whose tokens attend to its cells only, so a
row's attention does not grow with the other rows' text. llama.cpp takes no token of several
sequences there, so trees are cut to their first chain; the rows' chains are padded to one length
and the rows kept on sequences 0..B - 1, which llama.cpp then runs as one forward
(docs/llamacpp-backend.md "Streams").

Heads and drafters stay in torch: logits [B, N, V] and the drafters' feature layers (the inputs
of the target's layers, HF `hidden_states[i]` = llama.cpp's layer input i) come back as tensors,
and so does the final normed state (HF `hidden_states[-1]`, key -1: llama.cpp's token embeddings
output, the tensor its LM head multiplies) for the heads that read it.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import numpy as np
import torch

from ..engine.policy import cut_tree
from ..engine.recurrent import has_recurrent_layers
from ..engine.tree import DraftTree, first_chain
from ..engine.verify import Verification
from . import lib as _lib
from .sequences import depths_of, leaf_sets, nodes_within

LAST = -1  # the key of the final normed state among the returned hidden states (HF's hidden_states[-1])
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: every row and every leaf of every tree
BATCH_TOKENS = 512  # tokens per llama_decode call (prefill is cut into such chunks)
FLASH_ATTENTION = 0  # off: llama.cpp's CPU flash attention rounds a one-token and a several-token forward apart, in f32 too


class LlamaCppError(RuntimeError):
    """libllama refused a model, a context or a batch."""


class LlamaCppTarget:
    """A GGUF target in llama.cpp, for `speculative_generate` in place of a transformers model.

    `config` is the target's transformers config (context limit, vocabulary, layer count); the
    drafter still runs on the torch model the head was loaded with. `feature_dtype`: the dtype
    features come back in (the drafter's).
    """

    def __init__(self, gguf: str | Path, config, *, threads: int = 2, feature_dtype: torch.dtype = torch.float32):
        if has_recurrent_layers(config):  # before anything loads: a refusal costs nothing
            raise LlamaCppError(
                f"{gguf}: {config.model_type} has recurrent layers, whose states this backend's "
                'tree rounds would branch: decode it on the torch backend (docs/trees.md "Hybrid targets")'
            )
        self.lib = _lib.load()
        self.path = Path(gguf)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no GGUF file")
        self.config = config
        self.feature_dtype = feature_dtype
        self.model = self.lib.dh_load_model(str(self.path).encode())
        if not self.model:
            raise LlamaCppError(f"{self.path}: llama.cpp cannot load this GGUF (DRAFTHEAD_LLAMA_VERBOSE=1 says why)")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = self.lib.llama_model_n_layer(self.model)
        self.hidden_size = self.lib.llama_model_n_embd(self.model)
        self.vocab_size = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self.model))
        if (self.num_layers, self.hidden_size) != (text.num_hidden_layers, text.hidden_size):
            raise LlamaCppError(
                f"{self.path}: {self.num_layers} layers of width {self.hidden_size}, but the target's "
                f"config has {text.num_hidden_layers} of {text.hidden_size}: another model's GGUF"
            )
        self.ctx = None
        self.context = 0  # KV cells of the current context, shared by every row and tree
        self.streams = 0  # streams of the current context (0: one unified cache)
        self.threads = threads
        self._features: tuple[int, ...] = ()
        self._rows: list[int] = []  # sequence id of each active row, in batch order
        self._first_leaf = 0
        self._leaves: dict[int, tuple[int, list[list[int]], list[int]]] = {}

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # -- the engine's side (inference/engine/generate.py) -----------------------------------------

    device = torch.device("cpu")

    def engine_context(self, enabled: bool):
        return contextlib.nullcontext()

    def start(self, prompts: list[torch.Tensor], feature_layers: tuple[int, ...], need_last: bool, max_new_tokens: int = 0):
        """Empty the cache and run every prompt but its last token, row b as sequence b.
        Returns {hidden-state index: [B, P - 1, H]} for the drafters (padded rows), or None."""
        if len(prompts) > MAX_SEQUENCES // 2:
            raise ValueError(f"the llama.cpp backend takes at most {MAX_SEQUENCES // 2} rows, got {len(prompts)}")
        self.open(len(prompts), sum(p.numel() for p in prompts) + len(prompts) * (max_new_tokens + 1) + BATCH_TOKENS, feature_layers, need_last)
        return self.join(prompts)

    def open(self, rows: int, cells: int, feature_layers: tuple[int, ...], need_last: bool, streams: bool = False) -> None:
        """An empty cache of at least `cells` KV cells for up to `rows` rows (sequences 0..rows - 1;
        the trees' leaves take the sequences after them), whose drafters read `feature_layers`.
        streams: each row a stream of cells // rows cells (the module docstring)."""
        if rows > (MAX_SEQUENCES if streams else MAX_SEQUENCES // 2):
            raise ValueError(f"the llama.cpp backend takes at most {MAX_SEQUENCES // 2} rows, got {rows}")
        self._ensure_context(cells, rows if streams else 0)
        self.lib.llama_memory_clear(self.memory, True)
        wanted = tuple(sorted(set(feature_layers)))
        if any(layer > self.num_layers for layer in wanted):
            raise NotImplementedError(
                f"features {wanted}: llama.cpp returns hidden states 0..{self.num_layers} (the inputs of its layers and the final normed state)"
            )
        layer_inputs = {layer for layer in wanted if layer < self.num_layers}
        for layer in {i for i in self._features if 0 <= i < self.num_layers} | layer_inputs:
            self.lib.dh_set_layer_inp(self.ctx, layer, layer in layer_inputs)
        self._features = wanted + ((LAST,) if need_last else ())
        # the final normed state (hidden_states[L], also asked for as -1): llama.cpp's embeddings
        # output; with it on, llama.cpp outputs every token of a batch (logits too), prefill included
        self.lib.llama_set_embeddings(self.ctx, any(self._is_normed(i) for i in self._features))
        self._rows = []
        self._first_leaf = rows  # leaf sequences follow every row's, even after rows leave

    def join(self, prompts: list[torch.Tensor], max_new_tokens: int = 0):
        """Run every prompt but its last token as new rows after the active ones, each on a free
        row sequence. Returns {hidden-state index: [B_new, P - 1, H]} (padded rows), or None."""
        free = [s for s in range(self._first_leaf) if s not in self._rows]  # streams: the rows are 0..B - 1, so these follow them
        if len(prompts) > len(free):
            raise LlamaCppError(f"{len(prompts)} rows join {len(self._rows)} of at most {self._first_leaf}: no free sequence")
        seqs = free[: len(prompts)]
        longest = max(p.numel() for p in prompts) - 1
        hidden = (
            {i: torch.zeros(len(prompts), longest, self.hidden_size, dtype=self.feature_dtype) for i in self._features} if self._features else None
        )
        tokens, where = [], []
        for b, (p, seq) in enumerate(zip(prompts, seqs)):
            ids = p[:-1].tolist()
            tokens += [(t, pos, [seq]) for pos, t in enumerate(ids)]
            where += [(b, pos) for pos in range(len(ids))]
        for start in range(0, len(tokens), BATCH_TOKENS):
            self._run_chunk(tokens[start : start + BATCH_TOKENS], where[start : start + BATCH_TOKENS], None, hidden)
        self._rows += seqs
        return hidden

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """{layer: [B, T, H]} HF `hidden_states[layer]` of every real token of right-padded rows, zero
        at padding: what `data capture --engine llama.cpp` stores (train/capture/features.py
        target_features gives the same from torch). One row at a time, each from an empty cache."""
        B, T = input_ids.shape
        out = {layer: torch.zeros(B, T, self.hidden_size, dtype=self.feature_dtype) for layer in layers}
        for b in range(B):
            n = int(attention_mask[b].sum())
            ids = input_ids[b, :n].cpu()
            # start() runs all but a prompt's last token: one more token makes it run all n
            hidden = self.start([torch.cat([ids, ids[-1:]])], tuple(layers), False)
            for layer in layers:
                out[layer][b, :n] = hidden[layer][0]
        return out

    def cut_to_capacity(self, tree: DraftTree, rows: int) -> DraftTree:
        """The tree cut to the leaves a row may use this round (each leaf is a sequence); with
        streams, to its first chain."""
        if self.streams:
            return tree.subtree(first_chain(tree.parents))
        allowance = (MAX_SEQUENCES - self._first_leaf) // max(1, rows)
        return cut_tree(tree, nodes_within(tree.parents.tolist(), allowance))

    def verify(self, trees: list[DraftTree], lengths: list[int], want_hidden: bool):
        """Every active row's tree in one forward (in chunks of whole rows beyond BATCH_TOKENS);
        returns logits [B, N, V] float32 and {hidden index: [B, N, H]} (N: the largest tree)."""
        width = max(t.num_nodes for t in trees)
        self._leaves = {}
        if self.streams:
            trees = [pad_chain(tree, width) for tree in trees]
        if len(trees) == 1 and width <= BATCH_TOKENS:  # one call fills every entry: the copied outputs are the result
            nodes, _ = self._place(trees[0], lengths[0], 0, self._first_leaf)
            out = self._decode(nodes, outputs=True)
            assert out is not None  # outputs asked for
            hidden = {i: h[None] for i, h in self._layer_inputs(len(nodes)).items()} if want_hidden and self._features else None
            return Verification(out[None], hidden)
        logits = torch.zeros(len(trees), width, self.vocab_size)
        hidden = (
            {i: torch.zeros(len(trees), width, self.hidden_size, dtype=self.feature_dtype) for i in self._features}
            if want_hidden and self._features
            else None
        )
        next_leaf = self._first_leaf
        where: list[tuple[int, int]] = []  # (row b, node) of each entry of the chunk being built
        chunk: list[tuple[int, int, list[int]]] = []  # (token, position, sequence ids)
        # by sequence: llama.cpp runs streams of consecutive ids together
        order = sorted(range(len(trees)), key=self._rows.__getitem__) if self.streams else range(len(trees))
        for b in order:
            tree, length = trees[b], lengths[b]
            nodes, next_leaf = self._place(tree, length, b, next_leaf)
            if chunk and len(chunk) + len(nodes) > BATCH_TOKENS:
                self._run_chunk(chunk, where, logits, hidden)
                chunk, where = [], []
            where += [(b, i) for i in range(len(nodes))]
            chunk += nodes
        self._run_chunk(chunk, where, logits, hidden)
        return Verification(logits, hidden)

    def _place(self, tree: DraftTree, length: int, b: int, next_leaf: int) -> tuple[list[tuple[int, int, list[int]]], int]:
        """Row b's tree as (token, position, sequence ids) entries after its `length` committed
        tokens, its leaves given sequences from `next_leaf` on (a chain stays on the row's own);
        returns the entries and the next free leaf sequence. Records what keep() needs."""
        parents = tree.parents.tolist()
        sets = leaf_sets(parents)
        depth = depths_of(parents)
        n_leaves = len(sets[0])
        row_seq = self._rows[b]
        if n_leaves == 1:  # a chain (plain decoding too) extends the row's own sequence
            seqs = [row_seq]
        else:
            seqs = list(range(next_leaf, next_leaf + n_leaves))
            if next_leaf + n_leaves > MAX_SEQUENCES:
                raise LlamaCppError(f"{n_leaves} leaves do not fit the {MAX_SEQUENCES} sequences (use cut_to_capacity())")
            next_leaf += n_leaves
            for s in seqs:
                self.lib.llama_memory_seq_cp(self.memory, row_seq, s, -1, -1)
        node_seqs = [[seqs[k] for k in node] for node in sets]
        self._leaves[b] = (length, node_seqs, seqs)
        return [(int(t), length + depth[i], node_seqs[i]) for i, t in enumerate(tree.tokens[0].tolist())], next_leaf

    def _run_chunk(self, chunk, where, logits: torch.Tensor | None, hidden: dict | None) -> None:
        """One llama_decode of `chunk`; entry j's logits (when `logits` is given) and feature
        layers land at [row, column] = where[j] of those tensors."""
        out = self._decode(chunk, outputs=logits is not None)
        rows = torch.tensor([b for b, _ in where])
        cols = torch.tensor([i for _, i in where])
        if logits is not None:
            assert out is not None  # outputs asked for
            logits[rows, cols] = out
        if hidden is not None:
            for i, h in self._layer_inputs(len(chunk)).items():
                hidden[i][rows, cols] = h

    def greedy_run(self, token: int, length: int, n: int, stop: tuple[int, ...]) -> list[int]:
        """Up to n plain greedy rounds of the one active row in one library call (shim.cpp
        dh_greedy): `token` (the pending one) goes in at position `length`; returns the tokens
        chosen, stopping after one in `stop`. The cache is left as n plain rounds leave it."""
        out = (ctypes.c_int32 * n)()
        stops = (ctypes.c_int32 * max(1, len(stop)))(*stop)
        done = self.lib.dh_greedy(
            self.ctx, token, length, self._rows[0], n, ctypes.cast(stops, _lib.c_int32_p), len(stop), ctypes.cast(out, _lib.c_int32_p)
        )
        if done < 0:
            raise LlamaCppError(f"llama_decode returned {-1 - done} in a run of plain rounds (1: no room in the KV cache of {self.context})")
        self._leaves = {}
        return list(out[:done])

    def keep(self, paths: list[list[int]], lengths: list[int]) -> None:
        """Row b keeps its accepted nodes `paths[b]` (root first) after its committed text."""
        for b, path in enumerate(paths):
            length, node_seqs, seqs = self._leaves[b]
            if seqs == [self._rows[b]]:  # a chain: drop the rejected tail of the row's own sequence
                self.lib.llama_memory_seq_rm(self.memory, seqs[0], length + len(path), -1)
                continue
            leaf = node_seqs[path[-1]][0]  # its cells hold every node of the path
            self.lib.llama_memory_seq_cp(self.memory, leaf, self._rows[b], length, length + len(path))
            for s in seqs:
                self.lib.llama_memory_seq_rm(self.memory, s, -1, -1)
        self._leaves = {}

    def select_rows(self, keep: list[int], lengths: list[int]) -> None:
        """Only rows `keep` (indices into the active rows) stay; the others' cells are freed. With
        streams, the rows left on sequences past the first len(keep) move down into the freed
        ones (a whole-stream copy in llama.cpp, at the next decode), so the rows stay 0..B - 1."""
        for b, seq in enumerate(self._rows):
            if b not in keep:
                self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        self._rows = [self._rows[b] for b in keep]
        if self.streams:
            free = iter(sorted(set(range(len(self._rows))) - set(self._rows)))
            for b, seq in enumerate(self._rows):
                if seq >= len(self._rows):
                    to = next(free)
                    self.lib.llama_memory_seq_cp(self.memory, seq, to, -1, -1)
                    self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    self._rows[b] = to

    def discard(self, length: int) -> None:
        """Forget the last verified trees and every position from `length` on (row 0): what
        timing a forward needs after each try."""
        for _, _, seqs in self._leaves.values():
            for s in seqs:
                if s not in self._rows:
                    self.lib.llama_memory_seq_rm(self.memory, s, -1, -1)
        self._leaves = {}
        self.lib.llama_memory_seq_rm(self.memory, self._rows[0], length, -1)

    # -- libllama ------------------------------------------------------------------------------

    def _ensure_context(self, cells: int, streams: int = 0) -> None:
        """A context of at least `cells` KV cells (in steps of 1024): the committed text of every
        row, its new tokens and one round's trees; with `streams`, that many streams sharing them.
        A bigger generation or another layout makes a new one."""
        if cells <= self.context and streams == self.streams:
            return
        if self.ctx:
            self.lib.llama_free(self.ctx)
            self.ctx = None
        size = -(-cells // 1024) * 1024
        self.ctx = self.lib.dh_new_context(
            self.model, size, BATCH_TOKENS, streams or MAX_SEQUENCES, self.threads, False, FLASH_ATTENTION, not streams
        )
        if not self.ctx:
            raise LlamaCppError(f"{self.path}: llama.cpp could not make a context of {size} cells")
        self.context, self.streams = size, streams
        self.memory: int | None = self.lib.llama_get_memory(self.ctx)  # a void* (ctypes: an int)
        self._features = ()

    def _decode(self, tokens: list[tuple[int, int, list[int]]], outputs: bool) -> torch.Tensor | None:
        """One llama_decode of (token, position, sequence ids) entries; [n, V] logits if `outputs`."""
        n = len(tokens)
        token = (ctypes.c_int32 * n)(*[t for t, _, _ in tokens])
        pos = (ctypes.c_int32 * n)(*[p for _, p, _ in tokens])
        n_seq = (ctypes.c_int32 * n)(*[len(s) for _, _, s in tokens])
        seq_arrays = [(ctypes.c_int32 * len(s))(*s) for _, _, s in tokens]
        seq_id = (_lib.c_int32_p * n)(*[ctypes.cast(a, _lib.c_int32_p) for a in seq_arrays])
        flags = (ctypes.c_int8 * n)(*([1 if outputs else 0] * n))
        batch = _lib.LlamaBatch(
            n,
            ctypes.cast(token, _lib.c_int32_p),
            None,
            ctypes.cast(pos, _lib.c_int32_p),
            ctypes.cast(n_seq, _lib.c_int32_p),
            ctypes.cast(seq_id, ctypes.POINTER(_lib.c_int32_p)),
            ctypes.cast(flags, ctypes.POINTER(ctypes.c_int8)),
        )
        rc = self.lib.dh_decode(self.ctx, ctypes.byref(batch))
        if rc != 0:
            raise LlamaCppError(
                f"llama_decode returned {rc} for {n} tokens (1: no room in the KV cache of "
                f"{self.context}; < 0: the batch is invalid; DRAFTHEAD_LLAMA_VERBOSE=1 says more)"
            )
        if not outputs:
            return None
        ptr = self.lib.llama_get_logits(self.ctx)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n, self.vocab_size)).copy())

    def _is_normed(self, index: int) -> bool:
        """Whether hidden-state `index` is the final normed state (L, or -1), not a layer input."""
        return index in (LAST, self.num_layers)

    def _layer_inputs(self, n: int) -> dict[int, torch.Tensor]:
        """{layer: [n, H]} the inputs of the feature layers for the last decode's n tokens, and
        {LAST: [n, H]} the final normed state when asked for."""
        out = {}
        for layer in self._features:
            ptr = self.lib.llama_get_embeddings(self.ctx) if self._is_normed(layer) else self.lib.dh_get_layer_inp(self.ctx, layer)
            if not ptr:
                raise LlamaCppError(f"llama.cpp returned no input for layer {layer}")
            array = np.ctypeslib.as_array(ptr, shape=(n, self.hidden_size))
            out[layer] = torch.from_numpy(array.copy()).to(self.feature_dtype)
        return out


def pad_chain(tree: DraftTree, width: int) -> DraftTree:
    """A chain made `width` nodes long by repeating its last token (the filler nodes are drafts
    like any other: verified, and accepted only if the target would emit them)."""
    n = tree.num_nodes
    if n == width:
        return tree
    tokens = torch.cat([tree.tokens, tree.tokens[:, -1:].expand(-1, width - n)], dim=1)
    parents = torch.arange(-1, width - 1, device=tree.parents.device)
    return DraftTree(tokens, parents)
