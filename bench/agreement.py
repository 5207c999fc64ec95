"""Teacher-forced token agreement between verification and target-only decoding.

    python bench/agreement.py [--variant q4] [--max-tokens 128] [--workload FILE]

Runs each prompt target-only (greedy), then replays the sequence in verification passes of
6 tokens, as the speculative loop does, and counts the positions whose argmax is the token
target-only decoding chose: once as configured by default, once with `[runtime]
batch_invariant = true`.  On the fp32 target both are 1.0 up to exact ties; on q4 the
default differs at near-ties (docs/history/results.md).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from memspec.bench.policies import load_workload, teacher_forced_agreement
from memspec.runtime.target import load_target
from memspec.speculation.engine import Engine
from memspec.runtime.config import SessionConfig
from memspec.models.store import ModelStore, default_home


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="q4", choices=("q4", "fp32"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--workload", help="JSONL with prompt and category fields (default: the built-in 48)")
    args = ap.parse_args()
    store = ModelStore(default_home())
    workload = load_workload(args.workload)
    for invariant in (False, True):
        config = SessionConfig(max_context=2048, batch_invariant=invariant)
        engine = Engine(load_target(store, "smollm2-135m", args.variant, config))
        by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for w in workload:
            agree, total = teacher_forced_agreement(engine, [w["prompt"]], args.max_tokens)
            by_cat[w["category"]][0] += agree
            by_cat[w["category"]][1] += total
        agree, total = (sum(v[i] for v in by_cat.values()) for i in (0, 1))
        cats = ", ".join(f"{c} {a / t:.3f}" for c, (a, t) in sorted(by_cat.items()))
        print(f"{args.variant} batch_invariant={str(invariant).lower()}: {agree}/{total} = {agree / total:.4f} ({cats})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
