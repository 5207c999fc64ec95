"""`memspec bench`: run a prompt workload under several draft policies, side by side.

Every prompt runs under every policy in turn (interleaved, so machine noise
hits all of them alike), greedily, and each policy's output is checked against
target-only: a speculative run that changed a token is counted as a mismatch.
Reported per policy and category: tok/s, speedup over target-only, mean
acceptance length and wasted draft tokens.  `--json FILE` writes the `runs`
list; `--png FILE` draws the speedups (needs matplotlib: `pip install -e .[bench]`).

Scheduling policies (`bandit`, `memspec`, `oracle`, or any policy with
`--budget-mb`) run as a stream instead: the workload shuffled into one mixed
request stream, each policy in turn over the same stream with a fresh scheduler
and working set under the same memory budget (real loads and evictions, the same
target session), while a thread samples the process RSS.  Their `all` rows add
peak RSS against the budget, load stalls, the ratio to bandit and the fraction
of the oracle.  The oracle's table (fastest draft per prompt) comes from
`--oracle-table`, else from a profiling pass: every draft over the stream,
preloaded, decode tok/s per prompt.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from memspec.errors import ConfigError, InvalidRequestError, MemspecError
from memspec.runtime.memory import MiB
from memspec.request import NO_DRAFT, Completion, GenerationRequest, PolicyName, unknown_draft, unknown_policy

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
    tree_rows: int = 0  # rows token trees added to their chains (memspec.speculation.tree)
    tree_tokens: int = 0  # tokens their branches won
    mismatches: int = 0
    per_request_tps: list[float] = field(default_factory=list)

    def add(self, completion, mismatch: bool) -> None:
        s = completion.stats
        self.requests += 1
        self.tokens += len(completion.token_ids)
        self.seconds += completion.timings.total_ms / 1e3
        self.num_drafts += s.num_drafts
        self.num_draft_tokens += s.num_draft_tokens
        self.num_accepted_tokens += s.num_accepted_tokens
        self.tree_rows += s.tree_rows
        self.tree_tokens += s.tree_tokens
        self.mismatches += int(mismatch)
        self.per_request_tps.append(len(completion.token_ids) / max(completion.timings.total_ms / 1e3, 1e-9))

    def merge(self, other: "Tally") -> None:
        for k in ("requests", "tokens", "seconds", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "tree_rows",
                  "tree_tokens", "mismatches"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.per_request_tps += other.per_request_tps

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def rows_per_pass(self) -> float:
        """Rows of a drafting step's verify pass: the last token, the drafts, a tree's branches."""
        return (self.num_drafts + self.num_draft_tokens + self.tree_rows) / self.num_drafts if self.num_drafts else 1.0


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


def spread(items: list[dict], n: int) -> list[dict]:
    """n of a workload's items, spread over its categories: each category (sorted) in turn, its
    items in file order, a category that runs out skipped."""
    by_cat: dict[str, list[dict]] = {}
    for item in items:
        by_cat.setdefault(item["category"], []).append(item)
    rows = [by_cat[c] for c in sorted(by_cat)]
    turns = (row[i] for i in range(max(map(len, rows), default=0)) for row in rows if i < len(row))
    return list(itertools.islice(turns, n))


def policy_draft(policy: str, pool) -> str:
    """The draft a policy of a fixed pool (a DraftPool) runs with ('none' for target-only)."""
    name = PolicyName.parse(policy, "policies")
    if name.kind not in ("target-only", "fixed"):
        raise unknown_policy(policy, pool.policies(), "policies")
    if name.kind == "fixed" and name.draft not in pool:
        raise unknown_draft(name.draft, pool, "policies")
    return name.draft or NO_DRAFT


def run(engine, workload: list[dict], policies: list[str], max_tokens: int, progress=None) -> dict:
    """Run the workload; returns {(policy, category): Tally}."""
    if "target-only" not in policies:
        policies = ["target-only", *policies]
    drafts = {p: policy_draft(p, engine.drafts) for p in policies}
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


def teacher_forced_agreement(engine, prompts: list[str], max_tokens: int, verify_len: int = 6) -> tuple[int, int]:
    """How often verification agrees with target-only decoding: along each prompt's greedy
    target-only sequence, target passes of `verify_len` tokens ([last, d1..d5], as the
    speculative loop runs them) whose argmax is the token decoding chose.  Returns (agree, total)."""
    import numpy as np

    s = engine.target.session
    agree = total = 0
    for prompt in prompts:
        base = engine.generate(GenerationRequest(prompt=prompt, max_tokens=max_tokens, draft=NO_DRAFT))
        seq = base.prompt_token_ids + base.token_ids
        cache = s.new_cache(len(seq) + verify_len)
        pos = len(base.prompt_token_ids) - 1
        s.forward(cache, seq[:pos], keep=1)
        while pos < len(seq) - 1:
            chunk = seq[pos: pos + verify_len]
            want = seq[pos + 1: pos + 1 + len(chunk)]
            got = s.forward(cache, chunk, keep=len(chunk)).argmax(-1)[: len(want)]
            agree += int((got == np.asarray(want)).sum())
            total += len(want)
            pos += len(chunk)
    return agree, total


def summarize_runs(cells: dict, policies: list[str]) -> list[dict]:
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
        "rows_per_pass": round(t.rows_per_pass, 3), "tree_rows": t.tree_rows, "tree_tokens": t.tree_tokens,
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
    print(f"\n{'policy':<{w}} {'tok/s':>8} {'speedup':>8} {'accept len':>10} {'rows/pass':>9} {'wasted':>8} "
          f"{'mismatch':>8}", file=out)
    for p in pols:
        r = cell[(p, "all")]
        print(f"{p:<{w}} {r['tok_per_s']:>8.1f} {r['speedup_vs_target']:>7.2f}x {r['mean_acceptance_length']:>10.2f} "
              f"{r['rows_per_pass']:>9.2f} {r['wasted_draft_tokens']:>8} {r['mismatches_vs_target']:>8}", file=out)


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


# -- scheduling policies on one request stream ---------------------------------------------------
SCHEDULED = ("bandit", "memspec", "oracle")


@dataclass
class PolicyRun:
    """What one policy did over the whole stream, beside its Tally cells."""

    peak_rss: int = 0  # bytes, sampled (the highest of its rounds)
    counters: dict = field(default_factory=dict)  # the scheduler's ROUND_COUNTS, summed over its rounds
    round_tok_per_s: list[float] = field(default_factory=list)  # its tok/s over the whole stream, each round

    def add_round(self, peak_rss: int, counters: dict, tok_per_s: float) -> None:
        self.peak_rss = max(self.peak_rss, peak_rss)
        for k in ROUND_COUNTS:  # counts add up over rounds; the scheduler's means and gauges would not
            self.counters[k] = self.counters.get(k, 0.0) + counters.get(k, 0.0)
        self.round_tok_per_s.append(tok_per_s)

    @property
    def stalls(self) -> int:
        return int(self.counters.get("stalls", 0))

    @property
    def stall_ms(self) -> float:
        return self.counters.get("stall_ms", 0.0)


ROUND_COUNTS = ("stalls", "stall_ms", "loads", "evictions", "hits", "misses", "preloads", "switches")


def draft_sizes(store, target, suffix_bytes: int = 0, corpus: bool = True) -> dict[str, int]:
    """Every draft made for the target, with its planned RSS footprint (prompt lookup: 0; the
    suffix draft, when suffix_bytes > 0: its index's bytes, and with `corpus` its shipped corpus's)."""
    from memspec.speculation.drafts import target_drafts
    from memspec.speculation.sources import shipped_corpus, suffix_nbytes
    from memspec.scheduling.scheduler import draft_footprints

    held = shipped_corpus(store, target.name, target.vocab_size) if corpus and suffix_bytes else None
    return draft_footprints(target_drafts(store, target.name), suffix_nbytes(suffix_bytes, held))


def draft_room(sizes: dict[str, int], held: tuple[str, ...] = ()) -> int:
    """Room for the drafts the scheduler holds for good (`held`: the suffix draft's index, which
    learns from every request and is never evicted) and at most half the other model drafts in any
    combination: the larger of the largest one and the n//2 smallest together (any n//2 + 1 of them
    need more, when n > 1).  Without the held ones' room the largest draft would never fit."""
    kept = sum(b for n, b in sizes.items() if n in held)
    small = sorted(b for n, b in sizes.items() if b > 0 and n not in held)
    if not small:
        return kept
    return kept + max(small[-1], sum(small[: len(small) // 2]))


def default_budget_mb(process_bytes: int, kv_bytes: int, sizes: dict[str, int], held: tuple[str, ...] = ()) -> int:
    """The process as it is now (runtime and target), one request's KV caches and room for the
    drafts held for good and at most half the others (`draft_room`)."""
    return -(-(process_bytes + kv_bytes + draft_room(sizes, held)) // MiB)


def round_order(policies: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, policy) in the order they run: forward, then backward, and so on (A B B A), so
    that a machine drifting over the run slows no policy more than another."""
    return [(r, p) for r in range(rounds) for p in (policies if r % 2 == 0 else policies[::-1])]


def run_stream(engine, make_scheduler, workload: list[dict], policies: list[str], max_tokens: int,
               lookahead: int = 1, progress=None,
               rounds: int = 1) -> tuple[dict, dict[str, PolicyRun], dict[str, list[int]]]:
    """Each policy over the same stream with its own scheduler, `rounds` times in round_order;
    returns (cells summed over the rounds, runs, target-only outputs).
    The engine must be warm (ONNX Runtime's first runs are slow): run_bench_stream warms it."""
    from memspec.runtime.memory import PsutilProbe, RssSampler, reclaim
    from memspec.speculation.sources import DraftPool

    cells: dict[tuple[str, str], Tally] = defaultdict(Tally)
    runs: dict[str, PolicyRun] = {p: PolicyRun() for p in policies}
    base: dict[int, list[int]] = {}
    probe = PsutilProbe()
    reqs = [GenerationRequest(prompt=w["prompt"], max_tokens=max_tokens) for w in workload]
    for r, policy in round_order(policies, rounds):
        sched = make_scheduler(policy)  # a fresh one each round: no round starts with another's resident set
        engine.drafts = sched
        reclaim()
        this_round = Tally()
        try:
            with RssSampler(probe) as rss:
                for i, (item, req) in enumerate(zip(workload, reqs)):
                    c = None
                    for n, out in enumerate(engine.stream(req)):
                        if n == 0:  # the queue is seen while this request runs, as in the daemon
                            sched.hint(reqs[i + 1: i + 1 + lookahead])
                        if isinstance(out, Completion):
                            c = out
                    base.setdefault(i, c.token_ids)
                    mismatch = c.token_ids != base[i]
                    cells[(policy, item["category"])].add(c, mismatch=mismatch)
                    this_round.add(c, mismatch=mismatch)
                    if progress:
                        progress(f"[{policy} {i + 1}/{len(workload)}{f' round {r + 1}/{rounds}' if rounds > 1 else ''}]"
                                 f" {item['category']}")
            runs[policy].add_round(rss.peak_bytes, sched.counters(), this_round.tok_per_s)
        finally:
            engine.drafts = DraftPool()
            sched.close()
    return cells, runs, base


def profile_oracle(engine, make_scheduler, workload: list[dict], drafts: list[str], max_tokens: int,
                   progress=None) -> dict[str, str]:
    """{prompt: the draft (or 'none') with the best decode tok/s}, every draft preloaded."""
    from memspec.speculation.sources import DraftPool

    best: dict[str, tuple[float, str]] = {}
    for name in [NO_DRAFT, *drafts]:
        sched = make_scheduler(str(PolicyName.of_draft(name)), budget_mb=0)
        if name != NO_DRAFT:
            sched.ws.preload(name)
            sched.ws.wait_idle(timeout=600)
        engine.drafts = sched
        try:
            for i, w in enumerate(workload, 1):
                c = engine.generate(GenerationRequest(prompt=w["prompt"], max_tokens=max_tokens))
                tps = c.timings.tok_per_s
                if tps > best.get(w["prompt"], (-1.0, ""))[0]:
                    best[w["prompt"]] = (tps, name)
                if progress:
                    progress(f"[oracle profile {name} {i}/{len(workload)}]")
        finally:
            engine.drafts = DraftPool()
            sched.close()
    return {p: n for p, (_, n) in best.items()}


def stream_rows(cells: dict, runs: dict[str, PolicyRun], policies: list[str], budget_mb: int) -> list[dict]:
    """summarize_runs() rows, with the stream's columns added to each policy's `all` row."""
    rows = summarize_runs(cells, policies)
    alls = {r["policy"]: r for r in rows if r["category"] == "all"}

    def ratio(policy: str, other: str) -> float | None:
        """The median over rounds of policy's tok/s over other's in the same round (one round: the ratio)."""
        if other not in runs or not runs[other].round_tok_per_s:
            return None
        return round(statistics.median(a / b for a, b in zip(runs[policy].round_tok_per_s,
                                                              runs[other].round_tok_per_s) if b > 0), 3)

    for policy, r in alls.items():
        run_ = runs[policy]
        if len(run_.round_tok_per_s) > 1:  # ratios as medians of each round's, the drift of the machine apart
            r["speedup_vs_target"] = ratio(policy, "target-only")
        r.update({
            "peak_rss_mb": round(run_.peak_rss / MiB, 1), "budget_mb": budget_mb,
            "load_stalls": run_.stalls, "load_stall_ms": round(run_.stall_ms, 1),
            "rounds_tok_per_s": [round(v, 2) for v in run_.round_tok_per_s],
            "ratio_vs_bandit": ratio(policy, "bandit"),
            "fraction_of_oracle": ratio(policy, "oracle"),
            "acceptance_rate": round(r["num_accepted_tokens"] / r["num_draft_tokens"], 3) if r["num_draft_tokens"] else 0.0,
            "loads": int(run_.counters.get("loads", 0)), "evictions": int(run_.counters.get("evictions", 0)),
            "hits": int(run_.counters.get("hits", 0)), "misses": int(run_.counters.get("misses", 0)),
            "preloads": int(run_.counters.get("preloads", 0)), "switches": int(run_.counters.get("switches", 0)),
        })
    return rows


def print_stream_table(rows: list[dict], out=sys.stdout) -> None:
    alls = [r for r in rows if r["category"] == "all"]
    w = max(len(r["policy"]) for r in alls) + 1

    def opt(v, fmt):
        return format(v, fmt) if v is not None else "-"

    print(f"\n{'policy':<{w}} {'tok/s':>7} {'speedup':>8} {'vs bandit':>9} {'of oracle':>9} {'stalls':>6} "
          f"{'stall ms':>9} {'peak RSS/budget MiB':>20} {'accept len':>10} {'accept':>7} {'mismatch':>8}", file=out)
    for r in alls:
        print(f"{r['policy']:<{w}} {r['tok_per_s']:>7.1f} {r['speedup_vs_target']:>7.2f}x "
              f"{opt(r['ratio_vs_bandit'], '.2f'):>9} {opt(r['fraction_of_oracle'], '.2f'):>9} {r['load_stalls']:>6} "
              f"{r['load_stall_ms']:>9.0f} {r['peak_rss_mb']:>11.0f} / {r['budget_mb']:<6} "
              f"{r['mean_acceptance_length']:>10.2f} {r['acceptance_rate']:>7.2f} {r['mismatches_vs_target']:>8}",
              file=out)
    print("(budget: the process's RSS with the target loaded + resident drafts' footprints + KV caches "
          "of the running request; peak RSS: the whole process, sampled)", file=out)
    if any(len(r.get("rounds_tok_per_s", ())) > 1 for r in alls):
        print("(tok/s: over every round; speedup, vs bandit and of oracle: the median of each round's ratio, "
              "the rounds run forward then backward; stalls over every round)", file=out)
        for r in alls:
            print(f"  {r['policy']:<{w}} tok/s by round: {', '.join(f'{v:.1f}' for v in r['rounds_tok_per_s'])}",
                  file=out)


def run_bench_stream(args, policies: list[str], workload: list[dict], spec) -> tuple[list[dict], dict]:
    import dataclasses

    from memspec.speculation.drafts import target_drafts
    from memspec.runtime.target import load_target
    from memspec.speculation.engine import Engine
    from memspec.runtime.costs import COSTS, CostCache
    from memspec.runtime.memory import request_kv_bytes
    from memspec.scheduling.policies import load_predictor
    from memspec.scheduling.scheduler import draft_kv_sizers, from_store
    from memspec.models.store import ModelStore

    config = args.config
    store = ModelStore(config.store_home)
    target = load_target(store, config.model.target, args.variant or config.model.variant, config.runtime)
    engine = Engine(target, config.limits, spec=spec, costs=CostCache(store.home / COSTS))  # as build_engine
    suffix_bytes = spec.suffix_mb << 20  # each policy's scheduler starts its own index: none sees another's runs
    sizes = draft_sizes(store, target, suffix_bytes, spec.suffix_corpus)
    target_bytes = target.file_bytes
    budget = args.budget_mb or 0  # set below when not given, once the process is warm
    process: int | None = None  # the warm process, measured below: what every policy books from then on
    base_cfg = config.scheduler
    predictor = load_predictor(base_cfg.predictor, target.variant, target.name) if "memspec" in policies else None
    if "memspec" in policies and predictor is None:
        raise ConfigError(f"policy 'memspec' needs a predictor fitted for {target.name}: none ships for it "
                          f"(memspec profile --model {target.name}, then memspec train-predictor --out "
                          f"models/predictor-{target.name}-{target.variant}.json)")
    limits = spec.draft_limits()
    progress = (lambda m: print(m, file=sys.stderr, flush=True))
    oracle_table = None

    def make_scheduler(policy: str, budget_mb: int | None = None):
        cfg = dataclasses.replace(base_cfg, policy=policy, budget_mb=budget if budget_mb is None else budget_mb)
        # every policy books the process the budget was set from: not what its heap grew to under the
        # policies run before it (which left the 0.5B sibling no room in the later ones)
        return from_store(cfg, store, target, config.runtime, limits, predictor=predictor, oracle_table=oracle_table,
                          suffix_bytes=suffix_bytes, process_bytes=process, corpus=spec.suffix_corpus)

    for p in policies:  # refused before anything runs
        name = PolicyName.parse(p, "policies")
        if name.kind == "fixed" and name.draft not in sizes:
            raise unknown_draft(name.draft, sizes, "policies")
    if "oracle" in policies:
        if args.oracle_table:
            from memspec.scheduling.policies import load_oracle_table
            oracle_table = load_oracle_table(args.oracle_table)
        else:
            oracle_table = profile_oracle(engine, make_scheduler, workload, sorted(sizes), args.max_tokens, progress)
    from memspec.runtime.memory import PsutilProbe, reclaim

    # warm on the longest prompt: the target's arena grows to its largest pass and stays there,
    # so the process measured now is the process every policy runs with
    lengths = [len(engine.prompt_ids(GenerationRequest(prompt=w["prompt"]))) for w in workload]
    longest = max(lengths)
    engine.generate(GenerationRequest(prompt=workload[lengths.index(longest)]["prompt"], max_tokens=args.max_tokens))
    engine.calibrate()  # the verification cost curve, as the daemon measures it at start: in no policy's time
    reclaim()
    process = PsutilProbe().rss_bytes()
    kv = request_kv_bytes(longest + args.max_tokens, target.session.cache_nbytes,  # the most one request may hold
                          draft_kv_sizers(target_drafts(store, target.name), target.session.max_context).values(),
                          slack=spec.gamma_max + 1)
    if args.budget_mb is None:
        from memspec.speculation.suffix import SUFFIX

        budget = default_budget_mb(process, kv, sizes, held=(SUFFIX,))  # the scheduler holds the suffix draft
    print(f"budget {budget} MiB: process with the target {process / MiB:.0f} MiB (target file "
          f"{target_bytes / MiB:.0f} MiB) + KV caches {kv / MiB:.1f} MiB + draft footprints "
          f"{', '.join(f'{n} {b / MiB:.1f}' for n, b in sorted(sizes.items()))} MiB", file=sys.stderr)
    rounds = getattr(args, "rounds", 1)
    cells, runs, _ = run_stream(engine, make_scheduler, workload, policies, args.max_tokens, args.lookahead, progress,
                                rounds=rounds)
    rows = stream_rows(cells, runs, policies, budget)
    info = {"budget_mb": budget, "target_bytes": target_bytes, "process_bytes_at_start": process,
            "kv_bytes_per_request": kv, "draft_footprints": sizes, "stream": True,
            "lookahead": args.lookahead, "rounds": rounds, "oracle_table": oracle_table,
            "scheduler": dataclasses.asdict(dataclasses.replace(base_cfg, budget_mb=budget))}
    return rows, {"engine": engine, "info": info}



def add_arguments(b) -> None:
    b.add_argument("--workload", metavar="FILE", help="JSONL with prompt and category fields (default: built-in 48)")
    b.add_argument("--policies", default="all",
                   help="comma-separated: target-only, fixed:DRAFT, bandit, memspec, oracle; 'all' = "
                        "target-only and every draft fixed")
    b.add_argument("--variant", choices=("fp32", "q4"), help="target variant (default from config)")
    b.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    b.add_argument("--limit", type=int, default=0, help="run only the first N prompts per category (0 = all)")
    b.add_argument("--shuffle", type=int, metavar="SEED", help="shuffle the request order with this seed")
    b.add_argument("--gamma", type=int, help="initial draft length (default from config: 5)")
    b.add_argument("--fixed-gamma", action="store_true", help="do not adapt the draft length")
    b.add_argument("--trees", choices=("on", "off"),
                   help="verify token trees where the target takes them (default from config: [speculative] trees)")
    b.add_argument("--budget-mb", type=int, metavar="N",
                   help="memory budget of the process: runtime and target, resident drafts, KV caches "
                        "(scheduling policies; default: the process once warm, one request's KV caches and "
                        "room for at most half the drafts); runs the policies as one shuffled stream")
    b.add_argument("--oracle-table", metavar="FILE",
                   help="fastest draft per prompt for the oracle (default: profile every draft first)")
    b.add_argument("--lookahead", type=int, default=1, metavar="N",
                   help="stream mode: requests the scheduler sees queued behind the running one (default 1)")
    b.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="stream mode: run every policy over the stream N times, forward then backward, and "
                        "report each ratio as the median of the rounds' (default 1)")
    b.add_argument("--json", metavar="FILE", help="write {config, runs} as JSON")
    b.add_argument("--png", metavar="FILE", help="write a chart of speedups")


def expand_all(policies: list[str], config) -> list[str]:
    """'all' among other policies: target-only and every draft the store has for the target, fixed
    (not the suffix draft: its index would learn each prompt's answer from the policies before it),
    in its place; a policy named twice runs once."""
    from memspec.models.store import ModelStore
    from memspec.scheduling.scheduler import draft_names

    drafts = draft_names(ModelStore(config.store_home), config.model.target, suffix=False,
                         session_config=config.runtime)
    out: list[str] = []
    for p in policies:
        for q in (["target-only", *(f"fixed:{d}" for d in sorted(drafts))] if p == "all" else [p]):
            if q not in out:
                out.append(q)
    return out


def run_bench(args) -> int:
    import dataclasses

    from memspec.build import build_engine

    if args.max_tokens <= 0:
        raise InvalidRequestError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        raise InvalidRequestError(f"--rounds must be at least 1, got {rounds}")
    workload = load_workload(args.workload)
    if args.limit:
        kept: dict[str, list] = defaultdict(list)
        for w in workload:
            kept[w["category"]].append(w)
        workload = [w for group in kept.values() for w in group[: args.limit]]
    if args.shuffle is not None:
        random.Random(args.shuffle).shuffle(workload)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if "all" in policies:  # target-only and every draft fixed, where it stands (the others kept)
        policies = None if policies == ["all"] else expand_all(policies, args.config)
    if policies is not None and (args.budget_mb is not None or any(p in SCHEDULED for p in policies)):
        if "target-only" not in policies:
            policies = ["target-only", *policies]
        if args.shuffle is None:
            random.Random(0).shuffle(workload)  # one mixed stream across categories
        spec = _spec(args, args.config.speculative)
        rows, ctx = run_bench_stream(args, policies, workload, spec)
        engine, extra = ctx["engine"], ctx["info"]
        print_table(rows)
        print_stream_table(rows)
    else:
        if rounds > 1:
            raise InvalidRequestError("--rounds runs the scheduling policies' stream (bandit, memspec, oracle, or "
                                      "any policy with --budget-mb); the fixed drafts run once each")
        engine = build_engine(args.config, args.variant, drafts="pool")
        spec = engine.spec = _spec(args, engine.spec)
        from memspec.speculation.suffix import SUFFIX

        # not the suffix draft unless named: its index learns every run of the shared engine, so each
        # prompt would find its own answer from the policies run before it (a repeated request)
        policies = policies or ["target-only", *(f"fixed:{d}" for d in sorted(engine.drafts) if d != SUFFIX)]
        for p in policies:
            policy_draft(p, engine.drafts)  # refuse unknown policies before running anything
        engine.calibrate()  # measured (or read from the store) now, not in the first drafting policy's time
        cells = run(engine, workload, policies, args.max_tokens,
                    progress=lambda m: print(m, file=sys.stderr, flush=True))
        rows = summarize_runs(cells, policies)
        print_table(rows)
        extra = {}
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"target": engine.target.name, "variant": engine.target.variant, "max_tokens": args.max_tokens,
                       "spec": dataclasses.asdict(spec), "requests": len(workload), **extra},
            "runs": rows}, indent=2))
    if args.png:
        write_png(rows, args.png)
    return 0 if all(r["mismatches_vs_target"] == 0 for r in rows) or engine.target.variant != "fp32" else 1


def _spec(args, spec):
    import dataclasses

    if args.gamma:
        spec = dataclasses.replace(spec, gamma=args.gamma)
    if args.fixed_gamma:
        spec = dataclasses.replace(spec, adaptive=False)
    if getattr(args, "trees", None):
        spec = dataclasses.replace(spec, trees=args.trees == "on")
    return spec


__all__ = ["add_arguments", "run_bench", "load_workload", "run", "summarize_runs", "MemspecError"]
