"""The benchmark's default memory budget: room for at most half the drafts, whichever they are."""

from __future__ import annotations

import itertools

from memspec.bench import default_budget_mb, draft_room

MiB = 1 << 20


def test_draft_room_holds_at_most_half_the_drafts_in_any_combination():
    sizes = {"code": 31 * MiB, "math": 31 * MiB, "chat": 31 * MiB, "general": 65 * MiB, "prompt-lookup": 0}
    room = draft_room(sizes)
    assert room == 65 * MiB  # the largest alone, or two of the specialists
    models = [b for b in sizes.values() if b]
    for k in range(1, len(models) + 1):
        fits = [c for c in itertools.combinations(models, k) if sum(c) <= room]
        assert bool(fits) == (k <= len(models) // 2), k
    assert draft_room({"a": 10 * MiB, "prompt-lookup": 0}) == 10 * MiB  # one draft: it fits
    assert draft_room({"prompt-lookup": 0}) == 0


def test_default_budget_adds_the_process_and_one_request_and_rounds_up():
    sizes = {"a": 30 * MiB, "b": 40 * MiB}
    assert default_budget_mb(300 * MiB, 10 * MiB + 1, sizes) == 300 + 11 + 40
