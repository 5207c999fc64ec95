"""What one batched target pass costs, and whether a row's logits depend on its batch.

    flock /tmp/memspec-bench.lock python bench/batch_pass.py [--variant q4] [--rows 4] [--repeats 15]

1. Invariance: 8 requests with different contexts (20..120 tokens) and feeds of 1..6 tokens run
   alone (DecoderSession.forward, the one-request graph) and in the ragged batched graph
   (memspec.runtime.batch) in passes of 1, 2, 3 and 4 rows; each row's logits are compared with
   its solo logits: max |diff|, argmax agreement, rows equal bit for bit.
2. Cost: the median milliseconds of a pass over B rows x k tokens (k = 1..6) after 100 cached
   tokens, in interleaved rounds, beside the one-request graph's pass over k tokens; and the
   tokens per millisecond a pass would commit if every row's k tokens were accepted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from memspec.models.store import ModelStore
from memspec.runtime.batch import BatchedTarget
from memspec.runtime.config import SessionConfig
from memspec.runtime.target import load_target


def invariance(bt: BatchedTarget, rng: np.random.Generator, n: int = 8) -> dict:
    sess = bt.target
    vocab = sess.vocab_size
    ctxs = [list(map(int, rng.integers(100, vocab - 1, size=int(rng.integers(20, 120))))) for _ in range(n)]
    feeds = [list(map(int, rng.integers(100, vocab - 1, size=int(rng.integers(1, 7))))) for _ in range(n)]
    solo = []
    for c, f in zip(ctxs, feeds):
        cache = sess.new_cache()
        sess.forward(cache, c, keep=1)
        solo.append(sess.forward(cache, f, keep=len(f)).copy())
    report = {}
    for b in range(1, bt.rows + 1):
        diff, agree, exact, total, rows = 0.0, 0, 0, 0, 0
        for lo in range(0, n - b + 1, b):
            caches = [sess.new_cache() for _ in range(b)]
            for c, ctx in zip(caches, ctxs[lo: lo + b]):
                sess.forward(c, ctx, keep=1)  # prefill alone, as the engine does
            out = bt.forward(caches, feeds[lo: lo + b], [len(f) for f in feeds[lo: lo + b]])
            for i, got in enumerate(out):
                ref = solo[lo + i]
                diff = max(diff, float(np.abs(got - ref).max()))
                agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
                exact += int(np.array_equal(got, ref))
                total += len(ref)
                rows += 1
            for c in caches:
                bt.release(c)
        report[f"B={b}"] = {"max_abs_diff": diff, "argmax_agree": f"{agree}/{total}",
                            "rows_bit_equal": f"{exact}/{rows}"}
    return report


def cost(bt: BatchedTarget, repeats: int) -> dict:
    sess = bt.target
    ctx, ks = 100, range(1, 7)
    caches = [sess.new_cache() for _ in range(bt.rows)]
    for c in caches:
        sess.forward(c, list(range(100, 100 + ctx)), keep=1)
    solo_cache = sess.new_cache()
    sess.forward(solo_cache, list(range(100, 100 + ctx)), keep=1)
    cells = [(b, k) for b in range(1, bt.rows + 1) for k in ks]
    times: dict = {c: [] for c in cells}
    solo: dict = {k: [] for k in ks}
    for _ in range(repeats):  # interleaved: every cell once per round
        for b, k in cells:
            t = time.perf_counter()
            bt.forward(caches[:b], [list(range(200, 200 + k))] * b, [k] * b)
            times[(b, k)].append(time.perf_counter() - t)
            for c in caches[:b]:
                c.truncate(ctx)
        for k in ks:
            t = time.perf_counter()
            sess.forward(solo_cache, list(range(200, 200 + k)), keep=k)
            solo[k].append(time.perf_counter() - t)
            solo_cache.truncate(ctx)
    med = {c: statistics.median(v) for c, v in times.items()}
    smed = {k: statistics.median(v) for k, v in solo.items()}
    return {
        "solo_graph_ms": {k: round(v * 1e3, 2) for k, v in smed.items()},
        "batched_ms": {f"B={b} k={k}": round(med[(b, k)] * 1e3, 2) for b, k in cells},
        "batched_over_solo_k": {f"B={b} k={k}": round(med[(b, k)] / smed[k], 2) for b, k in cells},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--variant", default="q4")
    ap.add_argument("--rows", type=int, default=4, help="row slots of the batched graph")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-invariant", action="store_true",
                    help="batch_invariant = false (min_rows 1; no effect on a graph that pads attention itself)")
    args = ap.parse_args()
    target = load_target(ModelStore(), args.model, args.variant,
                         SessionConfig(batch_invariant=not args.no_invariant))
    bt = BatchedTarget(target.session, args.rows)
    print(json.dumps({"invariance": invariance(bt, np.random.default_rng(0))}, indent=1))
    print(json.dumps(cost(bt, args.repeats), indent=1))


if __name__ == "__main__":
    main()
