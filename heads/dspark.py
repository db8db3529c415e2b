"""DSpark (arXiv 2607.05147): DFlash's block drafter made semi-autoregressive by two small heads.

The backbone is DFlash's (heads/dflash.py): the committed text's fused target features as cached
keys/values, one non-causal block [x_n (the pending token), MASK, ..., MASK] at positions
n .. n + S - 1 as queries. Every slot drafts, the pending token's included: slot k's final normed
state h_k gives the base logits U_k = lm_head(h_k) for token n + k + 1, so a block drafts S tokens.

    Markov head       logits_k = U_k + W2 W1[x_{n+k}]           W1 [V, r] (an embedding), W2 [V, r]
    confidence head   c_k = sigmoid(proj(cat(h_k, W1[x_{n+k}])))   proj: (H + r) -> 1, with a bias

x_{n+k} is the token before slot k's: the pending token for slot 0, then the token drafted at
slot k - 1 (the data token in training, teacher forced). So the drafts are sequential, one
[r] x [r, V] product a token after one backbone forward, and a tree node's distribution is that of
its own parent (inference/drafters/parallel.py DSparkDrafter). c_k estimates the chance slot k is
accepted once the slots before it were; the product along a path sizes the verify.

Training (`compute_loss`): DFlash's random anchors, each block scored at every slot against the
data token (CE), the target's distribution p (L1 = ||q - p||_1, q the Markov-corrected draft) and
the acceptance rate 1 - L1 / 2 (BCE of the confidence logit, the label detached):

    loss = ce_weight * CE + l1_weight * L1 + confidence_weight * BCE

each term weighted exp(-k / loss_decay_gamma) at slot k and normalised by the weights' sum, or
with `loss: dpace` weighted by D-PACE (heads/losses.py) per block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .batch import FeatureBatch
from .config import DSparkConfig
from .dflash import KV, DFlashHead, position_metrics

INIT_STD = 0.02  # the reference trainer's (Hugging Face's normal init): the bias starts near zero


class MarkovHead(nn.Module):
    """The rank-r bias from the previous token: markov_w1 [V, r], markov_w2 [V, r] (the engines' names)."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        for w in (self.markov_w1.weight, self.markov_w2.weight):
            nn.init.normal_(w, std=INIT_STD)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [...] token ids -> [..., r]."""
        return self.markov_w1(prev)

    def bias(self, embedded: torch.Tensor) -> torch.Tensor:
        """[..., r] -> [..., V]: the logit bias."""
        return self.markov_w2(embedded)


class ConfidenceHead(nn.Module):
    """proj: (H [+ r]) -> 1 with a bias, one logit per slot."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)
        nn.init.normal_(self.proj.weight, std=INIT_STD)
        nn.init.zeros_(self.proj.bias)


class DSparkHead(DFlashHead):
    config: DSparkConfig

    def __init__(self, config: DSparkConfig, target_model: nn.Module) -> None:
        super().__init__(config, target_model)
        V, H, r = config.vocab_size, config.hidden_size, config.markov_rank
        self.markov_head = MarkovHead(V, r)
        self.confidence_head = ConfidenceHead(H + (r if config.confidence_with_markov else 0)) if config.confidence_head else None

    # -- the two heads ---------------------------------------------------------------------------

    def corrected_logits(self, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """base logits [..., V] of slots whose previous tokens are prev [...] -> [..., V]."""
        return base + self.markov_head.bias(self.markov_head.embed(prev)).to(base.dtype)

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Final normed states h [..., H] of slots whose previous tokens are prev [...] -> [...]."""
        if self.confidence_head is None:
            raise ValueError("this dspark head has no confidence head (confidence_head: false)")
        x = torch.cat([h, self.markov_head.embed(prev).to(h.dtype)], dim=-1) if self.config.confidence_with_markov else h
        return self.confidence_head.proj(x).squeeze(-1)

    # -- drafting --------------------------------------------------------------------------------

    def block_states(self, pending: torch.Tensor, position: int, context: list[KV]):
        """One block after a committed text of `position` tokens (context: their K/V), its first
        token `pending` [B] -> (h [B, S, H] final normed states, base logits [B, S, V]): slot k
        for token position + k + 1, before the Markov bias."""
        tokens = self.block_tokens(pending)  # [B, S]
        positions = (torch.arange(self.block_size, device=tokens.device) + position)[None].expand_as(tokens)
        h = self.block_hidden(tokens, positions, context)
        return h, self.refs.lm_logits(h)

    def draft_chain(self, pending: torch.Tensor, position: int, context: list[KV]) -> torch.Tensor:
        """The greedy block: [B, S] tokens, slot k's argmax after the bias of slot k - 1's pick."""
        _, base = self.block_states(pending, position, context)
        prev, out = pending, []
        for k in range(self.block_size):
            prev = self.corrected_logits(base[:, k], prev).argmax(-1)
            out.append(prev)
        return torch.stack(out, dim=1)

    # -- training --------------------------------------------------------------------------------

    def block_loss(self, batch: FeatureBatch, anchors: torch.Tensor, ok: torch.Tensor):
        """The loss over blocks at `anchors` [B, A] (those with ok [B, A]) (module docstring).
        Metrics per slot i: loss_i (CE), acc_i (top-1 == the target's), alpha_i (1 - L1 / 2),
        l1_i, and conf_i (the confidence head's mean probability)."""
        cfg, S = self.config, self.block_size
        h, label, valid = self.run_blocks(batch, anchors, ok)  # label [B, A, S]: slot k drafts token anchor + k + 1
        b, a, k = valid.nonzero(as_tuple=True)
        ids = batch.input_ids
        prev = ids[b, label[b, a, k] - 1]  # teacher forcing: the text's token before each label
        target_token = ids[b, label[b, a, k]]
        hk = h[b, a, k]  # [N, H]
        logits = self.corrected_logits(self.refs.lm_logits(hk), prev).float()  # [N, V]
        with torch.no_grad():  # the target's distribution for token label, from the state before it
            hL = batch.hidden_states[cfg.final_layer]
            p = torch.softmax(self.refs.lm_logits(hL[b, label[b, a, k] - 1].float()), dim=-1)
        log_q = torch.log_softmax(logits, dim=-1)
        ce = F.nll_loss(log_q, target_token, reduction="none")  # [N]
        l1 = (log_q.exp() - p).abs().sum(-1)  # [N]
        alpha = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # the acceptance rate sum_x min(p, q)
        w, total = self.position_weights((b, a, k), tuple(label.shape), (-ce).exp().detach())
        per = cfg.ce_weight * ce + cfg.l1_weight * l1
        metrics: dict[str, float] = {}
        conf = torch.zeros_like(ce)
        if cfg.confidence_weight > 0:
            c_logit = self.confidence_logit(hk, prev).float()
            bce = F.binary_cross_entropy_with_logits(c_logit, alpha, reduction="none")
            per = per + cfg.confidence_weight * bce
            conf = torch.sigmoid(c_logit).detach()
        loss = (w * per).sum() / total if per.numel() else logits.sum() * 0.0
        hits = logits.argmax(-1) == p.argmax(-1)
        metrics["loss"] = loss.item()
        for i in range(S):
            metrics.update(position_metrics(i, k == i, ce=ce.detach(), acc=hits.float(), alpha=alpha, l1=l1.detach(), conf=conf))
        return loss, metrics
