"""What the daemon serves with: the resident models, behind the small interface the server needs.

The server asks a `Backend` to check a request (and say how many KV bytes it
needs), to stream it, and for its models and status.  `EngineBackend` is the
implementation over one engine (`ServingEngine`: memspec.speculation.engine.Engine,
a target and its draft source); the draft source's report is what `status()`
gives under "drafts", "scheduler" and "predictor".
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
from memspec.request import Chunk, Completion, GenerationRequest, Limits, quote

log = logging.getLogger("memspec.backend")


class ServingEngine(Protocol):
    """What the backend needs of an engine (memspec.speculation.engine.Engine)."""

    target: "memspec.speculation.engine.TargetModel"  # noqa: F821  (name, variant, session, manifest, file_bytes)
    limits: Limits  # bounds every request; reconfigure() replaces them
    drafts: "memspec.speculation.sources.DraftSource"  # noqa: F821
    batch: "memspec.speculation.batching.BatchLoop | None"  # noqa: F821  (None: requests run their own passes)

    def check(self, req: GenerationRequest) -> list[int]: ...  # validate fully; the prompt ids
    def kv_bytes(self, req: GenerationRequest, prompt: list[int]) -> int: ...  # memory.request_kv_bytes
    def stream(self, req: GenerationRequest, cancel: threading.Event | None = None,
               prompt: list[int] | None = None) -> Iterator[Chunk | Completion]: ...
    def calibrate(self) -> list[float] | None: ...  # measure verification cost once
    def close(self) -> None: ...


EngineLoader = Callable[[Config, str], ServingEngine]  # (config, variant) -> engine (memspec.cli.load_engine)


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
    """A request that passed check(): the engine that checked it (and runs it, even after a
    LoadModel), its prompt ids (so it is tokenized once) and its KV bytes."""

    engine: ServingEngine
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
    """One engine: its target and the drafts its source holds are the resident set."""

    config: Config
    loader: EngineLoader  # builds an engine; tests pass a fake
    store: "memspec.models.store.ModelStore"  # noqa: F821
    engine: ServingEngine | None = None
    started: bool = False  # the first target load has finished
    _lock: threading.Lock = field(default_factory=threading.Lock)  # one LoadModel at a time
    _config_lock: threading.Lock = field(default_factory=threading.Lock)  # config and engine limits (SIGHUP)
    _count_lock: threading.Lock = field(default_factory=threading.Lock)
    _drafts: dict[str, DraftCounters] = field(default_factory=dict)  # draft name -> counters

    def start(self) -> dict:
        """Load the configured target (at daemon start)."""
        out = self.load(self.config.model.target, self.config.model.variant)
        self.started = True
        return out

    def _engine(self) -> ServingEngine:
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
        return Checked(engine, prompt, engine.kv_bytes(req, prompt))

    def open(self, req: GenerationRequest, cancel: threading.Event, checked: Checked | None = None) -> Run:
        # The run holds the engine that checked it (and the draft it picks) until it is closed.
        checked = checked or self.check(req)
        engine = checked.engine
        return Run(engine.target.name, engine.target.variant, engine.stream(req, cancel, checked.prompt_ids))

    def hint(self, req: GenerationRequest) -> None:
        """A checked request is about to wait in the queue: let the draft source preload its draft."""
        engine = self.engine
        if engine is not None:
            try:
                engine.drafts.hint([req])
            except Exception:  # advisory: a failed preload must not fail the request
                log.warning("queue hint failed", exc_info=True)

    def record(self, completion: Completion) -> None:
        name = draft_used(completion.stats)
        if name:
            with self._count_lock:
                self._drafts.setdefault(name, DraftCounters()).add(completion.stats)

    # -- models ----------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return sum(m["bytes"] for m in _resident(self.engine))

    def models(self) -> list[dict]:
        resident = {m["name"]: m["variant"] for m in _resident(self.engine)}
        return [{
            "name": m.name, "role": m.role, "variants": {v: m.variant_bytes(v) for v in m.variants},
            "source": m.provenance.get("source", ""), "resident": m.name in resident,
            "resident_variant": resident.get(m.name, ""),
        } for m in self.store.list()]

    def load(self, name: str, variant: str | None) -> dict:
        manifest = self.store.get(name)  # ModelNotFoundError
        if manifest.role != "target":
            raise InvalidRequestError(f"name: {quote(name)} is a {manifest.role}; drafts are loaded with their target")
        variant = variant or self.config.model.variant
        manifest.variant_path(variant)  # ModelNotFoundError names the variants it has
        config = dataclasses.replace(self.config, model=dataclasses.replace(self.config.model, target=name,
                                                                               variant=variant))
        with self._lock:
            t0 = time.perf_counter()
            engine = self.loader(config, variant)
            engine.calibrate()  # measure verification cost now, not in the first request
            with self._config_lock:  # a SIGHUP during the load changed the limits: keep its config
                self.config = dataclasses.replace(self.config, model=config.model)
                engine.limits = self.config.limits
                old, self.engine = self.engine, engine  # running streams keep theirs
            if old is not None:
                old.close()  # its drafts go; a stream still on it keeps the one it holds
            load_ms = (time.perf_counter() - t0) * 1e3
            target = _resident(engine)[0]
        return {"model": target, "load_ms": load_ms}

    def unload(self, name: str) -> int:
        with self._lock:
            engine = self.engine
            resident = _resident(engine)
            if engine is not None and engine.target.name == name:
                self.engine = None
                engine.close()
                return sum(m["bytes"] for m in resident)  # the target takes its drafts with it
            freed = engine.drafts.unload(name) if engine is not None else None
            if freed is not None:
                return freed
        have = ", ".join(m["name"] for m in resident) or "none"
        raise ModelNotFoundError(f"name: {quote(name)} is not resident (resident: {have})")

    # -- status ------------------------------------------------------------------------
    def status(self) -> dict:
        engine = self.engine
        if engine is None:
            return {"resident": [], "drafts": [], "predictor": {}, "scheduler": {}, "batch": {}, "warnings": []}
        report = engine.drafts.report()
        with self._count_lock:
            drafts = [{"name": d.name, "resident": d.resident, "bytes": d.bytes,
                       **self._drafts.get(d.name, DraftCounters()).to_dict()} for d in report.drafts]
        out = {"resident": _resident(engine), "drafts": drafts, "predictor": dict(report.predictor),
               "scheduler": dict(report.scheduler)}
        if report.budget_bytes is not None:  # the draft source's memory budget is the one that holds
            out["budget_bytes"] = int(report.budget_bytes)
        out["batch"] = engine.batch.report() if engine.batch is not None else {}
        out["warnings"] = [w for w in (engine.target.session.rows.warning(),) if w]
        return out

    def reconfigure(self, config: Config) -> None:
        """Apply what can change at run time: the request limits."""
        with self._config_lock:
            self.config = dataclasses.replace(config, model=self.config.model)
            if self.engine is not None:
                self.engine.limits = config.limits

    def close(self) -> None:
        """Drop the engine at shutdown, joining its loader thread (memspec.speculation.engine.Engine.close)."""
        with self._lock:
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


def _resident(engine: ServingEngine | None) -> list[dict]:
    """The target and the drafts pinned with it, as ListModels and GetStatus show them."""
    if engine is None:
        return []
    t = engine.target
    rows = t.session.rows  # the self-check at load (memspec.runtime.invariance)
    out = [{"name": t.name, "role": "target", "variant": t.variant, "bytes": t.file_bytes,
            "device": t.session.device, "providers": list(t.session.providers),
            "row_invariant": rows.exact, "exactness": rows.reason}]
    batch = getattr(engine, "batch", None)
    if batch is not None:  # [runtime] batching: the ragged batched graph holds its own copy of the weights
        out.append({"name": t.name, "role": "batched", "variant": t.variant, "bytes": batch.target.weight_bytes,
                    "device": t.session.device, "providers": list(t.session.providers)})
    for name, d in sorted(engine.drafts.pinned().items()):
        if d.session is not None:  # a model draft (prompt lookup holds no weights)
            out.append({"name": name, "role": "draft", "variant": d.session.path.stem, "bytes": d.nbytes,
                        "device": d.session.device, "providers": list(d.session.providers)})
    return out
