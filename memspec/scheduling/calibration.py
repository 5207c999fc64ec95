"""The predictor's step costs as they are on this machine now.

The predictor (memspec.scheduling.predictor) rates each policy as MAL / (step_s + per_draft_token_s
* drafted): MAL and drafted carry over to any machine, the two costs were fitted on the machine
that recorded the profile.  Elsewhere the costs move, and not all by one factor: on a 2-core AVX2
EPYC a verification pass of three rows costs what one does, where on the AVX-512 EPYC the shipped
profile comes from each extra row cost 0.15 of a step; a tiny draft's step is overhead there and
here alike, while the 0.5B sibling's scales with memory bandwidth.

`LocalCosts` measures it as requests run: for each policy, the seconds its steps took here against
the seconds the profile's costs give for the same steps and drafted tokens.  That ratio (its scale)
divides the policy's predicted rate.  A policy not yet seen here takes the median scale of those
seen (the machine's overall speed), so that none is favoured for being untried; with none seen, the
profile's costs stand.  Sums decay by half once a policy has `window` steps, so a machine that gets
busier, or a draft that moves to other threads, is followed within a few hundred steps.
"""

from __future__ import annotations

import statistics
import threading

from memspec.request import NO_DRAFT

MIN_STEPS = 16  # a policy's steps before its own scale is used
WINDOW = 256  # steps after which a policy's sums are halved


class LocalCosts:
    """Per policy: the seconds its steps took here against what the predictor's costs say."""

    def __init__(self, costs: dict[str, dict], min_steps: int = MIN_STEPS, window: int = WINDOW):
        """costs: the predictor's {policy: {"step_s", "per_draft_token_s"}} (NO_DRAFT among them)."""
        if min_steps < 1 or window < 2 * min_steps:
            raise ValueError(f"min_steps {min_steps} and window {window}: need min_steps >= 1, window >= 2 * min_steps")
        self.costs, self.min_steps, self.window = costs, min_steps, window
        self._sums: dict[str, list[float]] = {}  # policy -> [steps, seconds here, seconds the profile gives]
        self._lock = threading.Lock()  # requests finish on many threads

    def observe(self, name: str, steps: int, drafted: int, seconds: float) -> None:
        """`steps` verification steps of policy `name` (NO_DRAFT: target-only), `drafted` draft
        tokens among them, took `seconds` here (drafting and verification)."""
        cost = self.costs.get(name)
        if cost is None or steps <= 0 or seconds <= 0:
            return  # a policy the predictor does not rate, or nothing measured
        profiled = steps * cost["step_s"] + drafted * cost["per_draft_token_s"]
        with self._lock:
            s = self._sums.setdefault(name, [0.0, 0.0, 0.0])
            s[0], s[1], s[2] = s[0] + steps, s[1] + seconds, s[2] + profiled
            if s[0] >= self.window:
                s[:] = [v / 2 for v in s]

    def scales(self) -> dict[str, float]:
        """{policy: seconds here / seconds profiled} for each policy seen for MIN_STEPS steps."""
        with self._lock:
            return {d: s[1] / s[2] for d, s in self._sums.items() if s[0] >= self.min_steps and s[2] > 0}

    def apply(self, rates: dict[str, float]) -> dict[str, float]:
        """The predictor's {policy: tok/s} at this machine's costs."""
        seen = self.scales()
        if not seen:
            return dict(rates)
        machine = statistics.median(seen.values())
        return {d: v / seen.get(d, machine) for d, v in rates.items()}

    def report(self) -> dict[str, float]:
        """Each scale seen so far, rounded (Scheduler.status: what this machine's costs are)."""
        return {(d if d != NO_DRAFT else "target-only"): round(v, 3) for d, v in sorted(self.scales().items())}
