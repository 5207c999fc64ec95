"""Held-out acceptance of drafts, teacher-forced: what a draft would accept, without decoding.

    python bench/draft_acceptance.py --model qwen2.5-coder-1.5b \
        [--workload bench/heldout_mixed.jsonl] [--max-new 64] [--drafts NAME|PATH.gguf ...]

The target answers each held-out prompt greedily once, on the native engine, the prompts decoded
together (memspec.training.teacher.NativeTeacher: each answer is the target's alone, token for
token; cached in --answers, keyed by the target's file, the prompts and --max-new).  Each draft
then reads every prompt + answer in one pass on the native engine, and at each answer position
its argmax is compared with the target's token:
top-1 agreement, and the mean acceptance length greedy speculative decoding would reach at gamma 5
(memspec.training.drafts.acceptance: while the draft matches, its context is the target's text).
A draft is a store name, or a GGUF path with its vocab.json beside it (say a re-quantized copy:
--drafts models/x/draft.gguf /tmp/x-q4/draft.gguf).  Also prints each draft's step (one token
after 64, 1 thread, median of 40) against the target's.  Per category and over all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memspec.bench.policies import load_workload  # noqa: E402
from memspec.models.store import ModelStore, default_home, speaks_own_tokenizer  # noqa: E402
from memspec.models.tokenizer import Tokenizer  # noqa: E402
from memspec.runtime.native_target import NativeTarget  # noqa: E402
from memspec.speculation.drafts import GGUF_VARIANT, target_drafts, target_to_draft  # noqa: E402
from memspec.training.drafts import acceptance  # noqa: E402
from memspec.training.teacher import NativeTeacher  # noqa: E402

GAMMA = 5


def target_answers(store: ModelStore, model: str, items: list[dict], max_new: int, cache: Path,
                   threads: int) -> list[dict]:
    """[{category, prompt_ids, answer_ids}]: the target's greedy answers, made once per key."""
    m = store.get(model)
    gguf = store.gguf_of(m)
    key = hashlib.sha256(json.dumps([str(gguf), gguf.stat().st_size, max_new,
                                     [w["prompt"] for w in items]]).encode()).hexdigest()[:16]
    if cache.is_file():
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return data["samples"]
    tok = Tokenizer.from_file(m.folder / "tokenizer.json", m.folder / "tokenizer_config.json")
    eos = set(m.extra.get("eos_token_ids", [])) | tok.eos_token_ids
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": w["prompt"]}])) for w in items]
    print(f"  the target answers {len(items)} prompts (up to {max_new} tokens, decoded together)", file=sys.stderr)
    recs = NativeTeacher(gguf, threads).answers(ids, max_new, eos)  # each the target's answer alone
    samples = [{"category": w.get("category", "all"), "prompt_ids": p,
                "answer_ids": r["answer"][:-1] if r["answer"] and r["answer"][-1] in eos else r["answer"]}
               for w, p, r in zip(items, ids, recs)]
    cache.write_text(json.dumps({"key": key, "samples": samples}))
    return samples


def open_draft(store: ModelStore, spec: str, target_vocab: int) -> tuple[str, NativeTarget, np.ndarray, np.ndarray]:
    """(label, engine, to_draft (V_target,), to_target (V_draft,)) of a store draft's GGUF, or of a
    GGUF path with its vocab.json beside it."""
    path = Path(spec)
    if path.suffix == ".gguf":
        gguf, vocab = path, path.with_name("vocab.json")
        label = f"{path.parent.name}/{path.name}"
    else:
        m = store.get(spec)
        if GGUF_VARIANT not in m.variants:
            raise SystemExit(f"{spec}: ships no GGUF (variants: {', '.join(m.variants)})")
        if speaks_own_tokenizer(m):
            raise SystemExit(f"{spec}: drafts in its own tokens, by text: there are no rows in the target's ids "
                             f"to score; measure it with `memspec bench --policies target-only,fixed:{spec}`")
        gguf, vocab, label = m.variant_path(GGUF_VARIANT), m.folder / m.extra.get("draft_vocab", "vocab.json"), spec
    to_target = np.asarray(json.loads(vocab.read_text()), dtype=np.int64)
    engine = NativeTarget(gguf, threads=1, max_context=2048, check_rows=False)
    return label, engine, target_to_draft(to_target, target_vocab), to_target


def score(engine: NativeTarget, to_draft: np.ndarray, to_target: np.ndarray, samples: list[dict]) -> dict:
    """{category: (agree, positions, tokens, steps)} teacher-forced over every sample."""
    out: dict[str, list[int]] = {}
    for s in samples:
        ids, ans = s["prompt_ids"], s["answer_ids"]
        if not ans:
            continue
        feed = to_draft[np.asarray(ids + ans[:-1])].tolist()
        logits = engine.forward(engine.new_cache(), feed, keep=len(ans))  # row j predicts ans[j]
        match = to_target[logits.argmax(-1)] == np.asarray(ans)
        tokens, steps = acceptance(match, GAMMA)
        acc = out.setdefault(s["category"], [0, 0, 0, 0])
        for i, v in enumerate((int(match.sum()), len(match), tokens, steps)):
            acc[i] += v
    return out


def step_ms(engine: NativeTarget, n: int = 40) -> float:
    c = engine.new_cache()
    engine.forward(c, list(range(1, 65)))
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        engine.forward(c, [1 + i % 50])
        times.append(time.perf_counter() - t0)
        c.truncate(64)
    return 1e3 * float(np.median(times))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--workload", default=str(Path(__file__).with_name("heldout_mixed.jsonl")))
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--limit", type=int, default=0, help="prompts per category (0 = all)")
    ap.add_argument("--drafts", nargs="*", help="store names or GGUF paths (default: every draft for --model)")
    ap.add_argument("--answers", type=Path, default=None, help="cache of the target's answers")
    ap.add_argument("--threads", type=int, default=0, help="the target's threads (0 = physical cores)")
    ap.add_argument("--json", type=Path, help="write the table as JSON")
    args = ap.parse_args(argv)
    store = ModelStore(default_home())
    items = load_workload(args.workload)
    if args.limit:
        kept: list[dict] = []
        for w in items:  # the first --limit prompts of each category
            if sum(k.get("category") == w.get("category") for k in kept) < args.limit:
                kept.append(w)
        items = kept
    cache = args.answers or store.home / f"heldout-answers-{args.model}.json"
    samples = target_answers(store, args.model, items, args.max_new, cache, args.threads)
    target = NativeTarget(store.gguf_of(store.get(args.model)), threads=1, max_context=2048, check_rows=False)
    vocab = target.vocab_size
    # teacher-forced scoring reads a draft's rows in the target's ids: a draft in its own tokens
    # (memspec.speculation.textdraft) has none; `memspec bench --policies fixed:NAME` measures it
    names = args.drafts or [m.name for m in target_drafts(store, args.model)
                            if GGUF_VARIANT in m.variants and not speaks_own_tokenizer(m)]
    target_ms = step_ms(target, 10)
    rows = {}
    cats = sorted({s["category"] for s in samples})
    print(f"{args.model}: {len(samples)} held-out answers, {sum(len(s['answer_ids']) for s in samples)} "
          f"positions; target step (1 thread) {target_ms:.2f} ms")
    print(f"{'draft':44s} {'step ms':>8s} {'/target':>7s}  " + "  ".join(f"{c[:10]:>15s}" for c in cats)
          + f"  {'all':>15s}   (top-1 / mean acceptance length)")
    for spec in names:
        label, engine, to_draft, to_target = open_draft(store, spec, vocab)
        per = score(engine, to_draft, to_target, samples)
        total = [sum(v[i] for v in per.values()) for i in range(4)]
        ms = step_ms(engine)
        cells = {c: (v[0] / max(1, v[1]), v[2] / max(1, v[3])) for c, v in {**per, "all": total}.items()}
        rows[label] = {"step_ms": round(ms, 3), "step_share": round(ms / target_ms, 4),
                       **{c: {"top1": round(a, 4), "mean_accept_len": round(b, 3)} for c, (a, b) in cells.items()}}
        print(f"{label:44s} {ms:8.2f} {ms / target_ms:7.3f}  "
              + "  ".join(f"{cells[c][0]:6.3f} / {cells[c][1]:5.2f}" if c in cells else f"{'-':>15s}"
                          for c in [*cats, "all"]))
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "target_step_ms": target_ms, "drafts": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
