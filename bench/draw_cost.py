"""What drawing one sampled token costs: the coupled scheme's Gumbel argmax against the standard
scheme's inverse-CDF draw, on the real target's rows.

    PYTHONPATH=. python bench/draw_cost.py [--model smollm2-135m]

Per row of a prompt's last 8 positions, the minimum over 60 repetitions of process time (the
least disturbed run on a shared machine): building the sampling distribution, the standard draw
(memspec.speculation.sampling.sample) and the coupled draw (gumbel_argmax), at temperature 0.7 with
top_p 0.95 and at 1.0 unfiltered, with how many tokens the coupled draw had to hash.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def best_ms(f, n: int = 60) -> float:
    out = []
    for _ in range(n):
        t0 = time.process_time_ns()
        f()
        out.append(time.process_time_ns() - t0)
    return min(out) / 1e6


def main(argv: list[str] | None = None) -> int:
    from memspec.models.store import ModelStore, default_home
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.target import load_target
    from memspec.speculation import sampling

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args(argv)
    t = load_target(ModelStore(default_home()), args.model, "q4", SessionConfig(max_context=256))
    ids = t.tokenizer.encode("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    rows = t.session.forward(t.session.new_cache(), ids, keep=8)
    rng = np.random.default_rng(0)
    for temperature, kw in ((0.7, {"top_p": 0.95}), (1.0, {})):
        ps = [sampling.probabilities(r, temperature, **kw) for r in rows]
        build = best_ms(lambda: [sampling.probabilities(r, temperature, **kw) for r in rows]) / len(rows)
        standard = best_ms(lambda: [sampling.sample(p, rng) for p in ps]) / len(rows)
        coupled = best_ms(lambda: [sampling.gumbel_argmax(p, 7, i) for i, p in enumerate(ps)]) / len(rows)
        hashed = np.mean([np.sum(p >= p.max() * np.exp(-sampling.GUMBEL_SPAN)) for p in ps])
        print(f"T {temperature} {kw or 'unfiltered'}: distribution {build:.3f} ms, standard draw {standard:.3f} ms, "
              f"coupled draw {coupled:.3f} ms ({hashed:.0f} of {len(ps[0])} tokens hashed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
