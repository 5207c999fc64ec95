"""Two builds of the native extension side by side in one process, taking turns step by step.

    python bench/ab_builds.py OLD.so NEW.so [--model NAME | --gguf PATH] [--rows 1,2,4,8]
                              [--steps 30] [--prefill 256] [--threads 2] [--context 256] [--isa avx2]
                              [--seqs 1]

Copy `memspec/runtime/_native*.so` aside before a change and after it, then run this: each build
loads the same GGUF, caches `--context` tokens, then runs passes of each row count (every row's
logits kept, as verification keeps them) in alternating order, and a prefill.  It prints both
builds' median and minimum step and their ratio NEW/OLD (with `--seqs S`, a pass's rows are spread
over S sequences, each with its own cache, as a batch of S requests is), and whether their logits were the same
bits (they must be: a kernel change may move speed, never a row's result).  Taking turns in one
process is what makes a few percent visible on a machine whose speed wanders.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from memspec.config import load_config
from memspec.errors import ModelNotFoundError
from memspec.models.store import ModelStore
from memspec.runtime import kernels
from memspec.runtime.native_target import NativeTarget


def load_build(so: Path, tag: str):
    spec = importlib.util.spec_from_file_location(f"memspec_ab_{tag}._native", so)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{so}: not a loadable extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--model", metavar="NAME", default="qwen2.5-coder-1.5b", help="a target in the store")
    ap.add_argument("--gguf", type=Path, help="a GGUF file instead of --model")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens of a prefill pass (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--seqs", type=int, default=1, help="sequences a pass's rows are spread over (a batch of requests)")
    ap.add_argument("--isa", help="a kernel path both builds run (avx2 on an AVX-512 host, scalar); default: the best")
    args = ap.parse_args(argv)
    for so in (args.old, args.new):
        if not so.is_file():
            ap.error(f"{so}: no such file (copy memspec/runtime/_native*.so aside before and after the change)")
    if args.gguf:
        gguf = args.gguf
    else:
        store = ModelStore(load_config(None).store_home)
        try:
            gguf = store.gguf_path(store.get(args.model))
        except ModelNotFoundError as exc:
            ap.error(str(exc))
    if gguf is None or not gguf.is_file():
        ap.error(f"no GGUF for {args.gguf or args.model} ({gguf}); memspec pull {args.model} fetches it")
    rows_list = [int(r) for r in args.rows.split(",")]
    builds = []
    for tag, so in (("old", args.old), ("new", args.new)):
        kernels._native = load_build(so, tag)  # NativeTarget binds the module current at load
        t = NativeTarget(gguf, threads=args.threads, isa=args.isa)
        caches = []
        for q in range(max(args.seqs, 1)):
            c = t.new_cache(args.context + max(rows_list) + args.prefill + 8)
            t.forward(c, [100 + (i + 13 * q) % 1000 for i in range(args.context)], keep=1)
            caches.append(c)
        builds.append((t, caches))
    same = True

    def report(name: str, times: list[list[float]]) -> None:
        med = [statistics.median(v) * 1e3 for v in times]
        low = [min(v) * 1e3 for v in times]
        print(f"{name:>12}: old {med[0]:8.1f} new {med[1]:8.1f} ms median (new/old {med[1] / med[0]:.3f}); "
              f"min {low[0]:.1f} / {low[1]:.1f} ({low[1] / low[0]:.3f})", flush=True)

    for rows in rows_list:
        times: list[list[float]] = [[], []]
        for s in range(args.steps):
            outs = [None, None]
            for i in ((0, 1) if s % 2 == 0 else (1, 0)):
                t, caches = builds[i]
                used = caches[:rows]  # each sequence one row at least
                feeds = [[5 + (s + q + j) % 7 for j in range(rows // len(used) + (q < rows % len(used)))]
                         for q in range(len(used))]
                t0 = time.perf_counter()
                outs[i] = np.concatenate(t.forward_batch(used, feeds, [len(f) for f in feeds]))
                times[i].append(time.perf_counter() - t0)
                for c in used:
                    c.truncate(args.context)
            same &= bool(np.array_equal(outs[0], outs[1]))
        report(f"{rows} rows", times)
    if args.prefill:
        ids = [(7 * j) % 5000 + 100 for j in range(args.prefill)]
        times = [[], []]
        for s in range(4):
            outs = [None, None]
            for i in ((0, 1) if s % 2 == 0 else (1, 0)):
                t, (c, *_) = builds[i]
                c.truncate(0)
                t0 = time.perf_counter()
                outs[i] = t.forward(c, ids, keep=1)
                times[i].append(time.perf_counter() - t0)
            same &= bool(np.array_equal(outs[0], outs[1]))
        report(f"prefill {args.prefill}", times)
    print(f"logits the same bits in both builds: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
