"""llama.cpp's EAGLE-3 draft GGUF, read back (docs/formats.md, "EAGLE-3 research layout").

`convert_hf_to_gguf.py HEAD --target-model-dir TARGET` writes `general.architecture = eagle3` with
`eagle3.target_layers` (vLLM's numbering), `eagle3.norm_before_residual`, `eagle3.norm_before_fc`, the
layer's hyper-parameters, and tensors under llama.cpp names: q/k rows permuted into its interleaved
RoPE order, `d2t` as absolute target ids, no `t2d`. Only unquantized tensors (F32 / F16 / BF16) can
be read back exactly; anything else is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..io import HeadFormatError
from ...ground.files import read_gguf
from .common import ForeignHead, Layout

# GGUF tensor -> our EAGLE-3 key (before the q/k un-permute)
NAMES = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "input_norm.weight",
    "blk.0.attn_norm.weight": "midlayer.input_layernorm.weight",
    "blk.0.attn_norm_2.weight": "midlayer.hidden_norm.weight",
    "blk.0.attn_q.weight": "midlayer.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "midlayer.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "midlayer.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "midlayer.self_attn.o_proj.weight",
    "blk.0.ffn_norm.weight": "midlayer.post_attention_layernorm.weight",
    "blk.0.ffn_gate.weight": "midlayer.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "midlayer.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "midlayer.mlp.down_proj.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def is_layout(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (rotate-half pairs -> interleaved pairs), [out, in]."""
    out, inp = w.shape
    return w.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _tensor(t) -> torch.Tensor:
    kind = t.tensor_type.name
    data = np.array(t.data)
    if kind == "BF16":
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
    if kind in ("F32", "F16", "I64", "I32"):
        return torch.from_numpy(data.copy())
    raise HeadFormatError(f"GGUF tensor {t.name} is {kind}: a quantized tensor cannot be read back exactly")


def read(src: Path) -> ForeignHead:
    reader = read_gguf(src)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.")}
    arch = meta.get("general.architecture")
    if arch != "eagle3":
        raise HeadFormatError(f"{src}: general.architecture is {arch!r}; drafthead reads llama.cpp's eagle3 drafts")

    def field(name, default=None):
        value = meta.get(f"eagle3.{name}", default)
        if value is None:
            raise HeadFormatError(f"{src}: GGUF metadata eagle3.{name} is missing")
        return value

    n_head, n_kv = int(field("attention.head_count")), int(field("attention.head_count_kv"))
    state, unknown = {}, []
    for t in reader.tensors:
        if t.name == "d2t":
            absolute = _tensor(t).long()  # llama.cpp stores target ids; ours are offsets
            state["d2t"] = absolute - torch.arange(absolute.shape[0])
            vocab = int(field("vocab_size"))
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[absolute] = True
            state["t2d"] = t2d
        elif t.name == "token_embd.weight":
            state["embed_tokens.weight"] = _tensor(t)
        elif t.name in NAMES:
            state[NAMES[t.name]] = _tensor(t)
        else:
            unknown.append(t.name)
    if unknown:
        raise HeadFormatError(f"{src}: unexpected GGUF tensor(s) {', '.join(unknown)}")
    for key, n in (("midlayer.self_attn.q_proj.weight", n_head), ("midlayer.self_attn.k_proj.weight", n_kv)):
        if key in state:
            state[key] = unpermute(state[key], n)
    copies = {k: state.pop(k) for k in ("embed_tokens.weight",) if k in state}
    overrides: dict = {
        "aux_layers": tuple(int(i) for i in field("target_layers")),
        "draft_vocab_size": int(state["lm_head.weight"].shape[0]) if "lm_head.weight" in state else int(field("vocab_size")),
        "norm_before_residual": bool(field("norm_before_residual", False)),
        "norm_before_fc": bool(field("norm_before_fc", False)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(field("rope.freq_base"))},
    }
    layer = {
        "hidden_size": int(field("embedding_length")),
        "intermediate_size": int(field("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(field("attention.key_length")),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
    }
    notes = [f"llama.cpp GGUF: target layers {list(overrides['aux_layers'])} (vLLM's numbering), q/k un-permuted, d2t converted from absolute ids"]
    return ForeignHead("llama.cpp-gguf", "eagle3", overrides, state, copies, notes=notes, layer_fields=layer)


LAYOUTS = (Layout("llama.cpp-gguf", lambda src, cfg: is_layout(src), lambda cfg: "eagle3", lambda src, cfg, convention: read(src), on_file=True),)
