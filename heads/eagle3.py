"""EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test").

    g_t  = fc(cat(F_a1[t], F_a2[t], F_a3[t]))                  fc: 3H -> H, no bias
    h_t  = Midlayer(embed(x_{t+1}), g_t)                        one decoder layer, see below
    q_t  = softmax(lm_head(norm(h_t)))                          over the reduced draft vocab

F_a are target hidden states at output_hidden_states indices `aux_layers` (default (2, L//2, L-3):
the *inputs* of those decoder layers, vLLM's `eagle_aux_hidden_state_layer_ids`). The midlayer
follows vLLM's/SpecForge's EAGLE-3 layer so exported weights load there unchanged:

    residual = g;  a = cat(input_layernorm(e), hidden_norm(g))       [.., 2H]
                   (norm_before_residual: residual = hidden_norm(g), the speculators variant)
    h = residual + self_attn(a)                                      q/k/v_proj take 2H inputs
    h = h + mlp(post_attention_layernorm(h))

built from Llama's attention / MLP / RMSNorm classes sized from the target, whatever its family:
the layer every engine serves (docs/formats.md "The draft layer per target family").
No feature loss: the target is the target model's distribution at t+1 (softmax of its LM head on
the final normed state), restricted to the draft vocab and renormalised, under soft CE or an LK
loss (`loss`, heads/losses.py).

Training-time test (EAGLE-3 sec. 3.2): unroll `ttt_steps` steps; step i feeds its own output
hidden state h^(i-1) as the next step's g and the token one position further right, so step i at
column t predicts token t + 2 + i, with loss sum_i ttt_decay**i * CE_i. Attention at step i: column
t sees step-0 keys at columns <= t (the committed prefix) and its own earlier unroll keys (same
column t, steps 1..i): exactly what a node at depth i of a draft chain sees at inference
(`ttt_attention_mask`). Position id of step i at column t is t + i (the depth rule of `step`).
Progressive TTT (`ttt_ramp`): in training mode the unroll is `ttt_depth` steps at the run's
progress (`train_progress`, set by the trainer each step); evaluation always unrolls them all.
Entropy curriculum (`entropy_ramp`, after EDSD, Cheng et al. ACL 2026, "easy to hard"): in training
mode each unroll step's loss covers only its positions whose target distribution has the lowest
entropy, a share growing from `entropy_start` to 1 over the first `entropy_ramp` of the run
(`entropy_curriculum`); accuracy is still reported over every position, and evaluation uses all.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .batch import FeatureBatch
from .config import Eagle3Config
from .context_split import ContextSplit, pad_columns, pad_positions
from .draft_vocab import build_draft_vocab, draft_target_ids, draft_vocab_from_ids, identity_draft_vocab
from .eagle import DecoderHeadBase, cache_kwarg
from .io import shift_left, shifted_labels
from .losses import (
    acceptance_rate,
    distill_loss,
    dpace_chain_loss,
    entropy_of,
    label_confidence,
    lk_lambda,
    lk_lambda_of_mean,
    loss_chunk_rows,
    recompute_loss,
)
from .packing import causal_within, row_positions
from .ttt_attention import TTTMask, ttt_attention_for


def ttt_depth(steps: int, ramp: float, progress: float) -> int:
    """Unroll steps at training progress `progress` in [0, 1]: growing linearly from 1 to `steps`
    over the first `ramp` share of the run (each depth an equal share of it), then `steps`."""
    if ramp <= 0 or progress >= ramp:
        return steps
    return min(steps, 1 + int(progress / ramp * steps))


def entropy_curriculum(entropy: torch.Tensor, ramp: float, progress: float, start: float) -> torch.Tensor:
    """[N] bool: the positions an easy-to-hard curriculum trains on at `progress` in [0, 1], from
    each position's target-distribution entropy [N]: the ceil(share * N) lowest (ties at the cut
    all kept), share = start + (1 - start) * progress / ramp, growing to every position at `ramp`."""
    n = entropy.numel()
    if ramp <= 0 or progress >= ramp or n == 0:
        return torch.ones_like(entropy, dtype=torch.bool)
    share = start + (1.0 - start) * progress / ramp
    k = min(n, max(1, int(-(-share * n // 1))))
    return entropy <= entropy.kthvalue(k).values


def ttt_attention_mask(T: int, step: int, dtype: torch.dtype, device=None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Additive [1, 1, T, (step + 1) * T] mask of training-time-test step `step` (0-based);
    [B, 1, T, (step + 1) * T] for packed rows (position_ids [B, T], heads/packing.py). The rule in
    dense form: training computes it chunk by chunk (heads/ttt_attention.py TTTMask), and the tests
    hold that to this.

    Keys are laid out block by block as the cache fills: block 0 = step-0 keys (causal: column t
    sees columns <= t, in its own conversation when rows are packed), block j >= 1 = step-j keys
    (diagonal: column t sees only column t).
    """
    cols = torch.arange(T, device=device)
    causal = (cols[None, :] <= cols[:, None])[None]  # block 0, [1, T, T]
    if position_ids is not None:
        causal = causal_within(position_ids.to(device))  # [B, T, T]
    eye = (cols[None, :] == cols[:, None])[None].expand(causal.shape[0], -1, -1)
    allowed = torch.cat([causal] + [eye] * step, dim=2)  # [1 or B, T, (step+1) T]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's midlayer from a draft layer's attention, MLP and norm classes (heads/eagle.py
    `draft_layer_parts`: Llama's unless the head keeps its target family's)."""

    def __init__(self, cfg, parts, norm_before_residual: bool = False) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        H = cfg.hidden_size
        eps = getattr(cfg, "rms_norm_eps", 1e-6)
        self.self_attn = parts.attention(cfg, 0)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name, None)
            if not isinstance(old, nn.Linear):
                raise TypeError(f"{parts.attention.__name__} has no Linear {name}; EAGLE-3 needs separate q/k/v projections")
            setattr(self.self_attn, name, nn.Linear(2 * H, old.out_features, bias=old.bias is not None))
        self.mlp = parts.mlp(cfg)
        self.input_layernorm = parts.norm(H, eps=eps)  # on the token embedding
        self.hidden_norm = parts.norm(H, eps=eps)  # on the fused feature / previous hidden
        self.post_attention_layernorm = parts.norm(H, eps=eps)
        self._cache_kw = cache_kwarg(parts.attention.forward)

    def forward(self, embeds, hidden, attention_mask, position_ids, position_embeddings, cache=None):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        attn = self.self_attn(
            hidden_states=x,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{self._cache_kw: cache},
        )[0]
        h = residual + attn
        if torch.is_grad_enabled() and self.training:
            # the MLP's [T, I] intermediates are most of what a training step keeps per token: the
            # backward recomputes them instead (its cost is small beside attention at length)
            return h + checkpoint(self._mlp_block, h, use_reentrant=False)
        return h + self._mlp_block(h)

    def _mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(DecoderHeadBase):
    config: Eagle3Config
    d2t: torch.Tensor  # buffers (register_buffer in __init__)
    t2d: torch.Tensor

    def __init__(self, config: Eagle3Config, target_model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.train_progress = 1.0  # share of the training run done (the trainer sets it; ttt_depth)
        # rows split across the ranks of a group (heads/context_split.py; the trainer sets it for
        # context_parallel > 1): compute_loss then computes this rank's columns and its share of the loss
        self.context_split: ContextSplit | None = None
        self._init_decoder_common(target_model)
        H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        n_feat = len(config.feature_layers)
        norm_cls, eps = self._parts.norm, getattr(self._layer_cfg, "rms_norm_eps", 1e-6)
        # optional norms on fc's input (module docstring): None when off, so the keys are absent
        self.input_norm = norm_cls(n_feat * H, eps=eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(norm_cls(H, eps=eps) for _ in range(n_feat)) if config.fc_norm else None
        self.fc = nn.Linear(n_feat * H, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(self._layer_cfg, self._parts, config.norm_before_residual)
        self.norm = norm_cls(H, eps=eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        # Placeholder mapping (target ids 0..Vd-1); `init_from_target` or a loaded state replaces it.
        d2t, t2d = identity_draft_vocab(V) if Vd == V else draft_vocab_from_ids(torch.arange(Vd), V)
        self.register_buffer("d2t", d2t)  # int64 [Vd]: target_id = draft_id + d2t[draft_id]
        self.register_buffer("t2d", t2d)  # bool [V]

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.d2t

    @property
    def draft_target_ids(self) -> torch.Tensor:
        """[Vd] long: the target id of each draft id."""
        return draft_target_ids(self.d2t)

    def init_from_target(self, model: nn.Module, token_counts: torch.Tensor | None = None, always_include=(), **kwargs) -> None:
        """Choose the draft vocab from `token_counts` [V] (forcing `always_include`, e.g. EOS).

        lm_head and norm keep their fresh init: starting lm_head as the target's rows for the
        draft tokens (and norm as the target's final norm) was measured worse on SmolLM2-135M
        (first-step CE 15.3 vs 7.9 from random, still behind after 15 AdamW steps).
        """
        V, Vd = self.config.vocab_size, self.config.draft_vocab_size
        if Vd < V:
            if token_counts is None:
                raise ValueError(
                    f"EAGLE-3 with a draft vocab of {Vd} < {V} tokens needs token_counts (heads.draft_vocab.count_tokens over the training data)"
                )
            d2t, t2d = build_draft_vocab(token_counts, Vd, always_include)
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    def fuse(self, features) -> torch.Tensor:
        """features: list of [B, T, H] at `feature_layers`, in that order -> [B, T, H]."""
        if len(features) != len(self.config.feature_layers):
            raise ValueError(f"EAGLE-3 fuses {len(self.config.feature_layers)} features {self.config.feature_layers}, got {len(features)}")
        feats = [f.to(self.dtype) for f in features]
        if self.fc_norm is not None:
            feats = [norm(f) for norm, f in zip(self.fc_norm, feats)]
        x = torch.cat(feats, dim=-1)  # [B, T, n*H]
        if self.input_norm is not None:
            x = self.input_norm(x)
        return self.fc(x)

    def _hidden(self, fused, tokens, position_ids, cache, attention_mask) -> torch.Tensor:
        e = self.refs.embed_tokens(tokens, self.dtype)
        fused = fused.to(self.dtype)
        position_ids, mask, pos_emb = self._inputs(e, tokens, position_ids, cache, attention_mask)
        return self.midlayer(e, fused, mask, position_ids, pos_emb, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [.., H] (pre-norm, as returned by step) -> draft-vocab logits [.., V_draft]."""
        return self.lm_head(self.norm(hidden))

    def step(self, fused, tokens, position_ids=None, cache=None, attention_mask=None, last_only=False):
        """fused [B,T,H] (fuse(...) output, or the parent's returned hidden), tokens [B,T] ->
        (hidden [B,T,H] = `feedback` of the layer output, fed back as the children's `fused`; logits [B,T,V_draft],
        map with `draft_to_target` / `to_target_logits`). last_only: logits [B,1,V_draft] of the
        last position only (catching up on accepted tokens needs no others)."""
        h = self._hidden(fused, tokens, position_ids, cache, attention_mask)
        logits = self.logits(h[:, -1:] if last_only else h)
        return self.feedback(h), logits

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads as its `fused` input: h itself, or norm(h) with
        norm_output (EAGLE-3.1's post-norm hidden states)."""
        return self.norm(h) if self.config.norm_output else h

    def ttt_unroll(
        self, fused: torch.Tensor, input_ids: torch.Tensor, steps: int, position_ids: torch.Tensor | None = None, split: ContextSplit | None = None
    ):
        """Yield the layer outputs [B, T, H] (pre-norm) of training-time-test steps 0..steps-1; the
        next step reads `feedback` of each.

        Step i at column t reads token input_ids[t + 1 + i] at position p_t + i (p_t = t, or its
        position in its conversation for packed rows, position_ids [B, T]) and the previous
        step's hidden state at column t (step 0: `fused`), attending as `ttt_attention_mask` says.
        Its logits predict token t + 2 + i. With `split`, input_ids and position_ids are the whole
        (padded) rows and `fused` holds this rank's columns only, as do the outputs.
        """
        B, T = input_ids.shape
        lo, hi = split.bounds(T) if split is not None else (0, T)
        cache = self.new_cache()
        positions = row_positions(position_ids, B, T, fused.device)  # [B, T]
        hidden = fused
        for i in range(steps):
            tokens = shift_left(input_ids, 1 + i)[:, lo:hi]  # x_{t+1+i} at column t
            # the rule of `ttt_attention_mask`, computed chunk by chunk (heads/ttt_attention.py);
            # the window is measured from the step-0 keys' own positions, and the unroll keys
            # count as the query's own position (a chain never spans the window)
            mask = TTTMask(i, positions, packed=position_ids is not None, window=self.config.sliding_window, split=split)
            with ttt_attention_for(self._layer_cfg):
                out = self._hidden(hidden, tokens, positions[:, lo:hi] + i, cache, mask)
            yield out
            hidden = self.feedback(out)

    def _target_distribution(self, batch: FeatureBatch) -> torch.Tensor:
        """[B, T, Vd]: the target's distribution for the token after each position, restricted to
        the draft vocab and renormalised (softmax of the restricted logits): the soft targets."""
        cfg = self.config
        batch.require(set(cfg.feature_layers) | {cfg.final_layer}, cfg.kind)
        return self._target_rows(batch.hidden_states[cfg.final_layer])

    def _target_rows(self, final: torch.Tensor) -> torch.Tensor:
        """The target's distribution [.., Vd] (restricted to the draft vocab, renormalised) for the
        token after each position, from their final normed states `final` [.., H]."""
        with torch.no_grad():
            assert self.refs.lm_head is not None  # bound to a target (bind_target)
            w = self.refs.lm_head.weight.detach()[self.draft_target_ids.to(self.refs.lm_head.weight.device)]
            return torch.softmax(nn.functional.linear(final.to(w.device, w.dtype), w).float(), dim=-1).to(final.device)

    @overload
    def distill_rows(
        self,
        hidden: torch.Tensor,
        final: torch.Tensor,
        keep=None,
        count: int | None = None,
        split: ContextSplit | None = None,
        elements: Literal[False] = False,
    ) -> tuple[torch.Tensor, float, float]: ...

    @overload
    def distill_rows(
        self,
        hidden: torch.Tensor,
        final: torch.Tensor,
        keep=None,
        count: int | None = None,
        split: ContextSplit | None = None,
        *,
        elements: Literal[True],
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], float, float]: ...

    def distill_rows(
        self,
        hidden: torch.Tensor,
        final: torch.Tensor,
        keep=None,
        count: int | None = None,
        split: ContextSplit | None = None,
        elements: bool = False,
    ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], float, float]:
        """One unroll step's loss over N positions: draft hidden states [N, H] against the target's
        distribution from `final` [N, H] (`_target_rows`), the mean of `config.loss` over the
        positions `keep(entropies [N]) -> bool [N]` keeps (None: all), with (alpha, top-1 agreement)
        over all N. Chunk by chunk (heads/losses.py loss_chunk_rows) under checkpointing when N
        positions' [N, Vd] tensors are more than the backward should keep (heads/losses.py
        recompute_loss): what it keeps is then O(N H). count: the mean's denominator when these N
        positions are one rank's share of a split row (default N); split: that row's split, over
        whose positions the curriculum's cut and LK^lambda's weight are taken. elements: return the
        unweighted loss of each position [N] and its D-PACE confidence [N] (the draft's probability
        of the target's top token) instead of the mean: `loss: dpace` weighs them over the steps."""
        cfg = self.config
        n = hidden.shape[0]
        rows = loss_chunk_rows(cfg.draft_vocab_size)
        chunks = [(a, min(n, a + rows)) for a in range(0, n, rows)]
        weights = torch.full((n,), 1.0 / max(n if count is None else count, 1), device=hidden.device)
        if keep is not None:
            with torch.no_grad():
                entropy = torch.cat([entropy_of(self._target_rows(final[a:b])) for a, b in chunks]) if n else hidden.new_zeros(0)
                if split is None:
                    kept = keep(entropy)
                    weights = kept.float() / kept.sum().clamp_min(1)
                else:  # the cut over the whole row's positions, this rank's share of them kept
                    every = split.gather_ragged(entropy)
                    kept = keep(torch.cat(every))[sum(e.numel() for e in every[: split.rank]) :][:n]
                    weights = kept.float() / split.all_sum(kept.sum()).clamp_min(1)
        lam = None
        if cfg.loss == "lk_lambda" and (len(chunks) > 1 or split is not None):  # its weight is over all positions
            with torch.no_grad():
                alpha = (
                    torch.cat(
                        [acceptance_rate(self._target_rows(final[a:b]), torch.softmax(self.logits(hidden[a:b]).float(), -1)) for a, b in chunks]
                    )
                    if n
                    else hidden.new_zeros(0)
                )
                if split is None:
                    lam = lk_lambda(alpha, cfg.lk_eta)
                else:  # the group's mean acceptance
                    total_alpha, total_n = split.all_sum(torch.stack([alpha.double().sum(), alpha.new_tensor(n, dtype=torch.float64)]))
                    lam = lk_lambda_of_mean(float(total_alpha) / float(total_n), cfg.lk_eta) if total_n else 1.0

        def part(h, f, w):
            logits = self.logits(h).float()  # [c, Vd]
            p = self._target_rows(f)
            each, alpha = distill_loss(logits, p, cfg.loss, cfg.lk_eta, lam=lam)
            if elements:
                return each, alpha, (logits.argmax(-1) == p.argmax(-1)).float(), label_confidence(logits, p)
            return (each * w).sum(), alpha, (logits.argmax(-1) == p.argmax(-1)).float()

        checkpointed = torch.is_grad_enabled() and recompute_loss(n, cfg.draft_vocab_size)
        if not n:  # a rank whose share of a split row has no labels here: it took part in the collectives above
            return hidden.sum() * 0.0, 0.0, 0.0
        total: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = hidden.new_zeros((), dtype=torch.float32)
        alphas, agrees, parts = [], [], []
        for a, b in chunks:
            args = (hidden[a:b], final[a:b], weights[a:b])
            out = checkpoint(part, *args, use_reentrant=False) if checkpointed else part(*args)
            parts.append(out)
            alphas.append(out[1])
            agrees.append(out[2])
            if not elements:
                total = total + out[0]
        if elements:
            total = (torch.cat([o[0] for o in parts]), torch.cat([o[3] for o in parts]))
        return total, torch.cat(alphas).mean().item(), torch.cat(agrees).mean().item()

    def compute_loss(self, batch: FeatureBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Training-time test loss sum_i ttt_decay**i * L_i (module docstring), L_i the mean of
        `config.loss` (soft CE by default; heads/losses.py) over step i's positions.

        metrics: loss_i and acc_i per unroll step (top-1 draft token == argmax of the target
        distribution restricted to the draft vocab, on loss-masked positions), alpha_i (the mean
        acceptance rate sum_x min(p, q) against that distribution), num_labels.

        With `context_split` set, this rank computes its columns only and returns its share of the
        loss (the group's shares add up to the loss); the metrics are the whole rows'.
        """
        cfg = self.config
        split = self.context_split
        batch.require(set(cfg.feature_layers) | {cfg.final_layer}, cfg.kind)
        ids, loss_mask, attention_mask, position_ids = batch.input_ids, batch.loss_mask, batch.attention_mask, batch.position_ids
        final = batch.hidden_states[cfg.final_layer]  # [B, T, H]: the target's distributions come from it, rows at a time
        features = [batch.hidden_states[i] for i in cfg.feature_layers]
        lo, hi = 0, ids.shape[1]
        final_lo = 0  # the column final[:, 0] holds
        if batch.split_columns and split is None:
            raise ValueError("the batch holds one rank's columns of split rows, but this head has no context_split")
        if split is not None:
            padded = split.shard(ids.shape[1]) * split.size
            ids, loss_mask, attention_mask = (pad_columns(x, padded) for x in (ids, loss_mask, attention_mask))
            final = final if batch.split_columns else pad_columns(final, padded)
            if position_ids is not None:
                position_ids = pad_positions(position_ids, padded)
            lo, hi = split.bounds(ids.shape[1])
            if batch.split_columns:  # the target ran split too: local features, final from column lo on
                final_lo = lo
            else:
                features = [pad_columns(f, padded)[:, lo:hi] for f in features]
        fused = self.fuse(features)  # [B, T, H] (this rank's columns when split)
        total = fused.new_zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        steps = ttt_depth(cfg.ttt_steps, cfg.ttt_ramp, self.train_progress) if self.training else cfg.ttt_steps
        keep = None
        if self.training and cfg.entropy_ramp > 0:
            keep = lambda entropy: entropy_curriculum(entropy, cfg.entropy_ramp, self.train_progress, cfg.entropy_start)  # noqa: E731
        dpace = cfg.loss == "dpace"
        if dpace and (split is not None or keep is not None):
            raise ValueError(
                "loss dpace weighs each position's chain of unroll steps on one rank, over every labelled "
                "position: it does not combine with context_parallel > 1 or an entropy_ramp"
            )
        chains = []  # with loss dpace, per step: (cells, loss [N], confidence [N]); position t's chain is its steps
        for i, hidden in enumerate(self.ttt_unroll(fused, ids, steps, position_ids, split)):
            _, valid = shifted_labels(ids, loss_mask, attention_mask, 2 + i, position_ids)
            b_idx, t_idx = valid[:, lo:hi].nonzero(as_tuple=True)
            n = b_idx.numel()
            count = n if split is None else int(split.all_sum(torch.tensor(n, device=ids.device)))
            if dpace and count:
                (each, conf), alpha, acc = self.distill_rows(hidden[b_idx, t_idx], final[b_idx, t_idx + 1 + i], elements=True)
                chains.append((b_idx * ids.shape[1] + t_idx, each, conf))
                step_loss = each.detach().mean()
            elif count:  # the target's distribution for token t + 2 + i is read at t + 1 + i; every rank of a split row calls
                step_loss, alpha, acc = self.distill_rows(hidden[b_idx, t_idx], final[b_idx, lo - final_lo + t_idx + 1 + i], keep, count, split)
            else:
                step_loss, alpha, acc = hidden.sum() * 0.0, 0.0, 0.0
            if not dpace:
                total = total + cfg.ttt_decay**i * step_loss
            figures = torch.tensor([float(step_loss.detach()), alpha * n, acc * n], device=ids.device)
            if split is not None:  # the whole rows' figures: shares of the loss add, the rest is weighted by n
                figures = split.all_sum(figures)
            metrics[f"loss_{i}"] = float(figures[0])
            metrics[f"acc_{i}"] = float(figures[2]) / max(count, 1)
            if count:
                metrics[f"alpha_{i}"] = float(figures[1]) / count
            if i == 0:
                metrics["num_labels"] = float(count)
        if dpace:
            total = dpace_chain_loss(chains, ids.numel(), cfg.dpace_alpha) if chains else fused.sum() * 0.0
            metrics["loss"] = total.item()
        else:
            metrics["loss"] = sum(cfg.ttt_decay**i * metrics[f"loss_{i}"] for i in range(steps))
        return total, metrics
