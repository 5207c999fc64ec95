"""One request's draft selector: the lease it holds, what its steps showed, switching and degrading.

The scheduler's policies hand each request a `RequestSelector` (a DraftSelector of
memspec.speculation.speculative).  It holds at most one draft lease from the
working set at a time and releases it when the request ends, however it ends (the
engine closes the selector on completion, cancellation and exceptions).  Under
memory pressure it drops its draft and the request goes on target-only; with a
`switcher` (the memspec policy) it reconsiders every few steps.  What a draft's steps showed stands
for it while the request runs without it (so that it does not go back and forth), but not for the
rest of the request: the text may change character (a code block, a passage quoted from the prompt),
so the switcher may set it aside (`set_aside`) once the request has run `PROBE_EVERY` steps without
the draft, twice as long after each time it left the draft again, up to `PROBE_MAX` (then it stands),
the backoff of the cost controller's probes.  A draft taken again starts over: a new state, a new
cost controller in the decode loop, and its steps counted afresh.  Drafts the request has not run
yet are tried on the same backoff (`may_try`): the first at once, each further one 16, 32, then 64
steps after the last, then no more, unless the text changed since the last (its prediction rose by
more than the margin): where every draft's prediction is too high (advice on SmolLM2: each predicted
1.15-1.3x target-only, each accepting a quarter), a request does not pay a catch-up over the whole
context and the cost controller's first steps for one draft after another.  With a `recall` (the
scheduler's, where it holds the suffix draft), a step whose text's end agrees long with a
request the daemon saw proposes what followed there instead (memspec.speculation.suffix.Recall),
whichever draft the request holds, and that step counts as the suffix draft's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from memspec.request import NO_DRAFT, GenerationRequest
from memspec.scheduling.workingset import Lease, WorkingSet
from memspec.speculation.logits import IDENTITY
from memspec.speculation.metrics import SpecMetrics
from memspec.speculation.speculative import CostController
from memspec.speculation.suffix import SUFFIX

log = logging.getLogger("memspec.scheduler")
WINDOW_STEPS = 16  # steps of each draft's (drafted, accepted) a request keeps (`window`); memspec leaves a
#                   draft that drafted nothing in all of them
ACCEPTANCE_MIN_TOKENS = 4  # a draft's recent acceptance is told the predictor over at least this many drafted
#                            tokens: it learnt it over 4 or more (99% of SmolLM2's profiled segments; median 15)
PROBE_EVERY, PROBE_MAX = CostController.PROBE_EVERY, CostController.PROBE_MAX  # a left draft's steps stand this long
ASK_SHARE = 0.02  # the switcher takes at most this share of a request's time: on SmolLM2 an ask (about 1 ms)
#                   every 8 steps of 3-4 ms was 3%; on the 1.5B (70 ms steps) it still asks every 8


class _Watched:
    """A draft state that remembers the entropy of its proposals."""

    def __init__(self, state, entropies: deque):
        self.state, self.entropies = state, entropies

    def propose(self, context, k, params, rng, shaper=IDENTITY, alternatives=False):
        prop = self.state.propose(context, k, params, rng, shaper, alternatives)
        self.entropies.extend(prop.entropy)
        return prop

    def close(self) -> None:
        self.state.close()


class RequestSelector:
    """The DraftSelector of one request."""

    def __init__(self, ws: WorkingSet, count: Callable[[str], None], req: GenerationRequest, prompt: list[int],
                 capacity: int, lease: Lease | None, on_close: Callable[["RequestSelector"], None] | None = None,
                 switcher: Callable[["RequestSelector"], None] | None = None, switch_every: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        """ws: where its leases come from; count: the scheduler's counter; switcher: called every
        `switch_every` steps to reconsider the draft, and no more often than keeps its own time
        within ASK_SHARE of the request's (timed on `clock`); on_close: called once when the request ends."""
        self.ws, self.count, self.req, self.capacity = ws, count, req, capacity
        self.n_prompt = len(prompt)
        self.on_close, self.switcher, self.switch_every = on_close, switcher, switch_every
        self.clock = clock
        self._asked = (0, clock(), 0.0)  # the step and the time of the last ask, and what asking took
        self.lease: Lease | None = None
        self.state = None
        self.pending: str | None = None  # a draft loading in the background, switched to once resident
        self.steps = 0
        self.context: list[int] = list(prompt)
        self.metrics = SpecMetrics()
        self.entropies: deque[float] = deque(maxlen=32)
        self.window: dict[str, deque] = {}  # draft -> recent (drafted, accepted) per step
        self.observed: dict[str, list[float]] = {}  # draft -> [tokens, seconds] in this request
        self.predicted: dict[str, float] = {}  # draft -> tok/s predicted when it was chosen
        self._last = (0, 0, 0, 0.0)  # metrics totals at the previous step
        self._ran: str | None = None  # the draft the previous step ran with
        self.broken: set[str] = set()  # drafts that raised in this request: never taken again by it
        # draft -> (the step the request left it at, steps its window stands for it, its prediction then)
        self.left: dict[str, tuple[int, int, float]] = {}
        # drafts taken for the first time in this request, the step of the last, and every prediction then
        self.tries, self.tried_at, self.tried_with = 0, 0, {}
        self.closed = False
        self.recall = None  # a memspec.speculation.suffix.Recall, set by the scheduler (None: no recall)
        if lease is not None:
            self._take(lease)

    @property
    def name(self) -> str | None:
        return self.lease.name if self.lease is not None else None

    @property
    def generated(self) -> list[int]:
        """The token ids committed after the prompt so far."""
        return self.context[self.n_prompt:]

    def _take(self, lease: Lease) -> None:
        """Run with the leased draft; a draft whose state cannot be made (its cache allocation
        fails) is handed back at once and the request goes on target-only."""
        try:
            state = lease.proposer.begin(self.capacity)
        except Exception as exc:
            lease.release()
            self._give_up(lease.name, exc)
            return
        self.lease, self.state = lease, _Watched(state, self.entropies)
        self.window.pop(lease.name, None)  # a new state (and cost controller) starts over: so do its steps

    def failed(self, name: str, exc: Exception) -> None:
        """The draft raised mid-request: drop it; the rest of the request runs without it."""
        self.drop()
        self._give_up(name, exc)

    def _give_up(self, name: str, exc: Exception) -> None:
        self.broken.add(name)
        self.count("draft_failures")
        log.warning("request %s gives up draft %s (%s: %s)", id(self), name, type(exc).__name__, exc)

    def drop(self) -> None:
        """Give the current draft back (its state first, then the lease)."""
        if self.state is not None:
            self.state.close()
            self.state = None
        if self.lease is not None:
            name = self.lease.name
            self.lease.release()
            self.lease = None
            _, holds, _ = self.left.get(name, (0, PROBE_EVERY // 2, 0.0))
            self.left[name] = (self.steps, 2 * holds, self.predicted.get(name, 0.0))

    def set_aside(self, name: str, predicted: float, margin: float) -> bool:
        """Whether the steps `name` ran in this request no longer stand for it: the request left it
        long enough ago (the module's docstring: 8, 16, 32, 64 steps, then never) and its prediction
        for the text now, `predicted`, is above the one it was left with by more than `margin` (the
        text changed character; a prediction that stayed where it was says nothing new, and a
        request where no draft pays does not pay a draft's catch-up again and again)."""
        if name == self.name or name not in self.left:
            return False
        at, holds, then = self.left[name]
        return holds <= PROBE_MAX and self.steps - at >= holds and predicted > then * (1 + margin)

    def untried(self, name: str) -> bool:
        """Whether `name` has not run in this request (neither now nor before)."""
        return name != self.name and name not in self.window and name not in self.left

    def may_try(self, name: str, predicted: float, margin: float) -> bool:
        """Whether the switcher may take `name`, a draft the request has not run, now: the first such
        at any time; each further one once the request has run twice as long as before the last
        (16, 32, 64 steps, then never: the cost controller's backoff), or where its prediction for the
        text now is above the one it had at the last first try by more than `margin` (the text changed)."""
        if self.tries == 0 or predicted > self.tried_with.get(name, 0.0) * (1 + margin):
            return True
        wait = PROBE_EVERY << self.tries
        return wait <= PROBE_MAX and self.steps - self.tried_at >= wait

    def tried(self, predicted: dict[str, float]) -> None:
        """The switcher takes a draft the request has not run (may_try); `predicted`: every draft's prediction now."""
        self.tries, self.tried_at, self.tried_with = self.tries + 1, self.steps, dict(predicted)

    def switch_to(self, lease: Lease, why: str) -> None:
        if lease.name in self.broken:  # it failed in this request: stay on the current one
            lease.release()
            return
        old = self.name
        self.drop()
        self._take(lease)
        self.count("switches")
        log.debug("request %s: switched %s -> %s at position %d (%s)", id(self), old, lease.name,
                  len(self.generated), why)

    def _observe(self, metrics: SpecMetrics) -> None:
        """Attribute the previous step's outcome to the draft that ran it."""
        now = (metrics.num_draft_tokens, metrics.num_accepted_tokens, len(metrics.token_latencies_s),
               metrics.draft_s + metrics.verify_s)
        d_drafted, d_accepted, d_tokens, d_s = (a - b for a, b in zip(now, self._last))
        self._last = now
        name = self._ran or NO_DRAFT
        if self.steps > 1:
            self.window.setdefault(name, deque(maxlen=WINDOW_STEPS)).append((d_drafted, d_accepted))
            obs = self.observed.setdefault(name, [0.0, 0.0])
            obs[0] += d_tokens
            obs[1] += d_s

    def observed_rate(self, name: str, min_tokens: int) -> float:
        """Tokens a second this request committed with `name` (NO_DRAFT: target-only), once at
        least `min_tokens` ran on it; else 0.0."""
        tokens, seconds = self.observed.get(name, (0.0, 0.0))
        return tokens / seconds if tokens >= min_tokens and seconds > 0 else 0.0

    def recent_quantities(self, name: str) -> tuple[float, float, int]:
        """(tokens committed a step, draft tokens a step, steps) over `name`'s recent steps
        (its last WINDOW_STEPS) in this request; (0, 0, 0) before any."""
        steps = self.window.get(name)
        if not steps:
            return 0.0, 0.0, 0
        n = len(steps)
        return 1.0 + sum(a for _, a in steps) / n, sum(d for d, _ in steps) / n, n

    def recent_acceptance(self) -> dict[str, float]:
        """Each draft's accepted share of its recent steps' tokens (the predictor's generation context);
        not the recall's steps (counted as the suffix draft's): copies of an earlier answer say
        nothing of how the drafts the policy picks from would do here.  Nor a share of fewer than
        ACCEPTANCE_MIN_TOKENS tokens: where the cost controller has stopped a draft, its window holds
        a probe or two, and one accepted probe (1.0) had the predictor expect every draft at twice
        target-only's speed on SmolLM2's advice prompts, where each accepts a quarter."""
        out = {}
        for name, steps in self.window.items():
            drafted = sum(d for d, _ in steps)
            if drafted >= ACCEPTANCE_MIN_TOKENS and not (name == SUFFIX and self.recall is not None):
                out[name] = sum(a for _, a in steps) / drafted
        return out

    def mean_entropy(self) -> float:
        """Mean draft entropy over the recent proposals (NaN: no model draft proposed yet)."""
        return sum(self.entropies) / len(self.entropies) if self.entropies else float("nan")

    def __call__(self, context: list[int], metrics: SpecMetrics):
        self.steps += 1
        self.context, self.metrics = context, metrics
        self._observe(metrics)
        if self.ws.check_pressure():
            if self.lease is not None:
                log.info("memory pressure: request %s drops %s and runs target-only", id(self), self.name)
                self.count("degraded")
                self.drop()
            self.pending = None
        else:
            if self.pending is not None and self.ws.is_resident(self.pending):
                lease = self.ws.lease(self.pending, wait=False)
                self.pending = None
                if lease is not None:
                    self.switch_to(lease, "its background load finished")
            if self.switcher is not None and self._ask_due():
                t0 = self.clock()
                self.switcher(self)
                took = self.clock() - t0
                self._asked = (self.steps, t0, took if not self._asked[2] else 0.5 * (self._asked[2] + took))
        if self.recall is not None and self.name != SUFFIX and self.recall.check(context):
            self._ran = SUFFIX
            return SUFFIX, self.recall
        self._ran = self.name
        return (self.name, self.state) if self.lease is not None else (None, None)

    def _ask_due(self) -> bool:
        """Whether the switcher is asked at this step: `switch_every` steps after the last ask, once
        the time since is at least what an ask takes over ASK_SHARE."""
        step, at, took = self._asked
        return self.steps - step >= self.switch_every and self.clock() - at >= took / ASK_SHARE

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.on_close is not None:
                self.on_close(self)
        finally:
            self.drop()
