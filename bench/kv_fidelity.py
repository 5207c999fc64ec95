"""INT8 KV ([runtime] kv = "q8") against float16 KV on the native engine: fidelity and decode speed.

    .venv/bin/python bench/kv_fidelity.py [--model smollm2-135m] [--tokens 4096] [--docs 3] [--threads 2]
                                          [--contexts 2048,4096] [--decode 24] [--out result.json]

Documents: the repo's own docs (docs/*.md and README.md, each file tokenized whole, the files
concatenated in name order), cut into `--docs` windows of `--tokens` tokens spread over the text.
Each is teacher-forced through two targets of the same GGUF, one with f16 KV and one with q8, in
chunks of 256 tokens: at every position, whether the top-1 tokens agree, and KL(p_f16 || p_q8) of
the next-token distributions (float64 softmax).  Both per quarter of the window too, since the KV
error a row attends grows with the positions it reads.

The floor: f16 KV against itself with the last bit of each of its elements made random (a change of
one unit in the last place, f16's own resolution, to about half of them), the f16 target's rows
perturbed after each chunk, as q8's are quantized when written.  No KV format other than f16's exact
bits can agree with f16 better than that on these models: a small model turns so small a change in
what it attends into different top-1 tokens at a few percent of positions.

Decode speed: on the last document's caches, cut back to each of `--contexts` (the longest
first), `--decode` greedy one-token steps per format, the two formats' steps interleaved so that a
busy machine slows both alike; the median step and the fastest give tok/s (on a shared machine the
fastest is the one least disturbed).  The caches' bytes are those of the
allocated buffers (NativeCache.nbytes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 256


def documents(tok, tokens: int, docs: int) -> list[list[int]]:
    files = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    ids: list[int] = []
    for f in files:
        ids.extend(tok.encode(f.read_text()))
    if len(ids) < tokens:
        raise SystemExit(f"the docs hold {len(ids)} tokens; a document of {tokens} needs more")
    stride = (len(ids) - tokens) // max(1, docs - 1) if docs > 1 else 0
    return [ids[i * stride: i * stride + tokens] for i in range(docs)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def compare(f16: np.ndarray, q8: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: top-1 agreement (bool) and KL(p_f16 || p_q8) in nats."""
    lp, lq = log_softmax(f16), log_softmax(q8)
    return f16.argmax(1) == q8.argmax(1), (np.exp(lp) * (lp - lq)).sum(axis=1)


def last_bit(rows: np.ndarray, rng: np.random.Generator) -> None:
    """Make the last bit of each finite float16 in `rows` (a view of a cache) random, in place."""
    h = rows.view(np.uint16)
    finite = (h & 0x7C00) != 0x7C00
    h ^= (rng.integers(0, 2, h.shape, dtype=np.uint16) & finite).astype(np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from memspec.models.store import ModelStore, default_home
    from memspec.models.tokenizer import Tokenizer
    from memspec.runtime import kernels
    from memspec.runtime.native_target import NativeTarget

    store = ModelStore(default_home())
    m = store.get(args.model)
    folder = Path(m.folder)
    tok = Tokenizer.from_file(folder / "tokenizer.json", folder / "tokenizer_config.json")
    docs = documents(tok, args.tokens, args.docs)
    contexts = sorted((int(c) for c in args.contexts.split(",") if c), reverse=True)
    capacity = max([args.tokens, *contexts]) + args.decode + 8
    gguf = store.gguf_of(m)
    targets = {kv: NativeTarget(gguf, threads=args.threads, max_context=capacity, kv=kv) for kv in ("f16", "q8")}
    print(f"{args.model} ({gguf.name}), {args.threads} threads, {kernels.isa()}; {len(docs)} documents of "
          f"{args.tokens} tokens from docs/ and README.md", flush=True)
    result: dict = {"model": args.model, "threads": args.threads, "isa": kernels.isa(), "tokens": args.tokens,
                    "kv_bytes_per_token": {kv: t.kv_bytes_per_token() for kv, t in targets.items()},
                    "cache_bytes": {kv: t.new_cache().nbytes for kv, t in targets.items()}, "docs": []}
    quarters = 4
    agree_all, kl_all = [], []
    caches = {}
    rng = np.random.default_rng(0)
    floor_agree, floor_kl = [], []
    for d, doc in enumerate(docs):
        caches = {kv: t.new_cache() for kv, t in targets.items()}
        seconds = {kv: 0.0 for kv in targets}
        agree, kl = [], []
        nudged = targets["f16"].new_cache()
        for at in range(0, len(doc), CHUNK):
            feed = doc[at: at + CHUNK]
            rows = {}
            for kv, t in targets.items():
                t0 = time.perf_counter()
                rows[kv] = t.forward(caches[kv], feed, keep=len(feed))
                seconds[kv] += time.perf_counter() - t0
            a, k = compare(rows["f16"], rows["q8"])
            agree.append(a)
            kl.append(k)
            a, k = compare(rows["f16"], targets["f16"].forward(nudged, feed, keep=len(feed)))
            floor_agree.append(a)
            floor_kl.append(k)
            last_bit(nudged.data[:, :, :, at: at + len(feed), :], rng)
        a, k = np.concatenate(agree)[:-1], np.concatenate(kl)[:-1]  # the last row predicts past the document
        floor_agree[-1], floor_kl[-1] = floor_agree[-1][:-1], floor_kl[-1][:-1]
        agree_all.append(a)
        kl_all.append(k)
        q = np.array_split(np.arange(len(a)), quarters)
        entry = {"agreement": float(a.mean()), "mean_kl": float(k.mean()), "max_kl": float(k.max()),
                 "agreement_by_quarter": [float(a[i].mean()) for i in q],
                 "mean_kl_by_quarter": [float(k[i].mean()) for i in q],
                 "prefill_tok_s": {kv: len(doc) / s for kv, s in seconds.items()}}
        result["docs"].append(entry)
        print(f"doc {d}: top-1 agreement {entry['agreement']:.4f}, mean KL {entry['mean_kl']:.5f} nats "
              f"(max {entry['max_kl']:.3f}); by quarter {['%.4f' % x for x in entry['agreement_by_quarter']]}; "
              f"prefill f16 {entry['prefill_tok_s']['f16']:.1f} q8 {entry['prefill_tok_s']['q8']:.1f} tok/s",
              flush=True)
    a, k = np.concatenate(agree_all), np.concatenate(kl_all)
    result["agreement"], result["mean_kl"] = float(a.mean()), float(k.mean())
    print(f"all: top-1 agreement {result['agreement']:.4f} over {len(a)} positions, mean KL {result['mean_kl']:.5f}")
    a, k = np.concatenate(floor_agree), np.concatenate(floor_kl)
    result["floor"] = {"agreement": float(a.mean()), "mean_kl": float(k.mean()), "max_kl": float(k.max())}
    print(f"floor (f16 KV, the last bit of its elements random): top-1 agreement {a.mean():.4f}, "
          f"mean KL {k.mean():.5f} (max {k.max():.3f})")

    result["decode"] = {}
    last = {kv: None for kv in targets}
    for ctx in contexts:
        if ctx > args.tokens:
            continue
        steps = {kv: [] for kv in targets}
        for kv in targets:
            caches[kv].truncate(ctx)
            last[kv] = docs[-1][ctx - 1]
            caches[kv].truncate(ctx - 1)  # the step feeds the context's last token, then its own
        for _ in range(args.decode):
            for kv, t in targets.items():
                t0 = time.perf_counter()
                row = t.forward(caches[kv], [last[kv]])[-1]
                steps[kv].append(time.perf_counter() - t0)
                last[kv] = int(row.argmax())
        result["decode"][ctx] = {kv: 1.0 / float(np.median(s)) for kv, s in steps.items()}
        result["decode_best"] = {**result.get("decode_best", {}), ctx: {kv: 1.0 / min(s) for kv, s in steps.items()}}
        r, b = result["decode"][ctx], result["decode_best"][ctx]
        print(f"decode after {ctx} tokens: median step f16 {r['f16']:.2f} tok/s, q8 {r['q8']:.2f} tok/s "
              f"({r['q8'] / r['f16']:.3f}x); fastest step f16 {b['f16']:.2f}, q8 {b['q8']:.2f} "
              f"({b['q8'] / b['f16']:.3f}x)", flush=True)
    print(f"KV bytes per token: f16 {result['kv_bytes_per_token']['f16']}, q8 {result['kv_bytes_per_token']['q8']}; "
          f"a cache of {capacity} positions: f16 {result['cache_bytes']['f16']}, q8 {result['cache_bytes']['q8']} "
          f"({result['cache_bytes']['q8'] / result['cache_bytes']['f16']:.3f})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
