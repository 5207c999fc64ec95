"""Test doubles for the working set and the scheduler: a clock, a memory probe, drafts, a loader
and a stand-in predictor; and `wait_for`, for tests that watch a real thread or daemon.  Never
used outside tests."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from memspec.speculation.drafts import Proposal

MiB = 1 << 20


def wait_for(cond, timeout: float = 5.0, interval: float = 0.01) -> None:
    """Poll `cond()` until it holds; fail the test after `timeout` seconds."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(interval)


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        with self._lock:
            self.t += s


@dataclass
class FakeProbe:
    available: int = 8 << 30
    rss: int = 100 * MiB
    limit: int = 0  # a cgroup memory limit (0 = none)
    calls: int = 0

    def available_bytes(self) -> int:
        self.calls += 1
        return self.available

    def rss_bytes(self) -> int:
        return self.rss

    def limit_bytes(self) -> int:
        return self.limit


class FakeState:
    def __init__(self, proposer: "FakeProposer"):
        self.p = proposer
        self.closed = False

    def propose(self, context, k, params, rng, shaper=None, alternatives=False):
        assert not self.closed, f"{self.p.name}: propose after close"
        toks = list(self.p.tokens[:k])
        return Proposal(toks, None, [self.p.entropy] * len(toks))

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeProposer:
    name: str
    nbytes: int
    tokens: list[int] = field(default_factory=lambda: [1, 2, 3])
    entropy: float = 0.5
    states: list = field(default_factory=list)
    feed_s: float | None = None  # its catch-up cost a token, once "timed"

    def begin(self, capacity: int) -> FakeState:
        s = FakeState(self)
        self.states.append(s)
        return s

    def feed_seconds_per_token(self) -> float | None:
        return self.feed_s


class FakeLoader:
    """name -> FakeProposer of sizes[name]; `fail` names raise; each load advances the clock by `load_s`."""

    def __init__(self, sizes: dict[str, int], clock: FakeClock | None = None, load_s: float = 0.0,
                 fail: set[str] | None = None):
        self.sizes, self.clock, self.load_s = sizes, clock, load_s
        self.fail = set(fail or ())
        self.loaded: list[str] = []
        self.proposers: dict[str, FakeProposer] = {}

    def __call__(self, name: str):
        if self.clock is not None:
            self.clock.advance(self.load_s)
        if name in self.fail:
            raise OSError(f"corrupt file for {name}")
        self.loaded.append(name)
        p = FakeProposer(name, self.sizes[name])
        self.proposers[name] = p
        return p, self.sizes[name]


class StandInPredictor:
    """A predictor double: fixed tok/s per draft, and `code` rates once a code block is open; a
    step of any draft is priced at `step_s` (`rate`)."""

    def __init__(self, rates: dict[str, float], code: dict[str, float] | None = None,
                 prior: dict[str, float] | None = None, step_s: float = 0.1):
        self.rates, self.code, self._prior = rates, code or rates, dict(prior or {})
        self.drafts = tuple(rates)
        self.step_s = step_s
        self.calls: list = []

    def rate(self, draft: str, mal: float, drafted: float) -> float:
        return mal / self.step_s

    def prior(self) -> dict[str, float]:
        return dict(self._prior)

    def predict(self, prompt_text: str, ctx=None) -> dict[str, float]:
        self.calls.append((prompt_text, ctx))
        if ctx is not None and ctx.in_code_block:
            return dict(self.code)
        if "code" in prompt_text:
            return dict(self.code)
        return dict(self.rates)
