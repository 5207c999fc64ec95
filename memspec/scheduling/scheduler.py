"""The scheduler: which draft each request runs with, and which drafts stay resident.

It is the engine's DraftSource (memspec.speculation.sources) when drafts are
scheduled.  For every request it asks the request's policy (memspec.scheduling.
policies: one class per policy, each with its own state) for a `RequestSelector`
(memspec.scheduling.selector), which holds at most one draft lease from the
`WorkingSet`, the resident set this scheduler alone owns.  A policy name is parsed
once, at the boundary, into a `PolicyName`; here it is only looked up.

Under memory pressure (working set `target_only`) every selector drops its draft
and the request goes on target-only; the output does not change (lossless).

The suffix draft (memspec.speculation.suffix) learns from every request, whichever draft
runs it, so the scheduler holds a lease on it for its whole life: its index is loaded at
start, counted in the budget at its bytes and never evicted (UnloadModel drops it).  Every
request a policy picks drafts for (not one that names its draft) also recalls from it: a step
whose text's end agrees with an indexed request for `recall_tokens` tokens or more proposes
what followed there (memspec.speculation.suffix.Recall).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import Counter
from typing import Callable, Iterator

from memspec.errors import ConfigError, InvalidRequestError
from memspec.request import NO_DRAFT, GenerationRequest, PolicyName, unknown_draft
from memspec.runtime.memory import MiB, MemoryProbe, memory_budget
from memspec.scheduling.config import SchedulerConfig
from memspec.scheduling.features import Detokenize
from memspec.scheduling.policies import Policy, PolicyContext, build_policy, load_oracle_table, load_predictor
from memspec.scheduling.selector import RequestSelector
from memspec.scheduling.workingset import Lease, Loader, WorkingSet
from memspec.speculation.drafts import PROMPT_LOOKUP
from memspec.speculation.sources import DraftRow, KVSizer, SourceStatus
from memspec.speculation.suffix import KEY, MAX_MATCH, SUFFIX, Recall, SuffixDraft

log = logging.getLogger("memspec.scheduler")
DRAFT_PREFIX = "draft_prefix."  # counters(): "draft_prefix.<draft>.<key>", a resident draft's PrefixCache.report()


class Scheduler:
    """Owns the working set and picks every request's draft."""

    def __init__(self, config: SchedulerConfig, loader: Loader, drafts: dict[str, int], probe: MemoryProbe,
                 target: tuple[str, int] | None = None, clock: Callable[[], float] = time.monotonic,
                 predictor=None, oracle_table: dict[str, str] | None = None, decode: Detokenize | None = None,
                 kv_sizers: dict[str, KVSizer] | None = None, variant: str = "", load_overlap: float = 1.0,
                 recall_tokens: int = 0, lookup_ngram: int = 0):
        """drafts: every draft it may use -> declared bytes; target: (name, bytes) to pin;
        predictor: memspec's (default: the shipped predictor for the target's `variant`);
        oracle_table: {prompt: draft} (default: from config.oracle); decode: the target's token ids -> text;
        kv_sizers: draft -> tokens -> bytes of its KV cache (a draft without one keeps none);
        load_overlap: the share of a request's speed kept while a draft loads beside it (load_overlap());
        recall_tokens: the match a step's recall needs (`[speculative] recall_tokens`; 0: no recall);
        lookup_ngram: the drafts' own lookup (`[speculative] lookup_ngram`), which a recall leaves alone."""
        if recall_tokens and not KEY <= recall_tokens <= MAX_MATCH:
            raise ConfigError(f"[speculative] recall_tokens must be 0 (off) or {KEY}..{MAX_MATCH}, got {recall_tokens}")
        self.recall_tokens, self.lookup_ngram = recall_tokens, lookup_ngram
        self.config = config
        self.variant = variant
        self.target_name = target[0] if target else ""
        self._kv_sizers = dict(kv_sizers or {})
        self._kv_ids = itertools.count(1)
        self.drafts = dict(drafts)
        self.clock = clock
        self.decode: Detokenize = decode or (lambda ids, skip_special_tokens=False: "")
        try:
            self.default = PolicyName.parse(config.policy, "[scheduler] policy")
        except InvalidRequestError as exc:
            raise ConfigError(str(exc)) from None
        oracle = self.default.kind == "oracle"
        budget = 0 if oracle else memory_budget(config.budget_mb, probe)
        self.ws = WorkingSet(budget, loader, probe, clock, config.pressure_floor_mb * MiB, sizes=drafts,
                             retry_after_s=config.retry_after_s, load_overlap=load_overlap)
        if target is not None:
            self.ws.pin(*target)
        self.stats: Counter[str] = Counter()  # written from every request's thread: under _stats_lock
        self._stats_lock = threading.Lock()
        self._predictor, self._oracle_table = predictor, oracle_table
        self._policies: dict[PolicyName, Policy] = {}
        # what its policies see of it (memspec.scheduling.policies.PolicyContext)
        self.context = PolicyContext(self.ws, config, self.drafts, self.count, self.leased, self.decode,
                                     self.target_name, self._load_predictor, self._load_oracle_table)
        self._policies_lock = threading.Lock()
        policy = self.policy(self.default)  # a missing predictor or oracle table fails at start, not at the first request
        self._suffix = self._hold(SUFFIX) if SUFFIX in self.drafts else None  # learns from every request
        policy.warm()  # what the first requests should find resident (the oracle: every draft)
        self.ws.wait_idle(timeout=600 if oracle else config.load_wait_s)

    def _hold(self, name: str) -> Lease | None:
        """A lease on `name` for the scheduler's life, once it is loaded (None: it does not fit the budget)."""
        if self.ws.fetch(name):
            self.ws.wait_idle(timeout=self.config.load_wait_s)
        lease = self.ws.lease(name, wait=False)
        if lease is None:
            log.warning("draft %s (%.1f MiB) cannot be loaded within the budget: it is not used",
                        name, self.drafts[name] / MiB)
        return lease

    # -- policies ---------------------------------------------------------------------
    def policy(self, name: PolicyName) -> Policy:
        """The policy object of `name`, built on first use (each keeps its own state)."""
        with self._policies_lock:
            policy = self._policies.get(name)
            if policy is None:
                policy = self._policies[name] = self._build(name)
            return policy

    def _build(self, name: PolicyName) -> Policy:
        return build_policy(name, self.context)  # memspec.scheduling.policies.POLICIES

    def _load_predictor(self):
        """memspec's predictor: the one given, else the shipped one for the target and its variant."""
        return self._predictor or load_predictor(self.config.predictor, self.variant, self.target_name)

    def _load_oracle_table(self) -> dict[str, str]:
        if self._oracle_table is None:
            if not self.config.oracle:
                raise ConfigError("policy 'oracle' needs a table of the fastest draft per prompt: "
                                  "set [scheduler] oracle to a JSON table or a JSONL trace file")
            self._oracle_table = load_oracle_table(self.config.oracle)
        return self._oracle_table

    def policy_for(self, req: GenerationRequest) -> PolicyName:
        """What runs this request: the draft it names, else the policy it names, else the configured one."""
        if req.draft is not None:
            return PolicyName.of_draft(req.draft)
        return req.policy or self.default

    def count(self, what: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[what] += n

    def leased(self, policy: str, req: GenerationRequest, prompt: list[int], capacity: int, name: str,
               cancelled: Callable[[], bool], on_close=None) -> RequestSelector | None:
        """A selector holding a lease on draft `name`, waiting while it loads, at most
        [scheduler] load_wait_s and not past a cancel (None: it cannot be had: target-only)."""
        lease = self.ws.lease(name, wait=True, timeout=self.config.load_wait_s, cancelled=cancelled) \
            if name in self.drafts else None
        if lease is None:
            self.count("no_draft")
            log.debug("%s: %s cannot be had; target-only", policy, name)
            return None
        log.debug("%s: %s", policy, name)
        return RequestSelector(self.ws, self.count, req, prompt, capacity, lease, on_close=on_close)

    # -- DraftSource ------------------------------------------------------------------
    def check(self, req: GenerationRequest) -> None:
        """Refuse an unknown draft or policy before any work."""
        check_draft_names(req, self.drafts)
        if req.policy is not None:
            self.policy(req.policy)  # an unknown fixed draft; a predictor or oracle table that is missing

    def draft_kv_sizers(self, req: GenerationRequest) -> list[KVSizer]:
        name = self.policy_for(req)
        if name.kind == "target-only":
            return []
        if name.kind == "fixed":
            return [self._kv_sizers[name.draft]] if name.draft in self._kv_sizers else []
        return list(self._kv_sizers.values())  # any draft the policy may pick

    def selector(self, req: GenerationRequest, prompt: list[int], capacity: int,
                 cancelled: Callable[[], bool] = lambda: False) -> RequestSelector | None:
        """The DraftSelector for one request (None = plain target-only decoding)."""
        name = self.policy_for(req)
        self.count("requests")
        self.count(f"policy.{name}")
        sel = self.policy(name).start(req, prompt, capacity, cancelled)
        suffix = self._suffix_draft()
        if sel is not None and suffix is not None and self.recall_tokens and name.kind != "fixed":
            sel.recall = Recall(suffix, self.recall_tokens, self.lookup_ngram)  # a named draft runs as named
        return sel

    @contextlib.contextmanager
    def reserve_kv(self, nbytes: int, cancelled: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Hold a running request's KV caches (`nbytes`, memory.request_kv_bytes) in the memory
        budget while it runs (see WorkingSet.reserve)."""
        key = f"request-{next(self._kv_ids)}"
        self.ws.reserve(key, nbytes, cancelled)
        try:
            yield
        finally:
            self.ws.unreserve(key)

    def hint(self, queued: list[GenerationRequest]) -> None:
        """Requests waiting in the queue: let their policies preload what they will want."""
        for req in queued:
            name = self.policy_for(req)
            if name in self._policies:  # built when the request was checked, or the configured one
                self.policy(name).hint(req)

    def pinned(self) -> dict:
        return {}  # drafts come and go in the working set; report() lists them

    def unload(self, name: str) -> int | None:
        """Evict a resident draft now (UnloadModel); InvalidRequestError while requests hold it.
        The suffix draft's own lease is given up first: its index is gone until a restart."""
        if name not in self.drafts or not self.ws.is_resident(name):
            return None
        if name != SUFFIX or self._suffix is None:
            return self.ws.unload(name)
        held, self._suffix = self._suffix, None
        held.release()
        try:
            return self.ws.unload(name)
        except InvalidRequestError:  # requests run on it: it stays, and goes on learning
            self._suffix = self.ws.lease(name, wait=False)
            raise

    def _suffix_draft(self) -> SuffixDraft | None:
        """The suffix draft the scheduler holds (None: none configured, it did not fit, or unloaded)."""
        held = self._suffix
        proposer = held.proposer if held is not None else None
        return proposer if isinstance(proposer, SuffixDraft) else None

    def learn(self, tokens: list[int]) -> None:
        """A finished request's prompt and committed output, for the suffix draft's index."""
        draft = self._suffix_draft()
        if draft is not None:
            draft.learn(tokens)

    def forget(self) -> None:
        """Drop what learn() indexed (a benchmark's rounds each start from an empty index)."""
        draft = self._suffix_draft()
        if draft is not None:
            draft.forget()

    def shrink(self, nbytes: int) -> int:
        """Give up unleased drafts, lowest value per byte first, until `nbytes` are freed."""
        return self.ws.shrink(nbytes)

    def add_spare(self, release: Callable[[], int]) -> None:
        """A cache emptied before any draft is evicted under memory pressure (WorkingSet.add_spare)."""
        self.ws.add_spare(release)

    def report(self) -> SourceStatus:
        table = self.ws.status()["drafts"]
        rows = [DraftRow(n, table.get(n, {}).get("state") == "resident", int(table.get(n, {}).get("bytes", size)))
                for n, size in sorted(self.drafts.items())]
        predictor = {k: v for policy in list(self._policies.values()) for k, v in policy.report().predictor.items()}
        return SourceStatus(rows, self.ws.budget, self.counters(), predictor)

    # -- reporting -----------------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        ws = self.ws.status()["counters"]
        with self._stats_lock:
            stats = dict(self.stats)
        out = {**{k: float(v) for k, v in ws.items()}, **{k: float(v) for k, v in stats.items()}}
        for policy in list(self._policies.values()):
            out.update(policy.report().counters)
        draft = self._suffix_draft()
        if draft is not None:  # what the index holds and how often it found a match
            out.update({f"suffix.{k}": float(v) for k, v in draft.index.report().items()})
        for name, proposer in self.ws.proposers().items():  # the prompts a resident native draft keeps
            prefixes = getattr(proposer, "prefixes", None)
            if prefixes is not None:
                out.update({f"{DRAFT_PREFIX}{name}.{k}": v for k, v in prefixes.report().items()})
        return out

    def status(self) -> dict:
        ws = self.ws.status()
        out = {
            "policy": self.config.policy,
            "budget_bytes": ws["budget_bytes"],
            "used_bytes": ws["used_bytes"],
            "resident": {**ws["pinned"], **{n: d["bytes"] for n, d in ws["drafts"].items() if d["state"] == "resident"}},
            "working_set": ws,
            "counters": self.counters(),
            "bandit": {},
            "values": {},
        }
        for policy in list(self._policies.values()):
            out.update(policy.report().status)
        return out

    def close(self) -> None:
        held, self._suffix = self._suffix, None
        if held is not None:
            held.release()
        self.ws.close()


def check_draft_names(req: GenerationRequest, drafts) -> None:
    """Refuse a request whose draft (or fixed policy's draft) is not one of `drafts`."""
    if req.draft not in (None, NO_DRAFT) and req.draft not in drafts:
        raise unknown_draft(req.draft, drafts)
    if req.policy is not None and req.policy.kind == "fixed" and req.policy.draft not in drafts:
        raise unknown_draft(req.policy.draft, drafts, "policy")


def draft_names(store, target_name: str, suffix: bool = True, session_config=None) -> list[str]:
    """The drafts a request for `target_name` may name, from the store alone (before the target
    loads): what from_store's scheduler offers, prompt lookup, the suffix draft (where
    `[speculative] suffix_mb` keeps one) and every draft made for it (that runs here under
    `session_config`, where given: memspec.speculation.drafts.runnable_drafts)."""
    from memspec.speculation.drafts import target_drafts
    from memspec.speculation.sources import DraftMaker

    return DraftMaker.names_for(target_drafts(store, target_name, config=session_config), suffix)


def draft_footprints(drafts: list, suffix_nbytes: int = 0) -> dict[str, int]:
    """Every draft (manifests) with the RSS footprint budgets plan it at, plus prompt lookup (0)
    and, when `suffix_nbytes` > 0, the suffix draft at those bytes (its index's and its corpus's:
    memspec.speculation.sources.suffix_nbytes)."""
    from memspec.runtime.memory import planned_draft_footprint
    from memspec.speculation.drafts import draft_variant

    suffix = {SUFFIX: suffix_nbytes} if suffix_nbytes else {}
    planned = {m.name: planned_draft_footprint(m.total_bytes, draft_variant(m)) for m in drafts}
    return {PROMPT_LOOKUP: 0, **suffix, **planned}


def draft_kv_sizers(drafts: list, capacity: int) -> dict[str, KVSizer]:
    """Each draft's (manifests) KV cache: tokens -> bytes once it holds that many, in caches of
    `capacity` slots (a request's draft cache is as long as its target cache)."""
    from memspec.runtime.kvcache import kv_cache_nbytes

    out = {}
    for m in drafts:
        a = m.architecture or {}
        if {"n_layers", "n_kv_heads", "head_dim"} <= set(a):
            rows, head_dim = 2 * int(a["n_layers"]) * int(a["n_kv_heads"]), int(a["head_dim"])
            out[m.name] = lambda tokens, rows=rows, head_dim=head_dim: kv_cache_nbytes(rows, head_dim, tokens, capacity)
    return out


def load_overlap(session_config, target) -> float:
    """The share of a running request's speed kept while a draft loads beside it: 0.0 where the
    target's CPU threads take every core the process may run on, so that the load (reading and
    packing the draft's weights) takes its time from decoding; 1.0 where a core is left over, or
    the target computes on a GPU.  Measured on 2 cores with the target on both: the 0.5B sibling's
    load ran 422-639 ms beside decoding against 222-352 ms alone, and decoding went at 0.3-0.5x
    its speed meanwhile (draft-chat's: 40-54 ms against 29)."""
    import os

    from memspec.runtime.config import GPU_PROVIDERS
    from memspec.runtime.contracts import physical_cores

    if any(p in GPU_PROVIDERS for p in getattr(target.session, "providers", None) or ()):
        return 1.0
    threads = getattr(session_config, "intra_op_threads", 0) or physical_cores()  # None: the defaults
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1.0 if cores > threads else 0.0


def from_store(config: SchedulerConfig, store, target, session_config, draft_limits, probe: MemoryProbe | None = None,
               names: list[str] | None = None, suffix_bytes: int = 0, batched_bytes: int = 0,
               process_bytes: int | None = None, corpus: bool = True, **kwargs) -> Scheduler:
    """A scheduler over every draft in the store made for `target` (a loaded TargetModel), plus prompt
    lookup and the suffix draft over an index of `suffix_bytes` (0: none; with `corpus`, starting from
    the target's shipped corpus where there is one); the target is pinned with
    `batched_bytes` more where its batched pass holds a second copy of its weights, or at
    `process_bytes` where given (the process as a budget was set from: several schedulers made one
    after another in one process then book the same, however its heap grew in between)."""
    from memspec.runtime.memory import PsutilProbe, planned_draft_footprint
    from memspec.speculation.sources import DraftMaker

    maker = DraftMaker.for_target(store, target.name, target.vocab_size, session_config, draft_limits, names,
                                  suffix_bytes, target.tokenizer, corpus)
    drafts = maker.manifests
    sizes = draft_footprints(drafts, maker.suffix_nbytes())

    def loader(name: str):
        d = maker.make(name)  # prompt lookup and the suffix draft hold what they say; a model draft as planned
        return d, d.nbytes if name in (PROMPT_LOOKUP, SUFFIX) else planned_draft_footprint(d.nbytes, d.variant)

    probe = probe or PsutilProbe()
    # the target is pinned at what the process holds now: the runtime, Python and the target
    # (with its batched graph's copy of the weights, when batching loaded one: memspec.build)
    pinned = target.file_bytes + batched_bytes
    process = probe.rss_bytes() if process_bytes is None else process_bytes
    kwargs.setdefault("load_overlap", load_overlap(session_config, target))
    kwargs.setdefault("recall_tokens", draft_limits.recall_tokens)
    kwargs.setdefault("lookup_ngram", draft_limits.lookup_ngram)
    return Scheduler(config, loader, sizes, probe, target=(target.name, max(pinned, process)),
                     decode=target.tokenizer.decode, kv_sizers=draft_kv_sizers(drafts, target.max_context),
                     variant=target.variant, **kwargs)
