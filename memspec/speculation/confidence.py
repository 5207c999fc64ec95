"""Which of a proposal's tokens are worth a verified row: the target's acceptance by the draft's entropy.

The cost controller (memspec.speculation.speculative.CostController) sets how many tokens a draft
proposes from one acceptance rate for the whole request.  But a draft knows at each position how
sure it is, and that says how often the target takes its token: on the 1.5B's qa, creative and
summarization prompts, the first tokens draft-chat proposed at 4 nats of entropy or more were
accepted 15% of the time (353 of 1016 first tokens), those at 2-4 nats 28%, those under 1.5 nats
65% or more.  A verified row beside the first costs 0.06-0.22 of a one-token pass on a 2-core
Zen 4 (memspec.runtime.costs.LiveCosts), so a token taken 15% of the time loses in one phase of the
machine and pays in another.

AcceptanceByEntropy keeps, per draft and across requests, decayed counts of the positions the
target reached (every accepted token, then the first rejected one) and of those it accepted, in
bins of the draft's entropy there.  keep() gives the prefix of a proposal that commits the most
expected tokens per unit of cost at the current pass costs: all of it, part of it, or none (a plain
target step).  Verifying a shorter chain leaves the output as it was: greedy, the target's own
tokens; sampling, speculative sampling over fewer tokens, exact all the same.
"""

from __future__ import annotations

import bisect
import threading

EDGES = (0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)  # entropy bins' upper edges (nats); one bin above the last
PRIOR = 2.0  # pseudo-positions at the request's own acceptance rate in every bin: a bin seen little says little
DECAY = 0.998  # a bin's counts fade by this per position observed in it: recent requests count most


class AcceptanceByEntropy:
    """Per draft: how often the target accepted a token the draft proposed at a given entropy."""

    def __init__(self):
        self._bins: dict[str, tuple[list[float], list[float]]] = {}  # draft -> (accepted, reached) per bin
        self._lock = threading.Lock()

    @staticmethod
    def bin(entropy: float) -> int:
        return bisect.bisect_right(EDGES, entropy)

    def rate(self, draft: str, entropy: float, prior: float) -> float:
        """The chance the target accepts a token `draft` proposed at `entropy`, where it reaches it;
        `prior`: the request's acceptance rate so far (what a bin seen little is pulled towards)."""
        b = self.bin(entropy)
        with self._lock:
            bins = self._bins.get(draft)
            a, r = (bins[0][b], bins[1][b]) if bins is not None else (0.0, 0.0)
        return (a + PRIOR * prior) / (r + PRIOR)

    def observe(self, draft: str, entropy: list[float], accepted: int) -> None:
        """A verified proposal: its tokens' entropies, and how many of them the target accepted."""
        with self._lock:
            acc, reached = self._bins.setdefault(draft, ([0.0] * (len(EDGES) + 1), [0.0] * (len(EDGES) + 1)))
            for i in range(min(accepted + 1, len(entropy))):  # the positions the target reached
                b = self.bin(entropy[i])
                acc[b] = DECAY * acc[b] + (i < accepted)
                reached[b] = DECAY * reached[b] + 1.0

    def keep(self, draft: str, entropy: list[float], prior: float, verify_cost: list[float],
             draft_cost: float) -> int:
        """How many of a proposal's tokens to verify (0..len(entropy)): the prefix with the most
        expected committed tokens per unit of cost.  verify_cost[n]: a pass of n rows relative to
        one; draft_cost: a drafted token relative to one row, spent whatever is kept."""
        spent = len(entropy) * draft_cost
        best, best_rate = 0, 1.0 / (verify_cost[1] + spent)
        expected, reach = 1.0, 1.0
        for m in range(1, min(len(entropy), len(verify_cost) - 2) + 1):
            reach *= self.rate(draft, entropy[m - 1], prior)
            expected += reach
            rate = expected / (verify_cost[m + 1] + spent)
            if rate > best_rate:
                best, best_rate = m, rate
        return best
