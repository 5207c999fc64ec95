"""The planner: which engine runs a target, as which variant, at what memory footprint.

    p = plan(store, "qwen2.5-coder-1.5b", "q4", config.runtime)
    p.engine, p.variant, p.planned_bytes     # "native", "gguf", 1.2e9

One answer for every caller: the loader opens what the plan says (memspec.runtime.target), the
daemon's admission plans a target it may load on demand with it (memspec.serving.backend), and the
scheduler pins the target and picks its predictor by it.  No engine is imported here: planning
needs neither ONNX Runtime nor the native kernels.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from memspec.runtime.config import GPU_PROVIDERS


def onnxruntime_missing() -> str | None:
    """None where ONNX Runtime imports, else what to install (the one message memspec gives)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:  # memspec does not depend on one ONNX Runtime build: the machine picks it
        return (f"ONNX Runtime is not installed ({exc}): pip install 'memspec[cpu]' (the onnxruntime package), or on "
                f"a Jetson the JetPack build of onnxruntime-gpu from NVIDIA's index (not both: they replace each other)")
    return None


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
