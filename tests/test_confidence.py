"""Which drafted tokens are worth a verified row (memspec/speculation/confidence.py)."""

from __future__ import annotations

import pytest

from memspec.speculation.confidence import PRIOR, AcceptanceByEntropy

FAST = [0.0, 1.0, 1.22, 1.38, 1.6, 1.84, 2.07]  # the 1.5B's passes of 1..6 rows on a 2-core Zen 4, one phase
FREE = [0.0, 1.0, 1.01, 1.02, 1.03, 1.04, 1.05]  # rows nearly free


def trained(sure: float = 0.1, unsure: float = 4.5, n: int = 400) -> AcceptanceByEntropy:
    """A draft whose sure tokens the target takes 9 times in 10, its unsure ones 1 in 10."""
    acc = AcceptanceByEntropy()
    for i in range(n):
        acc.observe("d", [sure, sure], 2 if i % 10 else 1)  # 19 of 20 sure positions reached, 9 in 10 taken
        acc.observe("d", [unsure], 1 if i % 10 == 0 else 0)
    return acc


def test_a_bin_never_seen_is_the_requests_own_rate():
    acc = AcceptanceByEntropy()
    assert acc.rate("d", 3.0, 0.4) == pytest.approx(0.4)
    acc.observe("other", [3.0], 0)
    assert acc.rate("d", 3.0, 0.4) == pytest.approx(0.4)  # per draft


def test_only_the_positions_the_target_reached_are_counted():
    acc = AcceptanceByEntropy()
    acc.observe("d", [0.1, 4.5, 0.1], 1)  # the first accepted, the second rejected, the third never reached
    assert acc.rate("d", 0.1, 0.0) == pytest.approx(1 / (1 + PRIOR))
    assert acc.rate("d", 4.5, 1.0) == pytest.approx(PRIOR / (1 + PRIOR))


def test_the_gate_keeps_what_pays_at_the_rows_cost():
    acc = trained()
    assert acc.rate("d", 0.1, 0.5) > 0.85 and acc.rate("d", 4.5, 0.5) < 0.15
    assert acc.keep("d", [0.1, 0.1, 4.5, 4.5], 0.5, FAST, 0.02) == 2  # the unsure tail costs more than it wins
    assert acc.keep("d", [4.5, 0.1], 0.5, FAST, 0.02) == 0  # an unsure first token: a plain step pays more
    assert acc.keep("d", [4.5, 0.1], 0.5, FREE, 0.02) == 2  # where rows are nearly free, all of it
    assert acc.keep("d", [0.1] * 8, 0.5, FAST, 0.02) <= len(FAST) - 2  # never past the rows the curve knows
    assert acc.keep("d", [], 0.5, FAST, 0.02) == 0
