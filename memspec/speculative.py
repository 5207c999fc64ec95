"""The speculative decode loop: draft proposes, target verifies in one pass, caches roll back.

Per step, with the target cache holding every committed token but the last:

    feed   = [last, d1 .. dk]                  one target forward, k+1 logits rows
    accept = verify_greedy / verify_sampled     (memspec.sampling, pure NumPy)
    commit = d1 .. dn + [recovered | bonus]
    target cache -> committed length - 1       (rollback is a truncation)

The draft state re-syncs itself from the committed context at its next
proposal, so rejected draft tokens are dropped and after a full acceptance the
draft catches up on dk and the bonus token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np

from memspec import sampling
from memspec.drafts import DraftState, Proposal
from memspec.metrics import SpecMetrics
from memspec.request import SamplingParams
from memspec.sessions import DecoderSession, KVCache


@dataclass(frozen=True)
class SpecConfig:
    """How long draft proposals are ([speculative] in the config; [scheduler] picks the draft)."""

    p_min: float = 0.3  # a draft stops proposing when its top probability falls below this
    max_entropy: float = 4.0  # ... or when its entropy (nats) rises above this
    gamma: int = 5  # draft tokens proposed per step at the start
    gamma_min: int = 1  # never propose fewer (while drafting at all)
    gamma_max: int = 8  # never propose more
    adaptive: bool = True  # grow gamma by 1 after a full acceptance, shrink by 1 after a rejection


def next_gamma(cfg: SpecConfig, gamma: int, n_drafted: int, n_accepted: int) -> int:
    """The draft length for the next step, from this step's outcome."""
    if not cfg.adaptive or n_drafted == 0:
        return gamma
    if n_accepted == n_drafted:
        return min(gamma + 1, cfg.gamma_max)
    return max(gamma - 1, cfg.gamma_min)


class DraftSelector(Protocol):
    """Chooses the draft for each step of one request (the scheduler's hook into the loop).

    Called before every step with the committed context and the request's metrics
    so far; returns (draft name, its state) or (None, None) for a target-only step,
    which is how a request degrades mid-run when a draft must be given up.
    """

    def __call__(self, context: list[int], metrics: SpecMetrics) -> tuple[str | None, DraftState | None]: ...

    def close(self) -> None: ...


class FixedDraft:
    """One draft for the whole request."""

    def __init__(self, name: str, state: DraftState):
        self.name, self.state = name, state

    def __call__(self, context: list[int], metrics: SpecMetrics) -> tuple[str, DraftState]:
        return self.name, self.state

    def close(self) -> None:
        self.state.close()


def _pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    if params.greedy:
        return sampling.greedy(logits)
    return sampling.sample(sampling.probabilities(logits, params.temperature, params.top_k, params.top_p), rng)


def speculative_steps(target: DecoderSession, cache: KVCache, prompt: list[int], select: DraftSelector,
                      params: SamplingParams, rng: np.random.Generator, cfg: SpecConfig, metrics: SpecMetrics,
                      clock: Callable[[], float] = time.perf_counter) -> Iterator[list[int]]:
    """Yield the token ids committed at each step (1 .. k+1 per step)."""
    logits = target.forward(cache, prompt, keep=1)[-1]
    context = list(prompt)
    first = _pick(logits, params, rng)
    context.append(first)
    yield [first]
    gamma = cfg.gamma
    while cache.length < cache.capacity:  # the pending last token must fit
        k = min(gamma, cache.capacity - cache.length - 1)
        t0 = clock()
        draft_name, draft = select(context, metrics)
        prop = draft.propose(context, k, params, rng) if draft is not None else Proposal([], None, [])
        t1 = clock()
        feed = [context[-1], *prop.tokens]
        rows = target.forward(cache, feed, keep=len(feed))  # (k+1, V)
        if params.greedy:
            n, nxt = sampling.verify_greedy(rows.argmax(axis=-1), np.asarray(prop.tokens, dtype=np.int64))
        else:
            p = np.stack([sampling.probabilities(r, params.temperature, params.top_k, params.top_p) for r in rows])
            n, nxt = sampling.verify_sampled(p, prop.q, np.asarray(prop.tokens, dtype=np.int64), rng)
        t2 = clock()
        cache.truncate(cache.length - len(feed) + 1 + n)  # keep `last` and the accepted drafts
        committed = [*prop.tokens[:n], nxt]
        context.extend(committed)
        metrics.record_step(draft_name, len(prop.tokens), n, len(committed), t1 - t0, t2 - t1)
        gamma = next_gamma(cfg, gamma, len(prop.tokens), n)
        yield committed
