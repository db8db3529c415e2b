"""Settings refused at the start, runs that end cleanly (a launch, a signal, a resume) and docs
that say what the code does: each case through the CLI's main in-process, or the CLI as a process
where a launcher or a signal is the point. The table is docs/reliability.md's subsections
"Settings refused at the start", "Runs, launches and signals" and "Docs that match the code".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.cli_checks import assert_failed_late, assert_refused, run_cli
from tests.test_reliability import medusa_head_dir, tiny_train, unchanged

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_progress_bars(monkeypatch):
    """No progress bars on stderr (datasets' ignore TQDM_DISABLE): a refusal is its only line."""
    import datasets

    monkeypatch.setenv("TQDM_DISABLE", "1")
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    yield
    if not was_disabled:
        datasets.enable_progress_bars()


# ---------------------------------------------------------------------------------------------- settings refused at the start


@pytest.mark.parametrize("text", ["", "# a run config\n\n# to fill in\n"])
def test_an_empty_config_is_refused(tmp_path, capsys, monkeypatch, text):
    """A 0-byte or comment-only YAML ran the whole default run (SmolLM2, all of ShareGPT, into
    runs/run). Here the run, were it to start, would stop at once (no such target) in tmp_path."""
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "run.yaml"
    empty.write_text(text)
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, "train", "--config", empty, "target=nothing"), str(empty), "holds no settings", "preset")


def test_a_key_given_twice_is_refused(tmp_path, capsys, monkeypatch):
    """`lr:` twice: yaml keeps the last one silently (a run that started would stop at once)."""
    monkeypatch.chdir(tmp_path)
    twice = tmp_path / "run.yaml"
    twice.write_text("lr: 0.1\nbatch_size: 2\nlr: 0.5\n")
    with unchanged(tmp_path):
        assert_refused(
            *run_cli(capsys, "train", "--config", twice, "target=nothing"), str(twice), "line 3", "the key 'lr' is given twice (first at line 1)"
        )


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("warmup_steps=-5", "warmup_steps must be >= 0 (0: none); got -5"),
        ("epochs=0", "epochs must be a number > 0; got 0.0"),
        ("lr=.nan", "lr must be a number > 0; got nan"),
        ("eval_every=-1", "eval_every must be >= 0"),
        ("min_lr_ratio=2", "min_lr_ratio must be in [0, 1]"),
    ],
)
def test_lengths_and_rates_out_of_range_are_refused(tmp_path, capsys, override, fragment):
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, "train", "--config", "tiny-medusa1", f"output_dir={tmp_path / 'run'}", override), fragment)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--proposer", "prompt-lookup", "--head", "HEAD"], "--head drafts for --proposer head, not prompt-lookup"),
        (["--proposer", "head", "--draft-model", "m"], "--draft-model drafts for --proposer draft-model, not head"),
        (["--head", "HEAD", "--draft-model", "m"], "--head and --draft-model name two drafters"),
    ],
)
def test_a_drafter_the_proposer_would_ignore_is_refused(tmp_path, capsys, argv, fragment):
    """`--proposer prompt-lookup --head H` drafted with prompt lookup, the head unused (DraftSpec's rule)."""
    head = medusa_head_dir(tmp_path / "head")
    argv = [str(head) if a == "HEAD" else a for a in argv]
    with unchanged(tmp_path):  # refused before the target loads: --target names no model
        assert_refused(*run_cli(capsys, "generate", "--target", "nothing", "--prompt", "hi", *argv), fragment)


@pytest.mark.parametrize(
    "config, overrides, fragment",
    [
        ("dspark", ["context_parallel=2"], "context_parallel splits the rows of eagle3, eagle31 heads; dspark heads do not split theirs"),
        ("eagle3", ["context_parallel=2", "head.loss=dpace"], "loss dpace weighs each position's chain of unroll steps on one rank"),
    ],
)
def test_the_plan_refuses_what_training_refuses(tmp_path, capsys, config, overrides, fragment):
    """`train --plan` planned a context-parallel DSpark run that training refused; an EAGLE-3 run
    under loss dpace was refused only at its first step, after writing its config and log."""
    plan = ["--plan", str(REPO / "configs" / "targets" / "llama-3.1-8b.json")]
    run = tmp_path / "run"
    with unchanged(tmp_path):
        planned = assert_refused(*run_cli(capsys, "train", "--config", config, *overrides, *plan), fragment)
        trained = assert_refused(*run_cli(capsys, "train", "--config", config, *overrides, f"output_dir={run}", "target=nothing"), fragment)
    assert planned == trained and not run.exists()
    assert_refused(
        *run_cli(capsys, "train", "--config", "eagle3", "context_parallel=2", *plan, "--ranks", "1,8"),
        "--ranks 1: context_parallel: 2 does not divide the 1 processes",
    )


def test_a_fresh_run_stopped_at_its_first_step_leaves_nothing(tmp_path, capsys, monkeypatch, tiny_llama_dir, isolated_cache):
    """A run refused at its first batch (as a context-parallel run is by rows with images) left
    config.yaml and metrics.jsonl, which made the corrected rerun refuse output_dir."""
    from drafthead.train.data.tiny import write_tiny_jsonl
    from drafthead.train.loop.trainer import Trainer

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 8)
    run = tmp_path / "run"
    argv = tiny_train(tiny_llama_dir, chats, run, "max_steps=2", "checkpoint_every=1")

    def refused_at_the_first_batch(self, *args, **kwargs):
        raise ValueError("context_parallel splits text rows; rows with images are not built for it")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_micro_step", refused_at_the_first_batch)
        assert_failed_late(*run_cli(capsys, *argv), "rows with images are not built for it")
    assert not run.exists()
    assert run_cli(capsys, *argv)[0] == 0  # the corrected rerun is not refused


def test_long_prompts_past_the_targets_context_are_refused(tmp_path, capsys, tiny_llama_dir):
    """`data long-prompts --tokens` at or past the target's context wrote prompts no bench can run."""
    from drafthead.ground.target.load import target_context

    context = target_context(tiny_llama_dir)
    out = tmp_path / "long.jsonl"
    for tokens in (context, 4 * context):
        with unchanged(tmp_path):
            assert_refused(
                *run_cli(capsys, "data", "long-prompts", "--target", tiny_llama_dir, "--tokens", tokens, "--out", out),
                f"--tokens {tokens}",
                f"context holds {context} tokens",
                f"below {context}",
            )
    assert not out.exists()


@pytest.mark.parametrize(
    "config, overrides",
    [
        ("tiny-medusa1", ["head.num_heads=1"]),
        ("tiny-eagle3", ["head.ttt_steps=1"]),
        ("tiny-peagle", ["head.parallel_depth=1"]),
        ("tiny-dflash", ["head.block_size=2"]),
        ("tiny-eagle1", []),
    ],
)
def test_dpace_on_one_position_is_refused(tmp_path, capsys, config, overrides):
    """loss dpace weighs a chain of positions: refused where a head trains one, by its kind
    (eagle1, mtp) or by its settings, which were accepted (heads/config.py KINDS chain_positions).
    Before the target loads (--target names no model)."""
    with unchanged(tmp_path):
        assert_refused(
            *run_cli(capsys, "train", "--config", config, *overrides, "head.loss=dpace", "target=nothing", f"output_dir={tmp_path / 'run'}"),
            "loss dpace weighs a chain of draft positions",
            "trains one",
        )


# ---------------------------------------------------------------------------------------------- runs, launches and signals


@pytest.fixture
def no_libllama(tmp_path, monkeypatch):
    """DRAFTHEAD_LIBLLAMA at an empty folder: the llama.cpp backend as a machine without `make llamacpp` has it."""
    from drafthead.inference.llamacpp import lib

    monkeypatch.setenv("DRAFTHEAD_LIBLLAMA", str(tmp_path / "nolib"))
    lib.load.cache_clear()
    yield
    lib.load.cache_clear()


def test_the_llamacpp_backend_not_built_is_one_line(tmp_path, capsys, no_libllama):
    """LibllamaMissing was a RuntimeError: a traceback. Now one line, before any model loads."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("target: nothing\nhead: {kind: medusa1}\n")
    with unchanged(tmp_path):
        for argv in (
            ["generate", "--backend", "llama.cpp", "--target", "nothing", "--prompt", "hi"],
            ["bench", "--backend", "llama.cpp", "--target", "nothing"],
            ["data", "capture", "--config", cfg, "--backend", "llama.cpp", "--out", tmp_path / "features"],
        ):
            assert_refused(*run_cli(capsys, *argv), "llama.cpp backend not built", "make llamacpp")


@pytest.mark.subprocess
def test_under_a_launcher_rank_0_alone_prints_the_error(tmp_path):
    """`accelerate launch` of 2 processes with a bad config: every rank printed the line, then the
    launcher's ChildFailedError dump said only "To enable traceback see ...". The dump is the
    launcher's own (a failed rank always gets it); every rank's line is in it as its traceback."""
    from tests.launch import accelerate_launch, run_group

    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1\n")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    out = run_group([*accelerate_launch(2), "-m", "drafthead", "train", "--config", str(bad)], timeout=300, env=env, cwd=tmp_path)
    ours = [line for line in out.stderr.splitlines() if line.startswith("drafthead: error: ")]
    assert out.returncode != 0 and len(ours) == 1, out.stderr
    assert str(bad) in ours[0] and "not valid YAML" in ours[0]
    assert f"traceback : {ours[0]}" in out.stderr and "To enable traceback" not in out.stderr, out.stderr


def test_a_warning_is_one_line(tmp_path, capsys, tiny_llama_dir):
    """Python printed a warning as FILE:LINE: UserWarning: ... and the source line. A head trained
    on a target of another name whose every structural field matches loads with a warning."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafthead.heads.registry import build_head, make_config

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    config = make_config("medusa1", target, AutoTokenizer.from_pretrained(tiny_llama_dir), name="trained-elsewhere", num_heads=2)
    head = build_head(config, target).save_pretrained(tmp_path / "head")
    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)  # shown even where this process warned before
        code, err = run_cli(capsys, "generate", "--target", tiny_llama_dir, "--head", head, "--prompt", "hi", "--max-new-tokens", "2")
    warned = [line for line in err.splitlines() if "warning:" in line.lower()]
    assert code == 0 and "Traceback" not in err, err
    assert warned == [
        f"drafthead: warning: head was trained on target 'trained-elsewhere', loading onto '{tiny_llama_dir.name}' "
        "(every structural field and the tokenizer match)"
    ], err


def test_metrics_log_each_step_once_after_a_resume(tmp_path, capsys, monkeypatch, tiny_llama_dir, isolated_cache):
    """A run stopped after logging step 3 and before its checkpoint (every 2 steps): the resume
    from step 2 logs step 3 again, and metrics.jsonl held it twice."""
    from drafthead.train.data.tiny import write_tiny_jsonl
    from drafthead.train.loop.tracking import METRICS_FILE, RunLog

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 12)
    run = tmp_path / "run"
    argv = tiny_train(tiny_llama_dir, chats, run, "max_steps=4", "checkpoint_every=2", "log_every=1")
    real = RunLog.metrics

    def stop_after_step_3(self, step, split, values):
        real(self, step, split, values)
        if step == 3 and split == "train":
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(RunLog, "metrics", stop_after_step_3)
        assert run_cli(capsys, *argv)[0] == 130
    assert run_cli(capsys, *argv, "--resume")[0] == 0
    records = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records if r.get("split") == "train"] == [1, 2, 3, 4]
    assert [r["event"] for r in records if r.get("event") in ("start", "resume")] == ["start", "resume"]


SLOW_TINY_TARGET = """
import sys, time
import drafthead.train.data.tiny as tiny
def slow(*args, **kwargs):
    print("writing", flush=True)
    time.sleep(120)
tiny.write_tiny_jsonl = slow
from drafthead import cli
sys.exit(cli.main(["data", "tiny-target", "--out", sys.argv[1], "--chats", "3"]))
"""


@pytest.mark.subprocess
def test_sigterm_removes_the_lock_and_the_temp_folder(tmp_path):
    """SIGTERM (a scheduler's stop, `kill`) while `data tiny-target` writes: the `.NAME.lock`
    file stayed beside the output, as did the temp folder."""
    out = tmp_path / "tiny"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_TINY_TARGET, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        assert (tmp_path / ".tiny.lock").exists()  # held while the folder is written
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 143 and err.splitlines() == ["drafthead: terminated"], err
    assert list(tmp_path.iterdir()) == []  # no lock, no temp folder, no output


def test_a_truncated_image_is_named(tmp_path, capsys):
    """`generate --image a.png --image b.png` with b.png cut short: "image file is truncated",
    without saying which; refused before the target loads."""
    import numpy as np
    from PIL import Image

    whole, cut = tmp_path / "a.png", tmp_path / "b.png"
    Image.fromarray((np.random.default_rng(1).random((30, 30, 3)) * 255).astype("uint8")).save(whole)
    cut.write_bytes(whole.read_bytes()[:600])
    with unchanged(tmp_path):
        line = assert_refused(
            *run_cli(capsys, "generate", "--target", "nothing", "--image", whole, "--image", cut, "--prompt", "hi"),
            f"{cut} is not a readable image",
            "truncated",
        )
    assert str(whole) not in line


# ---------------------------------------------------------------------------------------------- docs that match the code


def test_the_retried_statuses_are_the_ones_documented(capsys):
    """The docs and --help said 5xx; RETRY_STATUS retries 408, 429, 500, 502, 503, 504 (a 501 is not asked again)."""
    from drafthead.train.regeneration.openai_client import RETRY_STATUS

    *first, last = (str(code) for code in RETRY_STATUS)
    docs = " ".join((REPO / "docs" / "models-and-data.md").read_text().split())
    assert f"HTTP {', '.join(first)} and {last}" in docs
    help_text = help_of(capsys, "data", "regenerate")
    assert "HTTP " + "/".join(map(str, RETRY_STATUS)) in help_text and "5xx" not in help_text


def test_source_help_names_every_source(capsys):
    """`--source` said sharegpt | json | regenerated; train/data/sources.py also reads jsonl and file."""
    from drafthead.train.data.sources import SOURCES

    for action in ("inspect", "regenerate", "long-prompts"):
        help_text = help_of(capsys, "data", action)
        assert all(name in help_text for name in SOURCES), (action, help_text)


def test_a_device_with_a_cpu_backend_is_refused_at_once(tmp_path, capsys):
    """docs: `--backend vllm` refuses --device; the code loaded the target on that device first
    (and, on a CUDA machine with no --device, on CUDA, then refused the --device never given)."""
    from drafthead.commands import backend_device

    assert [backend_device(None, b) for b in ("vllm", "llama.cpp", "torch")] == ["cpu", "cpu", None]
    assert backend_device("cpu", "vllm") == "cpu" and backend_device("cuda:1", "torch") == "cuda:1"
    cfg = tmp_path / "run.yaml"
    cfg.write_text("target: nothing\nhead: {kind: medusa1}\n")
    with unchanged(tmp_path):
        assert_refused(
            *run_cli(capsys, "data", "capture", "--config", cfg, "--backend", "vllm", "--device", "cuda", "--out", tmp_path / "f"),
            "--backend vllm runs on the CPU: drop --device cuda",
        )


def test_long_prompts_never_replaces_a_file(tmp_path, capsys):
    """docs: long-prompts takes no --overwrite and refuses an existing --out, even an empty one
    (the rule of the other commands writes into an empty one)."""
    out = tmp_path / "long.jsonl"
    out.write_text("")
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, "data", "long-prompts", "--tokens", "64", "--out", out), "long-prompts never replaces a file")
    with pytest.raises(SystemExit):
        run_cli(capsys, "data", "long-prompts", "--tokens", "64", "--out", out, "--overwrite")
    assert "unrecognized arguments: --overwrite" in capsys.readouterr().err


def help_of(capsys, *command: str) -> str:
    from drafthead import cli

    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())
