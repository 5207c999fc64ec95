"""The speculative decode loop: draft proposes, target verifies in one pass, caches roll back.

Per step, with the target cache holding every committed token but the last:

    feed   = [last, d1 .. dk]                  one target forward, k+1 logits rows
    accept = verify_greedy / verify_coupled     (memspec.speculation.sampling, pure NumPy: the argmax
             / verify_sampled                   of each row, plus the position's noise when sampling;
                                                 the standard scheme's rule under [speculative] sampling)
    commit = d1 .. dn + [recovered | bonus]
    target cache -> committed length - 1       (rollback is a truncation)

The draft state re-syncs itself from the committed context at its next
proposal, so rejected draft tokens are dropped and after a full acceptance the
draft catches up on dk and the bonus token.

A request's output controls (penalties, logit_bias, a grammar) are its logits shaper
(memspec.speculation.logits): the draft proposes under it, every verified row is shaped with
the tokens before its position, and it rolls back what was rejected.  With none asked the
shaper is IDENTITY and the loop never calls it.

Where the target takes token trees and `[speculative] trees` is on, a step may
feed the draft's alternatives beside its chain in the same pass
(memspec.speculation.tree); the cache then keeps the committed path.  A request with
output controls runs chains (the tree walk does not shape its rows).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import numpy as np

from memspec.speculation import sampling, tree
from memspec.speculation.config import SpecConfig
from memspec.speculation.confidence import AcceptanceByEntropy
from memspec.speculation.drafts import DraftState, Proposal, deterministic_proposal
from memspec.speculation.logits import IDENTITY, LogitsShaper, forced, is_identity, settle, verify_rows
from memspec.speculation.metrics import SpecMetrics
from memspec.request import SamplingParams
from memspec.runtime.kvcache import KVCache

log = logging.getLogger("memspec.speculative")


def next_gamma(cfg: SpecConfig, gamma: int, n_drafted: int, n_accepted: int) -> int:
    """The step controller: the draft length for the next step, from this step's outcome."""
    if not cfg.adaptive or n_drafted == 0:
        return gamma
    if n_accepted == n_drafted:
        return min(gamma + 1, cfg.gamma_max)
    return max(gamma - 1, cfg.gamma_min)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens one step commits when each draft token is accepted with probability alpha:
    1 + alpha + ... + alpha^gamma (the accepted run plus the recovered or bonus token)."""
    return float(gamma + 1) if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def best_gamma(alpha: float, verify_cost: list[float], draft_cost: float, gamma_max: int) -> int:
    """The draft length with the most expected tokens per unit of time (0 = do not draft).

    verify_cost[k]: a target pass over k tokens, relative to one (verify_cost[1] == 1);
    draft_cost: one draft token, relative to one target token.  A plain target step
    commits 1 token at cost 1, so drafting must beat a rate of 1 to be used.
    """
    best, best_rate = 0, 1.0
    for g in range(1, min(gamma_max, len(verify_cost) - 2) + 1):
        rate = expected_tokens(alpha, g) / (verify_cost[g + 1] + g * draft_cost)
        if rate > best_rate:
            best, best_rate = g, rate
    return best


class CostController:
    """Per request and per draft: acceptance and draft cost seen so far -> next gamma.

    Where no draft length pays (best_gamma 0) the steps run target-only, as Ollama's adaptive draft
    controller falls back to plain decoding, and a probe of one token checks now and then whether
    the draft has started to pay: one step in PROBE_EVERY, each rejected probe doubling the wait
    before the next, an accepted one starting the waits over.  A probe costs more than its token and
    row: the draft first catches up on every token committed since it last ran (a model draft's
    K/V), so probing forever would cost that catch-up on every token of the request; once the probe
    after the longest wait (PROBE_MAX steps) is rejected too, about 120 plain steps after drafting
    stopped paying, the draft is not tried again in this request.  A draft that never agrees so
    costs its first steps (the prior), four probes and their catch-ups: a few percent of target-only
    on 160 tokens, less on longer answers (tests/test_controller.py).

    The same draft in another request starts over: what did not pay on one prompt may on the next;
    so does a draft the scheduler's switcher takes again later in the request (a new DraftState).
    """

    PRIOR = (1.2, 0.8)  # pseudo-counts (accepted, rejected): alpha starts at 0.6
    DECAY = 0.9  # weight of the past per step: recent acceptance counts most
    PROBE_EVERY = 8  # while drafting does not pay, still try one token after this many steps ...
    PROBE_MAX = 64  # ... twice as many after each probe that failed, up to this many (then no more) ...
    PROBE_ALPHA = 0.9  # ... where it would pay at this acceptance

    def __init__(self, cfg: SpecConfig, verify_cost: list[float], target_step_s: float):
        self.cfg = cfg
        self.verify_cost = verify_cost
        self.target_step_s = target_step_s
        self.accepted, self.rejected = self.PRIOR
        self.draft_cost = 0.05  # until measured
        self.idle_steps = 0  # target-only steps since drafting last paid or was probed
        self.probe_every = self.PROBE_EVERY  # steps the next probe waits for (past PROBE_MAX: no probe)
        self.probing = False  # the step asked for last is a probe
        self.after_idle = False  # ... or follows steps that drafted nothing (its catch-up is its own cost)

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def next(self) -> int:
        g = best_gamma(self.alpha, self.verify_cost, self.draft_cost, self.cfg.gamma_max)
        self.probing, self.after_idle = False, self.idle_steps > 0
        if g > 0:  # drafting pays: probes start again from the shortest wait when it stops paying
            self.idle_steps, self.probe_every = 0, self.PROBE_EVERY
            return g
        self.idle_steps += 1
        if self.idle_steps >= self.probe_every <= self.PROBE_MAX and self._worth_probing():
            self.idle_steps, self.probing = 0, True
            return 1
        return 0

    def _worth_probing(self) -> bool:
        """A probe re-measures acceptance, at the price of a draft token and a wider pass: worth it
        only where a draft right 9 times in 10 would pay.  Not where verifying costs nearly a row per
        token, as in a batched pass that is already compute-bound (4 requests of the 1.5B on 2
        cores: probes every 8 steps cost 10% of the aggregate, for tokens no draft could win back)."""
        return best_gamma(self.PROBE_ALPHA, self.verify_cost, self.draft_cost, self.cfg.gamma_max) > 0

    def observe(self, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float | None = None,
                rows: int | None = None, setup_s: float = 0.0) -> None:
        """A step's outcome: tokens drafted and accepted, the seconds drafting took and, where the
        pass was this request's alone, the seconds verifying took (a pass of `rows` tokens; default
        all the drafted ones and the last).  The pass's seconds over its relative cost keep the
        target's step time as the machine runs now: another process on the cores slows the draft
        and the target alike, and their ratio is what the draft length needs (a draft timed on a
        busy machine against a target timed on an idle one never pays).  Drafted tokens the gate
        left unverified (memspec.speculation.confidence) count as drafted and not accepted.

        setup_s: the part of draft_s that was a long catch-up (Proposal.setup_s).  The draft's first
        one, the prompt's prefill, is spent once and is no cost of the tokens it drafts; one after
        steps that drafted nothing (a probe's, or drafting's again) is what coming back costs, every
        time: left out, a probe would look as cheap as a step of a draft that runs every step."""
        if not self.after_idle:
            draft_s = max(draft_s - setup_s, 0.0)
        rows = n_drafted + 1 if rows is None else rows
        if verify_s is not None and rows < len(self.verify_cost):
            step = verify_s / max(self.verify_cost[rows], 1e-9)
            self.target_step_s = 0.7 * self.target_step_s + 0.3 * step
        if n_drafted == 0:
            return
        self.accepted = self.DECAY * self.accepted + n_accepted
        self.rejected = self.DECAY * self.rejected + (1 if n_accepted < n_drafted else 0)
        per_token = draft_s / n_drafted / max(self.target_step_s, 1e-9)
        self.draft_cost = 0.7 * self.draft_cost + 0.3 * per_token
        if self.probing:  # a rejected probe: wait twice as long for the next; an accepted one: the shortest wait
            self.probe_every = 2 * self.probe_every if n_accepted < n_drafted else self.PROBE_EVERY


class TargetPass(Protocol):
    """What the loop needs of the target: DecoderSession, or a batch slot (speculation.batching)."""

    def forward(self, cache: KVCache, ids: list[int], keep: int = 1) -> np.ndarray: ...  # (keep, V)


class DraftSelector(Protocol):
    """Chooses the draft for each step of one request (the scheduler's hook into the loop).

    Called before every step with the committed context and the request's metrics
    so far; returns (draft name, its state) or (None, None) for a target-only step,
    which is how a request degrades mid-run when a draft must be given up.
    """

    def __call__(self, context: list[int], metrics: SpecMetrics) -> tuple[str | None, DraftState | None]: ...

    def failed(self, name: str, exc: Exception) -> None: ...  # the draft raised: give it up for this request

    def close(self) -> None: ...


class NoDraft:
    """Target only: every step feeds just the last token."""

    def __call__(self, context: list[int], metrics: SpecMetrics) -> tuple[None, None]:
        return None, None

    def failed(self, name: str, exc: Exception) -> None:
        pass  # it runs no draft

    def close(self) -> None:
        pass


class FixedDraft:
    """One draft for the whole request."""

    def __init__(self, name: str, state: DraftState):
        self.name, self.state = name, state

    def __call__(self, context: list[int], metrics: SpecMetrics) -> tuple[str | None, DraftState | None]:
        return (self.name, self.state) if self.state is not None else (None, None)

    def failed(self, name: str, exc: Exception) -> None:
        self.close()  # target-only for the rest of the request

    def close(self) -> None:
        state, self.state = self.state, None
        if state is not None:
            state.close()


def _propose(select: DraftSelector, name: str | None, draft: DraftState | None, context: list[int], k: int,
             params: SamplingParams, rng: sampling.Randomness, metrics: SpecMetrics,
             shaper: LogitsShaper, alternatives: bool = False) -> Proposal:
    """The draft's proposal of k tokens; none when there is no draft, or when it raises (a broken
    draft must not fail the request: the selector gives it up and the request goes on target-only,
    which changes nothing in the output)."""
    if draft is None or k <= 0:
        return Proposal([], None, [])
    try:
        if alternatives:  # token trees: the draft's next choices too
            return draft.propose(context, k, params, rng, shaper, alternatives=True)
        return draft.propose(context, k, params, rng, shaper)  # leaves the shaper as it found it
    except Exception as exc:
        log.warning("draft %s failed mid-request (%s: %s): target-only for the rest of it",
                    name, type(exc).__name__, exc)
        metrics.draft_failures += 1
        select.failed(name, exc)
        return Proposal([], None, [])


@dataclass
class _Request:
    """One request's side of the loop: what every step reads, and the hooks it reports to."""

    target: TargetPass
    cache: KVCache  # holds every committed token but the last
    context: list[int]  # (n,) the prompt and every committed token
    params: SamplingParams
    rng: sampling.Randomness
    shaper: LogitsShaper  # IDENTITY: no output controls, never called
    metrics: SpecMetrics
    clock: Callable[[], float]
    on_rows: Callable[[np.ndarray], None] | None  # the rows that predicted each step's committed tokens
    on_pass: Callable[[int, float], None] | None  # (rows, seconds) of each verification pass

    def verify(self, proposal: Proposal) -> tuple[list[int], int, np.ndarray]:
        """One target pass over [context[-1], *proposal.tokens] and the verify rule: the committed
        tokens (the accepted run and the recovered or bonus token), how many were accepted, and the
        raw rows; the cache keeps the last token and the accepted ones, the shaper is settled.

        The rule: greedy, a draft token stands while it is the argmax of the target's (shaped) row;
        coupled sampling, the same on the rows plus the position's noise, which makes the answer the
        target-only one; the standard scheme, the speculative-sampling rule on q."""
        shaped = not is_identity(self.shaper)
        feed = [self.context[-1], *proposal.tokens]
        rows = self.target.forward(self.cache, feed, keep=len(feed))  # (k+1, V)
        decide = verify_rows(self.shaper, rows, proposal.tokens) if shaped else rows  # (k+1, V)
        draft, params = np.asarray(proposal.tokens, dtype=np.int64), self.params
        if params.greedy:
            n, nxt = sampling.verify_greedy(decide.argmax(axis=-1), draft)
        else:
            p = sampling.TargetRows(decide, params.temperature, params.top_k, params.top_p, params.min_p)
            if sampling.coupled(self.rng):  # row 0 predicts the token after the whole context
                n, nxt = sampling.verify_coupled(p, draft, self.rng, len(self.context))
            else:
                n, nxt = sampling.verify_sampled(p, proposal.q, draft, self.rng)
        if shaped:  # once per token: the rejected drafts come off, the recovered or bonus token goes on
            settle(self.shaper, len(proposal.tokens), n, nxt)
        self.cache.truncate(self.cache.length - len(feed) + 1 + n)  # keep `last` and the accepted drafts
        return [*proposal.tokens[:n], nxt], n, rows

    def commit(self, committed: list[int], rows: np.ndarray) -> list[int]:
        """The step's tokens join the context; rows[i] predicted committed[i] (on_rows)."""
        self.context.extend(committed)
        if self.on_rows is not None:
            self.on_rows(rows)
        return committed

    def forced_step(self, tokens: list[int], vocab: int, t0: float) -> list[int]:
        """A step whose proposal is what the grammar forces (memspec.speculation.logits.forced),
        verified like a draft's (the masked target gives the forced token all its mass, so it is
        accepted unless the target spells the same bytes in other tokens)."""
        prop = deterministic_proposal(tokens, vocab, self.params, self.shaper)
        t1 = self.clock()
        committed, n, rows = self.verify(prop)
        self.metrics.record_step(None, 0, 0, len(committed), t1 - t0, self.clock() - t1)
        self.metrics.record_forced(len(prop.tokens), n)
        return self.commit(committed, rows[:n + 1])

    def chain_step(self, name: str | None, prop: Proposal, t0: float, t1: float) -> tuple[list[int], int, float]:
        """The draft's chain verified in one pass: (committed tokens, drafts accepted, the pass's seconds)."""
        committed, n, rows = self.verify(prop)
        t2 = self.clock()
        self.metrics.record_step(name, len(prop.tokens), n, len(committed), t1 - t0, t2 - t1)
        if self.on_pass is not None:
            self.on_pass(len(prop.tokens) + 1, t2 - t1)
        return self.commit(committed, rows[:n + 1]), n, t2 - t1

    def tree_step(self, name: str, prop: Proposal, branches: list[tree.Branch], t0: float,
                  t1: float) -> tuple[list[int], int, tuple[float, int]]:
        """The chain and its branches in one pass (memspec.speculation.tree): (committed tokens,
        main-chain drafts accepted, (the pass's seconds, the rows it fed))."""
        step = tree.verify(self.target, self.cache, self.context, prop, branches, self.params, self.rng)
        t2 = self.clock()
        committed, g = step.committed, len(prop.tokens)
        rows_fed = g + 1 + sum(len(b.tokens) for b in branches)
        self.metrics.record_step(name, g, len(committed) - 1, len(committed), t1 - t0, t2 - t1)
        self.metrics.record_tree(rows_fed - g - 1, len(committed) - 1 - step.main)
        if self.on_pass is not None:
            self.on_pass(rows_fed, t2 - t1)
        return self.commit(committed, step.rows), step.main, (t2 - t1, rows_fed)


def speculative_steps(target: TargetPass, cache: KVCache, prompt: list[int], select: DraftSelector,
                      params: SamplingParams, rng: sampling.Randomness, cfg: SpecConfig, metrics: SpecMetrics,
                      clock: Callable[[], float] = time.perf_counter,
                      verify_cost_s: list[float] | Callable[[], list[float]] | None = None,
                      on_rows: Callable[[np.ndarray], None] | None = None,
                      shaper: LogitsShaper = IDENTITY,
                      on_pass: Callable[[int, float], None] | None = None,
                      gate: AcceptanceByEntropy | None = None) -> Iterator[list[int]]:
    """Yield the token ids committed at each step (1 .. k+1 per step).

    verify_cost_s[k]: measured seconds of a target pass over k tokens (index 0 unused), for the
    cost controller; without it the step controller runs.  A callable is read before each step
    (under batching the cost of a pass depends on how many requests share it).  on_rows: called
    before each yield with the target's logits rows that predicted the committed tokens,
    (n_committed, V); the rows are the session's buffer, valid only during the call (logprobs).
    `cache` may hold the prompt's first tokens already (memspec.runtime.prefixes): only the rest is fed.
    shaper: the request's logits shaper, built for `prompt` with nothing pushed yet (the logits
    rows given to on_rows stay the raw ones).  on_pass(rows, seconds): each verification pass,
    timed (memspec.runtime.costs.LiveCosts; only where the pass is this request's alone).  gate:
    where the cost controller runs, the acceptance by the draft's entropy that trims each model
    draft's proposal to the prefix worth verifying (memspec.speculation.confidence).
    """
    shaped = not is_identity(shaper)
    live = verify_cost_s if callable(verify_cost_s) else None
    if live is not None:
        verify_cost_s = live()
    verify_cost = [c / verify_cost_s[1] for c in verify_cost_s] if verify_cost_s else None
    verify_cost_s1 = verify_cost_s[1] if verify_cost_s else 0.0
    logits = target.forward(cache, prompt[cache.length:], keep=1)[-1]  # a cache may start with a reused prefix
    context = list(prompt)
    first = sampling.pick(shaper.shape(logits) if shaped else logits, params.temperature, params.top_k,
                          params.top_p, rng, params.min_p, at=len(context))
    if shaped:
        shaper.push(first)
    context.append(first)
    if on_rows is not None:
        on_rows(logits[None, :])
    yield [first]
    req = _Request(target, cache, context, params, rng, shaper, metrics, clock, on_rows, on_pass)
    gamma = cfg.gamma
    # per draft: acceptance differs from draft to draft; a draft taken again (a new state: the scheduler's
    # switcher left it and came back, where the text may have changed) starts over, as in a new request
    controllers: dict[str, tuple[DraftState, CostController]] = {}
    use_cost = cfg.adaptive and cfg.controller == "cost" and verify_cost is not None
    # token trees where the target takes them (its own word: the loop does not know the engine)
    # (a request with output controls runs chains: the tree walk does not shape its rows)
    planner = (tree.Planner() if cfg.trees and use_cost and getattr(target, "trees", False) and is_identity(shaper)
               else None)
    vocab = logits.shape[-1]
    # the gate's record per draft and kind of decoding: a sampled token is accepted by another rule
    gate_key = (lambda name: name) if params.greedy else (lambda name: f"{name} (sampled)")
    while cache.length < cache.capacity:  # the pending last token must fit
        t0 = clock()
        # where the request's grammar admits one way on, its tokens are the proposal: no draft runs
        ff = forced(shaper, min(cfg.gamma_max, cache.capacity - cache.length - 1)) if shaped else []
        if ff:
            yield req.forced_step(ff, vocab, t0)
            continue
        draft_name, draft = select(context, metrics)
        ctl = None
        if use_cost and draft is not None:
            held, ctl = controllers.get(draft_name, (None, None))
            if held is not draft:
                ctl = CostController(cfg, verify_cost, verify_cost_s1)
                controllers[draft_name] = draft, ctl
            if live is not None:  # the pass this step joins
                now = live()
                ctl.verify_cost, ctl.target_step_s = [c / now[1] for c in now], now[1]
            gamma = ctl.next()
        k = min(gamma, cache.capacity - cache.length - 1)
        prop = _propose(select, draft_name, draft, context, k, params, rng, metrics, shaper, planner is not None)
        drafted = len(prop.tokens)
        gated = gate is not None and ctl is not None and any(e > 0.0 for e in prop.entropy)  # a model's proposal
        if gated:
            prop = prop.prefix(gate.keep(gate_key(draft_name), prop.entropy, ctl.alpha, ctl.verify_cost,
                                         ctl.draft_cost))
        t1 = clock()
        branches = planner.choose(draft_name, prop, ctl.alpha, ctl.verify_cost, ctl.draft_cost,
                                  cache.capacity - cache.length) if planner and ctl else []
        g = len(prop.tokens)
        if branches:
            committed, n, (verify_s, rows_fed) = req.tree_step(draft_name, prop, branches, t0, t1)
            verify_s *= ctl.verify_cost[g + 1] / ctl.verify_cost[rows_fed]  # the pass's seconds as a chain's
            planner.observe(draft_name, prop, n, committed[n])
        else:
            committed, n, verify_s = req.chain_step(draft_name, prop, t0, t1)
            if planner is not None and draft_name is not None:
                planner.observe(draft_name, prop, n, committed[-1])  # what the draft's alternatives would have won
        if ctl is not None:  # the controller decides what of a long catch-up (setup_s) the step cost
            ctl.observe(drafted, n, t1 - t0,
                        None if live is not None else verify_s,  # a batched pass is not this request's alone
                        rows=g + 1, setup_s=prop.setup_s)
            if gated:
                gate.observe(gate_key(draft_name), prop.entropy, n)
        else:
            gamma = next_gamma(cfg, gamma, g, n)
        yield committed
