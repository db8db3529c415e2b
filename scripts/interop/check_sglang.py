#!/usr/bin/env python
"""Load an EAGLE-3 head that our exporter wrote (SGLang layout) with SGLang's OWN code, on the CPU.

Run with the SGLang venv (scripts/interop/setup_sglang.sh):

    .venv-interop/sglang/bin/python scripts/interop/check_sglang.py \
        --head /tmp/interop/shipped-sglang --target /root/.cache/drafthead/targets/smollm2-135m \
        --out /tmp/interop/sglang_shipped [--inputs tests/fixtures/interop/inputs.safetensors]

SGLang's server needs CUDA; this script drives the pieces of sglang 0.5.23 a server would run,
in one process, on the CPU:

 (a) config + aux ids: ServerArgs(model_path=TARGET, speculative_algorithm=EAGLE3,
     speculative_draft_model_path=HEAD, dtype=float32) is published, the target's ModelConfig is
     built with ModelConfig.from_server_args, and SGLang's own resolver
     (model_runner_components/spec_aux_hidden_state.py:resolve_spec_aux_hidden_state_config)
     reads the draft config and returns the aux-layer ids. These ids go through the
     set_eagle3_layers_to_capture of SGLang's class for the target's architecture (its model
     registry; a real instance, built on the CPU) -> model.layers_to_capture. Captured HF indices
     are then MEASURED: SGLang's target forward (torch_native attention backend) runs on a prompt,
     and each captured aux tensor is matched against transformers' output_hidden_states of the
     same target. Where SGLang's CPU path cannot build, load or run that class, target_error
     names the stage and SGLang's error, and the rest still runs on transformers' hidden states.
 (b) weights: SGLang's draft class LlamaForCausalLMEagle3 is built from the resolved draft
     ModelConfig and fed with sglang.srt.model_loader.weight_utils.safetensors_weights_iterator
     -> load_weights (what DefaultModelLoader does). Every SGLang parameter is compared with the
     export tensor(s) it should hold (q/k/v -> qkv_proj, gate/up -> gate_up_proj); the export
     tensors that landed nowhere are listed (SGLang drops unknown names silently). embed_tokens is
     then installed from the target with SGLang's own set_embed (what eagle_worker_v2.init_lm_head does).
     PREFIX.json's "loader" sums it up per export tensor: mapped, missing, unexpected, skipped.
 (c) forward: the draft runs through SGLang's own LlamaModel.forward with the torch_native
     attention backend (SDPA; no flashinfer/triton needed), an EXTEND ForwardBatch (one request,
     positions 0..T-1, no prefix, causal) and spec_info.hidden_states = the fused features.
     Logits are lm_head(norm(h)) computed as F.linear(normed, lm_head.weight): SGLang's
     LogitsProcessor needs a scheduler batch and is not used.

Comparisons (all float32):
  draft_max_abs_diff  SGLang's draft on HF features at the layers the head was trained on
                      (drafthead.config.aux_layers in the export's config.json, else the captured
                      ones) vs an independent plain-torch EAGLE-3 written here from the exported
                      tensors: tests loader + maths, independent of the id convention.
  e2e_max_abs_diff    SGLang end to end (SGLang target capture -> SGLang draft) vs the same
                      reference on HF features at the trained layers: large when ids are off.
  max_abs_diff        = draft_max_abs_diff (what scripts/interop/run.py tabulates).

Writes PREFIX.json (printed as the last line) and PREFIX.safetensors: input_ids / features3
(HF features at the trained layers, column t = feature of position t beside token t+1),
hidden / logits (SGLang draft on them), e2e_hidden / e2e_logits, captured (SGLang's aux,
concatenated); with --inputs also inputs_hidden / inputs_logits (SGLang draft on that file's
input_ids + features3), so a driver in our venv can compare with our head.
"""

from __future__ import annotations

import argparse
import glob
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path


# ----------------------------------------------------------------------------- import stubs
class _Dummy:
    """Stands in for any attribute of a stubbed module; calling it raises for `vllm`."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Dummy(f"{self._name}.{attr}")

    def __call__(self, *a, **k):
        if self._name.startswith("vllm"):
            raise RuntimeError(f"stubbed {self._name} was called: the CPU path is not the native one")
        return _Dummy(self._name + "()")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = ("torchvision", "vllm")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def _install_import_stubs():
    """torchvision: imported at module level by sglang's multimodal configs (srt/configs/__init__.py
    -> nano_nemotron_vl -> multimodal/internvl_utils); the PyPI wheel cannot load on CPU torch.
    vllm: llama.py's RotaryEmbedding imports `vllm._custom_ops.rotary_embedding` at construction
    when the platform is neither CUDA nor SGLang's CPU engine (which needs a CPU sgl_kernel build);
    the stub raises if it is ever called, so a pass proves the native rotary path ran.
    transformers' torchvision probe is evaluated (and cached False) before the stub goes in."""
    import transformers.utils.import_utils as iu

    iu.is_torchvision_available()
    sys.meta_path.insert(0, _StubFinder())


_install_import_stubs()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


# ----------------------------------------------------------------------------- SGLang runtime
def init_sglang(target: str, head: str, algorithm: str = "EAGLE3"):
    """gloo world of 1 + SGLang's model-parallel groups + published ServerArgs (role 'test');
    algorithm: SGLang's speculative algorithm (NEXTN for a target's own MTP layer)."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, get_server_args, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method="file://" + tempfile.mktemp(prefix="sgl_dist_")
    )
    reset_context()
    # a hybrid target's prefix cache keeps Mamba state snapshots, which SGLang validates as CUDA-only;
    # no request is served here, so the radix cache is off for such targets
    layer_types = set(json.loads((Path(target) / "config.json").read_text()).get("layer_types") or ())
    hybrid = bool(layer_types & {"linear_attention", "mamba", "conv", "hybrid"})
    publish(
        ServerArgs(
            model_path=target,
            speculative_algorithm=algorithm,
            speculative_draft_model_path=head,
            device="cpu",
            dtype="float32",
            tp_size=1,
            pp_size=1,
            ep_size=1,
            disable_cuda_graph=True,
            disable_radix_cache=hybrid,
        ),
        role="test",
        ranks=SpawnRanks(world_rank=0),
    )
    if parallel_state._WORLD is not None:
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    return get_server_args()


class Extend:
    """One request, no prefix, positions 0..T-1: KV pool + torch_native backend + ForwardBatch."""

    def __init__(self, cfg, num_layers: int, T: int, dtype=torch.float32):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.rtp = ReqToTokenPool(size=1, max_context_len=T + 8, device="cpu", enable_memory_saver=False)
        self.kvp = MHATokenToKVPool(
            size=T + 16,
            page_size=1,
            dtype=dtype,
            head_num=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
            layer_num=num_layers,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        self.backend = TorchNativeAttnBackend(types.SimpleNamespace(device="cpu", req_to_token_pool=self.rtp, token_to_kv_pool=self.kvp))
        self.T = T

    def run(self, module, input_ids, spec_hidden=None):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        T = self.T
        locs = torch.arange(1, T + 1, dtype=torch.int64)
        self.rtp.req_to_token[0, :T] = locs.to(self.rtp.req_to_token.dtype)
        i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=input_ids,
            req_pool_indices=i32([0]),
            seq_lens=i32([T]),
            seq_lens_cpu=i32([T]),
            out_cache_loc=locs,
            seq_lens_sum=T,
            positions=torch.arange(T, dtype=torch.int64),
        )
        fb.extend_prefix_lens, fb.extend_prefix_lens_cpu = i32([0]), [0]
        fb.extend_seq_lens, fb.extend_seq_lens_cpu, fb.extend_num_tokens = i32([T]), [T], T
        if spec_hidden is not None:
            fb.spec_info = types.SimpleNamespace(hidden_states=spec_hidden)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.backend)):
            self.backend.init_forward_metadata(fb)
            return module(input_ids, fb.positions, fb)


# ----------------------------------------------------------------------------- reference
def _rms(x, w, eps):
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _rope(x, pos, theta):  # x [T, heads, d], neox (rotate-half) layout
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None], torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_eagle3(sd: dict, cfg, embed: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor):
    """Plain-torch EAGLE-3 step from the export's own tensors (research layout, midlayer.*):
    g = fc(feats); x = cat(input_layernorm(embed[ids]), hidden_norm(g)); h = g + o(attn(x));
    h = h + mlp(post_attention_layernorm(h)); logits = lm_head(norm(h)). Causal, positions 0..T-1."""
    g = lambda n: sd[n].float()  # noqa: E731
    pre = "midlayer." if "midlayer.hidden_norm.weight" in sd else "layers.0."
    eps = cfg.rms_norm_eps
    rp = getattr(cfg, "rope_parameters", None) or {}
    theta = float(rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", cfg.hidden_size // nh)
    T = ids.shape[0]
    fused = feats.float() @ g("fc.weight").T
    x = torch.cat([_rms(embed[ids].float(), g(pre + "input_layernorm.weight"), eps), _rms(fused, g(pre + "hidden_norm.weight"), eps)], -1)
    pos = torch.arange(T)
    q = _rope((x @ g(pre + "self_attn.q_proj.weight").T).view(T, nh, hd), pos, theta)
    k = _rope((x @ g(pre + "self_attn.k_proj.weight").T).view(T, nkv, hd), pos, theta)
    v = (x @ g(pre + "self_attn.v_proj.weight").T).view(T, nkv, hd)
    rep = nh // nkv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    att = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", att, v).reshape(T, nh * hd) @ g(pre + "self_attn.o_proj.weight").T
    h = fused + o
    y = _rms(h, g(pre + "post_attention_layernorm.weight"), eps)
    h = h + (F.silu(y @ g(pre + "mlp.gate_proj.weight").T) * (y @ g(pre + "mlp.up_proj.weight").T)) @ g(pre + "mlp.down_proj.weight").T
    return h, _rms(h, g("norm.weight"), eps) @ g("lm_head.weight").T


# ----------------------------------------------------------------------------- checks
def expected_params(sd: dict) -> dict:
    """SGLang parameter name -> the export tensor it should hold (after SGLang's renames)."""
    out = {}
    names = {k.replace("midlayer.", "layers.0."): k for k in sd}
    for n, src in names.items():
        if n in ("d2t", "t2d"):
            continue
        full = n if n == "lm_head.weight" or n.startswith("model.") else "model." + n
        out.setdefault(full, []).append(src)
    merged = {}
    for full, srcs in out.items():
        for a, parts in ((".qkv_proj.", (".q_proj.", ".k_proj.", ".v_proj.")), (".gate_up_proj.", (".gate_proj.", ".up_proj."))):
            if any(p in full for p in parts):
                for p in parts:
                    full = full.replace(p, a)
        merged.setdefault(full, []).extend(srcs)
    return merged


def param_report(model, sd: dict) -> tuple[list, list]:
    params = dict(model.named_parameters())
    exp = expected_params(sd)
    order = {".q_proj.": 0, ".k_proj.": 1, ".v_proj.": 2, ".gate_proj.": 0, ".up_proj.": 1}
    rows, used = [], set()
    for name, p in params.items():
        srcs = exp.get(name, [])
        row = {
            "param": name,
            "shape": list(p.shape),
            "dtype": str(p.dtype).replace("torch.", ""),
            "from": srcs,
            "landed": False,
            "max_abs_diff": None,
        }
        if srcs:
            srcs = sorted(srcs, key=lambda s: next((v for k, v in order.items() if k in s), 0))
            want = torch.cat([sd[s].float() for s in srcs], 0)
            if tuple(want.shape) == tuple(p.shape):
                d = (p.detach().float() - want).abs().max().item()
                row.update(landed=d == 0.0, max_abs_diff=d)
            else:
                row["note"] = f"shape {list(want.shape)} != param {list(p.shape)}"
            used.update(srcs)
        rows.append(row)
    special = {"d2t", "t2d"}
    dropped = sorted(k for k in sd if k not in used and k not in special)
    return rows, dropped


def match_indices(captured, hf_hidden):
    """For each captured [T, H] tensor: the HF output_hidden_states index it equals (closest)."""
    res = []
    for c in captured:
        diffs = [(c.float() - hs[0].float()).abs().max().item() for hs in hf_hidden]
        j = min(range(len(diffs)), key=diffs.__getitem__)
        res.append({"hf_index": j, "max_abs_diff": diffs[j], "next_best": sorted(diffs)[1] if len(diffs) > 1 else None})
    return res


def prompt_ids(target: str, n_random: int = 12):
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
        ids = tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return torch.tensor(ids, dtype=torch.int64).flatten(), "chat template prompt"
    except Exception as e:  # the fixture target has no tokenizer
        g = torch.Generator().manual_seed(0)
        import json as _j

        V = _j.loads((Path(target) / "config.json").read_text())["vocab_size"]
        return torch.randint(3, V, (n_random,), generator=g), f"seeded random ids ({type(e).__name__})"


def loader_summary(rows: list, dropped: list, sd: dict, hot_token_id: dict | None) -> dict:
    """What SGLang's draft loader did with the export, per export tensor: mapped (its values sit in
    the parameter SGLang names for it; d2t as hot_token_id = d2t + arange), skipped by name (t2d),
    unexpected (SGLang drops unknown names silently); and the draft parameters no tensor filled,
    less the embedding, which SGLang installs from the target (set_embed)."""
    mapped = sorted(src for r in rows if r["landed"] for src in r["from"])
    if "d2t" in sd and hot_token_id and hot_token_id["equals_d2t_plus_arange"]:
        mapped.append("d2t")
    from_target = [r["param"] for r in rows if not r["from"] and r["param"] == "model.embed_tokens.weight"]
    return {
        "mapped": mapped,
        "missing": [r["param"] for r in rows if not r["from"] and r["param"] not in from_target],
        "unexpected": dropped,
        "skipped": [n for n in ("t2d",) if n in sd],
        "from_target": from_target,
        "not_intact": [r["param"] for r in rows if r["from"] and not r["landed"]],
    }


def target_capture(res: dict, tmc, ids_to_capture, ids, hs, target: str):
    """SGLang's own class for the target's architecture (its model registry, as its loader picks
    it): built, told which layers to capture, fed the target's weights by its loader and run on
    `ids` with the torch_native backend; the aux hidden states it captures, each matched with
    transformers' hidden states `hs`. None, with res["target_error"] naming the stage it stopped
    at, when SGLang's CPU path cannot run that class."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.registry import ModelRegistry

    stage = "resolve the class"
    try:
        cls, _ = ModelRegistry.resolve_model_cls(tmc.hf_config.architectures)
        res["target_class"] = cls.__name__
        stage = "build"
        with set_default_torch_dtype(tmc.dtype):
            tgt = cls(tmc.hf_config).eval()
        tgt.set_eagle3_layers_to_capture(ids_to_capture)
        res["layers_to_capture"] = list(tgt.model.layers_to_capture)  # input of layer i = hs[i]
        stage = "load weights"
        tgt.load_weights(safetensors_weights_iterator(sorted(glob.glob(os.path.join(target, "*.safetensors")))))
        stage = "forward"
        out = Extend(tmc.hf_config, tmc.hf_config.num_hidden_layers, ids.numel()).run(tgt.model, ids)
        captured = [c.float() for c in out[1]]
    except Exception as e:  # the JSON says where SGLang's CPU path stopped
        res["target_error"] = {"stage": stage, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        return None
    res["capture_match"] = match_indices(captured, hs)
    res["captured_hidden_state_indices"] = [x["hf_index"] for x in res["capture_match"]]
    return captured


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", required=True, help="SGLang-layout EAGLE-3 folder (config.json + *.safetensors)")
    ap.add_argument("--target", required=True, help="HF target folder")
    ap.add_argument("--inputs", default=None, help="optional inputs.safetensors (input_ids, features3)")
    ap.add_argument("--reference", default=None, help="optional reference.safetensors (hidden, logits) on --inputs")
    ap.add_argument("--out", required=True, help="output prefix: PREFIX.json, PREFIX.safetensors")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    res = {"consumer": "sglang", "head": args.head, "target": args.target, "loaded": False, "notes": []}
    out_t = {}
    try:
        import importlib.metadata as md

        res["versions"] = {p: md.version(p) for p in ("sglang", "torch", "transformers")}
        sa = init_sglang(args.target, args.head)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import resolve_spec_aux_hidden_state_config
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
        from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        # (a) config + ids the way the target's model runner resolves them
        tmc = ModelConfig.from_server_args(sa)
        aux = resolve_spec_aux_hidden_state_config(
            server_args=sa, model_config=tmc, spec_algorithm=SpeculativeAlgorithm.EAGLE3, is_draft_worker=False
        )
        dmc = aux.draft_model_config
        dcfg = dmc.hf_config
        L = tmc.hf_config.num_hidden_layers
        res["draft_config_as_read"] = {
            "architectures": dcfg.architectures,
            "model_dtype": str(dmc.dtype),
            "eagle_config": getattr(dcfg, "eagle_config", None),
            "top_level_eagle_aux_hidden_state_layer_ids": getattr(dcfg, "eagle_aux_hidden_state_layer_ids", None),
            "draft_vocab_size": getattr(dcfg, "draft_vocab_size", "MISSING"),
            "target_hidden_size": getattr(dcfg, "target_hidden_size", None),
            "num_aux_hidden_states": getattr(dcfg, "num_aux_hidden_states", None),
            "rope_parameters": getattr(dcfg, "rope_parameters", None),
            "tie_word_embeddings": dcfg.tie_word_embeddings,
            "norm_before_fc": getattr(dcfg, "norm_before_fc", None),
            "fc_norm": getattr(dcfg, "fc_norm", None),
            "norm_output": getattr(dcfg, "norm_output", None),
            "norm_before_residual (not read by SGLang)": getattr(dcfg, "norm_before_residual", None),
        }
        res["eagle_use_aux_hidden_state"] = aux.eagle_use_aux_hidden_state
        res["eagle_aux_hidden_state_layer_ids"] = aux.eagle_aux_hidden_state_layer_ids
        res["target_num_layers"] = L

        # (b) draft weights through SGLang's loader
        with set_default_torch_dtype(dmc.dtype):
            draft = LlamaForCausalLMEagle3(dcfg).eval()
        # SGLang's loader reads every *.safetensors in the folder; a fixture's reference.safetensors is ours,
        # not part of the checkpoint, so it is left out (its names would be dropped silently anyway)
        files = sorted(f for f in glob.glob(os.path.join(args.head, "*.safetensors")) if os.path.basename(f) != "reference.safetensors")
        draft.load_weights(safetensors_weights_iterator(files))
        sd = {}
        for f in files:
            sd.update(load_file(f))
        rows, dropped = param_report(draft, sd)
        res["params"] = rows
        res["export_tensors_dropped_by_sglang"] = dropped
        ht = draft.hot_token_id
        res["hot_token_id"] = (
            None
            if ht is None
            else {
                "len": int(ht.numel()),
                "equals_d2t_plus_arange": bool(torch.equal(ht, sd["d2t"] + torch.arange(ht.numel()))),
                "min": int(ht.min()),
                "max": int(ht.max()),
                "unique": bool(ht.unique().numel() == ht.numel()),
            }
        )
        if "t2d" in sd and ht is not None:
            t2d = sd["t2d"].bool()
            res["hot_token_id"]["t2d_consistent"] = bool(t2d.sum().item() == ht.numel() and t2d[ht].all().item())
        tw = load_file(sorted(glob.glob(os.path.join(args.target, "*.safetensors")))[0])
        embed = tw["model.embed_tokens.weight"].float()
        draft.set_embed(torch.nn.Parameter(embed.clone(), requires_grad=False))  # eagle_worker_v2.init_lm_head
        rows_by = {r["param"]: r for r in rows}
        if "model.embed_tokens.weight" in rows_by and not rows_by["model.embed_tokens.weight"]["from"]:
            rows_by["model.embed_tokens.weight"]["note"] = "not in export; installed from the target by set_embed"
        weights_ok = all(r["landed"] for r in rows if r["from"]) and not dropped
        res["loaded"] = True
        res["weights_all_landed"] = weights_ok
        res["loader"] = loader_summary(rows, dropped, sd, res["hot_token_id"])

        # HF hidden states of the target (the features our head reads), and SGLang's target's capture
        ids, src = prompt_ids(args.target)
        res["prompt"] = {"source": src, "num_tokens": int(ids.numel())}
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        with torch.no_grad():
            hs = hf(ids[None], output_hidden_states=True).hidden_states
        captured = target_capture(res, tmc, aux.eagle_aux_hidden_state_layer_ids, ids, hs, args.target)
        n_aux = draft.model.num_aux_hidden_states
        if captured is not None and len(captured) != n_aux:
            res["notes"].append(
                f"SGLang's target captured {len(captured)} aux tensors for layers_to_capture "
                f"{res['layers_to_capture']} (its layers are 0..{L - 1}; an index >= {L} is never "
                f"reached), the draft's fc wants {n_aux}: SGLang would fail at runtime"
            )
        dh = (json.loads((Path(args.head) / "config.json").read_text()).get("drafthead") or {}).get("config", {})
        trained = list(dh.get("aux_layers") or res.get("layers_to_capture") or [])
        res["trained_hidden_state_indices"] = trained
        res["trained_indices_source"] = (
            "drafthead.config.aux_layers" if dh.get("aux_layers") else "layers_to_capture (no drafthead block: what SGLang's code asks for)"
        )
        res["ids_match_training"] = None if captured is None else res["captured_hidden_state_indices"] == trained

        # (c) SGLang's draft forward vs the plain-torch reference
        T = ids.numel() - 1
        tok = ids[1:].contiguous()
        if len(trained) == n_aux and max(trained) < len(hs):
            feats = torch.cat([hs[i][0, :T] for i in trained], -1)
            h_norm, aux_out = Extend(dcfg, dcfg.num_hidden_layers, T).run(draft.model, tok, feats)
            logits = F.linear(h_norm, draft.lm_head.weight)
            ref_h, ref_logits = reference_eagle3(sd, dcfg, embed, tok, feats)
            res["draft_max_abs_diff"] = {"hidden": (aux_out[0] - ref_h).abs().max().item(), "logits": (logits - ref_logits).abs().max().item()}
            res["max_abs_diff"] = res["draft_max_abs_diff"]["logits"]
            out_t.update(input_ids=tok[None], features3=feats[None], hidden=aux_out[0][None], logits=logits[None])
            if captured is not None and len(captured) == n_aux:
                e_norm, e_aux = Extend(dcfg, dcfg.num_hidden_layers, T).run(draft.model, tok, torch.cat(captured, -1)[:T])
                e_logits = F.linear(e_norm, draft.lm_head.weight)
                res["e2e_max_abs_diff"] = {"hidden": (e_aux[0] - ref_h).abs().max().item(), "logits": (e_logits - ref_logits).abs().max().item()}
                res["e2e_argmax_agreement"] = (e_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
                out_t.update(e2e_hidden=e_aux[0][None], e2e_logits=e_logits[None], captured=torch.cat(captured, -1)[None])
        res["forward"] = (
            "SGLang LlamaModel.forward (llama_eagle3.py) ran on CPU with the torch_native "
            "attention backend, EXTEND batch; rotary/RMSNorm/SiluAndMul on their native torch paths"
        )
        if args.inputs:
            inp = load_file(args.inputs)
            ii, f3 = inp["input_ids"][0], inp["features3"][0]
            n, a = Extend(dcfg, dcfg.num_hidden_layers, ii.numel()).run(draft.model, ii, f3)
            out_t.update(inputs_hidden=a[0][None], inputs_logits=F.linear(n, draft.lm_head.weight)[None])
            rh, rl = reference_eagle3(sd, dcfg, embed, ii, f3)
            res["inputs_max_abs_diff_vs_reference"] = {
                "hidden": (a[0] - rh).abs().max().item(),
                "logits": (F.linear(n, draft.lm_head.weight) - rl).abs().max().item(),
            }
            if args.reference:  # e.g. an upstream fixture's reference.safetensors
                ref = load_file(args.reference)
                res["inputs_max_abs_diff_vs_given_reference"] = {
                    k: (v[0].float() - ref[k][0].float()).abs().max().item()
                    for k, v in (("hidden", a[0][None]), ("logits", F.linear(n, draft.lm_head.weight)[None]))
                    if k in ref
                }
        bad = [r["param"] for r in rows if r["from"] and not r["landed"]]
        e2e = res.get("e2e_max_abs_diff", {}).get("logits")
        capture = (
            f"layers_to_capture {res['layers_to_capture']} -> HF hidden_states {res['captured_hidden_state_indices']}"
            if captured is not None
            else f"SGLang's target did not run ({res['target_error']['stage']}: {res['target_error']['error'][:200]})"
        )
        res["note"] = (
            f"ids {aux.eagle_aux_hidden_state_layer_ids} -> {capture}; weights "
            f"{'all landed' if weights_ok else 'NOT all landed: ' + str(bad + dropped)}; "
            f"e2e logits diff {'n/a' if e2e is None else format(e2e, '.3g')}" + ("; " + "; ".join(res["notes"]) if res["notes"] else "")
        )
    except Exception as e:
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    res["seconds"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if out_t:
        save_file(
            {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in out_t.items()}, args.out + ".safetensors"
        )
    Path(args.out + ".json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
