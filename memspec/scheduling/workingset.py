"""The working set: which drafts are resident beside the target, within a memory budget.

`WorkingSet` alone owns the resident set.  The target is pinned.  Drafts are
loaded on one background loader thread (ONNX Runtime releases the GIL while it
builds a session) and leased to requests: a leased draft is reference counted
and never evicted.  Bytes are accounted before a load starts, so the total
(pinned + resident + loading) never goes over the budget: victims are evicted
first.  Under system pressure (available memory below a floor) unleased drafts
are evicted, and if that is not enough `target_only` is raised so that running
requests give their drafts up.

What the budget counts is what the process holds: the pinned target at the
process's RSS once it is loaded (the runtime, Python and the target's weights),
each draft at its footprint (planned from its file size, then what its load
really added to the RSS, whichever is larger), and the KV caches of running
requests (`reserve`, which evicts unleased drafts to make room).  So the budget
is a ceiling on the process's RSS, not only on its weights.

Admission and eviction are the two small pure functions below.  The loader,
the memory probe and the clock are passed in, so tests run on fakes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

from memspec.errors import CancelledError, ConfigError, InsufficientMemoryError, InvalidRequestError
from memspec.runtime.memory import Ledger, MemoryProbe, MiB, reclaim, tune_malloc

log = logging.getLogger("memspec.workingset")

POLL_S = 0.05  # how often a request waiting for a load checks whether it was cancelled
# Every request asks check_pressure at every step; reading the OS's figure (psutil: /proc/meminfo) took a
# quarter of a request's own time between passes at 4 clients on SmolLM2.  Above the floor, a reading
# stands this long; at or under it, every call reads again.
PRESSURE_PERIOD_S = 0.05

Loader = Callable[[str], tuple[object, int]]  # name -> (proposer, declared bytes); may raise
Clock = Callable[[], float]


# -- pure functions --------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One draft as admission and eviction see it."""

    name: str
    nbytes: int  # declared size
    refs: int = 0  # leases held (and requests waiting for it); > 0 = never evicted
    value: float = 0.0  # expected value while resident (the scheduler's estimate, e.g. tok/s gained x demand)
    last_used: float = 0.0  # clock time of the last lease or release


def value_per_byte(c: Candidate) -> float:
    return c.value / max(c.nbytes, 1)


def eviction_order(resident: list[Candidate]) -> list[Candidate]:
    """Drafts that may be evicted, first to go first: only unreferenced ones that free
    memory; the lowest expected value per byte, then the least recently used."""
    free = [c for c in resident if c.refs == 0 and c.nbytes > 0]
    return sorted(free, key=lambda c: (value_per_byte(c), c.last_used, c.name))


@dataclass(frozen=True)
class LoadDecision:
    """admit()'s answer for one draft load (or KV reservation)."""

    ok: bool
    victims: tuple[str, ...] = ()  # to evict, in order, before loading
    reason: str = ""  # why not (empty when ok)


def admit(new: Candidate, resident: list[Candidate], used: int, budget: int, force: bool) -> LoadDecision:
    """May `new` be loaded now, and what must be evicted first?

    used: bytes already accounted (pinned target + resident + loading drafts);
    budget: 0 = no limit.  force: a request is waiting for this draft, so any
    unreferenced draft may go; otherwise (a preload) only drafts worth less per
    byte than `new`, so a speculative preload never pushes out something better.
    """
    if not budget or used + new.nbytes <= budget:
        return LoadDecision(True)
    pinned_and_held = used - sum(c.nbytes for c in eviction_order(resident))
    if pinned_and_held + new.nbytes > budget:
        return LoadDecision(False, reason=f"{new.name} ({new.nbytes / MiB:.1f} MiB) does not fit the budget of "
                                       f"{budget / MiB:.1f} MiB beside {pinned_and_held / MiB:.1f} MiB pinned or leased")
    victims, freed = [], 0
    for c in eviction_order(resident):
        if used - freed + new.nbytes <= budget:
            break
        if not force and value_per_byte(c) >= value_per_byte(new):
            return LoadDecision(False, reason=f"preloading {new.name} would evict {c.name}, worth as much or more per byte")
        victims.append(c.name)
        freed += c.nbytes
    return LoadDecision(True, tuple(victims))


# -- the working set ---------------------------------------------------------------------
@dataclass
class WorkingSetCounters:
    preloads: int = 0  # loads started ahead of need
    loads: int = 0  # loads finished
    failed_loads: int = 0  # loads that raised (the draft is then unavailable for a while)
    hits: int = 0  # leases that found the draft resident
    misses: int = 0  # leases that did not
    stalls: int = 0  # leases that waited for a load
    stall_ms: float = 0.0  # time those waits took
    evictions: int = 0  # drafts unloaded to make room or under pressure
    pressure_evictions: int = 0  # ... of which under system pressure
    refused: int = 0  # loads admission refused
    bytes_loaded: int = 0
    bytes_evicted: int = 0


@dataclass
class _Entry:
    name: str
    nbytes: int  # declared bytes (accounted from the moment the load is queued)
    state: str = "loading"  # "loading" | "resident"
    proposer: object | None = None
    refs: int = 0  # leases held
    waiting: int = 0  # requests blocked until this load ends
    last_used: float = 0.0
    value: float = 0.0
    load_s: float = 0.0  # how long the load took
    rss_delta: int = 0  # RSS growth during the load (noisy under concurrency)


class Lease:
    """A draft held by one request; `release()` (idempotent) hands it back."""

    def __init__(self, ws: "WorkingSet", name: str, proposer: object):
        self.name, self.proposer = name, proposer
        self._ws: WorkingSet | None = ws

    def release(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            ws._release(self.name)
        self.proposer = None


@dataclass
class _Job:
    name: str
    reclaim_first: bool  # drafts were evicted to make room: give their memory back before loading


class WorkingSet:
    """The resident set: a pinned target plus drafts loaded and evicted within `budget_bytes`."""

    def __init__(self, budget_bytes: int, loader: Loader, probe: MemoryProbe, clock: Clock = time.monotonic,
                 pressure_floor_bytes: int = 0, sizes: dict[str, int] | None = None, retry_after_s: float = 30.0,
                 ledger: Ledger | None = None, reclaim: Callable[[], None] = reclaim,
                 pressure_period_s: float = PRESSURE_PERIOD_S, load_overlap: float = 1.0):
        self.budget = budget_bytes  # 0 = no limit
        # the share of a running request's speed kept while a load runs beside it (scheduler.load_overlap)
        self.load_overlap = load_overlap
        self.loader, self.probe, self.clock = loader, probe, clock
        self.pressure_floor = pressure_floor_bytes  # 0 = never under pressure
        self.pressure_period_s = pressure_period_s  # memory is read at most this often while above the floor
        self._clear_until = float("-inf")  # clock time until which the last reading (above the floor) stands
        self.sizes = dict(sizes or {})  # draft -> declared bytes, known before loading (manifests)
        self.retry_after_s = retry_after_s  # a draft that failed to load is not tried again for this long
        self.ledger = ledger or Ledger()
        self._reclaim = reclaim
        self.counters = WorkingSetCounters()
        self.target_only = False  # raised under pressure once no draft is left to evict
        self.peak_used = 0  # the most bytes ever accounted (never above the budget)
        self._pinned: dict[str, int] = {}
        self._kv: dict[str, int] = {}  # reservation key -> KV bytes of a running request
        self._entries: dict[str, _Entry] = {}
        self._values: dict[str, float] = {}
        self._unavailable: dict[str, float] = {}  # draft -> clock time it may be tried again
        self._spares: list[Callable[[], int]] = []  # caches given up first under pressure: each returns bytes freed
        self._load_rate = 100 * MiB  # bytes per second, updated from real loads
        self._cond = threading.Condition()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        tune_malloc()  # so that evicting a draft gives its memory back (memspec.runtime.memory)

    # -- accounting ------------------------------------------------------------------
    def used_bytes(self) -> int:
        return sum(self._pinned.values()) + sum(self._kv.values()) + sum(e.nbytes for e in self._entries.values())

    def _account(self) -> None:
        used = self.used_bytes()
        assert not self.budget or used <= self.budget, f"working set over budget: {used} > {self.budget} bytes"
        self.peak_used = max(self.peak_used, used)

    def _candidates(self) -> list[Candidate]:
        return [Candidate(e.name, e.nbytes, e.refs + e.waiting + (e.state == "loading"), e.value, e.last_used)
                for e in self._entries.values()]

    def pin(self, name: str, nbytes: int) -> None:
        """Account the target: always resident, never evicted."""
        with self._cond:
            if self.budget and sum(self._pinned.values()) + nbytes > self.budget:
                raise ConfigError(f"[scheduler] budget_mb: {self.budget / MiB:.0f} MiB does not hold {name} "
                                  f"({nbytes / MiB:.1f} MiB); raise it or set 0 (no budget)")
            self._pinned[name] = nbytes
            self.ledger.add("target", name, nbytes)
            self._account()

    def reserve(self, key: str, nbytes: int, cancelled: Callable[[], bool] = lambda: False) -> None:
        """Account a running request's KV caches under `key`, evicting unleased drafts (lowest
        value per byte first) to make room.  While other requests' caches fill the budget it
        waits for them to end; InsufficientMemoryError (507) when nothing running would free enough,
        CancelledError when `cancelled()` turns true while it waits."""
        victims: tuple[str, ...] = ()
        with self._cond:
            while True:  # the same admission as a draft load that a request waits for (force)
                adm = admit(Candidate(key, nbytes), self._candidates(), self.used_bytes(), self.budget, force=True)
                if adm.ok:
                    victims = adm.victims
                    break
                if not self._kv:  # nothing running will free memory: waiting cannot help
                    raise InsufficientMemoryError(
                        f"not enough memory for this request: its KV caches need {nbytes / MiB:.1f} MiB, and the "
                        f"budget of {self.budget / MiB:.0f} MiB holds {self.used_bytes() / MiB:.1f} MiB of models; "
                        f"ask for fewer tokens or raise [scheduler] budget_mb")
                if cancelled():
                    raise CancelledError("cancelled while waiting for memory")
                self._cond.wait(0.05)
            for name in victims:
                self._evict(name, why=f"to make room for the KV caches of {key}")
            self._kv[key] = self._kv.get(key, 0) + int(nbytes)
            self.ledger.add("kv", key, nbytes)
            self._account()
        if victims:
            self._reclaim()

    def unreserve(self, key: str) -> None:
        """The request under `key` ended: its KV bytes are free again."""
        with self._cond:
            if self._kv.pop(key, None) is not None:
                self.ledger.remove("kv", key)
            self._cond.notify_all()

    def set_value(self, name: str, value: float) -> None:
        """The scheduler's expected value of keeping `name` resident (eviction order)."""
        with self._cond:
            self._values[name] = value
            if name in self._entries:
                self._entries[name].value = value

    def expected_load_s(self, name: str) -> float:
        """How long loading `name` should take: its last load, else its size at the observed rate."""
        with self._cond:
            e = self._entries.get(name)
            if e is not None and e.state == "resident":
                return 0.0
            return self.sizes.get(name, 0) / self._load_rate

    def expected_reload_s(self, name: str) -> float:
        """What fetching `name` now would cost later: the expected load time of the drafts worth
        keeping (value > 0) that its load would evict, which the requests that want them next must
        load again.  0.0 when it is resident, fits beside them, or could not be loaded at all."""
        with self._cond:
            if name in self._entries:
                return 0.0
            new = Candidate(name, self.sizes.get(name, 0), 0, self._values.get(name, 0.0), self.clock())
            adm = admit(new, self._candidates(), self.used_bytes(), self.budget, force=True)
            if not adm.ok:
                return 0.0
            return sum(self._entries[v].nbytes for v in adm.victims if self._entries[v].value > 0) / self._load_rate

    def expected_catchup_s(self, name: str, tokens: int) -> float:
        """How long `name` should take to feed `tokens` of context into an empty cache (what a
        request that switches to it pays before its first proposal): its own timed catch-ups when
        it is resident and has run one, else its declared bytes at the per-byte cost of the
        resident drafts that have (a draft's prefill cost grows with its weights); 0.0 when no
        draft was timed yet, or `name` holds no weights."""
        with self._cond:
            timed = {}
            for e in self._entries.values():
                rate = e.proposer.feed_seconds_per_token() if e.state == "resident" else None
                if rate is not None:
                    timed[e.name] = (rate, e.nbytes)
            nbytes = self.sizes.get(name, 0)
        if name in timed:
            return tokens * timed[name][0]
        per_byte = [rate / b for rate, b in timed.values() if b > 0]
        if not nbytes or not per_byte:
            return 0.0
        return tokens * nbytes * sorted(per_byte)[len(per_byte) // 2]

    # -- queries -----------------------------------------------------------------------
    def is_resident(self, name: str) -> bool:
        with self._cond:
            e = self._entries.get(name)
            return e is not None and e.state == "resident"

    def is_available(self, name: str) -> bool:
        """Not in its back-off after a failed load."""
        with self._cond:
            return self._unavailable.get(name, float("-inf")) <= self.clock()

    def resident(self) -> dict[str, int]:
        with self._cond:
            return {n: e.nbytes for n, e in self._entries.items() if e.state == "resident"}

    def proposers(self) -> dict[str, object]:
        """The resident drafts' loaded objects, for what they report (not to run: that takes a lease)."""
        with self._cond:
            return {n: e.proposer for n, e in self._entries.items() if e.state == "resident"}

    # -- loading -------------------------------------------------------------------------
    def _start_load(self, name: str, force: bool) -> bool:
        """Under the lock: admit, evict victims, account and queue the load."""
        if self._closed or self.target_only or not self.is_available(name):
            return False
        nbytes = self.sizes.get(name, 0)
        new = Candidate(name, nbytes, 0, self._values.get(name, 0.0), self.clock())
        adm = admit(new, self._candidates(), self.used_bytes(), self.budget, force)
        if not adm.ok:
            self.counters.refused += 1
            log.debug("load of %s refused: %s", name, adm.reason)
            return False
        for victim in adm.victims:
            self._evict(victim, why=f"to make room for {name}")
        self._entries[name] = _Entry(name, nbytes, value=new.value, last_used=new.last_used)
        self._account()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loader_loop, name="memspec-loader", daemon=True)
            self._thread.start()
        self._jobs.put(_Job(name, bool(adm.victims)))
        return True

    def _evict(self, name: str, why: str, pressure: bool = False) -> None:
        e = self._entries.pop(name)
        assert e.refs == 0 and e.waiting == 0 and e.state == "resident", f"evicting {name} in use: {e}"
        e.proposer = None  # the last reference: its session is freed here, before the heap is trimmed
        self.ledger.remove("draft", name)
        self.counters.evictions += 1
        self.counters.pressure_evictions += int(pressure)
        self.counters.bytes_evicted += e.nbytes
        log.debug("evicted %s (%d bytes) %s", name, e.nbytes, why)

    def _loader_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._load(job)
            except Exception as exc:  # a bad file, or anything around the load: never leave waiters hanging
                log.warning("loading draft %s failed: %s; not retried for %.0f s", job.name, exc, self.retry_after_s)
                with self._cond:
                    e = self._entries.get(job.name)
                    if e is not None and e.state == "loading":
                        del self._entries[job.name]
                    self._unavailable[job.name] = self.clock() + self.retry_after_s
                    self.counters.failed_loads += 1
                    self._cond.notify_all()

    def _load(self, job: _Job) -> None:
        if job.reclaim_first:
            self._reclaim()
        rss0, t0 = self.probe.rss_bytes(), self.clock()
        proposer, declared = self.loader(job.name)
        rss_delta = self.probe.rss_bytes() - rss0
        # what the load really added, when it is more than planned (0-byte proposers stay 0)
        footprint = max(int(declared), rss_delta) if declared else 0
        self._finish_load(job.name, proposer, footprint, self.clock() - t0, rss_delta)
        del proposer  # the working set holds it now; a local here would keep an evicted draft alive

    def _finish_load(self, name: str, proposer: object, declared: int, seconds: float, rss_delta: int) -> None:
        with self._cond:
            e = self._entries.get(name)
            if e is None or self._closed:  # closed while loading
                self._cond.notify_all()
                return
            self.sizes[name] = declared
            if declared != e.nbytes:  # the plan was wrong: account the real size, still within budget
                others = self.used_bytes() - e.nbytes
                if self.budget and others + declared > self.budget:
                    log.warning("draft %s takes %d bytes, not the %d planned, and does not fit: dropped",
                                name, declared, e.nbytes)
                    del self._entries[name]
                    self.counters.failed_loads += 1
                    self._cond.notify_all()
                    return
                e.nbytes = declared
            e.state, e.proposer, e.load_s, e.rss_delta = "resident", proposer, seconds, rss_delta
            self.ledger.add("draft", name, declared)
            self.counters.loads += 1
            self.counters.bytes_loaded += declared
            if seconds > 0 and declared > 0:
                self._load_rate = 0.5 * self._load_rate + 0.5 * declared / seconds
            self._account()
            log.debug("loaded %s: %d bytes declared, RSS %+d, %.1f ms", name, declared, rss_delta, seconds * 1e3)
            self._cond.notify_all()

    def preload(self, name: str) -> bool:
        """Start loading `name` in the background if admission allows it without pushing out
        anything worth more; True when it is resident or on its way."""
        with self._cond:
            if name in self._entries:
                return True
            if self._start_load(name, force=False):
                self.counters.preloads += 1
                log.debug("preloading %s", name)
                return True
            return False

    def fetch(self, name: str) -> bool:
        """Start loading `name` in the background for a request that wants it now (any unleased
        draft may be evicted for it); True when it is resident or on its way."""
        with self._cond:
            return name in self._entries or self._start_load(name, force=True)

    def lease(self, name: str, wait: bool = True, timeout: float | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> Lease | None:
        """Hold `name` for a request.  Resident: a hit.  Otherwise a miss, and with `wait`
        the request stalls until it is loaded (counted), for at most `timeout` seconds and
        not past `cancelled()`; None when it cannot be had."""
        with self._cond:
            e = self._entries.get(name)
            if e is not None and e.state == "resident" and not self.target_only:
                return self._hold(e, hit=True)
            self.counters.misses += 1
            if not wait or self.target_only:
                return None
            if e is None:
                if not self._start_load(name, force=True):
                    return None
                e = self._entries[name]
            e.waiting += 1
            t0 = time.monotonic() if timeout is not None else 0.0
            c0 = self.clock()
            try:
                while self._entries.get(name) is e and e.state == "loading" and not cancelled():
                    left = POLL_S if timeout is None else min(POLL_S, timeout - (time.monotonic() - t0))
                    if left <= 0:
                        break
                    self._cond.wait(left)  # woken by the load's end; polls for the cancel
            finally:
                e.waiting -= 1
            stall_ms = (self.clock() - c0) * 1e3
            self.counters.stalls += 1
            self.counters.stall_ms += stall_ms
            log.debug("stalled %.1f ms for %s", stall_ms, name)
            if self._entries.get(name) is not e or e.state != "resident":
                return None
            return self._hold(e, hit=False)

    def _hold(self, e: _Entry, hit: bool) -> Lease:
        e.refs += 1
        e.last_used = self.clock()
        self.counters.hits += int(hit)
        return Lease(self, e.name, e.proposer)

    def _release(self, name: str) -> None:
        with self._cond:
            e = self._entries.get(name)
            if e is None and self._closed:  # close() dropped it while the request ran
                return
            assert e is not None and e.refs > 0, f"release of {name}, which is not leased"
            e.refs -= 1
            e.last_used = self.clock()

    def unload(self, name: str) -> int:
        """Evict `name` now if no request holds it; returns the bytes freed (0 if it was not resident)."""
        with self._cond:
            e = self._entries.get(name)
            if e is None or e.state != "resident":
                return 0
            if e.refs or e.waiting:
                raise InvalidRequestError(f"name: {name!r} is in use by {e.refs} request(s); unload it when they end")
            self._evict(name, why="on request")
        self._reclaim()
        return e.nbytes

    def shrink(self, nbytes: int) -> int:
        """Evict unleased drafts, lowest value per byte first, until `nbytes` are freed (room for
        another target); returns the bytes freed."""
        freed = 0
        with self._cond:
            for c in eviction_order(self._candidates()):
                if freed >= nbytes:
                    break
                self._evict(c.name, why="to make room for another target")
                freed += c.nbytes
        if freed:
            self._reclaim()
        return freed

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no load is queued or running (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(e.state == "loading" for e in self._entries.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # -- pressure --------------------------------------------------------------------------
    def add_spare(self, release: Callable[[], int]) -> None:
        """A cache that only saves time (the engine's prompt prefixes): under pressure it is
        emptied before any draft is evicted.  release() drops it and returns the bytes freed."""
        with self._cond:
            self._spares.append(release)

    def check_pressure(self) -> bool:
        """Under the floor of available memory, empty the spare caches (the engine's, then the prompts
        resident drafts keep: a proposer's `prefixes`), then evict unleased drafts;
        if that is not enough, raise `target_only` (lowered again once memory is back).  Returns
        target_only.  A reading above the floor stands for `pressure_period_s`."""
        if not self.pressure_floor:
            return False
        now = self.clock()
        if now < self._clear_until:  # read above the floor a moment ago
            return False
        avail = self.probe.available_bytes()
        evicted = False
        with self._cond:
            if avail >= self.pressure_floor:
                if self.target_only:
                    log.info("memory pressure over (%d MiB available): drafts allowed again", avail // MiB)
                self.target_only = False
                self._clear_until = now + self.pressure_period_s
                return False
            freed = 0
            releases = [*self._spares, *(keep.clear for e in self._entries.values()  # drafts' own (DraftModel)
                                         if (keep := getattr(e.proposer, "prefixes", None)) is not None)]
            for release in releases:
                got = release()
                if got:
                    log.info("memory pressure: %d MiB available; dropped %d MiB of cached prompt prefixes",
                             avail // MiB, got // MiB)
                    freed += got
                    evicted = True
            for c in eviction_order(self._candidates()):
                if avail + freed >= self.pressure_floor:
                    break
                self._evict(c.name, why=f"under pressure ({avail // MiB} MiB available)", pressure=True)
                freed += c.nbytes
                evicted = True
            if avail + freed < self.pressure_floor and not self.target_only:
                log.warning("memory pressure: %d MiB available, floor %d MiB; running target-only",
                            avail // MiB, self.pressure_floor // MiB)
                self.target_only = True
            out = self.target_only
        if evicted:
            self._reclaim()
        return out

    # -- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the loader and drop every draft (leases still held keep theirs alive)."""
        with self._cond:
            self._closed = True
            for name in list(self._entries):
                self.ledger.remove("draft", name)
            self._entries.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        self._reclaim()

    def status(self) -> dict:
        with self._cond:
            return {
                "budget_bytes": self.budget,
                "used_bytes": self.used_bytes(),
                "peak_used_bytes": self.peak_used,
                "pressure_floor_bytes": self.pressure_floor,
                "target_only": self.target_only,
                "pinned": dict(self._pinned),
                "kv_bytes": sum(self._kv.values()),
                "drafts": {n: {"bytes": e.nbytes, "state": e.state, "leases": e.refs, "value": round(e.value, 4),
                               "load_ms": round(e.load_s * 1e3, 1), "rss_delta_bytes": e.rss_delta}
                           for n, e in sorted(self._entries.items())},
                "unavailable": sorted(n for n, t in self._unavailable.items() if t > self.clock()),
                "counters": asdict(self.counters),
            }
