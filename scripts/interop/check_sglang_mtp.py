#!/usr/bin/env python
"""Load an `mtp` export (a target's own MTP layer; heads/formats/mtp.py) with SGLang's OWN MTP
class, on the CPU: DeepseekV3ForCausalLMNextN, Glm4MoeForCausalLMNextN or Qwen3NextForCausalLMMTP.

Run with the SGLang venv (scripts/interop/setup_sglang.sh):

    .venv-interop/sglang/bin/python scripts/interop/check_sglang_mtp.py --target TARGET --head EXPORT --out PREFIX

SGLang's draft ModelConfig is built from the export folder as its draft worker builds it
(`is_draft_model`: SGLang renames the architecture to its MTP class), the class is taken from
its model registry and built, and each export tensor goes through its `load_weights` on its own,
all parameters set to NaN before: the parameters a tensor wrote into are where it landed (NaN,
not zero: a norm weight stored as zeros would look untouched). PREFIX.json:
class, per export tensor the parameters it landed in and whether its values sit there intact,
missing (parameters no tensor reached), dropped (tensors that reached none).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_sglang as base  # noqa: E402  (installs SGLang's CPU import stubs)
from check_vllm import holds_slice  # noqa: E402  (stdlib imports only at its top)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--head", required=True, help="the `mtp` export folder")
    p.add_argument("--out", required=True, help="output prefix (PREFIX.json)")
    args = p.parse_args()
    res: dict = {"consumer": "sglang", "head": args.head, "target": args.target, "loaded": False}
    try:
        from safetensors.torch import load_file
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.models.registry import ModelRegistry

        sa = base.init_sglang(args.target, args.head, algorithm="NEXTN")
        dmc = ModelConfig.from_server_args(sa, model_path=args.head, is_draft_model=True)
        cls, arch = ModelRegistry.resolve_model_cls(dmc.hf_config.architectures)
        res["draft_class"] = cls.__name__
        with set_default_torch_dtype(dmc.dtype):
            model = cls(dmc.hf_config).eval()
        params = dict(model.named_parameters())
        tensors = load_file(str(Path(args.head) / "model.safetensors"))
        per_tensor = {}
        for name, t in tensors.items():
            with torch.no_grad():
                for q in params.values():
                    q.fill_(float("nan"))
            try:
                model.load_weights([(name, t)])
            except Exception as e:  # a name SGLang does not know
                per_tensor[name] = {"params": [], "refused": f"{type(e).__name__}: {str(e)[:200]}"}
                continue
            into = sorted(n for n, q in params.items() if bool((~q.detach().isnan()).any()))
            per_tensor[name] = {"params": into, "intact": any(holds_slice(params[n].detach(), t) for n in into)}
        # tensors SGLang fuses (DeepSeek's q_a_proj with kv_a_proj_with_mqa) are held until their
        # partner arrives: the ones that landed nowhere alone go in again together
        alone = [n for n, r in per_tensor.items() if not r["params"] and "refused" not in r]
        if len(alone) > 1:
            with torch.no_grad():
                for q in params.values():
                    q.fill_(float("nan"))
            model.load_weights([(n, tensors[n]) for n in alone])
            into = sorted(n for n, q in params.items() if bool((~q.detach().isnan()).any()))
            for n in alone:
                landed = [m for m in into if holds_slice(params[m].detach(), tensors[n])]
                if landed:
                    per_tensor[n] = {"params": landed, "intact": True, "with": [m for m in alone if m != n]}
        reached = {n for r in per_tensor.values() for n in r["params"]}
        res.update(
            loaded=True,
            per_tensor=per_tensor,
            missing=sorted(set(params) - reached),
            dropped=sorted(n for n, r in per_tensor.items() if not r["params"]),
            not_intact=sorted(n for n, r in per_tensor.items() if r["params"] and not r["intact"]),
        )
    except Exception as e:
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    Path(f"{args.out}.json").write_text(json.dumps(res, indent=1))
    summary = {k: res.get(k) for k in ("draft_class", "loaded", "missing", "dropped", "not_intact", "error")}
    summary["tensors"] = len(res.get("per_tensor") or {})
    print(json.dumps(summary))
    return 0 if res["loaded"] else 1


if __name__ == "__main__":
    sys.exit(main())
