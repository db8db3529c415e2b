"""The head shipped for the default target: it loads, matches SmolLM2-135M's fingerprint, drafts
trees whose verified output is the target's own greedy output, and a damaged copy is refused."""

import json
import shutil

import pytest
import torch

from drafthead.proposers import default_head_path
from drafthead.ground.target.identity import HeadTargetMismatch, identify_target
from drafthead.heads.io import HeadFormatError
from drafthead.draft_spec import DraftSpec
from drafthead.inference.drafters.load import load_head_drafter
from drafthead.inference.engine.generate import GenerationConfig, speculative_generate
from drafthead.inference.bench.prompts import encode_chat, load_prompts
from drafthead.ground.target.identity import eos_token_ids
from drafthead.ground.target.load import load_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m", dtype="float32")


@pytest.fixture(scope="module")
def shipped():
    path = default_head_path("smollm2-135m")
    assert path is not None, "no head ships in heads/pretrained/smollm2-135m"
    return path


def test_shipped_head_is_small_bf16_and_for_the_default_target(shipped, smollm2):
    size = sum(f.stat().st_size for f in shipped.iterdir())
    assert size <= 24 * 2**20
    config = json.loads((shipped / "config.json").read_text())
    recorded = config["config"]["target"]
    actual = identify_target(smollm2.model, smollm2.tokenizer, "smollm2-135m")
    assert recorded["tokenizer_sha"] == actual.tokenizer_sha
    assert recorded["vocab_size"] == actual.vocab_size == 49152
    drafter, _ = load_head_drafter(shipped, smollm2.model, smollm2.tokenizer, target_name="smollm2-135m")
    assert all(p.dtype == torch.float32 for p in drafter.head.parameters())  # cast to the target's dtype


def test_shipped_head_greedy_output_is_the_target_output(shipped, smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    eos = eos_token_ids(model, tok)
    drafting = DraftSpec(head=str(shipped)).build(smollm2, note=lambda line: None)  # as shipped: its drafting.json
    drafter, target = drafting.factory(), drafting.model
    taus = []
    for prompt in load_prompts("mt-bench")[5::40]:  # two prompts of different categories
        ids = encode_chat(tok, prompt)
        ref = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0])
        result = speculative_generate(target, drafter, ids, GenerationConfig(max_new_tokens=48, eos_token_ids=eos))
        assert result.new_tokens[0].tolist() == ref[0, ids.shape[1] :].tolist()
        taus.append(result.tau)
    assert sum(taus) / len(taus) > 1.5  # a trained head, not noise


def test_truncated_copy_is_refused(shipped, smollm2, tmp_path):
    copy = tmp_path / "head"
    shutil.copytree(shipped, copy)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(HeadFormatError):
        load_head_drafter(copy, smollm2.model, smollm2.tokenizer)


def test_flipped_config_field_is_refused(shipped, smollm2, tmp_path):
    copy = tmp_path / "head"
    shutil.copytree(shipped, copy)
    config = json.loads((copy / "config.json").read_text())
    config["config"]["target"]["vocab_size"] = 32000
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises((HeadTargetMismatch, HeadFormatError)):
        load_head_drafter(copy, smollm2.model, smollm2.tokenizer)
