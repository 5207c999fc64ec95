"""What do M activation rows cost against one, in memspec's native Q4_K matmul?

    .venv/bin/python bench/kernels.py [--threads 2] [--repeats 20] [--layers 8] [--type Q4_K] [--isa avx2,avx512]

Times memspec.runtime.kernels.matmul on the 1.5B's gate/up shape (K 1536, N 8960, Q4_K; the
real ffn_gate matrices when the Qwen2.5-Coder-1.5B GGUF is in the store, else random blocks)
at M = 1, 2, 4, 8, 16 and prints the median milliseconds per matrix, cost(M)/cost(1) and the
weight bytes read per second at M = 1, twice: "hot", one matrix again and again (7.7 MB: it
stays in a large L3), and "cold", the --layers matrices in turn (as a forward pass reads them,
from memory once they outgrow the L3).  Targets: cost(4)/cost(1) <= 1.3, cost(8)/cost(1) <= 2.2.

--type times another shipped shape instead: Q6_K (the 1.5B's Q6_K ffn_down matrices, K 8960,
N 1536), Q4_1 (SmolLM2-135M's ffn_gate, K 576, N 1536: small enough that "cold" stays in a
large L3) or Q8_0 (SmolLM2's tied head, K 576, N 49152: one matrix, so no cold case).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from memspec.runtime import kernels

ROWS = (1, 2, 4, 8, 16)
STORE = Path.home() / ".local/share/memspec/downloads"
QWEN_GGUF = STORE / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SMOLLM_GGUF = STORE / "SmolLM2-135M-Instruct.Q4_1.gguf"
SIBLING_GGUF = STORE.parent / "models/qwen2.5-coder-0.5b-draft/draft.gguf"  # memspec pull qwen2.5-coder-0.5b-draft
# type: (ggml id, K, N, GGUF, tensor name pattern, what it is)
SHAPES = {
    "Q4_K": (12, 1536, 8960, QWEN_GGUF, "blk.{}.ffn_gate.weight", "the 1.5B's ffn_gate"),
    "Q6_K": (14, 8960, 1536, QWEN_GGUF, "blk.{}.ffn_down.weight", "the 1.5B's Q6_K ffn_down"),
    "Q4_1": (3, 576, 1536, SMOLLM_GGUF, "blk.{}.ffn_gate.weight", "SmolLM2's ffn_gate"),
    "Q8_0": (8, 576, 49152, SMOLLM_GGUF, "token_embd.weight", "SmolLM2's tied head"),
    "Q4_0": (2, 896, 4864, SIBLING_GGUF, "blk.{}.ffn_gate.weight", "the 0.5B sibling draft's ffn_gate"),
}
BLOCK = {12: (256, 144), 14: (256, 210), 3: (32, 20), 8: (32, 34), 2: (32, 18)}  # weights, bytes per block
FP16_AT = {12: (0, 2), 14: (208,), 3: (0, 2), 8: (0,), 2: (0,)}  # the fp16 scale fields of a block


def weights(qtype: str, layers: int) -> tuple[list[np.ndarray], str]:
    """Up to `layers` (N, bytes per row) uint8 matrices of `qtype`, and where they came from."""
    tid, k, n, path, pattern, what = SHAPES[qtype]
    if path.exists():
        import gguf

        tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        names = [pattern.format(i) for i in range(100)] if "{}" in pattern else [pattern]
        found = [tensors[m] for m in names if m in tensors and tensors[m].tensor_type == tid][:layers]
        return [np.ascontiguousarray(t.data).reshape(n, -1) for t in found], what
    rng = np.random.default_rng(0)
    per, nbytes = BLOCK[tid]
    mats = []
    for _ in range(layers if "{}" in pattern else 1):
        raw = rng.integers(0, 256, size=(n, k // per, nbytes), dtype=np.uint8)
        for at in FP16_AT[tid]:
            raw[..., at : at + 2] = np.float16(1e-3).reshape(1).view(np.uint8)
        mats.append(raw.reshape(n, -1))
    return mats, "random blocks"


def median_ms(mats: list[np.ndarray], tid: int, n: int, k: int, x: np.ndarray, threads: int, repeats: int,
              isas: list[str]) -> dict[str, float]:
    """Per path, the median milliseconds per matrix over `repeats` passes through `mats`, the
    paths taking turns within each repeat.  Each path multiplies the layout the native target
    gives it (interleaved at load where the path packs the type: packed once here, not timed)."""
    layouts = {isa: [kernels.pack(raw, tid, n, k, isa=isa) for raw in mats] for isa in isas}

    def run(isa: str) -> None:
        for raw, packed in zip(mats, layouts[isa]):
            kernels.matmul(raw, tid, n, k, x, threads=threads, isa=isa, packed=False if packed is None else packed)

    for isa in isas:  # warm up
        run(isa)
    times: dict[str, list[float]] = {isa: [] for isa in isas}
    for _ in range(repeats):
        for isa in isas:
            start = time.perf_counter()
            run(isa)
            times[isa].append((time.perf_counter() - start) / len(mats))
    return {isa: 1e3 * float(np.median(t)) for isa, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=8, help="matrices the cold case cycles through")
    parser.add_argument("--type", default="Q4_K", choices=sorted(SHAPES), help="which shipped shape")
    parser.add_argument("--isa", default=None, help=f"comma-separated paths (this CPU: {','.join(kernels.isas())})")
    args = parser.parse_args()
    isas = args.isa.split(",") if args.isa else [kernels.isa()]
    unknown = [i for i in isas if i not in kernels.isas()]
    if unknown:
        parser.error(f"--isa {','.join(unknown)}: this CPU runs {', '.join(kernels.isas())}")
    tid, k, n = SHAPES[args.type][:3]
    mats, source = weights(args.type, args.layers)
    nbytes = mats[0].nbytes
    print(f"{args.type} K={k} N={n} ({nbytes / 1e6:.1f} MB each, {source}), isa {', '.join(isas)}, threads {args.threads}")
    x = np.random.default_rng(1).standard_normal((max(ROWS), k)).astype(np.float32)
    pools = [("hot", mats[:1])] + ([(f"cold ({len(mats)} matrices)", mats)] if len(mats) > 1 else [])
    for label, pool in pools:
        print(label)
        base: dict[str, float] = {}
        for m in ROWS:
            for isa, ms in median_ms(pool, tid, n, k, x[:m], args.threads, args.repeats, isas).items():
                base.setdefault(isa, ms)
                extra = f"  {nbytes / ms / 1e6:.1f} GB/s of weights" if m == 1 else ""
                print(f"  M={m:2d} {isa:>6}  {ms:7.3f} ms  cost/cost(1) {ms / base[isa]:4.2f}{extra}")


if __name__ == "__main__":
    main()
