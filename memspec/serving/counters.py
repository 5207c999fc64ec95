"""What the daemon counts about the requests it serves, whichever front end they came by.

Counted here (plain Python, thread-safe, no exporter imported); read by GetStatus
(memspec.serving.service.Service.status) and exported for Prometheus by
memspec.serving.prometheus.  The names follow vLLM's: prompt and generation
tokens, time to first token, inter-token latency, end-to-end latency, queue time.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

OUTCOMES = ("completed", "cancelled", "rejected", "invalid", "failed")  # memspec.errors.Status.outcome

# seconds; vLLM's TTFT and ITL buckets cut to what a small model on an edge device sees
TTFT_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


@dataclass
class RequestCounters:
    """Generation requests by outcome, and their tokens (what GetStatus shows as "requests")."""

    started: int = 0  # admitted to generation
    completed: int = 0
    cancelled: int = 0  # the client left, or its deadline passed
    rejected: int = 0  # queue full, no memory, starting, draining, no model, bad key
    invalid: int = 0  # a bad field, an unknown model
    failed: int = 0  # an internal error
    prompt_tokens: int = 0  # of the requests that finished
    generation_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, outcome: str, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens

    def to_dict(self) -> dict:
        with self.lock:
            return {k: getattr(self, k) for k in ("started", *OUTCOMES, "prompt_tokens", "generation_tokens")}


@dataclass
class Histogram:
    """Observations counted into fixed buckets (upper bounds, seconds), Prometheus-style."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # [i] = observations <= buckets[i] and > buckets[i-1]; [-1]: +Inf
    sum: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, n: int = 1) -> None:
        with self.lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += n
            self.sum += value * n

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (upper bound, count) pairs ending with "+Inf", and the sum."""
        with self.lock:
            counts, total = list(self.counts), self.sum
        out, running = [], 0
        for bound, c in zip([*map(str, self.buckets), "+Inf"], counts):
            running += c
            out.append((bound, running))
        return out, total


@dataclass
class LatencyHistograms:
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))  # arrival to first token
    itl_s: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))  # between committed tokens
    e2e_s: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))  # arrival to the last token
    queue_s: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))  # waiting for admission


class RequestClock:
    """One request's timeline, fed to the histograms as its tokens come out.

    A step that commits n tokens after dt seconds counts n inter-token latencies
    of dt / n, as memspec.speculation.metrics.SpecMetrics does."""

    def __init__(self, histograms: LatencyHistograms, arrived: float):
        self.h = histograms
        self.arrived = arrived
        self.last: float | None = None  # when the previous token came out

    def queued(self, seconds: float) -> None:
        self.h.queue_s.observe(seconds)

    def tokens(self, n: int, now: float) -> None:
        if n <= 0:
            return
        if self.last is None:  # the prefill commits one token
            self.h.ttft_s.observe(now - self.arrived)
        else:
            self.h.itl_s.observe((now - self.last) / n, n)
        self.last = now

    def finished(self, now: float) -> None:
        self.h.e2e_s.observe(now - self.arrived)
