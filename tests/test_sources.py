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


def test_the_fixed_pool_and_the_scheduler_make_the_same_drafts_in_one_place(model_store, monkeypatch):
    """memspec.build.load_pool and the scheduler's loader (from_store) both make their drafts through
    DraftMaker: the same names, each the same kind of proposer, and a draft the maker does not know
    is refused by both alike."""
    from memspec.build import load_pool
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.target import load_target
    from memspec.scheduling.config import SchedulerConfig
    from memspec.scheduling.scheduler import draft_names, from_store
    from memspec.speculation.config import DraftLimits
    from memspec.speculation.sources import DraftMaker

    config = SessionConfig(max_context=256)
    maker = DraftMaker.for_target(model_store, "smollm2-135m", 49152, config, DraftLimits(), suffix_bytes=1 << 20)
    assert maker.names[:2] == ["prompt-lookup", "suffix"] and {"draft-code", "draft-chat"} <= set(maker.names)
    assert draft_names(model_store, "smollm2-135m", session_config=config) == maker.names
    made = []
    real_make = DraftMaker.make
    monkeypatch.setattr(DraftMaker, "make", lambda self, name: made.append(name) or real_make(self, name))
    pool = load_pool(model_store, "smollm2-135m", 49152, config, suffix_bytes=1 << 20)
    assert list(pool) == maker.names == made
    target = load_target(model_store, "smollm2-135m", None, config)
    sched = from_store(SchedulerConfig(policy="bandit", pressure_floor_mb=0), model_store, target, config,
                       DraftLimits(), suffix_bytes=1 << 20)
    try:
        assert sorted(sched.drafts) == sorted(maker.names)
        made.clear()
        lease = sched.ws.lease("draft-code", wait=True)
        assert made == ["draft-code"] and type(lease.proposer) is type(pool["draft-code"])
        lease.release()
    finally:
        sched.close()
    with pytest.raises(ValueError, match="no draft 'draft-none'"):
        maker.make("draft-none")
