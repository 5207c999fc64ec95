"""The planner: which engine runs a target, as which variant, at what memory footprint.

    p = plan(store, "qwen2.5-coder-1.5b", "q4", config.runtime)
    p.engine, p.variant, p.planned_bytes     # "native", "gguf", 1.2e9

One answer for every caller: the loader opens what the plan says (memspec.runtime.target), the
daemon's admission plans a target it may load on demand with it (memspec.serving.backend), and the
scheduler pins the target and picks its predictor by it.  No engine is imported here: a plan for
the native engine needs neither ONNX Runtime nor the kernels loaded; one for ONNX Runtime asks it
which execution providers this build has (the graph CUDA runs differs: variant_for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from memspec.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from memspec.request import quote
from memspec.runtime.config import GPU_PROVIDERS, NATIVE_VARIANT, SessionConfig

BACKENDS = ("auto", "native", "onnxruntime")
# Whether "auto" runs a target natively on a CPU where it can (engine_for): the native engine measures
# faster there end to end (docs/history/results.md, issue 29).
AUTO_NATIVE = True

# RSS a native target adds per byte of its GGUF: the mapped file, read whole by the first pass, and the
# pass's buffers (the 1.5B: 1069 MiB of process RSS for a 986 MB GGUF, the interpreter included).
NATIVE_FOOTPRINT_PER_FILE_BYTE = 1.1


@dataclass(frozen=True)
class Plan:
    """How a store target is loaded here: the one answer the loader, admission and scheduler share."""

    name: str  # the store entry
    manifest: "memspec.models.store.Manifest"  # noqa: F821
    asked: str  # the variant as a request or the config names it, resolved: an ONNX variant ("q4", "fp32");
    #             the native engine runs "q4" from the GGUF, the very blocks of the q4 graph
    engine: str  # "native" or "onnxruntime"
    variant: str  # what the engine runs: NATIVE_VARIANT ("gguf"), or the ONNX graph loaded (q4f16 for q4 on CUDA)
    planned_bytes: int  # the RSS loading it should add (what budgets and loading on demand plan with)
    warning: str | None = None  # a line for the log about the variant chosen (variant_for), or None


def plan(store, name: str, asked: str | None, config: SessionConfig, preferred: str = "q4",
         field: str | None = None) -> Plan:
    """The plan for target `name` of the store as `asked` (None: `preferred` where it has it, else
    q4, else its first graph; NATIVE_VARIANT: q4 on the native engine) under `config`.  Named errors
    for anything that cannot load, naming the request's `field` where one asked (a request's "model"
    lists the pulled targets; otherwise the store's own message stands): ModelNotFoundError (not in
    the store, or a variant it lacks),
    InvalidRequestError (a draft, or the native engine's variant where it does not run),
    ConfigError (an engine this machine cannot run)."""
    from memspec.runtime.memory import planned_target_footprint

    manifest = _target(store, name, field)
    have = sorted(manifest.variants)
    native = engine_for(store, manifest, "q4", config) == "native"
    if asked == NATIVE_VARIANT:  # what status lists a native target as: the q4 blocks, run as they are
        if not native:
            raise InvalidRequestError(f"variant: {NATIVE_VARIANT!r} is the native engine's, which does not run "
                                      f"{quote(name)} here ([runtime] backend = {quote(config.backend)}); ask for "
                                      f"one of {', '.join(have) or 'its ONNX variants, once pulled'}")
        asked = "q4"
    # the preferred variant where it has it, else q4 (a target pulled with its GGUF alone runs as q4 on
    # the native engine), else its first graph
    asked = asked or next((v for v in (preferred, "q4", *have) if v in have), "q4")
    if not (native and asked == "q4"):
        manifest.variant_path(asked)  # ModelNotFoundError names the variants it has
    if engine_for(store, manifest, asked, config) == "native":
        gguf = store.gguf_of(manifest)  # ModelFormatError: missing or not the one pulled
        return Plan(name, manifest, asked, "native", NATIVE_VARIANT,
                    int(gguf.stat().st_size * NATIVE_FOOTPRINT_PER_FILE_BYTE))
    from memspec.runtime.sessions import resolve_providers  # ONNX Runtime runs it: ConfigError where it is missing

    variant, warning = variant_for(asked, resolve_providers(config.providers), manifest.variants)
    planned = planned_target_footprint(manifest.variant_bytes(variant))
    return Plan(name, manifest, asked, "onnxruntime", variant, planned, warning)


def _target(store, name: str, field: str):
    """The manifest of target `name`, or the named error a request gets for it."""
    try:
        manifest = store.get(name)
    except ModelNotFoundError:
        if field != "model":
            raise
        pulled = ", ".join(m.name for m in store.list() if m.role == "target") or "none"
        raise ModelNotFoundError(f"model: {quote(name)} is not in the store; the pulled targets are {pulled} "
                                 f"(`memspec pull NAME` adds one)") from None
    if manifest.role != "target":
        raise InvalidRequestError(f"{field + ': ' if field else ''}{quote(name)} is a {manifest.role}; name a target, "
                                  f"and pick a draft with \"draft\" (drafts are loaded with their target)")
    return manifest



def variant_for(variant: str, providers: Sequence[str], available: Iterable[str]) -> tuple[str, str | None]:
    """The ONNX variant to load for `variant` on `providers`, and a warning for the log, or None.

    On CUDA, ONNX Runtime's GroupQueryAttention runs in float16/bfloat16 only, so a float32 graph
    would put every layer's attention on the CPU: q4 is served from its float16-activation twin,
    q4f16, where the store has it."""
    available = set(available)
    if variant != "q4" or not providers or providers[0] not in GPU_PROVIDERS:
        return variant, None
    if "q4f16" in available:
        return "q4f16", None
    return variant, (f"{providers[0]} with the float32 q4 graph: its attention will run on the CPU; "
                     f"build the CUDA variant with `memspec pull --variant q4f16 NAME`")


def profiled_as(variant: str) -> str | None:
    """The variant whose profiles (predictors, traces) are nearest to `variant`'s where it has none:
    the native engine runs the GGUF the q4 graph holds the very blocks of (the speeds differ; the
    scheduler warns that its costs may not hold).  None: no such stand-in."""
    return "q4" if variant == NATIVE_VARIANT else None


def batching_on(batching: bool | str, variant: str) -> bool:
    """Whether a target running `variant` batches concurrent requests under `[runtime] batching`:
    true or false as said; "auto" on the native engine only (its pass over several sequences is its
    own, exact and from one copy of the weights; ONNX Runtime's needs a second, batched graph)."""
    if isinstance(batching, bool):
        return batching
    if batching != "auto":
        raise ConfigError(f"[runtime] batching: {batching!r} is not a choice; use true, false or \"auto\"")
    return variant == NATIVE_VARIANT


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
    is an error at plan, with the command that fetches it."""
    engine = resolve_backend(config.backend, config.providers)
    if engine == "native" and config.backend == "auto":
        if variant != "q4":
            return "onnxruntime"
        gguf = store.gguf_path(manifest)
        if gguf is None or not gguf.is_file():
            return "onnxruntime"
    return engine


