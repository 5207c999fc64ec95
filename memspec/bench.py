"""`memspec bench`: run a prompt workload under several draft policies, side by side.

Every prompt runs under every policy in turn (interleaved, so machine noise
hits all of them alike), greedily, and each policy's output is checked against
target-only: a speculative run that changed a token is counted as a mismatch.
Reported per policy and category: tok/s, speedup over target-only, mean
acceptance length and wasted draft tokens.  `--json FILE` writes the `runs`
list; `--png FILE` draws the speedups (needs matplotlib: `pip install -e .[bench]`).
"""

from __future__ import annotations

import json
import random
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from memspec.errors import InvalidRequestError, MemspecError
from memspec.request import GenerationRequest

DEFAULT_WORKLOAD = "bench_prompts.jsonl"


@dataclass
class Tally:
    """Totals of one (policy, category) cell."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mismatches: int = 0
    per_request_tps: list[float] = field(default_factory=list)

    def add(self, completion, mismatch: bool) -> None:
        s = completion.stats
        self.requests += 1
        self.tokens += len(completion.token_ids)
        self.seconds += completion.timings["total_ms"] / 1e3
        self.num_drafts += s.get("num_drafts", 0)
        self.num_draft_tokens += s.get("num_draft_tokens", 0)
        self.num_accepted_tokens += s.get("num_accepted_tokens", 0)
        self.mismatches += int(mismatch)
        self.per_request_tps.append(len(completion.token_ids) / max(completion.timings["total_ms"] / 1e3, 1e-9))

    def merge(self, other: "Tally") -> None:
        for k in ("requests", "tokens", "seconds", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "mismatches"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.per_request_tps += other.per_request_tps

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def load_workload(path: str | None) -> list[dict]:
    """Prompts from a JSONL file with `prompt` and `category` fields (default: the built-in set)."""
    if path is None:
        text = resources.files("memspec.data").joinpath(DEFAULT_WORKLOAD).read_text()
        where = f"built-in {DEFAULT_WORKLOAD}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InvalidRequestError(f"workload: cannot read {path}: {exc.strerror}") from None
        where = path
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"workload {where}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise InvalidRequestError(f"workload {where}:{n}: needs a non-empty string field 'prompt'")
        items.append({"prompt": item["prompt"], "category": str(item.get("category", "all"))})
    if not items:
        raise InvalidRequestError(f"workload {where} holds no prompts")
    return items


def policy_draft(policy: str, engine) -> str:
    """The draft a fixed policy runs with ('none' for target-only)."""
    if policy == "target-only":
        return "none"
    if policy.startswith("fixed:") and policy[6:] in engine.drafts:
        return policy[6:]
    known = ", ".join(["target-only", *(f"fixed:{d}" for d in sorted(engine.drafts))])
    raise InvalidRequestError(f"policies: unknown policy {policy!r}; known: {known}")


def run(engine, workload: list[dict], policies: list[str], max_tokens: int, progress=None) -> dict:
    """Run the workload; returns {(policy, category): Tally}."""
    if "target-only" not in policies:
        policies = ["target-only", *policies]
    drafts = {p: policy_draft(p, engine) for p in policies}
    cells: dict[tuple[str, str], Tally] = defaultdict(Tally)
    for i, item in enumerate(workload, 1):
        base = None
        for policy in policies:
            req = GenerationRequest(prompt=item["prompt"], max_tokens=max_tokens, draft=drafts[policy])
            c = engine.generate(req)
            if base is None:
                base = c.token_ids
            cells[(policy, item["category"])].add(c, mismatch=c.token_ids != base)
        if progress:
            progress(f"[{i}/{len(workload)}] {item['category']}")
    return cells


def summarize(cells: dict, policies: list[str]) -> list[dict]:
    """The `runs` rows: one per (policy, category) plus category 'all'."""
    cats = sorted({c for _, c in cells})
    base = {c: cells[("target-only", c)] for c in cats}
    total_base = Tally()
    for t in base.values():
        total_base.merge(t)
    rows = []
    for policy in ["target-only", *[p for p in policies if p != "target-only"]]:
        total = Tally()
        for c in cats:
            t = cells[(policy, c)]
            total.merge(t)
            rows.append(_row(policy, c, t, base[c]))
        rows.append(_row(policy, "all", total, total_base))
    return rows


def _row(policy: str, category: str, t: Tally, base: Tally) -> dict:
    return {
        "policy": policy, "category": category, "requests": t.requests, "tokens": t.tokens,
        "seconds": round(t.seconds, 4), "tok_per_s": round(t.tok_per_s, 2),
        "speedup_vs_target": round(t.tok_per_s / base.tok_per_s, 3) if base.tok_per_s else 0.0,
        "mean_acceptance_length": round(t.mean_acceptance_length, 3),
        "wasted_draft_tokens": t.num_draft_tokens - t.num_accepted_tokens,
        "num_drafts": t.num_drafts, "num_draft_tokens": t.num_draft_tokens,
        "num_accepted_tokens": t.num_accepted_tokens, "mismatches_vs_target": t.mismatches,
    }


def print_table(rows: list[dict], out=sys.stdout) -> None:
    cats = [c for c in dict.fromkeys(r["category"] for r in rows) if c != "all"] + ["all"]
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    cell = {(r["policy"], r["category"]): r for r in rows}
    w = max(len(p) for p in pols) + 1
    print("\nmean acceptance length (speedup vs target-only) by category", file=out)
    print(f"{'policy':<{w}}" + "".join(f"{c[:13]:>16}" for c in cats), file=out)
    for p in pols:
        print(f"{p:<{w}}" + "".join(
            f"{cell[(p, c)]['mean_acceptance_length']:>8.2f} ({cell[(p, c)]['speedup_vs_target']:.2f}x)" for c in cats
        ), file=out)
    print(f"\n{'policy':<{w}} {'tok/s':>8} {'speedup':>8} {'accept len':>10} {'wasted':>8} {'mismatch':>8}", file=out)
    for p in pols:
        r = cell[(p, "all")]
        print(f"{p:<{w}} {r['tok_per_s']:>8.1f} {r['speedup_vs_target']:>7.2f}x {r['mean_acceptance_length']:>10.2f} "
              f"{r['wasted_draft_tokens']:>8} {r['mismatches_vs_target']:>8}", file=out)


def write_png(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no PNG written (pip install -e .[bench])", file=sys.stderr)
        return False
    cats = [c for c in dict.fromkeys(r["category"] for r in rows)]
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    cell = {(r["policy"], r["category"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(cats)), 4.5))
    width = 0.8 / len(pols)
    for i, p in enumerate(pols):
        ax.bar([j + i * width for j in range(len(cats))], [cell[(p, c)]["speedup_vs_target"] for c in cats],
               width, label=p)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats)
    ax.set_ylabel("speedup vs target-only (tok/s)")
    ax.set_title("memspec bench: greedy, lossless")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def add_arguments(b) -> None:
    b.add_argument("--workload", metavar="FILE", help="JSONL with prompt and category fields (default: built-in 48)")
    b.add_argument("--policies", default="all",
                   help="comma-separated: target-only, fixed:DRAFT ...; 'all' = target-only and every draft fixed")
    b.add_argument("--variant", choices=("fp32", "q4"), help="target variant (default from config)")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    b.add_argument("--limit", type=int, default=0, help="run only the first N prompts per category (0 = all)")
    b.add_argument("--shuffle", type=int, metavar="SEED", help="shuffle the request order with this seed")
    b.add_argument("--gamma", type=int, help="initial draft length (default from config: 5)")
    b.add_argument("--fixed-gamma", action="store_true", help="do not adapt the draft length")
    b.add_argument("--json", metavar="FILE", help="write {config, runs} as JSON")
    b.add_argument("--png", metavar="FILE", help="write a chart of speedups")


def run_cli(args) -> int:
    import dataclasses

    from memspec.engine import Engine

    if args.max_tokens <= 0:
        raise InvalidRequestError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    workload = load_workload(args.workload)
    if args.limit:
        kept: dict[str, list] = defaultdict(list)
        for w in workload:
            kept[w["category"]].append(w)
        workload = [w for group in kept.values() for w in group[: args.limit]]
    if args.shuffle is not None:
        random.Random(args.shuffle).shuffle(workload)
    engine = Engine.from_config(args.config, args.variant, with_drafts=True)
    spec = engine.spec
    if args.gamma:
        spec = dataclasses.replace(spec, gamma=args.gamma)
    if args.fixed_gamma:
        spec = dataclasses.replace(spec, adaptive=False)
    engine.spec = spec
    policies = (["target-only", *(f"fixed:{d}" for d in sorted(engine.drafts))] if args.policies == "all"
                else [p.strip() for p in args.policies.split(",") if p.strip()])
    for p in policies:
        policy_draft(p, engine)  # refuse unknown policies before running anything
    cells = run(engine, workload, policies, args.max_tokens,
                progress=lambda m: print(m, file=sys.stderr, flush=True))
    rows = summarize(cells, policies)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"target": engine.target.name, "variant": engine.target.variant, "max_tokens": args.max_tokens,
                       "spec": dataclasses.asdict(spec), "requests": len(workload)},
            "runs": rows}, indent=2))
    if args.png:
        write_png(rows, args.png)
    return 0 if all(r["mismatches_vs_target"] == 0 for r in rows) or engine.target.variant != "fp32" else 1


__all__ = ["add_arguments", "run_cli", "load_workload", "run", "summarize", "MemspecError"]
