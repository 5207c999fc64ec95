"""What do M activation rows cost against one, in memspec's native Q4_K matmul?

    .venv/bin/python bench/kernels.py [--threads 2] [--repeats 20] [--layers 8]

Times memspec.runtime.kernels.matmul on the 1.5B's gate/up shape (K 1536, N 8960, Q4_K; the
real ffn_gate matrices when the Qwen2.5-Coder-1.5B GGUF is in the store, else random blocks)
at M = 1, 2, 4, 8, 16 and prints the median milliseconds per matrix, cost(M)/cost(1) and the
weight bytes read per second at M = 1, twice: "hot", one matrix again and again (7.7 MB: it
stays in a large L3), and "cold", the --layers matrices in turn (as a forward pass reads them,
from memory once they outgrow the L3).  Targets: cost(4)/cost(1) <= 1.3, cost(8)/cost(1) <= 2.2.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from memspec.runtime import kernels

Q4_K = 12
K, N = 1536, 8960
ROWS = (1, 2, 4, 8, 16)
QWEN_GGUF = Path.home() / ".local/share/memspec/downloads/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def weights(layers: int) -> tuple[list[np.ndarray], str]:
    """`layers` (N, 864) uint8 Q4_K matrices, and where they came from."""
    if QWEN_GGUF.exists():
        import gguf

        tensors = {t.name: t for t in gguf.GGUFReader(QWEN_GGUF).tensors}
        names = [f"blk.{i}.ffn_gate.weight" for i in range(layers)]
        return [np.ascontiguousarray(tensors[name].data) for name in names], "the 1.5B's ffn_gate"
    rng = np.random.default_rng(0)
    mats = []
    for _ in range(layers):
        raw = rng.integers(0, 256, size=(N, K // 256, 144), dtype=np.uint8)
        raw[..., 0:4] = np.float16(1e-3).reshape(1).view(np.uint8).repeat(2)  # d and dmin
        mats.append(raw.reshape(N, -1))
    return mats, "random blocks"


def median_ms(mats: list[np.ndarray], x: np.ndarray, threads: int, repeats: int) -> float:
    """Median milliseconds per matrix over `repeats` passes through `mats`."""
    for raw in mats:  # warm up
        kernels.matmul(raw, Q4_K, N, K, x, threads=threads)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for raw in mats:
            kernels.matmul(raw, Q4_K, N, K, x, threads=threads)
        times.append((time.perf_counter() - start) / len(mats))
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=8, help="matrices the cold case cycles through")
    args = parser.parse_args()
    mats, source = weights(args.layers)
    nbytes = mats[0].nbytes
    print(f"Q4_K K={K} N={N} ({nbytes / 1e6:.1f} MB each, {source}), isa {kernels.isa()}, threads {args.threads}")
    x = np.random.default_rng(1).standard_normal((max(ROWS), K)).astype(np.float32)
    for label, pool in (("hot", mats[:1]), (f"cold ({len(mats)} matrices)", mats)):
        print(label)
        base = None
        for m in ROWS:
            ms = median_ms(pool, x[:m], args.threads, args.repeats)
            base = base or ms
            extra = f"  {nbytes / ms / 1e6:.1f} GB/s of weights" if m == 1 else ""
            print(f"  M={m:2d}  {ms:7.3f} ms  cost/cost(1) {ms / base:4.2f}{extra}")


if __name__ == "__main__":
    main()
