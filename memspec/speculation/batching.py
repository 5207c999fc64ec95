"""Continuous batching: one loop owns the target and runs every request's pass together.

    loop = BatchLoop(BatchedTarget(session, rows=4))
    slot = loop.join()                      # a request takes a slot ...
    logits = slot.forward(cache, ids, keep) # ... and its passes join the next batched pass
    slot.leave()                            # finished or cancelled: its row is free at the next pass

Each request still runs its own decode loop (memspec.speculation.speculative) on its own
thread, with its own draft, verification rule, seeded generator and logits shaper (its
penalties, logit_bias: memspec.speculation.logits); only the target pass is shared.  A slot's
`forward` is what the loop calls `target.forward`: it queues the row and waits.
The loop thread runs a pass as soon as every joined slot has queued one (each has drafted), or
when the first queued row has waited `max_wait_s` (a slot that is still drafting, or waiting for
its draft to load, does not hold the others up longer than that).  Like llama.cpp's server slots,
the loop is the one owner of the target; the slots are plain state.

A row's logits are its solo logits bit for bit, whatever else is in the pass (bench/batch_pass.py
measures it; memspec.runtime.batch says why), so batching changes no request's output.
A long prompt is fed in chunks, one per pass, each pass shared with the other rows' decode steps:
it does not stall the other requests for its whole prefill (vLLM's chunked prefill), and its rows
are what one pass would give them, so no answer changes.  A chunk is sized by time (PrefillPace):
while other requests are in the loop, about as many prompt tokens as cost one of their decode
steps, so that each of their tokens waits about two steps, not a 512-token pass; alone, a prompt
is fed `prefill_chunk` tokens a pass ([runtime] prefill_chunk, also the bound on a shared chunk).
A slot's `progress(done, total)` hears of each chunk.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from memspec.errors import ContextOverflowError
from memspec.runtime.contracts import BatchedPass
from memspec.runtime.kvcache import KVCache

Clock = Callable[[], float]
PREFILL_FLOOR = 4  # fewest prompt tokens in a chunk shared with other rows (the others' step reads the
#                    weights anyway: a few prompt rows ride on it at their own cost, so the floor only
#                    keeps the prompt moving where a token costs more than `share` steps)
PREFILL_PROBE = 32  # the first shared chunk, before a prompt token's cost is known: enough rows that
#                     its pass measures it above the noise of a step
PREFILL_SHARE = 1.0  # a shared chunk's own cost, in the other rows' decode steps: their pass then takes
#                      about 1 + this steps (issue 69's bar: inter-token p99 within 3x the median)
PACE_WEIGHT = 0.5  # weight of the newest pass in the running estimates (a prompt token costs more as
#                    the context it attends to grows, so the estimate must follow)


@dataclass
class _Row:
    """One queued row of the next pass."""

    cache: KVCache
    ids: list[int]  # (n,) tokens to feed after the cache's committed ones
    keep: int  # logits rows wanted, from the end
    done: threading.Event = field(default_factory=threading.Event)
    logits: np.ndarray | None = None  # (keep, V), set by the loop
    error: BaseException | None = None


@dataclass
class BatchStats:
    """What GetStatus shows of the loop: pass sizes and slots."""

    passes: int = 0
    rows: Counter = field(default_factory=Counter)  # rows in a pass -> passes
    tokens: Counter = field(default_factory=Counter)  # tokens in a pass, bucketed (1, 2-4, 5-8, ...) -> passes
    busy_s: float = 0.0  # seconds spent in passes

    def count(self, rows: int, tokens: int, seconds: float) -> None:
        self.passes += 1
        self.rows[rows] += 1
        self.tokens[_bucket(tokens)] += 1
        self.busy_s += seconds

    def to_dict(self, slots: int, in_use: int) -> dict:
        out = {"slots": float(slots), "slots_in_use": float(in_use), "passes": float(self.passes),
               "busy_s": round(self.busy_s, 3)}
        out.update({f"rows_{b}": float(n) for b, n in sorted(self.rows.items())})
        out.update({f"tokens_le_{b}": float(n) for b, n in sorted(self.tokens.items())})
        return out


@dataclass
class PrefillPace:
    """Sizes a long prompt's chunks by time, from the passes the loop has timed.

    A pass's seconds are modelled as (its step rows' cost) + (its prompt tokens) x token_s, where a
    step row is a decode step or a verification (a logits row per token) and a prompt row is the
    rest.  A chunk shared with other requests gets share x step_s / token_s tokens, between `floor`
    and the bound (the first, before token_s is known, `probe` tokens); alone, or before any step was
    timed (nobody is streaming yet), the bound."""

    floor: int = PREFILL_FLOOR
    share: float = PREFILL_SHARE
    probe: int = PREFILL_PROBE
    step_s: float | None = None  # seconds of a pass with step rows only (the others' decode steps)
    token_s: float | None = None  # seconds a prompt token adds to a pass

    def observe(self, steps: bool, prompt_tokens: int, seconds: float) -> None:
        """One timed pass: whether it had step rows, how many prompt tokens it fed, how long it took."""
        if not prompt_tokens:
            if steps:
                self.step_s = _blend(self.step_s, seconds)
            return
        extra = seconds - (self.step_s or 0.0) if steps else seconds
        if extra > 0:  # else noise hid the chunk's cost: keep the last estimate
            self.token_s = _blend(self.token_s, extra / prompt_tokens)

    def chunk(self, most: int, others: bool) -> int:
        """Prompt tokens for the next chunk, at most `most` ([runtime] prefill_chunk)."""
        if not others or self.step_s is None:
            return most
        if self.token_s is None:  # a probe first: its pass measures what a token costs
            return min(max(self.probe, self.floor), most)
        return min(most, max(self.floor, round(self.share * self.step_s / self.token_s)))


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - PACE_WEIGHT) * old + PACE_WEIGHT * new


def _steps_and_prompt(rows: Sequence[_Row]) -> tuple[bool, int]:
    """Whether rows hold a step row (a logits row per token), and the prompt tokens the others feed."""
    steps = any(r.keep == len(r.ids) for r in rows)
    return steps, sum(len(r.ids) for r in rows if r.keep != len(r.ids))


def _bucket(n: int) -> int:
    """Upper bound of the power-of-two bucket n falls in (1, 2, 4, 8, ...)."""
    return 1 << max(n - 1, 0).bit_length()


class Slot:
    """One request's place in the batch; `forward` stands in for DecoderSession.forward."""

    trees = False  # a batched pass takes chains only (the loop verifies drafts as chains)
    features = False  # a slot hands over logits only (contracts.FeatureTarget)

    def __init__(self, loop: "BatchLoop"):
        self._loop = loop
        self.left = False
        # told (prompt tokens fed, of how many) after each chunk of a prompt fed in several
        self.progress: Callable[[int, int], None] | None = None

    def forward(self, cache: KVCache, ids: Sequence[int], keep: int = 1) -> np.ndarray:
        """Feed `ids` after the cache's committed tokens in the next batched pass(es); (keep, V)."""
        ids = list(ids)
        if not ids:
            raise ValueError("forward needs at least one token")
        if cache.length + len(ids) > cache.capacity:
            raise ContextOverflowError(
                f"context overflow: {cache.length} cached + {len(ids)} new tokens > capacity {cache.capacity}")
        total, done = len(ids), 0
        keep = min(max(keep, 1), total)
        while len(ids) > keep and len(ids) > (chunk := self._loop.chunk(self)):  # a long prompt: a chunk a
            chunk = min(chunk, len(ids) - keep)  # pass, beside the others' steps; the kept rows in the last
            self._loop.run(self, _Row(cache, ids[:chunk], 1))
            ids, done = ids[chunk:], done + chunk
            if self.progress is not None:
                self.progress(done, total)
        return self._loop.run(self, _Row(cache, ids, keep))

    def leave(self) -> None:
        if not self.left:
            self.left = True
            self._loop.leave(self)


class BatchLoop:
    """The thread that owns the batched target (module docstring)."""

    def __init__(self, target: BatchedPass, max_wait_s: float = 0.02, prefill_chunk: int = 256,
                 clock: Clock = time.perf_counter, pace: PrefillPace | None = None):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk: {prefill_chunk} is out of range; at least 1")
        self.target = target
        self.max_wait_s = max_wait_s
        self.prefill_chunk = prefill_chunk  # a chunk's bound, and a lone prompt's chunk
        self.pace = pace if pace is not None else PrefillPace()  # sizes shared chunks from timed passes
        self.clock = clock
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._members: set[Slot] = set()
        self._queue: list[_Row] = []
        self._first_at = 0.0  # when the oldest queued row arrived
        self._last_end = 0.0  # when the last pass ended: its rows' requests are drafting their next
        self._closed = False
        self._releases: list[KVCache] = []  # caches of requests that left, to unbind
        # (rows, seconds) of each pass a request ran alone with a logits row per token (a verification
        # or a decode step, not a prompt's chunk): the engine's live pass costs (runtime.costs.LiveCosts)
        self.on_alone: Callable[[int, float], None] | None = None
        self._thread = threading.Thread(target=self._run, name="memspec-batch", daemon=True)
        self._thread.start()

    @property
    def slots(self) -> int:
        return self.target.rows

    def join(self) -> Slot:
        slot = Slot(self)
        with self._cond:
            self._members.add(slot)
        return slot

    def leave(self, slot: Slot) -> None:
        with self._cond:
            self._members.discard(slot)
            self._cond.notify_all()  # the rest may all be queued now

    def chunk(self, slot: Slot) -> int:
        """Prompt tokens for slot's next chunk: by time while other requests share the loop."""
        with self._cond:
            return self.pace.chunk(self.prefill_chunk, others=bool(self._members - {slot}))

    def in_use(self) -> int:
        with self._cond:
            return len(self._members)

    def release(self, cache: KVCache) -> None:
        """A request's cache is done with: the loop unbinds it before its next pass, so that the
        target's binding keeps none of its memory."""
        with self._cond:
            self._releases.append(cache)
            self._cond.notify_all()

    def run(self, slot: Slot, row: _Row) -> np.ndarray:
        """The row's logits: from the next batched pass, or, while its slot is the only one, from the
        one-request graph on the caller's thread (its logits are the same bit for bit, and it has no
        dummy rows to pay for)."""
        with self._cond:
            alone = self._members == {slot} and not self._queue
        if alone:
            t = self.clock()
            out = self.target.target.forward(row.cache, row.ids, keep=row.keep)
            dt = self.clock() - t
            with self._cond:
                self.stats.count(1, len(row.ids), dt)
                self.pace.observe(*_steps_and_prompt([row]), dt)
            if self.on_alone is not None and row.keep == len(row.ids):
                self.on_alone(len(row.ids), dt)
            return out
        return self.submit(row)

    def submit(self, row: _Row) -> np.ndarray:
        with self._cond:
            if self._closed:
                raise RuntimeError("the batch loop is closed")
            if not self._queue:
                self._first_at = self.clock()
            self._queue.append(row)
            self._cond.notify_all()
        row.done.wait()
        if row.error is not None:
            raise row.error
        return row.logits

    def _ready(self) -> bool:
        if not self._queue:
            return False
        if len(self._queue) >= min(len(self._members), self.slots) or self._closed:
            return True
        # wait from the later of the oldest row's arrival and the last pass's end: a request whose row
        # was in that pass needs the time to verify and draft before it can queue again, else two
        # requests fall out of step and alternate passes of one row each
        return self.clock() - max(self._first_at, self._last_end) >= self.max_wait_s

    def _run(self) -> None:
        while True:
            rows: list[_Row] = []
            with self._cond:
                while not self._ready() and not self._releases:
                    if self._closed and not self._queue:
                        return
                    self._cond.wait(self.max_wait_s if self._queue else 0.5)
                releases, self._releases = self._releases, []
                if self._ready():
                    rows, self._queue = self._queue[: self.slots], self._queue[self.slots:]
                    self._first_at = self.clock()
            for cache in releases:
                self.target.release(cache)
            if rows:
                self._pass(rows)

    def _pass(self, rows: list[_Row]) -> None:
        t = self.clock()
        try:
            out = self.target.forward([r.cache for r in rows], [r.ids for r in rows], [r.keep for r in rows])
        except BaseException as exc:  # every row of a failed pass gets the error; the loop goes on
            self._last_end = self.clock()
            for r in rows:
                r.error = exc
                r.done.set()
            return
        with self._cond:
            self._last_end = self.clock()
            self.stats.count(len(rows), sum(len(r.ids) for r in rows), self._last_end - t)
            self.pace.observe(*_steps_and_prompt(rows), self._last_end - t)
        for r, logits in zip(rows, out):
            r.logits = logits
            r.done.set()

    def report(self) -> dict:
        with self._cond:
            out = self.stats.to_dict(self.slots, len(self._members))
            for key, s in (("step_ms", self.pace.step_s), ("prompt_token_ms", self.pace.token_s)):
                if s is not None:  # what sizes a long prompt's chunks (PrefillPace), once timed
                    out[key] = round(s * 1e3, 3)
            return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
