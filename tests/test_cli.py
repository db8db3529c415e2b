"""The CLI: happy paths on a tiny target, and expected errors as one line with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from drafthead import cli
from drafthead.draft_spec import DraftSpec
from drafthead.commands.generate import TextPrinter
from drafthead.inference.bench.report import written_by_bench


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, fragment):
    assert code == 2
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("drafthead: error: "), err
    assert fragment in lines[-1], lines[-1]
    assert "Traceback" not in err


def test_commands_are_registered():
    parser, modules = cli.build_parser()
    assert set(cli.COMMANDS) <= set(modules)
    assert {"generate", "bench", "demo"} <= set(cli.COMMANDS)


def test_unknown_target(capsys):
    code, out, err = run_cli(capsys, "generate", "--target", "no-such-model", "--prompt", "hi")
    assert_one_line_error(code, err, "unknown target 'no-such-model'")


def test_limit_zero(capsys, tiny_llama_dir):
    code, out, err = run_cli(capsys, "bench", "--target", str(tiny_llama_dir), "--limit", "0")
    assert_one_line_error(code, err, "limit must be a positive number")


def test_empty_prompt_file(capsys, tiny_llama_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, out, err = run_cli(capsys, "bench", "--target", str(tiny_llama_dir), "--dataset", str(empty))
    assert_one_line_error(code, err, "no prompts")


def test_malformed_prompt_file_names_the_line(capsys, tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    code, out, err = run_cli(capsys, "bench", "--target", str(tiny_llama_dir), "--dataset", str(bad))
    assert_one_line_error(code, err, "bad.jsonl:2:")


def test_prompt_longer_than_the_context(capsys, tiny_target_dir):
    short = tiny_target_dir("llama", max_position_embeddings=16)
    long_prompt = " ".join(["hello world"] * 20)
    code, out, err = run_cli(capsys, "generate", "--target", str(short), "--prompt", long_prompt, "--threads", "1")
    assert_one_line_error(code, err, "context of 16")
    prompts = short.parent / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": long_prompt}) + "\n")
    code, out, err = run_cli(capsys, "bench", "--target", str(short), "--dataset", str(prompts), "--no-progress")
    assert_one_line_error(code, err, "context of 16")


def test_other_expected_errors(capsys, tiny_llama_dir, tmp_path):
    code, out, err = run_cli(capsys, "generate", "--target", str(tiny_llama_dir), "--prompt", "  ")
    assert_one_line_error(code, err, "prompt is empty")
    code, out, err = run_cli(
        capsys, "generate", "--target", str(tiny_llama_dir), "--prompt", "hi", "--proposer", "head", "--head", str(tmp_path / "none")
    )
    assert_one_line_error(code, err, "no head folder")
    code, out, err = run_cli(capsys, "generate", "--target", str(tiny_llama_dir), "--prompt", "hi", "--temperature", "-1")
    assert_one_line_error(code, err, "temperature")
    code, out, err = run_cli(capsys, "bench", "--target", str(tiny_llama_dir), "--dataset", str(tmp_path / "missing.jsonl"))
    assert_one_line_error(code, err, "no prompt file")
    code, out, err = run_cli(capsys, "bench", "--target", str(tiny_llama_dir), "--limit", "1", "--compare", "llama.cpp", "--temperature", "0.7")
    assert_one_line_error(code, err, "runs greedy decoding only")


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate"])  # --prompt is required
    assert info.value.code == 2
    assert cli.main(["bench", "--num-draft", "0"]) == 2  # a whole number, refused by DraftSpec's rule
    assert "num_draft (--num-draft) must be a whole number >= 1, got 0" in capsys.readouterr().err


@pytest.mark.subprocess
def test_the_parser_builds_without_the_heavy_libraries():
    """Building the parser (`drafthead --help`, and the start of every command) imports no torch,
    transformers or datasets: each command imports them in its run(), and an option whose choices
    a heavy module declares reads them only when asked (DeclaredChoices). A fresh process, since
    this one has imported them already."""
    heavy = ("torch", "transformers", "datasets")
    code = f"import sys, drafthead.cli; drafthead.cli.build_parser(); print([m for m in {heavy!r} if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_choices_a_heavy_module_declares_are_checked_and_listed(capsys):
    """`export --format` and `import --convention` take their choices from heads.formats when
    argparse asks: a parse checks them as any choices, and the option's help lists them."""
    from drafthead.heads.formats import CONVENTIONS, EXPORT_FORMATS

    parser = cli.build_parser()[0]
    assert parser.parse_args(["export", "h", "--out", "o", "--format", "vllm"]).format == "vllm"
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args(["export", "h", "--out", "o", "--format", "onnx"])
    assert stopped.value.code == 2 and "argument --format: invalid choice: 'onnx'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["export", "--help"])
    assert ", ".join(EXPORT_FORMATS) in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        parser.parse_args(["import", "--help"])
    assert ", ".join(CONVENTIONS) in " ".join(capsys.readouterr().out.split())


def test_console_script_prints_one_line(tiny_llama_dir):
    script = Path(sys.executable).with_name("drafthead")  # installed by `pip install -e .`
    proc = subprocess.run(
        [str(script), "bench", "--target", "no-such-model", "--limit", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("drafthead: error: unknown target 'no-such-model': use a built-in name (")


def test_generate_streams_and_reports(capsys, tiny_llama_dir):
    code, out, err = run_cli(
        capsys,
        "generate",
        "--target",
        str(tiny_llama_dir),
        "--prompt",
        "hello world, hello there",
        "--max-new-tokens",
        "24",
        "--threads",
        "1",
    )
    assert code == 0
    assert "no trained head ships" in err and "prompt lookup" in err
    assert "tau " in err and "tokens/s" in err
    assert out.endswith("\n") and len(out.strip()) > 0


def test_bench_writes_report_markdown_and_plot(capsys, tiny_llama_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "category": c}) + "\n" for t, c in [("hello world", "a"), ("one two three", "b")]))
    out_json, md, png = tmp_path / "r" / "report.json", tmp_path / "r.md", tmp_path / "r.png"
    code, out, err = run_cli(
        capsys,
        "bench",
        "--target",
        str(tiny_llama_dir),
        "--dataset",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--out",
        str(out_json),
        "--markdown",
        str(md),
        "--plot",
        str(png),
        "--compare",
        "hf-prompt-lookup",
        "--no-progress",
        "--threads",
        "1",
        "--profile",
    )
    assert code == 0, err
    report = json.loads(out_json.read_text())
    assert report["num_prompts"] == 2 and report["identical_fraction"] == 1.0
    assert report["settings"]["proposer"] == "prompt-lookup" and report["settings"]["dataset"] == str(prompts)
    assert report["settings"]["drafter"]["kind"] == "prompt-lookup" and report["settings"]["drafter"]["lookup_streak"] == 32
    assert "hf_prompt_lookup_tokens_per_s" in report
    assert md.read_text().splitlines()[1].startswith("| method |")  # after the line that marks it as bench's
    assert png.stat().st_size > 1000
    assert all(written_by_bench(p) for p in (out_json, md, png))  # so --overwrite may replace them (ground/outdir.py)
    assert "plain generate()" in out and "engine time" in out


def test_bench_batch_size_with_the_load_policy(capsys, tiny_llama_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("hello world", "one two three", "a b a b a")))
    out_json = tmp_path / "batch.json"
    code, out, err = run_cli(
        capsys,
        "bench",
        "--target",
        str(tiny_llama_dir),
        "--dataset",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--batch-size",
        "2",
        "--sizing",
        "policy",
        "--out",
        str(out_json),
        "--no-progress",
        "--threads",
        "1",
    )
    assert code == 0, err
    report = json.loads(out_json.read_text())
    assert report["batch_size"] == 2 and report["num_prompts"] == 3
    assert report["methods"]["policy"]["identical_fraction"] == 1.0  # fp32 greedy rows = their batch-1 outputs
    assert "timing the target's forward" in err and "ours, policy" in out


def test_text_printer_holds_back_partial_characters():
    class ByteTokenizer:  # one token per UTF-8 byte
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    import io

    stream = io.StringIO()
    printer = TextPrinter(ByteTokenizer(), stream)
    data = list("héllo 東京".encode())
    for b in data:
        printer([b])
        assert "\ufffd" not in stream.getvalue()
    printer.finish()
    assert stream.getvalue() == "héllo 東京\n"


def test_default_proposer_is_prompt_lookup_without_a_shipped_head():
    spec, message = DraftSpec().resolve("no-head-target")
    assert (spec.proposer, spec.head) == ("prompt-lookup", None) and "no trained head ships" in message
    assert DraftSpec(draft_model="x").resolve("t")[0].proposer == "draft-model"
    assert DraftSpec(head="h").resolve("t")[0].proposer == "head"
    with pytest.raises(ValueError, match="no head ships for t: pass --head"):
        DraftSpec(proposer="head").resolve("t")
    with pytest.raises(ValueError, match="confidence' needs an EAGLE or DSpark head"):
        DraftSpec(sizing="confidence").resolve("t")


# -- the drafter factory behind --proposer -----------------------------------------------------


def test_draft_model_proposer_end_to_end(capsys, tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    """A tiny Qwen2 drafting for a tiny Llama with the same tokenizer: fp32 greedy stays identical."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world, hello there"}) + "\n")
    out_json = tmp_path / "report.json"
    code, out, err = run_cli(
        capsys,
        "bench",
        "--target",
        str(tiny_llama_dir),
        "--dataset",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--draft-model",
        str(tiny_qwen2_dir),
        "--num-draft",
        "3",
        "--out",
        str(out_json),
        "--no-progress",
        "--threads",
        "1",
    )
    assert code == 0, err
    assert f"draft model {tiny_qwen2_dir}" in err
    report = json.loads(out_json.read_text())
    assert report["settings"]["proposer"] == "draft-model"
    assert report["identical_fraction"] == 1.0
    assert max(report["prompts"][0]["drafted"]) == 3


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from drafthead.draft_spec import build_drafter
    from drafthead.proposers import DrafterError, check_same_vocabulary
    from drafthead.ground.target.load import load_target
    from tests.tiny import tiny_causal_lm

    target = load_target(tiny_llama_dir)
    # a different vocabulary size
    small = tiny_causal_lm("llama", vocab=300)
    with pytest.raises(DrafterError, match=r"vocabulary \(300\) differs"):
        build_drafter("draft-model", target.model, target.tokenizer, draft_model=small)
    # the same size, two token ids swapped: the ids mean other things
    spec = json.loads(target.tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    a, b = (k for k, v in vocab.items() if v in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    assert len(swapped) == len(target.tokenizer)
    same_size = tiny_causal_lm("llama", vocab=len(swapped))
    with pytest.raises(DrafterError, match="map 2 tokens differently"):
        check_same_vocabulary(target.model, target.tokenizer, same_size, swapped)
    # the same tokenizer passes
    check_same_vocabulary(target.model, target.tokenizer, same_size, target.tokenizer)


def test_unknown_proposer_and_missing_arguments(tiny_llama_dir):
    from drafthead.draft_spec import build_drafter
    from drafthead.proposers import default_head_path

    with pytest.raises(ValueError, match="unknown proposer"):
        build_drafter("medusa-magic", None, None)
    with pytest.raises(ValueError, match="needs --draft-model"):
        build_drafter("draft-model", None, None)
    with pytest.raises(ValueError, match="needs a trained head folder"):
        build_drafter("head", None, None)
    assert default_head_path("no-such-target") is None
    lookup = build_drafter("prompt-lookup", None, None, num_draft=5)
    assert (lookup.length, lookup.num_draft, lookup.lookup_streak) == (5, 5, 32)  # --num-draft: the trie's draft nodes
    lookup = build_drafter("prompt-lookup", None, None, num_draft=40)
    assert (lookup.length, lookup.num_draft) == (10, 40)  # continuations stay 10 long; the trie holds 40 nodes
    assert build_drafter("prompt-lookup", None, None).num_draft == 20


@pytest.mark.parametrize("kind", ["medusa1", "eagle1"])
def test_heads_proposer_end_to_end(capsys, tiny_llama_dir, tmp_path, kind):
    """An (untrained) head folder through --head: loads with identity checks, stays exact."""
    from drafthead.heads.registry import build_head, make_config
    from drafthead.ground.target.load import load_target

    target = load_target(tiny_llama_dir)
    head = build_head(make_config(kind, target.model, target.tokenizer, name=target.name), target.model)
    head.save_pretrained(tmp_path / "head")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello world, hello there"}) + "\n")
    out_json = tmp_path / "report.json"
    code, out, err = run_cli(
        capsys,
        "bench",
        "--target",
        str(tiny_llama_dir),
        "--dataset",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--head",
        str(tmp_path / "head"),
        "--num-draft",
        "5",
        "--out",
        str(out_json),
        "--no-progress",
        "--threads",
        "1",
    )
    assert code == 0, err
    report = json.loads(out_json.read_text())
    assert report["settings"]["proposer"] == "head" and report["identical_fraction"] == 1.0
    assert max(report["prompts"][0]["drafted"]) <= 5  # --num-draft sets the head's num_draft
    described = report["settings"]["drafter"]  # the effective drafter settings are recorded
    assert described["kind"].startswith(kind) and described["num_draft"] == 5


def test_a_head_that_adapts_the_target_is_refused_on_the_llama_cpp_backend():
    """The backend's GGUF holds the target without Medusa-2's merged LoRA: decoding the adapted
    target's drafts against it would not be the adapted target's output, so it is refused."""
    from argparse import Namespace
    from types import SimpleNamespace

    loaded = SimpleNamespace(model=object())
    with pytest.raises(ValueError, match="adapts the target"):
        DraftSpec(backend="llama.cpp")._verifier(loaded, object(), None, print)
    assert DraftSpec()._verifier(loaded, loaded.model, None, print) is loaded.model
    assert Namespace  # the CLI's spelling goes through DraftSpec.from_args (test_draft_spec.py)
