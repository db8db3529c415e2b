"""How each round's tree is sized: one setting, `sizing`, under one name from the CLI
(`--sizing`) through DraftSpec to GenerationConfig and the serving engine.

    fixed       every round verifies the drafter's whole tree
    policy      the load policy (policy.py) cuts every row's tree to the node count that pays at
                the batch size, down to plain decoding, from the verifier's measured forward cost
    confidence  the drafter sizes its own tree against that cost (EAGLE's path probabilities,
                DSpark's confidence head): a drafter that takes `size_by(cost)`

The engine builds what a rule needs from the verifier it decodes with: the forward timed once
(cost.py `measure_verify_cost`) and, for the policy, the SpeculationPolicy, whose estimates then
carry over from call to call as a server's do from batch to batch. Both are kept per verifier (a
transformers model or a llama.cpp target), the policy per drafter class and feature layers: a
process runs one drafter setting (a command, a server). `prepare_sizing` builds them ahead, so
that a caller timing its generations (bench, demo) does not time the measurement.

This module imports no torch until a rule is built: the CLI's parser reads SIZINGS.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

SIZINGS = ("fixed", "policy", "confidence")
# what a batch of 16 rows x 32 nodes reaches: the token counts the load policy's cost curve is timed at
POLICY_TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
POLICY_CONTEXT = 128  # cached tokens behind the timed forward (measure_verify_cost's default)

_BUILT: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()  # verifier -> what was built for it


def check_sizing(sizing: str) -> None:
    """A ValueError in one line for a value that is no sizing rule."""
    if sizing not in SIZINGS:
        raise ValueError(f"unknown sizing {sizing!r}: use one of {', '.join(SIZINGS)}")


def _kept(verifier, key: tuple, build: Callable[[], Any]):
    kept = _BUILT.setdefault(verifier, {})
    if key not in kept:
        kept[key] = build()
    return kept[key]


def forget_sizing(verifier) -> None:
    """Drop what was built for `verifier`: the next call times its forward and learns afresh (a
    study comparing settings in one process starts each from the same cold state)."""
    _BUILT.pop(verifier, None)


def policy_token_counts(verifier) -> tuple[int, ...]:
    """POLICY_TOKEN_COUNTS that fit the verifier's context behind POLICY_CONTEXT cached tokens."""
    limit = getattr(verifier.config.get_text_config(), "max_position_embeddings", None) or 10**9
    return tuple(n for n in POLICY_TOKEN_COUNTS if POLICY_CONTEXT + n <= limit) or (1, 2)


def _policy_key(drafter, row_invariant: bool) -> tuple:
    return ("policy", type(drafter).__qualname__, tuple(drafter.feature_layers), bool(drafter.needs_last_hidden), bool(row_invariant))


def set_policy(verifier, drafter, policy, row_invariant: bool | None = None) -> None:
    """Rounds of `drafter`'s class on `verifier` run under `policy` (a SpeculationPolicy) from
    now on, in place of the one the engine builds: a study or a test with costs of its own.
    row_invariant None: the engine's default for `verifier` (backend.py)."""
    if row_invariant is None:
        from .backend import row_invariant_by_default

        row_invariant = row_invariant_by_default(verifier)
    _BUILT.setdefault(verifier, {})[_policy_key(drafter, row_invariant)] = policy


def set_verify_cost(verifier, drafter, cost, row_invariant: bool | None = None) -> None:
    """Drafters like `drafter` that size their rounds on `verifier` do so against `cost` (a
    cost.CostCurve) from now on, in place of the engine's measured one: a test with costs of its
    own. row_invariant None: the engine's default for `verifier`."""
    if row_invariant is None:
        from .backend import row_invariant_by_default

        row_invariant = row_invariant_by_default(verifier)
    _BUILT.setdefault(verifier, {})[_cost_key(drafter, row_invariant)] = cost


def _cost_key(drafter, row_invariant: bool) -> tuple:
    return ("confidence", tuple(drafter.feature_layers), bool(row_invariant))


def load_policy(verifier, drafter, row_invariant: bool):
    """The load policy for rounds of `drafter` verified by `verifier` (module docstring): the
    verifier's forward timed once at `policy_token_counts`, the way rounds call it."""
    from .cost import measure_verify_cost
    from .policy import SpeculationPolicy

    layers, want_last = tuple(drafter.feature_layers), bool(drafter.needs_last_hidden)

    def build():
        curve = measure_verify_cost(
            verifier,
            policy_token_counts(verifier),
            context=POLICY_CONTEXT,
            want_hidden=bool(layers) or want_last,
            feature_layers=layers,
            row_invariant=row_invariant,
        )
        return SpeculationPolicy(curve)

    return _kept(verifier, _policy_key(drafter, row_invariant), build)


def size_drafter(verifier, drafter, sizing: str, row_invariant: bool) -> None:
    """Under sizing "confidence", hand `drafter` the verifier's measured cost to size its rounds
    against (`size_by(cost)`); under the other rules, take it back (`size_by(None)`: its whole
    tree, or the load policy's cut). A drafter without `size_by` cannot size itself."""
    size_by = getattr(drafter, "size_by", None)
    if size_by is None:
        if sizing == "confidence":
            raise ValueError(f"sizing 'confidence' needs a drafter that sizes its own rounds (EAGLE, DSpark heads), not {type(drafter).__name__}")
        return
    if sizing != "confidence":
        size_by(None)
        return
    from .cost import measure_verify_cost

    layers = tuple(drafter.feature_layers)

    def build():  # the verifier returns hidden states to these drafters: its forward is timed that way
        return measure_verify_cost(verifier, feature_layers=layers, row_invariant=row_invariant)

    size_by(_kept(verifier, _cost_key(drafter, row_invariant), build))


def prepare_sizing(verifier, drafter, sizing: str, row_invariant: bool, note: Callable[[str], None] | None = None) -> None:
    """Build now what `sizing` needs for `drafter` on `verifier` (the first generation then finds
    it), saying so through `note` when it times the forward."""
    check_sizing(sizing)
    if sizing == "policy":
        if note is not None:
            note("sizing policy: timing the target's forward at " + ", ".join(map(str, policy_token_counts(verifier))) + " tokens")
        load_policy(verifier, drafter, row_invariant)
    elif sizing == "confidence":
        if note is not None:
            note("sizing confidence: timing the target's forward")
        size_drafter(verifier, drafter, sizing, row_invariant)
