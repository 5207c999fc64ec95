"""The draft-selection policies, one class each, each with its own state.

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

A policy starts a request's `RequestSelector` (or None: plain target-only
decoding).  The scheduler builds each policy once, from a `PolicyName`, and owns
the working set they all lease from.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from memspec.errors import ConfigError
from memspec.request import NO_DRAFT, GenerationRequest, PolicyName, unknown_draft
from memspec.scheduling.config import SchedulerConfig
from memspec.scheduling.features import Detokenize, generation_context, request_text
from memspec.scheduling.selector import RequestSelector
from memspec.scheduling.workingset import WorkingSet
from memspec.speculation.metrics import SpecMetrics
from memspec.speculation.suffix import SUFFIX

log = logging.getLogger("memspec.scheduler")

SWITCH_EVIDENCE_TOKENS = 16  # memspec trusts a request's own rate target-only once this many tokens ran so
SWITCH_EVIDENCE_STEPS = 8  # ... and its draft's own acceptance once it ran this many steps with it


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may use of the scheduler that runs it, and no more (the scheduler makes one)."""

    ws: WorkingSet  # the resident drafts: leased, fetched, preloaded
    config: SchedulerConfig
    drafts: Mapping[str, int]  # every draft it may use -> declared bytes
    count: Callable[..., None]  # count(what, n=1): add to the scheduler's counters
    leased: Callable[..., RequestSelector | None]  # a request's selector over a lease on a draft (Scheduler.leased)
    decode: Detokenize  # the target's token ids -> text
    target: str = ""  # the target's store name ("": not known), for what a policy says
    predictor: Callable[[], object | None] = lambda: None  # memspec's predictor, loaded on first call (None: none)
    oracle_table: Callable[[], dict[str, str]] = dict  # the oracle's {prompt: fastest draft}, loaded on first call


@dataclass(frozen=True)
class PolicyReport:
    """What a policy tells the scheduler's report about itself."""

    counters: dict[str, float] = field(default_factory=dict)  # added to the scheduler's counters
    status: dict[str, dict] = field(default_factory=dict)  # its own part of Scheduler.status() (e.g. "bandit")
    predictor: dict[str, float] = field(default_factory=dict)  # the predictor's counters, where it runs one


class Policy:
    """How one policy picks drafts.  The defaults are those of a policy that keeps no state."""

    name = ""  # as a request or the config writes it

    def start(self, req: GenerationRequest, prompt: list[int], capacity: int,
              cancelled: Callable[[], bool]) -> RequestSelector | None:
        """The selector of a request that starts now (None = target-only decoding); `cancelled`
        ends a wait for a draft's load."""
        raise NotImplementedError

    def hint(self, req: GenerationRequest) -> None:
        """A request of this policy waits in the queue (memspec preloads its draft)."""

    def warm(self) -> None:
        """The scheduler starts with this as its configured policy, before any request: load what
        the first requests should find resident (the scheduler then waits for those loads)."""

    def report(self) -> PolicyReport:
        """Its counters and own state, for the scheduler's counters, status and report."""
        return PolicyReport()


class TargetOnly(Policy):
    name = "target-only"

    def start(self, req, prompt, capacity, cancelled):
        log.debug("request: target-only")
        return None


class Fixed(Policy):
    """One draft for the whole request."""

    def __init__(self, sched: PolicyContext, draft: str):
        self.sched, self.draft, self.name = sched, draft, f"fixed:{draft}"

    def start(self, req, prompt, capacity, cancelled):
        return self.sched.leased(self.name, req, prompt, capacity, self.draft, cancelled)


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


class Bandit(Policy):
    name = "bandit"

    def __init__(self, sched: PolicyContext):
        self.sched = sched
        self.pulls: dict[str, int] = {}  # draft -> requests it finished
        self.rewards: dict[str, float] = {}  # draft -> sum of its scaled rewards
        self.reward_max = 0.0  # the largest raw reward seen (rewards are scaled by it into [0, 1])
        self._lock = threading.Lock()  # requests start and finish on many threads

    def start(self, req, prompt, capacity, cancelled):
        ws = self.sched.ws
        arms = [d for d in self.sched.drafts if ws.is_available(d)]
        if not arms:
            return None
        with self._lock:
            arm = ucb_pick(arms, self.pulls, self.rewards, self.sched.config.ucb_c)
        log.debug("bandit: picks %s", arm)
        sel = self.sched.leased(self.name, req, prompt, capacity, arm, cancelled, on_close=self.learn)
        if sel is None and not cancelled():
            # The arm could not be had (too big for the budget now, or still loading past
            # load_wait_s): a pull that earned nothing, so that UCB moves on instead of picking it
            # again for every request.
            with self._lock:
                self._pull(arm, 0.0)
        return sel

    def _pull(self, name: str, reward: float) -> float:
        """Count one pull of `name` that earned `reward` (scaled); its mean reward.  Under the lock."""
        self.pulls[name] = self.pulls.get(name, 0) + 1
        self.rewards[name] = self.rewards.get(name, 0.0) + reward
        return self.rewards[name] / self.pulls[name]

    def learn(self, sel: RequestSelector) -> None:
        name = sel.name
        if name is None or not sel.metrics.token_latencies_s:
            return  # degraded, or ended before a single step: nothing to learn
        raw = request_reward(sel.metrics, self.sched.config.bandit_reward)
        with self._lock:
            self.reward_max = max(self.reward_max, raw)
            reward = raw / self.reward_max if self.reward_max else 0.0
            mean = self._pull(name, reward)
        self.sched.ws.set_value(name, mean)
        log.debug("bandit: %s reward %.3f (raw %.2f)", name, reward, raw)

    def report(self) -> PolicyReport:
        with self._lock:
            return PolicyReport(status={"bandit": {d: {"pulls": n, "mean_reward": round(self.rewards[d] / n, 4)}
                                                   for d, n in self.pulls.items()}})


# -- memspec ---------------------------------------------------------------------------------
def expected_seconds(tokens: int, tps_now: float, tps_new: float, load_s: float, catchup_s: float = 0.0,
                     overlap: float = 1.0) -> float:
    """Time to generate `tokens` running at `overlap` times `tps_now` while a draft loads for
    `load_s`, then, after `catchup_s` in which it feeds the context so far and nothing is
    generated, at `tps_new` (load_s = catchup_s = 0: the draft is there already; overlap 0: the
    load takes the cores the request decodes on, so it costs its whole time)."""
    tps_now, tps_new = max(tps_now, 1e-6), max(tps_new, 1e-6)
    during = load_s * tps_now * overlap
    if overlap > 0 and during >= tokens:
        return tokens / (tps_now * overlap)
    return load_s + catchup_s + (tokens - during) / tps_new


def request_trust(ran: Mapping[str, float], predicted: Mapping[str, float]) -> float:
    """How far the predictor's gains held on this request, in [0, 1]: where two drafts or more ran long
    enough to be measured (`ran`: their rates here), the best share of a draft's predicted gain over
    target-only (`predicted`, with NO_DRAFT's) that its measured rate gave, at most 1; else 1."""
    none = predicted.get(NO_DRAFT, 0.0)
    shares = [(rate - none) / (predicted[d] - none) for d, rate in ran.items() if predicted.get(d, 0.0) > none]
    return min(1.0, max(0.0, max(shares))) if len(ran) >= 2 and shares else 1.0


def predictor_file(path: str, variant: str = "", target: str = "") -> Path | None:
    """The predictor to use: `path` when set; else the shipped one fitted for the target and its
    variant, models/predictor-TARGET-VARIANT.json, then models/predictor-TARGET.json; else the
    default target's models/predictor-VARIANT.json or models/predictor.json, where they were fitted
    on `target` (their info says which; any target when `target` is not given).  None: no shipped
    predictor was fitted for this target."""
    from memspec.models.store import SHIPPED_MODELS

    if path:
        return Path(path)
    from memspec.runtime.plan import profiled_as

    nearest = [v for v in (variant, profiled_as(variant)) if v]  # its own variant's, else the nearest one's
    for name in ([f"predictor-{target}-{v}.json" for v in nearest] + [f"predictor-{target}.json"] if target else ()):
        if (SHIPPED_MODELS / name).is_file():
            return SHIPPED_MODELS / name
    own = SHIPPED_MODELS / f"predictor-{variant}.json"
    for file in ((own,) if variant else ()) + (SHIPPED_MODELS / "predictor.json",):
        if file.is_file() and (not target or _fitted_target(file) in ("", target)):
            return file
    return None


def _fitted_target(file: Path) -> str:
    """The target name a predictor file was fitted on ("" when it does not say)."""
    try:
        info = json.loads(file.read_text()).get("info") or {}
    except (OSError, ValueError):
        return ""
    return str(info.get("target") or "").rsplit(":", 1)[0]


def load_predictor(path: str, variant: str = "", target: str = ""):
    """The predictor for `target` of `variant` (see predictor_file); None when none is configured and
    none was fitted for this target; a ConfigError naming what is missing or broken."""
    try:
        from memspec.scheduling.predictor import Predictor
    except ImportError as exc:
        raise ConfigError(f"policy 'memspec' needs the predictor, but memspec/scheduling/predictor.py cannot be "
                          f"imported ({exc}); use another [scheduler] policy until it is installed") from None
    file = predictor_file(path, variant, target)
    if file is None:
        return None
    if not file.is_file():
        raise ConfigError(f"policy 'memspec' needs a trained predictor, but {file} does not exist "
                          f"(memspec train-predictor writes it; or set [scheduler] predictor)")
    pred = Predictor.load(file)
    fitted = str(pred.info.get("target") or "")  # "name:variant" of the traces it was fitted on
    if variant and ":" in fitted and fitted.rsplit(":", 1)[1] != variant:
        from memspec.runtime.config import NATIVE_VARIANT

        # the native engine runs the q4 variant as NATIVE_VARIANT: `memspec profile` on the default engine traces it
        profile = "memspec profile" if variant == NATIVE_VARIANT else f"memspec profile --variant {variant}"
        log.warning("predictor %s was fitted on traces of %s, but the target runs as %s; its costs and choices "
                    "may not hold (%s, then memspec train-predictor)", file, fitted, variant, profile)
    return pred


class Memspec(Policy):
    name = "memspec"

    def __init__(self, sched: PolicyContext, predictor):
        self.sched, self.predictor = sched, predictor
        self.values: dict[str, float] = {}  # draft -> expected gain over target-only (EMA), for eviction
        self.pred_err = [0.0, 0]  # sum of |observed - predicted| / predicted, checks
        self.predictions = 0  # predictor calls
        self._lock = threading.Lock()  # the three above are written from every request's thread

    def _predict(self, text: str, ctx=None) -> dict[str, float]:
        with self._lock:
            self.predictions += 1
        pred = self.predictor.predict(text, ctx)
        ws = self.sched.ws
        usable = {d: v for d, v in pred.items() if d == NO_DRAFT or (d in self.sched.drafts and ws.is_available(d))}
        usable.setdefault(NO_DRAFT, 0.0)
        return usable

    def _best(self, pred: dict[str, float], tokens: int, current: str | None,
              context: int = 0) -> tuple[str, float]:
        """The draft with the least expected time for `tokens` more tokens, counting loads:
        a resident draft runs at once; a missing one loads while `current` (or the best
        resident) runs, as fast as the load leaves it (the working set's load_overlap), and the
        drafts worth keeping that its load evicts are counted at the time they take to load again.
        Mid-request (`context` tokens so far) a draft other than `current` first catches up on
        the whole context.  At the start that is the prompt, which the predictor's rates already
        include.  Returns (draft or 'none', expected seconds)."""
        ws = self.sched.ws
        resident = {d for d in pred if d == NO_DRAFT or ws.is_resident(d)}
        now = current if current is not None else max(resident, key=lambda d: pred[d])
        best, best_s = now, expected_seconds(tokens, pred[now], pred[now], 0.0)
        for d, tps in pred.items():
            load_s = 0.0 if d in resident else ws.expected_load_s(d)
            reload_s = 0.0 if d in resident else ws.expected_reload_s(d)
            catchup_s = ws.expected_catchup_s(d, context) if context and d not in (now, NO_DRAFT) else 0.0
            s = expected_seconds(tokens, pred[now], tps, load_s, catchup_s, ws.load_overlap) + reload_s
            if s < best_s:
                best, best_s = d, s
        return best, best_s

    def start(self, req, prompt, capacity, cancelled):
        sched, ws = self.sched, self.sched.ws
        pred = self._predict(request_text(req))
        self._learn_values(pred)
        best, _ = self._best(pred, min(req.max_tokens, sched.config.expected_tokens), None)
        lease, pending = None, None
        if best != NO_DRAFT:
            lease = ws.lease(best, wait=False)  # a hit, or a miss: then it loads while the request starts
            if lease is None and ws.fetch(best):
                pending = best
        if lease is None:
            resident = [d for d in pred if d != NO_DRAFT and ws.is_resident(d)]
            start = max(resident, key=lambda d: pred[d], default=None)
            if start is not None and pred[start] > pred[NO_DRAFT]:
                lease = ws.lease(start, wait=False)
        sel = RequestSelector(ws, sched.count, req, prompt, capacity, lease, on_close=self._done,
                              switcher=self.switch, switch_every=sched.config.switch_every_steps,
                              clock=ws.clock)
        sel.pending = pending
        chosen = sel.name or NO_DRAFT
        sel.predicted[chosen] = pred.get(chosen, 0.0)
        sched.count("memspec.start_best" if chosen == best else "memspec.start_while_loading")
        log.debug("memspec: predicted %s; best %s, starts on %s%s", {k: round(v, 1) for k, v in pred.items()},
                  best, chosen, f", loading {pending}" if pending else "")
        return sel

    def switch(self, sel: RequestSelector) -> None:
        """Every few steps: ask again with the generation context, and switch when it pays."""
        sched, ws = self.sched, self.sched.ws
        ctx = generation_context(sched.decode, sel.generated, sel.recent_acceptance(), sel.mean_entropy())
        pred = self._predict(request_text(sel.req), ctx)
        self._compare(sel, pred)
        predicted = dict(pred)
        current = sel.name or NO_DRAFT
        # The drafts this request ran long enough (the one it runs and the ones it left, so that it
        # does not go back and forth) are worth what their steps here accepted, priced as the rest's
        # predictions are: a fast or slow spell of the machine moves none of them against the others.
        # A draft it left is judged by its prediction again once the text changed (RequestSelector.set_aside).
        measured, ran = set(), {}
        for d in sel.window:
            mal, drafted, steps = sel.recent_quantities(d)
            if d in pred and d != NO_DRAFT and steps >= SWITCH_EVIDENCE_STEPS:
                ran[d] = self.predictor.rate(d, mal, drafted)
                if not sel.set_aside(d, pred[d], sched.config.switch_margin):
                    pred[d] = ran[d]
                    measured.add(d)
        # Two drafts or more that did worse here than predicted say the prompt misled the predictor (advice
        # on SmolLM2: every draft predicted 1.15-1.5x target-only, each accepting a quarter), not the draft:
        # the drafts the request has not run, or left and would take again, are taken at its word as far as
        # it held here.  One draft that did worse says no more than that the runner-up may do better.
        if sel.recall is not None:  # the recall's steps (copies of an earlier answer) say nothing of the rest
            ran.pop(SUFFIX, None)
        trust, none = request_trust(ran, predicted), pred.get(NO_DRAFT, 0.0)
        for d in pred:
            if d not in measured and d not in (NO_DRAFT, current) and pred[d] > none:
                pred[d] = none + trust * (pred[d] - none)
        if current not in measured:  # target-only (or a draft not measured yet) doing better in this
            # request than predicted keeps its measured rate
            pred[current] = max(pred.get(current, 0.0), sel.observed_rate(current, SWITCH_EVIDENCE_TOKENS))
        recent = sel.window.get(current)  # its last selector.WINDOW_STEPS steps
        if current != NO_DRAFT and recent and len(recent) == recent.maxlen and not any(d for d, _ in recent):
            # its cost controller (or the gate) has stopped it drafting: here it is worth a plain step,
            # and a draft predicted to beat that may be tried (its catch-up and the margin counted)
            pred[current] = min(pred[current], pred.get(NO_DRAFT, 0.0))
        margin = sched.config.switch_margin
        pred = {d: v for d, v in pred.items()  # drafts it has not run wait for their turn (RequestSelector.may_try)
                if d == NO_DRAFT or not sel.untried(d) or sel.may_try(d, predicted.get(d, v), margin)}
        left = max(min(sel.req.max_tokens - ctx.position, sched.config.expected_tokens), 1)
        best, best_s = self._best(pred, left, current, len(sel.context))
        if best == current or best_s * (1 + sched.config.switch_margin) > left / max(pred[current], 1e-6):
            return  # it must save at least switch_margin of the time left, its load and catch-up counted
        if best == NO_DRAFT:
            sel.drop()
            sched.count("switches")
            log.debug("memspec: request %s drops %s for target-only (context changed)", id(sel), current)
        elif ws.is_resident(best):
            lease = ws.lease(best, wait=False)
            if lease is not None:
                if sel.untried(best):
                    sel.tried(predicted)
                sel.switch_to(lease, f"predicted {pred[best]:.1f} vs {pred.get(current, 0):.1f} tok/s")
        elif sel.pending != best and ws.fetch(best):
            if sel.untried(best):
                sel.tried(predicted)
            sel.pending = best
            log.debug("memspec: request %s loads %s to switch to it", id(sel), best)

    def _compare(self, sel: RequestSelector, pred: dict[str, float]) -> None:
        """Prediction against what the current draft did so far in this request."""
        name = sel.name or NO_DRAFT
        tokens, seconds = sel.observed.get(name, (0.0, 0.0))
        if name in sel.predicted and seconds > 0 and tokens >= 8:
            observed = tokens / seconds
            err = abs(observed - sel.predicted[name]) / max(sel.predicted[name], 1e-6)
            with self._lock:
                self.pred_err[0] += err
                self.pred_err[1] += 1
            log.debug("memspec: %s predicted %.1f tok/s, observed %.1f", name, sel.predicted[name], observed)
        sel.predicted.update(pred)

    def _learn_values(self, pred: dict[str, float]) -> None:
        """Each draft's expected value: a moving average of its predicted gain over target-only."""
        decay = self.sched.config.value_decay
        with self._lock:
            for d in self.sched.drafts:
                gain = max(pred.get(d, 0.0) - pred.get(NO_DRAFT, 0.0), 0.0)
                self.values[d] = decay * self.values.get(d, gain) + (1 - decay) * gain
            values = dict(self.values)
        for d, v in values.items():
            self.sched.ws.set_value(d, v)

    def _done(self, sel: RequestSelector) -> None:
        if sel.pending:
            self.sched.count("memspec.pending_at_end")
        if self.sched.config.preload:
            self.preload_likely()

    def preload_likely(self) -> None:
        """Preload the drafts worth most per byte that admission lets in without evicting better ones."""
        drafts, ws = self.sched.drafts, self.sched.ws
        with self._lock:
            values = dict(self.values)
        for d in sorted(values, key=lambda d: -values[d] / max(drafts.get(d, 1), 1)):
            if values[d] > 0 and not ws.is_resident(d):
                ws.preload(d)

    def warm(self) -> None:
        """Fill the working set before the first request: the drafts worth most per byte by the
        predictor's prior (what each added on the requests it was fastest for), as far as the
        budget admits them without evicting one worth more.  A cold start instead loads the first
        request's draft while it runs, and evicts for the next one's (the drafts thrash)."""
        if not self.sched.config.preload:
            return
        prior = {d: v for d, v in self.predictor.prior().items() if d in self.sched.drafts}
        ws, sizes = self.sched.ws, self.sched.drafts
        with self._lock:
            for d, v in prior.items():
                self.values.setdefault(d, v)
        for d in sorted(prior, key=lambda d: -prior[d] / max(sizes[d], 1)):
            ws.set_value(d, prior[d])
            if ws.preload(d):
                self.sched.count("memspec.warm_preloads")

    def hint(self, req: GenerationRequest) -> None:
        """A request waiting in the queue: preload what it will want."""
        if not self.sched.config.preload:
            return
        ws = self.sched.ws
        pred = self._predict(request_text(req))
        best = max(pred, key=pred.get)
        if best != NO_DRAFT and not ws.is_resident(best):
            with self._lock:
                value = self.values.get(best, 0.0)
            ws.set_value(best, max(value, pred[best] - pred[NO_DRAFT]) * 2)
            if ws.preload(best):
                self.sched.count("memspec.preload_for_queue")
                log.debug("memspec: preloading %s for a queued request", best)

    def report(self) -> PolicyReport:
        with self._lock:
            total, n = self.pred_err
            predictor = {"predictions": float(self.predictions), **({"checked_predictions": float(n)} if n else {})}
            return PolicyReport(counters={"prediction_mean_rel_error": total / n} if n else {},
                                status={"values": {d: round(v, 3) for d, v in self.values.items()}},
                                predictor=predictor)


# -- oracle ----------------------------------------------------------------------------------
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


class Oracle(Policy):
    name = "oracle"

    def __init__(self, sched: PolicyContext, table: dict[str, str]):
        self.sched, self.table = sched, table  # {prompt text: fastest draft}

    def warm(self) -> None:
        for name in self.sched.drafts:  # all preloaded, at no cost to any request (its budget is none)
            self.sched.ws.preload(name)

    def start(self, req, prompt, capacity, cancelled):
        best = self.table.get(request_text(req))
        if best is None:
            self.sched.count("oracle_unknown_prompt")
            log.debug("oracle: prompt not in the table: target-only")
            return None
        return self.sched.leased(self.name, req, prompt, capacity, best, cancelled) if best != NO_DRAFT else None


# -- the registry ----------------------------------------------------------------------------
def _fixed(name: PolicyName, ctx: PolicyContext) -> Policy:
    if name.draft not in ctx.drafts:
        raise unknown_draft(name.draft, ctx.drafts, "policy")
    return Fixed(ctx, name.draft)


def _memspec(name: PolicyName, ctx: PolicyContext) -> Policy:
    predictor = ctx.predictor()
    if predictor is None:  # a target nobody fitted a predictor for (say your own GGUF): learn online
        log.warning("policy 'memspec': no predictor was fitted for %s (memspec profile --model %s, then "
                    "memspec train-predictor, or set [scheduler] predictor); the bandit chooses its drafts",
                    ctx.target or "this target", ctx.target or "NAME")
        return Bandit(ctx)
    return Memspec(ctx, predictor)


# each policy kind (memspec.request.POLICY_KINDS) -> its policy over a scheduler's context
POLICIES: dict[str, Callable[[PolicyName, PolicyContext], Policy]] = {
    "target-only": lambda name, ctx: TargetOnly(),
    "fixed": _fixed,
    "bandit": lambda name, ctx: Bandit(ctx),
    "memspec": _memspec,
    "oracle": lambda name, ctx: Oracle(ctx, ctx.oracle_table()),
}


def build_policy(name: PolicyName, ctx: PolicyContext) -> Policy:
    """The policy `name` names, over `ctx` (ConfigError: its predictor or oracle table is missing)."""
    return POLICIES[name.kind](name, ctx)
