"""Pure NumPy sampling maths.  No ONNX Runtime here; the generator is passed in."""

from __future__ import annotations

import numpy as np


def greedy(logits: np.ndarray) -> int:
    """Index of the largest logit of a (V,) row."""
    return int(np.argmax(logits))


def probabilities(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The (V,) float64 distribution that sampling draws from.

    temperature > 0 scales the logits; top_k > 0 keeps the k most likely tokens;
    top_p < 1 keeps the smallest set whose mass reaches top_p.  Filtered tokens
    get probability 0 and the rest are renormalised.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.shape[-1]:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        csum = np.cumsum(p[order])
        # keep every token whose preceding mass is below top_p (the first always stays)
        keep = order[: int(np.searchsorted(csum, top_p, side="left")) + 1]
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from the (V,) distribution p (inverse CDF, one uniform)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.shape[-1] - 1))
