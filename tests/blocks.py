"""Random GGUF blocks for the tests: valid layouts, finite fp16 fields, weights about N(0, 1/k)."""

from __future__ import annotations

import numpy as np

SIZES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),  # (weights, bytes) a block
         "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
# Byte offsets of a block's fp16 fields (scale, then min)
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,)}
TYPICAL = {"Q4_0": 4, "Q4_1": 7.5, "Q5_0": 8, "Q8_0": 64, "Q4_K": 236, "Q5_K": 480, "Q6_K": 1024}  # |integer part|
MIN_RATIO = {"Q4_1": -7.5, "Q4_K": 7.5, "Q5_K": 15.5}  # min field / scale field that centres the weights


def random_blocks(rng: np.random.Generator, qtype: str, n: int, k: int) -> np.ndarray:
    """(n, bytes per row) uint8: random blocks whose weights are about N(0, 1/k) in size."""
    per, nbytes = SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, size=(n, k // per)) / (TYPICAL[qtype] * np.sqrt(k))
    fields = [d, d * MIN_RATIO.get(qtype, 0) * rng.uniform(0.8, 1.2, size=d.shape)]
    for at, value in zip(FP16_FIELDS[qtype], fields):
        raw[..., at : at + 2] = value.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)
