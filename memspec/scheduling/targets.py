"""The loaded targets: loaded on demand, unloaded when idle, within the memory budget.

`TargetSet` alone owns the set of loaded targets (Ollama's server/sched.go is the
model).  A request acquires its target by name: a loaded one is held at once; one
that is not is loaded on the set's loader thread while every request for it waits
(one load, however many ask).  Loads run one at a time.  Before a target loads,
room is made for it in this order:

1. drafts: each loaded engine gives up its unleased drafts, lowest value per
   byte first (its working set's own order), least recently used engine first;
2. idle targets, least recently used first (`plan_room`);
3. busy targets: they drain first (new requests for them wait), then go.

A target that cannot fit even with every other model gone is refused with
InsufficientMemoryError, with the figures; nothing is unloaded for it.

Each target keeps a `keep_alive` (Ollama's): the last request's, else the
caller's default.  When its last request ends, it expires that many seconds later
(0: at once; KEEP_FOREVER: never, though it may still be evicted to make room).
Expired targets are unloaded by `expire()`, which the reaper thread calls.

Memory is what the process holds: `base` (the process's RSS with no target
loaded) plus each target at its footprint (planned, then what its load added to
the RSS, whichever is larger) plus its resident drafts.  The budget is a ceiling
on that; with no budget, the system's available memory minus a headroom is.

The loader, the planner (store knowledge), the memory probe and the clock are
passed in, so tests run on fakes; `plan_room` and `expired` are pure.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from memspec.errors import (CancelledError, DeadlineExceededError, InsufficientMemoryError, MemspecError,
                            UnavailableError)
from memspec.request import KEEP_FOREVER
from memspec.runtime.memory import MemoryProbe, MiB, reclaim

if TYPE_CHECKING:  # the set itself runs no engine code
    from memspec.speculation.sources import DraftSource

log = logging.getLogger("memspec.targets")

POLL_S = 0.05  # how often a waiting request checks its cancel and deadline
PROGRESS_S = 2.0  # how often a request waiting for a load is told how far it is (acquire's progress)


class Engine(Protocol):
    """What the set needs of a loaded target (memspec.speculation.engine.Engine)."""

    drafts: "DraftSource"  # its own drafts: shrunk to make room, reported with it

    def close(self) -> None: ...


Loader = Callable[[str, str], Engine]  # (name, variant) -> a loaded engine; may raise
Planner = Callable[[str, "str | None"], tuple[str, int]]  # (name, variant or None) -> (variant, planned bytes)


# -- pure functions --------------------------------------------------------------------
@dataclass(frozen=True)
class Resident:
    """A loaded target as room planning sees it."""

    name: str
    nbytes: int  # the target and its resident drafts
    refs: int  # requests holding it (> 0: it must drain before it goes)
    last_used: float  # clock time its last request ended (or it loaded)


@dataclass(frozen=True)
class Room:
    """plan_room's answer: what goes so that a new target fits."""

    evict: tuple[str, ...] = ()  # idle targets to unload now, in order
    drain: tuple[str, ...] = ()  # busy targets to unload once their requests end
    reason: str = ""  # why it cannot fit even with every target gone ("" = it can)


def eviction_order(targets: list[Resident]) -> list[Resident]:
    """First to go first: idle targets before busy ones, each least recently used first."""
    return sorted(targets, key=lambda t: (t.refs > 0, t.last_used, t.name))


def plan_room(need: int, used: int, budget: int, targets: list[Resident]) -> Room:
    """Which loaded targets go so that `need` more bytes fit: `used` (everything the process
    holds, `targets` included) + need <= `budget`."""
    free = budget - used
    if need <= free:
        return Room()
    evict, drain = [], []
    for t in eviction_order(targets):
        if need <= free:
            break
        (drain if t.refs else evict).append(t.name)
        free += t.nbytes
    if need > free:
        held = used - sum(t.nbytes for t in targets)
        return Room(reason=f"it needs {need / MiB:.0f} MiB and the budget is {budget / MiB:.0f} MiB, of which "
                           f"{held / MiB:.0f} MiB stay held with every other target unloaded")
    return Room(tuple(evict), tuple(drain))


@dataclass(frozen=True)
class Idle:
    """A loaded target as expiry sees it."""

    name: str
    refs: int  # requests holding it, or waiting for it
    expires_at: float | None  # clock time; None = never


def expired(targets: list[Idle], now: float) -> list[str]:
    """The targets to unload now: idle ones whose keep-alive has run out."""
    return [t.name for t in targets if t.refs == 0 and t.expires_at is not None and t.expires_at <= now]


# -- the set ------------------------------------------------------------------------------
@dataclass
class TargetCounters:
    """What happened to one target, for GetStatus and /metrics."""

    loads: int = 0  # loads finished
    unloads: int = 0  # unloads (expired, evicted for room, or asked for)
    load_seconds: float = 0.0  # time those loads took
    failed_loads: int = 0  # loads that raised
    refused: int = 0  # loads refused: the target does not fit the memory


@dataclass
class _Target:
    name: str
    variant: str
    keep_alive: float  # seconds it stays once idle (KEEP_FOREVER: never expires)
    nbytes: int  # planned footprint, then what its load added to the RSS when that is more
    state: str = "loading"  # loading -> loaded -> unloading; or failed
    engine: Engine | None = None
    refs: int = 0  # leases held
    waiting: int = 0  # requests blocked until it is loaded
    draining: bool = False  # a load waits for it to go: new requests wait too
    last_used: float = 0.0
    expires_at: float | None = None  # set when it turns idle; None = never
    error: BaseException | None = None  # why its load failed
    since: float = 0.0  # when its load was asked for (progress reports count from it)


class TargetLease:
    """One request's hold on a loaded target; `release()` (idempotent) hands it back."""

    def __init__(self, owner: "TargetSet", entry: _Target, keep_alive: float | None):
        self.name, self.variant, self.engine = entry.name, entry.variant, entry.engine
        self.keep_alive = keep_alive  # the request's (None: the target keeps its own)
        self._owner: TargetSet | None = owner
        self._entry = entry

    def release(self) -> None:
        owner, self._owner = self._owner, None
        self.engine = None  # a lease kept past its request must not keep an unloaded target's memory
        if owner is not None:
            owner._release(self._entry, self.keep_alive)


class TargetSet:
    """The loaded targets, within `budget` bytes (0: the system's available memory less `headroom`)."""

    def __init__(self, loader: Loader, planner: Planner, probe: MemoryProbe, budget: int = 0, headroom: int = 0,
                 clock: Callable[[], float] = time.monotonic, reclaim: Callable[[], None] = reclaim):
        self.loader, self.planner, self.probe, self.clock = loader, planner, probe, clock
        self.budget, self.headroom = budget, headroom
        self._reclaim = reclaim
        self.base = probe.rss_bytes()  # the process with no target: re-measured whenever none is loaded
        self.counters: dict[str, TargetCounters] = {}
        self._entries: dict[str, _Target] = {}
        self._measured: dict[str, int] = {}  # name -> footprint its last load showed
        self._cond = threading.Condition()
        self._load_lock = threading.Lock()  # one load at a time
        self._reaper: threading.Thread | None = None
        self._closed = False

    # -- requests ------------------------------------------------------------------------
    def acquire(self, name: str, variant: str | None = None, keep_alive: float | None = None,
                default_keep_alive: float = KEEP_FOREVER, cancelled: Callable[[], bool] = lambda: False,
                timeout: float | None = None, progress: Callable[[str], None] | None = None) -> TargetLease:
        """Hold `name`, loading it first when it is not loaded (as `variant`; None: the planner's
        choice, or whatever is loaded).  Waits for its load, or for it to drain and come back, at
        most `timeout` seconds and not past `cancelled()`.  keep_alive: this request's (None: the
        target's, else `default_keep_alive` for a target it loads).  progress: told what it waits
        for as the wait begins, then every PROGRESS_S ("loading NAME (VARIANT): 4 s"); called
        under the set's lock, so it must not block.  Raises the load's error
        (InsufficientMemoryError when it does not fit), CancelledError, DeadlineExceededError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        told = None  # when progress was last called
        with self._cond:
            while True:
                if self._closed:
                    raise UnavailableError("the daemon is shutting down and takes no new requests")
                e = self._entries.get(name)
                if e is None:
                    e = self._start_load(name, variant, default_keep_alive if keep_alive is None else keep_alive)
                elif e.state == "loaded" and not e.draining:
                    return self._hold(e, keep_alive)
                if progress is not None and (told is None or time.monotonic() - told >= PROGRESS_S):
                    told = time.monotonic()
                    progress(self._progress(e))
                self._wait_on(e, cancelled, deadline)

    def _progress(self, e: _Target) -> str:
        """Under the lock: what a request waiting for `e` waits for, in words."""
        waited = max(self.clock() - e.since, 0.0)
        if e.state == "loading":
            c = self.counters.get(e.name)
            last = f"; its loads took {c.load_seconds / c.loads:.0f} s on average" if c and c.loads else ""
            return f"loading {e.name} ({e.variant}): {waited:.0f} s{last}"
        return f"waiting for {e.name} ({e.state}{', draining to make room' if e.draining else ''}): {waited:.0f} s"

    def _wait_on(self, e: _Target, cancelled: Callable[[], bool], deadline: float | None) -> None:
        """Under the lock: wait a moment for `e` to load, drain or go; raise its load's error."""
        e.waiting += 1
        try:
            if cancelled():
                raise CancelledError(f"cancelled while waiting for {e.name} to load")
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise DeadlineExceededError(f"the deadline passed while waiting for {e.name} to load")
            self._cond.wait(left)
            if e.state == "failed":
                raise _again(e.error)
        finally:
            e.waiting -= 1
            if e.state == "loaded" and not e.refs and not e.waiting:
                self._idle(e)

    def _hold(self, e: _Target, keep_alive: float | None) -> TargetLease:
        e.refs += 1
        e.expires_at = None
        if keep_alive is not None:
            e.keep_alive = keep_alive  # Ollama: each request sets its model's keep-alive
        return TargetLease(self, e, keep_alive)

    def _release(self, e: _Target, keep_alive: float | None) -> None:
        with self._cond:
            assert e.refs > 0, f"release of {e.name}, which is not held"
            e.refs -= 1
            if keep_alive is not None:
                e.keep_alive = keep_alive
            e.last_used = self.clock()
            if not e.refs and not e.waiting:
                self._idle(e)
            self._cond.notify_all()

    def _idle(self, e: _Target) -> None:
        """Under the lock: no request holds `e`; its keep-alive starts (the reaper unloads it)."""
        e.expires_at = None if e.keep_alive == KEEP_FOREVER else self.clock() + e.keep_alive
        self._cond.notify_all()

    # -- loading -----------------------------------------------------------------------------
    def _start_load(self, name: str, variant: str | None, keep_alive: float) -> _Target:
        """Under the lock: an entry for `name`, loading on a thread of its own."""
        variant, planned = self.planner(name, variant)  # ModelNotFoundError, a variant it lacks
        e = _Target(name, variant, keep_alive, max(planned, self._measured.get(name, 0)), last_used=self.clock(),
                    since=self.clock())
        self._entries[name] = e
        self.counters.setdefault(name, TargetCounters())
        threading.Thread(target=self._load, args=(e,), name=f"memspec-load-{name}", daemon=True).start()
        return e

    def _load(self, e: _Target) -> None:
        with self._load_lock:
            try:
                self._make_room(e)
                rss0, t0 = self.probe.rss_bytes(), self.clock()
                log.info("target loading", extra={"fields": {"model": e.name, "variant": e.variant,
                                                             "planned_bytes": e.nbytes}})
                engine = self.loader(e.name, e.variant)
                seconds, added = self.clock() - t0, self.probe.rss_bytes() - rss0
            except BaseException as exc:  # noqa: BLE001 - every waiter gets the error, the daemon goes on
                self._failed(e, exc)
                return
            with self._cond:
                e.engine, e.state, e.last_used = engine, "loaded", self.clock()
                e.nbytes = self._measured[e.name] = max(e.nbytes, added)
                c = self.counters[e.name]
                c.loads, c.load_seconds = c.loads + 1, c.load_seconds + seconds
                if not e.waiting:
                    self._idle(e)
                self._cond.notify_all()
            log.info("target loaded", extra={"fields": {"model": e.name, "variant": e.variant, "bytes": e.nbytes,
                                                        "load_ms": round(seconds * 1e3, 1),
                                                        "rss_bytes": self.probe.rss_bytes()}})

    def _failed(self, e: _Target, exc: BaseException) -> None:
        with self._cond:
            e.state, e.error = "failed", exc
            if self._entries.get(e.name) is e:
                del self._entries[e.name]
            c = self.counters[e.name]
            if isinstance(exc, InsufficientMemoryError):
                c.refused += 1
            else:
                c.failed_loads += 1
            self._cond.notify_all()
        log.warning("target load failed", extra={"fields": {"model": e.name, "error": str(exc)}})

    def _make_room(self, e: _Target) -> None:
        """Unload what must go for `e` to fit: drafts, then idle targets, then drained ones."""
        try:
            while True:
                self._shrink_drafts(e)
                with self._cond:
                    while any(x.state == "unloading" for x in self._entries.values()):
                        self._cond.wait(POLL_S)  # its memory is not back yet: plan once it is
                    room = self._plan(e)
                    if room.reason:
                        raise InsufficientMemoryError(f"{e.name} ({e.variant}) cannot be loaded: {room.reason}; "
                                                      f"{self._advice()}")
                    for name in room.drain:
                        self._entries[name].draining = True
                    if not room.evict and not room.drain:
                        return
                    victims = [self._take(self._entries[name]) for name in room.evict]
                for victim in victims:
                    self._close(victim, f"to make room for {e.name}")
                if room.drain and not room.evict:
                    self._wait_drained(room.drain)
        finally:
            with self._cond:
                for other in self._entries.values():
                    other.draining = False
                self._cond.notify_all()

    def _loaded(self, but: _Target | None = None) -> list[_Target]:
        return [x for x in self._entries.values() if x is not but and x.state in ("loaded", "unloading")]

    def _plan(self, e: _Target) -> Room:
        """Under the lock: plan_room for `e` over the other loaded targets."""
        others = self._loaded(but=e)
        if not others:
            self.base = self.probe.rss_bytes()
        # requests waiting for a draining target hold no memory: only its leases keep it
        rows = [Resident(x.name, x.nbytes + _draft_bytes(x.engine), x.refs, x.last_used)
                for x in others if x.state == "loaded"]
        used = self._used(others)
        return plan_room(e.nbytes, used, self._budget(used), rows)

    def _budget(self, used: int) -> int:
        return self.budget or used + self.probe.available_bytes() - self.headroom

    def _advice(self) -> str:
        if self.budget:
            return "raise [scheduler] budget_mb, or ask for a smaller model"
        return f"the system has {self.probe.available_bytes() / MiB:.0f} MiB available and {self.headroom / MiB:.0f} " \
               f"MiB must stay free ([server] memory_headroom_mb); free memory, or ask for a smaller model"

    def _shrink_drafts(self, e: _Target) -> None:
        """Drafts first: each loaded engine gives up unleased drafts, least recently used first."""
        with self._cond:
            others = sorted(self._loaded(but=e), key=lambda x: x.last_used)
            short = e.nbytes - (self._budget(self._used(others)) - self._used(others))
        for x in others:
            if short <= 0:
                return
            if x.engine is not None:
                short -= x.engine.drafts.shrink(short)

    def _used(self, others: list[_Target]) -> int:
        return self.base + sum(x.nbytes + _draft_bytes(x.engine) for x in others)

    def _wait_drained(self, names: tuple[str, ...]) -> None:
        with self._cond:
            while any((x := self._entries.get(n)) is not None and x.refs for n in names) and not self._closed:
                self._cond.wait(POLL_S)

    # -- unloading -------------------------------------------------------------------------------
    def _take(self, e: _Target) -> _Target:
        """Under the lock: `e`, idle, leaves the loaded set (requests for it wait until it is gone)."""
        assert e.state == "loaded" and not e.refs, f"unloading {e.name} in use: {e}"
        e.state = "unloading"
        return e

    def _close(self, e: _Target, why: str) -> None:
        """Close `e`'s engine (its drafts go with it) and give its memory back.  The entry held the
        only reference the set keeps; the heap is trimmed once it is dropped."""
        with self._cond:
            engine, e.engine = e.engine, None
        log.info("target unloading", extra={"fields": {"model": e.name, "bytes": e.nbytes, "why": why}})
        try:
            engine.close()
        finally:
            del engine  # the last reference: the heap is trimmed below
            self._reclaim()
            with self._cond:
                if self._entries.get(e.name) is e:
                    del self._entries[e.name]
                self.counters[e.name].unloads += 1
                self._cond.notify_all()
        log.info("target unloaded", extra={"fields": {"model": e.name, "why": why,
                                                      "rss_bytes": self.probe.rss_bytes()}})

    def expire(self) -> list[str]:
        """Unload every idle target whose keep-alive has run out; their names."""
        with self._cond:
            rows = [Idle(x.name, x.refs + x.waiting, x.expires_at) for x in self._loaded() if x.state == "loaded"]
            gone = [self._take(self._entries[n]) for n in expired(rows, self.clock())]
        for e in gone:
            self._close(e, f"idle past its keep_alive of {e.keep_alive:g} s")
        return [e.name for e in gone]

    def unload(self, name: str) -> int | None:
        """Unload `name` now, or once its requests end (admin); its bytes; None: not loaded."""
        with self._cond:
            e = self._entries.get(name)
            if e is None or e.state != "loaded":
                return None
            e.keep_alive, nbytes = 0.0, e.nbytes + _draft_bytes(e.engine)
            if e.refs or e.waiting:  # the last release starts a keep-alive of 0: the reaper unloads it
                e.expires_at = None
                return nbytes
            taken = self._take(e)
        self._close(taken, "on request")
        return nbytes

    def keep(self, name: str, keep_alive: float) -> None:
        """Give loaded `name` a new keep-alive (from now, when it is idle)."""
        with self._cond:
            e = self._entries.get(name)
            if e is not None and e.state == "loaded":
                e.keep_alive = keep_alive
                if not e.refs and not e.waiting:
                    self._idle(e)

    def start(self) -> "TargetSet":
        """Start the reaper thread, which unloads targets as their keep-alive runs out."""
        self._reaper = threading.Thread(target=self._reap, name="memspec-reaper", daemon=True)
        self._reaper.start()
        return self

    def _reap(self) -> None:
        while True:
            try:
                self.expire()
            except Exception:  # noqa: BLE001 - a failed close must not stop the reaper
                log.exception("unloading an expired target failed")
            with self._cond:
                if self._closed:
                    return
                times = [x.expires_at for x in self._entries.values() if x.expires_at is not None]
                self._cond.wait(min([max(t - self.clock(), 0.0) for t in times], default=60.0) + 0.001)

    def close(self) -> None:
        """Stop the reaper and unload every target (daemon shutdown)."""
        with self._cond:
            self._closed = True
            entries = [x for x in self._loaded() if x.state == "loaded"]
            for x in entries:
                x.state = "unloading"
            self._cond.notify_all()
        if self._reaper is not None:
            self._reaper.join()
        for e in entries:
            self._close(e, "shutdown")

    # -- reporting -------------------------------------------------------------------------------
    def engines(self) -> list[tuple[str, Engine]]:
        """(name, engine) of every loaded target, most recently used first."""
        with self._cond:
            rows = sorted(self._loaded(), key=lambda x: -x.last_used)
            return [(x.name, x.engine) for x in rows if x.state == "loaded" and x.engine is not None]

    def status(self) -> list[dict]:
        """One row per target that is loaded, loading, or was ever loaded (loaded first)."""
        with self._cond:
            now, rows = self.clock(), []
            for name, c in self.counters.items():
                e = self._entries.get(name)
                state = ("draining" if e.draining else e.state) if e else "unloaded"
                rows.append({"name": name, "state": state, "variant": e.variant if e else "",
                             "bytes": e.nbytes if e else 0, "active": e.refs if e else 0,
                             "waiting": e.waiting if e else 0, "drafts": _draft_names(e.engine if e else None),
                             "keep_alive_s": _seconds(e.keep_alive) if e else 0.0,
                             "expires_in_s": _seconds(e.expires_at - now if e and e.expires_at is not None
                                                      else KEEP_FOREVER) if e else 0.0, **asdict(c)})
        return sorted(rows, key=lambda r: (r["state"] not in ("loaded", "draining"), r["state"] == "unloaded",
                                           r["name"]))


def _seconds(s: float) -> float:
    """A duration as status shows it: -1 for never."""
    return -1.0 if s == KEEP_FOREVER else max(round(s, 3), 0.0)


def _again(exc: BaseException) -> BaseException:
    """A failed load's error for one more waiter: a fresh exception of the same named kind."""
    return type(exc)(str(exc)) if isinstance(exc, MemspecError) else exc


def _draft_names(engine: Engine | None) -> list[str]:
    return [] if engine is None else [d.name for d in engine.drafts.report().drafts if d.resident]


def _draft_bytes(engine: Engine | None) -> int:
    """What a loaded engine's resident drafts hold."""
    if engine is None:
        return 0
    return sum(d.bytes for d in engine.drafts.report().drafts if d.resident)
