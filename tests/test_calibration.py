"""The predictor's costs measured on the running machine (memspec.scheduling.calibration)."""

from __future__ import annotations

import pytest

from fakes import StandInPredictor
from memspec.request import NO_DRAFT
from memspec.scheduling.calibration import LocalCosts
from test_scheduler import make, req, run_steps

COSTS = {NO_DRAFT: {"step_s": 0.010, "per_draft_token_s": 0.0},
         "draft-chat": {"step_s": 0.010, "per_draft_token_s": 0.001},
         "prompt-lookup": {"step_s": 0.010, "per_draft_token_s": 0.001}}


def test_a_policy_s_scale_is_its_seconds_here_over_what_the_profile_gives():
    local = LocalCosts(COSTS, min_steps=4, window=64)
    local.observe("draft-chat", 10, 30, 10 * (0.010 + 3 * 0.001) * 2)  # twice the profile's time
    local.observe(NO_DRAFT, 3, 0, 0.03)  # too few steps to count yet
    local.observe("not-profiled", 10, 10, 1.0)  # the predictor does not rate it: ignored
    assert local.scales() == {"draft-chat": pytest.approx(2.0)}
    local.observe(NO_DRAFT, 1, 0, 0.01)  # four steps: 0.04 s against 0.04 profiled
    assert local.scales() == {"draft-chat": pytest.approx(2.0), NO_DRAFT: pytest.approx(1.0)}
    assert local.report() == {"draft-chat": 2.0, "target-only": 1.0}


def test_rates_are_divided_by_their_scale_and_an_unseen_policy_takes_the_median():
    local = LocalCosts(COSTS, min_steps=4, window=64)
    rates = {"draft-chat": 40.0, "prompt-lookup": 35.0, NO_DRAFT: 30.0}
    assert local.apply(rates) == rates  # nothing seen: the profile's costs stand
    local.observe("draft-chat", 8, 24, 8 * 0.013 * 2)
    assert local.apply(rates) == pytest.approx({d: v / 2 for d, v in rates.items()})  # one machine-wide factor
    local.observe(NO_DRAFT, 8, 0, 8 * 0.010 * 1.5)
    local.observe("prompt-lookup", 8, 24, 8 * 0.013 * 0.5)  # costs less here than on the profiling machine
    got = local.apply(rates)
    assert got == pytest.approx({"draft-chat": 20.0, "prompt-lookup": 70.0, NO_DRAFT: 20.0})
    assert local.apply({"draft-math": 10.0}) == pytest.approx({"draft-math": 10.0 / 1.5})  # the median of 2, 0.5, 1.5


def test_old_steps_fade_so_a_machine_that_changes_is_followed():
    local = LocalCosts(COSTS, min_steps=4, window=16)
    for _ in range(4):
        local.observe(NO_DRAFT, 8, 0, 8 * 0.010 * 3)  # a busy machine: three times the profile's time
    for _ in range(4):
        local.observe(NO_DRAFT, 8, 0, 8 * 0.010)  # then quiet
    assert local.scales()[NO_DRAFT] < 1.5  # weighted towards the recent steps (all-time mean: 2.0)


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="min_steps"):
        LocalCosts(COSTS, min_steps=8, window=8)


def test_memspec_picks_by_what_drafts_cost_on_this_machine():
    """A draft predicted fastest on the profiling machine's costs but twice as slow here loses to
    one that runs here at its profiled cost: the steps each request ran are measured, and the
    policy's next pick divides each rate by its draft's scale."""
    rates = {"draft-chat": 40.0, "draft-code": 5.0, "draft-math": 5.0, "prompt-lookup": 35.0, NO_DRAFT: 30.0}
    code = dict(rates, **{"prompt-lookup": 50.0, "draft-chat": 20.0})
    sched, *_ = make("memspec", budget_mb=0, predictor=StandInPredictor(rates, code, costs=COSTS))
    for d in ("draft-chat", "prompt-lookup"):
        sched.ws.lease(d).release()  # resident: each request starts on its pick
    profiled = 0.010 + 3 * 0.001  # a step that drafts 3 tokens (FakeProposer), at the profile's costs
    for prompt, want, step_s in (("hello", "draft-chat", 2 * profiled),  # predicted best, runs twice as slow
                                 ("write code", "prompt-lookup", profiled)):  # runs as profiled
        sel = sched.selector(req(prompt), [1, 2, 3], 256)
        assert sel.name == want
        run_steps(sel, 20, step_s=step_s)
        sel.close()
    counters = sched.counters()
    assert counters["memspec.cost_scale.draft-chat"] == pytest.approx(2.0, rel=0.01)
    assert counters["memspec.cost_scale.prompt-lookup"] == pytest.approx(1.0, rel=0.01)
    sel = sched.selector(req("hello"), [1, 2, 3], 256)
    assert sel.name == "prompt-lookup"  # 35 / 1.0 against draft-chat's 40 / 2.0 and none's 30 / 1.5
    sel.close()
