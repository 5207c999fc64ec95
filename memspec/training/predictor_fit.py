"""Fitting the predictor (`memspec train-predictor`): training rows from `memspec profile` traces,
gradient-boosted trees and step costs, held-out evaluation by prompt, the report and the command.

scikit-learn is imported only when a fit runs; what a fit makes is a
memspec.scheduling.predictor.Predictor, which the scheduler loads and runs
with NumPy alone.  The traces come from memspec.training.profile.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from memspec.errors import ModelFormatError
from memspec.scheduling.features import GenerationContext, prompt_features, prompt_ngrams
from memspec.scheduling.predictor import DEFAULT_PATH, NONE, QUANTITIES, Predictor, feature_rows


# -- export of the fitted trees ---------------------------------------------------------------------
def tree_to_json(tree) -> dict:
    """One fitted scikit-learn regression tree (`estimator.tree_`) as plain lists."""
    return {"feature": tree.feature.tolist(), "threshold": tree.threshold.tolist(),
            "left": tree.children_left.tolist(), "right": tree.children_right.tolist(),
            "value": tree.value[:, 0, 0].tolist()}


def gbr_to_json(model) -> dict:
    """A fitted GradientBoostingRegressor (squared error) as {init, learning_rate, trees}."""
    init = float(model.init_.constant_.ravel()[0]) if hasattr(model.init_, "constant_") else 0.0
    return {"kind": "gbr", "init": init, "learning_rate": float(model.learning_rate),
            "trees": [tree_to_json(est[0].tree_) for est in model.estimators_]}


# -- training (scikit-learn, offline) ---------------------------------------------------------------
TRACE_FORMAT = "memspec-trace"


@dataclass(frozen=True)
class PredictorFitConfig:
    """How `train-predictor` fits (GradientBoostingRegressor settings) and evaluates."""

    n_estimators: int = 60  # trees per (draft, quantity)
    max_depth: int = 3  # levels per tree
    learning_rate: float = 0.08
    subsample: float = 0.8  # stochastic boosting: share of rows per tree
    min_samples_leaf: int = 8
    folds: int = 4  # held-out evaluation: prompts split into this many groups
    seed: int = 0


def read_traces(path) -> list[dict]:
    """The request records of a `memspec profile` JSONL file."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("format") != TRACE_FORMAT:
            raise ModelFormatError(f"{path}:{n}: not a memspec trace record (format {rec.get('format')!r})")
        out.append(rec)
    if not out:
        raise ModelFormatError(f"{path}: holds no trace records")
    return out


def replace_draft_records(base: list[dict], newer: list[dict], draft: str, where: str = "newer") -> list[dict]:
    """`base` with `draft`'s records, the request's and every segment's, taken from `newer`: traces of
    the same prompts (a draft trained again and profiled alone, `memspec profile --drafts NAME`, on
    this machine or another).  Tokens, steps, drafted and accepted carry over as they are (greedy
    verification makes them the text's, not the machine's); seconds are scaled by the request's
    target-only seconds in `base` over those in `newer`, so that they are priced against base's
    target.  Refused where a prompt is missing or its output was cut into other segments."""
    by_prompt = {t["prompt_text"]: t for t in newer}
    out = []
    for tr in base:
        other = by_prompt.get(tr["prompt_text"])
        if other is None:
            raise ModelFormatError(f"{where}: has no trace of the prompt {tr['prompt'][:80]!r}; profile the "
                                   f"same prompts (--workload) as the traces it replaces a draft in")
        if draft not in other["requests"] or NONE not in other["requests"]:
            raise ModelFormatError(f"{where}: the prompt {tr['prompt'][:80]!r} was profiled without {draft} or "
                                   f"target-only; profile it with `--drafts {draft}`")
        spans = [(s["start"], s["end"]) for s in tr["segments"]]
        theirs = [(s["start"], s["end"]) for s in other["segments"]]
        if tr.get("generated") != other.get("generated") or spans != theirs:
            raise ModelFormatError(f"{where}: the prompt {tr['prompt'][:80]!r} generated {other.get('generated')} "
                                   f"tokens in other segments than the traces it replaces a draft in "
                                   f"({tr.get('generated')}); profile with the same --max-tokens and --segment-tokens")
        scale = tr["requests"][NONE]["seconds"] / max(other["requests"][NONE]["seconds"], 1e-9)
        t = json.loads(json.dumps(tr))  # a deep copy: the caller's traces stay as they were read
        t["requests"][draft] = dict(other["requests"][draft], seconds=other["requests"][draft]["seconds"] * scale)
        for seg, their_seg in zip(t["segments"], other["segments"]):
            rec = their_seg["drafts"].get(draft)
            if rec is None:
                seg["drafts"].pop(draft, None)
            else:
                seg["drafts"][draft] = dict(rec, seconds=rec["seconds"] * scale)
        if draft not in t["policies"]:
            t["policies"] = [*t["policies"], draft]
        out.append(t)
    return out


def _rate(m: dict | None) -> tuple[float, float] | None:
    """(MAL, drafted per step) of a segment or request record; None when unmeasured."""
    if not m or not m["steps"]:
        return None
    return m["tokens"] / m["steps"], m["drafted"] / m["steps"]


def segment_context(seg: dict, prev: dict | None, current: str | None) -> GenerationContext:
    """The context at a segment's start as a scheduler running `current` since `prev` would see it:
    the text part as profiling recorded it (features.generation_context), the acceptance of the last segment."""
    acc, ent = {}, float("nan")
    last = prev["drafts"].get(current) if prev and current else None
    if last and last["drafted"]:
        acc[current] = last["accepted"] / last["drafted"]
        if last.get("entropy") is not None:
            ent = last["entropy"]
    return GenerationContext.from_record(seg["context"], acc, ent)


def training_rows(traces: list[dict], drafts: list[str]):
    """X (n, R, F), Y (n, R, 2) [MAL, drafted/step] (NaN = not measured), group (n,) = request index.

    One row per request before generation (ctx None, whole-request labels) and,
    per segment, one row for each draft that could have been running the segment
    before (only its own acceptance known), and one with nothing known.
    """
    X, Y, G = [], [], []
    for gi, tr in enumerate(traces):
        pf, grams = prompt_features(tr["prompt_text"]), prompt_ngrams(tr["prompt_text"])

        def add(ctx, labels):
            X.append(feature_rows(pf, grams, ctx, drafts))
            Y.append([_rate(labels.get(d)) or (np.nan, np.nan) for d in drafts])
            G.append(gi)

        add(None, tr["requests"])
        for s, seg in enumerate(tr["segments"]):
            prev = tr["segments"][s - 1] if s else None
            currents = [None] + ([d for d in tr["policies"] if d != NONE] if prev else [])
            for cur in currents:
                add(segment_context(seg, prev, cur), seg["drafts"])
    return np.asarray(X), np.asarray(Y, dtype=np.float64), np.asarray(G)


def fit_costs(traces: list[dict], policies: list[str]) -> dict[str, dict]:
    """Per policy: seconds per step = step_s + per_draft_token_s * drafted per step (robust least squares).

    First segments are left out: they hold the draft's one-time prefill of the prompt.
    """
    costs = {}
    for d in policies:
        segs = [seg["drafts"][d] for tr in traces for seg in tr["segments"][1:] if seg["drafts"].get(d)]
        segs = [m for m in segs if m["steps"]]
        if not segs:
            raise ModelFormatError(f"traces: no measured segments for {d!r}")
        x = np.asarray([m["drafted"] / m["steps"] for m in segs])
        y = np.asarray([m["seconds"] / m["steps"] for m in segs])
        w = np.sqrt([m["steps"] for m in segs])
        keep = np.ones(len(y), bool)
        for _ in range(3):  # drop machine hiccups: residuals beyond 3 MADs, then refit
            A = np.stack([np.ones(keep.sum()), x[keep]], 1) if d != NONE else np.ones((keep.sum(), 1))
            coef = np.linalg.lstsq(A * w[keep, None], y[keep] * w[keep], rcond=None)[0]
            pred = coef[0] + (coef[1] * x if d != NONE else 0.0)
            res = y - pred
            mad = np.median(np.abs(res[keep] - np.median(res[keep]))) + 1e-9
            keep = np.abs(res) <= 3 * 1.4826 * mad
        a, b = float(coef[0]), float(coef[1]) if d != NONE else 0.0
        if b < 0 or a < 0:  # drafted/step barely varies (or noise tilts the line): a flat cost per step instead
            a, b = float(np.average(y[keep], weights=w[keep] ** 2)), 0.0
        costs[d] = {"step_s": max(a, 1e-5), "per_draft_token_s": b}
    return costs


def fit(traces: list[dict], cfg: PredictorFitConfig = PredictorFitConfig(), info: dict | None = None) -> Predictor:
    """Fit ensembles and costs on traces; the result is built from its own JSON (what `load` would see)."""
    from sklearn.ensemble import GradientBoostingRegressor

    policies = list(traces[0]["policies"])
    drafts = [d for d in policies if d != NONE]
    X, Y, _ = training_rows(traces, drafts)
    ensembles: dict[str, dict] = {}
    for r, d in enumerate(drafts):
        for qi, q in enumerate(QUANTITIES):
            ok = ~np.isnan(Y[:, r, qi])
            model = GradientBoostingRegressor(
                n_estimators=cfg.n_estimators, max_depth=cfg.max_depth, learning_rate=cfg.learning_rate,
                subsample=cfg.subsample, min_samples_leaf=cfg.min_samples_leaf, random_state=cfg.seed)
            model.fit(X[ok, r], Y[ok, r, qi])
            ensembles.setdefault(d, {})[q] = gbr_to_json(model)
    pred = Predictor(tuple(policies), fit_costs(traces, policies), ensembles, info)
    return Predictor.from_json(json.loads(json.dumps(pred.to_json())))


# -- held-out evaluation ----------------------------------------------------------------------------
def _measured(m: dict | None) -> float | None:
    return m["tokens"] / m["seconds"] if m and m["steps"] and m["seconds"] > 0 else None


def _modeled(m: dict, cost: dict) -> float:
    """tok/s of a record under the fitted step costs: its acceptance, without its timing noise."""
    return m["tokens"] / (m["steps"] * cost["step_s"] + m["drafted"] * cost["per_draft_token_s"])


def _outcome(choice: str, records: dict[str, dict], pred: Predictor, single: str, aligned: bool) -> dict:
    tps = {d: _measured(m) for d, m in records.items()}
    tps = {d: v for d, v in tps.items() if v is not None}
    best = max(tps, key=tps.__getitem__)
    modeled = {d: _modeled(records[d], pred.costs[d]) for d in tps}
    best_modeled = max(modeled, key=modeled.__getitem__)
    return {"choice": choice, "best": best, "hit": choice == best, "aligned": aligned,
            "hit_modeled": choice == best_modeled, "single_hit": single == best,
            "single_hit_modeled": single == best_modeled,
            "tps": tps[choice], "best_tps": tps[best], "single_tps": tps[single],
            "mean_tps": float(np.mean(list(tps.values()))),
            "modeled_regret": modeled[best_modeled] - modeled[choice],
            "single_modeled_regret": modeled[best_modeled] - modeled[single]}


def evaluate_choices(pred: Predictor, traces: list[dict], single_best: str) -> dict[str, list]:
    """Outcomes per request (choice from the prompt alone) and per segment (closed loop: the draft chosen
    for the last segment reports its acceptance), and the replayed segment-by-segment totals."""
    out: dict[str, list] = {"request": [], "segment": [], "sim": []}
    rng = np.random.default_rng(0)
    for tr in traces:
        recs = {d: m for d, m in tr["requests"].items() if d in pred.drafts and _measured(m) is not None}
        scores = pred.predict(tr["prompt_text"])
        aligned = all(m.get("mismatch_at") is None for m in recs.values())
        out["request"].append(_outcome(max(recs, key=scores.__getitem__), recs, pred, single_best, aligned))
        cur, sim = None, {"pred": [0, 0.0], "fixed": [0, 0.0], "oracle": [0, 0.0], "random": [0, 0.0]}
        for s, seg in enumerate(tr["segments"]):
            scores = pred.predict(tr["prompt_text"], segment_context(seg, tr["segments"][s - 1] if s else None, cur))
            cur = max(pred.drafts, key=scores.__getitem__)
            recs = {d: m for d, m in seg["drafts"].items() if d in pred.drafts and _measured(m) is not None}
            if cur not in recs or single_best not in recs:
                continue  # not measured here (that run ended sooner: its output diverged from target-only)
            o = _outcome(cur, recs, pred, single_best, all(m.get("aligned", True) for m in recs.values()))
            out["segment"].append(o)
            for key, d in (("pred", cur), ("fixed", single_best), ("oracle", o["best"]),
                           ("random", list(recs)[rng.integers(len(recs))])):
                sim[key][0] += recs[d]["tokens"]
                sim[key][1] += recs[d]["seconds"]
        out["sim"].append(sim)
    return out


def single_best_policy(traces: list[dict], policies) -> str:
    """The policy with the highest total measured throughput over these requests."""
    tot = {d: [0, 0.0] for d in policies}
    for tr in traces:
        for d in policies:
            m = tr["requests"].get(d)
            if m:
                tot[d][0] += m["tokens"]
                tot[d][1] += m["seconds"]
    return max(policies, key=lambda d: tot[d][0] / tot[d][1] if tot[d][1] else 0.0)


def prior_values(traces: list[dict], policies) -> dict[str, float]:
    """Each draft's worth before any request is seen: the tok/s over target-only it measured on the
    requests it was the fastest for, averaged over all requests (0.0 for one never fastest).  What
    memspec's working set is filled by at start, per byte, before the first prompt says more."""
    gain = {d: 0.0 for d in policies if d != NONE}
    for tr in traces:
        rates = {d: _measured(tr["requests"].get(d)) for d in policies}
        rates = {d: r for d, r in rates.items() if r is not None}
        if not rates:
            continue
        best = max(rates, key=rates.get)
        if best != NONE and NONE in rates:
            gain[best] += rates[best] - rates[NONE]
    return {d: round(g / max(len(traces), 1), 4) for d, g in gain.items()}


MARGINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)  # candidate margins over the default policy


def cross_validate(traces: list[dict], cfg: PredictorFitConfig, margins=MARGINS) -> dict[float, dict]:
    """Held out by prompt: each fold's predictor never saw the prompts it is scored on.
    One summary per candidate margin (each fold's default: its training folds' single best)."""
    order = np.random.default_rng(cfg.seed).permutation(len(traces))
    folds = [order[i::cfg.folds] for i in range(cfg.folds)]
    merged: dict[float, dict[str, list]] = {m: {"request": [], "segment": [], "sim": []} for m in margins}
    singles = []
    for test in folds:
        train = [traces[i] for i in order if i not in set(test)]
        pred = fit(train, cfg)
        single = single_best_policy(train, pred.drafts)
        singles.append(single)
        pred.default = single
        for m in margins:
            pred.margin = m
            for k, v in evaluate_choices(pred, [traces[i] for i in test], single).items():
                merged[m][k] += v
    return {m: summarize_choices(ev, singles) for m, ev in merged.items()}


def pick_margin(results: dict[float, dict]) -> float:
    """The margin with the least held-out regret per request under the cost model (measured acceptance
    at the fitted step costs: on a shared machine one timing per prompt is mostly noise); ties: smaller."""
    return min(results, key=lambda m: (round(results[m]["request"]["regret_modeled_tok_s"], 6), m))


def summarize_choices(ev: dict[str, list], singles: list[str]) -> dict:
    res = {"single_best": sorted(set(singles))}
    for level in ("request", "segment"):
        rows = ev[level]
        col = {k: np.asarray([r[k] for r in rows]) for k in rows[0]}
        al = col["aligned"]
        res[level] = {
            "n": len(rows), "aligned": int(al.sum()), "accuracy": float(col["hit"].mean()),
            "accuracy_aligned": float(col["hit"][al].mean()) if al.any() else None,
            "accuracy_modeled": float(col["hit_modeled"].mean()),
            "accuracy_single_best": float(col["single_hit"].mean()),
            "accuracy_single_best_modeled": float(col["single_hit_modeled"].mean()),
            "regret_tok_s": float(np.mean(col["best_tps"] - col["tps"])),
            "regret_single_best_tok_s": float(np.mean(col["best_tps"] - col["single_tps"])),
            "regret_random_tok_s": float(np.mean(col["best_tps"] - col["mean_tps"])),
            "regret_modeled_tok_s": float(np.mean(col["modeled_regret"])),
            "regret_single_best_modeled_tok_s": float(np.mean(col["single_modeled_regret"])),
            "best_tok_s": float(col["best_tps"].mean()),
            "chosen": {str(d): int((col["choice"] == d).sum()) for d in sorted(set(col["choice"]))},
            "best": {str(d): int((col["best"] == d).sum()) for d in sorted(set(col["best"]))},
        }
    tot = {k: [sum(s[k][0] for s in ev["sim"]), sum(s[k][1] for s in ev["sim"])] for k in ev["sim"][0]}
    res["simulated_tok_s"] = {k: v[0] / v[1] for k, v in tot.items() if v[1]}
    return res


def print_report(res: dict, n_requests: int, cfg: PredictorFitConfig, out=sys.stdout, held_out: bool = True) -> None:
    if held_out:
        print(f"held out by prompt: {cfg.folds} folds over {n_requests} prompts; "
              f"single best draft of the training folds: {', '.join(res['single_best'])}", file=out)
    else:
        print(f"{n_requests} prompts; single best draft of the training traces: {', '.join(res['single_best'])}",
              file=out)
    print(f"{'level':<9} {'n':>5} {'choice=best':>11} {'(cost model)':>12} {'regret tok/s: predictor':>24} "
          f"{'single-best':>11} {'random':>7} {'(best tok/s)':>12}", file=out)
    for level in ("request", "segment"):
        r = res[level]
        print(f"{level:<9} {r['n']:>5} {r['accuracy']:>11.0%} {r['accuracy_modeled']:>12.0%} "
              f"{r['regret_tok_s']:>24.2f} {r['regret_single_best_tok_s']:>11.2f} {r['regret_random_tok_s']:>7.2f} "
              f"{r['best_tok_s']:>12.1f}", file=out)
    for level in ("request", "segment"):
        r = res[level]
        print(f"{level}: chosen {r['chosen']}; measured best {r['best']}; the single best draft was the best "
              f"{r['accuracy_single_best']:.0%} ({r['accuracy_single_best_modeled']:.0%} by cost model)", file=out)
        if r["aligned"] < r["n"] and r["accuracy_aligned"] is not None:
            print(f"{level}: {r['aligned']} of {r['n']} with every output identical to target-only; "
                  f"choice=best on those {r['accuracy_aligned']:.0%}", file=out)
    s = res["simulated_tok_s"]
    print("(cost model) = choice was the best by measured acceptance under the fitted step costs (no timing noise)",
          file=out)
    print("segment-by-segment switching replayed from the traces (draft switch cost not counted): "
          + ", ".join(f"{k} {v:.1f} tok/s" for k, v in s.items()), file=out)


def measure_latency(pred: Predictor, prompt_text: str, n: int = 2000) -> dict[str, float]:
    """Median microseconds of predict(): first call (prompt features computed) and later calls (cached)."""
    import time

    ctx = GenerationContext(64, {pred.drafts[-1]: 0.6}, 1.2, False, "def f(x):\n    return x + 1\n")
    t = []
    for i in range(n):
        text = prompt_text if i % 2 else f"{prompt_text} {i}"
        t0 = time.perf_counter()
        pred.predict(text, ctx)
        t.append((time.perf_counter() - t0) * 1e6)
    t = np.asarray(t)
    return {"uncached_us": float(np.median(t[0::2])), "cached_us": float(np.median(t[1::2]))}


# -- command line -------------------------------------------------------------------------------------
def add_train_predictor_parser(subparsers):
    p = subparsers.add_parser("train-predictor", help="fit the draft predictor on `memspec profile` traces",
                              description="Fits one gradient-boosted tree ensemble per (draft, MAL | drafted/step) "
                                          "and per-draft step costs, prints held-out accuracy and regret "
                                          "(split by prompt), and saves JSON.")
    p.add_argument("--traces", required=True, metavar="FILE", help="JSONL written by `memspec profile`")
    p.add_argument("--out", default=str(DEFAULT_PATH), metavar="FILE", help="where to save (default: %(default)s)")
    p.add_argument("--folds", type=int, default=PredictorFitConfig.folds, help="held-out folds (0 = skip evaluation)")
    p.add_argument("--test-traces", metavar="FILE",
                   help="traces of other prompts (say `memspec profile --workload bench/heldout_mixed.jsonl`) to "
                        "score the fitted predictor on; none of their prompts may be in --traces")
    p.add_argument("--replace", action="append", default=[], metavar="DRAFT=FILE",
                   help="take DRAFT's records from FILE, traces of the same prompts (a draft trained again, "
                        "`memspec profile --drafts DRAFT`, on any machine), seconds scaled by target-only's "
                        "in each; repeatable")
    p.add_argument("--trees", type=int, default=PredictorFitConfig.n_estimators, help="trees per ensemble")
    p.add_argument("--seed", type=int, default=PredictorFitConfig.seed)
    p.set_defaults(func=run_train_predictor)
    return p


def run_train_predictor(args) -> int:
    import datetime

    import sklearn

    traces = read_traces(args.traces)
    replaced = {}
    for spec in args.replace:
        draft, sep, file = spec.partition("=")
        if not sep or not draft or not file:
            raise ModelFormatError(f"--replace takes DRAFT=FILE, got {spec!r}")
        traces = replace_draft_records(traces, read_traces(file), draft, f"--replace {spec}")
        replaced[draft] = Path(file).name
    tests = read_traces(args.test_traces) if args.test_traces else None
    if tests:
        seen = {t["prompt_text"] for t in traces}
        shared = [t["prompt"] for t in tests if t["prompt_text"] in seen]
        if shared:
            raise ModelFormatError(f"--test-traces: {len(shared)} of its prompts are in --traces too, so they are "
                                   f"not held out (the first: {shared[0][:80]!r})")
        lacking = sorted({d for t in tests for d in traces[0]["policies"] if d not in t["policies"]})
        if lacking:
            raise ModelFormatError(f"--test-traces: profiled without {', '.join(lacking)}, which --traces has; "
                                   f"profile them with the same drafts")
    if args.folds and not 2 <= args.folds <= len(traces):
        raise ModelFormatError(f"--folds must be 0 or 2..{len(traces)} (the number of prompts), got {args.folds}")
    cfg = PredictorFitConfig(n_estimators=args.trees, folds=args.folds or PredictorFitConfig.folds, seed=args.seed)
    by_margin = cross_validate(traces, cfg) if args.folds else None
    margin, held_out = 0.0, None
    if by_margin:
        print("margin over the default policy: held-out choice=best (measured, cost model) and regret tok/s "
              "(measured, cost model) per request")
        for m, r in by_margin.items():
            q = r["request"]
            print(f"  {m:>4.2f}: {q['accuracy']:.0%}, {q['accuracy_modeled']:.0%}; "
                  f"{q['regret_tok_s']:.2f}, {q['regret_modeled_tok_s']:.2f}")
        margin = pick_margin(by_margin)
        held_out = {**by_margin[margin], "margin": margin,
                    "by_margin": {str(m): {k: r["request"][k] for k in ("accuracy", "accuracy_modeled",
                                                                        "regret_tok_s", "regret_modeled_tok_s")}
                                  for m, r in by_margin.items()}}
        print(f"chosen margin {margin:.2f} (the least regret; chosen on these same held-out folds)")
        print_report(held_out, len(traces), cfg)
    info = {"traces": Path(args.traces).name, **({"replaced": replaced} if replaced else {}), "requests": len(traces),
            "segments": sum(len(t["segments"]) for t in traces), "target": traces[0].get("target"),
            "trained": datetime.date.today().isoformat(), "sklearn": sklearn.__version__,
            "config": asdict(cfg), "held_out": held_out,
            "prior": prior_values(traces, traces[0]["policies"])}
    pred = fit(traces, cfg, info)
    pred.default, pred.margin = single_best_policy(traces, pred.drafts), margin  # as cross_validate sets them
    if tests:
        test = summarize_choices(evaluate_choices(pred, tests, pred.default), [pred.default])
        pred.info["test"] = {"traces": Path(args.test_traces).name, "requests": len(tests), **test}
        print(f"\non {len(tests)} prompts of {args.test_traces} (none of them in --traces), with the predictor fitted "
              f"on all {len(traces)}:")
        print_report(test, len(tests), cfg, held_out=False)
    pred.save(args.out)
    lat = measure_latency(pred, traces[0]["prompt_text"])
    print(f"saved {args.out} ({Path(args.out).stat().st_size / 1e3:.0f} kB): {', '.join(pred.drafts)}; "
          f"predict() {lat['cached_us']:.0f} us (prompt cached), {lat['uncached_us']:.0f} us (new prompt)")
    return 0
