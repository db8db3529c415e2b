"""`drafthead data capture` and `data regenerate` as two processes (docs/launching.md "Data work on
several processes"): the same shards, index and greedy answers as one process, byte for byte, and a
rerun after a rank died finishes the job without redoing what was finished.

Each `accelerate launch` of two CPU processes costs ~10-15 s of imports on this machine, so the
file launches twice: once with rank 1 killed (SIGKILL) after its first shard, once to rerun the
capture and to regenerate. A regenerate killed mid-way is simulated in this process with two
threads (WorkShare over a threading.Barrier), which runs the same code between the barriers.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from drafthead.cli import main
from drafthead.train.capture.workshare import WorkShare
from drafthead.train.regeneration.regenerate import RegenerateSettings, done_ids, merge_parts, part_files, part_path, regenerate
from drafthead.train.data.tiny import write_tiny_jsonl
from tests.launch import accelerate_launch, run_group

pytestmark = pytest.mark.subprocess  # starts processes of its own (pyproject.toml markers)

REPO = Path(__file__).resolve().parent.parent

# Runs each argv list through the CLI; rank KILL_RANK SIGKILLs itself as it starts its second
# shard, i.e. right after its first shard is on disk.
LAUNCHED = """
import json, os, signal, sys
from drafthead.cli import main
from drafthead.train.capture import features

if os.environ.get("KILL_RANK") == os.environ["RANK"]:
    real, calls = features._capture_shard, []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    features._capture_shard = dying
for argv in json.loads(sys.argv[1]):
    rc = main(argv)
    if rc:
        sys.exit(rc)
"""


def _launch(tmp_path: Path, runs: list[list[str]], **env) -> subprocess.CompletedProcess:
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    cmd = [
        *accelerate_launch(),
        str(script),
        json.dumps(runs),
    ]
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **env)
    return run_group(cmd, 150, cwd=REPO, env=env)


def _stamps(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob("shard-*.safetensors")}


@pytest.fixture(scope="module")
def target(tiny_target_dir) -> Path:
    return tiny_target_dir("llama", hidden=64)  # wider than the default: more varied greedy answers


def test_two_processes_write_what_one_does_and_a_killed_rank_reruns(tmp_path, target, isolated_cache):
    chats = write_tiny_jsonl(tmp_path / "chats.jsonl", 40)

    def capture(out):  # 40 samples, 5 shards of 8, batches of 4
        return [
            "data",
            "capture",
            "--config",
            "tiny-eagle3",
            f"target={target}",
            f"data.path={chats}",
            f"output_dir={tmp_path / 'run'}",
            "threads=1",
            "features.shard_samples=8",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]

    def regen(out):  # 16 conversations (24 turns), 8 batches of 2
        return [
            "data",
            "regenerate",
            "--target",
            str(target),
            "--source",
            "json",
            "--path",
            str(chats),
            "--limit",
            "16",
            "--max-new-tokens",
            "6",
            "--batch-size",
            "2",
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]

    one, two = tmp_path / "one", tmp_path / "two"
    threads = torch.get_num_threads()
    try:  # one process (this one), one thread like each launched process: the same float rounding
        assert main(capture(one)) == 0
        assert main(regen(tmp_path / "one.jsonl")) == 0
    finally:
        torch.set_num_threads(threads)

    killed = _launch(tmp_path, [capture(two)], KILL_RANK="1")
    assert killed.returncode != 0
    # missing shards 0..4 dealt round-robin: rank 1 wrote shard 1 and died starting shard 3
    assert (two / "shard-00001.safetensors").exists() and not (two / "shard-00003.safetensors").exists(), (
        killed.stdout[-3000:] + killed.stderr[-3000:]
    )
    assert not (two / "index.json").exists()
    finished = _stamps(two)

    proc = _launch(tmp_path, [capture(two), regen(tmp_path / "two.jsonl")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {name: _stamps(two)[name] for name in finished} == finished  # finished shards were not rewritten
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())  # no temp file left
    for name in sorted(p.name for p in one.iterdir()):  # shards, index.json, capture.json
        assert (two / name).read_bytes() == (one / name).read_bytes(), name

    reference = (tmp_path / "one.jsonl").read_text()
    assert len(reference.splitlines()) == 16
    assert (tmp_path / "two.jsonl").read_text() == reference  # same answers, same order
    assert part_files(tmp_path / "two.jsonl") == []
    out = proc.stdout + proc.stderr
    assert out.count("written=16") == 1  # the job's report, printed by the main process alone


def _thread_shares(world: int) -> tuple[list[WorkShare], threading.Barrier]:
    """WorkShares for `world` threads of this process: a rank that dies aborts the barrier, as a
    killed process's closed connections fail the others' gloo barrier."""
    barrier = threading.Barrier(world, timeout=60)
    slots: list = [None] * world

    def share(rank: int) -> WorkShare:
        def gather(obj):
            slots[rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        return WorkShare(rank, world, barrier.wait, gather)

    return [share(r) for r in range(world)], barrier


class Killed(Exception):
    pass


class DiesAfterFirstBatch(torch.nn.Module):
    """The target, until its rank's part file holds a record: then the process 'dies'."""

    def __init__(self, model, part: Path):
        super().__init__()
        self.model, self.config, self.part = model, model.config, part

    def generate(self, **kwargs):
        if self.part.exists() and self.part.stat().st_size:
            raise Killed
        return self.model.generate(**kwargs)


def _run_ranks(models, tokenizer, convs, out, **kwargs) -> list:
    shares, barrier = _thread_shares(len(models))
    results: list = [None] * len(models)

    def work(rank):
        try:
            results[rank] = regenerate(models[rank], tokenizer, convs, out, share=shares[rank], progress=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - the test looks at what each rank raised
            results[rank] = e
            barrier.abort()

    ts = [threading.Thread(target=work, args=(r,)) for r in range(len(models))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


def test_regenerate_rerun_after_a_rank_died_gives_the_clean_answers(tmp_path, target):
    """Two ranks, rank 1 dies after its first batch; rerun as two ranks, or as one process: both
    keep every finished record and write the file a clean single process writes."""
    from drafthead.ground.target.load import load_target
    from drafthead.train.data.sources import load_conversations

    loaded = load_target(str(target), dtype="float32", device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    convs = list(load_conversations("json", str(write_tiny_jsonl(tmp_path / "c.jsonl", 12)), use_cache=False)[0])
    kw = dict(settings=RegenerateSettings(max_new_tokens=5, batch_size=2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads of work on two cores
    try:
        regenerate(model, tok, convs, tmp_path / "one.jsonl", progress=False, **kw)

        out = tmp_path / "two.jsonl"
        first = _run_ranks([model, DiesAfterFirstBatch(model, part_path(out, 1, 2))], tok, convs, out, **kw)
        assert isinstance(first[1], Killed) and isinstance(first[0], threading.BrokenBarrierError)
        # 6 batches dealt round-robin: rank 0 answered its 3, rank 1 its first one before dying
        assert not out.exists() and len(done_ids(part_path(out, 1, 2))) == 2
        assert len(done_ids(part_path(out, 0, 2))) == 6
        kept = part_path(out, 1, 2).read_bytes()
        alone = tmp_path / "alone" / "two.jsonl"  # the same leftovers, rerun as one process
        alone.parent.mkdir()
        for part in part_files(out):
            (alone.parent / part.name).write_bytes(part.read_bytes())

        second = _run_ranks([model, model], tok, convs, out, **kw)
        third = regenerate(model, tok, convs, alone, progress=False, **kw)
    finally:
        torch.set_num_threads(threads)
    assert third.already_done == 8 and third.written == 4
    assert alone.read_bytes() == (tmp_path / "one.jsonl").read_bytes() and part_files(alone) == []
    assert second[0] == second[1]  # every rank returns the job's report
    assert second[0].already_done == 8 and second[0].written == 4  # the 2 batches left, one per rank
    assert kept in out.read_bytes()  # the dead rank's records were kept, not answered again
    assert out.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert part_files(out) == []


def test_merge_keeps_the_output_first_each_id_once_in_input_order(tmp_path):
    out = tmp_path / "out.jsonl"
    line = lambda i, v="": json.dumps({"id": i, "v": v}) + "\n"  # noqa: E731
    out.write_text(line("x") + line("c", "output's"))  # "x": not in this input (an earlier one)
    part_path(out, 0, 2).write_text(line("d") + line("a"))
    part_path(out, 1, 2).write_text(line("b") + line("c", "part's") + '{"id": "e", "v"')  # torn by a kill
    part_path(out, 0, 1).write_text(line("f"))  # a part of another world size
    assert len(part_files(out)) == 3 and part_files(tmp_path / "other.jsonl") == []
    assert merge_parts(out, ["a", "b", "c", "d", "e", "f"]) == 6
    assert out.read_text() == line("x") + line("a") + line("b") + line("c", "output's") + line("d") + line("f")
    assert part_files(out) == []
