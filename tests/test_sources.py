"""The fixed draft pool as the engine's draft source, on fake proposers (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memspec.errors import InvalidRequestError
from memspec.request import GenerationRequest, PolicyName
from memspec.speculation.sources import DraftPool, DraftRow
from memspec.speculation.speculative import FixedDraft


class FakeProposer:
    def __init__(self, name, nbytes, kv_per_token=0):
        self.name, self.nbytes = name, nbytes
        self.session = SimpleNamespace(cache_nbytes=lambda tokens: tokens * kv_per_token) if kv_per_token else None
        self.begun = []

    def begin(self, capacity):
        self.begun.append(capacity)
        return SimpleNamespace(close=lambda: None)


def req(**kw):
    if "policy" in kw:
        kw["policy"] = PolicyName.parse(kw["policy"])
    return GenerationRequest(prompt="hi", **kw)


@pytest.fixture
def pool():
    return DraftPool({"model": FakeProposer("model", 7, kv_per_token=10), "lookup": FakeProposer("lookup", 0)})


def test_a_request_runs_the_draft_it_names_or_its_fixed_policy_or_the_default(pool):
    sel = pool.selector(req(draft="model"), [1, 2], 64)
    assert isinstance(sel, FixedDraft) and sel.name == "model" and pool["model"].begun == [64]
    assert pool.selector(req(policy="fixed:lookup"), [1], 32).name == "lookup"
    assert pool.selector(req(draft="none"), [1], 32) is None
    assert pool.selector(req(policy="target-only"), [1], 32) is None
    assert pool.selector(req(), [1], 32) is None  # no default: target only
    assert DraftPool(pool.proposers, default="lookup").selector(req(), [1], 32).name == "lookup"
    assert pool.selector(req(draft="lookup", policy="fixed:model"), [1], 32).name == "lookup"  # draft wins


def test_unknown_drafts_and_policies_a_pool_cannot_run_are_refused(pool):
    with pytest.raises(InvalidRequestError, match=r"^draft: unknown draft 'x'; available: none, lookup, model$"):
        pool.check(req(draft="x"))
    with pytest.raises(InvalidRequestError, match=r"^policy: unknown draft 'x'; available: none, lookup, model$"):
        pool.check(req(policy="fixed:x"))
    with pytest.raises(InvalidRequestError,
                       match=r"^policy: unknown policy 'memspec'; known: target-only, fixed:lookup, fixed:model$"):
        pool.check(req(policy="memspec"))


def test_only_a_model_draft_brings_a_kv_cache(pool):
    (sizer,) = pool.draft_kv_sizers(req(draft="model"))
    assert sizer(5) == 50
    assert pool.draft_kv_sizers(req(draft="lookup")) == [] and pool.draft_kv_sizers(req()) == []


def test_pinned_drafts_are_reported_and_can_be_unloaded(pool):
    assert set(pool.pinned()) == {"model", "lookup"}
    assert pool.report().drafts == [DraftRow("lookup", True, 0), DraftRow("model", True, 7)]
    assert pool.report().budget_bytes is None
    assert pool.unload("model") == 7 and "model" not in pool and pool.unload("model") is None
    with pool.reserve_kv(1 << 40, lambda: False):  # no budget: nothing to wait for
        pass
