"""What the daemon serves with: the resident models, behind the small interface the server needs.

The server asks a `Backend` to check a request (holding its target, and saying
how many KV bytes it needs), to stream it, and for its models and status.
`EngineBackend` is the implementation over the loaded targets, each an engine
(`ServingEngine`: memspec.speculation.engine.Engine, a target and its draft
source), which a TargetSet (memspec.scheduling.targets) alone loads and unloads;
the backend adds what the store knows (which names are targets, their variants
and planned footprint).  The draft sources' reports are what `status()` gives
under "drafts", "scheduler" and "predictor".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol

from memspec.config import Config
from memspec.models.tokenizer import Tokenizer
from memspec.errors import ConfigError, InvalidRequestError, ModelNotFoundError, UnavailableError
from memspec.request import (KEEP_FOREVER, Chunk, Completion, GenerationRequest, Limits, SpecStats, from_plain,
                             parse_keep_alive, quote, validate)
from memspec.runtime.context import trained_context
from memspec.runtime.memory import MemoryProbe, MiB, PsutilProbe, memory_budget
from memspec.runtime.plan import plan
from memspec.scheduling.scheduler import check_draft_names
from memspec.scheduling.targets import TargetLease, TargetSet
from memspec.serving.status import DraftStatus, ModelsStatus, ResidentModel, TargetStatus

log = logging.getLogger("memspec.backend")


class ServingEngine(Protocol):
    """What the backend needs of an engine (memspec.speculation.engine.Engine)."""

    target: "memspec.speculation.engine.TargetModel"  # noqa: F821  (name, variant, session, manifest, file_bytes)
    limits: Limits  # bounds every request; reconfigure() replaces them
    drafts: "memspec.speculation.sources.DraftSource"  # noqa: F821
    batch: "memspec.speculation.batching.BatchLoop | None"  # noqa: F821  (None: requests run their own passes)
    prefixes: "memspec.runtime.prefixes.PrefixCache | None"  # noqa: F821  (None: no prompt prefixes kept)

    def check(self, req: GenerationRequest) -> list[int]: ...  # validate fully; the prompt ids
    def kv_bytes(self, req: GenerationRequest, prompt: list[int]) -> int: ...  # memory.request_kv_bytes
    def max_new(self, req: GenerationRequest, prompt: list[int]) -> int: ...  # request.new_tokens
    def stream(self, req: GenerationRequest, cancel: threading.Event | None = None,
               prompt: list[int] | None = None,
               progress: Callable[[str], None] | None = None) -> Iterator[Chunk | Completion]: ...
    def calibrate(self) -> list[float] | None: ...  # measure verification cost once
    def close(self) -> None: ...


EngineLoader = Callable[[Config, str], ServingEngine]  # (config, variant) -> engine (memspec.cli.serving_engine)


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
    LoadModel), its prompt ids (so it is tokenized once), its KV bytes, and its hold on the
    target (released once the request ends, whatever ended it)."""

    engine: ServingEngine
    prompt_ids: list[int]
    kv_bytes: int
    lease: TargetLease | None = None  # None: nothing to hand back
    max_new: int = 0  # the most new tokens it gets (memspec.request.new_tokens)

    def release(self) -> None:
        """The request ended: its target's keep-alive starts once no other request holds it."""
        if self.lease is not None:
            self.lease.release()


class Backend(Protocol):
    config: Config  # what it runs with; config.limits bound every request
    # load its target if need be (telling progress how the load goes); its prompt ids and KV bytes
    def check(self, req: GenerationRequest, cancelled: Callable[[], bool] = ..., timeout: float | None = None,
              progress: Callable[[str], None] | None = None) -> Checked: ...
    # stream it; progress: told how far a long prompt's prefill has come
    def open(self, req: GenerationRequest, cancel: threading.Event, checked: Checked,
             progress: Callable[[str], None] | None = None) -> Run: ...
    def pull(self, name: str, progress: Callable[[str], None]) -> None: ...  # a catalogued model into the store
    # load a target (or unload it: keep_alive 0) with no request to run; its name
    def warm(self, name: str | None, keep_alive: float | None, timeout: float | None = None) -> str: ...
    def record(self, completion: Completion) -> None: ...  # count a finished request
    def hint(self, req: GenerationRequest) -> None: ...  # a checked request will wait in the queue
    def resident_bytes(self) -> int: ...
    def models(self) -> list[dict]: ...
    def tokenizer(self, name: str | None) -> Tokenizer: ...  # a target's (None: the default target's)
    def load(self, name: str, variant: str | None) -> dict: ...
    def unload(self, name: str) -> int: ...
    def status(self) -> ModelsStatus: ...
    def reconfigure(self, config: Config) -> None: ...
    def close(self) -> None: ...


@dataclass
class DraftCounters:
    """What one draft did across requests (vLLM's words)."""

    requests: int = 0  # requests it served
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, stats: SpecStats) -> None:
        self.requests += 1
        self.num_drafts += stats.num_drafts
        self.num_draft_tokens += stats.num_draft_tokens
        self.num_accepted_tokens += stats.num_accepted_tokens

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0,
        }


@dataclass
class EngineBackend:
    """The loaded targets, each an engine with its own drafts: a TargetSet (memspec.scheduling.targets)
    loads them on demand within the memory budget and unloads them when idle."""

    config: Config
    loader: EngineLoader  # builds an engine; tests pass a fake
    store: "memspec.models.store.ModelStore"  # noqa: F821
    probe: MemoryProbe | None = None  # the daemon's memory (None: psutil's); tests pass a fake
    clock: Callable[[], float] = time.monotonic
    # target name -> the drafts its requests may name, known before it loads (the daemon's: the store's,
    # as its scheduler offers them, memspec.scheduling.scheduler.draft_names); None: checked once loaded
    drafts_of: Callable[[str], list[str]] | None = None
    started: bool = False  # the first target load has finished
    _config_lock: threading.Lock = field(default_factory=threading.Lock)  # config and engine limits (SIGHUP)
    _count_lock: threading.Lock = field(default_factory=threading.Lock)
    _drafts: dict[str, DraftCounters] = field(default_factory=dict)  # draft name -> counters
    _tokenizers: dict[str, Tokenizer] = field(default_factory=dict)  # targets not loaded: read from the store

    def __post_init__(self):
        probe = self.probe or PsutilProbe()
        try:  # the keep-alive of a target loaded on demand, unless its requests say otherwise
            self.keep_alive = parse_keep_alive(self.config.model.keep_alive, "[model] keep_alive")
        except InvalidRequestError as exc:
            raise ConfigError(str(exc)) from None
        budget = memory_budget(self.config.scheduler.budget_mb, probe)
        self.targets = TargetSet(self._load_engine, self._plan, probe, budget,
                                 self.config.server.memory_headroom_mb * MiB, self.clock)

    def start(self) -> dict:
        """Load the configured target (at daemon start), then let idle targets expire."""
        out = self.load(self.config.model.target, self.config.model.variant)
        self.started = True
        self.targets.start()
        return out

    @property
    def engine(self) -> ServingEngine | None:
        """The default target's engine (the one a request that names no model gets), if loaded."""
        return dict(self.targets.engines()).get(self.config.model.target)

    # -- the store: what a name may load as ----------------------------------------------
    def _plan(self, name: str, variant: str | None, field: str = "model") -> tuple[str, int]:
        """(variant, planned bytes) of target `name` (memspec.runtime.plan.plan): the variant asked
        for, else the configured one where it has it, else q4, else its first; named errors for
        anything that is not a target, naming the request's `field` ("model"; LoadModel's "name"
        keeps the store's own message)."""
        p = plan(self.store, name, variant, self.config.runtime, self.config.model.variant, field)
        return p.asked, p.planned_bytes

    def _load_engine(self, name: str, variant: str) -> ServingEngine:
        """What the TargetSet's loader thread runs: the engine of `name`, calibrated, with the limits now."""
        config = dataclasses.replace(self.config, model=dataclasses.replace(self.config.model, target=name,
                                                                               variant=variant))
        engine = self.loader(config, variant)
        engine.calibrate()  # measure verification cost now, not in the first request
        with self._config_lock:  # a SIGHUP during the load changed the limits: keep its config
            engine.limits = self.config.limits
        return engine

    # -- requests ------------------------------------------------------------------
    def check(self, req: GenerationRequest, cancelled: Callable[[], bool] = lambda: False,
              timeout: float | None = None, progress: Callable[[str], None] | None = None) -> Checked:
        """Hold the request's target (loading it first if need be, waiting at most `timeout` s and
        not past `cancelled()`, telling `progress` how the load goes), then check the request
        against it."""
        if not self.started:
            raise UnavailableError(f"the daemon is starting: loading {self.config.model.target}")
        validate(req, self.config.limits)  # a bad field costs no load
        name = req.model or self.config.model.target
        if self.drafts_of is not None and (req.draft is not None or req.policy is not None):
            self._plan(name, None)  # an unknown or draft model is named first, as the load would
            check_draft_names(req, self.drafts_of(name))  # nor does an unknown draft cost a load
        default = KEEP_FOREVER if name == self.config.model.target else self.keep_alive
        lease = self.targets.acquire(name, None, req.keep_alive, default, cancelled, timeout, progress)
        try:
            engine = lease.engine
            prompt = engine.check(req)  # limits, draft, policy, context; raises InvalidRequest / ContextOverflow
            return Checked(engine, prompt, engine.kv_bytes(req, prompt), lease, engine.max_new(req, prompt))
        except BaseException:
            lease.release()
            raise

    def warm(self, name: str | None, keep_alive: float | None, timeout: float | None = None) -> str:
        """Ollama's request with no prompt: load target `name` (None: the default) as a request
        would, and let its keep-alive start; keep_alive 0 unloads it now (or once its requests end)
        instead.  Returns the target's name."""
        if not self.started:
            raise UnavailableError(f"the daemon is starting: loading {self.config.model.target}")
        name = name or self.config.model.target
        self._plan(name, None)  # an unknown name or a draft is refused as a request's "model"
        if keep_alive == 0:
            self.targets.unload(name)
            return name
        default = KEEP_FOREVER if name == self.config.model.target else self.keep_alive
        self.targets.acquire(name, None, keep_alive, default, timeout=timeout).release()
        return name

    def pull(self, name: str, progress: Callable[[str], None]) -> None:
        """Fetch and convert a catalogued model into the store (memspec.models.pull), as `memspec
        pull NAME` does; progress hears each step."""
        from memspec.models.pull import pull

        pull(self.store, name, None, progress=progress, runtime=self.config.runtime)

    def open(self, req: GenerationRequest, cancel: threading.Event, checked: Checked,
             progress: Callable[[str], None] | None = None) -> Run:
        # The run holds the engine that checked it (and the draft it picks) until it is closed.
        engine = checked.engine
        return Run(engine.target.name, engine.target.variant, engine.stream(req, cancel, checked.prompt_ids, progress))

    def hint(self, req: GenerationRequest) -> None:
        """A checked request is about to wait in the queue: let the draft source preload its draft."""
        engine = dict(self.targets.engines()).get(req.model or self.config.model.target)
        if engine is not None:
            try:
                engine.drafts.hint([req])
            except Exception:  # advisory: a failed preload must not fail the request
                log.warning("queue hint failed", exc_info=True)

    def record(self, completion: Completion) -> None:
        name = completion.stats.draft
        if name:
            with self._count_lock:
                self._drafts.setdefault(name, DraftCounters()).add(completion.stats)

    # -- models ----------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return sum(m["bytes"] for _, e in self.targets.engines() for m in _resident(e))

    def models(self) -> list[dict]:
        engines = self.targets.engines()
        resident = {m["name"]: m["variant"] for _, e in engines for m in _resident(e)}
        contexts = {name: e.target.session.max_context for name, e in engines}
        kvs = {name: e.target.session.kv for name, e in engines}
        return [{
            "name": m.name, "role": m.role, "variants": self.store.runnable(m),
            "source": m.provenance.get("source", ""), "resident": m.name in resident,
            "resident_variant": resident.get(m.name, ""),
            "architecture": dict(m.architecture), "provenance": dict(m.provenance),
            # the context it has while loaded (memspec.runtime.context), and the one it was trained for
            "context": contexts.get(m.name, 0), "trained_context": trained_context(m.architecture) or 0,
            "kv": kvs.get(m.name, ""),  # its KV cache's format while loaded ([runtime] kv on the native engine)
        } for m in self.store.list()]

    def tokenizer(self, name: str | None) -> Tokenizer:
        """Target `name`'s tokenizer (None: the default target's): the loaded engine's, else read from
        the store (no weights are loaded to tokenize); the errors of a request naming that model."""
        name = name or self.config.model.target
        engine = dict(self.targets.engines()).get(name)
        if engine is not None:
            return engine.target.tokenizer
        with self._count_lock:
            tok = self._tokenizers.get(name)
        if tok is None:
            self._plan(name, None)  # not in the store, or a draft: named as a request's "model"
            folder = Path(self.store.get(name).folder)
            tok = Tokenizer.from_file(folder / "tokenizer.json", folder / "tokenizer_config.json")
            with self._count_lock:
                self._tokenizers[name] = tok
        return tok

    def load(self, name: str, variant: str | None) -> dict:
        """LoadModel: make `name` resident (kept until told otherwise) and the default target."""
        t0 = time.perf_counter()
        variant, _ = self._plan(name, variant or self.config.model.variant, field="name")
        self._drop_other_variant(name, variant)
        lease = self.targets.acquire(name, variant, KEEP_FOREVER)
        engine = lease.engine
        lease.release()
        with self._config_lock:
            old = self.config.model.target
            self.config = dataclasses.replace(self.config, model=dataclasses.replace(self.config.model, target=name,
                                                                                        variant=variant))
        if old != name:  # no longer the default: it expires like any other
            self.targets.keep(old, self.keep_alive)
        return {"model": _resident(engine)[0], "load_ms": (time.perf_counter() - t0) * 1e3}

    def _drop_other_variant(self, name: str, variant: str) -> None:
        row = next((r for r in self.targets.status() if r["name"] == name and r["state"] == "loaded"), None)
        if row is not None and row["variant"] != variant:
            if row["active"]:
                raise InvalidRequestError(f"name: {quote(name)} is loaded as {row['variant']} and in use by "
                                          f"{row['active']} request(s); load {variant} once they end")
            self.targets.unload(name)

    def unload(self, name: str) -> int:
        """UnloadModel: a target now (or once its requests end), with its drafts; or one draft.
        Returns the weight bytes freed (the resident rows' bytes)."""
        engines = self.targets.engines()
        target = dict(engines).get(name)
        if target is not None and self.targets.unload(name) is not None:
            return sum(m["bytes"] for m in _resident(target))
        for _, engine in engines:
            freed = engine.drafts.unload(name)
            if freed is not None:
                return freed
        have = ", ".join(dict.fromkeys(m["name"] for _, e in engines for m in _resident(e))) or "none"
        raise ModelNotFoundError(f"name: {quote(name)} is not resident (resident: {have})")

    # -- status ------------------------------------------------------------------------
    def status(self) -> ModelsStatus:
        engines = self.targets.engines()  # most recently used first
        # a loaded target's variant as its engine runs it ("gguf" on the native engine), as "resident" says
        runs = {name: dict(variant=e.target.variant, context=e.target.session.max_context, kv=e.target.session.kv)
                for name, e in engines}
        targets = [dict(r, **runs[r["name"]]) if r["name"] in runs else r for r in self.targets.status()]
        drafts: dict[str, DraftStatus] = {}
        for _, engine in engines:  # a draft every target has (prompt lookup) is listed once: counters are by name
            for d in self._draft_rows(engine.drafts.report()):
                drafts.setdefault(d.name, d)
        out = dict(resident=tuple(from_plain(ResidentModel, m) for _, e in engines for m in _resident(e)),
                   drafts=tuple(drafts.values()), targets=tuple(from_plain(TargetStatus, r) for r in targets),
                   warnings=tuple(w for _, e in engines for w in (e.target.session.rows.warning(),) if w))
        main = dict(engines).get(self.config.model.target) or (engines[0][1] if engines else None)
        if main is not None:  # counters of one engine: the default target's, else the last used
            report = main.drafts.report()
            out.update(predictor=dict(report.predictor), scheduler=dict(report.scheduler),
                       batch=main.batch.report() if main.batch is not None else {},
                       prefix_cache=main.prefixes.report() if main.prefixes is not None else {})
            if report.budget_bytes is not None:
                out["budget_bytes"] = int(report.budget_bytes)
        if self.targets.budget:
            out["budget_bytes"] = self.targets.budget
        return ModelsStatus(**out)

    def _draft_rows(self, report) -> list[DraftStatus]:
        with self._count_lock:
            return [DraftStatus(name=d.name, resident=d.resident, bytes=d.bytes,
                                **self._drafts.get(d.name, DraftCounters()).to_dict()) for d in report.drafts]

    def reconfigure(self, config: Config) -> None:
        """Apply what can change at run time: the request limits."""
        with self._config_lock:
            self.config = dataclasses.replace(config, model=self.config.model)
            for _, engine in self.targets.engines():
                engine.limits = config.limits

    def close(self) -> None:
        """Unload every target at shutdown, joining their loader threads (Engine.close)."""
        self.targets.close()


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
