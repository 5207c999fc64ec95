"""The runtime's config: how ONNX Runtime runs a model ([runtime] in the config file).

Kept apart from memspec.runtime.sessions, which imports onnxruntime and NumPy, so
that loading a config (and the light CLI commands) does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from memspec.errors import ConfigError

AUTO = "auto"  # max_context: the model's trained context, within the memory (memspec.runtime.context)


LARGE_DRAFT_BYTES = 64 * 2**20  # a draft this large runs on every core when draft_threads = 0
GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")  # ONNX Runtime's, in `providers`
KV_FORMATS = ("f16", "q8")  # [runtime] kv: the native engine's KV cache formats (native/attention.h)
NATIVE_VARIANT = "gguf"  # what status and the store call a native target's variant: the GGUF file itself


def onnxruntime_missing() -> str | None:
    """None where ONNX Runtime imports, else what to install (the one message memspec gives)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:  # memspec does not depend on one ONNX Runtime build: the machine picks it
        return (f"ONNX Runtime is not installed ({exc}): pip install 'memspec[cpu]' (the onnxruntime package), or "
                f"on a Jetson the JetPack build of onnxruntime-gpu from NVIDIA's index (not both: they replace each "
                f"other)")
    return None


@dataclass(frozen=True)
class SessionConfig:
    """How ONNX Runtime runs a model."""

    backend: str = "auto"  # the target's engine: "native" (memspec's kernels on the GGUF as it is, CPU),
    #                        "onnxruntime" (a converted graph; CPU or CUDA), "auto" (memspec.runtime.target)
    providers: tuple[str, ...] = ("auto",)  # EP names, or "auto" = best that ORT reports
    draft_providers: tuple[str, ...] = ()  # the drafts' EPs, if not the target's (a tiny draft step
    #                                        can be cheaper on the CPU than a GPU kernel launch each)
    intra_op_threads: int = 0  # target threads; 0 = one per physical core
    draft_threads: int = 0  # threads of each draft; 0 = by its size: one for a small draft (a second
    #                         pool would only wait), one per physical core for one of LARGE_DRAFT_BYTES
    #                         or more (a 0.5B sibling's step is memory-bound); draft pools never spin
    max_context: int | str = "auto"  # KV capacity in tokens (prompt + generated); "auto": the model's trained
    #                                  context, capped so that [server] max_concurrent requests' KV fit the
    #                                  memory (memspec.runtime.context)
    model_max_context: tuple[tuple[str, int | str], ...] = ()  # per target: ((store name, tokens or "auto"),
    #                                  ...); in the config file a table, { "qwen2.5-coder-1.5b" = 8192 }
    prefill_chunk: int = 512  # most prompt tokens per batched pass: a long prompt is fed in chunks beside the
    #                           other requests' decode steps, so that their tokens keep coming (batching on);
    #                           a chunk beside them costs about one of their steps (batching.PrefillPace)
    kv: str = "f16"  # the native engine's KV cache: "f16", or "q8" (int8 with a float32 scale per
    #                  position and KV head: about half the bytes; memspec.runtime.native_target)
    prefix_cache_mb: int = 64  # K/V of recent prompts kept for the next prompt that starts the same way
    #                            (memspec.runtime.prefixes; targets exact at any row count only); 0 = off
    batching: bool | str = "auto"  # concurrent requests share one batched target pass, [server]
    #                         max_concurrent rows (memspec.speculation.batching; CPU only): the native
    #                         engine batches its own passes; ONNX Runtime loads a second, batched graph
    #                         of the target.  "auto": on for the native engine, off for ONNX Runtime
    #                         (runtime.plan.batching_on)
    batch_invariant: bool = True  # target passes of one token run as two, so that target-only
    #                                decoding and multi-token verification use the same kernels and
    #                                greedy speculative output is target-only output token for token
    #                                (on q4 ~2% of tokens flip otherwise); graphs that pad attention
    #                                themselves (memspec.attention_pad) need neither, and ignore it

    def __post_init__(self):
        if self.kv not in KV_FORMATS:
            raise ConfigError(f"[runtime] kv: {self.kv!r} is not a KV cache format; choose one of "
                              f"{', '.join(KV_FORMATS)}")


def check_setting(value: object, where: str) -> int | str:
    """A max_context setting as the config gives it: "auto" or a whole number of tokens >= 16."""
    if value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 16):
        return value
    raise ConfigError(f"{where} must be \"auto\" (the model's trained context, within the memory) or a number of "
                      f"tokens of at least 16, got {value!r}")
