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
import torch
import yaml

from drafthead import cli
from drafthead.heads import build_head, make_config
from drafthead.heads.outdir import fresh_folder
from drafthead.train.checkpoint import RUN_CONFIG_FILE, latest_checkpoint
from drafthead.train.config import check_resume, resume_changes
from drafthead.train.trainer import Trainer, TrainData
from test_trainer import DummyHead, config, random_samples
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


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, *fragments: str) -> str:
    """Exit 2, one `drafthead: error:` line holding every fragment, no traceback."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert lines and lines[-1].startswith("drafthead: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


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
    out.mkdir()
    (out / "stale.bin").write_bytes(b"old")
    with pytest.raises(ValueError, match="--overwrite"):
        with fresh_folder(out):
            pass
    with fresh_folder(out, overwrite=True) as tmp:
        (tmp / "new.bin").write_bytes(b"new")
    assert sorted(p.name for p in out.iterdir()) == ["new.bin"]  # the stale file went with the old folder
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


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
    cfg = config(tmp_path, max_steps=2, checkpoint_every=0, eval_every=0, log_every=1)
    Trainer(cfg, DummyHead(), TrainData(train=random_samples(16))).fit(progress=False)
    (Path(cfg.output_dir) / "stale.txt").write_text("old")
    Trainer(cfg, DummyHead(), TrainData(train=random_samples(16))).fit(progress=False, overwrite=True)
    out = Path(cfg.output_dir)
    assert not (out / "stale.txt").exists()
    starts = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("event") == "start" for r in starts) == 1  # one run's log, not two


def test_export_refuses_a_non_empty_folder_and_overwrite_leaves_no_stale_file(tmp_path, capsys):
    """Issue 28 cases 4 and 7: an export over an earlier one, whose stale files would be read."""
    head = medusa_head_dir(tmp_path / "head")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier export")
    with unchanged(out, head):
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", out), str(out), "--overwrite")
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", head), "source folder itself")
    code, err = run_cli(capsys, "export", head, "--format", "medusa", "--out", out, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "medusa_lm_head.pt"]
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

    import drafthead.train.tiny as tiny

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
    saved = {"lr": 0.001, "log_every": 10, "data": {"path": "a.jsonl", "limit": None, "num_proc": None},
             "head": {"kind": "medusa1", "num_heads": 3}}
    now = {"lr": 0.1, "log_every": 1, "data": {"path": "b.jsonl", "limit": None, "num_proc": 4},
           "head": {"kind": "medusa1"}}
    refused, applied = resume_changes(saved, now)
    assert refused == ["data.path: 'a.jsonl' -> 'b.jsonl'", "head.num_heads: 3 -> '<unset>'", "lr: 0.001 -> 0.1"]
    assert applied == ["data.num_proc: None -> 4", "log_every: 10 -> 1"]
    assert resume_changes(saved, saved) == ([], [])


@pytest.mark.parametrize("override,field", [("lr=0.1", "lr: 0.03 -> 0.1"), ("batch_size=2", "batch_size: 4 -> 2"),
                                            ("data.path=other.jsonl", "data.path: None -> 'other.jsonl'")])
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
    older = {k: v for k, v in cfg.to_dict().items() if k != "shard_target"}  # a field added later, at its default
    assert check_resume(older, cfg, "here") == []


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    out, saved = trained_run(tmp_path)
    with unchanged(out):
        assert_refused(*run_cli(capsys, "train", "--config", saved, "--resume", "--overwrite"), "pass one")


# ---------------------------------------------------------------------------------------------- data commands


def test_regenerate_refuses_a_file_it_did_not_write(tmp_path, capsys):
    """--out pointed at the user's own data file: refused before the target loads."""
    from drafthead.train.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 3)
    with unchanged(chats):
        assert_refused(*run_cli(capsys, "data", "regenerate", "--target", "nothing", "--source", "json", "--path", chats,
                                "--out", chats), "not a `data regenerate` output", "--overwrite")


def test_regenerate_with_no_answer_exits_2_and_writes_nothing(tmp_path, capsys, monkeypatch, tiny_llama_dir, isolated_cache):
    """Issue 28: a target that answers nothing wrote 0 records and exited 0."""
    import drafthead.train.regenerate as regenerate
    from drafthead.train.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 2)
    monkeypatch.setattr(regenerate, "answer", lambda model, tokenizer, prompts, **kw: [regenerate.Answer("", True)] * len(prompts))
    out = tmp_path / "regen.jsonl"
    code, err = run_cli(capsys, "data", "regenerate", "--target", tiny_llama_dir, "--source", "json", "--path", chats,
                        "--out", out, "--max-new-tokens", "2", "--batch-size", "2")
    assert_refused(code, err, "no record written", "empty_answers=2")
    assert not out.exists()


def test_regenerate_overwrite_and_continue(tmp_path, capsys, monkeypatch, tiny_llama_dir, isolated_cache):
    """--overwrite replaces a file regenerate did not write; a rerun continues its own file."""
    import drafthead.train.regenerate as regenerate
    from drafthead.train.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 2)
    out = tmp_path / "regen.jsonl"
    out.write_text('{"some": "user data"}\n')
    monkeypatch.setattr(regenerate, "answer", lambda model, tokenizer, prompts, **kw: [regenerate.Answer("fine", True)] * len(prompts))
    argv = ["data", "regenerate", "--target", tiny_llama_dir, "--source", "json", "--path", chats, "--out", out,
            "--max-new-tokens", "2", "--batch-size", "2"]
    assert run_cli(capsys, *argv, "--overwrite")[0] == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
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
    import drafthead.train.run as run

    cfg = config(tmp_path, target=str(tiny_llama_dir))
    saved = tmp_path / "run.yaml"
    saved.write_text(yaml.safe_dump(cfg.to_dict()))
    out = tmp_path / "features"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    seen = []

    def capture(config, model, tokenizer, out_dir, **kw):  # what the real capture finds on entry
        seen.append(sorted(p.name for p in Path(out_dir).iterdir()) if Path(out_dir).exists() else [])
        return Path(out_dir) / "index.json"

    monkeypatch.setattr(run, "capture_from_config", capture)
    assert run_cli(capsys, "data", "capture", "--config", saved, "--out", out, "--overwrite")[0] == 0
    assert seen == [[]] and not (out / "notes.txt").exists()


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
        assert_refused(*run_cli(capsys, "generate", "--target", target_copy, "--prompt", "hi"),
                       str(target_copy), "truncated or corrupt", "again")


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
        assert_refused(*run_cli(capsys, "import", cut, "--target", tiny_llama_dir, "--out", tmp_path / "imported"),
                       str(cut), "truncated")
    assert not (tmp_path / "imported").exists()
    assert not list(isolated_cache.rglob("*.safetensors"))  # nothing cached from it


def test_gpt2_target_with_an_eagle3_config_names_the_kinds_that_fit(tmp_path, capsys, isolated_cache):
    from transformers import GPT2Config, GPT2LMHeadModel

    from drafthead.train.tiny import tiny_tokenizer, write_tiny_jsonl

    tok = tiny_tokenizer()
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=128,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).save_pretrained(gpt2)
    tok.save_pretrained(gpt2)
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 8)
    with unchanged(tmp_path):
        code, err = run_cli(capsys, "train", "--config", "tiny-eagle3", f"target={gpt2}", f"data.path={chats}",
                            f"output_dir={tmp_path / 'run'}", "max_steps=1")
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
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", tmp_path / "x"),
                       str(head / "config.json"), "not UTF-8")


def test_head_config_json_that_is_not_an_object(tmp_path, capsys):
    head = medusa_head_dir(tmp_path / "head")
    (head / "config.json").write_text("[1, 2]")
    with unchanged(tmp_path):
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", tmp_path / "x"),
                       str(head / "config.json"), "not an object")


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
        line = assert_refused(*run_cli(capsys, "generate", "--target", target_copy, "--prompt", "hi"),
                              str(target_copy), "no tokenizer", "save_pretrained")
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
        assert_refused(*run_cli(capsys, "export", head, "--format", "medusa", "--out", locked / "out"),
                       str(locked), "Permission denied", "permissions")


def test_read_only_checkpoint_folder(tmp_path, capsys, monkeypatch, tiny_llama_dir, isolated_cache):
    from drafthead.train.tiny import write_tiny_jsonl

    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 8)
    run_dir = tmp_path / "run"
    refuse_writes_under(monkeypatch, run_dir / "checkpoints")
    code, err = run_cli(capsys, "train", "--config", "tiny-medusa1", f"target={tiny_llama_dir}", f"data.path={chats}",
                        f"output_dir={run_dir}", "max_steps=1", "checkpoint_every=1", "eval_every=0", "data.eval_size=1")
    assert_refused(code, err, str(run_dir / "checkpoints"), "Permission denied")
    assert not (run_dir / "final").exists()


def test_traceback_on_request(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1\n")
    monkeypatch.setenv("DRAFTHEAD_TRACEBACK", "1")
    with pytest.raises(ValueError, match="not valid YAML"):
        cli.main(["train", "--config", str(bad)])


def test_words_after_options(capsys):
    """Overrides may follow options; an unknown option or a word that is no override is still an error."""
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "--config", "tiny-medusa1", "--resume", "--bogus"])
    assert stop.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert_refused(*run_cli(capsys, "train", "--config", "tiny-medusa1", "--resume", "oops"), "'oops' is not key=value")


@pytest.mark.parametrize("damaged", ["trainable.safetensors", "optimizer.pt"])
def test_damaged_checkpoint_on_resume(tmp_path, capsys, damaged):
    out, saved = trained_run(tmp_path)
    broken = latest_checkpoint(out) / damaged
    broken.write_bytes(broken.read_bytes()[:100])
    with unchanged(out):
        with pytest.raises(ValueError, match=r"step-00000002 is truncated or corrupt.*delete it"):
            cfg = config(tmp_path, max_steps=4, checkpoint_every=2, eval_every=0)
            Trainer(cfg, DummyHead(), TrainData(train=random_samples(16))).fit(progress=False, resume=True)


def test_python_m_drafthead_train_reports_the_same_way(tmp_path):
    """`python -m drafthead train` (what `accelerate launch -m drafthead train` runs): one line, exit 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1\n")
    out = subprocess.run([sys.executable, "-m", "drafthead", "train", "--config", str(bad)], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("drafthead: error: ") and len(out.stderr.splitlines()) == 1


def test_damaged_captured_shard_and_index(tmp_path):
    from safetensors.torch import save_file

    from drafthead.train.features import FORMAT_VERSION, INDEX_FILE, CapturedFeatures

    folder = tmp_path / "features"
    folder.mkdir()
    shard = folder / "shard-00000.safetensors"
    save_file({"offsets": torch.tensor([0, 4]), "input_ids": torch.arange(4), "loss_mask": torch.ones(4, dtype=torch.bool),
               "hidden.1": torch.zeros(4, 8)}, str(shard))
    index = {"version": FORMAT_VERSION, "layers": [1], "hidden_size": 8, "shards": [{"file": shard.name, "num_samples": 1}]}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    assert CapturedFeatures(folder)[0]["input_ids"].tolist() == [0, 1, 2, 3]  # whole, it reads
    shard.write_bytes(shard.read_bytes()[:-10])
    with unchanged(folder):
        with pytest.raises(ValueError, match="shard-00000.safetensors is truncated or corrupt.*rerun"):
            CapturedFeatures(folder)[0]
    (folder / INDEX_FILE).write_bytes(b"\xff" + json.dumps(index).encode())
    with unchanged(folder):
        with pytest.raises(ValueError, match=f"{INDEX_FILE} is not UTF-8"):
            CapturedFeatures(folder)
