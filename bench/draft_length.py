"""How long a draft's proposals should be, worked out offline: record, then replay rules.

    python bench/draft_length.py [--model qwen2.5-coder-1.5b] [--draft qwen2.5-coder-0.5b-draft]
                                 [--per-category 3] [--max-tokens 96] [--record FILE | --replay FILE]

Record: greedy decoding of the built-in prompts (--per-category of each category) with the draft
proposing 8 tokens at every step and never stopping early; each step keeps every draft token's top
probability and entropy and how many the target accepted (greedy acceptance of a prefix does not
depend on what follows it, so any shorter proposal's outcome is known too), and the seconds the
draft and the target took.  Replay: each draft-length rule over the recorded steps, priced with the
target's pass costs from the store's costs.json (this machine's, relative to a 1-row pass) and the
draft's step as measured while recording, as tokens per unit of target time against target-only's
one a step.  A rule that stops on the next token's probability pays for the forward that computed
it: the stop costs one more draft step than the tokens it proposes.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

K = 8  # tokens drafted at every recorded step


def record(model: str, draft_name: str, per_category: int, max_new: int, threads: int) -> dict:
    from memspec.bench.policies import load_workload
    from memspec.build import load_pool
    from memspec.models.store import ModelStore, default_home
    from memspec.request import GenerationRequest
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.target import load_target
    from memspec.speculation import sampling
    from memspec.speculation.engine import Engine

    store = ModelStore(default_home())
    config = SessionConfig(max_context=1024, backend="native", intra_op_threads=threads)
    target = load_target(store, model, "q4", config)
    pool = load_pool(store, model, target.session.vocab_size, config, names=[draft_name])
    draft = next(d for d in (pool.values() if isinstance(pool, dict) else pool) if getattr(d, "name", "") == draft_name)
    engine, ts = Engine(target), target.session
    seen: collections.Counter = collections.Counter()
    out = []
    for w in load_workload(None):
        if seen[w["category"]] >= per_category:
            continue
        seen[w["category"]] += 1
        prompt = engine.prompt_ids(GenerationRequest(prompt=w["prompt"], max_tokens=max_new))
        cache = ts.new_cache()
        ctx = [*prompt, int(np.argmax(ts.forward(cache, prompt, keep=1)[-1]))]
        state, steps, draft_s, verify_s = draft.begin(1024), [], 0.0, 0.0
        while len(ctx) - len(prompt) < max_new and ctx[-1] not in target.eos_ids:
            t0 = time.perf_counter()
            logits, _ = state._catch_up(ctx)
            tokens, top, ent = [], [], []
            for i in range(K):
                probs = sampling.probabilities(logits, 1.0)
                d = int(np.argmax(probs))
                top.append(float(probs[d]))
                ent.append(float(-(probs * np.log(np.maximum(probs, 1e-30))).sum()))
                tokens.append(int(draft.to_target[d]))
                if i + 1 < K:
                    logits = draft.session.forward(state.cache, [d], keep=1)[-1]
                    state.cached.append(tokens[-1])
            t1 = time.perf_counter()
            feed = [ctx[-1], *tokens]
            best = ts.forward(cache, feed, keep=len(feed)).argmax(axis=-1)
            n = 0
            while n < K and best[n] == tokens[n]:
                n += 1
            cache.truncate(cache.length - len(feed) + 1 + n)
            ctx.extend([*tokens[:n], int(best[n])])
            draft_s += t1 - t0
            verify_s += time.perf_counter() - t1
            steps.append({"p": top, "entropy": ent, "accepted": n})
        out.append({"category": w["category"], "steps": steps, "draft_s": draft_s, "verify_s": verify_s})
        print(f"{w['category']:<14} {len(steps):>3} steps, {len(ctx) - len(prompt)} tokens", file=sys.stderr, flush=True)
    curve = ts.measure_step_costs(K + 1)  # [k] = seconds of a pass of k rows (index 0 unused), measured now
    return {"model": model, "draft": draft_name, "prompts": out, "pass_s": list(curve)}


def replay(data: dict) -> list[tuple[str, dict[str, float]]]:
    pass_s = data["pass_s"]
    rel = [c / pass_s[1] for c in pass_s]  # [k] = a pass of k rows against one
    steps_n = sum(len(p["steps"]) for p in data["prompts"])
    verify = sum(p["verify_s"] for p in data["prompts"]) / max(steps_n, 1) / rel[K + 1]  # a 1-row pass, as run
    cd = sum(p["draft_s"] for p in data["prompts"]) / max(steps_n * K, 1) / verify  # a draft step, relative

    def run(stop, kmax):
        res = collections.defaultdict(lambda: [0, 0.0])
        for prompt in data["prompts"]:
            for s in prompt["steps"]:
                k, cum, extra = 0, 1.0, 0
                while k < kmax:
                    cum *= s["p"][k]
                    if stop(k, s["p"][k], cum, s["entropy"][k]):
                        extra = 1  # the forward that read this token's probability was paid (the catch-up at k = 0)
                        break
                    k += 1
                cost = rel[k + 1] + (k + extra) * cd
                for key in (prompt["category"], "all"):
                    res[key][0] += min(s["accepted"], k) + 1
                    res[key][1] += cost
        return {c: t / c_ for c, (t, c_) in res.items()}

    rules = [(f"fixed {k}", (lambda i, p, c, e: False), k) for k in (1, 2, 3, 4)]
    rules += [(f"p < {t} (shipped rule), at most {k}", (lambda t: lambda i, p, c, e: i >= 1 and (p < t or e > 4.0))(t), k)
              for t in (0.3, 0.5) for k in (2, 3, 4, 6)]
    rules += [(f"product < {t}, at most {k}", (lambda t: lambda i, p, c, e: i >= 1 and c < t)(t), k)
              for t in (0.4, 0.5, 0.6, 0.7) for k in (4, 8)]
    rules += [(f"product < {t}, none at all too", (lambda t: lambda i, p, c, e: c < t)(t), 8) for t in (0.4, 0.6)]
    return [("draft step / target step", {"all": cd})] + [(name, run(f, k)) for name, f, k in rules]


def calibration(data: dict) -> list[tuple[float, int, int]]:
    bins = collections.defaultdict(lambda: [0, 0])
    for prompt in data["prompts"]:
        for s in prompt["steps"]:
            for i, p in enumerate(s["p"][: s["accepted"] + 1]):  # the tokens the target judged
                b = bins[min(int(p * 10), 9)]
                b[0] += i < s["accepted"]
                b[1] += 1
    return [(k / 10, a, n) for k, (a, n) in sorted(bins.items())]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-draft")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--record", metavar="FILE", help="keep the recorded steps here (JSON)")
    ap.add_argument("--replay", metavar="FILE", help="replay a recording instead of recording")
    args = ap.parse_args()
    if args.replay:
        data = json.loads(Path(args.replay).read_text())
    else:
        data = record(args.model, args.draft, args.per_category, args.max_tokens, args.threads)
        if args.record:
            Path(args.record).write_text(json.dumps(data))
    rows = replay(data)
    cats = sorted(rows[1][1])
    print(f"{data['draft']} proposing for {data['model']}: a draft step costs {rows[0][1]['all']:.2f} of a target step; "
          f"tokens per unit of target time (target-only: 1.00)")
    print(f"{'rule':<34} " + " ".join(f"{c[:9]:>9}" for c in cats))
    for name, r in rows[1:]:
        print(f"{name:<34} " + " ".join(f"{r[c]:>9.2f}" for c in cats))
    print("\ntop probability -> share accepted: " + ", ".join(f"{lo:.1f}+ {a}/{n}" for lo, a, n in calibration(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
