"""`memspec profile`: run every draft fixed (and target-only) on a calibration set and record traces.

Greedy speculative decoding is lossless, so every policy commits the same
tokens: position p of one draft's run is position p of every other's.  Each
request's decode is cut into segments of N committed tokens, and for each
segment and policy the trace holds what the predictor learns from:

    tokens, steps, seconds (draft + verify), drafted, accepted, entropy

plus the context at the segment's start (position, the generated tail, an
open code block).  A step belongs to the segment its first committed token
falls in.  With the fp32 target every policy's output is identical; the 4-bit
target's logits differ slightly between a one-token and a k-token forward, so
near-ties (top-2 logit gaps of ~0.1) can flip and a run diverge from
target-only.  That is recorded (`mismatch_at` per request, `aligned: false`
on the segments from there on); those segments still measure the draft at
that position on text of the same kind, so training keeps them.

One JSON line per request (format "memspec-trace", version 1); policies run
interleaved per prompt, in a rotating order, so machine noise hits all alike.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memspec.speculation.drafts import PROMPT_LOOKUP, Proposal
from memspec.speculation.logits import IDENTITY
from memspec.scheduling.features import TAIL_CHARS, generation_context, request_text
from memspec.speculation.metrics import SpecMetrics
from memspec.scheduling.predictor import NONE
from memspec.request import GenerationRequest, SamplingParams, unknown_draft
from memspec.speculation.speculative import speculative_steps
from memspec.training.predictor_fit import TRACE_FORMAT

TRACE_VERSION = 1


@dataclass(frozen=True)
class ProfileConfig:
    """What one profiling run measures."""

    max_tokens: int = 128  # new tokens per request (the first comes from the prefill)
    segment_tokens: int = 16  # committed tokens per segment
    tail_chars: int = TAIL_CHARS  # generated text kept as context at each segment start


class _Recorder:
    """Selector for one fixed policy that keeps each proposal's entropies (None = target-only)."""

    def __init__(self, name: str | None, state):
        self.name, self.state = name, state
        self.entropy: list[float] = []

    def __call__(self, context, metrics):
        return (self.name, self) if self.state is not None else (None, None)

    def propose(self, context, k, params, rng, shaper=IDENTITY) -> Proposal:
        prop = self.state.propose(context, k, params, rng, shaper)
        self.entropy = prop.entropy
        return prop

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


class _StepLog(SpecMetrics):
    """SpecMetrics that also keeps every step: [drafted, accepted, committed, seconds, mean entropy]."""

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder
        self.steps: list[list] = []

    def record_step(self, draft_name, n_drafted, n_accepted, n_committed, draft_s, verify_s) -> None:
        super().record_step(draft_name, n_drafted, n_accepted, n_committed, draft_s, verify_s)
        ent = self.recorder.entropy if draft_name != PROMPT_LOOKUP else []  # prompt lookup has no distribution
        self.steps.append([n_drafted, n_accepted, n_committed, draft_s + verify_s,
                           float(np.mean(ent)) if n_drafted and ent else None])
        self.recorder.entropy = []


def run_policy(engine, prompt: list[int], policy: str, max_tokens: int) -> tuple[list[int], list[list]]:
    """Greedy decode with one fixed policy: (token ids, steps as [position, drafted, accepted, committed, s, H])."""
    session = engine.target.session
    cache = session.new_cache()
    state = engine.drafts[policy].begin(cache.capacity) if policy != NONE else None
    rec = _Recorder(policy if state is not None else None, state)
    log = _StepLog(rec)
    out: list[int] = []
    steps = speculative_steps(session, cache, prompt, rec, SamplingParams(), np.random.default_rng(0),
                              engine.spec, log, time.perf_counter)
    try:
        for committed in steps:
            if len(log.steps) and len(log.steps[-1]) == 5:
                log.steps[-1].insert(0, len(out))  # the step's first committed position
            for tok in committed:
                out.append(tok)
                if tok in engine.target.eos_ids or len(out) >= max_tokens:
                    return out, log.steps
    finally:
        steps.close()
        rec.close()
    return out, log.steps


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """First position where two outputs differ (None = identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _tally(steps: list[list], lo: int, hi: int, length: int) -> dict:
    """Totals of the steps that start in [lo, hi); committed tokens past `length` are not counted."""
    sel = [s for s in steps if lo <= s[0] < hi]
    ents = [s[5] for s in sel if s[5] is not None]
    return {"tokens": int(sum(min(s[3], length - s[0]) for s in sel)), "steps": len(sel),
            "seconds": float(sum(s[4] for s in sel)), "drafted": int(sum(s[1] for s in sel)),
            "accepted": int(sum(s[2] for s in sel)), "entropy": float(np.mean(ents)) if ents else None}


def _segment(run: tuple[list[int], list[list]], lo: int, hi: int, mismatch: int | None) -> dict | None:
    """One policy's tally of a segment; `aligned` = its output still equals target-only there."""
    t = _tally(run[1], lo, hi, len(run[0]))
    return dict(t, aligned=mismatch is None or mismatch >= hi) if t["steps"] else None


def profile_request(engine, item: dict, index: int, policies: list[str], cfg: ProfileConfig) -> dict:
    """Run one prompt under every policy; return its trace record."""
    req = GenerationRequest(prompt=item["prompt"], max_tokens=cfg.max_tokens)
    prompt = engine.prompt_ids(req)
    order = policies[index % len(policies):] + policies[:index % len(policies)]
    runs = {p: run_policy(engine, prompt, p, cfg.max_tokens) for p in order}
    ref = runs[NONE][0]
    L = len(ref)
    mismatch = {p: first_mismatch(ref, runs[p][0]) for p in policies}
    requests = {p: dict(_tally(runs[p][1], 1, len(runs[p][0]), len(runs[p][0])), mismatch_at=mismatch[p])
                for p in policies}
    tok = engine.target.tokenizer
    segments = []
    for lo in range(1, L, cfg.segment_tokens):
        hi = min(lo + cfg.segment_tokens, L)
        if hi - lo < cfg.segment_tokens // 4:
            break
        ctx = generation_context(tok.decode, ref[:lo], tail_chars=cfg.tail_chars)
        segments.append({
            "start": lo, "end": hi, "context": ctx.to_record(),
            "drafts": {p: _segment(runs[p], lo, hi, mismatch[p]) for p in policies},
        })
    return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "id": index, "category": item["category"],
            "prompt": item["prompt"], "prompt_text": request_text(req),
            "prompt_tokens": len(prompt), "generated": L, "target": f"{engine.target.name}:{engine.target.variant}",
            "segment_tokens": cfg.segment_tokens, "policies": policies, "requests": requests, "segments": segments}


def print_summary(traces: list[dict], out=sys.stdout) -> None:
    """Measured tok/s (and mean acceptance length) of each policy per category."""
    policies = traces[0]["policies"]
    cats = sorted({t["category"] for t in traces})
    w = max(len(p) for p in policies) + 1
    print("\nmeasured tok/s (tokens per verification step) per category", file=out)
    print(f"{'policy':<{w}}" + "".join(f"{c[:14]:>16}" for c in [*cats, "all"]), file=out)
    for p in policies:
        cells = []
        for c in [*cats, "all"]:
            ms = [t["requests"][p] for t in traces if c in ("all", t["category"])]
            tokens, secs = sum(m["tokens"] for m in ms), sum(m["seconds"] for m in ms)
            steps = sum(m["steps"] for m in ms)
            mal = tokens / steps if steps else 1.0
            cells.append(f"{tokens / secs if secs else 0:>8.1f} ({mal:.2f})")
        print(f"{p:<{w}}" + "".join(f"{c:>16}" for c in cells), file=out)
    wins: dict[str, dict[str, int]] = {}
    for t in traces:
        best = max(policies, key=lambda p: t["requests"][p]["tokens"] / max(t["requests"][p]["seconds"], 1e-9))
        wins.setdefault(t["category"], {}).setdefault(best, 0)
        wins[t["category"]][best] += 1
    print("fastest per request: " + "; ".join(f"{c}: " + ", ".join(f"{p} {n}" for p, n in sorted(
        wins[c].items(), key=lambda kv: -kv[1])) for c in cats), file=out)
    mism = {p: sum(t["requests"][p]["mismatch_at"] is not None for t in traces) for p in policies}
    print("outputs that diverged from target-only (4-bit near-ties): "
          + ", ".join(f"{p} {n}" for p, n in mism.items() if p != NONE), file=out)


# -- command line -------------------------------------------------------------------------------------
def add_profile_parser(subparsers):
    p = subparsers.add_parser("profile", help="record draft traces for `memspec train-predictor`",
                              description="Runs every draft fixed, and target-only, greedily on a calibration "
                                          "set and writes one JSON line of per-segment measurements per prompt.")
    p.add_argument("--workload", metavar="FILE", help="JSONL with prompt and category fields (default: built-in 48)")
    p.add_argument("--out", default="memspec-traces.jsonl", metavar="FILE", help="trace file (default: %(default)s)")
    p.add_argument("--drafts", help="comma-separated drafts to profile (default: every loaded draft)")
    p.add_argument("--variant", choices=("fp32", "q4"), help="target variant (default from config: q4)")
    p.add_argument("--max-tokens", type=int, default=ProfileConfig.max_tokens, help="new tokens per request")
    p.add_argument("--segment-tokens", type=int, default=ProfileConfig.segment_tokens,
                   help="committed tokens per segment")
    p.add_argument("--limit", type=int, default=0, help="only the first N prompts per category (0 = all)")
    p.set_defaults(func=run_profile)
    return p


def run_profile(args) -> int:
    from memspec.bench.policies import load_workload
    from memspec.build import build_engine
    from memspec.errors import InvalidRequestError

    if args.max_tokens < 2 or args.segment_tokens < 1:
        raise InvalidRequestError(f"--max-tokens must be at least 2 and --segment-tokens at least 1, got "
                                  f"{args.max_tokens} and {args.segment_tokens}")
    workload = load_workload(args.workload)
    if args.limit:
        kept: dict[str, list] = {}
        for w in workload:
            kept.setdefault(w["category"], []).append(w)
        workload = [w for group in kept.values() for w in group[: args.limit]]
    engine = build_engine(args.config, args.variant, drafts="pool")
    # every draft, the suffix draft too: run_policy never teaches its index (forgotten before each
    # prompt besides), so it proposes as in a daemon that has served nothing, from the request itself
    # and the target's shipped corpus, never from this prompt's answer under another policy
    names = sorted(engine.drafts) if not args.drafts else [d.strip() for d in args.drafts.split(",") if d.strip()]
    for d in names:
        if d not in engine.drafts:
            raise unknown_draft(d, engine.drafts, "--drafts")
    policies = [NONE, *names]
    cfg = ProfileConfig(args.max_tokens, args.segment_tokens)
    traces = []
    t0 = time.perf_counter()
    with open(args.out, "w") as f:
        for i, item in enumerate(workload):
            engine.drafts.forget()
            tr = profile_request(engine, item, i, policies, cfg)
            f.write(json.dumps(tr) + "\n")
            f.flush()
            traces.append(tr)
            print(f"[{i + 1}/{len(workload)}] {item['category']}: {tr['generated']} tokens, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print_summary(traces)
    print(f"\nwrote {len(traces)} requests to {args.out} ({Path(args.out).stat().st_size / 1e3:.0f} kB)")
    return 0
