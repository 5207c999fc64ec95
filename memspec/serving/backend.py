"""What the daemon serves with: the resident models, behind the small interface the server needs.

The server asks a `Backend` to check a request (and say how many KV bytes it
needs), to stream it, and for its models and status.  `EngineBackend` is the
implementation over one `Engine` (a target and the drafts the engine holds).
When the scheduler owns the resident set, it implements the same protocol;
its counters and the predictor's are what `status()` reports under
"scheduler" and "predictor" (empty while there is none).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from memspec.config import Config
from memspec.errors import InvalidRequestError, ModelNotFoundError, NotLoadedError, UnavailableError
from memspec.request import Chunk, Completion, GenerationRequest, validate
from memspec.models.store import ModelStore

log = logging.getLogger("memspec.backend")

EngineLoader = Callable[[Config, str], object]  # (config, variant) -> Engine (memspec.cli.load_engine)


class Counters(Protocol):
    def counters(self) -> dict[str, float]: ...


@dataclass
class Run:
    """One request being generated: who answers, and the engine's stream."""

    model: str  # target name
    variant: str
    items: Iterator[Chunk | Completion]  # Engine.stream(); closing it frees the KV cache and draft state

    def close(self) -> None:
        self.items.close()


@dataclass(frozen=True)
class Checked:
    """A request that passed check(): its prompt ids (so it is tokenized once) and its KV bytes."""

    prompt_ids: list[int]
    kv_bytes: int


class Backend(Protocol):
    config: Config  # what it runs with; config.limits bound every request
    def check(self, req: GenerationRequest) -> Checked: ...  # validate fully: prompt ids, KV bytes
    def open(self, req: GenerationRequest, cancel: threading.Event, checked: Checked | None = None) -> Run: ...
    def record(self, completion: Completion) -> None: ...  # count a finished request
    def hint(self, req: GenerationRequest) -> None: ...  # a checked request will wait in the queue
    def resident_bytes(self) -> int: ...
    def models(self) -> list[dict]: ...
    def load(self, name: str, variant: str | None) -> dict: ...
    def unload(self, name: str) -> int: ...
    def status(self) -> dict: ...
    def reconfigure(self, config: Config) -> None: ...
    def close(self) -> None: ...


@dataclass
class DraftCounters:
    """What one draft did across requests (vLLM's words)."""

    requests: int = 0  # requests it served
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, stats: dict) -> None:
        self.requests += 1
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            setattr(self, key, getattr(self, key) + int(stats.get(key, 0)))

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0,
        }


def draft_used(stats: dict) -> str:
    """The draft a finished request ran with ("" = target only), from its stats."""
    used = stats.get("drafts_used") or {}
    return max(used, key=used.get) if used else ""


@dataclass
class EngineBackend:
    """One engine: its target and drafts are the resident set."""

    config: Config
    loader: EngineLoader  # builds an Engine; tests pass a fake
    store: ModelStore
    scheduler: Counters | None = None  # the scheduler (default: the engine's, if it has one)
    predictor: Counters | None = None  # the draft-choice predictor (default: the scheduler's)
    policies: tuple[str, ...] = ()  # draft-selection policies a request may name
    engine: object | None = None
    started: bool = False  # the first target load has finished
    _lock: threading.Lock = field(default_factory=threading.Lock)  # one LoadModel at a time
    _count_lock: threading.Lock = field(default_factory=threading.Lock)
    _drafts: dict[str, DraftCounters] = field(default_factory=dict)  # draft name -> counters

    def start(self) -> dict:
        """Load the configured target (at daemon start)."""
        out = self.load(self.config.model.target, self.config.model.variant)
        self.started = True
        return out

    def _engine(self):
        engine = self.engine
        if engine is None:
            if not self.started:
                raise UnavailableError(f"the daemon is starting: loading {self.config.model.target}")
            raise NotLoadedError("no target is loaded; call LoadModel (memspec load NAME) first")
        return engine

    # -- requests ------------------------------------------------------------------
    def check(self, req: GenerationRequest) -> Checked:
        engine = self._engine()
        prompt = engine.check(req)  # limits, draft, policy, context; raises InvalidRequest / ContextOverflow
        scheduler = getattr(engine, "scheduler", None)
        if scheduler is None and req.policy is not None and req.policy not in self.policies:
            known = ", ".join(self.policies) or "none"
            raise InvalidRequestError(f"policy: unknown policy {req.policy!r}; known: {known}")
        # a draft named by hand brings its KV cache; the scheduler's picks are reserved as they run
        proposer = getattr(engine, "drafts", {}).get(req.draft) if scheduler is not None \
            else engine.draft_for(req) if hasattr(engine, "draft_for") else _target_only(req)
        session = engine.target.session
        tokens = len(prompt) + req.max_tokens
        need = session.cache_nbytes(tokens)
        draft_session = getattr(proposer, "session", None)
        if draft_session is not None:
            need += draft_session.cache_nbytes(tokens)
        return Checked(prompt, need)

    def open(self, req: GenerationRequest, cancel: threading.Event, checked: Checked | None = None) -> Run:
        # The run holds this engine (and the draft it picks) until it is closed.
        engine = self._engine()
        prompt = checked.prompt_ids if checked is not None else None
        return Run(engine.target.name, engine.target.variant, engine.stream(req, cancel, prompt))

    def hint(self, req: GenerationRequest) -> None:
        """A checked request is about to wait in the queue: let the scheduler preload its draft."""
        scheduler = getattr(self.engine, "scheduler", None)
        if scheduler is not None:
            try:
                scheduler.hint([req])
            except Exception:  # advisory: a failed preload must not fail the request
                log.warning("queue hint failed", exc_info=True)

    def record(self, completion: Completion) -> None:
        name = draft_used(completion.stats)
        if name:
            with self._count_lock:
                self._drafts.setdefault(name, DraftCounters()).add(completion.stats)

    # -- models ----------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return sum(m["bytes"] for m in self._resident())

    def _resident(self) -> list[dict]:
        engine = self.engine
        if engine is None:
            return []
        t = engine.target
        rec = t.manifest.variants.get(t.variant, {}) if t.manifest else {}
        out = [{"name": t.name, "role": "target", "variant": t.variant,
                "bytes": rec.get("bytes") or t.session.path.stat().st_size,
                "device": t.session.device, "providers": list(t.session.providers)}]
        for name, d in sorted(getattr(engine, "drafts", {}).items()):
            s = getattr(d, "session", None)
            if s is not None:  # a model draft (prompt lookup holds no weights)
                out.append({"name": name, "role": "draft", "variant": s.path.stem, "bytes": d.nbytes,
                            "device": s.device, "providers": list(s.providers)})
        return out

    def models(self) -> list[dict]:
        resident = {m["name"]: m["variant"] for m in self._resident()}
        return [{
            "name": m.name, "role": m.role, "variants": {v: r["bytes"] for v, r in m.variants.items()},
            "source": m.provenance.get("source", ""), "resident": m.name in resident,
            "resident_variant": resident.get(m.name, ""),
        } for m in self.store.list()]

    def load(self, name: str, variant: str | None) -> dict:
        manifest = self.store.get(name)  # ModelNotFoundError
        if manifest.role != "target":
            raise InvalidRequestError(f"name: {name!r} is a {manifest.role}; drafts are loaded with their target")
        variant = variant or self.config.model.variant
        manifest.variant_path(variant)  # ModelNotFoundError names the variants it has
        config = dataclasses.replace(self.config, model=dataclasses.replace(self.config.model, target=name,
                                                                               variant=variant))
        with self._lock:
            t0 = time.perf_counter()
            engine = self.loader(config, variant)
            if hasattr(engine, "calibrate"):  # measure verification cost now, not in the first request
                engine.calibrate()
            old, self.engine, self.config = self.engine, engine, config  # running streams keep theirs
            _retire(old)
            load_ms = (time.perf_counter() - t0) * 1e3
        return {"model": self._resident()[0], "load_ms": load_ms}

    def unload(self, name: str) -> int:
        with self._lock:
            engine = self.engine
            resident = self._resident()
            if engine is not None and engine.target.name == name:
                self.engine = None
                _retire(engine)
                return sum(m["bytes"] for m in resident)  # the target takes its drafts with it
            drafts = getattr(engine, "drafts", {}) if engine is not None else {}
            if name in drafts:
                engine.drafts = {k: v for k, v in drafts.items() if k != name}
                return int(getattr(drafts[name], "nbytes", 0))
        have = ", ".join([m["name"] for m in resident] + sorted(drafts)) or "none"
        raise ModelNotFoundError(f"name: {name!r} is not resident (resident: {have})")

    # -- status ------------------------------------------------------------------------
    def status(self) -> dict:
        engine = self.engine
        proposers = getattr(engine, "drafts", {}) if engine is not None else {}
        scheduler = self.scheduler or getattr(engine, "scheduler", None)
        predictor = self.predictor or getattr(scheduler, "predictor", None)
        if hasattr(scheduler, "status"):  # the scheduler owns the drafts: every draft it may use
            table = scheduler.status()["working_set"]["drafts"]
            drafts = [{"name": n, "resident": table.get(n, {}).get("state") == "resident",
                       "bytes": int(table.get(n, {}).get("bytes", size)),
                       **self._drafts.get(n, DraftCounters()).to_dict()} for n, size in sorted(scheduler.drafts.items())]
        else:
            drafts = [{"name": n, "resident": True, "bytes": int(getattr(d, "nbytes", 0)),
                       **self._drafts.get(n, DraftCounters()).to_dict()} for n, d in sorted(proposers.items())]
        out = {
            "resident": self._resident(),
            "drafts": drafts,
            "predictor": _counters(predictor),
            "scheduler": _counters(scheduler),
        }
        if hasattr(scheduler, "status"):  # the scheduler's memory budget is the one that holds
            out["budget_bytes"] = int(scheduler.status().get("budget_bytes", 0))
        return out

    def reconfigure(self, config: Config) -> None:
        """Apply what can change at run time: the request limits."""
        self.config = dataclasses.replace(config, model=self.config.model)
        if self.engine is not None:
            self.engine.limits = config.limits

    def close(self) -> None:
        """Drop the engine at shutdown, joining its loader thread (memspec.speculation.engine.Engine.close)."""
        with self._lock:
            engine, self.engine = self.engine, None
        _retire(engine)


def _counters(obj) -> dict[str, float]:
    """An optional component's counters ({} when there is none, or it keeps none)."""
    return dict(obj.counters()) if hasattr(obj, "counters") else {}


def _retire(engine) -> None:
    """Stop a replaced or unloaded engine's background loading.  Its drafts go; a stream still
    running on it keeps the draft it holds, and runs target-only if it wants another."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def _target_only(req: GenerationRequest):
    if req.draft not in (None, "none"):
        raise InvalidRequestError(f"draft: unknown draft {req.draft!r}; available: none")
    return None
