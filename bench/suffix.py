"""The suffix draft against prompt lookup and target-only on workloads that repeat themselves.

    python bench/suffix.py [--model smollm2-135m] [--variant q4] [--reps 3] [--max-tokens 96] [--json out.json]

Each workload runs as a short session on one engine, greedy: every policy in turn runs the
same sequence of requests, the suffix draft from a fresh index (so it learns only from the
requests before, in its own run).  Workloads:

* `repeat`: the same prompt twice (a retried request, a regenerated answer); the second is reported;
* `rewrite`: a paragraph, then "rewrite it more formally" with the paragraph (and the first
  answer) given back, as an editing loop does; the second request is reported;
* `agent`: one instruction template with four different inputs (an agent loop's tool
  calls); the last three are reported.

Policies: target-only, prompt lookup and the suffix draft forced, and the daemon's default
(`scheduled`: the scheduler over the target's drafts in the store, its configured policy, a step
recalling from the suffix index where the text matches it for `[speculative] recall_tokens`) beside
the same with recall off (`scheduled, no recall`).

Per policy: decode tok/s and mean acceptance length of the reported requests, medians over
--reps rounds (the policies interleaved in each round, so machine noise hits them alike), and
whether every output equals target-only's token for token.  On a shared machine tok/s swings
with the neighbours, so a modelled speedup is shown beside it: every decode pass the target ran
priced at the engine's calibrated cost of a pass over that many tokens (what the cost controller
reads), plus the measured drafting time, against target-only's passes priced the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from memspec.config import load_config
from memspec.models.store import ModelStore
from memspec.request import GenerationRequest
from memspec.runtime.costs import COSTS, CostCache
from memspec.speculation.drafts import PROMPT_LOOKUP, PromptLookup
from memspec.runtime.target import load_target
from memspec.speculation.engine import Engine
from memspec.speculation.sources import DraftPool
from memspec.speculation.suffix import SUFFIX, SuffixDraft, SuffixIndex

PARAGRAPH = ("Our team met on Tuesday to review the launch plan. We agreed to move the release to the first week "
             "of March, because the payment service still fails under load. Maria will own the load tests, and "
             "Ken will update the customers who asked for early access.")
TOOL = "Extract the city and the date from this message and answer as JSON with keys city and date: {}"
MESSAGES = ["I will be in Paris on 3 May for the conference.", "Meet me in Berlin, 12 June, at the station.",
            "The Lisbon office opens on 1 September.", "We land in Tokyo on 20 October, late evening."]


def workloads(first_answer) -> dict[str, tuple[list[str], int]]:
    """{name: (prompts in order, how many of the last ones are reported)}; `first_answer(prompt)`:
    the target's answer, for the editing loop that sends it back."""
    ask = f"Summarize this note in two sentences:\n\n{PARAGRAPH}"
    edit = (f"Here is a note:\n\n{PARAGRAPH}\n\nAnd its summary:\n\n{first_answer(ask)}\n\n"
            f"Rewrite the summary more formally, keeping every fact.")
    return {
        "repeat": (["Write a Python function that returns the n-th Fibonacci number, with a docstring."] * 2, 1),
        "rewrite": ([ask, edit], 1),
        "agent": ([TOOL.format(m) for m in MESSAGES], 3),
    }


class PricedPasses:
    """The target's session, pricing each decode pass at the calibrated cost of its width: a
    request's first pass (its prefill) is not counted."""

    def __init__(self, session, cost_s: list[float]):
        self._session, self.cost_s = session, cost_s
        self.passes: list[int] = []  # tokens of each pass since the last reset()

    def __getattr__(self, name):
        return getattr(self._session, name)

    def forward(self, cache, ids, keep=1):
        self.passes.append(len(ids))
        return self._session.forward(cache, ids, keep=keep)

    def reset(self) -> None:
        self.passes = []

    def decode_s(self) -> float:
        return sum(self.cost_s[n] for n in self.passes[1:])


SCHEDULED = "scheduled"  # the daemon's default: the scheduler over the store's drafts, recalling from its suffix index
NO_RECALL = "scheduled, no recall"  # ... with [speculative] recall_tokens = 0


def pool(policy: str, vocab: int, suffix_bytes: int, scheduler=None):
    """A fresh draft source for one policy's run of a workload (the suffix draft: an empty index);
    `scheduler(recall_tokens)` makes the scheduled ones."""
    if policy in (SCHEDULED, NO_RECALL):
        return scheduler(None if policy == SCHEDULED else 0)
    if policy == SUFFIX:
        return DraftPool({SUFFIX: SuffixDraft(SuffixIndex(suffix_bytes), vocab)}, default=SUFFIX)
    if policy == PROMPT_LOOKUP:
        return DraftPool({PROMPT_LOOKUP: PromptLookup(vocab)}, default=PROMPT_LOOKUP)
    return DraftPool()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="memspec config (default: built-in defaults)")
    ap.add_argument("--model", help="target (default: the config's)")
    ap.add_argument("--variant", help="variant (default: the config's)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", help="write the rows as JSON")
    args = ap.parse_args()
    config = load_config(args.config)
    store = ModelStore(config.store_home)
    target = load_target(store, args.model or config.model.target, args.variant or config.model.variant,
                         config.runtime)
    engine = Engine(target, config.limits, spec=config.speculative, costs=CostCache(store.home / COSTS))
    cost_s = engine.calibrate()  # the cost controller's table: measured (or read from the store) before any timing
    vocab, suffix_bytes = target.session.vocab_size, max(config.speculative.suffix_mb, 1) << 20
    priced = target.session = PricedPasses(target.session, cost_s)
    modelled: dict[int, float] = {}  # id(completion) -> its modelled decode seconds

    def run(prompt: str):
        priced.reset()
        c = engine.generate(GenerationRequest(prompt=prompt, max_tokens=args.max_tokens))
        modelled[id(c)] = priced.decode_s() + c.stats.draft_ms / 1e3
        return c

    def scheduler(recall_tokens: int | None):
        from memspec.scheduling.scheduler import from_store

        extra = {} if recall_tokens is None else {"recall_tokens": recall_tokens}
        return from_store(config.scheduler, store, target, config.runtime, config.speculative.draft_limits(),
                          suffix_bytes=suffix_bytes, **extra)

    work = workloads(lambda p: run(p).text)
    policies = ["target-only", PROMPT_LOOKUP, SUFFIX, SCHEDULED, NO_RECALL]
    tps: dict = {(w, p): [] for w in work for p in policies}
    acc: dict = {(w, p): [] for w in work for p in policies}
    exact: dict = {(w, p): True for w in work for p in policies}
    model: dict = {(w, p): [] for w in work for p in policies}  # modelled decode seconds a token
    base: dict = {}
    for rep in range(args.reps):
        for w, (prompts, reported) in work.items():
            for p in policies:
                engine.drafts = pool(p, vocab, suffix_bytes, scheduler)
                try:
                    outs = [run(q) for q in prompts]
                finally:
                    engine.drafts.close()
                    engine.drafts = DraftPool()
                for i, c in enumerate(outs):
                    exact[(w, p)] &= c.token_ids == base.setdefault((w, i), c.token_ids)
                shown = outs[-reported:]
                tokens = sum(len(c.token_ids) - 1 for c in shown)  # decode: after the first token
                seconds = sum(c.timings.decode_ms for c in shown) / 1e3
                tps[(w, p)].append(tokens / seconds)
                model[(w, p)].append(sum(modelled[id(c)] for c in shown) / tokens)
                acc[(w, p)].append(statistics.mean(c.stats.mean_acceptance_length for c in shown))
                print(f"[{rep + 1}/{args.reps}] {w:<8} {p:<20} {tps[(w, p)][-1]:6.1f} tok/s  "
                      f"accept len {acc[(w, p)][-1]:.2f}", file=sys.stderr, flush=True)
    rows = []
    print(f"\n{target.name} ({target.variant}), {args.max_tokens} tokens max, median of {args.reps}")
    print(f"{'workload':<9} {'policy':<20} {'tok/s':>7} {'speedup':>8} {'modelled':>9} {'accept len':>10} {'exact':>6}")
    for w in work:
        for p in policies:
            r = {"workload": w, "policy": p, "tok_per_s": round(statistics.median(tps[(w, p)]), 1),
                 "mean_acceptance_length": round(statistics.median(acc[(w, p)]), 2), "exact": exact[(w, p)]}
            r["speedup"] = round(r["tok_per_s"] / statistics.median(tps[(w, "target-only")]), 2)
            r["modelled_speedup"] = round(statistics.median(model[(w, "target-only")]) /
                                          statistics.median(model[(w, p)]), 2)
            rows.append(r)
            print(f"{w:<9} {p:<20} {r['tok_per_s']:>7.1f} {r['speedup']:>7.2f}x {r['modelled_speedup']:>8.2f}x "
                  f"{r['mean_acceptance_length']:>10.2f} {str(r['exact']):>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": target.name, "variant": target.variant, "max_tokens": args.max_tokens,
                       "reps": args.reps, "rows": rows}, f, indent=2)
    engine.close()
    return 0 if all(r["exact"] for r in rows) or target.variant != "fp32" else 1


if __name__ == "__main__":
    sys.exit(main())
