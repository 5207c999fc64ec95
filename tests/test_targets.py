"""The loaded-target set (memspec.scheduling.targets) on fakes: the pure room planning and expiry,
then TargetSet with a fake loader, memory probe and clock: one load for many requests, keep-alive
on a fake clock, drafts before idle targets before busy ones, a refusal that unloads nothing."""

from __future__ import annotations

import threading
import weakref

import pytest

from fakes import FakeClock, FakeProbe, wait_for

from memspec.errors import CancelledError, DeadlineExceededError, InsufficientMemoryError, ModelFormatError
from memspec.request import KEEP_FOREVER
from memspec.scheduling.targets import Idle, Resident, Room, TargetSet, expired, plan_room
from memspec.speculation.sources import DraftRow, SourceStatus

MiB = 1 << 20


# -- pure functions ------------------------------------------------------------------------------
def test_a_target_that_fits_evicts_nothing():
    assert plan_room(300, 500, 1000, [Resident("a", 400, 0, 1.0)]) == Room()


def test_idle_targets_go_before_busy_ones_least_recently_used_first():
    loaded = [Resident("busy", 300, 2, 0.0), Resident("new", 300, 0, 9.0), Resident("old", 300, 0, 1.0)]
    assert plan_room(300, 1000, 1000, loaded) == Room(evict=("old",))
    assert plan_room(600, 1000, 1000, loaded) == Room(evict=("old", "new"))
    assert plan_room(800, 1000, 1000, loaded) == Room(evict=("old", "new"), drain=("busy",))


def test_a_target_that_cannot_fit_even_alone_is_refused_with_the_figures():
    room = plan_room(950 * MiB, 400 * MiB, 1000 * MiB, [Resident("a", 300 * MiB, 0, 0.0)])
    assert room.evict == () and room.drain == ()
    assert room.reason == "it needs 950 MiB and the budget is 1000 MiB, of which 100 MiB stay held with every " \
                          "other target unloaded"


def test_only_idle_targets_past_their_keep_alive_expire():
    rows = [Idle("due", 0, 10.0), Idle("later", 0, 11.0), Idle("busy", 1, 5.0), Idle("kept", 0, None)]
    assert expired(rows, 10.0) == ["due"]
    assert expired(rows, 20.0) == ["due", "later"]


# -- fakes -----------------------------------------------------------------------------------------
class FakeDrafts:
    """A draft source holding `nbytes` of drafts it may give up."""

    def __init__(self, nbytes: int = 0):
        self.nbytes = nbytes
        self.shrunk: list[int] = []

    def shrink(self, nbytes: int) -> int:
        freed = min(nbytes, self.nbytes)
        self.nbytes -= freed
        self.shrunk.append(freed)
        return freed

    def report(self) -> SourceStatus:
        return SourceStatus([DraftRow("d", True, self.nbytes)] if self.nbytes else [])


class FakeEngine:
    def __init__(self, name: str, drafts: int):
        self.name, self.drafts, self.closed = name, FakeDrafts(drafts), 0

    def close(self) -> None:
        self.closed += 1


class Loads:
    """The loader: an engine per (name, variant), built once `gate` opens; counts its calls."""

    def __init__(self, drafts: dict[str, int] | None = None, fail: set[str] = frozenset()):
        self.calls: list[str] = []
        self.engines: dict[str, FakeEngine] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.drafts, self.fail = drafts or {}, fail

    def __call__(self, name: str, variant: str) -> FakeEngine:
        self.calls.append(name)
        assert self.gate.wait(5)
        if name in self.fail:
            raise ModelFormatError(f"{name}: the file is corrupt")
        self.engines[name] = FakeEngine(name, self.drafts.get(name, 0))
        return self.engines[name]


SIZES = {"a": 300 * MiB, "b": 300 * MiB, "c": 300 * MiB, "huge": 2000 * MiB}


def make(budget_mb: int = 1000, **kw) -> tuple[TargetSet, Loads, FakeClock]:
    """A set whose base (the process with no target) is FakeProbe's 100 MiB RSS."""
    loads, clock = Loads(**kw), FakeClock(100.0)
    planner = lambda name, variant: ("q4", SIZES[name])  # noqa: E731
    return TargetSet(loads, planner, FakeProbe(), budget_mb * MiB, clock=clock, reclaim=lambda: None), loads, clock


def use(ts: TargetSet, name: str, keep_alive: float | None = None, **kw) -> FakeEngine:
    """One request: hold `name`, then hand it back."""
    lease = ts.acquire(name, keep_alive=keep_alive, default_keep_alive=300.0, **kw)
    engine = lease.engine
    lease.release()
    assert lease.engine is None  # a lease kept past its request keeps no engine alive
    return engine


def crowd(ts: TargetSet, loads: Loads, n: int, request) -> None:
    """n requests at once, all waiting for one load before the loader may finish it."""
    loads.gate.clear()
    threads = [threading.Thread(target=request) for _ in range(n)]
    for t in threads:
        t.start()
    wait_for(lambda: ts.status() and ts.status()[0]["waiting"] == n)
    loads.gate.set()
    for t in threads:
        t.join(5)


# -- the set ---------------------------------------------------------------------------------------
def test_concurrent_requests_for_a_target_trigger_one_load():
    ts, loads, _ = make()
    got = []
    crowd(ts, loads, 8, lambda: got.append(use(ts, "a")))
    assert loads.calls == ["a"] and len(got) == 8 and all(e is got[0] for e in got)
    assert ts.status()[0]["loads"] == 1


def test_keep_alive_runs_on_the_clock_from_the_last_release():
    ts, loads, clock = make()
    engine = use(ts, "a", keep_alive=60.0)
    clock.advance(59)
    assert ts.expire() == [] and engine.closed == 0
    assert ts.status()[0]["expires_in_s"] == 1.0
    clock.advance(2)
    assert ts.expire() == ["a"] and engine.closed == 1
    assert ts.status()[0]["state"] == "unloaded" and ts.status()[0]["unloads"] == 1


def test_keep_alive_0_unloads_after_the_answer_and_forever_never():
    ts, loads, clock = make()
    engine = use(ts, "a", keep_alive=0.0)
    assert ts.expire() == ["a"] and engine.closed == 1
    kept = use(ts, "b", keep_alive=KEEP_FOREVER)
    clock.advance(1e9)
    assert ts.expire() == [] and kept.closed == 0 and ts.status()[0]["expires_in_s"] == -1.0


def test_a_held_target_never_expires_and_its_timer_starts_at_release():
    ts, _, clock = make()
    lease = ts.acquire("a", keep_alive=10.0)
    clock.advance(100)
    assert ts.expire() == []
    lease.release()
    clock.advance(9)
    assert ts.expire() == []
    clock.advance(1)
    assert ts.expire() == ["a"]


def test_drafts_are_given_up_before_an_idle_target():
    # base 100 + a 300 + a's drafts 400 = 800 of 1000: b (300) fits once 100 MiB of drafts go
    ts, loads, _ = make(drafts={"a": 400 * MiB})
    a = use(ts, "a")
    use(ts, "b")
    assert a.closed == 0 and a.drafts.shrunk == [100 * MiB] and a.drafts.nbytes == 300 * MiB
    assert [r["name"] for r in ts.status() if r["state"] == "loaded"] == ["a", "b"]


def test_the_least_recently_used_idle_target_goes_first(caplog):
    ts, loads, clock = make(budget_mb=900)
    a = use(ts, "a")  # base 100 + 300 + 300 = 700 of 900: a third needs one gone
    clock.advance(1)
    b = use(ts, "b")
    clock.advance(1)
    use(ts, "a")  # a is now the more recently used
    with caplog.at_level("INFO", logger="memspec.targets"):
        use(ts, "c")
    assert (a.closed, b.closed) == (0, 1)
    gone = [r.fields for r in caplog.records if r.msg == "target unloaded"]
    assert gone == [{"model": "b", "why": "to make room for c", "rss_bytes": 100 * MiB}]


def test_a_busy_target_drains_first_and_new_requests_for_it_wait():
    ts, loads, _ = make(budget_mb=500)  # room for one target at a time
    held = ts.acquire("a")
    a, got = held.engine, []
    t = threading.Thread(target=lambda: got.append(use(ts, "b")))
    t.start()
    wait_for(lambda: {r["name"]: r["state"] for r in ts.status()}.get("a") == "draining")
    with pytest.raises(DeadlineExceededError, match="while waiting for a to load"):
        ts.acquire("a", timeout=0.2)  # it drains: a new request for it waits
    assert a.closed == 0 and loads.calls == ["a"]  # the running request keeps its target
    held.release()
    t.join(5)
    assert got and got[0].name == "b" and a.closed == 1 and loads.calls == ["a", "b"]


def test_a_target_that_cannot_fit_is_refused_and_unloads_nothing():
    ts, loads, _ = make()
    a = use(ts, "a")
    with pytest.raises(InsufficientMemoryError, match=r"huge \(q4\) cannot be loaded: it needs 2000 MiB and the "
                                                      r"budget is 1000 MiB, of which 100 MiB stay held"):
        use(ts, "huge")
    assert a.closed == 0 and loads.calls == ["a"]
    assert use(ts, "a") is a  # and the set keeps serving
    row = {r["name"]: r for r in ts.status()}["huge"]
    assert (row["state"], row["refused"], row["loads"]) == ("unloaded", 1, 0)


def test_a_failed_load_reaches_every_waiter_and_the_next_request_tries_again():
    ts, loads, _ = make(fail={"a"})
    errors = []

    def ask():
        try:
            use(ts, "a")
        except ModelFormatError as exc:
            errors.append(exc)

    crowd(ts, loads, 3, ask)
    assert len(errors) == 3 and loads.calls == ["a"]
    loads.fail = set()
    assert use(ts, "a").name == "a" and loads.calls == ["a", "a"]


class Machine(FakeProbe):
    """500 MiB available with no target loaded; each loaded engine takes its size of it."""

    def __init__(self, loads: Loads):
        super().__init__()
        self.loads = loads

    def available_bytes(self) -> int:
        return 500 * MiB - sum(SIZES[n] for n, e in self.loads.engines.items() if not e.closed)


def test_without_a_budget_the_available_memory_less_the_headroom_holds():
    loads = Loads()
    planner = lambda name, variant: ("q4", SIZES[name])  # noqa: E731
    ts = TargetSet(loads, planner, Machine(loads), 0, headroom=100 * MiB, clock=FakeClock(), reclaim=lambda: None)
    a = use(ts, "a")  # 300 of the 400 MiB that may be used
    use(ts, "b")
    assert a.closed == 1  # b fits only once a is gone
    with pytest.raises(InsufficientMemoryError, match="the system has 200 MiB available and 100 MiB must stay free"):
        use(ts, "huge")


def test_an_unloaded_engine_is_dropped_before_the_heap_is_trimmed():
    """Trimming the heap gives a target's memory back only once nothing references its engine: the
    set keeps none past the unload (a list of victims holding them kept the RSS up)."""
    made, alive_at_reclaim = [], []

    def loader(name, variant):
        made.append(weakref.ref(engine := FakeEngine(name, 0)))
        return engine

    planner = lambda name, variant: ("q4", SIZES[name])  # noqa: E731
    ts = TargetSet(loader, planner, FakeProbe(), 500 * MiB, clock=FakeClock(),
                   reclaim=lambda: alive_at_reclaim.append([r() is not None for r in made]))
    use(ts, "a")
    use(ts, "b")  # a goes first
    assert alive_at_reclaim == [[False]]


def test_a_request_cancelled_while_its_target_loads_leaves_and_the_load_goes_on():
    ts, loads, _ = make()
    loads.gate.clear()
    with pytest.raises(CancelledError, match="cancelled while waiting for a to load"):
        ts.acquire("a", cancelled=lambda: True)
    loads.gate.set()
    wait_for(lambda: ts.status()[0]["state"] == "loaded")
    assert use(ts, "a") is loads.engines["a"] and loads.calls == ["a"]  # loaded once, for the next request


def test_a_request_waiting_for_a_load_is_told_how_it_goes(monkeypatch):
    """acquire(progress=...): what a front end streams while its target loads (issue 45: a load on
    demand was half a minute of silence). As the wait begins, then every PROGRESS_S, on the set's
    clock; a later load of the same target also says what its loads took before."""
    import memspec.scheduling.targets as targets

    monkeypatch.setattr(targets, "PROGRESS_S", 0.0)
    ts, loads, clock = make()
    loads.gate.clear()
    told: list[str] = []
    t = threading.Thread(target=lambda: use(ts, "a", progress=told.append))
    t.start()
    wait_for(lambda: len(told) >= 2)
    clock.advance(12)
    wait_for(lambda: told[-1] == "loading a (q4): 12 s")
    loads.gate.set()
    t.join(5)
    assert told[0] == "loading a (q4): 0 s" and set(told) <= {"loading a (q4): 0 s", "loading a (q4): 12 s"}
    ts.unload("a")
    wait_for(lambda: ts.status()[0]["state"] == "unloaded")
    again: list[str] = []
    use(ts, "a", progress=again.append)
    assert set(again) == {"loading a (q4): 0 s; its loads took 12 s on average"}
    said = len(again)
    use(ts, "a", progress=again.append)  # loaded: nothing to wait for, nothing said
    assert len(again) == said
