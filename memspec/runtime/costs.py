"""Measured target-pass costs, kept across processes.

The cost controller needs what one target pass over k tokens costs on this machine
(DecoderSession.measure_step_costs).  On a 1.5B target that is 27 passes, seconds of work that
every `memspec generate` and every daemon start would otherwise repeat before its first
drafted token.  This file keeps them in the store (`<home>/costs.json`), keyed by everything
they depend on: the model file (path, size, mtime), ONNX Runtime's version, the providers and
threads, the padding rule, the CPU and its core count.  A machine or a model that changes gets
a new key, and so a new measurement; a curve older than MAX_AGE_S is measured again.

A curve measured while other processes kept the machine busy is used by the process that measured
it but never kept: the next start measures again.  Without that, a daemon started beside a training
run kept a curve of a 1.5B whose one-token pass looked twice as slow as it is (and whose draft
tokens so looked half as costly) for a whole day.
"""

from __future__ import annotations

import json
import math
import os
import platform
import threading
import time
from pathlib import Path
from typing import Callable

COSTS = "costs.json"
MAX_ENTRIES = 32  # oldest keys beyond this are dropped
MAX_AGE_S = 24 * 3600.0  # a curve is measured again after a day
BUSY_SHARE = 0.25  # other processes used more of the machine's CPU than this while measuring: not kept


def timed_curve(run: Callable[[int], object], max_k: int, repeats: int = 3,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of run(k) for k = 1..max_k; index 0 is unused (0.0).

    Each repeat runs every k once, in turn, so that a burst of other work slows all k alike rather
    than one of them; each k keeps its fastest time, since other work only ever adds time; and a
    pass over more tokens is never taken to cost less than one over fewer: the cost controller
    reads the curve's ratios, and a dip would make a longer proposal look free.
    """
    best = [float("inf")] * (max_k + 1)
    for _ in range(repeats):
        for k in range(1, max_k + 1):
            t = clock()
            run(k)
            best[k] = min(best[k], clock() - t)
    out = [0.0]
    for k in range(1, max_k + 1):
        out.append(max(best[k], out[-1]))
    return out


def others_cpu_share(fn: Callable[[], object]) -> tuple[object, float]:
    """fn(), and the share of the machine's CPU time that other processes used while it ran
    (0 = they were idle, 1 = they kept every core busy).  A virtual machine's stolen time counts
    as theirs: it slows the measurement just the same."""
    import psutil

    me = psutil.Process()

    def busy() -> tuple[float, float]:
        t, own = psutil.cpu_times(), me.cpu_times()
        return (t.user + t.nice + t.system + sum(getattr(t, f, 0.0) for f in ("irq", "softirq", "steal")),
                own.user + own.system)

    (all0, own0), w0 = busy(), time.perf_counter()
    result = fn()
    (all1, own1), wall = busy(), time.perf_counter() - w0
    others = (all1 - all0) - (own1 - own0)
    return result, max(0.0, min(1.0, others / max(wall * (psutil.cpu_count() or 1), 1e-9)))


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; elsewhere platform's guess)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_key(model: Path, max_k: int, engine: list, threads: int, min_rows: int) -> str:
    """Everything a measured cost curve depends on, as one string.  engine: what computes the
    passes, with its version (ONNX Runtime's and its providers, or the native kernels' path)."""
    st = model.stat()
    return json.dumps([str(model.resolve()), st.st_size, st.st_mtime_ns, *engine, threads, min_rows, max_k,
                       cpu_name(), os.cpu_count()])


def step_costs(target, max_k: int, context: int = 64, repeats: int = 3) -> list[float]:
    """Seconds of one target forward (memspec.runtime.target.Target) over k tokens after `context`
    cached ones, k = 1..max_k (timed_curve: the fastest of `repeats`, never falling with k).

    Index 0 of the result is unused (0.0).  This is what verifying k-1 draft tokens costs,
    measured on this machine at start-up for the draft-length controller."""
    cache = target.new_cache(context + max_k + 1)
    vocab = target.vocab_size or 1000
    ids = [(17 * i + 3) % vocab for i in range(context + max_k)]
    target.forward(cache, ids[:context], keep=1)

    def run(k: int) -> None:
        cache.truncate(context)
        target.forward(cache, ids[context: context + k], keep=k)

    return timed_curve(run, max_k, repeats)


def pass_costs(batched, max_k: int, context: int = 64, repeats: int = 3,
               one_row: list[float] | None = None) -> dict[int, list[float]]:
    """Seconds of one pass of `batched` (memspec.runtime.target.BatchedPass) over b rows of k tokens
    each after `context` cached tokens, b = 1..batched.rows, k = 1..max_k (timed_curve):
    {b: [unused, k=1, ..., k=max_k]}.  The batched cost controller reads it (what a request's k
    tokens cost inside a pass of b rows).

    Only the passes of one row and of every row are timed; the rows between are interpolated
    (interpolate_rows).  Timing every b was most of a load on demand: 25 of the 0.5B's 30 s on 2
    cores, the passes of 2 and 3 rows half of that.  one_row: the curve of a one-row pass where
    the caller has it already (the native engine's pass over one row is the target's own forward,
    whose step_costs it measured): not timed again."""
    target = batched.target
    vocab = target.vocab_size or 1000
    caches = [target.new_cache(context + max_k + 1) for _ in range(batched.rows)]
    ctx = [(17 * i + 3) % vocab for i in range(context)]
    for c in caches:
        target.forward(c, ctx, keep=1)
    out: dict[int, list[float]] = {} if one_row is None else {1: list(one_row)}
    for b in sorted({1, batched.rows} - set(out)):
        def run(k: int, b: int = b) -> None:
            for c in caches[:b]:
                c.truncate(context)
            batched.forward(caches[:b], [[(5 * j + 11) % vocab for j in range(k)]] * b, [k] * b)

        out[b] = timed_curve(run, max_k, repeats)
    for c in caches:
        batched.release(c)
    return interpolate_rows(out, batched.rows)


def interpolate_rows(measured: dict[int, list[float]], rows: int) -> dict[int, list[float]]:
    """{b: curve} for b = 1..rows from the curves of one row and of `rows` rows, each b between
    them a straight line in b at every k.  A pass reads the weights once and computes each row's
    tokens, so its cost grows about linearly in b (the native engine's rows), or not at all where
    a graph always runs every row (ONNX Runtime's padded batch): the line is right for both.  Each
    curve keeps timed_curve's rule: it never falls with k (a mean of two such curves does not)."""
    one, full = measured[1], measured[rows]
    out = dict(measured)
    for b in range(2, rows):
        w = (b - 1) / (rows - 1)
        out[b] = [(1 - w) * a + w * z for a, z in zip(one, full)]
    return {b: out[b] for b in range(1, rows + 1)}


class CostCache:
    """`<home>/costs.json`: cost curves by cost_key.  A store that cannot be written just
    measures again next time."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time,
                 contention: Callable[[Callable[[], object]], tuple[object, float]] = others_cpu_share):
        self.path = Path(path)
        self.clock = clock
        self.contention = contention  # fn -> (fn(), other processes' CPU share meanwhile)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> list[float] | None:
        entry = self._read().get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("at"), (int, float)):
            return None  # absent, or not an entry (a hand-edited file): measure again
        costs = entry.get("costs")
        if not (isinstance(costs, list) and costs and all(isinstance(c, (int, float)) and c >= 0 for c in costs)):
            return None
        if not 0 <= self.clock() - entry["at"] <= MAX_AGE_S:
            return None
        return [float(c) for c in costs]

    def put(self, key: str, costs: list[float]) -> None:
        if not self.path.parent.is_dir():  # measuring never makes a store
            return
        data = self._read()
        data.pop(key, None)
        data[key] = {"costs": costs, "at": self.clock()}
        data = dict(list(data.items())[-MAX_ENTRIES:])
        try:
            tmp = self.path.with_name(self.path.name + f".{os.getpid()}.partial")
            tmp.write_text(json.dumps(data))
            tmp.replace(self.path)
        except OSError:
            pass

    def measured(self, key: str, measure: Callable[[], list[float]]) -> list[float]:
        """The cached curve for `key`, else measure(), kept if the machine was quiet meanwhile."""
        costs = self.get(key)
        if costs is None:
            costs, others = self.contention(measure)
            if others <= BUSY_SHARE:
                self.put(key, costs)
        return costs


class LiveCosts:
    """The one-request pass costs as the machine runs now: the calibrated curve, corrected by the
    passes the engine times while it serves.

    The curve's shape is what the cost controller reads (what a verified row costs against a step),
    and on a shared virtual machine it moves.  On a 2-core Zen 4 VM the 1.5B's one-row pass took
    23.8 ms in one quarter of an hour and 30 ms in the next, while a pass of 4 rows took 39 and 38
    ms: the one-row pass is bound by memory bandwidth, which the neighbours take, and the wider ones
    by the cores.  A row beside the first cost 0.22 of a step in the first phase and 0.06 in the
    second, and a curve measured once (kept a day in the store) held one phase's shape through the
    other.

    Each row count keeps a running mean of log(timed / calibrated) over the passes of that many
    rows (one outlier, a pass stalled by the collector or another process, moves it by at most
    RATE * CLAMP); a row count not yet timed takes the correction of the nearest one that was.  The
    curve never falls with k (timed_curve's rule).  Thread-safe: one engine's requests share it.
    """

    RATE = 0.05  # weight of a pass in its row count's running mean (about the last 20 passes)
    CLAMP = 0.7  # one pass moves the mean as if it were at most e^0.7 = 2x off the calibrated cost

    def __init__(self, calibrated: list[float]):
        self.base = list(calibrated)
        self._log: list[float | None] = [None] * len(self.base)
        self._nearest: list[int] | None = None  # [k] = the timed row count k takes its correction from
        self._lock = threading.Lock()

    def observe(self, rows: int, seconds: float) -> None:
        """A pass of `rows` tokens of one request took `seconds` (not a batched pass: its rows are
        other requests' too)."""
        if not (1 <= rows < len(self.base)) or not seconds > 0 or not self.base[rows] > 0:
            return
        x = max(-self.CLAMP, min(self.CLAMP, math.log(seconds / self.base[rows])))
        with self._lock:
            cur = self._log[rows]
            if cur is None:  # a row count timed for the first time: the nearest ones change
                self._log[rows], self._nearest = self.RATE * x, None
            else:
                self._log[rows] = cur + self.RATE * (x - cur)

    def __call__(self) -> list[float]:
        """Seconds of a pass over k = 1.. tokens now (index 0 unused), as the calibrated curve is.
        Read before every step of a request: which timed row count stands for each k is worked out
        once per row count first timed, not on every read (it cost 36 us of SmolLM2's 3-4 ms step)."""
        with self._lock:
            logs = list(self._log)
            nearest = self._nearest
            if nearest is None:
                seen = [k for k in range(1, len(logs)) if logs[k] is not None]
                nearest = [0] + [min(seen, key=lambda s: (abs(s - k), s)) if seen else 0
                                 for k in range(1, len(logs))]
                self._nearest = nearest
        if not nearest[-1]:  # nothing timed yet
            return list(self.base)
        out, exp, base = [0.0], math.exp, self.base
        for k in range(1, len(base)):
            out.append(max(base[k] * exp(logs[nearest[k]]), out[-1]))
        return out
