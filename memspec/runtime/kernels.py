"""Exact GGUF block matmuls on the CPU: NumPy in, NumPy out, over the C extension
``memspec.runtime._native`` (sources in memspec/runtime/native/).

``matmul(raw, ggml_type, n, k, x)`` multiplies activation rows x (M, k) by the (n, k)
weight matrix whose GGUF blocks ``raw`` holds, without dequantizing it.  Quantized types
quantize each activation row to 8 bits (32 per scale for Q4_0/Q4_1/Q5_0/Q8_0, 256 for the
K-quants) and dot in integers; float types dot in float32.  A row's result is bit for bit
the same whatever the other rows and the thread count.

``reference_matmul`` is the float64 reference the tests compare against.
"""

from __future__ import annotations

import numpy as np

from memspec.errors import ConfigError


class NativeIsaRefused(ConfigError, ImportError):
    """The extension is built but refuses to load: $MEMSPEC_NATIVE_ISA names a path this CPU cannot
    run.  A ConfigError, so the CLI says so in a line and exits 2; an ImportError, as the import is."""


try:
    from memspec.runtime import _native
except ModuleNotFoundError:  # the extension was not built (no C compiler at install)
    _native = None
except ImportError as exc:  # built, and refusing $MEMSPEC_NATIVE_ISA: nothing can run a native pass
    raise NativeIsaRefused(f"{exc}: unset MEMSPEC_NATIVE_ISA, or set it to one of those") from None

NOT_BUILT = ("the native kernels are not built (no C compiler at install?): reinstall with gcc present; "
             "the ONNX Runtime engine still works")


class NativeKernelsUnavailable(ImportError):
    """memspec.runtime._native is missing."""


def available() -> bool:
    """Whether the native kernels are built."""
    return _native is not None


def build_id() -> str:
    """Which build of the extension this is (its file's size and time), so that what was measured
    with one build (a cost curve) is measured again after a rebuild."""
    import os

    st = os.stat(module().__file__)
    return f"{st.st_size}:{st.st_mtime_ns}"


def module():
    if _native is None:
        raise NativeKernelsUnavailable(NOT_BUILT)
    return _native


def isa() -> str:
    """The path matmul uses: "avx512" (with VNNI), "avx2", "neon" or "scalar" ($MEMSPEC_NATIVE_ISA=scalar forces scalar)."""
    return module().isa()


def isas() -> tuple[str, ...]:
    """Every path this CPU can run, for ``matmul(..., isa=)``."""
    return module().isas()


def matmul(raw: np.ndarray, ggml_type: int, n: int, k: int, x: np.ndarray, threads: int = 1,
           isa: str | None = None, packed: bytearray | bool | None = None) -> np.ndarray:
    """(M, n) float32 = x (M, k) float32 @ W.T.

    raw: the (n, k) matrix's GGUF bytes, rows of blocks (uint8, contiguous; a GGUFReader
    tensor's ``data`` works as it is).  threads split the n outputs.  isa forces a path
    (see :func:`isas`).  packed: None interleaves W for this call where the path multiplies
    its type 8 rows at a time (as the native target does at load); False keeps the row layout;
    :func:`pack`'s result skips the repacking.  The result is the same bits every way.  Raises
    ValueError on a bad type, size, shape or packed buffer."""
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (M, k={k}), got shape {x.shape}")
    out = np.empty((x.shape[0], n), dtype=np.float32)
    module().matmul(raw, ggml_type, n, k, x, out, threads, isa=isa, packed=packed)
    return out


def pack(raw: np.ndarray, ggml_type: int, n: int, k: int, isa: str | None = None) -> bytearray | None:
    """The (n, k) matrix interleaved 8 rows at a time as path `isa` multiplies it (native/pack.h),
    for ``matmul(..., packed=)``; None where the path keeps this type (or n) in its row layout."""
    return module().pack(raw, ggml_type, n, k, isa=isa)


def dequantize(raw: np.ndarray, ggml_type: int, n: int, k: int) -> np.ndarray:
    """(n, k) float32: W as the ``gguf`` package itself dequantizes it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    return gguf_dequantize(rows, GGMLQuantizationType(ggml_type)).reshape(n, k)


def reference_matmul(raw: np.ndarray, ggml_type: int, n: int, k: int, x: np.ndarray) -> np.ndarray:
    """(M, n) float64 = x @ W.T, W dequantized by the ``gguf`` package (the tests' reference)."""
    return np.asarray(x, dtype=np.float64) @ dequantize(raw, ggml_type, n, k).astype(np.float64).T
