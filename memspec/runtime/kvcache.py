"""A sequence's KV cache as every target engine keeps it, and what its pages cost.

No ONNX Runtime, no native code: the scheduler and the memory accounting import this to count
bytes, and each engine (memspec.runtime.sessions, memspec.runtime.native_target) subclasses
`KVCache` with its own buffers.
"""

from __future__ import annotations

import mmap

import numpy as np

from memspec.errors import ContextOverflowError

PAGE = 4096  # bytes the OS commits at a time (Linux, x86-64 and aarch64 defaults)


def kv_cache_nbytes(rows: int, head_dim: int, tokens: int, capacity: int, itemsize: int = 4) -> int:
    """Resident bytes of a preallocated KV cache of `rows` (layer, K/V, head) rows of `capacity`
    slots of `itemsize`-byte values each (4: float32; 2: float16), once `tokens` slots of every row
    are written: whole pages, plus one per row since rows need not start on a page, never above
    the capacity."""
    tokens = max(0, min(tokens, capacity))
    pages = -(-tokens * head_dim * itemsize // PAGE) + (tokens > 0)
    return min(rows * pages * PAGE, rows * capacity * head_dim * itemsize)


def committed_as_written(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array over its own anonymous mapping, in base pages: the OS commits a page when a slot in it
    is first written, so a preallocated cache holds what kv_cache_nbytes says.  Not np.empty: numpy
    asks for transparent huge pages on arrays of 4 MiB and more, and the kernel then zeroes and commits
    2 MiB for the first slot written in each; a new SmolLM2 cache (47 MB at 2,048 positions) took
    8 ms to touch its first 30 positions and held all 47 MB, against 0.8 ms and under 1 MB."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous (fd -1), zero-filled on first touch
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)  # the array keeps the mapping alive


class KVCache:
    """Per-sequence key/value state.  `length` is the number of committed tokens."""

    def __init__(self, capacity: int, slack: int = 0):
        self.capacity = capacity  # most tokens the cache can hold
        self.slack = slack  # slots past the capacity that a padded pass may write (never committed)
        self.length = 0  # tokens whose K/V are valid and visible

    def check_room(self, n: int) -> None:
        """ContextOverflowError unless n more tokens fit after the committed ones (the one message
        every engine gives)."""
        if n < 1:
            raise ValueError("forward needs at least one token per sequence")
        if self.length + n > self.capacity:
            raise ContextOverflowError(f"context overflow: {self.length} cached + {n} new tokens > capacity "
                                       f"{self.capacity}")

    def truncate(self, length: int) -> None:
        """Roll back to `length` tokens (the next forward overwrites the rest)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    @property
    def nbytes(self) -> int:
        return 0
