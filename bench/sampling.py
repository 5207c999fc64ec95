"""Sampled requests: tok/s, acceptance and repeatability of the sampling schemes, per category.

    python bench/sampling.py [--model NAME] [--drafts D1,D2,scheduled] [--filters "top_p=0.95;top_k=40"]
                             [--temperature 0.7,1.0] [--scheme coupled,standard] [--workload FILE]
                             [--max-tokens 64] [--limit 1] [--rounds 2]

One process, the target and the named drafts loaded once (the fixed pool; with the policy
`scheduled` among --drafts, the daemon's scheduler instead, which also runs any draft named); each
round runs every prompt (`--limit` of each category of the workload: the built-in one, or a JSONL
file of `prompt` and `category`) under every temperature, filter set, scheme and policy in turn,
each prompt with its own seed (the same for every policy and scheme), so that the machine's drift
falls on all alike.  `scheduled` requests name no draft: the scheduler picks as the daemon does,
and its suffix index is emptied before each (else it would recall the same prompt's answer under
the policies before).

The schemes ([speculative] sampling, memspec.speculation.sampling): "coupled", noise keyed by
(seed, position, token) and verification greedy on the perturbed rows (a seed's answer is the
target-only one, whatever the draft); "standard", one stream a request and the speculative-sampling
rule (the answer for a seed depends on the draft).

It prints, per temperature, filters, scheme, policy and category: tok/s (generated tokens over the
requests' whole time, medians of the rounds), the ratio to target-only under the same scheme in the
same round, the acceptance rate (accepted / drafted tokens) and the share of answers identical to
target-only's with the same seed; and each policy's coupled tok/s over its standard tok/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time


SCHEDULED = "scheduled"  # the policy of a request that names no draft: the daemon's scheduler picks
SCHEMES = ("coupled", "standard")


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


def parse_list(text: str, what: str, kind=str) -> list:
    try:
        out = [kind(t.strip()) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"{what}: {text!r} is not a comma-separated list") from None
    if not out:
        raise SystemExit(f"{what}: give at least one")
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
    ap.add_argument("--filters", default="top_p=0.95",
                    help="';'-separated filter sets, each 'key=value,...' of top_p, top_k, min_p")
    ap.add_argument("--temperature", default="0.7", help="comma-separated temperatures (default 0.7)")
    ap.add_argument("--scheme", default=",".join(SCHEMES), help="comma-separated sampling schemes: coupled, standard")
    ap.add_argument("--workload", help="JSONL of prompt and category (default: the built-in prompts)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=1, help="prompts of each category (default 1)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--config", help="memspec TOML config")
    args = ap.parse_args(argv)
    temperatures = parse_list(args.temperature, "--temperature", float)
    schemes = parse_list(args.scheme, "--scheme")
    if any(t <= 0 for t in temperatures) or args.max_tokens < 1 or args.rounds < 1 or args.limit < 1:
        raise SystemExit("--temperature must be > 0, --max-tokens, --rounds and --limit at least 1")
    if set(schemes) - set(SCHEMES):
        raise SystemExit(f"--scheme: {args.scheme!r}; known: {', '.join(SCHEMES)}")
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
    prompts: list[tuple[str, str]] = []  # (category, prompt)
    for w in load_workload(args.workload):
        if seen.get(w["category"], 0) < args.limit:
            seen[w["category"]] = seen.get(w["category"], 0) + 1
            prompts.append((w["category"], w["prompt"]))
    categories = sorted(seen)
    settings = [(t, f, s) for t in temperatures for f in range(len(filters)) for s in schemes]
    # (setting, policy, category) -> per round [tokens, seconds, drafted, accepted, identical, answers]
    rates: dict[tuple, list[float]] = {}
    ratios: dict[tuple, list[float]] = {}
    accept: dict[tuple, list[int]] = {}
    same: dict[tuple, list[int]] = {}
    base_spec = engine.spec
    for r in range(args.rounds):
        tally: dict[tuple, list[float]] = {}
        for i, (cat, prompt) in enumerate(prompts):
            order = [(st, p) for st in settings for p in policies]
            shift = (i + r) % len(order)  # each prompt starts elsewhere: the drift falls on all alike
            answers: dict[tuple, list[int]] = {}
            for st, p in order[shift:] + order[:shift]:
                temperature, f, scheme = st
                engine.spec = dataclasses.replace(base_spec, sampling=scheme)
                params = SamplingParams(temperature=temperature, seed=1000 * r + i, **filters[f])
                if p == SCHEDULED:
                    engine.drafts.forget()
                t0 = time.perf_counter()
                c = engine.generate(GenerationRequest(prompt=prompt, max_tokens=args.max_tokens,
                                                      draft=None if p == SCHEDULED else p, sampling=params))
                dt = time.perf_counter() - t0
                answers[(st, p)] = c.token_ids
                for key in ((st, p, cat), (st, p, "all")):
                    row = tally.setdefault(key, [0, 0.0, 0, 0, 0, 0])
                    row[0] += len(c.token_ids)
                    row[1] += dt
                    row[2] += c.stats.num_draft_tokens
                    row[3] += c.stats.num_accepted_tokens
            for st, p in order:  # the same seed's target-only answer under the same scheme
                for key in ((st, p, cat), (st, p, "all")):
                    tally[key][4] += answers[(st, p)] == answers[(st, "none")]
                    tally[key][5] += 1
        for (st, p, cat), (tokens, seconds, drafted, accepted, ident, n) in tally.items():
            base = tally[(st, "none", cat)]
            rates.setdefault((st, p, cat), []).append(tokens / seconds)
            ratios.setdefault((st, p, cat), []).append(tokens / seconds / (base[0] / base[1]))
            a = accept.setdefault((st, p, cat), [0, 0])
            a[0] += drafted
            a[1] += accepted
            m = same.setdefault((st, p, cat), [0, 0])
            m[0] += ident
            m[1] += n
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    engine.spec = base_spec
    print(f"{len(prompts)} prompts ({', '.join(f'{c} {seen[c]}' for c in categories)}), up to {args.max_tokens} "
          f"tokens, medians of {args.rounds} rounds; ratio: to target-only under the same scheme, same round; "
          f"accept: accepted / drafted tokens; same: answers identical to target-only's with the seed")
    print(f"{'T':>4} {'filters':<14} {'scheme':<9} {'policy':<16} {'category':<10} {'tok/s':>7} {'ratio':>6} "
          f"{'accept':>6} {'same':>5}")
    for st in settings:
        temperature, f, scheme = st
        name = ",".join(f"{k}={v}" for k, v in filters[f].items()) or "none"
        for p in policies:
            for cat in [*categories, "all"]:
                drafted, accepted = accept[(st, p, cat)]
                ident, n = same[(st, p, cat)]
                print(f"{temperature:>4} {name:<14} {scheme:<9} {p:<16} {cat:<10} "
                      f"{statistics.median(rates[(st, p, cat)]):>7.1f} {statistics.median(ratios[(st, p, cat)]):>5.2f}x "
                      f"{accepted / drafted if drafted else 0.0:>6.2f} {ident / n:>5.2f}")
    if set(schemes) == set(SCHEMES):
        print("coupled tok/s over standard tok/s (all categories, medians of the rounds' ratios):")
        for t in temperatures:
            for f in range(len(filters)):
                for p in policies:
                    c = rates[((t, f, "coupled"), p, "all")]
                    s = rates[((t, f, "standard"), p, "all")]
                    print(f"  T {t} filters {f} {p:<16} {statistics.median(x / y for x, y in zip(c, s)):.3f}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
