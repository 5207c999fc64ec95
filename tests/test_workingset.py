"""The working set on fakes: admission and eviction, the budget, leases, pressure, failed loads."""

from __future__ import annotations

import random

import pytest

from fakes import FakeClock, FakeLoader, FakeProbe, MiB
from memspec.errors import ConfigError, InvalidRequestError
from memspec.scheduling.workingset import PRESSURE_PERIOD_S, Candidate, WorkingSet, admit, eviction_order


# -- pure functions ----------------------------------------------------------------------
def test_eviction_order_skips_leased_and_empty_then_value_per_byte_then_lru():
    cands = [
        Candidate("leased", 10, refs=1, value=0.0),
        Candidate("lookup", 0, value=0.0),  # frees nothing
        Candidate("cheap_old", 10, value=1.0, last_used=1.0),
        Candidate("cheap_new", 10, value=1.0, last_used=5.0),
        Candidate("dear", 10, value=9.0, last_used=0.0),
        Candidate("big", 100, value=9.0, last_used=9.0),  # 0.09 per byte: goes first
    ]
    assert [c.name for c in eviction_order(cands)] == ["big", "cheap_old", "cheap_new", "dear"]


def test_admit_fits_without_eviction_and_without_budget():
    assert admit(Candidate("a", 10), [], used=50, budget=60, force=False).ok
    assert admit(Candidate("a", 10**9), [], used=50, budget=0, force=False).ok


def test_admit_evicts_just_enough_in_order():
    res = [Candidate("x", 10, value=1.0, last_used=2.0), Candidate("y", 10, value=1.0, last_used=1.0),
           Candidate("z", 10, value=5.0)]
    adm = admit(Candidate("new", 15, value=3.0), res, used=108, budget=110, force=True)
    assert adm.ok and adm.victims == ("y", "x")


def test_admit_refuses_what_cannot_fit_beside_pinned_and_leased():
    res = [Candidate("held", 20, refs=1)]
    adm = admit(Candidate("new", 15), res, used=100, budget=110, force=True)
    assert not adm.ok and "does not fit" in adm.reason


def test_preload_never_pushes_out_something_worth_more_per_byte():
    res = [Candidate("good", 10, value=5.0)]
    assert not admit(Candidate("meh", 10, value=1.0), res, used=100, budget=100, force=False).ok
    assert admit(Candidate("meh", 10, value=1.0), res, used=100, budget=100, force=True).victims == ("good",)
    assert admit(Candidate("better", 10, value=9.0), res, used=100, budget=100, force=False).victims == ("good",)


# -- the working set ---------------------------------------------------------------------------
SIZES = {"a": 10 * MiB, "b": 20 * MiB, "c": 30 * MiB, "d": 15 * MiB, "lookup": 0}


def make(budget_mb=160, floor_mb=0, load_s=0.0, fail=None, sizes=SIZES):
    clock, probe = FakeClock(), FakeProbe()
    loader = FakeLoader(sizes, clock, load_s, fail)
    ws = WorkingSet(budget_mb * MiB, loader, probe, clock, floor_mb * MiB, sizes=sizes, retry_after_s=10.0,
                    reclaim=lambda: None)
    ws.pin("target", 100 * MiB)
    return ws, loader, clock, probe


def test_target_that_does_not_fit_is_refused():
    ws = WorkingSet(50 * MiB, FakeLoader(SIZES), FakeProbe(), FakeClock())
    with pytest.raises(ConfigError, match="does not hold target"):
        ws.pin("target", 100 * MiB)


def test_lease_miss_stalls_then_hits():
    ws, loader, clock, _ = make(load_s=0.25)
    lease = ws.lease("a")
    assert lease is not None and lease.proposer.name == "a"
    c = ws.counters
    assert (c.misses, c.stalls, c.hits, c.loads) == (1, 1, 0, 1)
    assert c.stall_ms == pytest.approx(250.0)
    lease.release()
    lease.release()  # idempotent
    again = ws.lease("a")
    assert (ws.counters.hits, ws.counters.stalls) == (1, 1)
    again.release()
    ws.close()


def test_catch_up_cost_is_a_drafts_own_timing_else_its_bytes_at_the_timed_drafts_rate():
    ws, loader, _, _ = make()
    assert ws.expected_catchup_s("b", 100) == 0.0  # nothing timed yet: unknown, not charged
    ws.lease("a").release()
    assert ws.expected_catchup_s("b", 100) == 0.0  # resident, but it has not caught up on anything
    loader.proposers["a"].feed_s = 0.001  # 1 ms a token for its 10 MiB
    assert ws.expected_catchup_s("a", 100) == pytest.approx(0.1)
    assert ws.expected_catchup_s("c", 100) == pytest.approx(0.3)  # 30 MiB, not loaded: three times a's cost
    assert ws.expected_catchup_s("lookup", 100) == 0.0  # no weights
    ws.lease("c").release()
    loader.proposers["c"].feed_s = 0.006  # its own timing wins over the estimate from its bytes
    assert ws.expected_catchup_s("c", 100) == pytest.approx(0.6)
    ws.unload("c")
    assert ws.expected_catchup_s("c", 100) == pytest.approx(0.3)  # evicted: back to the estimate from a
    ws.close()


def test_leased_draft_is_never_evicted():
    ws, loader, _, _ = make(budget_mb=140)  # target + 40 MiB
    a = ws.lease("a")  # 10
    b = ws.lease("b")  # 20 -> 130
    assert ws.lease("c") is None  # 30 more needs a and b gone; both are held
    assert ws.counters.refused == 1 and set(ws.resident()) == {"a", "b"}
    b.release()
    c = ws.lease("c")  # b goes, a stays
    assert c is not None and set(ws.resident()) == {"a", "c"}
    assert ws.counters.evictions == 1
    with pytest.raises(InvalidRequestError, match="in use"):
        ws.unload("a")
    a.release(), c.release()
    assert ws.unload("a") == 10 * MiB
    ws.close()


def test_random_sequences_never_exceed_budget_nor_evict_leased():
    rng = random.Random(0)
    for trial in range(20):
        ws, loader, clock, probe = make(budget_mb=100 + rng.choice([15, 35, 50, 80]), floor_mb=50)
        held = []
        for _ in range(200):
            op = rng.random()
            name = rng.choice(list(SIZES))
            if op < 0.35:
                lease = ws.lease(name, wait=rng.random() < 0.7)
                if lease is not None:
                    held.append(lease)
            elif op < 0.6 and held:
                held.pop(rng.randrange(len(held))).release()
            elif op < 0.75:
                ws.preload(name)
            elif op < 0.85:
                ws.fetch(name)
            elif op < 0.9:
                ws.set_value(name, rng.random() * 10)
            else:
                probe.available = rng.choice([10, 40, 60, 500]) * MiB
                ws.check_pressure()
            assert ws.used_bytes() <= ws.budget
            resident = ws.resident()
            for lease in held:
                assert lease.name in resident, f"leased {lease.name} was evicted"
                assert lease.proposer is ws._entries[lease.name].proposer
        ws.wait_idle()
        assert ws.peak_used <= ws.budget
        for lease in held:
            lease.release()
        ws.close()


def test_pressure_evicts_unleased_drafts_then_signals_target_only():
    ws, loader, clock, probe = make(budget_mb=200, floor_mb=100)
    held = ws.lease("a")
    for n in ("b", "c"):
        ws.lease(n).release()
    probe.available = 500 * MiB
    assert not ws.check_pressure() and set(ws.resident()) == {"a", "b", "c"}
    probe.available = 60 * MiB  # 40 short: evicting c (30) is not enough, b too (50) is
    clock.advance(PRESSURE_PERIOD_S)  # the last reading (above the floor) no longer stands
    assert not ws.check_pressure()
    assert set(ws.resident()) == {"a"} and ws.counters.pressure_evictions == 2
    probe.available = 10 * MiB  # nothing unleased left: target-only
    assert ws.check_pressure() and ws.target_only
    assert ws.lease("a") is None  # no new leases while target-only
    held.release()
    assert ws.check_pressure() and ws.resident() == {}  # released, then evicted
    probe.available = 500 * MiB
    assert not ws.check_pressure() and not ws.target_only
    assert ws.lease("a") is not None
    ws.close()


def test_a_reading_above_the_floor_stands_a_moment_and_one_under_it_never_does():
    """Every request asks at every step: memory is read at most once a period while it is plentiful,
    and on every call once it is short (so eviction and recovery are seen at once)."""
    ws, _, clock, probe = make(budget_mb=200, floor_mb=100)
    probe.available = 500 * MiB
    assert not ws.check_pressure() and probe.calls == 1
    probe.available = 10 * MiB
    clock.advance(PRESSURE_PERIOD_S / 2)
    assert not ws.check_pressure() and probe.calls == 1  # the reading of a moment ago stands
    clock.advance(PRESSURE_PERIOD_S / 2)
    assert ws.check_pressure() and probe.calls == 2
    assert ws.check_pressure() and probe.calls == 3  # under the floor: read on every call
    probe.available = 500 * MiB
    assert not ws.check_pressure() and probe.calls == 4 and not ws.target_only  # back at once
    assert not ws.check_pressure() and probe.calls == 4


def test_under_pressure_spare_caches_go_before_any_draft():
    ws, loader, _, probe = make(budget_mb=200, floor_mb=100)
    for n in ("b", "c"):
        ws.lease(n).release()
    spare = {"bytes": 45 * MiB, "calls": 0}

    def release():
        spare["calls"] += 1
        freed, spare["bytes"] = spare["bytes"], 0
        return freed

    ws.add_spare(release)
    probe.available = 60 * MiB  # 40 short: the spare cache's 45 is enough, no draft goes
    assert not ws.check_pressure()
    assert set(ws.resident()) == {"b", "c"} and ws.counters.pressure_evictions == 0 and spare["calls"] == 1
    probe.available = 60 * MiB  # still short (the probe says so): the empty cache frees nothing, drafts go
    assert not ws.check_pressure() and ws.counters.pressure_evictions == 2
    ws.close()


def test_a_failure_around_the_load_wakes_the_waiters_and_the_loader_keeps_serving():
    """Not the loader itself: what runs beside it (the RSS probe, reclaiming) raises."""
    ws, loader, clock, probe = make()
    rss = probe.rss_bytes
    calls = {"n": 0}

    def flaky_rss():
        calls["n"] += 1
        if calls["n"] == 2:  # the reading after the load
            raise OSError("/proc is gone")
        return rss()

    probe.rss_bytes = flaky_rss
    assert ws.lease("b") is None  # returns: the waiter is woken, not left waiting for ever
    assert ws.counters.failed_loads == 1 and not ws.is_available("b") and "b" not in ws.resident()
    assert ws.used_bytes() == 100 * MiB  # its reservation was given back
    assert ws.lease("a") is not None  # the loader thread is still alive and loads the next one
    ws.close()


def test_failed_load_is_counted_and_backs_off():
    ws, loader, clock, _ = make(fail={"b"})
    assert ws.lease("b") is None  # does not raise
    assert ws.counters.failed_loads == 1 and not ws.is_available("b")
    assert ws.lease("b") is None and ws.counters.failed_loads == 1  # not retried during the back-off
    assert not ws.preload("b")
    assert ws.used_bytes() == 100 * MiB  # its reservation was given back
    clock.advance(11.0)
    loader.fail.clear()
    assert ws.lease("b") is not None
    ws.close()


def test_preload_runs_in_the_background_and_counts():
    ws, loader, _, _ = make()
    assert ws.preload("c")
    ws.wait_idle()
    assert ws.is_resident("c") and ws.counters.preloads == 1
    lease = ws.lease("c")
    assert ws.counters.hits == 1 and ws.counters.stalls == 0
    lease.release()
    st = ws.status()
    assert st["drafts"]["c"]["bytes"] == 30 * MiB and st["used_bytes"] == 130 * MiB
    assert ws.ledger.to_dict()["draft"] == {"c": 30 * MiB}
    ws.close()


def test_close_joins_the_loader_and_a_lease_held_across_it_is_released_cleanly():
    """Regression: `memspec generate --local` exited with its loader thread still inside ONNX
    Runtime and aborted ("terminate called without an active exception").  close() must join
    the loader, and a request still holding a draft must be able to hand it back afterwards."""
    ws, *_ = make()
    lease = ws.lease("a")
    assert ws.preload("c")
    ws.close()
    assert ws._thread is None and ws.resident() == {}
    assert not ws.preload("b")  # closed: nothing more is loaded
    lease.release()  # no assertion: the entry went with close()
    assert lease.proposer is None


# -- the budget counts what the process holds: KV caches and measured footprints -------------------
def test_kv_reservation_evicts_idle_drafts_and_is_given_back():
    ws, *_ = make(budget_mb=160)
    ws.lease("c").release()  # 30 MiB resident, idle
    ws.lease("b").release()  # 20 MiB: 150 used
    ws.set_value("c", 3.0), ws.set_value("b", 1.0)  # b is worth less per byte
    ws.reserve("r1", 25 * MiB)  # needs 15 MiB more: b goes, which is enough
    assert set(ws.resident()) == {"c"} and ws.used_bytes() == 155 * MiB
    assert ws.status()["kv_bytes"] == 25 * MiB and ws.ledger.total("kv") == 25 * MiB
    ws.unreserve("r1")
    ws.unreserve("r1")  # idempotent
    assert ws.used_bytes() == 130 * MiB and ws.ledger.total("kv") == 0
    ws.close()


def test_kv_reservation_never_evicts_a_leased_draft_and_refuses_when_nothing_would_free_memory():
    from memspec.errors import OverloadedError

    ws, *_ = make(budget_mb=150)
    held = ws.lease("c")  # 130 used, leased
    with pytest.raises(OverloadedError, match=r"KV caches need 25.0 MiB.*raise \[scheduler\] budget_mb"):
        ws.reserve("r1", 25 * MiB)
    assert "c" in ws.resident() and ws.used_bytes() == 130 * MiB
    held.release()
    ws.close()


def test_kv_reservation_waits_for_running_requests_and_can_be_cancelled():
    import threading
    import time

    from memspec.errors import CancelledError

    ws, *_ = make(budget_mb=150)
    ws.reserve("r1", 40 * MiB)  # 140 used
    done = threading.Event()
    threading.Thread(target=lambda: (ws.reserve("r2", 30 * MiB), done.set()), daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()  # waits: r1 will free memory when it ends
    ws.unreserve("r1")
    assert done.wait(2.0) and ws.used_bytes() == 130 * MiB
    with pytest.raises(CancelledError):
        ws.reserve("r3", 30 * MiB, cancelled=lambda: True)
    assert ws.used_bytes() == 130 * MiB
    ws.close()


def test_a_load_that_adds_more_than_planned_is_accounted_at_what_it_added():
    clock, probe = FakeClock(), FakeProbe()

    def loader(name):  # the model takes 25 MiB of RSS, not the 10 MiB planned
        probe.rss += 25 * MiB
        return FakeLoader(SIZES, clock)(name)

    ws = WorkingSet(200 * MiB, loader, probe, clock, sizes=SIZES, reclaim=lambda: None)
    ws.pin("target", 100 * MiB)
    ws.lease("a").release()
    assert ws.resident() == {"a": 25 * MiB} and ws.status()["drafts"]["a"]["rss_delta_bytes"] == 25 * MiB
    assert ws.sizes["a"] == 25 * MiB  # the next load of it plans with what it really took
    ws.lease("lookup").release()  # a 0-byte proposer stays 0 whatever the RSS did
    assert ws.resident()["lookup"] == 0
    ws.close()


def test_a_wait_for_a_load_ends_at_its_deadline_or_at_a_cancel():
    import threading
    import time

    release = threading.Event()

    def stuck_loader(name):
        release.wait(10)  # a load that hangs (a slow disk, a TensorRT build)
        return object(), MiB

    ws = WorkingSet(0, stuck_loader, FakeProbe(), FakeClock(), sizes={"a": MiB, "b": MiB}, reclaim=lambda: None)
    t0 = time.monotonic()
    assert ws.lease("a", wait=True, timeout=0.2) is None
    assert 0.2 <= time.monotonic() - t0 < 2.0
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    t0 = time.monotonic()
    assert ws.lease("a", wait=True, cancelled=cancel.is_set) is None  # no deadline, but cancelled
    assert time.monotonic() - t0 < 2.0
    release.set()
    ws.wait_idle(5)
    assert ws.lease("a") is not None  # the load finished after all: later requests get it
    ws.close()


def test_under_pressure_the_prompts_a_resident_draft_keeps_go_before_any_draft():
    """A native draft's own prompt prefixes (DraftModel.prefixes) only save time, as the engine's do."""
    import numpy as np

    from memspec.runtime.prefixes import PrefixCache

    class KV:  # a cache holding n committed positions of 1 MiB each
        def __init__(self, n):
            self.length = n

        def prefix(self, n):
            return np.zeros((n, MiB), dtype=np.uint8)

    ws, loader, _, probe = make(budget_mb=200, floor_mb=100)
    for n in ("b", "c"):
        ws.lease(n).release()
    keep = loader.proposers["b"].prefixes = PrefixCache(64 * MiB)
    assert keep.store(list(range(45)), KV(45)) and keep.report()["bytes"] == 45 * MiB
    probe.available = 60 * MiB  # 40 short: the draft's 45 MiB of prompts are enough, no draft goes
    assert not ws.check_pressure()
    assert set(ws.resident()) == {"b", "c"} and ws.counters.pressure_evictions == 0 and keep.report()["bytes"] == 0
    ws.close()
