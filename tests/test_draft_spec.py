"""DraftSpec (drafthead/draft_spec.py): the one home of how a round drafts. The CLI's options map
to one spec, bad settings fail before any model loads, and each proposer gets its options from
one translation."""

from types import SimpleNamespace

import pytest

from drafthead.cli import build_parser
from drafthead.draft_spec import DraftSpec
from tests.tiny import tiny_causal_lm


def spec_of(*argv: str) -> DraftSpec:
    return DraftSpec.from_args(build_parser()[0].parse_args(["generate", "--prompt", "hi", *argv]))


def test_the_cli_spellings_map_to_one_spec():
    assert spec_of() == DraftSpec()
    assert spec_of("--sizing", "policy") == DraftSpec(sizing="policy")
    assert spec_of("--num-draft", "12", "--sizing", "confidence") == DraftSpec(num_draft=12, sizing="confidence")
    assert spec_of("--head", "h", "--tree-depth", "3", "--tree-branch", "2", "--lookup-nodes", "4", "--lookup-streak", "0") == DraftSpec(
        head="h", depth=3, branch=2, lookup_nodes=4, lookup_streak=0
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--num-draft", "auto"), "argument --num-draft: expected a whole number, got 'auto'"),
        (("--num-draft", "confidence"), "argument --num-draft: expected a whole number, got 'confidence'"),
        (("--proposer", "heads"), "argument --proposer: invalid choice: 'heads'"),
    ],
)
def test_a_value_that_is_no_setting_gets_the_parser_error(argv, message, capsys):
    """Sizing has its own option and the proposer is `head`: `--num-draft auto|confidence` and
    `--proposer heads` are values like any unknown one, refused by argparse with exit 2."""
    with pytest.raises(SystemExit) as stopped:
        spec_of(*argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_spec_takes_only_its_own_names():
    with pytest.raises(ValueError, match="unknown proposer 'heads'"):
        DraftSpec(proposer="heads", head="h")
    with pytest.raises(ValueError, match="unknown sizing 'auto'"):
        DraftSpec(sizing="auto")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lookup_nodes": -1}, "--lookup-nodes must be a whole number >= 0"),
        ({"lookup_streak": -2}, "--lookup-streak must be"),
        ({"num_draft": 0}, "--num-draft must be a whole number >= 1"),
        ({"depth": 0}, "--depth must be"),
        ({"sizing": "sometimes"}, "unknown sizing"),
        ({"proposer": "oracle"}, "unknown proposer"),
        ({"backend": "onnx"}, "unknown backend"),
        ({"proposer": "prompt-lookup", "sizing": "confidence"}, "not prompt-lookup drafts"),
        ({"proposer": "draft-model"}, "needs --draft-model"),
        ({"proposer": "prompt-lookup", "depth": 3}, "--depth is a head drafter's setting"),
    ],
)
def test_settings_no_drafter_can_take_fail_at_once(fields, message):
    with pytest.raises(ValueError, match=message):
        DraftSpec(**fields)


def test_each_proposer_gets_its_options_from_one_translation():
    assert DraftSpec(proposer="prompt-lookup", num_draft=7, lookup_streak=0).drafter_options() == {"num_draft": 7, "streak_draft": 0}
    heads = DraftSpec(proposer="head", head="h", num_draft=9, depth=3, branch=2, lookup_nodes=0)
    assert heads.drafter_options() == {"num_draft": 9, "depth": 3, "top_k": 2, "lookup_nodes": 0}
    # unset fields stay out, so drafting.json keeps them; the load policy is the engine's, and the
    # drafter drafts its fixed tree under it
    assert DraftSpec(proposer="head", head="h").drafter_options() == {}
    assert DraftSpec(proposer="head", head="h", sizing="policy").drafter_options() == {"sizing": "fixed"}
    assert DraftSpec(proposer="head", head="h", sizing="confidence").drafter_options() == {"sizing": "confidence"}
    assert DraftSpec(proposer="draft-model", draft_model="m", num_draft=3).drafter_options() == {"num_draft": 3}
    with pytest.raises(ValueError, match="resolve"):
        DraftSpec().drafter_options()


def test_build_gives_the_factory_model_verifier_and_policy():
    """Prompt lookup on a tiny target: fixed sizing has no policy; `--sizing policy` times the
    target's forward and gives a load policy; the torch backend verifies with the model itself."""
    target = tiny_causal_lm("llama", layers=1)
    loaded = SimpleNamespace(name="tiny-no-head", model=target, tokenizer=None)
    lines = []
    fixed = DraftSpec(num_draft=6).build(loaded, note=lines.append)
    assert fixed.spec.proposer == "prompt-lookup" and fixed.policy is None
    assert fixed.model is target and fixed.verifier is target
    assert fixed.factory() is not fixed.factory() and fixed.factory().num_draft == 6  # fresh state per prompt
    policy = DraftSpec(proposer="prompt-lookup", sizing="policy").build(loaded, note=lines.append)
    assert policy.policy is not None and any("timing the target's forward" in line for line in lines)


def test_data_regenerate_spells_sizing_as_the_other_commands(capsys):
    """`data regenerate --sizing policy|fixed`; `--num-draft` is no option of it."""
    parser = build_parser()[0]
    common = ["data", "regenerate", "--out", "x.jsonl", "--speculative"]
    assert parser.parse_args([*common, "--sizing", "fixed"]).sizing == "fixed"
    assert parser.parse_args(common).sizing is None  # the load policy (commands/data.py _regenerate_locally)
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args([*common, "--num-draft", "whole"])
    assert stopped.value.code == 2 and "unrecognized arguments: --num-draft whole" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["eagle3", "medusa1"])
def test_a_chain_replaces_the_heads_tree_in_its_drafters_terms(tmp_path, kind):
    """`--chain K` (what vLLM and SGLang serve): K top-1 drafts a round, whatever drafting.json's
    tree, written in each drafter family's own terms by the drafter layer's one chain translation."""
    import json

    from drafthead.heads.registry import build_head, make_config

    target = tiny_causal_lm("llama", layers=2)
    folder = build_head(make_config(kind, target, None, name="tiny"), target).save_pretrained(tmp_path / kind)
    (folder / "drafting.json").write_text(json.dumps({"num_draft": 9}))
    loaded = SimpleNamespace(name="tiny", model=target, tokenizer=None)
    drafter = DraftSpec(head=str(folder), chain=3, lookup_nodes=0).build(loaded, note=lambda line: None).factory()
    shape = drafter.describe()
    assert shape["num_draft"] == 3 and shape.get("depth", 3) == 3 and shape.get("top_k", 1) == 1  # 3 deep, one wide
    with pytest.raises(ValueError, match="takes no --num-draft"):
        DraftSpec(head=str(folder), chain=3, num_draft=4)
    with pytest.raises(ValueError, match="fixed chain"):
        DraftSpec(head=str(folder), chain=3, sizing="confidence")
