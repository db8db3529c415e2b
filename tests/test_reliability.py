"""Bad inputs and faults a user can cause, through the CLI's main in-process: each gets one line
and exit code 2 (or a refusal to overwrite), and nothing already on disk changes. The table of
cases is docs/reliability.md; each row names its test here.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from drafthead import cli
from drafthead.heads.registry import build_head, make_config
from drafthead.ground.outdir import MARKER_FILE, fresh_folder, mark_output
from drafthead.train.loop.checkpoint import RUN_CONFIG_FILE, latest_checkpoint
from drafthead.train.capture.features import CAPTURE_FILES
from drafthead.train.loop.config import check_resume, resume_changes
from drafthead.train.loop.trainer import Trainer, TrainData
from tests.trainer_checks import DummyHead, config, random_samples
from tests.cli_checks import assert_failed_late, assert_refused, run_cli
from tests.tiny import tiny_causal_lm


# ---------------------------------------------------------------------------------------------- helpers


def tree_hash(path: Path) -> str:
    """Every file's relative path and bytes under `path` (or the file itself), hashed: equal hashes
    mean nothing on disk changed."""
    path = Path(path)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*"))
    for p in files:
        digest.update(str(p.relative_to(path.parent)).encode())
        if p.is_file():
            digest.update(p.read_bytes())
    return digest.hexdigest()


@pytest.fixture(autouse=True)
def no_progress_bars(monkeypatch):
    """Progress bars (tqdm: datasets, safetensors shards, capture) draw on stderr; without them,
    stderr holds only what the command says, so a refusal must be its only line."""
    import datasets

    monkeypatch.setenv("TQDM_DISABLE", "1")
    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # datasets' bars ignore TQDM_DISABLE
    yield
    if not was_disabled:
        datasets.enable_progress_bars()


def unchanged(*paths):
    """Context: hash `paths` before and after the block and assert every one is the same."""

    class Guard:
        def __enter__(self):
            self.before = [tree_hash(p) for p in paths]

        def __exit__(self, *exc):
            if exc[0] is None:
                assert [tree_hash(p) for p in paths] == self.before, "something on disk changed"

    return Guard()


def medusa_head_dir(folder: Path) -> Path:
    """A saved medusa1 head on a tiny target (no target needed to export it)."""
    target = tiny_causal_lm("llama", vocab=64, layers=2, hidden=32)
    head = build_head(make_config("medusa1", target, None, name="tiny", num_heads=2), target)
    return head.save_pretrained(folder)


def trained_run(tmp_path, **kw) -> tuple[Path, Path]:
    """A DummyHead run stopped after 2 steps with a checkpoint (tests/test_trainer.py's config),
    and a YAML of its config for the CLI. Returns (output_dir, yaml path)."""
    cfg = config(tmp_path, max_steps=4, checkpoint_every=2, eval_every=0, **kw)
    Trainer(cfg, DummyHead(), TrainData(train=random_samples(16))).fit(progress=False, stop_after_steps=2)
    saved = tmp_path / "run.yaml"
    saved.write_text(yaml.safe_dump(cfg.to_dict()))
    return Path(cfg.output_dir), saved


# ---------------------------------------------------------------------------------------------- no silent overwrite


def test_fresh_folder_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with fresh_folder(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise KeyboardInterrupt
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no temp folder left either
    with fresh_folder(out) as tmp:
        (tmp / "stale.bin").write_bytes(b"old")
    with pytest.raises(ValueError, match="--overwrite"):
        with fresh_folder(out):
            pass
    with fresh_folder(out, overwrite=True) as tmp:
        (tmp / "new.bin").write_bytes(b"new")
    assert sorted(p.name for p in out.iterdir()) == [MARKER_FILE, "new.bin"]  # the stale file went with the old folder
    assert json.loads((out / MARKER_FILE).read_text())["files"] == ["new.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    (out / "mine.txt").write_text("a file no drafthead command wrote")
    with unchanged(out), pytest.raises(ValueError, match="holds mine.txt that no drafthead command wrote"):
        with fresh_folder(out, overwrite=True):
            pass


def test_train_refuses_a_finished_run_without_checkpoints(tmp_path, capsys):
    """Issue 28 case 1: output_dir holds final/ and logs but no checkpoint (checkpoint_every=0)."""
    cfg = config(tmp_path, max_steps=2, checkpoint_every=0, eval_every=0)
    Trainer(cfg, DummyHead(), TrainData(train=random_samples(16))).fit(progress=False)
    out = Path(cfg.output_dir)
    assert (out / "final").is_dir() and latest_checkpoint(out) is None
    saved = tmp_path / "run.yaml"
    saved.write_text(yaml.safe_dump(cfg.to_dict()))
    with unchanged(out):
        for extra in ([], ["--resume"]):
            assert_refused(*run_cli(capsys, "train", "--config", saved, *extra), "no checkpoint to resume", "--overwrite")


def test_train_overwrite_replaces_the_old_run(tmp_path):
    """--overwrite clears the run's own files (an old best/ head) and refuses one it did not write."""
    cfg = config(tmp_path, max_steps=2, checkpoint_every=0, eval_every=0, log_every=1)
    Trainer(cfg, DummyHead(), TrainData(train=random_samples(16))).fit(progress=False)
    out = Path(cfg.output_dir)
    (out / "best").mkdir()
    (out / "best" / "model.safetensors").write_text("an earlier run's best head")
    (out / "notes.txt").write_text("mine")
    with unchanged(out), pytest.raises(ValueError, match="holds notes.txt that no drafthead command wrote"):
        Trainer(cfg, DummyHead(), TrainData(train=random_samples(16))).fit(progress=False, overwrite=True)
    (out / "notes.txt").unlink()
    Trainer(cfg, DummyHead(), TrainData(train=random_samples(16))).fit(progress=False, overwrite=True)
    assert not (out / "best").exists()
    starts = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("event") == "start" for r in starts) == 1  # one run's log, not two


def test_export_refuses_a_non_empty_folder_and_overwrite_leaves_no_stale_file(tmp_path, capsys):
    """Issue 28 cases 4 and 7: an export over an earlier one, whose stale files would be read."""
    head = medusa_head_dir(tmp_path / "head")
    out = tmp_path / "out"
    assert run_cli(capsys, "export", head, "--format", "ours", "--out", out)[0] == 0  # an earlier export: model.safetensors
    with unchanged(out, head):
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", out), str(out), "--overwrite")
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", head), "source folder itself")
    code, err = run_cli(capsys, "export", head, "--format", "medusa", "--out", out, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", MARKER_FILE, "medusa_lm_head.pt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_import_refuses_an_existing_head_and_its_own_source(tmp_path, capsys):
    """Issue 28 cases 5 and 6; refused before the target loads (--target names no model)."""
    head = medusa_head_dir(tmp_path / "head")
    src = tmp_path / "upstream"
    assert run_cli(capsys, "export", head, "--format", "medusa", "--out", src)[0] == 0
    with unchanged(src, head):
        assert_refused(*run_cli(capsys, "import", src, "--out", head, "--target", "nothing"), str(head), "--overwrite")
        assert_refused(*run_cli(capsys, "import", src, "--out", src, "--target", "nothing"), "source folder itself")


def test_tiny_target_refuses_a_non_empty_folder_and_ctrl_c_leaves_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with unchanged(out):
        assert_refused(*run_cli(capsys, "data", "tiny-target", "--out", out), "--overwrite")
        assert_refused(*run_cli(capsys, "data", "tiny-target", "--out", out, "--overwrite"), "holds notes.txt that no drafthead command wrote")
    (out / "notes.txt").unlink()
    assert run_cli(capsys, "data", "tiny-target", "--out", out, "--chats", "2")[0] == 0  # an earlier tiny target

    import drafthead.train.data.tiny as tiny

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "write_tiny_jsonl", interrupted)  # Ctrl-C while the chats are written
    fresh = tmp_path / "fresh"
    code, err = run_cli(capsys, "data", "tiny-target", "--out", fresh, "--chats", "3")
    assert code == 130 and "interrupted" in err
    assert not fresh.exists()
    with unchanged(out):
        assert run_cli(capsys, "data", "tiny-target", "--out", out, "--overwrite")[0] == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temp folder left


# ---------------------------------------------------------------------------------------------- resume checks


def test_resume_changes_rule():
    saved = {"lr": 0.001, "log_every": 10, "data": {"path": "a.jsonl", "limit": None, "num_proc": None}, "head": {"kind": "medusa1", "num_heads": 3}}
    now = {"lr": 0.1, "log_every": 1, "data": {"path": "b.jsonl", "limit": None, "num_proc": 4}, "head": {"kind": "medusa1"}}
    refused, applied = resume_changes(saved, now)
    assert refused == ["data.path: 'a.jsonl' -> 'b.jsonl'", "head.num_heads: 3 -> '<unset>'", "lr: 0.001 -> 0.1"]
    assert applied == ["data.num_proc: None -> 4", "log_every: 10 -> 1"]
    assert resume_changes(saved, saved) == ([], [])


@pytest.mark.parametrize(
    "override,field",
    [("lr=0.1", "lr: 0.03 -> 0.1"), ("batch_size=2", "batch_size: 4 -> 2"), ("data.path=other.jsonl", "data.path: None -> 'other.jsonl'")],
)
def test_resume_refuses_a_change_of_meaning(tmp_path, capsys, override, field):
    """Issue 28 cases 2 and 3; the override comes after --resume (argparse order)."""
    out, saved = trained_run(tmp_path)
    with unchanged(out):
        line = assert_refused(*run_cli(capsys, "train", "--config", saved, "--resume", override), field, "init_from")
    assert "unrecognized" not in line


def test_resume_applies_and_logs_allowed_changes(tmp_path):
    out, saved = trained_run(tmp_path)
    cfg = config(tmp_path, max_steps=6, checkpoint_every=2, eval_every=0, log_every=1)
    result = Trainer(cfg, DummyHead(), TrainData(train=random_samples(16))).fit(progress=False, resume=True)
    assert result.state.step == 6  # the new max_steps ran
    assert yaml.safe_load((out / "config.yaml").read_text())["max_steps"] == 6  # the saved config says what ran
    events = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e.get("event") == "resume"]
    assert resumed and "max_steps: 4 -> 6" in resumed[-1]["changed_settings"]
    assert json.loads((latest_checkpoint(out) / RUN_CONFIG_FILE).read_text())["max_steps"] == 6
    bad = config(tmp_path, max_steps=6, checkpoint_every=2, eval_every=0, log_every=1, lr=0.5)
    with pytest.raises(ValueError, match="lr: 0.03 -> 0.5"):
        check_resume(cfg.to_dict(), bad, "here")
    unnamed = {k: v for k, v in cfg.to_dict().items() if k != "shard_target"}  # compared at its default
    assert check_resume(unnamed, cfg, "here") == []


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    out, saved = trained_run(tmp_path)
    with unchanged(out):
        assert_refused(*run_cli(capsys, "train", "--config", saved, "--resume", "--overwrite"), "pass one")


# ---------------------------------------------------------------------------------------------- data commands


def test_regenerate_refuses_a_file_it_did_not_write(tmp_path, capsys):
    """--out pointed at the user's own data file: refused before the target loads."""
    from drafthead.train.data.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 3)
    with unchanged(chats):
        assert_refused(
            *run_cli(capsys, "data", "regenerate", "--target", "nothing", "--source", "json", "--path", chats, "--out", chats),
            "not a `data regenerate` output",
            "--overwrite",
        )


def test_regenerate_with_no_answer_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch, tiny_llama_dir, isolated_cache):
    """Issue 28: a target that answers nothing wrote 0 records and exited 0."""
    import drafthead.train.regeneration.regenerate as regenerate
    from drafthead.train.data.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 2)
    monkeypatch.setattr(regenerate, "answer", lambda model, tokenizer, prompts, **kw: [regenerate.Answer("", True)] * len(prompts))
    out = tmp_path / "regen.jsonl"
    with unchanged(chats):
        code, err = run_cli(
            capsys,
            "data",
            "regenerate",
            "--target",
            tiny_llama_dir,
            "--source",
            "json",
            "--path",
            chats,
            "--out",
            out,
            "--max-new-tokens",
            "2",
            "--batch-size",
            "2",
        )
    assert_failed_late(code, err, "no record written", "empty_answers=2")
    assert sorted(p.name for p in tmp_path.iterdir() if p != isolated_cache) == ["chats.jsonl"]  # no output, temp or lock


def test_regenerate_overwrite_and_continue(tmp_path, capsys, monkeypatch, tiny_llama_dir, isolated_cache):
    """--overwrite refuses a file regenerate did not write and replaces its own (made with other
    settings); a rerun continues its own file."""
    import drafthead.train.regeneration.regenerate as regenerate
    from drafthead.train.data.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 2)
    out = tmp_path / "regen.jsonl"
    out.write_text('{"some": "user data"}\n')
    monkeypatch.setattr(regenerate, "answer", lambda model, tokenizer, prompts, **kw: [regenerate.Answer("fine", True)] * len(prompts))
    argv = [
        "data",
        "regenerate",
        "--target",
        tiny_llama_dir,
        "--source",
        "json",
        "--path",
        chats,
        "--out",
        out,
        "--max-new-tokens",
        "2",
        "--batch-size",
        "2",
    ]
    with unchanged(out):
        assert_refused(*run_cli(capsys, *argv, "--overwrite"), str(out), "is a file that no drafthead command wrote")
    out.unlink()
    assert run_cli(capsys, *argv, "--temperature", "0.5")[0] == 0
    assert run_cli(capsys, *argv, "--overwrite")[0] == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert {r["generation"]["temperature"] for r in records} == {0.0}
    assert [r["id"] for r in records] == ["tiny-0", "tiny-1"] and all("generation" in r for r in records)
    with unchanged(out):  # its own output: continued, with nothing left to do
        assert run_cli(capsys, *argv)[0] == 0


def test_capture_refuses_a_folder_that_holds_no_capture(tmp_path, capsys):
    cfg = config(tmp_path)
    saved = tmp_path / "run.yaml"
    saved.write_text(yaml.safe_dump(cfg.to_dict()))
    out = tmp_path / "features"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with unchanged(out):
        assert_refused(*run_cli(capsys, "data", "capture", "--config", saved, "--out", out), "holds no capture", "--overwrite")


def test_capture_overwrite_clears_the_old_folder_first(tmp_path, capsys, monkeypatch, tiny_llama_dir):
    import drafthead.train.loop.run as run

    cfg = config(tmp_path, target=str(tiny_llama_dir))
    saved = tmp_path / "run.yaml"
    saved.write_text(yaml.safe_dump(cfg.to_dict()))
    out = tmp_path / "features"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with unchanged(out):
        assert_refused(*run_cli(capsys, "data", "capture", "--config", saved, "--out", out, "--overwrite"), "holds notes.txt that no drafthead")
    (out / "notes.txt").unlink()
    mark_output(out, "capture folder", CAPTURE_FILES)  # an earlier capture's folder
    (out / "shard-00000.safetensors").write_text("an earlier shard")
    seen = []

    def capture(config, model, tokenizer, out_dir, **kw):  # what the real capture finds on entry
        seen.append(sorted(p.name for p in Path(out_dir).iterdir()) if Path(out_dir).exists() else [])
        return Path(out_dir) / "index.json"

    monkeypatch.setattr(run, "capture_from_config", capture)
    assert run_cli(capsys, "data", "capture", "--config", saved, "--out", out, "--overwrite")[0] == 0
    assert seen == [[]]


# ---------------------------------------------------------------------------------------------- one line per user error


@pytest.fixture
def target_copy(tmp_path, tiny_llama_dir):
    """A copy of the tiny Llama target folder the test may damage."""
    import shutil

    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "target"))


@pytest.mark.parametrize("keep", [20, 0.5])
def test_truncated_target_safetensors(target_copy, capsys, keep):
    weights = target_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with unchanged(target_copy):
        assert_refused(*run_cli(capsys, "generate", "--target", target_copy, "--prompt", "hi"), str(target_copy), "truncated or corrupt", "again")


def tiny_gguf(path: Path) -> bytes:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("a", np.ones((64, 32), np.float32))
    writer.add_tensor("b", np.ones((16,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.mark.parametrize("where", ["header", "tensor data"])
def test_truncated_gguf(tmp_path, capsys, isolated_cache, tiny_llama_dir, where):
    """Issue 28: a .gguf cut in its header gave struct.error, one cut in its tensor data 'cannot reshape'."""
    data = tiny_gguf(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:10] if where == "header" else data[:-100])
    with unchanged(cut):
        assert_refused(*run_cli(capsys, "generate", "--target", cut, "--prompt", "hi"), str(cut), "truncated")
        assert_refused(*run_cli(capsys, "import", cut, "--target", tiny_llama_dir, "--out", tmp_path / "imported"), str(cut), "truncated")
    assert not (tmp_path / "imported").exists()
    assert not list(isolated_cache.rglob("*.safetensors"))  # nothing cached from it


def test_gpt2_target_with_an_eagle3_config_names_the_kinds_that_fit(tmp_path, capsys, isolated_cache):
    from transformers import GPT2Config, GPT2LMHeadModel

    from drafthead.train.data.tiny import tiny_tokenizer, write_tiny_jsonl

    tok = tiny_tokenizer()
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=128, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    ).save_pretrained(gpt2)
    tok.save_pretrained(gpt2)
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 8)
    with unchanged(tmp_path):
        code, err = run_cli(
            capsys, "train", "--config", "tiny-eagle3", f"target={gpt2}", f"data.path={chats}", f"output_dir={tmp_path / 'run'}", "max_steps=1"
        )
        assert_refused(code, err, "eagle3", "GPT2LMHeadModel", "medusa1", "hydra")
    assert "dflash" not in err and "eagle1" not in err.splitlines()[-1].split("one of:")[-1]


def test_unparseable_yaml_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1, 2\nbatch_size: {\n")
    with unchanged(bad):
        line = assert_refused(*run_cli(capsys, "train", "--config", bad), str(bad), "not valid YAML", "line 2")
    assert "^" not in line


def test_non_utf8_files_are_named(tmp_path, capsys, tiny_llama_dir):
    data = tmp_path / "chats.jsonl"
    data.write_bytes(b'{"id": "a", "messages": [{"role": "user", "content": "\xff\xfe"}]}\n')
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_bytes(b"lr: 0.1 # \xff\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "\xff"}\n')
    head = medusa_head_dir(tmp_path / "head")
    (head / "config.json").write_bytes(bytes(range(128, 256)))
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, "data", "inspect", "--source", "json", "--path", data), str(data), "not UTF-8")
        assert_refused(*run_cli(capsys, "train", "--config", yaml_file), str(yaml_file), "not UTF-8")
        assert_refused(*run_cli(capsys, "bench", "--target", tiny_llama_dir, "--dataset", prompts), str(prompts), "not UTF-8")
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", tmp_path / "x"), str(head / "config.json"), "not UTF-8")


def test_head_config_json_that_is_not_an_object(tmp_path, capsys):
    head = medusa_head_dir(tmp_path / "head")
    (head / "config.json").write_text("[1, 2]")
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", tmp_path / "x"), str(head / "config.json"), "not an object")


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("num_heads", "2", "num_heads: expected an integer, got '2'"),
        ("loss_decay", "0.8", "loss_decay: expected a number, got '0.8'"),
        ("share_lm_head", 0, "share_lm_head: expected true or false, got 0"),
        ("target.hidden_size", "32", "hidden_size: expected an integer, got '32'"),
    ],
)
def test_head_config_json_with_values_of_the_wrong_type(tmp_path, capsys, field, value, fragment):
    """A hand-edited config.json ("4" for 4): one line naming the file and the key, not a TypeError
    from inside a forward."""
    head = medusa_head_dir(tmp_path / "head")
    meta = json.loads((head / "config.json").read_text())
    where, _, key = ("config." + field).rpartition(".")
    holder = meta
    for part in where.split("."):
        holder = holder[part]
    holder[key] = value
    (head / "config.json").write_text(json.dumps(meta))
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", tmp_path / "x"), str(head / "config.json"), fragment)


def test_first_contact_reaches_an_engine_layout(tmp_path, capsys):
    """The README's tiny CPU path (`data tiny-target`, `train --config tiny-eagle3`, `export`):
    the saved tiny target is deep enough for EAGLE-3's default features to export to every engine
    layout. A 2-layer one is not: training says so at its start, and export refuses with the way out."""
    deep, shallow = tmp_path / "tiny", tmp_path / "tiny2"
    assert run_cli(capsys, "data", "tiny-target", "--out", deep, "--chats", "24")[0] == 0
    assert run_cli(capsys, "data", "tiny-target", "--out", shallow, "--chats", "24", "--layers", "2")[0] == 0
    argv = ["train", "--config", "tiny-eagle3", "max_steps=1", "checkpoint_every=0", "eval_every=0", "data.eval_size=1"]
    capsys.readouterr()
    assert cli.main([*argv, f"target={deep}", f"data.path={deep / 'chats.jsonl'}", f"output_dir={tmp_path / 'run'}"]) == 0
    assert "no engine export" not in capsys.readouterr().out
    for fmt in ("vllm", "sglang", "speculators", "llama.cpp"):
        code, err = run_cli(capsys, "export", tmp_path / "run" / "final", "--format", fmt, "--out", tmp_path / fmt, "--target", deep)
        assert code == 0, (fmt, err)
    assert cli.main([*argv, f"target={shallow}", f"data.path={shallow / 'chats.jsonl'}", f"output_dir={tmp_path / 'run2'}"]) == 0
    assert "note: this head will run in drafthead only, no engine export will take it" in capsys.readouterr().out
    with unchanged(tmp_path):
        assert_refused(
            *run_cli(capsys, "export", tmp_path / "run2" / "final", "--format", "vllm", "--out", tmp_path / "x"),
            "retrain with aux_layers set to 3 distinct indices in 1..1",
        )


def test_random_bytes_target_config_json(target_copy, capsys):
    (target_copy / "config.json").write_bytes(bytes(range(256)) * 2)
    with unchanged(target_copy):
        assert_refused(*run_cli(capsys, "generate", "--target", target_copy, "--prompt", "hi"), "config.json")


def test_missing_tokenizer_message_is_whole(target_copy, capsys):
    """Issue 28: the message was cut off at 'from one of:'."""
    for p in list(target_copy.iterdir()):
        if p.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            p.unlink()
    with unchanged(target_copy):
        line = assert_refused(
            *run_cli(capsys, "generate", "--target", target_copy, "--prompt", "hi"), str(target_copy), "no tokenizer", "save_pretrained"
        )
    assert not line.rstrip().endswith(":")


def refuse_writes_under(monkeypatch, folder: Path):
    """Make creating anything under `folder` fail as a read-only folder does (tests run as root,
    which chmod cannot stop): os.mkdir and os.open for writing raise PermissionError."""
    import errno
    import os

    real_mkdir, real_open = os.mkdir, os.open
    inside = lambda p: str(Path(p).absolute()).startswith(str(folder))  # noqa: E731

    def mkdir(path, *args, **kwargs):
        if inside(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_mkdir(path, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)


def test_read_only_output_folder(tmp_path, capsys, monkeypatch):
    head = medusa_head_dir(tmp_path / "head")
    locked = tmp_path / "locked"
    locked.mkdir()
    refuse_writes_under(monkeypatch, locked)
    with unchanged(tmp_path):
        assert_refused(
            *run_cli(capsys, "export", head, "--format", "medusa", "--out", locked / "out"), str(locked), "Permission denied", "permissions"
        )


def test_read_only_checkpoint_folder(tmp_path, capsys, monkeypatch, tiny_llama_dir, isolated_cache):
    """Refused at the start (output_dir is probed before the target loads), not at the first checkpoint."""
    from drafthead.train.data.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 8)
    run_dir = tmp_path / "run"
    refuse_writes_under(monkeypatch, run_dir / "checkpoints")
    with unchanged(tmp_path):  # nothing made: no run folder, no lock file
        assert_refused(
            *run_cli(capsys, *tiny_train(tiny_llama_dir, chats, run_dir, "max_steps=1", "checkpoint_every=1")),
            str(run_dir / "checkpoints"),
            "Permission denied",
        )


def tiny_train(target, chats, out, *overrides) -> list:
    """argv of a tiny-medusa1 run of the target on the chats into `out` (seconds on a CPU)."""
    return [
        "train",
        "--config",
        "tiny-medusa1",
        f"target={target}",
        f"data.path={chats}",
        f"output_dir={out}",
        "eval_every=0",
        "data.eval_size=1",
        *overrides,
    ]


def test_traceback_on_request(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1\n")
    monkeypatch.setenv("DRAFTHEAD_TRACEBACK", "1")
    with unchanged(tmp_path), pytest.raises(ValueError, match="not valid YAML"):
        cli.main(["train", "--config", str(bad)])


def test_words_after_options(capsys):
    """Overrides may follow options; an unknown option or a word that is no override is still an error."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "--config", "tiny-medusa1", "--resume", "--bogus"])
    assert stop.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert_refused(*run_cli(capsys, "train", "--config", "tiny-medusa1", "--resume", "oops"), "'oops' is not key=value")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_target_dir):
    """A tiny-medusa1 run through the CLI stopped at step 2 of 4 with checkpoints at 1 and 2, and
    a capture of its features: (target, chats, run folder, capture folder). Tests copy them."""
    import datasets

    from drafthead.train.data.tiny import write_tiny_jsonl

    was_disabled = datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("tiny-run")
    target, chats = tiny_target_dir("llama"), write_tiny_jsonl(root / "chats.jsonl", 12)
    assert cli.main(tiny_train(target, chats, root / "run", "max_steps=2", "checkpoint_every=1")) == 0
    assert (
        cli.main(
            [
                "data",
                "capture",
                "--config",
                "tiny-medusa1",
                f"target={target}",
                f"data.path={chats}",
                "data.eval_size=1",
                "--out",
                str(root / "features"),
            ]
        )
        == 0
    )
    if not was_disabled:
        datasets.enable_progress_bars()
    return target, chats, root / "run", root / "features"


def copied(path: Path, where: Path) -> Path:
    import shutil

    return Path(shutil.copytree(path, where / path.name) if path.is_dir() else shutil.copy(path, where / path.name))


@pytest.mark.parametrize("damaged", ["trainable.safetensors", "optimizer.pt"])
def test_damaged_checkpoint_on_resume(tmp_path, capsys, tiny_run, damaged):
    target, chats, run, _ = tiny_run
    run = copied(run, tmp_path)
    broken = latest_checkpoint(run) / damaged
    broken.write_bytes(broken.read_bytes()[:100])
    with unchanged(run, chats):
        assert_refused(
            *run_cli(capsys, *tiny_train(target, chats, run, "max_steps=2", "checkpoint_every=1"), "--resume"),
            "step-00000002 is truncated or corrupt",
            "delete it",
        )


def test_python_m_drafthead_train_reports_the_same_way(tmp_path):
    """`python -m drafthead train` (what `accelerate launch -m drafthead train` runs): one line, exit 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1\n")
    with unchanged(tmp_path):
        out = subprocess.run([sys.executable, "-m", "drafthead", "train", "--config", str(bad)], capture_output=True, text=True)
    assert_refused(out.returncode, out.stderr, str(bad), "not valid YAML")


def test_damaged_captured_shard_and_index(tmp_path, capsys, tiny_run):
    from drafthead.train.capture.features import INDEX_FILE

    target, chats, _, features = tiny_run
    features = copied(features, tmp_path)
    argv = tiny_train(target, chats, tmp_path / "run", "max_steps=1", "features.mode=captured", f"features.path={features}")
    shard = features / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with unchanged(features, chats):
        assert_refused(*run_cli(capsys, *argv), str(shard), "truncated or corrupt", "rerun")
    index = features / INDEX_FILE
    index.write_bytes(b"\xff" + index.read_bytes())
    with unchanged(features, chats):
        assert_refused(*run_cli(capsys, *argv, "--overwrite"), str(index), "not UTF-8")


# ---------------------------------------------------------------------------------------------- issue 38: silently wrong


def test_stale_captured_features_are_refused(tmp_path, capsys, tiny_run, tiny_target_dir):
    """Data edited after the capture, another target of the same shapes, another hidden size:
    training on the capture and rerunning the capture are both refused."""
    target, chats, _, features = tiny_run
    features, chats = copied(features, tmp_path), copied(chats, tmp_path)
    train = tiny_train(target, chats, tmp_path / "run", "max_steps=1", "features.mode=captured", f"features.path={features}")
    other = tiny_target_dir("llama", seed=1)  # same shapes and tokenizer, other weights
    wider = tiny_target_dir("llama", hidden=64)
    with unchanged(features, chats):
        assert_refused(*run_cli(capsys, *train[:3], f"target={other}", *train[4:]), "target's weights", "capture again")
        assert_refused(*run_cli(capsys, *train[:3], f"target={wider}", *train[4:]), "hidden_size: captured from 32")
    with chats.open("a") as f:
        f.write(chats.read_text().splitlines()[0].replace('"id": "tiny-0"', '"id": "edited"') + "\n")
    capture = ["data", "capture", "--config", "tiny-medusa1", f"target={target}", f"data.path={chats}", "data.eval_size=1", "--out", features]
    with unchanged(features, chats):
        assert_refused(*run_cli(capsys, *train), f"content of {chats}", "--overwrite")
        assert_refused(*run_cli(capsys, *capture), "made from other data", "--overwrite")
    assert not (tmp_path / "run").exists()


def test_a_second_writer_of_one_output_is_refused(tmp_path, capsys, tiny_llama_dir):
    """Every writing command takes its output's lock; one held elsewhere refuses the command."""
    from drafthead.ground.outdir import lock_file, output_lock
    from drafthead.train.data.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 4)
    head = medusa_head_dir(tmp_path / "head")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the other writer's")
    mark_output(out, "the other writer's output", ["notes.txt"])
    commands = [
        tiny_train(tiny_llama_dir, chats, out, "--overwrite"),
        ["export", head, "--format", "medusa", "--out", out, "--overwrite"],
        ["data", "tiny-target", "--out", out, "--overwrite"],
        ["data", "capture", "--config", "tiny-medusa1", f"target={tiny_llama_dir}", f"data.path={chats}", "--out", out, "--overwrite"],
        ["data", "regenerate", "--target", tiny_llama_dir, "--source", "json", "--path", chats, "--out", out, "--overwrite"],
    ]
    with output_lock(out):
        with unchanged(tmp_path):
            for argv in commands:
                assert_refused(*run_cli(capsys, *argv), str(out), "being written by another drafthead process", f"pid {__import__('os').getpid()}")
    assert not lock_file(out).exists()  # let go, the lock leaves nothing behind


def test_bench_refuses_to_replace_a_file(tmp_path, capsys):
    """--out / --markdown / --plot: a non-empty file needs --overwrite, the --dataset file is never
    replaced, and two outputs may not name one file; all before the target loads."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    report = tmp_path / "report.json"
    report.write_text("{}")
    bench = ["bench", "--target", "nothing", "--dataset", prompts]
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, *bench, "--out", report), str(report), "--overwrite")
        assert_refused(*run_cli(capsys, *bench, "--markdown", report), str(report), "--overwrite")
        assert_refused(*run_cli(capsys, *bench, "--out", prompts, "--overwrite"), "is this command's input")
        assert_refused(*run_cli(capsys, *bench, "--out", tmp_path / "a.md", "--markdown", tmp_path / "a.md"), "both name")


def test_overwrite_never_deletes_a_model_data_or_the_inputs(tmp_path, capsys, target_copy):
    from drafthead.train.data.tiny import write_tiny_jsonl

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    chats = write_tiny_jsonl(data_dir / "chats.jsonl", 4)
    other_data = tmp_path / "other"
    other_data.mkdir()
    write_tiny_jsonl(other_data / "mine.jsonl", 2)
    head = medusa_head_dir(tmp_path / "head")
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, *tiny_train(target_copy, chats, target_copy, "--overwrite")), "is this command's input")
        assert_refused(*run_cli(capsys, *tiny_train(target_copy, chats, data_dir, "--overwrite")), "holds this command's input")
        assert_refused(*run_cli(capsys, *tiny_train(target_copy, chats, other_data, "--overwrite")), "holds mine.jsonl that no drafthead")
        assert_refused(
            *run_cli(capsys, "export", head, "--format", "medusa", "--out", target_copy, "--overwrite"),
            "holds chat_template.jinja and",
            "no drafthead",
        )
        assert_refused(
            *run_cli(
                capsys, "data", "capture", "--config", "tiny-medusa1", f"target={target_copy}", f"data.path={chats}", "--out", data_dir, "--overwrite"
            ),
            "holds this command's input",
        )
        assert_refused(*run_cli(capsys, "data", "tiny-target", "--out", target_copy, "--overwrite"), "that no drafthead command wrote")
        assert_refused(
            *run_cli(capsys, "data", "regenerate", "--target", target_copy, "--source", "json", "--path", chats, "--out", chats, "--overwrite"),
            "is this command's input",
        )
    tiny = tmp_path / "tiny"
    assert run_cli(capsys, "data", "tiny-target", "--out", tiny, "--chats", "2")[0] == 0
    assert run_cli(capsys, "data", "tiny-target", "--out", tiny, "--chats", "2", "--overwrite")[0] == 0  # its own


@pytest.mark.parametrize(
    "argv,fragments",
    [
        (["--stop", ""], ['--stop ""', "first token"]),
        (["--lookup-nodes", "-1"], ["lookup_nodes (--lookup-nodes) must be a whole number >= 0"]),
        (["--lookup-streak", "-2"], ["lookup_streak (--lookup-streak) must be a whole number >= 0"]),
        (["--temperature", "nan"], ["temperature must be a number >= 0, got nan"]),
        (["--temperature", "inf"], ["temperature must be a number >= 0, got inf"]),
        (["--repetition-penalty", "nan"], ["repetition_penalty"]),
    ],
)
def test_settings_are_checked_before_the_target_loads(tmp_path, capsys, argv, fragments):
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, "generate", "--target", "nothing", "--prompt", "hi", *argv), *fragments)


def llama_head_dir(folder: Path, target_dir: Path) -> Path:
    """A saved medusa1 head for the tiny Llama target folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    head = build_head(make_config("medusa1", target, AutoTokenizer.from_pretrained(target_dir), name=target_dir.name, num_heads=2), target)
    return head.save_pretrained(folder)


@pytest.mark.parametrize(
    "drafting,fragments",
    [
        ({"lookup_nodes": -1}, ["lookup_nodes (--lookup-nodes) must be a whole number >= 0", "got -1"]),
        ({"lookup_streak": "8"}, ["lookup_streak (--lookup-streak) must be a whole number", "got '8'"]),
        ({"num_draft": 0}, ["num_draft (--num-draft) must be a whole number >= 1"]),
        ([1, 2], ["holds a JSON list, not an object"]),
    ],
)
def test_bad_drafting_json_is_named(tmp_path, capsys, tiny_llama_dir, drafting, fragments):
    head = llama_head_dir(tmp_path / "head", tiny_llama_dir)
    (head / "drafting.json").write_text(json.dumps(drafting))
    with unchanged(tmp_path):
        assert_refused(
            *run_cli(capsys, "generate", "--target", tiny_llama_dir, "--head", head, "--prompt", "hi", "--max-new-tokens", "2"),
            str(head / "drafting.json"),
            *fragments,
        )


def test_keep_best_without_an_eval_split(tmp_path, capsys, tiny_llama_dir, isolated_cache):
    """Too few rows for an eval split: keep_best is refused before training; without it the run
    says at the start that it has no eval."""
    from drafthead.train.data.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 8)
    run = tmp_path / "run"
    no_eval = ["data.eval_fraction=0", "max_steps=1", "checkpoint_every=0"]
    with unchanged(chats):
        assert_refused(
            *run_cli(capsys, *tiny_train(tiny_llama_dir, chats, run, *no_eval, "keep_best=tau_est")),
            "keep_best=tau_est needs held-out samples",
            "leave none for eval",
            "keep_best=none",
        )
    assert not run.exists()
    capsys.readouterr()
    assert cli.main([str(a) for a in tiny_train(tiny_llama_dir, chats, run, *no_eval)]) == 0
    assert "no eval: 8 samples with data.eval_fraction=0.0" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- issue 38: unclear


def test_write_failure_rule():
    """What the writers raise on a full disk (taken from a full tmpfs), as the OSError the CLI reports."""
    import errno

    from drafthead.ground.outdir import write_failure

    safetensors = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert (write_failure(safetensors, "f").errno, write_failure(safetensors, "f").filename) == (errno.ENOSPC, "f")
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert write_failure(short, "/").errno in (errno.ENOSPC, errno.EIO)
    assert write_failure(OSError(errno.ENOSPC, "No space left on device"), "out.jsonl").filename == "out.jsonl"
    assert write_failure(RuntimeError("shape mismatch"), "f") is None


@pytest.fixture
def full_disk(tmp_path):
    """A tmpfs of 1 MiB mounted at tmp_path/full, filled but for `free(n)` bytes (tests run as
    root; a runner that may not mount skips, and test_write_failure_rule still runs)."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def free(n: int) -> Path:
        filler = folder / "filler"
        with open(filler, "wb") as f:
            try:
                f.write(b"\0" * (1 << 20))
            except OSError:
                pass
        with open(filler, "r+b") as f:
            f.truncate(max(0, filler.stat().st_size - n))
        return folder

    try:
        yield free
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def assert_disk_full(code: int, err: str, where: Path) -> None:
    line = assert_failed_late(code, err, "No space left on device", "the disk is full: free space or write somewhere else")
    assert str(where) in line
    assert not [p for p in where.rglob("*") if p.name.endswith((".tmp", ".lock")) or p.name.startswith(".tmp-")]


def test_disk_full_while_writing(tmp_path, capsys, full_disk, tiny_llama_dir, monkeypatch, isolated_cache):
    """Every writing command on a full disk: one line naming the file or folder with the way out,
    no temp file left, the inputs unchanged."""
    import drafthead.train.regeneration.regenerate as regenerate
    from drafthead.train.data.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 8)
    head = medusa_head_dir(tmp_path / "head")
    disk = full_disk(0)
    with unchanged(chats, head, tiny_llama_dir):
        assert_disk_full(*run_cli(capsys, "data", "tiny-target", "--out", disk / "tiny"), disk)
        assert_disk_full(*run_cli(capsys, "export", head, "--format", "medusa", "--out", disk / "export"), disk)
        monkeypatch.setattr(regenerate, "answer", lambda model, tokenizer, prompts, **kw: [regenerate.Answer("x" * 99, True)] * len(prompts))
        assert_disk_full(
            *run_cli(
                capsys,
                "data",
                "regenerate",
                "--target",
                tiny_llama_dir,
                "--source",
                "json",
                "--path",
                chats,
                "--out",
                disk / "regen.jsonl",
                "--max-new-tokens",
                "2",
            ),
            disk / "regen.jsonl",
        )
        disk = full_disk(4096)  # the capture's plan fits, its first shard does not
        assert_disk_full(
            *run_cli(
                capsys, "data", "capture", "--config", "tiny-medusa1", f"target={tiny_llama_dir}", f"data.path={chats}", "--out", disk / "features"
            ),
            disk / "features",
        )
        disk = full_disk(16384)  # the run's config and log fit, its first checkpoint does not
        assert_disk_full(
            *run_cli(capsys, *tiny_train(tiny_llama_dir, chats, disk / "run", "max_steps=1", "checkpoint_every=1")), disk / "run" / "checkpoints"
        )
    assert not (disk / "run" / "final").exists()


def test_leftovers_of_killed_writes_are_removed(tmp_path, capsys, tiny_run):
    """A killed checkpoint, export or capture shard write leaves temp files; the next run removes them."""
    target, chats, run, features = tiny_run
    run, features = copied(run, tmp_path), copied(features, tmp_path)
    (run / "checkpoints" / ".tmp-step-00000003-999999").mkdir()
    (run / "checkpoints" / ".tmp-step-00000003-999999" / "optimizer.pt").write_bytes(b"half")
    assert run_cli(capsys, *tiny_train(target, chats, run, "max_steps=3", "checkpoint_every=1"), "--resume")[0] == 0
    assert not list((run / "checkpoints").glob(".tmp-*"))
    (tmp_path / ".export.a1b2c3.tmp").mkdir()
    (tmp_path / ".export.a1b2c3.tmp" / "model.safetensors").write_bytes(b"half")
    assert run_cli(capsys, "export", run / "final", "--format", "medusa", "--out", tmp_path / "export")[0] == 0
    assert not list(tmp_path.glob(".export.*"))
    (features / "shard-00000.tmp").write_bytes(b"half")
    (features / ".index.json.x1y2.tmp").write_bytes(b"half")
    with unchanged(features / "shard-00000.safetensors"):
        assert (
            run_cli(
                capsys, "data", "capture", "--config", "tiny-medusa1", f"target={target}", f"data.path={chats}", "data.eval_size=1", "--out", features
            )[0]
            == 0
        )
    assert not list(features.glob("*.tmp"))


def test_paths_that_cannot_be_used(tmp_path, capsys, tiny_run):
    """--out under a file; data.path a folder of JSONL files; export of a run folder."""
    _, chats, run, _ = tiny_run
    note = tmp_path / "afile"
    note.write_text("mine")
    folder = tmp_path / "jsonl"
    folder.mkdir()
    copied(chats, folder)
    with unchanged(tmp_path, run):
        assert_refused(*run_cli(capsys, "export", run / "final", "--format", "medusa", "--out", note / "sub"), f"{note} is a file, not a folder")
        assert_refused(*run_cli(capsys, "data", "inspect", "--source", "file", "--path", folder), str(folder), "save_to_disk", "join them into one")
        assert_refused(*run_cli(capsys, "export", run, "--format", "medusa", "--out", tmp_path / "x"), "a training run's folder", str(run / "final"))


# ---------------------------------------------------------------------------------------------- issue 54: --overwrite and resumes


def test_overwrite_never_deletes_files_no_drafthead_command_wrote(tmp_path, capsys, tiny_run):
    """--overwrite over a user's text file, a folder of their work, a folder of photos, or a
    drafthead output they added a file to: one line naming a file it would delete, nothing
    changed. What drafthead wrote is still replaced (the tests above)."""
    from drafthead.inference.bench.report import report_json

    target, chats, run, features = tiny_run
    run, features = copied(run, tmp_path), copied(features, tmp_path)
    head = medusa_head_dir(tmp_path / "head")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    precious = tmp_path / "precious"
    (precious / "sub").mkdir(parents=True)
    (precious / "thesis.txt").write_text("four years")
    (precious / "sub" / "data.bin").write_bytes(b"\0" * 8)
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("a.jpg", "b.jpg"):
        (photos / name).write_bytes(b"\xff\xd8 a photo")
    (run / "checkpoints" / "holiday.jpg").write_bytes(b"\xff\xd8 a photo")
    (features / "holiday.jpg").write_bytes(b"\xff\xd8 a photo")
    capture = ["data", "capture", "--config", "tiny-medusa1", f"target={target}", f"data.path={chats}", "data.eval_size=1"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with unchanged(tmp_path):
        assert_refused(
            *run_cli(capsys, "export", head, "--format", "medusa", "--out", notes, "--overwrite"),
            f"export folder {notes} is a file that no drafthead command wrote there: --overwrite would delete it",
        )
        assert_refused(
            *run_cli(capsys, "data", "regenerate", "--target", target, "--source", "json", "--path", chats, "--out", precious, "--overwrite"),
            f"output {precious} holds sub/data.bin and 1 more file that no drafthead command wrote there",
        )
        assert_refused(*run_cli(capsys, *tiny_train(target, chats, photos, "--overwrite")), f"{photos} holds a.jpg and 1 more file that no drafthead")
        assert_refused(*run_cli(capsys, *capture, "--out", photos, "--overwrite"), "holds a.jpg and 1 more file that no drafthead")
        assert_refused(*run_cli(capsys, *tiny_train(target, chats, run, "--overwrite")), f"{run} holds checkpoints/holiday.jpg that no drafthead")
        assert_refused(*run_cli(capsys, *capture, "--out", features, "--overwrite"), f"{features} holds holiday.jpg that no drafthead")
        assert_refused(
            *run_cli(capsys, "bench", "--target", "nothing", "--dataset", prompts, "--out", notes, "--overwrite"), "is a file that no drafthead"
        )
    (tmp_path / "again").mkdir()
    resumed = copied(tiny_run[2], tmp_path / "again")
    (resumed / "final" / "notes.txt").write_text("mine")  # the run ends by replacing final/: refused at its start
    with unchanged(resumed):
        assert_refused(
            *run_cli(capsys, *tiny_train(target, chats, resumed, "max_steps=3", "checkpoint_every=1"), "--resume"),
            f"{resumed / 'final'} holds notes.txt that no drafthead command wrote there",
        )
    report = tmp_path / "report.json"
    report.write_text(report_json({"num_prompts": 1}))  # one bench wrote: replaceable, the run goes on to its target
    assert_refused(*run_cli(capsys, "bench", "--target", "nothing", "--dataset", prompts, "--out", report, "--overwrite"), "unknown target 'nothing'")


def test_resume_refuses_data_whose_content_changed(tmp_path, capsys, tiny_llama_dir):
    """train --resume over the same data.path whose content changed since the checkpoint: one
    line, before the target loads; with the data as it was, the run resumes."""
    from drafthead.train.data.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 8)
    run = tmp_path / "run"
    assert run_cli(capsys, *tiny_train(tiny_llama_dir, chats, run, "max_steps=1", "checkpoint_every=1"))[0] == 0
    original = chats.read_text()
    chats.write_text(original.replace("tiny-0", "edited"))
    with unchanged(run):
        assert_refused(
            *run_cli(capsys, *tiny_train(tiny_llama_dir, chats, run, "max_steps=2", "checkpoint_every=1"), "--resume"),
            f"--resume: the content of {chats} changed since {run / 'checkpoints' / 'step-00000001'} was written",
            "init_from",
        )
    chats.write_text(original)
    code, err = run_cli(capsys, *tiny_train(tiny_llama_dir, chats, run, "max_steps=2", "checkpoint_every=1"), "--resume")
    assert code == 0, err
