"""Self-distillation data: the target re-answers every user turn of a conversation set.

A draft head learns to predict the *target's* continuations; ShareGPT's answers come from other
models, so training on the target's own answers raises acceptance (Medusa-2's self-distillation,
EAGLE's "fixed dataset vs regenerated" ablation). Multi-turn conversations are answered turn by
turn: turn k's prompt holds the target's own answers to turns 1..k-1.

Output: OpenAI-form JSONL, one `{"id", "messages", "generation"}` record per conversation, in the
form `train/data/sources.py` reads back. Each answer keeps the ids the target produced (`token_ids` on
its message, the stop token left out) and its text is those ids decoded as they are: training
labels the answer with these ids (train/data/chat_format.py), since re-tokenizing the text need not
give them back. The report counts the answers where it would not (`ids_retokenize_differ`).

Resumable: ids already in the file are skipped; each record is written and flushed as soon as its
batch finishes, so an interruption loses at most one batch. A torn last line (killed mid-write)
is cut off before appending; a broken line before the last is refused (a hand edit), never
skipped with what follows it. A rerun continues only a file written the same way: every record's
`generation` block (the target, the sampling settings, the engine, the data file's content)
must equal this run's, else it is refused with the differences (check_continuation).

Batches are cut from the whole input in order, then the finished conversations are dropped from
them: a resumed run answers in the batches a clean run would have, so its greedy answers are the
clean run's (batch composition changes padding, hence float rounding).

Several processes (`accelerate launch`, `torchrun`): the batches left are dealt round-robin; rank
r of w appends its records to `<out stem>.rank-r-of-w<suffix>` beside the output, and the main
rank folds the part files into the output, in input order, once all ranks are done. The same
batches as one process, so the same greedy answers (docs/launching.md "Data work on several
processes"). A rerun after a rank died reads the part files' ids as done too.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ...ground.target.chat import render_chat
from ...inference.engine.sampling import SamplingConfig
from ..data.chat_format import decode_answer, stop_token_ids
from ..capture.features import plan_changes
from ..capture.workshare import WorkShare, write_atomically


RECORD_START = b'{"id": '  # json.dumps of a record whose first key is its id (is_regenerated)


@dataclass
class RegenerateReport:
    already_done: int = 0  # ids found in the output file
    written: int = 0  # records appended now
    turns_answered: int = 0
    answers_cut: int = 0  # stopped by max_new_tokens, not by an end-of-turn token
    empty_answers: int = 0  # the conversation stops before such a turn
    prompts_too_long: int = 0  # the conversation stops before such a turn
    skipped_no_answer: int = 0  # conversations that ended with no answered turn
    answer_tokens: int = 0  # tokens in the answers written (the served count when no ids came back)
    answers_with_ids: int = 0  # answers stored with the target's own token ids
    ids_retokenize_differ: int = 0  # of those, answers whose text re-tokenized gives other ids
    answers_without_ids: int = 0  # the server returned no ids: text only, re-tokenized in training
    prompt_tokens_differ: int = 0  # the server counted a prompt otherwise than our template + tokenizer

    def to_dict(self):
        return asdict(self)

    def summary(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.to_dict().items())

    @classmethod
    def combine(cls, reports: Sequence["RegenerateReport"]) -> "RegenerateReport":
        """The report of a job from its ranks' reports: counts add up; every rank read the same
        done ids, so already_done is any one's."""
        total = cls(**{f.name: sum(getattr(r, f.name) for r in reports) for f in fields(cls)})
        total.already_done = reports[0].already_done
        return total


def _records(data: bytes, where: Path | None = None) -> tuple[list[tuple[str, bytes]], int]:
    """([(id, line with its newline)], end of the last good line); blank lines are skipped. The
    last line may be torn by a kill (no trailing newline, bad JSON or no id): it is left out. A
    broken line before the last is ValueError naming `where` (records after it are never dropped
    unsaid)."""
    records: list[tuple[str, bytes]] = []
    good_end = pos = 0
    number = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            break  # last line without newline: torn
        number += 1
        line = data[pos:nl]
        if line.strip():
            try:
                records.append((str(json.loads(line)["id"]), data[pos : nl + 1]))
            except (ValueError, KeyError, TypeError):
                if data[nl + 1 :].strip():
                    raise ValueError(
                        f"{where}: line {number} is not a record with an id ({line[:60]!r}), and records follow it: "
                        "mend or delete that line, then run again"
                    ) from None
                break  # the last line, torn
        pos = good_end = nl + 1
    return records, good_end


def done_ids(path: Path, *, repair: bool = True) -> set[str]:
    """Ids already written; repairs a torn last line (no trailing newline / bad JSON) by cutting
    it. repair=False only reads (a file another process may append to)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    records, good_end = _records(data, path)
    if repair and good_end < len(data):
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return {id_ for id_, _ in records}


def is_regenerated(path: Path) -> bool:
    """Whether the file at `path` is `regenerate`'s own output (so a rerun may continue it, and
    --overwrite replace it): its first whole record has a `generation` block, or, torn by a kill
    before any line ended, it starts the way every record does and is not whole JSON (a user's
    one record without a newline is whole)."""
    data = path.read_bytes() if path.is_file() else b""
    records, _ = _records(data[: data.find(b"\n") + 1])  # the first line decides (none: torn before it ended)
    if records:
        return "generation" in json.loads(records[0][1])
    try:
        whole = json.loads(data)
    except ValueError:
        return data.lstrip().startswith(RECORD_START)
    return isinstance(whole, dict) and "generation" in whole


def part_path(out_path: Path, rank: int, world: int) -> Path:
    """Where rank `rank` of `world` appends its records: `out.jsonl` -> `out.rank-1-of-2.jsonl`."""
    return out_path.with_name(f"{out_path.stem}.rank-{rank}-of-{world}{out_path.suffix}")


def part_files(out_path: Path) -> list[Path]:
    """The part files beside `out_path`, of any world size (a killed run leaves them), by name."""
    if not out_path.parent.exists():
        return []
    name = re.compile(re.escape(out_path.stem) + r"\.rank-\d+-of-\d+" + re.escape(out_path.suffix))
    return sorted(p for p in out_path.parent.iterdir() if name.fullmatch(p.name))


def merge_parts(out_path: Path, order: Sequence[str]) -> int:
    """Fold the part files into `out_path`, then delete them: the records of both, each id once
    (the output's copy first), sorted by position in `order` (the input's ids; ids not in it first,
    in file order). Lines are copied as they are. Returns the number of records in the output.
    Killed between the rename and the deletes, a rerun folds the same parts again to the same file."""
    parts = part_files(out_path)
    records: dict[str, bytes] = {}
    for path in [out_path, *parts]:
        if path.exists():
            for id_, line in _records(path.read_bytes(), path)[0]:
                records.setdefault(id_, line)
    position = {id_: i for i, id_ in enumerate(order)}
    merged = sorted(records.items(), key=lambda item: position.get(item[0], -1))  # stable
    write_atomically(out_path, b"".join(line for _, line in merged))
    for path in parts:
        path.unlink()
    return len(merged)


def _split_turns(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """(leading system messages, user contents in order)."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    return system, users


@dataclass(frozen=True)
class Answer:
    """One answered turn: its text, whether a stop token ended it (else max_new_tokens cut it) and
    the ids the target produced, the stop token left out (None: not known, e.g. a server that
    returns none). reasoning: a reasoning text a server returned apart from the answer."""

    text: str
    ended: bool
    token_ids: list[int] | None = None
    reasoning: str | None = None
    served_tokens: int | None = None  # the server's count of answer tokens (usage), when it has no ids


def strip_stop(ids: list[int], stop_ids: Sequence[int]) -> list[int]:
    """The answer's ids up to its first stop token: the stop token is the template's, not the answer's."""
    hits = [i for i, t in enumerate(ids) if t in stop_ids]
    return list(ids[: hits[0]]) if hits else list(ids)


def add_turn(history: list[dict], user: str, reply: Answer, tokenizer, report: RegenerateReport) -> bool:
    """Append one user turn and its answer to `history`, counting it in `report`; False (nothing
    appended) for an empty answer, which ends its conversation."""
    if not reply.text.strip():
        report.empty_answers += 1
        return False
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.token_ids is not None:
        message["token_ids"] = reply.token_ids
        report.answers_with_ids += 1
        report.ids_retokenize_differ += tokenizer(reply.text, add_special_tokens=False)["input_ids"] != reply.token_ids
        report.answer_tokens += len(reply.token_ids)
    else:
        report.answers_without_ids += 1
        report.answer_tokens += reply.served_tokens or 0
    history += [{"role": "user", "content": user}, message]
    report.turns_answered += 1
    report.answers_cut += not reply.ended
    return True


@dataclass(frozen=True)
class RegenerateSettings:
    """How every turn is answered, as each record's `generation` block states it (with the target
    and the engine); checked when made."""

    max_new_tokens: int = 512
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    batch_size: int = 8  # conversations answered together
    max_prompt_tokens: int | None = None  # a longer prompt ends its conversation (None: the model's context)
    max_turns: int | None = None  # user turns answered per conversation (None: all)
    seed: int = 0
    target_name: str | None = None  # recorded only
    data_sha256: str | None = None  # the content of the conversations' file (train/data/sources.py data_fingerprint), recorded

    def __post_init__(self) -> None:
        SamplingConfig(temperature=self.temperature, top_p=self.top_p)  # the checks of every sampler: nan, < 0, top_p past 1
        for name in ("max_new_tokens", "batch_size", "max_prompt_tokens", "max_turns"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}")

    def generation(self, engine: str = "local") -> dict:
        """The `generation` block of every record: what decides its answers. engine: `local` (our
        engine or transformers' generate(): the same answers under greedy) or `server MODEL`."""
        return {
            "target": self.target_name,
            "engine": engine,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "max_turns": self.max_turns,
            "max_prompt_tokens": self.max_prompt_tokens,
            "data_sha256": self.data_sha256,
        }


def check_continuation(paths: Sequence[Path], generation: dict) -> None:
    """Refuse to append answers made with `generation` to files whose records were made otherwise
    (another target, engine, sampling or data): ValueError listing what differs, as a rerun of
    `data capture` does (train/capture/features.py plan_changes)."""
    for path in dict.fromkeys(paths):
        if not path.exists():
            continue
        seen: set[str] = set()
        for _, line in _records(path.read_bytes(), path)[0]:
            then = json.loads(line).get("generation")
            key = json.dumps(then, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            changed = plan_changes(then if isinstance(then, dict) else {}, generation)
            if changed:
                raise ValueError(
                    f"{path} holds answers made otherwise ({'; '.join(changed)}): continue it with the same "
                    "settings, pass --overwrite to answer again from scratch, or use another --out"
                )


@torch.no_grad()
def answer(
    model,
    tokenizer,
    prompts: list[str],
    settings: RegenerateSettings,
    *,
    stop_ids: list[int],
    pad_id: int,
    drafter=None,
    sizing: str = "fixed",
    seed: int = 0,
) -> list[Answer]:
    """Batched generation -> one Answer per prompt: transformers `generate()` with
    left padding, or, given a drafter, our batched speculative decoding (the same answers under
    greedy, the same distribution under sampling; docs/trees.md "Batches"), each round's trees
    sized by `sizing` (inference/engine/sizing.py: policy, the load policy, chooses the draft nodes)."""
    if drafter is not None:
        return _answer_speculative(model, tokenizer, prompts, drafter, settings, stop_ids=stop_ids, seed=seed, sizing=sizing)
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False, padding_side="left")
    device = next(model.parameters()).device
    kwargs = dict(max_new_tokens=settings.max_new_tokens, pad_token_id=pad_id, eos_token_id=stop_ids)
    if settings.temperature > 0:
        kwargs.update(do_sample=True, temperature=settings.temperature, top_p=settings.top_p)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device), **kwargs)
    new = out[:, enc["input_ids"].shape[1] :].cpu()
    return [_answer_of(tokenizer, row.tolist(), stop_ids) for row in new]


def _answer_of(tokenizer, ids: list[int], stop_ids: Sequence[int]) -> Answer:
    """The Answer of a row of new ids: up to its first stop token (a finished row of a batch is
    padded after it), the text decoded from them."""
    own = strip_stop(ids, stop_ids)
    return Answer(decode_answer(tokenizer, own), len(own) < len(ids), own)


def _answer_speculative(model, tokenizer, prompts, drafter, settings: RegenerateSettings, *, stop_ids, seed, sizing: str = "fixed"):
    from ...inference.engine.generate import GenerationConfig, generate_batch
    from ...inference.engine.sampling import SamplingConfig

    device = next(model.parameters()).device
    encoded = [torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"], device=device) for p in prompts]
    sampling = SamplingConfig(temperature=settings.temperature, top_p=settings.top_p) if settings.temperature > 0 else SamplingConfig()
    config = GenerationConfig(max_new_tokens=settings.max_new_tokens, sampling=sampling, eos_token_ids=tuple(stop_ids), seed=seed, sizing=sizing)
    result = generate_batch(model, drafter, encoded, config)
    return [_answer_of(tokenizer, row.new_tokens[0].tolist(), stop_ids) for row in result.rows]


@dataclass
class _Answerer:
    """Answers a batch of conversations turn by turn: the model, its drafter and what every turn
    needs (stop ids, pad id, the prompt length limit), found once per run."""

    model: object
    tokenizer: Any  # the target's (transformers) tokenizer
    settings: RegenerateSettings
    drafter: object = None
    sizing: str = "fixed"

    def __post_init__(self):
        self.stop_ids = stop_token_ids(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.limit = self.settings.max_prompt_tokens or getattr(self.model.config, "max_position_embeddings", None)

    def conversations(self, batch: list[dict], report: RegenerateReport) -> list[list[dict]]:
        """Each conversation's messages with the target's answers: its system message, then a user
        turn and its answer per turn, up to the first turn that could not be answered."""
        seed = self.settings.seed + zlib.crc32(str(batch[0]["id"]).encode())
        torch.manual_seed(seed)  # seeded by the batch's first id: reruns of the same batch sample the same answers
        turns = [_split_turns(c["messages"]) for c in batch]
        history = [list(system) for system, _ in turns]
        users = [u[: self.settings.max_turns] if self.settings.max_turns else u for _, u in turns]
        open_ = [True] * len(batch)
        for k in range(max(len(u) for u in users)):
            active, prompts = self._prompts(history, users, k, open_, report)
            if not active:
                break
            answers = answer(
                self.model,
                self.tokenizer,
                prompts,
                settings=self.settings,
                stop_ids=self.stop_ids,
                pad_id=self.pad_id,
                drafter=self.drafter,
                sizing=self.sizing,
                seed=seed + k,
            )
            for i, reply in zip(active, answers):
                open_[i] = add_turn(history[i], users[i][k], reply, self.tokenizer, report)
        return history

    def _prompts(self, history, users, k: int, open_: list[bool], report: RegenerateReport) -> tuple[list[int], list[str]]:
        """(rows, rendered prompts) of the conversations still open that have a turn k; a prompt too
        long for the limit closes its conversation."""
        active, prompts = [], []
        for i in range(len(history)):
            if not open_[i] or k >= len(users[i]):
                continue
            prompt = render_chat(self.tokenizer, history[i] + [{"role": "user", "content": users[i][k]}], add_generation_prompt=True)
            if (
                self.limit is not None
                and len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]) + self.settings.max_new_tokens > self.limit
            ):
                report.prompts_too_long += 1
                open_[i] = False
                continue
            active.append(i)
            prompts.append(prompt)
        return active, prompts


def _done_so_far(paths: Sequence[Path], mine: Path) -> set[str]:
    """The ids in the output and part files; a rank cuts only its own file's torn line."""
    done: set[str] = set()
    for path in dict.fromkeys(paths):
        done |= done_ids(path, repair=path == mine)
    return done


def _batches_left(conversations: list[dict], done: set[str], batch_size: int) -> list[list[dict]]:
    """The batches a clean run cuts from the whole input, less the finished conversations (module
    docstring: a resumed run answers in the same batches)."""
    batches = [conversations[b0 : b0 + batch_size] for b0 in range(0, len(conversations), batch_size)]
    return [kept for kept in ([c for c in b if str(c["id"]) not in done] for b in batches) if kept]


def _append_records(f, batch: list[dict], histories: list[list[dict]], generation: dict, report: RegenerateReport) -> None:
    """One record per conversation with an answered turn, flushed to disk before the next batch."""
    for conv, messages in zip(batch, histories):
        if not any(m["role"] == "assistant" for m in messages):
            report.skipped_no_answer += 1
            continue
        # the line starts with RECORD_START
        f.write(json.dumps({"id": str(conv["id"]), "messages": messages, "generation": generation}, ensure_ascii=False, allow_nan=False) + "\n")
        report.written += 1
    f.flush()
    os.fsync(f.fileno())


def regenerate(
    model,
    tokenizer,
    conversations: Iterable[dict],
    out_path: str | Path,
    settings: RegenerateSettings = RegenerateSettings(),
    *,
    drafter=None,
    sizing: str = "fixed",
    share: WorkShare | None = None,
    progress: bool = True,
) -> RegenerateReport:
    """Re-answer `conversations` ({id, messages}) with `model`; append records to `out_path`.
    drafter: answer with batched speculative decoding through it (None: transformers `generate()`);
    sizing: how its trees are sized each round (inference/engine/sizing.py; fixed: whole trees).
    share: this process's part of a job run by several (train/capture/workshare.py WorkShare; default
    alone); every rank returns the job's report."""
    share = share or WorkShare()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    conversations = list(conversations)
    leftovers = part_files(out_path)  # of a run that was killed
    mine = out_path if share.world == 1 else part_path(out_path, share.rank, share.world)
    check_continuation([out_path, *leftovers, mine], settings.generation())
    done = _done_so_far([out_path, *leftovers, mine], mine)
    report = RegenerateReport(already_done=len(done))
    todo = _batches_left(conversations, done, settings.batch_size)
    share.barrier()  # all ranks have read the done ids before any rank writes more
    todo = share.mine(todo)
    answerer = _Answerer(model, tokenizer, settings, drafter, sizing)

    bar = None
    if progress and share.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(map(len, todo)), desc="regenerate", unit="conv", dynamic_ncols=True)
    with open(mine, "a", encoding="utf-8") as f:
        for batch in todo:
            _append_records(f, batch, answerer.conversations(batch, report), settings.generation(), report)
            if bar is not None:
                bar.update(len(batch))
    if bar is not None:
        bar.close()
    reports = share.gather(report)  # every rank is done with its batches
    if share.is_main and (share.world > 1 or leftovers):
        merge_parts(out_path, [str(c["id"]) for c in conversations])
    share.barrier()  # no rank returns before the output is whole
    return RegenerateReport.combine(reports)
