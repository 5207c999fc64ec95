"""The one interface a target engine offers the layers above runtime/, and the choice of engine.

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

import logging
import os
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from memspec.errors import ConfigError
from memspec.runtime.config import GPU_PROVIDERS, NATIVE_VARIANT, SessionConfig  # noqa: F401 (NATIVE_VARIANT: re-exported)
from memspec.runtime.invariance import RowCheck
from memspec.runtime.kvcache import KVCache

log = logging.getLogger(__name__)
BACKENDS = ("auto", "native", "onnxruntime")


def profiled_as(variant: str) -> str | None:
    """The variant whose profiles (predictors, traces) are nearest to `variant`'s where it has none:
    the native engine runs the GGUF the q4 graph holds the very blocks of (the speeds differ; the
    scheduler warns that its costs may not hold).  None: no such stand-in."""
    return "q4" if variant == NATIVE_VARIANT else None
# Whether "auto" runs a target natively on a CPU where it can (engine_for): the native engine measures
# faster there end to end (docs/results.md, issue 29).
AUTO_NATIVE = True


class Target(Protocol):
    """A decoder that verifies drafts: k rows of logits per pass, a KV cache per sequence."""

    path: Path  # the file it runs: an ONNX graph or a GGUF
    device: str  # "cpu" or "cuda"
    providers: list[str]  # what computes it: ONNX Runtime's execution providers, or "memspec-native (isa)"
    vocab_size: int | None  # rows of its logits (None: not known before a pass)
    max_context: int  # a new cache's capacity in tokens
    threads: int  # CPU threads a pass runs on
    rows: RowCheck  # the self-check at load: is a row's result the same at any row count?
    prefix_reuse: bool  # may a prompt start from another's stored K/V (memspec.runtime.prefixes)?
    trees: bool  # may a pass verify a token tree (forward_tree, then the cache's keep_path)? native only

    def new_cache(self, capacity: int | None = None) -> KVCache: ...

    def forward(self, cache: KVCache, ids: Sequence[int], keep: int = 1) -> np.ndarray: ...

    def forward_batch(self, caches: Sequence[KVCache], feeds: Sequence[Sequence[int]],
                      keeps: Sequence[int]) -> list[np.ndarray]: ...

    def kv_bytes_per_token(self) -> int: ...

    def cache_nbytes(self, tokens: int) -> int: ...  # one sequence's resident KV bytes at `tokens`

    def cost_key(self, max_k: int) -> str: ...

    def measure_step_costs(self, max_k: int, context: int = 64, repeats: int = 3) -> list[float]: ...


class BatchedPass(Protocol):
    """One pass over several requests' rows, for the batch loop (memspec.speculation.batching)."""

    target: Target  # the one-request target (a request alone runs on it directly)
    rows: int  # most rows (requests) in one pass
    weight_bytes: int  # memory it holds beyond the target's own: a second copy of the weights, or 0

    def forward(self, caches: Sequence[KVCache], feeds: Sequence[Sequence[int]],
                keep: Sequence[int]) -> list[np.ndarray]: ...

    def release(self, cache: KVCache) -> None: ...  # the request is gone: keep none of its cache

    def measure_pass_costs(self, max_k: int, context: int = 64, repeats: int = 3) -> dict[int, list[float]]: ...


def open_batched(target: Target, rows: int) -> BatchedPass:
    """Passes of up to `rows` requests on `target`: the native engine batches by itself
    (NativeBatch); ONNX Runtime needs its ragged batched graph, a second copy of the weights
    (memspec.runtime.batch.BatchedTarget, CPU only)."""
    from memspec.runtime.native_target import NativeBatch, NativeTarget

    if isinstance(target, NativeTarget):
        return NativeBatch(target, rows)
    from memspec.runtime.batch import BatchedTarget

    return BatchedTarget(target, rows)


# RSS a native target adds per byte of its GGUF: the mapped file, read whole by the first pass, and the
# pass's buffers (the 1.5B: 1069 MiB of process RSS for a 986 MB GGUF, the interpreter included).
NATIVE_FOOTPRINT_PER_FILE_BYTE = 1.1


def planned_footprint(store, manifest, variant: str, config: SessionConfig) -> int:
    """The RSS loading this store target should add, by the engine `config.backend` picks: what
    loading on demand plans with (the native engine maps the GGUF; ONNX Runtime builds its
    session from the variant's graph: memory.planned_target_footprint)."""
    from memspec.runtime.memory import planned_target_footprint

    if engine_for(store, manifest, variant, config) == "native":
        return int(store.gguf_of(manifest).stat().st_size * NATIVE_FOOTPRINT_PER_FILE_BYTE)
    return planned_target_footprint(manifest.variant_bytes(variant))


def batching_on(batching: bool | str, variant: str) -> bool:
    """Whether a target running `variant` batches concurrent requests under `[runtime] batching`:
    true or false as said; "auto" on the native engine only (its pass over several sequences is its
    own, exact and from one copy of the weights; ONNX Runtime's needs a second, batched graph)."""
    if isinstance(batching, bool):
        return batching
    if batching != "auto":
        raise ConfigError(f"[runtime] batching: {batching!r} is not a choice; use true, false or \"auto\"")
    return variant == NATIVE_VARIANT


def physical_cores() -> int:
    """The default thread count of a target pass, for either engine."""
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except Exception:
        return os.cpu_count() or 1


def names_gpu(providers: Sequence[str]) -> bool:
    """Whether `[runtime] providers` name a provider other than the CPU's ("auto" names none)."""
    return any(p not in ("auto", "CPUExecutionProvider") for p in providers)


def on_gpu(providers: Sequence[str]) -> bool:
    """Whether `[runtime] providers` put the target on a GPU: one named (names_gpu), or "auto" where
    this onnxruntime build has CUDA or TensorRT (a Jetson with onnxruntime-gpu)."""
    if tuple(providers) in ((), ("auto",)):
        try:
            import onnxruntime as ort
        except ImportError:  # no ONNX Runtime at all: no GPU provider either
            return False
        return any(p in GPU_PROVIDERS for p in ort.get_available_providers())
    return names_gpu(providers)


def resolve_backend(backend: str, providers: Sequence[str]) -> str:
    """"native" or "onnxruntime" for `[runtime] backend` on these providers (config names)."""
    from memspec.runtime import kernels

    if backend not in BACKENDS:
        raise ConfigError(f"[runtime] backend: {backend!r} is not an engine; choose one of {', '.join(BACKENDS)}")
    if backend == "native":  # "auto" providers then mean the CPU's: the native engine runs there
        if names_gpu(providers):
            raise ConfigError(f"[runtime] backend = \"native\" runs on the CPU; providers {', '.join(providers)} ask "
                              f"for a GPU: set backend = \"onnxruntime\" (or \"auto\") for it")
        if not kernels.available():
            raise ConfigError(f"[runtime] backend = \"native\": {kernels.NOT_BUILT}")
        return "native"
    if backend == "auto":
        return "native" if AUTO_NATIVE and not on_gpu(providers) and kernels.available() else "onnxruntime"
    return backend


def needs_onnx(config: SessionConfig) -> bool:
    """Whether a target pulled here needs its ONNX graphs: the engine `config` picks on this machine
    is ONNX Runtime (a GPU, no native kernels, or backend = "onnxruntime"), or the config cannot run
    natively at all.  Where it is the native engine, the GGUF alone runs the target."""
    try:
        return resolve_backend(config.backend, config.providers) == "onnxruntime"
    except ConfigError:  # a config that runs no native target (native asked on a GPU, no kernels)
        return True


def engine_for(store, manifest, variant: str, config: SessionConfig) -> str:
    """"native" or "onnxruntime": the engine that runs this store target's `variant` under
    `config.backend`.  "auto" takes the native engine only where resolve_backend allows it, for the
    q4 variant (the graph of the GGUF's own blocks; a variant asked for by name, fp32 or q4f16, is
    another model and runs in ONNX Runtime), and where the target's GGUF is in the store (a target
    pulled by an older memspec has its ONNX graphs alone).  An explicit "native" without the GGUF
    is an error at open_target, with the command that fetches it."""
    engine = resolve_backend(config.backend, config.providers)
    if engine == "native" and config.backend == "auto":
        if variant != "q4":
            return "onnxruntime"
        gguf = store.gguf_path(manifest)
        if gguf is None or not gguf.is_file():
            return "onnxruntime"
    return engine


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
        return open_target(store, model, variant, config)[0]
    path = Path(model)
    if str(model).endswith(".gguf") or path.is_file():
        if resolve_backend(backend, config.providers) != "native":
            raise ConfigError(f"{model}: a GGUF file runs on the native engine only (backend = \"native\"); "
                              f"for ONNX Runtime convert it first: memspec pull --gguf {model} --name NAME")
        from memspec.runtime.native_target import NativeTarget

        return NativeTarget(path, threads=threads, max_context=max_context)
    if store is None:
        store = ModelStore(default_home())
    return open_target(store, store.get(str(model)), variant, config)[0]


def open_target(store, manifest, variant: str, config: SessionConfig) -> tuple[Target, str]:
    """The target engine for a store entry, by `config.backend`, and the variant it runs (the ONNX
    variant, or NATIVE_VARIANT).  Files are checked against the manifest before they are parsed."""
    if engine_for(store, manifest, variant, config) == "native":
        from memspec.runtime.native_target import NativeTarget

        gguf = store.gguf_of(manifest)  # ModelFormatError: missing or not the one pulled
        return NativeTarget(gguf, threads=config.intra_op_threads, max_context=config.max_context), NATIVE_VARIANT
    from memspec.runtime.sessions import DecoderSession, resolve_providers, variant_for

    variant, warning = variant_for(variant, resolve_providers(config.providers), manifest.variants)
    if warning:
        log.warning("%s: %s", manifest.name, warning)
    path = manifest.variant_path(variant)
    store.check_files(manifest, variant)  # a tampered or truncated file is refused before it is parsed
    session = DecoderSession(path, config, arena=True,  # pinned: never unloaded
                             min_rows=2 if config.batch_invariant else 1, check_rows=True)
    return session, variant

