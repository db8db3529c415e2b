"""Check a JSON-loaded dict against a dataclass's field annotations before building it: a
config.json written by hand or by another tool may hold "4" where 4 belongs, and a dataclass
does not check (the error would surface later as a TypeError deep in a forward).

Annotations are read as the strings `from __future__ import annotations` leaves: alternatives
split on "|", each one of the simple forms below; an unrecognised form is not checked.
"""

from __future__ import annotations

import dataclasses


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v) -> bool:
    return isinstance(v, (list, tuple)) and all(_is_int(x) for x in v)


# annotation text -> (does a JSON value fit it, how to name it in a message)
_CHECKS = {
    "None": (lambda v: v is None, "null"),
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_int(v) or isinstance(v, float), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list[int]": (_ints, "a list of integers"),
    "tuple[int, ...]": (_ints, "a list of integers"),
}


def type_problems(cls, d: dict) -> list[str]:
    """'key: expected ..., got ...' for every value of `d` that its field's annotation rules out
    (keys that are not fields are the caller's to refuse)."""
    problems = []
    for f in dataclasses.fields(cls):
        if f.name not in d or not isinstance(f.type, str):
            continue
        alternatives = [a.strip() for a in f.type.split("|")]
        if not all(a in _CHECKS for a in alternatives):  # a form this module does not know (a nested config)
            continue
        checks = [_CHECKS[a] for a in alternatives]
        v = d[f.name]
        if not any(fits(v) for fits, _ in checks):
            wanted = " or ".join(name for _, name in checks)
            problems.append(f"{f.name}: expected {wanted}, got {v!r}")
    return problems
