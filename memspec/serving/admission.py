"""Admission control: a bounded FIFO queue in front of a few generation slots.

A request arrives needing `kv_bytes` for its KV caches (target, plus its draft's
when one runs).  It starts when it is at the head of the queue, a slot is free,
and `fits()` says its caches fit in the system's free memory; otherwise it
waits.  It is refused at once (OverloadedError, RESOURCE_EXHAUSTED) when the
queue is full or when it could not fit even on an idle daemon (`fits()` fails
and nothing is running that would free memory).  Deadlines and cancellation end
the wait.  The memory budget ([scheduler] budget_mb) is not checked here: the
working set holds it, and the request reserves its KV caches there as it starts
(memspec.scheduling.workingset.WorkingSet.reserve, which waits and refuses the same way).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from memspec.errors import (CancelledError, DeadlineExceededError, InsufficientMemoryError, OverloadedError,
                            UnavailableError)

MiB = 1 << 20
POLL_S = 0.05  # how often a waiting request re-checks cancellation and memory


@dataclass(frozen=True)
class AdmissionConfig:
    max_concurrent: int = 4  # requests generating at once
    max_queue: int = 32  # requests waiting beyond those
    headroom_bytes: int = 256 * MiB  # system memory left free for everything else


def _mb(n: int) -> str:
    return f"{n / MiB:.0f} MiB"


def fits(need: int, available: int, headroom: int, reserved: int = 0) -> str | None:
    """None when a request needing `need` KV bytes may start now, else the reason it may not.

    available: system memory the kernel can still hand out (already net of what is
    allocated); headroom: what must stay free for everything else; reserved: the KV
    bytes running requests were admitted with.  Their pages are committed only as
    they generate, so `available` does not show them yet: they are counted as not
    written (the safe side: a request near its end is counted twice, never zero).
    """
    if need > available - headroom - reserved:
        held = f", {_mb(reserved)} are reserved by running requests" if reserved else ""
        return (f"its KV cache needs {_mb(need)} but the system has {_mb(available)} available{held} "
                f"and {_mb(headroom)} must stay free")
    return None


class Slot:
    """A request's place among the generating ones; `release()` (or leaving the with-block) frees it."""

    def __init__(self, owner: "Admission", kv_bytes: int, queued_s: float):
        self.kv_bytes = kv_bytes
        self.queued_s = queued_s  # time spent waiting for admission
        self._owner = owner
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._owner._release(self)

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Admission:
    """The queue and the slots; thread-safe."""

    def __init__(self, config: AdmissionConfig, available_memory: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._available = available_memory  # memory probe (psutil in the daemon, a fake in tests)
        self._clock = clock
        self._cond = threading.Condition()
        self._waiting: deque[object] = deque()
        self._active = 0
        self._reserved = 0  # KV bytes of the active slots
        self._closed = False

    # -- state ------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self._cond:
            return {"active": self._active, "waiting": len(self._waiting), "kv_bytes": self._reserved}

    def would_queue(self) -> bool:
        """Whether a request arriving now waits for a slot (others are queued, or all slots busy)."""
        with self._cond:
            return bool(self._waiting) or self._active >= self.config.max_concurrent

    def configure(self, config: AdmissionConfig) -> None:
        with self._cond:
            self.config = config
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse new arrivals (shutdown); queued and running requests carry on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- enter / leave ---------------------------------------------------------------
    def enter(self, kv_bytes: int, timeout: float | None = None,
              cancelled: Callable[[], bool] = lambda: False, need: str = "") -> Slot:
        """Wait for a slot; raise OverloadedError (the queue is full), InsufficientMemoryError (its KV
        cannot fit even once the running requests end; `need`: what it asked for, in words, which
        the message starts with), UnavailableError, DeadlineExceededError or CancelledError."""
        t0 = self._clock()
        deadline = None if timeout is None else t0 + timeout
        me = object()
        with self._cond:
            cfg = self.config
            if self._closed:
                raise UnavailableError("the daemon is shutting down and takes no new requests")
            can_start_now = not self._waiting and self._active < cfg.max_concurrent
            if not can_start_now and len(self._waiting) >= cfg.max_queue:
                raise OverloadedError(
                    f"the queue is full: {self._active} requests generating (max_concurrent={cfg.max_concurrent}) "
                    f"and {len(self._waiting)} waiting (max_queue={cfg.max_queue}); retry later"
                )
            self._waiting.append(me)
            try:
                self._wait_turn(me, kv_bytes, deadline, cancelled, need)
            finally:
                self._waiting.remove(me)
                self._cond.notify_all()
            self._active += 1
            self._reserved += kv_bytes
        return Slot(self, kv_bytes, self._clock() - t0)

    def _wait_turn(self, me: object, kv_bytes: int, deadline: float | None, cancelled: Callable[[], bool],
                   need: str = "") -> None:
        while True:
            cfg = self.config
            if self._waiting[0] is me and self._active < cfg.max_concurrent:
                why = fits(kv_bytes, self._available(), cfg.headroom_bytes, self._reserved)
                if why is None:
                    return
                if self._active == 0:  # nothing running will free memory: waiting cannot help
                    raise InsufficientMemoryError(f"not enough memory for this request{need and f' ({need})'}: {why}")
            if cancelled():
                raise CancelledError("cancelled while queued")
            wait = POLL_S
            if deadline is not None:
                left = deadline - self._clock()
                if left <= 0:
                    raise DeadlineExceededError(
                        f"the deadline passed while queued ({len(self._waiting)} waiting, {self._active} generating)"
                    )
                wait = min(wait, left)
            self._cond.wait(wait)

    def _release(self, slot: Slot) -> None:
        with self._cond:
            self._active -= 1
            self._reserved -= slot.kv_bytes
            self._cond.notify_all()
