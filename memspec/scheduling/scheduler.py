"""The scheduler: which draft each request runs with, and which drafts stay resident.

For every request the engine asks `Scheduler.selector()` for a `DraftSelector`
(memspec.speculation.speculative); the selector holds at most one draft lease from the
`WorkingSet` at a time and releases it when the request ends, however it ends
(the engine closes the selector on completion, cancellation and exceptions).

Policies:

* ``target-only``: no draft.
* ``fixed:<draft>``: one draft, loaded on first use.
* ``bandit``: UCB1 over drafts on the reward each request observed (tok/s, or
  acceptance per cost), loading the arm it picks on demand under the budget: the
  request stalls while it loads (BanditSpec / MetaSD style, reactive).
* ``memspec``: the predictor's expected tok/s per draft, with the load time of a
  draft that is not resident counted against it; a missing draft is loaded in the
  background while the request starts on the best resident one, and the request
  switches when it arrives.  Every few steps it asks again with the generation
  context (a chat answer turning into code, falling acceptance) and switches;
  between requests it preloads what queued and likely requests need and ranks
  drafts for eviction by expected value per byte.
* ``oracle``: the upper bound: per request the draft measured fastest offline,
  every draft preloaded at no cost (no budget).

Under memory pressure (working set `target_only`) every selector drops its draft
and the request goes on target-only; the output does not change (lossless).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from collections import Counter, deque
from pathlib import Path
from typing import Callable

from memspec.speculation.drafts import PROMPT_LOOKUP
from memspec.errors import ConfigError, InvalidRequestError
from memspec.runtime.memory import MiB, MemoryProbe
from memspec.speculation.metrics import SpecMetrics
from memspec.request import GenerationRequest
from memspec.scheduling.config import SchedulerConfig
from memspec.scheduling.workingset import Lease, Loader, WorkingSet

log = logging.getLogger("memspec.scheduler")

POLICIES = ("target-only", "fixed:<draft>", "bandit", "memspec", "oracle")
NONE = "none"  # the predictor's name for target-only decoding


def prompt_text(req: GenerationRequest) -> str:
    """What the request asks, as the predictor and the oracle table see it."""
    try:
        from memspec.scheduling.features import request_text
    except ImportError:  # the predictor's module is not installed: the oracle table keys on the prompt
        return req.prompt if req.prompt is not None else "\n".join(c for _, c in req.messages or ())
    return request_text(req)


# -- bandit --------------------------------------------------------------------------------
def ucb_pick(arms: list[str], pulls: dict[str, int], rewards: dict[str, float], c: float) -> str:
    """UCB1: an arm never tried first (in order), else the best mean + c * sqrt(ln N / n)."""
    for a in arms:
        if pulls.get(a, 0) == 0:
            return a
    total = sum(pulls[a] for a in arms)
    return max(arms, key=lambda a: rewards[a] / pulls[a] + c * math.sqrt(math.log(total) / pulls[a]))


def request_reward(metrics: SpecMetrics, kind: str) -> float:
    """What a finished request says about its draft: decode tok/s, or tokens per step
    divided by the step's cost relative to a target-only step (acceptance per cost)."""
    tokens = len(metrics.token_latencies_s)
    seconds = metrics.draft_s + metrics.verify_s
    if tokens == 0 or seconds <= 0:
        return 0.0
    if kind == "tok_per_s":
        return tokens / seconds
    if kind == "acceptance_per_cost":
        return metrics.mean_acceptance_length / (1.0 + metrics.draft_s / max(metrics.verify_s, 1e-9))
    raise ConfigError(f"[scheduler] bandit_reward: {kind!r}; known: tok_per_s, acceptance_per_cost")


# -- memspec ---------------------------------------------------------------------------------
def expected_seconds(tokens: int, tps_now: float, tps_new: float, load_s: float) -> float:
    """Time to generate `tokens` running at `tps_now` while a draft loads for `load_s`,
    then at `tps_new` (load_s = 0: the draft is there already)."""
    tps_now, tps_new = max(tps_now, 1e-6), max(tps_new, 1e-6)
    during = load_s * tps_now
    if during >= tokens:
        return tokens / tps_now
    return load_s + (tokens - during) / tps_new


def load_oracle_table(path: str | Path) -> dict[str, str]:
    """{prompt: fastest draft} from a JSON object, or from JSONL rows with `prompt` and one of:
    `best`; `requests` (memspec profile traces); `draft` and `tok_per_s` (the fastest wins)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"[scheduler] oracle: cannot read {p}: {exc.strerror}") from None
    try:
        data = json.loads(text)
        if isinstance(data, dict):
            return {str(k): str(v) for k, v in data.items()}
    except json.JSONDecodeError:
        pass
    best: dict[str, tuple[float, str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            if "best" in row:
                best[prompt] = (math.inf, row["best"])
            elif "requests" in row:  # a `memspec profile` trace: {policy: {tokens, seconds, ...}}
                tps = {d: r["tokens"] / max(r["seconds"], 1e-9) for d, r in row["requests"].items()}
                best[prompt] = (math.inf, max(tps, key=tps.get))
            elif best.get(prompt, (-math.inf, ""))[0] < float(row["tok_per_s"]):
                best[prompt] = (float(row["tok_per_s"]), row["draft"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"[scheduler] oracle: {p}:{n}: needs prompt and best, or prompt, draft and "
                              f"tok_per_s ({exc})") from None
    return {k: v for k, (_, v) in best.items()}


def predictor_file(path: str, variant: str = "") -> Path:
    """The predictor to use: `path` when set, else the shipped one fitted on traces of the target's
    variant (models/predictor-VARIANT.json) when there is one, else models/predictor.json."""
    from memspec.models.store import SHIPPED_MODELS

    if path:
        return Path(path)
    own = SHIPPED_MODELS / f"predictor-{variant}.json"
    return own if variant and own.is_file() else SHIPPED_MODELS / "predictor.json"


def load_predictor(path: str, variant: str = ""):
    """The predictor for a target of `variant` (see predictor_file), or a ConfigError naming what is missing."""
    try:
        from memspec.scheduling.predictor import Predictor
    except ImportError as exc:
        raise ConfigError(f"policy 'memspec' needs the predictor, but memspec/scheduling/predictor.py cannot be imported "
                          f"({exc}); use another [scheduler] policy until it is installed") from None
    file = predictor_file(path, variant)
    if not file.is_file():
        raise ConfigError(f"policy 'memspec' needs a trained predictor, but {file} does not exist "
                          f"(memspec train-predictor writes it; or set [scheduler] predictor)")
    pred = Predictor.load(file)
    fitted = str(pred.info.get("target") or "")  # "name:variant" of the traces it was fitted on
    if variant and ":" in fitted and fitted.rsplit(":", 1)[1] != variant:
        log.warning("predictor %s was fitted on traces of %s, but the target runs as %s; its costs and choices "
                    "may not hold (memspec profile --variant %s, then memspec train-predictor)",
                    file, fitted, variant, variant)
    return pred


def context_type():
    """GenerationContext from the predictor's features module."""
    try:
        from memspec.scheduling.features import GenerationContext
    except ImportError:
        from memspec.scheduling.predictor import GenerationContext  # type: ignore[no-redef]
    return GenerationContext


# -- the per-request selector -----------------------------------------------------------------
class _Watched:
    """A draft state that remembers the entropy of its proposals."""

    def __init__(self, state, entropies: deque):
        self.state, self.entropies = state, entropies

    def propose(self, context, k, params, rng):
        prop = self.state.propose(context, k, params, rng)
        self.entropies.extend(prop.entropy)
        return prop

    def close(self) -> None:
        self.state.close()


class RequestSelector:
    """The DraftSelector of one request.  Holds at most one lease; under pressure it gives
    it up and runs target-only; with a `switcher` (memspec) it reconsiders every few steps."""

    def __init__(self, sched: "Scheduler", policy: str, req: GenerationRequest, prompt: list[int], capacity: int,
                 lease: Lease | None, on_close: Callable[["RequestSelector"], None] | None = None,
                 switcher: Callable[["RequestSelector"], None] | None = None):
        self.sched, self.policy, self.req, self.capacity = sched, policy, req, capacity
        self.n_prompt = len(prompt)
        self.on_close, self.switcher = on_close, switcher
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
        self.closed = False
        if lease is not None:
            self._take(lease)

    @property
    def name(self) -> str | None:
        return self.lease.name if self.lease is not None else None

    def _take(self, lease: Lease) -> None:
        self.lease = lease
        self.state = _Watched(lease.proposer.begin(self.capacity), self.entropies)

    def drop(self) -> None:
        """Give the current draft back (its state first, then the lease)."""
        if self.state is not None:
            self.state.close()
            self.state = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def switch_to(self, lease: Lease, why: str) -> None:
        old = self.name
        self.drop()
        self._take(lease)
        self.sched.count("switches")
        log.debug("request %s: switched %s -> %s at position %d (%s)", id(self), old, lease.name,
                  len(self.context) - self.n_prompt, why)

    def _observe(self, metrics: SpecMetrics) -> None:
        """Attribute the previous step's outcome to the draft that ran it."""
        now = (metrics.num_draft_tokens, metrics.num_accepted_tokens, len(metrics.token_latencies_s),
               metrics.draft_s + metrics.verify_s)
        d_drafted, d_accepted, d_tokens, d_s = (a - b for a, b in zip(now, self._last))
        self._last = now
        name = self._ran or NONE
        if self.steps > 1:
            self.window.setdefault(name, deque(maxlen=16)).append((d_drafted, d_accepted))
            obs = self.observed.setdefault(name, [0.0, 0.0])
            obs[0] += d_tokens
            obs[1] += d_s

    def recent_acceptance(self) -> dict[str, float]:
        out = {}
        for name, steps in self.window.items():
            drafted = sum(d for d, _ in steps)
            if drafted:
                out[name] = sum(a for _, a in steps) / drafted
        return out

    def __call__(self, context: list[int], metrics: SpecMetrics):
        self.steps += 1
        self.context, self.metrics = context, metrics
        self._observe(metrics)
        if self.sched.ws.check_pressure():
            if self.lease is not None:
                log.info("memory pressure: request %s drops %s and runs target-only", id(self), self.name)
                self.sched.count("degraded")
                self.drop()
            self.pending = None
        else:
            if self.pending is not None and self.sched.ws.is_resident(self.pending):
                lease = self.sched.ws.lease(self.pending, wait=False)
                self.pending = None
                if lease is not None:
                    self.switch_to(lease, "its background load finished")
            if self.switcher is not None and self.steps % self.sched.config.switch_every_steps == 0:
                self.switcher(self)
        self._ran = self.name
        return (self.name, self.state) if self.lease is not None else (None, None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.on_close is not None:
                self.on_close(self)
        finally:
            self.drop()


# -- the scheduler ---------------------------------------------------------------------------
class Scheduler:
    """Owns the working set and picks every request's draft."""

    def __init__(self, config: SchedulerConfig, loader: Loader, drafts: dict[str, int], probe: MemoryProbe,
                 target: tuple[str, int] | None = None, clock: Callable[[], float] = time.monotonic,
                 predictor=None, make_context=None, oracle_table: dict[str, str] | None = None,
                 decode: Callable[[list[int]], str] | None = None, kv_bytes: Callable[[int], int] | None = None,
                 variant: str = ""):
        """drafts: every draft it may use -> declared bytes; target: (name, bytes) to pin;
        predictor / make_context: memspec (default: the shipped predictor for the target's `variant`,
        and GenerationContext);
        oracle_table: {prompt: draft} (default: from config.oracle); decode: token ids -> text;
        kv_bytes: tokens -> bytes of one request's KV caches (reserved in the budget while it runs)."""
        self.config = config
        self.variant = variant
        self.kv_bytes = kv_bytes or (lambda tokens: 0)
        self._kv_ids = itertools.count(1)
        self.drafts = dict(drafts)
        self.clock = clock
        self.decode = decode or (lambda ids: "")
        budget = 0 if config.policy == "oracle" else config.budget_mb * MiB
        self.ws = WorkingSet(budget, loader, probe, clock, config.pressure_floor_mb * MiB, sizes=drafts,
                             retry_after_s=config.retry_after_s)
        if target is not None:
            self.ws.pin(*target)
        self.stats: Counter[str] = Counter()
        self.pred_err = [0.0, 0]  # sum of |observed - predicted| / predicted, checks
        self.pulls: dict[str, int] = {}
        self.rewards: dict[str, float] = {}
        self.reward_max = 0.0
        self.values: dict[str, float] = {}
        self.predictor, self.make_context = predictor, make_context
        self.oracle_table = oracle_table
        self.check_policy(config.policy)
        if config.policy == "memspec":
            self._need_predictor()
        if config.policy == "oracle":
            self._need_oracle()
            for name in self.drafts:  # all preloaded, at no cost to any request
                self.ws.preload(name)
            self.ws.wait_idle(timeout=600)

    # -- checks -------------------------------------------------------------------------
    def check_policy(self, policy: str) -> None:
        if policy in ("target-only", "bandit", "memspec", "oracle"):
            return
        if policy.startswith("fixed:") and policy[6:] in self.drafts:
            return
        known = ", ".join(["target-only", "bandit", "memspec", "oracle", *(f"fixed:{d}" for d in sorted(self.drafts))])
        raise InvalidRequestError(f"policy: unknown policy {policy!r}; known: {known}")

    def check(self, req: GenerationRequest) -> None:
        """Refuse an unknown draft or policy before any work."""
        if req.draft not in (None, NONE) and req.draft not in self.drafts:
            have = ", ".join([NONE, *sorted(self.drafts)])
            raise InvalidRequestError(f"draft: unknown draft {req.draft!r}; available: {have}")
        if req.policy is not None:
            self.check_policy(req.policy)
            if req.policy == "memspec":
                self._need_predictor()
            if req.policy == "oracle":
                self._need_oracle()

    def _need_predictor(self) -> None:
        if self.predictor is None:
            self.predictor = load_predictor(self.config.predictor, self.variant)
        if self.make_context is None:
            self.make_context = context_type()

    def _need_oracle(self) -> None:
        if self.oracle_table is None:
            if not self.config.oracle:
                raise ConfigError("policy 'oracle' needs a table of the fastest draft per prompt: "
                                  "set [scheduler] oracle to a JSON table or a JSONL trace file")
            self.oracle_table = load_oracle_table(self.config.oracle)

    def count(self, what: str, n: int = 1) -> None:
        self.stats[what] += n

    # -- per request ---------------------------------------------------------------------
    def policy_for(self, req: GenerationRequest) -> str:
        if req.draft is not None:
            return "target-only" if req.draft == NONE else f"fixed:{req.draft}"
        return req.policy or self.config.policy

    def reserve_kv(self, tokens: int, cancelled: Callable[[], bool] = lambda: False) -> str:
        """Reserve the KV caches of a request that may hold `tokens` tokens in the memory budget
        (see WorkingSet.reserve); returns the key to give to release_kv() when it ends."""
        key = f"request-{next(self._kv_ids)}"
        self.ws.reserve(key, self.kv_bytes(tokens), cancelled)
        return key

    def release_kv(self, key: str) -> None:
        self.ws.unreserve(key)

    def selector(self, req: GenerationRequest, prompt: list[int], capacity: int) -> RequestSelector | None:
        """The DraftSelector for one request (None = plain target-only decoding)."""
        policy = self.policy_for(req)
        self.count("requests")
        self.count(f"policy.{policy}")
        if policy == "target-only":
            log.debug("request: target-only")
            return None
        if policy.startswith("fixed:"):
            return self._leased(policy, req, prompt, capacity, policy[6:])
        if policy == "oracle":
            best = self.oracle_table.get(prompt_text(req))
            if best is None:
                self.count("oracle_unknown_prompt")
                log.debug("oracle: prompt not in the table: target-only")
                return None
            return self._leased(policy, req, prompt, capacity, best) if best != NONE else None
        if policy == "bandit":
            return self._bandit(req, prompt, capacity)
        return self._memspec(req, prompt, capacity)

    def _leased(self, policy, req, prompt, capacity, name, on_close=None) -> RequestSelector | None:
        lease = self.ws.lease(name, wait=True) if name in self.drafts else None
        if lease is None:
            self.count("no_draft")
            log.debug("%s: %s cannot be had; target-only", policy, name)
            return None
        log.debug("%s: %s", policy, name)
        return RequestSelector(self, policy, req, prompt, capacity, lease, on_close=on_close)

    # -- bandit ---------------------------------------------------------------------------
    def _bandit(self, req, prompt, capacity) -> RequestSelector | None:
        arms = [d for d in self.drafts if self.ws.is_available(d)]
        if not arms:
            return None
        arm = ucb_pick(arms, self.pulls, self.rewards, self.config.ucb_c)
        log.debug("bandit: picks %s (pulls %s)", arm, self.pulls)
        return self._leased("bandit", req, prompt, capacity, arm, on_close=self._bandit_learn)

    def _bandit_learn(self, sel: RequestSelector) -> None:
        name = sel.name
        if name is None or not sel.metrics.token_latencies_s:
            return  # degraded, or ended before a single step: nothing to learn
        raw = request_reward(sel.metrics, self.config.bandit_reward)
        self.reward_max = max(self.reward_max, raw)
        reward = raw / self.reward_max if self.reward_max else 0.0
        self.pulls[name] = self.pulls.get(name, 0) + 1
        self.rewards[name] = self.rewards.get(name, 0.0) + reward
        self.ws.set_value(name, self.rewards[name] / self.pulls[name])
        log.debug("bandit: %s reward %.3f (raw %.2f)", name, reward, raw)

    # -- memspec --------------------------------------------------------------------------
    def _predict(self, text: str, ctx=None) -> dict[str, float]:
        pred = self.predictor.predict(text, ctx)
        usable = {d: v for d, v in pred.items() if d == NONE or (d in self.drafts and self.ws.is_available(d))}
        usable.setdefault(NONE, 0.0)
        return usable

    def _best(self, pred: dict[str, float], tokens: int, current: str | None) -> tuple[str, float]:
        """The draft with the least expected time for `tokens` more tokens, counting loads:
        a resident draft runs at once; a missing one loads while `current` (or the best
        resident) runs.  Returns (draft or 'none', expected seconds)."""
        resident = {d for d in pred if d == NONE or self.ws.is_resident(d)}
        now = current if current is not None else max(resident, key=lambda d: pred[d])
        best, best_s = now, expected_seconds(tokens, pred[now], pred[now], 0.0)
        for d, tps in pred.items():
            load_s = 0.0 if d in resident else self.ws.expected_load_s(d)
            s = expected_seconds(tokens, pred[now], tps, load_s)
            if s < best_s:
                best, best_s = d, s
        return best, best_s

    def _memspec(self, req, prompt, capacity) -> RequestSelector:
        pred = self._predict(prompt_text(req))
        self._learn_values(pred)
        best, _ = self._best(pred, min(req.max_tokens, self.config.expected_tokens), None)
        lease, pending = None, None
        if best != NONE:
            lease = self.ws.lease(best, wait=False)  # a hit, or a miss: then it loads while the request starts
            if lease is None and self.ws.fetch(best):
                pending = best
        if lease is None:
            resident = [d for d in pred if d != NONE and self.ws.is_resident(d)]
            start = max(resident, key=lambda d: pred[d], default=None)
            if start is not None and pred[start] > pred[NONE]:
                lease = self.ws.lease(start, wait=False)
        sel = RequestSelector(self, "memspec", req, prompt, capacity, lease, on_close=self._memspec_done,
                              switcher=self._memspec_switch)
        sel.pending = pending
        chosen = sel.name or NONE
        sel.predicted[chosen] = pred.get(chosen, 0.0)
        self.count("memspec.start_best" if chosen == best else "memspec.start_while_loading")
        log.debug("memspec: predicted %s; best %s, starts on %s%s", {k: round(v, 1) for k, v in pred.items()},
                  best, chosen, f", loading {pending}" if pending else "")
        return sel

    def _memspec_switch(self, sel: RequestSelector) -> None:
        position = len(sel.context) - sel.n_prompt
        tail_ids = sel.context[-64:] if position >= 64 else sel.context[sel.n_prompt:]
        tail = self.decode(tail_ids)[-200:]
        generated = self.decode(sel.context[sel.n_prompt:]) if position <= 512 else tail
        ctx = self.make_context(position=position, recent_acceptance=sel.recent_acceptance(),
                                draft_entropy=sum(sel.entropies) / len(sel.entropies) if sel.entropies else float("nan"),
                                in_code_block=generated.count("```") % 2 == 1, generated_tail=tail)
        pred = self._predict(prompt_text(sel.req), ctx)
        self._compare(sel, pred)
        current = sel.name or NONE
        left = min(sel.req.max_tokens - position, self.config.expected_tokens)
        best, best_s = self._best(pred, max(left, 1), current)
        if best == current or pred.get(best, 0.0) < pred.get(current, 0.0) * (1 + self.config.switch_margin):
            return
        if best == NONE:
            sel.drop()
            self.count("switches")
            log.debug("memspec: request %s drops %s for target-only (context changed)", id(sel), current)
        elif self.ws.is_resident(best):
            lease = self.ws.lease(best, wait=False)
            if lease is not None:
                sel.switch_to(lease, f"predicted {pred[best]:.1f} vs {pred.get(current, 0):.1f} tok/s")
        elif sel.pending != best and self.ws.fetch(best):
            sel.pending = best
            log.debug("memspec: request %s loads %s to switch to it", id(sel), best)

    def _compare(self, sel: RequestSelector, pred: dict[str, float]) -> None:
        """Prediction against what the current draft did so far in this request."""
        name = sel.name or NONE
        tokens, seconds = sel.observed.get(name, (0.0, 0.0))
        if name in sel.predicted and seconds > 0 and tokens >= 8:
            observed = tokens / seconds
            err = abs(observed - sel.predicted[name]) / max(sel.predicted[name], 1e-6)
            self.pred_err[0] += err
            self.pred_err[1] += 1
            log.debug("memspec: %s predicted %.1f tok/s, observed %.1f", name, sel.predicted[name], observed)
        sel.predicted.update(pred)

    def _learn_values(self, pred: dict[str, float]) -> None:
        """Each draft's expected value: a moving average of its predicted gain over target-only."""
        decay = self.config.value_decay
        for d in self.drafts:
            gain = max(pred.get(d, 0.0) - pred.get(NONE, 0.0), 0.0)
            self.values[d] = decay * self.values.get(d, gain) + (1 - decay) * gain
            self.ws.set_value(d, self.values[d])

    def _memspec_done(self, sel: RequestSelector) -> None:
        if sel.pending:
            self.count("memspec.pending_at_end")
        if self.config.preload:
            self.preload_likely()

    def preload_likely(self) -> None:
        """Preload the drafts worth most per byte that admission lets in without evicting better ones."""
        for d in sorted(self.values, key=lambda d: -self.values[d] / max(self.drafts.get(d, 1), 1)):
            if self.values[d] > 0 and not self.ws.is_resident(d):
                self.ws.preload(d)

    def hint(self, queued: list[GenerationRequest]) -> None:
        """Requests waiting in the queue: preload what the next ones will want (memspec only)."""
        if not self.config.preload:
            return
        for req in queued:
            if self.policy_for(req) != "memspec" or self.predictor is None:
                continue
            pred = self._predict(prompt_text(req))
            best = max(pred, key=pred.get)
            if best != NONE and not self.ws.is_resident(best):
                self.ws.set_value(best, max(self.values.get(best, 0.0), pred[best] - pred[NONE]) * 2)
                if self.ws.preload(best):
                    self.count("memspec.preload_for_queue")
                    log.debug("memspec: preloading %s for a queued request", best)

    # -- reporting -----------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        ws = self.ws.status()["counters"]
        out = {**{k: float(v) for k, v in ws.items()}, **{k: float(v) for k, v in self.stats.items()}}
        if self.pred_err[1]:
            out["prediction_mean_rel_error"] = self.pred_err[0] / self.pred_err[1]
        return out

    def status(self) -> dict:
        ws = self.ws.status()
        return {
            "policy": self.config.policy,
            "budget_bytes": ws["budget_bytes"],
            "used_bytes": ws["used_bytes"],
            "resident": {**ws["pinned"], **{n: d["bytes"] for n, d in ws["drafts"].items() if d["state"] == "resident"}},
            "working_set": ws,
            "counters": self.counters(),
            "bandit": {d: {"pulls": n, "mean_reward": round(self.rewards[d] / n, 4)} for d, n in self.pulls.items()},
            "values": {d: round(v, 3) for d, v in self.values.items()},
        }

    def close(self) -> None:
        self.ws.close()


def draft_footprints(drafts: list) -> dict[str, int]:
    """Every draft (manifests) with the RSS footprint budgets plan it at, plus prompt lookup (0)."""
    from memspec.speculation.drafts import draft_variant
    from memspec.runtime.memory import planned_footprint

    return {PROMPT_LOOKUP: 0, **{m.name: planned_footprint(m.total_bytes, draft_variant(m)) for m in drafts}}


def kv_sizer(target, drafts: list) -> Callable[[int], int]:
    """tokens -> bytes of one request's KV caches: the target's (a TargetModel) plus the largest
    of these drafts' (manifests), with room for the slots a verification pass writes."""
    from memspec.runtime.sessions import kv_cache_nbytes
    from memspec.speculation.config import SpecConfig

    rows = []  # (layers, kv heads, head dim) of each draft's KV cache
    for m in drafts:
        a = m.architecture or {}
        if {"n_layers", "n_kv_heads", "head_dim"} <= set(a):
            rows.append((int(a["n_layers"]), int(a["n_kv_heads"]), int(a["head_dim"])))
    session = target.session
    slack = SpecConfig().gamma_max + 1  # verification writes up to gamma_max + 1 slots past the committed ones

    def kv_bytes(tokens: int) -> int:
        n = tokens + slack
        largest = max((kv_cache_nbytes(2 * l * h, d, n, session.max_context) for l, h, d in rows), default=0)
        return session.cache_nbytes(n) + largest

    return kv_bytes


def from_store(config: SchedulerConfig, store, target, session_config, draft_limits, probe: MemoryProbe | None = None,
               names: list[str] | None = None, **kwargs) -> Scheduler:
    """A scheduler over every draft in the store made for `target` (a TargetModel), plus prompt lookup."""
    from memspec.speculation.drafts import DraftModel, PromptLookup, target_drafts
    from memspec.runtime.memory import PsutilProbe, planned_footprint

    vocab = target.session.vocab_size
    drafts = target_drafts(store, target.name, names)
    sizes = draft_footprints(drafts)

    def loader(name: str):
        if name == PROMPT_LOOKUP:
            return PromptLookup(vocab, loop_tokens=draft_limits.loop_tokens), 0
        d = DraftModel.load(store, name, vocab, session_config, draft_limits)
        return d, planned_footprint(d.nbytes, d.variant)

    probe = probe or PsutilProbe()
    # the target is pinned at what the process holds now: the runtime, Python and the target
    return Scheduler(config, loader, sizes, probe, target=(target.name, max(target.file_bytes, probe.rss_bytes())),
                     decode=target.tokenizer.decode, kv_bytes=kv_sizer(target, drafts), variant=target.variant,
                     **kwargs)
