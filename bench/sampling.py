"""Sampled requests: what the filters (top_p, top_k, min_p) cost, target-only and with drafts.

    python bench/sampling.py [--model NAME] [--drafts D1,D2,scheduled] [--filters "top_p=1.0;top_p=0.9;top_k=40"]
                             [--temperature 0.7] [--max-tokens 64] [--limit 1] [--rounds 2]

One process, the target and the named drafts loaded once (the fixed pool; with the policy
`scheduled` among --drafts, the daemon's scheduler instead, which also runs any draft named); each
round runs every prompt (the built-in ones, `--limit` of each category) under every filter and every
policy in turn, each request with its own seed, so that the machine's drift falls on all alike.
`scheduled` requests name no draft: the scheduler picks as the daemon does, and its suffix index
is emptied before each (else it would recall the same prompt's answer under the policies before).
It prints tok/s (generated tokens over the requests' whole time) per filter and policy, medians of
the rounds, and each filter's ratio to the unfiltered target-only rate of the same round.  Every
sampled token runs the filters over the target's whole vocabulary (151,936 ids for the Qwen2.5
targets), and a sampled speculative step runs them on every row it verifies.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time


SCHEDULED = "scheduled"  # the policy of a request that names no draft: the daemon's scheduler picks


def parse_filters(text: str) -> list[dict]:
    """"top_p=0.9,top_k=40;min_p=0.05" -> [{"top_p": 0.9, "top_k": 40}, {"min_p": 0.05}] ("" = none)."""
    out = []
    for group in text.split(";"):
        kw = {}
        for item in filter(None, (s.strip() for s in group.split(","))):
            key, _, value = item.partition("=")
            if key not in ("top_p", "top_k", "min_p") or not value:
                raise SystemExit(f"--filters: {item!r} is not top_p=X, top_k=N or min_p=X")
            kw[key] = int(value) if key == "top_k" else float(value)
        out.append(kw)
    return out


def main(argv: list[str] | None = None) -> int:
    from memspec.bench.policies import load_workload
    from memspec.build import build_engine
    from memspec.config import load_config
    from memspec.request import GenerationRequest, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target from the store (default: the config's [model] target)")
    ap.add_argument("--drafts", default="", help="comma-separated drafts to run besides target-only; "
                                                 "'scheduled': the daemon's scheduler picks")
    ap.add_argument("--filters", default="top_p=1.0;top_p=0.9;top_k=40",
                    help="';'-separated filter sets, each 'key=value,...' of top_p, top_k, min_p")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=1, help="prompts of each category (default 1)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--config", help="memspec TOML config")
    args = ap.parse_args(argv)
    if args.temperature <= 0 or args.max_tokens < 1 or args.rounds < 1 or args.limit < 1:
        raise SystemExit("--temperature must be > 0, --max-tokens, --rounds and --limit at least 1")
    filters = parse_filters(args.filters)
    config = load_config(args.config)
    if args.model:
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, target=args.model))
    policies = ["none", *filter(None, (d.strip() for d in args.drafts.split(",")))]
    scheduled = SCHEDULED in policies
    engine = build_engine(config, drafts="scheduler" if scheduled else "pool")
    available = [row.name for row in engine.drafts.report().drafts]
    for d in policies[1:]:
        if d != SCHEDULED and d not in available:
            engine.close()
            raise SystemExit(f"draft {d!r} is not in the pool: {', '.join(sorted([SCHEDULED, *available]))}")
    engine.calibrate()
    seen: dict[str, int] = {}
    prompts = []
    for w in load_workload(None):
        if seen.get(w["category"], 0) < args.limit:
            seen[w["category"]] = seen.get(w["category"], 0) + 1
            prompts.append(w["prompt"])
    rates: dict[tuple[int, str], list[float]] = {}
    ratios: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        tally = {(f, p): [0, 0.0] for f in range(len(filters)) for p in policies}
        for i, prompt in enumerate(prompts):
            order = [(f, p) for f in range(len(filters)) for p in policies]
            shift = (i + r) % len(order)  # each prompt starts elsewhere: the drift falls on all alike
            for f, p in order[shift:] + order[:shift]:
                params = SamplingParams(temperature=args.temperature, seed=1000 * r + i, **filters[f])
                if p == SCHEDULED:
                    engine.drafts.forget()
                t0 = time.perf_counter()
                c = engine.generate(GenerationRequest(prompt=prompt, max_tokens=args.max_tokens,
                                                      draft=None if p == SCHEDULED else p, sampling=params))
                tally[(f, p)][0] += len(c.token_ids)
                tally[(f, p)][1] += time.perf_counter() - t0
        base = tally[(0, "none")][0] / tally[(0, "none")][1]
        for key, (tokens, seconds) in tally.items():
            rates.setdefault(key, []).append(tokens / seconds)
            ratios.setdefault(key, []).append(tokens / seconds / base)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{len(prompts)} prompts, temperature {args.temperature}, up to {args.max_tokens} tokens, "
          f"medians of {args.rounds} rounds; ratio: to target-only under the first filters, same round")
    print(f"{'filters':<28} {'policy':<32} {'tok/s':>7} {'ratio':>6}")
    for f, kw in enumerate(filters):
        name = ",".join(f"{k}={v}" for k, v in kw.items()) or "none"
        for p in policies:
            print(f"{name:<28} {p:<32} {statistics.median(rates[(f, p)]):>7.1f} "
                  f"{statistics.median(ratios[(f, p)]):>5.2f}x")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
