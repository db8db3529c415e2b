"""JSON arrays and JSON lines read incrementally, record by record (docs/models-and-data.md
"Data formats and streaming"): memory stays at about one record, a file cut mid-record (the
ShareGPT package file) keeps every complete record before the cut, and the cut is noted in the
caller's SourceReport (train/data/source_report.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator, TextIO

from ...ground.files import not_utf8
from .source_report import SourceReport

_SEPARATOR = re.compile(r"[\s,]*")
_CHUNK = 1 << 20  # characters the JSON decoders read at a time
# A record still unparsed after this many characters is malformed (or absurd): stop reading ahead
# rather than pull the rest of a large file into memory looking for its end.
MAX_RECORD_CHARS = 1 << 27


def iter_json_array(f: TextIO, report: SourceReport, name: str = "") -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one by one, surviving a cut-off end.

    `json.load` needs the whole document; `raw_decode` parses one value at a position and tells
    where it ended, so every record before the cut is recovered. The file is read in chunks of
    `_CHUNK` characters (memory stays at about the largest record), and a record that does not
    parse yet is retried with more text until the file ends; then it is the cut, recorded in `report`.
    """
    decoder = json.JSONDecoder()
    buf, base, eof = "", 0, False  # base: the file offset (in characters) of buf[0]

    def read(n: int = _CHUNK) -> bool:
        nonlocal buf, eof
        piece = f.read(n)
        eof = not piece
        buf += piece
        return bool(piece)

    def cut(at: int) -> None:
        report.file_truncated, report.truncated_at_char = True, at

    i = 0
    while True:  # leading whitespace, then "["
        i = len(buf) - len(buf.lstrip())
        if i < len(buf) or not read():
            break
    if i >= len(buf) or buf[i] != "[":
        raise ValueError(f"{name}: not a JSON array")
    i += 1
    while True:
        while True:  # separators may continue into the next chunk
            i = _SEPARATOR.match(buf, i).end()  # type: ignore[union-attr]  # [\s,]* matches everywhere
            if i < len(buf) or not read():
                break
        if i >= len(buf):  # no closing bracket: cut between records
            return cut(base + i)
        if buf[i] == "]":
            return
        while True:
            try:
                record, j = decoder.raw_decode(buf, i)
                if j < len(buf) or eof:  # a value ending at the buffer's end (a number) may go on
                    break
            except json.JSONDecodeError:
                if eof:
                    return cut(base + i)
                if len(buf) - i > MAX_RECORD_CHARS:
                    raise ValueError(f"{name}: the record at char {base + i} does not parse within {MAX_RECORD_CHARS} characters") from None
            read(max(_CHUNK, len(buf) - i))  # doubles the pending text: linear in the record's size
        report.records_read += 1
        yield record
        i = j
        if i > _CHUNK:  # drop what was decoded
            buf, base, i = buf[i:], base + i, 0


def iter_jsonl(f: TextIO, report: SourceReport, name: str = "") -> Iterator[Any]:
    """Yield one record per non-empty line; a broken *last* line counts as a cut, others are errors."""
    pos, broken = 0, None  # broken: (line number, offset, error) of a bad line, a cut if nothing follows
    for n, line in enumerate(f, 1):
        start, pos = pos, pos + len(line)
        if not line.strip():
            continue
        if broken is not None:
            raise ValueError(f"{name}: line {broken[0]} is not valid JSON: {broken[2]}")
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            broken = (n, start, e)
            continue
        report.records_read += 1
        yield record
    if broken is not None:
        report.file_truncated, report.truncated_at_char = True, broken[1]


def iter_records(path: Path, report: SourceReport) -> Iterator[Any]:
    """Records of a JSON array or JSONL file, read incrementally (a JSON array is told by its "[")."""
    try:
        yield from _iter_records(path, report)
    except UnicodeDecodeError as e:
        raise not_utf8(path, e) from None


def _iter_records(path: Path, report: SourceReport) -> Iterator[Any]:
    # utf-8-sig: a byte-order mark is skipped; newline="": lines split on \n, \r\n or \r, untranslated
    with open(path, encoding="utf-8-sig", newline="") as f:
        head = ""
        while not head.strip() and (piece := f.read(4096)):
            head += piece
        stripped = head.lstrip()
        if not stripped:
            return  # an empty file has no records (load_conversations then says so)
        f.seek(0)
        if stripped.startswith("["):
            yield from iter_json_array(f, report, str(path))
        elif stripped.startswith("{"):
            yield from iter_jsonl(f, report, str(path))
        else:
            raise ValueError(f"{path}: expected a JSON array or JSONL of objects")
