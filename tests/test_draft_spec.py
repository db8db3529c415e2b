"""DraftSpec (drafthead/draft_spec.py): the one home of how a round drafts. The CLI's options map
to one spec, every rule on the settings is checked there once (the CLI and Python meet the same
check and the same words), a head folder's drafting.json is read into the same fields, and each
drafter gets its own typed settings under the spec's names."""

import json
from types import SimpleNamespace

import pytest

from drafthead import cli
from drafthead.cli import build_parser
from drafthead.draft_spec import DraftSpec
from drafthead.inference.drafters.settings import HeadDrafting, StaticTreeSettings, TreeSettings
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


# every rule on the drafting settings: (CLI options, the same as DraftSpec fields, the refusal both get)
RULES = [
    (["--num-draft", "0"], {"num_draft": 0}, "num_draft (--num-draft) must be a whole number >= 1, got 0"),
    (["--tree-depth", "0"], {"depth": 0}, "depth (--tree-depth) must be a whole number >= 1, got 0"),
    (["--tree-branch", "0"], {"branch": 0}, "branch (--tree-branch) must be a whole number >= 1, got 0"),
    (["--chain", "0"], {"chain": 0}, "chain (--chain) must be a whole number >= 1, got 0"),
    (["--lookup-nodes", "-1"], {"lookup_nodes": -1}, "lookup_nodes (--lookup-nodes) must be a whole number >= 0 (0: off), got -1"),
    (["--lookup-streak", "-2"], {"lookup_streak": -2}, "lookup_streak (--lookup-streak) must be a whole number >= 0 (0: off), got -2"),
    (
        ["--proposer", "prompt-lookup", "--sizing", "confidence"],
        {"proposer": "prompt-lookup", "sizing": "confidence"},
        "sizing 'confidence' sizes EAGLE trees and DSpark blocks, not prompt-lookup drafts",
    ),
    (["--proposer", "none", "--num-draft", "3"], {"proposer": "none", "num_draft": 3}, "--proposer none decodes plainly"),
    (["--proposer", "draft-model"], {"proposer": "draft-model"}, "--proposer draft-model needs --draft-model NAME"),
    (
        ["--proposer", "prompt-lookup", "--head", "h"],
        {"proposer": "prompt-lookup", "head": "h"},
        "--head drafts for --proposer head, not prompt-lookup: drop one of them",
    ),
    (["--head", "h", "--draft-model", "m"], {"head": "h", "draft_model": "m"}, "--head and --draft-model name two drafters"),
    (["--head", "h", "--chain", "3", "--num-draft", "4"], {"head": "h", "chain": 3, "num_draft": 4}, "--chain K drafts K nodes a round"),
    (["--head", "h", "--chain", "3", "--sizing", "confidence"], {"head": "h", "chain": 3, "sizing": "confidence"}, "--chain K is a fixed chain"),
    (
        ["--proposer", "prompt-lookup", "--tree-depth", "3"],
        {"proposer": "prompt-lookup", "depth": 3},
        "depth (--tree-depth) is a head drafter's setting, not prompt-lookup's",
    ),
]


@pytest.mark.parametrize("argv, fields, message", RULES, ids=[m.split(" must")[0][:40] for _, _, m in RULES])
def test_every_rule_is_checked_once_for_the_cli_and_python_alike(capsys, argv, fields, message):
    """Each rule lives in DraftSpec alone: the CLI (one line, exit 2, before any target loads:
    `nothing` is no target) and a Python caller meet the same check with the same words."""
    with pytest.raises(ValueError) as refused:
        DraftSpec(**fields)
    assert message in str(refused.value)
    code = cli.main(["generate", "--target", "nothing", "--prompt", "hi", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("drafthead: error: ") and message in err[0], err


def test_the_spec_takes_only_its_own_names():
    with pytest.raises(ValueError, match="unknown proposer 'heads'"):
        DraftSpec(proposer="heads", head="h")
    with pytest.raises(ValueError, match="unknown sizing 'auto'"):
        DraftSpec(sizing="auto")
    with pytest.raises(ValueError, match="unknown backend 'onnx'"):
        DraftSpec(backend="onnx")
    with pytest.raises(ValueError, match="choices must be a list of paths"):
        DraftSpec(choices=[[0], [-1]])
    assert DraftSpec(choices=[[0], [0, 1]]).choices == ((0,), (0, 1))  # JSON's lists, held as tuples


def head_folder(tmp_path, kind: str, drafting: dict | None = None):
    from drafthead.heads.registry import build_head, make_config

    target = tiny_causal_lm("llama", layers=2)
    folder = build_head(make_config(kind, target, None, name="tiny"), target).save_pretrained(tmp_path / kind)
    if drafting is not None:
        (folder / "drafting.json").write_text(json.dumps(drafting))
    return target, folder, SimpleNamespace(name="tiny", model=target, tokenizer=None)


@pytest.mark.parametrize(
    "kind, fields, message",
    [
        ("medusa1", {"sizing": "confidence"}, "sizing 'confidence' sizes EAGLE trees and DSpark blocks; medusa1 heads take a number of nodes"),
        ("medusa1", {"depth": 3}, "depth (--tree-depth) does not shape a medusa1 head's tree: it drafts a static tree (choices)"),
        ("eagle1", {"choices": [[0]]}, "choices does not shape a eagle1 head's tree: it drafts an EAGLE tree"),
    ],
)
def test_a_setting_the_heads_kind_cannot_take_is_refused_through_the_cli_and_python(tmp_path, capsys, tiny_llama_dir, kind, fields, message):
    """The rules that need the head's kind (heads/config.py KINDS) are DraftSpec's too, checked
    once the folder is read."""
    target, folder, loaded = head_folder(tmp_path, kind)
    with pytest.raises(ValueError, match="does not shape|sizes EAGLE") as refused:
        DraftSpec(head=str(folder), **fields).build(loaded, note=lambda line: None)
    assert message in str(refused.value)
    if "choices" not in fields:  # the CLI has no option for a static tree's choices (drafting.json and Python do)
        argv = [f"--{'sizing' if 'sizing' in fields else 'tree-depth'}", str(next(iter(fields.values())))]
        code = cli.main(["generate", "--target", str(tiny_llama_dir), "--head", str(folder), "--prompt", "hi", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and message in err[-1], err


def test_drafting_json_fills_what_the_caller_leaves_unset_under_the_same_names(tmp_path):
    """drafting.json holds DraftSpec's field names, read once by build: the caller's settings win,
    and the head drafter's own settings carry the same names (nothing is renamed on the way)."""
    target, folder, loaded = head_folder(tmp_path, "eagle1", {"num_draft": 7, "depth": 2, "branch": 3, "lookup_nodes": 2, "sizing": "fixed"})
    drafting = DraftSpec(head=str(folder), num_draft=5).build(loaded, note=lambda line: None)
    assert (drafting.spec.num_draft, drafting.spec.depth, drafting.spec.branch, drafting.spec.lookup_nodes) == (5, 2, 3, 2)
    assert drafting.head_drafting == HeadDrafting(TreeSettings(num_draft=5, depth=2, branch=3), lookup_nodes=2)
    eagle = drafting.factory().drafters[0]
    assert (eagle.num_draft, eagle.depth, eagle.branch) == (5, 2, 3)
    _, medusa, loaded = head_folder(tmp_path, "medusa1", {"choices": [[0], [1], [0, 0]]})
    drafting = DraftSpec(head=str(medusa), lookup_nodes=0).build(loaded, note=lambda line: None)
    assert drafting.head_drafting == HeadDrafting(StaticTreeSettings(choices=((0,), (1,), (0, 0))))
    assert drafting.factory().num_draft == 3


def test_a_head_drafting_survives_the_adapting_workers_json():
    """serve --adapt hands the served head's drafting to its worker through JSON (train/adapt/worker.py)."""
    for drafting in (
        HeadDrafting(TreeSettings(num_draft=5, depth=2, branch=3), lookup_nodes=2, lookup_streak=8),
        HeadDrafting(StaticTreeSettings(choices=((0,), (0, 0)))),
        HeadDrafting(),
    ):
        assert HeadDrafting.from_dict(json.loads(json.dumps(drafting.to_dict()))) == drafting


def test_build_gives_the_factory_model_and_verifier_and_the_engine_sizes():
    """Prompt lookup on a tiny target: fixed sizing times nothing; `--sizing policy` has the engine
    time the target's forward at build (inference/engine/sizing.py), and the spec keeps the rule
    for GenerationConfig; the torch backend verifies with the model itself."""
    from drafthead.inference.engine import sizing

    target = tiny_causal_lm("llama", layers=1)
    loaded = SimpleNamespace(name="tiny-no-head", model=target, tokenizer=None)
    lines = []
    fixed = DraftSpec(num_draft=6).build(loaded, note=lines.append)
    assert (fixed.spec.proposer, fixed.sizing) == ("prompt-lookup", "fixed") and not lines
    assert fixed.model is target and fixed.verifier is target
    assert fixed.factory() is not fixed.factory() and fixed.factory().num_draft == 6  # fresh state per prompt
    policy = DraftSpec(proposer="prompt-lookup", sizing="policy").build(loaded, note=lines.append)
    assert policy.sizing == "policy" and any("timing the target's forward" in line for line in lines)
    built = sizing.load_policy(target, policy.factory(), False)
    assert built is sizing.load_policy(target, policy.factory(), False)  # built once, kept for the verifier


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
    tree, in each drafter's own terms (inference/drafters/settings.py `chain`)."""
    _, folder, loaded = head_folder(tmp_path, kind, {"num_draft": 9})
    drafter = DraftSpec(head=str(folder), chain=3, lookup_nodes=0).build(loaded, note=lambda line: None).factory()
    shape = drafter.describe()
    assert shape["num_draft"] == 3 and shape.get("depth", 3) == 3 and shape.get("branch", 1) == 1  # 3 deep, one wide
