"""The scheduler driving the real engine (fp32 target): lossless output, degradation under
pressure mid-request, and leases released however a request ends."""

from __future__ import annotations

import threading

import numpy as np

from memspec.speculation.config import DraftLimits, SpecConfig
import pytest

from fakes import FakeProbe, MiB
from memspec.speculation.drafts import DraftModel, PromptLookup, Proposal
from memspec.runtime.target import load_target
from memspec.speculation.engine import Engine
from memspec.request import GenerationRequest
from memspec.runtime.memory import request_kv_bytes
from memspec.scheduling.config import SchedulerConfig
from memspec.scheduling.scheduler import Scheduler
from memspec.runtime.config import SessionConfig

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
V = 49152


class Broken:
    """A draft whose proposals raise (a request that fails mid-run)."""

    name, nbytes, session = "broken", 0, None

    def begin(self, capacity):
        return self

    def propose(self, context, k, params, rng, shaper=None, alternatives=False):
        raise RuntimeError("draft failed")

    def close(self):
        pass


class PressureAfter(FakeProbe):
    """Plenty of memory for the first `n` checks, then almost none."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def available_bytes(self):
        self.calls += 1
        return 8 << 30 if self.calls <= self.n else 1 * MiB


@pytest.fixture(scope="module")
def target(model_store):
    return load_target(model_store, "smollm2-135m", "fp32", SessionConfig(max_context=256))


def engine_with(target, policy, probe=None, floor_mb=0, budget_mb=0):
    drafts = {
        "self": DraftModel("self", target.session, np.arange(V), V, DraftLimits(0.0, np.inf)),  # accepts everything
        "prompt-lookup": PromptLookup(V),
        "broken": Broken(),
    }
    sizes = {"self": MiB, "prompt-lookup": 0, "broken": 0}  # "self" shares the target's weights: nominal size
    sched = Scheduler(SchedulerConfig(policy=policy, pressure_floor_mb=floor_mb, budget_mb=budget_mb),
                      lambda name: (drafts[name], sizes[name]), sizes, probe or FakeProbe(),
                      target=("target", 100 * MiB), decode=target.tokenizer.decode,
                      kv_sizers={"self": lambda tokens: MiB})  # its cache: a nominal 1 MiB

    # the step controller: "self" costs as much as the target, so the cost controller would
    # (rightly) stop drafting with it, and these tests are about scheduling, not draft length
    return Engine(target, drafts=sched, spec=SpecConfig(controller="step")), sched


def leases(sched):
    return sum(d["leases"] for d in sched.ws.status()["drafts"].values())


@pytest.fixture(scope="module")
def baseline(target):
    return Engine(target).generate(GenerationRequest(prompt=PROMPT, max_tokens=16, draft="none"))


@pytest.mark.parametrize("policy", ["fixed:self", "bandit"])
def test_scheduled_greedy_output_equals_target_only(target, baseline, policy):
    engine, sched = engine_with(target, policy)
    for _ in range(2 if policy == "bandit" else 1):
        r = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=16))
        assert r.token_ids == baseline.token_ids and r.text == baseline.text
    assert leases(sched) == 0
    if policy == "fixed:self":
        assert r.stats.drafts_used == {"self": r.stats.num_drafts} and r.stats.num_accepted_tokens > 8
    sched.close()


def test_pressure_mid_request_degrades_to_target_only_without_changing_the_output(target, baseline):
    engine, sched = engine_with(target, "fixed:self", PressureAfter(1), floor_mb=100)
    r = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=16))
    assert r.token_ids == baseline.token_ids
    assert r.stats.drafts_used["self"] == 1  # drafted at first ...
    assert r.stats.num_drafts == 1 and r.stats.num_accepted_tokens < 15  # ... then target-only steps
    assert sched.counters()["degraded"] == 1 and sched.ws.target_only
    assert leases(sched) == 0 and "self" not in sched.ws.resident()  # released, then evicted
    sched.close()


def test_leases_are_released_on_close_cancel_and_error(target, monkeypatch):
    engine, sched = engine_with(target, "fixed:self")
    stream = engine.stream(GenerationRequest(prompt=PROMPT, max_tokens=32))
    next(stream), next(stream)
    assert leases(sched) == 1
    stream.close()  # the client went away
    assert leases(sched) == 0

    cancel = threading.Event()
    stream = engine.stream(GenerationRequest(prompt=PROMPT, max_tokens=32), cancel)
    next(stream)
    cancel.set()
    done = [item for item in stream][-1]
    assert done.finish_reason == "cancelled" and leases(sched) == 0

    def failing_forward(*args, **kwargs):
        raise RuntimeError("the target failed")

    with monkeypatch.context() as m:  # an error outside the draft still ends the request, and frees it
        m.setattr(target.session, "forward", failing_forward)
        with pytest.raises(RuntimeError, match="the target failed"):
            engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=8))
    assert leases(sched) == 0
    sched.close()


def test_a_draft_that_raises_mid_request_is_given_up_and_the_request_finishes_target_only(target, baseline):
    engine, sched = engine_with(target, "fixed:self")
    r = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=16, draft="broken"))
    assert r.token_ids == baseline.token_ids and r.finish_reason == baseline.finish_reason
    assert r.stats.draft_failures == 1 and r.stats.num_drafts == 0
    assert sched.counters()["draft_failures"] == 1 and leases(sched) == 0
    sched.close()


def test_a_draft_whose_cache_cannot_be_made_hands_its_lease_back(target, baseline):
    class NoCache(Broken):
        def begin(self, capacity):
            raise MemoryError("cannot allocate the draft's KV cache")

    engine, sched = engine_with(target, "fixed:self")
    sched.ws.loader = lambda name: (NoCache(), 0)  # the next load of any draft
    r = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=16, draft="self"))
    assert r.token_ids == baseline.token_ids and r.stats.num_drafts == 0
    assert sched.counters()["draft_failures"] == 1 and leases(sched) == 0  # no lease leaked
    sched.close()


def kv_mib(target, baseline, max_tokens):
    """The KV bytes a request for PROMPT reserves (its target cache with a verification pass's
    slots, and the 1 MiB of "self"'s), and that in whole MiB."""
    kv = request_kv_bytes(len(baseline.prompt_token_ids) + max_tokens, target.session.cache_nbytes,
                          [lambda tokens: MiB], slack=SpecConfig().gamma_max + 1)
    return kv, -(-kv // MiB)


def test_kv_caches_are_reserved_in_the_budget_while_a_request_runs(target, baseline):
    kv, mib = kv_mib(target, baseline, 16)
    engine, sched = engine_with(target, "fixed:self", budget_mb=100 + 1 + mib)  # target, "self", this KV
    stream = engine.stream(GenerationRequest(prompt=PROMPT, max_tokens=16))
    next(stream)
    assert sched.ws.ledger.total("kv") == kv and "self" in sched.ws.resident()
    out = [x for x in stream][-1]
    assert out.token_ids == baseline.token_ids and sched.ws.ledger.total("kv") == 0
    assert sched.ws.peak_used <= (100 + 1 + mib) * MiB
    sched.close()


def test_caches_evict_an_idle_draft_or_are_refused_and_the_engine_keeps_serving(target, baseline):
    from memspec.errors import OverloadedError

    kv, mib = kv_mib(target, baseline, 16)
    assert mib * MiB - kv < MiB, "the budget below must leave no room for the 1 MiB draft beside the caches"
    engine, sched = engine_with(target, "fixed:self", budget_mb=100 + mib)
    sched.ws.lease("self").release()  # resident and idle
    with pytest.raises(OverloadedError, match=r"KV caches need .* raise \[scheduler\] budget_mb"):
        engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=200))  # too big even with "self" gone
    assert sched.ws.ledger.total("kv") == 0 and "self" in sched.ws.resident()  # refused before evicting
    r = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=16))  # fits once "self" is evicted
    assert r.token_ids == baseline.token_ids and sched.ws.ledger.total("kv") == 0
    assert sched.ws.counters.evictions >= 1 and r.stats.num_drafts == 0  # it ran target-only
    sched.close()


def test_closing_the_engine_mid_request_joins_the_loader_and_the_request_still_finishes(target, baseline):
    """What `memspec unload` or a replacing `memspec load` does to a running stream's engine:
    the loader thread is joined at once; the stream finishes with the same tokens (target-only
    once it has no draft) and hands its lease back without error."""
    engine, sched = engine_with(target, "fixed:self")
    stream = engine.stream(GenerationRequest(prompt=PROMPT, max_tokens=16))
    chunks = [next(stream), next(stream)]
    assert leases(sched) == 1 and sched.ws._thread.is_alive()
    engine.close()
    assert sched.ws._thread is None
    *rest, done = list(stream)
    ids = [i for c in chunks + rest for i in c.token_ids]
    assert ids == baseline.token_ids and done.token_ids == baseline.token_ids
    engine.close()  # idempotent


def test_a_request_waiting_for_its_draft_to_load_ends_when_it_is_cancelled(target):
    import time

    engine, sched = engine_with(target, "fixed:self")
    release = threading.Event()
    real = sched.ws.loader
    sched.ws.loader = lambda name: (release.wait(10), real(name))[1]  # a load that hangs
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.monotonic()
    out = [x for x in engine.stream(GenerationRequest(prompt=PROMPT, max_tokens=16), cancel)][-1]
    assert time.monotonic() - t0 < 5 and out.finish_reason == "cancelled" and out.stats.num_drafts == 0
    release.set()
    assert leases(sched) == 0
    sched.close()
