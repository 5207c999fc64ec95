"""Opening a target on its engine, and the choice of engine.  The interface a target offers the
layers above runtime/ is `Target` (memspec.runtime.contracts).

    from memspec.runtime import load_target
    t = load_target(model, backend="native", threads=2)   # model: a store entry or a GGUF path
    c = t.new_cache()
    logits = t.forward(c, ids, keep=k)        # (k, vocab) float32, rows for the last k ids
    c.truncate(n)
    rows = t.forward_batch([c1, c2], [ids1, ids2], keeps=[k1, k2])   # one pass, a list of arrays

Two engines implement `Target`: memspec.runtime.native_target.NativeTarget (the GGUF's blocks as
they are, memspec's own exact kernels; CPU) and memspec.runtime.sessions.DecoderSession (a graph
converted for ONNX Runtime; CPU or CUDA).  `[runtime] backend` picks one: "native",
"onnxruntime", or "auto": native on a CPU where the kernels are built and the target's GGUF is in
the store (engine_for), ONNX Runtime otherwise (a GPU, no compiler, or a target pulled without
its GGUF).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from memspec.errors import ConfigError
from memspec.runtime.config import SessionConfig
from memspec.runtime.contracts import BatchedPass, Target
from memspec.runtime.plan import Plan, plan, resolve_backend

log = logging.getLogger(__name__)


def open_batched(target: Target, rows: int) -> BatchedPass:
    """Passes of up to `rows` requests on `target`: the native engine batches by itself
    (NativeBatch); ONNX Runtime needs its ragged batched graph, a second copy of the weights
    (memspec.runtime.batch.BatchedTarget, CPU only)."""
    from memspec.runtime.native_target import NativeBatch, NativeTarget

    if isinstance(target, NativeTarget):
        return NativeBatch(target, rows)
    from memspec.runtime.batch import BatchedTarget

    return BatchedTarget(target, rows)


def load_target(model, backend: str = "auto", threads: int = 0, max_context: int = 2048,
                store=None, variant: str = "q4") -> Target:
    """A target engine for `model`: a store entry (its Manifest, as ModelStore.get and list give
    it, or its name; the store: `store`, else the one the entry was read from, else the default
    one) or a GGUF file's path (native only: ONNX Runtime needs `memspec pull --gguf PATH --name
    NAME`)."""
    from memspec.models.store import Manifest, ModelStore, default_home

    config = SessionConfig(intra_op_threads=threads, max_context=max_context, backend=backend)
    if isinstance(model, Manifest):
        if model.role != "target":
            raise ConfigError(f"{model.name} is a {model.role}, not a target")
        if store is None:  # the store it was read from: its entries lie in HOME/models/NAME
            folder = model.folder
            store = ModelStore(folder.parent.parent if folder is not None and folder.parent.name == "models"
                               else default_home())
        return open_target(store, plan(store, model.name, variant, config), config)
    path = Path(model)
    if str(model).endswith(".gguf") or path.is_file():
        if resolve_backend(backend, config.providers) != "native":
            raise ConfigError(f"{model}: a GGUF file runs on the native engine only (backend = \"native\"); "
                              f"for ONNX Runtime convert it first: memspec pull --gguf {model} --name NAME")
        from memspec.runtime.native_target import NativeTarget

        return NativeTarget(path, threads=threads, max_context=max_context)
    if store is None:
        store = ModelStore(default_home())
    return open_target(store, plan(store, str(model), variant, config), config)


def open_draft(path: Path, engine: str, config: SessionConfig, threads: int) -> Target:
    """A draft's model on `engine`: "native" runs its GGUF, "onnxruntime" its graph on the drafts'
    providers (config.draft_providers, else the target's), with threads that sleep as soon as a step
    ends (a spinning pool would steal the cores the target verifies on next).  A draft only
    proposes: its rows need no invariance check."""
    if engine == "native":
        from memspec.runtime.native_target import NativeTarget

        return NativeTarget(path, threads=threads, max_context=config.max_context, check_rows=False)
    from memspec.runtime.sessions import DecoderSession

    if config.draft_providers:
        config = dataclasses.replace(config, providers=config.draft_providers)
    return DecoderSession(path, config, spinning=False, threads=threads)


def open_target(store, plan: Plan, config: SessionConfig) -> Target:
    """The target engine the plan names (memspec.runtime.plan): its GGUF on the native engine, or
    its graph in ONNX Runtime.  Files are checked against the manifest before they are parsed."""
    if plan.engine == "native":
        from memspec.runtime.native_target import NativeTarget

        gguf = store.gguf_of(plan.manifest)  # ModelFormatError: missing or not the one pulled
        return NativeTarget(gguf, threads=config.intra_op_threads, max_context=config.max_context)
    from memspec.runtime.sessions import DecoderSession

    if plan.warning:
        log.warning("%s: %s", plan.name, plan.warning)
    path = plan.manifest.variant_path(plan.variant)
    store.check_files(plan.manifest, plan.variant)  # a tampered or truncated file is refused before it is parsed
    return DecoderSession(path, config, arena=True,  # pinned: never unloaded
                          min_rows=2 if config.batch_invariant else 1, check_rows=True)
