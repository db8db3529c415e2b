#!/usr/bin/env python3
"""Build tests/fixtures/interop/llamacpp-eagle3/: a tiny EAGLE-3 draft for the fixture target,
converted to GGUF by llama.cpp's own converter, plus llama.cpp's own forward on inputs.safetensors.

Run with the llamacpp venv's python after scripts/interop/setup_llamacpp.sh:
    .venv-interop/llamacpp/venv/bin/python scripts/interop/fixtures_llamacpp.py [--probes]

Folder contents:
  config.json, model.safetensors  the source HF folder (vLLM/research layout: fc, midlayer.*, norm,
                                  lm_head, d2t, t2d), seeded random weights, hidden 64, vocab 256,
                                  draft vocab 64, TOP-LEVEL eagle_aux_hidden_state_layer_ids [1, 2, 3]
  draft.gguf                      `convert_hf_to_gguf.py <folder> --target-model-dir <target> --outtype f32`
  reference.safetensors           llama.cpp's eagle3 encoder+decoder graphs run on inputs.safetensors by
                                  scripts/interop/llamacpp_eagle3_ref.cpp (linked against the built
                                  libllama): fused [1,8,64] = fc(features3), hidden [1,8,64] (pre-norm
                                  decoder output), logits [1,8,64] (draft vocab order)
  meta.json

The fixture target has no tokenizer, and the converter always writes the target's vocabulary into
the draft GGUF, so the conversion uses a scratch copy of the target folder with a small
SentencePiece model trained here (char model, padded by the converter to the 256-token vocab).
--probes additionally converts two variants (nested-only aux ids; attention biases) and reports what
the converter and the loader do with them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "interop"
OUT = FIX / "llamacpp-eagle3"
TARGET = FIX / "target"
LLAMACPP = ROOT / ".venv-interop" / "llamacpp"
SRC = LLAMACPP / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
BUILD = LLAMACPP / "build"
REF_BIN = BUILD / "bin" / "llamacpp_eagle3_ref"
AUX_IDS = [1, 2, 3]
H, FF, NH, NKV, HD, V, VD = 64, 128, 4, 2, 16, 256, 64


def head_config(aux_top=True, bias=False) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": FF,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "head_dim": HD,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "rope_theta": 100000.0,
        "vocab_size": V,
        "draft_vocab_size": VD,
        "target_hidden_size": H,
        "attention_bias": bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": "float32",
    }
    if aux_top:
        cfg["eagle_aux_hidden_state_layer_ids"] = AUX_IDS
    else:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True}
    return cfg


def head_tensors(bias=False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)

    def w(*shape, s=0.08):
        return (torch.randn(*shape, generator=g) * s).float()

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).float()

    sd = {
        "fc.weight": w(H, 3 * H),
        "midlayer.input_layernorm.weight": norm(H),
        "midlayer.hidden_norm.weight": norm(H),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.self_attn.q_proj.weight": w(NH * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(NKV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(NKV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, NH * HD),
        "midlayer.mlp.gate_proj.weight": w(FF, H),
        "midlayer.mlp.up_proj.weight": w(FF, H),
        "midlayer.mlp.down_proj.weight": w(H, FF),
        "norm.weight": norm(H),
        "lm_head.weight": w(VD, H, s=0.3),
    }
    # draft vocab: eos (1) plus 63 other target ids, ascending; d2t holds offsets (target = i + d2t[i])
    others = torch.randperm(V - 3, generator=g)[: VD - 1] + 3
    ids = torch.sort(torch.cat([torch.tensor([1]), others])).values
    sd["d2t"] = (ids - torch.arange(VD)).long()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    sd["t2d"] = t2d
    if bias:
        sd["midlayer.self_attn.q_proj.bias"] = w(NH * HD)
        sd["midlayer.self_attn.k_proj.bias"] = w(NKV * HD)
        sd["midlayer.self_attn.v_proj.bias"] = w(NKV * HD)
    return sd


def write_head(folder: Path, cfg: dict, sd: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))


def tokenizer_target(tmp: Path) -> Path:
    """Scratch copy of the fixture target with a SentencePiece tokenizer.model (the converter needs one)."""
    import io

    import sentencepiece as spm

    d = tmp / "target-with-tokenizer"
    d.mkdir()
    for f in TARGET.iterdir():
        (d / f.name).symlink_to(f.resolve())
    text = ["the quick brown fox jumps over the lazy dog 0123456789"] * 8
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=buf,
        model_type="char",
        vocab_size=64,
        hard_vocab_limit=False,
        num_threads=1,
        unk_id=0,
        bos_id=-1,
        eos_id=1,
        pad_id=2,
        minloglevel=2,
    )
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    return d


def convert(src: Path, out: Path, target: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SRC / "convert_hf_to_gguf.py"), str(src), "--outtype", "f32", "--outfile", str(out)]
    if target is not None:
        cmd += ["--target-model-dir", str(target)]
    return subprocess.run(cmd, capture_output=True, text=True)


def build_ref() -> None:
    src = Path(__file__).with_name("llamacpp_eagle3_ref.cpp")
    if REF_BIN.exists() and REF_BIN.stat().st_mtime > src.stat().st_mtime:
        return
    libs = [
        BUILD / "common" / "libllama-common.a",
        BUILD / "common" / "libllama-common-base.a",
        BUILD / "src" / "libllama.a",
        BUILD / "ggml" / "src" / "libggml.a",
        BUILD / "ggml" / "src" / "libggml-cpu.a",
        BUILD / "ggml" / "src" / "libggml-base.a",
    ]
    extra = sorted((BUILD / "vendor").rglob("*.a")) if (BUILD / "vendor").exists() else []
    cmd = [
        "nice",
        "-n",
        "10",
        "g++",
        "-O2",
        "-std=c++17",
        str(src),
        "-o",
        str(REF_BIN),
        f"-I{SRC / 'include'}",
        f"-I{SRC / 'common'}",
        f"-I{SRC / 'src'}",
        f"-I{SRC / 'ggml' / 'include'}",
        *map(str, libs),
        *map(str, extra),
        *map(str, libs),
        "-fopenmp",
        "-lpthread",
        "-ldl",
    ]
    subprocess.run(cmd, check=True)


def run_ref(target_gguf: Path, draft_gguf: Path, feats: np.ndarray, ids: np.ndarray, tmp: Path):
    T = ids.shape[0]
    (tmp / "feats.f32").write_bytes(feats.astype(np.float32).tobytes())
    (tmp / "ids.i32").write_bytes(ids.astype(np.int32).tobytes())
    p = subprocess.run(
        [str(REF_BIN), str(target_gguf), str(draft_gguf), str(tmp / "feats.f32"), str(tmp / "ids.i32"), str(T), str(tmp / "ref")],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        return None, p.stderr
    n_embd, n_vocab, _ = map(int, p.stdout.split())

    def rd(name, n):
        return np.frombuffer((tmp / f"ref.{name}.f32").read_bytes(), dtype=np.float32).reshape(T, n)

    return (rd("g", n_embd), rd("hidden", n_embd), rd("logits", n_vocab)), p.stderr


# --- reading the GGUF back into our layout, and our maths, as a check of what the findings say


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    o, i = w.shape
    return w.reshape(n_head, o // n_head // 2, 2, i).swapaxes(1, 2).reshape(o, i)


def read_gguf_head(path: Path) -> dict[str, torch.Tensor]:
    from gguf import GGUFReader

    t = {x.name: np.array(x.data) for x in GGUFReader(str(path)).tensors}
    sd = {
        "fc.weight": t["fc.weight"],
        "midlayer.input_layernorm.weight": t["blk.0.attn_norm.weight"],
        "midlayer.hidden_norm.weight": t["blk.0.attn_norm_2.weight"],
        "midlayer.post_attention_layernorm.weight": t["blk.0.ffn_norm.weight"],
        "midlayer.self_attn.q_proj.weight": unpermute(t["blk.0.attn_q.weight"], NH),
        "midlayer.self_attn.k_proj.weight": unpermute(t["blk.0.attn_k.weight"], NKV),
        "midlayer.self_attn.v_proj.weight": t["blk.0.attn_v.weight"],
        "midlayer.self_attn.o_proj.weight": t["blk.0.attn_output.weight"],
        "midlayer.mlp.gate_proj.weight": t["blk.0.ffn_gate.weight"],
        "midlayer.mlp.up_proj.weight": t["blk.0.ffn_up.weight"],
        "midlayer.mlp.down_proj.weight": t["blk.0.ffn_down.weight"],
        "norm.weight": t["output_norm.weight"],
        "lm_head.weight": t["output.weight"],
        "d2t": t["d2t"] - np.arange(t["d2t"].shape[0]),  # absolute ids -> our offsets
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}


def our_forward(sd, embed, feats, ids, eps=1e-5, theta=100000.0):
    """EAGLE-3 step as heads/eagle3.py defines it (HF rotate-half RoPE, causal), float64."""
    d = {k: v.double() for k, v in sd.items()}

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    T = ids.shape[0]
    g = feats.double() @ d["fc.weight"].T
    e = embed.double()[ids]
    x = torch.cat([rms(e, d["midlayer.input_layernorm.weight"]), rms(g, d["midlayer.hidden_norm.weight"])], -1)
    q = (x @ d["midlayer.self_attn.q_proj.weight"].T).view(T, NH, HD).transpose(0, 1)
    k = (x @ d["midlayer.self_attn.k_proj.weight"].T).view(T, NKV, HD).transpose(0, 1)
    v = (x @ d["midlayer.self_attn.v_proj.weight"].T).view(T, NKV, HD).transpose(0, 1)
    inv = 1.0 / theta ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rot(t):
        a, b = t[..., : HD // 2], t[..., HD // 2 :]
        return t * cos + torch.cat([-b, a], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(NH // NKV, 0), v.repeat_interleave(NH // NKV, 0)
    att = (q @ k.transpose(-1, -2)) / HD**0.5
    att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    o = (att @ v).transpose(0, 1).reshape(T, NH * HD) @ d["midlayer.self_attn.o_proj.weight"].T
    h = g + o
    m = rms(h, d["midlayer.post_attention_layernorm.weight"])
    m = torch.nn.functional.silu(m @ d["midlayer.mlp.gate_proj.weight"].T) * (m @ d["midlayer.mlp.up_proj.weight"].T)
    h = h + m @ d["midlayer.mlp.down_proj.weight"].T
    logits = rms(h, d["norm.weight"]) @ d["lm_head.weight"].T
    return g, h, logits


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probes", action="store_true")
    a = ap.parse_args()
    import gguf

    inputs = load_file(str(FIX / "inputs.safetensors"))
    feats = inputs["features3"][0].numpy()
    ids = inputs["input_ids"][0].numpy()
    embed = load_file(str(TARGET / "model.safetensors"))["model.embed_tokens.weight"]

    with tempfile.TemporaryDirectory(prefix="fixtures_llamacpp-") as t:
        tmp = Path(t)
        if OUT.exists():
            shutil.rmtree(OUT)
        cfg, sd = head_config(), head_tensors()
        write_head(OUT, cfg, sd)
        tgt_tok = tokenizer_target(tmp)
        p = convert(OUT, tmp / "draft.gguf", tgt_tok)
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            return 1
        shutil.copy(tmp / "draft.gguf", OUT / "draft.gguf")
        conv_log = [ln.split(":", 2)[-1].replace(str(tmp), "<scratch>") for ln in p.stderr.splitlines() if "EAGLE-3" in ln or "-->" in ln]
        p = convert(tgt_tok, tmp / "target.gguf")
        if p.returncode != 0:
            print(p.stderr[-3000:], file=sys.stderr)
            return 1

        build_ref()
        ref, err = run_ref(tmp / "target.gguf", OUT / "draft.gguf", feats, ids, tmp)
        if ref is None:
            print(err[-3000:], file=sys.stderr)
            return 1
        g_ref, h_ref, logits_full = ref
        abs_ids = sd["d2t"].numpy() + np.arange(VD)
        logits_ref = logits_full[:, abs_ids]
        outside = np.delete(logits_full, abs_ids, axis=1)
        save_file(
            {
                "fused": torch.from_numpy(g_ref.copy())[None],
                "hidden": torch.from_numpy(h_ref.copy())[None],
                "logits": torch.from_numpy(logits_ref.copy())[None],
            },
            str(OUT / "reference.safetensors"),
        )

        # check: GGUF read back (unpermuted) + our maths == llama.cpp
        back = read_gguf_head(OUT / "draft.gguf")
        g_o, h_o, l_o = our_forward(back, embed, torch.from_numpy(feats), torch.from_numpy(ids).long())
        same = {k: bool(torch.equal(back[k].to(sd[k].dtype), sd[k])) for k in back}
        diffs = {
            "fused": float(np.abs(g_o.numpy() - g_ref).max()),
            "hidden": float(np.abs(h_o.numpy() - h_ref).max()),
            "logits": float(np.abs(l_o.numpy() - logits_ref).max()),
        }
        print(
            json.dumps(
                {
                    "readback_equal_source": same,
                    "max_abs_diff_ours_vs_llamacpp": diffs,
                    "logits_outside_draft_vocab_all_neg_inf": bool(np.all(np.isneginf(outside))),
                }
            )
        )

        reader = gguf.GGUFReader(str(OUT / "draft.gguf"))
        tensors = {
            x.name: {"type": x.tensor_type.name, "ne": [int(n) for n in x.shape], "numpy_shape": list(np.array(x.data).shape)} for x in reader.tensors
        }
        meta = {
            "package": "llama.cpp (vendored in llama-cpp-python sdist)",
            "version": "llama-cpp-python==0.3.36 (vendored llama.cpp: build 0 / commit unknown, no .git in the sdist); gguf-py 0.19.0",
            "writer": "convert_hf_to_gguf.py <this folder> --target-model-dir <fixture target + scratch tokenizer.model> "
            "--outtype f32 (conversion/llama.py LlamaModel, MODEL_ARCH.EAGLE3)",
            "aux_id_convention": "vllm",
            "eagle_aux_hidden_state_layer_ids": AUX_IDS,
            "gguf_target_layers": list(reader.fields["eagle3.target_layers"].contents()),
            "gguf_tensors": tensors,
            "converter_log": conv_log,
            "check_max_abs_diff_ours_vs_llamacpp": diffs,
            "notes": (
                "config.json + model.safetensors: the source HF folder (vLLM/research key layout), seeded random, "
                "norms 1+0.1*randn, draft vocab 64 (target eos id 1 included). draft.gguf: llama.cpp's converter "
                "output. GGUF tensor map: fc.weight->fc.weight; midlayer.input_layernorm->blk.0.attn_norm; "
                "midlayer.hidden_norm->blk.0.attn_norm_2; post_attention_layernorm->blk.0.ffn_norm; "
                "q_proj->blk.0.attn_q PERMUTED with n_head=4; k_proj->blk.0.attn_k PERMUTED with n_kv_head=2 "
                "(permute: w.reshape(n,2,out//n//2,in).swapaxes(1,2); undo: w.reshape(n,out//n//2,2,in).swapaxes(1,2)); "
                "v/o/gate/up/down -> attn_v/attn_output/ffn_gate/ffn_up/ffn_down unchanged; norm->output_norm; "
                "lm_head->output; d2t -> I64 ABSOLUTE target ids (d2t + arange(64)); t2d dropped; no token_embd "
                "(the target's is used). gguf-py ReaderTensor.shape is GGML ne order (reversed); .data is numpy [out, in]. "
                "reference.safetensors: llama.cpp's own eagle3 graphs (scripts/interop/llamacpp_eagle3_ref.cpp, F32 KV cache, flash attention off, "
                "target fixture converted to GGUF for its tok_embd) on inputs.safetensors: fused = fc(features3), "
                "hidden = decoder pre-norm output with column t = (input_ids[t], fused[t]) at position t, causal; "
                "logits = llama.cpp's full-vocab logits gathered at the draft ids (draft vocab order); all other "
                "target ids are -inf in llama.cpp's output. The tokenizer in draft.gguf is a scratch SentencePiece char "
                "model (the fixture target has none) padded to 256 by the converter; it plays no part in the maths."
            ),
        }
        if a.probes:
            meta["probes"] = probes(tmp, tgt_tok, feats, ids)
            print(json.dumps(meta["probes"]))
        (OUT / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"wrote {OUT} ({size} bytes)")
    return 0


def probes(tmp: Path, tgt_tok: Path, feats, ids) -> dict:
    """What the converter/loader do with a nested-only aux-id config and with attention biases."""
    from gguf import GGUFReader

    res = {}
    d = tmp / "probe-nested"
    write_head(d, head_config(aux_top=False), head_tensors())
    p = convert(d, tmp / "probe-nested.gguf", tgt_tok)
    res["nested_only_ids"] = {
        "convert_rc": p.returncode,
        "gguf_target_layers": (
            list(GGUFReader(str(tmp / "probe-nested.gguf")).fields["eagle3.target_layers"].contents()) if p.returncode == 0 else None
        ),
        "log": [ln.replace(str(tmp), "<scratch>") for ln in p.stderr.splitlines() if "target_layers" in ln],
    }
    d = tmp / "probe-bias"
    write_head(d, head_config(bias=True), head_tensors(bias=True))
    p = convert(d, tmp / "probe-bias.gguf", tgt_tok)
    r = {"convert_rc": p.returncode, "log": [ln for ln in p.stderr.splitlines() if ".bias" in ln or "rror" in ln][-6:]}
    if p.returncode == 0:
        ref, err = run_ref(tmp / "target.gguf", tmp / "probe-bias.gguf", feats, ids, tmp)
        r["load_ok"] = ref is not None
        r["load_error"] = [ln for ln in err.splitlines() if "error" in ln.lower() or "wrong" in ln.lower()][-4:]
    res["attention_bias"] = r
    return res


if __name__ == "__main__":
    sys.exit(main())
