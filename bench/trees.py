"""Token trees against chains, per draft: tokens per drafting pass, rows per pass, what branches won,
and how often each draft's alternatives held the target's token where its first choice did not.

    python bench/trees.py --model qwen2.5-coder-1.5b \
        --drafts qwen2.5-coder-0.5b-draft,qwen2.5-coder-draft-code,prompt-lookup [--max-tokens 64] [--per-category 2]

Greedy, native engine, each draft fixed; the built-in prompts (--per-category of each category).
Both runs read one cost curve (--curve: relative seconds of a pass of 1, 2, ... rows, extended by
its last step), so that trees on and off differ by the trees alone and not by a remeasured curve;
the draft's cost is still timed, so gamma follows the machine.  Wall time is indicative only.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memspec.bench.policies import load_workload  # noqa: E402
from memspec.models.store import ModelStore, default_home  # noqa: E402
from memspec.request import GenerationRequest  # noqa: E402
from memspec.runtime.config import SessionConfig  # noqa: E402
from memspec.speculation import tree  # noqa: E402
from memspec.speculation.config import SpecConfig  # noqa: E402
from memspec.build import load_pool  # noqa: E402
from memspec.runtime.target import load_target  # noqa: E402
from memspec.speculation.drafts import PROMPT_LOOKUP  # noqa: E402
from memspec.speculation.engine import Engine  # noqa: E402
from memspec.speculation.sources import DraftPool  # noqa: E402

STATS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "tree_steps", "tree_rows", "tree_tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafts", required=True, help="comma-separated store names and/or prompt-lookup")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--curve", default="1,1.26,1.44,1.66,1.84", help="relative pass costs of 1, 2, ... rows")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    drafts = [d.strip() for d in args.drafts.split(",") if d.strip()]
    store = ModelStore(default_home())
    config = SessionConfig(max_context=1024, backend="native", intra_op_threads=args.threads)
    target = load_target(store, args.model, "q4", config)
    pool = load_pool(store, args.model, target.session.vocab_size, config,
                     names=[d for d in drafts if d != PROMPT_LOOKUP])
    seen: collections.Counter = collections.Counter()
    work = []
    for w in load_workload(None):
        if seen[w["category"]] < args.per_category:
            seen[w["category"]] += 1
            work.append(w)
    rel = [float(c) for c in args.curve.split(",")]
    step = rel[-1] - rel[-2] if len(rel) > 1 else 1.0
    rel = [0.0, *rel, *(rel[-1] + step * k for k in range(1, 14 - len(rel)))]
    alts = collections.defaultdict(lambda: [[0, 0], [0, 0]])  # draft -> rank -> [held the target's token, offered]
    observe = tree.Planner.observe

    def counting(self, name, prop, main, token):
        if main < len(prop.tokens) and main < len(prop.alternatives):
            for r, a in enumerate(prop.alternatives[main][:2]):
                alts[name][r][0] += a[0] == token
                alts[name][r][1] += 1
        observe(self, name, prop, main, token)

    tree.Planner.observe = counting
    for trees in (False, True):
        engine = Engine(target, drafts=DraftPool(pool), spec=SpecConfig(trees=trees))
        engine.pin_costs([c / 30 for c in rel])  # one curve for both; the controller rescales the step from its passes
        for d in drafts:
            tot: collections.Counter = collections.Counter()
            t0 = time.perf_counter()
            for w in work:
                r = engine.generate(GenerationRequest(prompt=w["prompt"], max_tokens=args.max_tokens, draft=d))
                tot.update({k: r.stats[k] for k in STATS})
                tot["tokens"] += len(r.token_ids)
            n = max(tot["num_drafts"], 1)
            print(f"trees={'on ' if trees else 'off'} {d:28} tokens/pass {1 + tot['num_accepted_tokens'] / n:.3f}  "
                  f"rows/pass {(tot['num_drafts'] + tot['num_draft_tokens'] + tot['tree_rows']) / n:.3f}  "
                  f"passes {tot['num_drafts']}  tree steps {tot['tree_steps']} rows {tot['tree_rows']} "
                  f"won {tot['tree_tokens']}  tok/s {tot['tokens'] / (time.perf_counter() - t0):.2f} (indicative)",
                  flush=True)
    for d, ranks in alts.items():
        print(f"{d}: where its first choice was rejected, its alternative held the target's token: "
              + ", ".join(f"choice {r + 2} {h}/{n} = {h / max(n, 1):.3f}" for r, (h, n) in enumerate(ranks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
