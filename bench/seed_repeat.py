"""Issue 68's done-check: a seeded request repeats, and is the target-only answer, through HTTP.

    python bench/seed_repeat.py [--model smollm2-135m] [--workload bench/everyday.jsonl]
        [--limit 24] [--max-tokens 64] [--seed 68] [--config FILE]

It starts `memspec serve --http 127.0.0.1:0` with the daemon's defaults (the config's, or none:
the scheduler picks each request's draft), takes --limit prompts of the workload spread over its
categories, and sends each one as a chat request through the official `openai` SDK with
temperature 0.8, top_p 0.95, max_tokens --max-tokens and its own seed (--seed + its index):
twice as it is, and once with `"memspec": {"draft": "none"}` (target-only).  Per category it
prints how many answers repeated (the second equals the first), how many equal the target-only
answer (both), and how many of the first answers a draft ran on (`memspec.num_drafts` > 0: a
check where no draft ran proves little).  Answers are compared by text and token count.

Exit status 0 when every answer repeated and equals target-only's, 1 otherwise (the prompts that
differ are listed).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's memspec, here and in the daemon below
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

from soak import start_daemon  # noqa: E402 (bench/ is the script's folder)

SAMPLING = {"temperature": 0.8, "top_p": 0.95}


def ask(sdk, model: str, prompt: str, seed: int, max_tokens: int, extra: dict | None = None) -> tuple[str, int, dict]:
    """(the answer, its token count, its memspec object) for one seeded chat request."""
    out = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], seed=seed,
                                      max_tokens=max_tokens, extra_body=extra, **SAMPLING)
    return out.choices[0].message.content or "", out.usage.completion_tokens, out.model_extra["memspec"]


def check(sdk, model: str, items: list[dict], seed: int, max_tokens: int) -> list[dict]:
    rows = []
    for i, item in enumerate(items):
        s = seed + i
        first, again, alone = (ask(sdk, model, item["prompt"], s, max_tokens, extra)
                               for extra in (None, None, {"memspec": {"draft": "none"}}))
        assert first[2]["seed"] == s and alone[2]["draft"] == "", (first[2], alone[2])
        rows.append({"category": item["category"], "seed": s, "repeated": first[:2] == again[:2],
                     "target_only": first[:2] == alone[:2] and again[:2] == alone[:2],
                     "drafted": first[2]["num_drafts"] > 0, "draft": first[2]["draft"],
                     "tokens": first[1], "prompt": item["prompt"]})
        print(f"{item['category']:<14} seed {s:<4} {first[1]:>3} tokens  draft {first[2]['draft'] or '-':<22} "
              f"repeated {rows[-1]['repeated']!s:<5} target-only {rows[-1]['target_only']}", flush=True)
    return rows


def report(rows: list[dict]) -> bool:
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(r)
    print(f"\n{'category':<14} {'prompts':>7} {'repeated':>8} {'=target-only':>12} {'drafted':>7}")
    for cat, rs in sorted(by_cat.items()) + [("all", rows)]:
        print(f"{cat:<14} {len(rs):>7} {sum(r['repeated'] for r in rs):>8} {sum(r['target_only'] for r in rs):>12} "
              f"{sum(r['drafted'] for r in rs):>7}")
    bad = [r for r in rows if not (r["repeated"] and r["target_only"])]
    for r in bad:
        print(f"DIFFERS: {r['category']} seed {r['seed']}: {r['prompt'][:60]!r}")
    return not bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the daemon's target (default: the config's [model] target)")
    ap.add_argument("--workload", default=str(ROOT / "bench" / "everyday.jsonl"))
    ap.add_argument("--limit", type=int, default=24, help="prompts, spread over the categories (default 24)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=68, help="the first prompt's seed; prompt i uses seed + i")
    ap.add_argument("--config", help="the daemon's config (default: none, the defaults)")
    args = ap.parse_args()

    from openai import OpenAI

    from memspec.bench.policies import load_workload, spread
    from memspec.config import load_config
    from memspec.serving.client import Client

    items = spread(load_workload(args.workload), args.limit)
    model = args.model or load_config(args.config).model.target
    with tempfile.TemporaryDirectory(prefix="ms-seed-") as d:
        proc, sock = start_daemon(Path(d), args.config,
                                  ("--http", "127.0.0.1:0", *(("--model", args.model) if args.model else ())))
        try:
            with Client(str(sock), timeout=60) as c:
                listen = c.status()["http_listen"]
            sdk = OpenAI(base_url=f"http://{listen}/v1", api_key="unused", max_retries=0, timeout=600)
            print(f"{model}, {len(items)} prompts, max_tokens {args.max_tokens}, {SAMPLING}, the daemon's defaults "
                  f"twice and draft none once", flush=True)
            ok = report(check(sdk, model, items, args.seed, args.max_tokens))
        finally:
            proc.terminate()
            proc.wait(60)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
