"""Chi-square goodness of fit without scipy: p-value from torch's regularised gamma."""

from __future__ import annotations

import torch


def chi_square_pvalue(observed: dict, expected_probs: dict, n: int, min_expected: float = 5.0) -> float:
    """Pearson chi-square test of counts `observed` (outcome -> count, n in total) against the
    exact distribution `expected_probs`; cells with expected count < min_expected are pooled."""
    cells, pooled_obs, pooled_exp = [], 0.0, 0.0
    for outcome, prob in expected_probs.items():
        exp = prob * n
        obs = observed.get(outcome, 0)
        if exp < min_expected:
            pooled_obs += obs
            pooled_exp += exp
        else:
            cells.append((obs, exp))
    impossible = sum(c for o, c in observed.items() if expected_probs.get(o, 0.0) == 0.0)
    if impossible:
        return 0.0  # an outcome the target can never produce
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    if dof < 1:  # every cell pooled into one: no test at all (it would read p = 0)
        raise ValueError(f"{n} samples are too few for {len(expected_probs)} outcomes: every cell was pooled")
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
