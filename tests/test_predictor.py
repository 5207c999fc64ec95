"""The predictor: features on literal prompts, exact JSON export of the trees, refusal of bad files,
training on synthetic traces, and the shipped models/predictor.json.  No model runs here."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from memspec.scheduling import features as F
from memspec.errors import ModelFormatError
from memspec.scheduling.predictor import DEFAULT_PATH, FEATURES, NONE, Forest, Predictor
from memspec.training.predictor_fit import (PredictorFitConfig, cross_validate, fit, gbr_to_json, measure_latency,
                                            pick_margin, segment_context)
from memspec.training.profile import _tally, first_mismatch
from memspec.models.store import SHIPPED_MODELS

CODE = "Write a Python function `merge(a, b)` that merges two sorted lists:\n\n    def merge(a, b):\n        pass"
PROSE = "Tell me about the history of the city of Rome and why people still visit it today."
MATH = "A shop sells pencils at 3 for 45 cents. How much do 12 pencils cost? Calculate step by step: 12 / 3 * 45 = ?"
REWRITE = ("Rewrite this paragraph in the passive voice: The committee approved the budget. The manager "
           "announced the decision. The staff celebrated the news.")


def feat(text: str) -> dict[str, float]:
    return dict(zip(F.PROMPT_FEATURES, F.prompt_features(text)))


SPECIAL = 0  # the one special token of `decode`


def decode(ids, *, skip_special_tokens=False) -> str:
    """A tiny detokenizer (features.Detokenize): id 0 is <|im_end|>, any other id n is the character chr(n)."""
    return "".join("<|im_end|>" if i == SPECIAL else chr(i) for i in ids if not (skip_special_tokens and i == SPECIAL))


def tokens(text: str) -> list[int]:
    """The ids `decode` turns into `text`, one per character."""
    return [ord(c) for c in text]


def context(text: str, acceptance=None, entropy=float("nan")) -> F.GenerationContext:
    """The predictor's context after generating `text` (one token per character)."""
    return F.generation_context(decode, tokens(text), acceptance, entropy)


# -- features -------------------------------------------------------------------------------------------
def test_feature_vectors_have_the_declared_lengths():
    assert F.prompt_features("").shape == (len(F.PROMPT_FEATURES),)
    assert F.prompt_features(CODE).dtype == np.float64
    assert F.context_features(None).shape == (len(F.CONTEXT_FEATURES),)
    ctx = F.GenerationContext(10, {"draft-code": 0.5}, 1.0, True, "x = 1")
    assert F.context_features(ctx).shape == (len(F.CONTEXT_FEATURES),)
    assert np.isfinite(F.prompt_features("ünïcödé ✓ — 你好\n\t{}")).all()


def test_code_prompt_looks_like_code():
    code, prose = feat(CODE), feat(PROSE)
    for name in ("code_intent", "code_keywords", "indented_lines", "frac_bracket"):
        assert code[name] > prose[name], name


def test_math_prompt_has_numbers_and_math_words():
    m, prose = feat(MATH), feat(PROSE)
    for name in ("numbers", "math_words", "frac_digit", "frac_operator"):
        assert m[name] > prose[name], name


def test_rewriting_prompt_is_likely_to_copy():
    r, prose = feat(REWRITE), feat(PROSE)
    assert r["copy_verbs"] > prose["copy_verbs"] and r["copy_verb_first"] == 1.0 and prose["copy_verb_first"] == 0.0
    assert r["given_text_frac"] > 0.5 > prose["given_text_frac"]
    assert feat('Translate to French: "The cat sleeps on the warm mat all day long."')["quoted_frac"] > 0.5
    assert feat('Convert to JSON:\n- name: a\n- size: 2')["structured_markers"] > 0


def test_chat_structure_and_repetition():
    chat = F.chat_text([("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Why?")])
    c = feat(chat)
    assert c["chat_turns"] == 4 and c["has_system"] == 1.0
    assert feat(PROSE)["chat_turns"] == 0 and feat(PROSE)["has_system"] == 0.0
    assert feat("the cat sat " * 20)["bigram_repeat"] > 0.8 > feat(PROSE)["bigram_repeat"]


def test_context_features():
    none = dict(zip(F.CONTEXT_FEATURES, F.context_features(None)))
    assert none["has_context"] == 0 and none["acc:draft-code"] == F.UNKNOWN and none["draft_entropy"] == F.UNKNOWN
    text = "Sure:\n```python\ndef f(x):\n    return x\n"
    ctx = context(text, {"draft-code": 0.75})
    c = dict(zip(F.CONTEXT_FEATURES, F.context_features(ctx)))
    assert c["in_code_block"] == 1.0 and c["acc:draft-code"] == 0.75 and c["acc:draft-math"] == F.UNKNOWN
    assert c["acc_max"] == 0.75 and c["tail_indented"] > 0
    assert c["log_position"] == pytest.approx(np.log1p(len(text)))  # one token per character
    assert not context("```py\nx\n```\n").in_code_block
    grams = F.prompt_ngrams(REWRITE)
    copying = F.overlap_features(grams, context("The budget was approved by the committee."))
    echoing = F.overlap_features(grams, context("the manager announced the decision and"))
    assert echoing[0] > copying[0] == 0.0


def test_generation_context_reads_every_generated_token_without_special_tokens():
    """The one rule of the predictor's context, which profiling, training rows and the scheduler share."""
    text = "Here it is:\n```python\n" + "x = x + 1\n" * 40  # the fence opens long before the tail
    ids = [SPECIAL, *tokens(text), SPECIAL]
    ctx = F.generation_context(decode, ids, {"draft-code": 0.5}, 0.7, tail_chars=50)
    assert ctx.position == len(ids)  # generated tokens, special ones included
    assert ctx.generated_tail == text[-50:]  # the last tail_chars characters, special tokens skipped
    assert "```" not in ctx.generated_tail and ctx.in_code_block  # decided over all the text, not the tail
    assert ctx.recent_acceptance == {"draft-code": 0.5} and ctx.draft_entropy == 0.7
    closed = "```py\nx\n```\n" + "y" * 300
    assert not F.generation_context(decode, tokens(closed), tail_chars=50).in_code_block
    assert F.generation_context(decode, tokens(closed)).generated_tail == closed[-F.TAIL_CHARS:]


def test_training_rows_see_the_context_profiling_recorded():
    """A trace keeps the text part of the context (to_record); a training row gets it back with the
    acceptance of the draft that ran the segment before, as the scheduler would have built it."""
    ids = tokens("Sure:\n```python\ndef f(x):\n")
    seg = {"context": F.generation_context(decode, ids).to_record(), "drafts": {}}
    prev = {"drafts": {"draft-code": {"drafted": 8, "accepted": 6, "entropy": 0.4}}}
    assert segment_context(seg, prev, "draft-code") == F.generation_context(decode, ids, {"draft-code": 0.75}, 0.4)
    first = segment_context(seg, None, None)  # the first segment: nothing ran before
    assert (first.position, first.in_code_block, first.generated_tail, first.recent_acceptance) == \
        (len(ids), True, "Sure:\n```python\ndef f(x):\n", {})


# -- exact export of the trees -----------------------------------------------------------------------------
def _gbr(seed=0, n_features=len(FEATURES)):
    from sklearn.ensemble import GradientBoostingRegressor

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(300, n_features))
    X[:, 3] = rng.integers(0, 3, 300)  # ties and thresholds on integer features too
    y = X[:, 0] * 2 + np.where(X[:, 3] > 1, 1.5, 0) + rng.normal(0, 0.1, 300)
    m = GradientBoostingRegressor(n_estimators=40, max_depth=3, learning_rate=0.1, subsample=0.8,
                                  min_samples_leaf=3, random_state=seed).fit(X, y)
    return m, rng.normal(size=(200, n_features)) * 1.3


def test_json_trees_predict_exactly_what_sklearn_predicts():
    m1, X = _gbr(0)
    m2, _ = _gbr(1)
    forest = Forest.from_json(json.loads(json.dumps([gbr_to_json(m1), gbr_to_json(m2)])), len(FEATURES))
    got = forest.predict(np.stack([X, X[::-1]], axis=1), np.array([0, 1]))  # ensemble 1 reads row 1
    assert np.array_equal(got[:, 0], m1.predict(X))
    assert np.array_equal(got[:, 1], m2.predict(X[::-1]))


def _synthetic_traces(n_per_kind: int = 8) -> list[dict]:
    """Traces where draft-code wins on code, prompt-lookup on rewriting, target-only on chit-chat."""
    kinds = {  # kind -> (prompt, {policy: tokens per step}, drafted per step)
        "code": ("Write a Python function that {t}.", {"prompt-lookup": 1.1, "draft-code": 3.2}, 4.0),
        "rewrite": ("Rewrite in simple words: The {t} was approved by the committee after a long debate.",
                    {"prompt-lookup": 2.6, "draft-code": 1.2}, 3.0),
        "chat": ("Tell me something nice about {t}.", {"prompt-lookup": 1.0, "draft-code": 1.05}, 2.0),
    }
    cost = {NONE: (0.010, 0.0), "prompt-lookup": (0.0105, 0.0003), "draft-code": (0.011, 0.002)}
    topics = ["lists", "strings", "budget", "numbers", "files", "trees", "graphs", "dates", "money", "words"]
    rng = np.random.default_rng(0)
    traces = []
    for kind, (tmpl, mal, dps) in kinds.items():
        for i in range(n_per_kind):
            def rec(p, steps=8):
                m = 1.0 if p == NONE else mal[p] * rng.uniform(0.9, 1.1)
                d = 0.0 if p == NONE else dps
                tokens = int(round(m * steps))
                a, b = cost[p]
                return {"tokens": tokens, "steps": steps, "seconds": steps * (a + b * d) * rng.uniform(0.95, 1.05),
                        "drafted": int(d * steps), "accepted": max(tokens - steps, 0), "entropy": None,
                        "aligned": True}
            policies = [NONE, "prompt-lookup", "draft-code"]
            segs = [{"start": 1 + 16 * s, "end": 17 + 16 * s,
                     "context": {"position": 1 + 16 * s, "in_code_block": kind == "code", "generated_tail": "x"},
                     "drafts": {p: rec(p) for p in policies}} for s in range(4)]
            req = {p: dict(rec(p, 32), mismatch_at=None) for p in policies}
            traces.append({"format": "memspec-trace", "version": 1, "id": len(traces), "category": kind,
                           "prompt": tmpl.format(t=topics[i]), "prompt_text": tmpl.format(t=topics[i]),
                           "policies": policies, "requests": req, "segments": segs})
    return traces


@pytest.fixture(scope="module")
def synthetic():
    traces = _synthetic_traces()
    return traces, fit(traces, PredictorFitConfig(n_estimators=30, learning_rate=0.2, min_samples_leaf=3))


def test_trained_predictor_picks_the_right_draft(synthetic):
    _, pred = synthetic
    assert pred.drafts == (NONE, "prompt-lookup", "draft-code")
    assert pred.best("Write a Python function that sorts a dict.") == "draft-code"
    assert pred.best("Rewrite in simple words: The plan was approved by the committee after a long debate.") \
        == "prompt-lookup"
    assert pred.best("Tell me something nice about cats.") == NONE
    assert pred.costs[NONE]["step_s"] == pytest.approx(0.010, rel=0.05)
    assert pred.costs["draft-code"]["per_draft_token_s"] == pytest.approx(0.002, rel=0.3)


def test_cross_validation_reports_accuracy_and_regret(synthetic):
    traces, _ = synthetic
    by_margin = cross_validate(traces, PredictorFitConfig(n_estimators=20, learning_rate=0.2, min_samples_leaf=3, folds=3),
                               margins=(0.0, 0.1, 1e9))
    res = by_margin[0.0]
    assert res["request"]["n"] == len(traces) and res["segment"]["n"] == 4 * len(traces)
    assert res["request"]["accuracy"] > 0.8
    assert res["request"]["regret_tok_s"] < res["request"]["regret_random_tok_s"]
    # a huge margin always picks the default: the single best policy's accuracy and regret
    big = by_margin[1e9]["request"]
    assert big["accuracy"] == pytest.approx(big["accuracy_single_best"])
    assert big["regret_tok_s"] == pytest.approx(big["regret_single_best_tok_s"])
    # here the trees are right, so no margin is chosen
    assert pick_margin(by_margin) == 0.0


def test_margin_keeps_the_default_unless_another_is_predicted_faster_by_that_much(synthetic):
    _, pred = synthetic
    prompt = "Write a Python function that sorts a dict."
    raw = pred.predict(prompt)
    assert pred.best(prompt) == "draft-code"
    biased = Predictor(pred.drafts, pred.costs, pred.ensembles, pred.info, "prompt-lookup", 0.25)
    got = biased.predict(prompt)
    assert got["prompt-lookup"] == pytest.approx(raw["prompt-lookup"])
    assert got["draft-code"] == pytest.approx(raw["draft-code"] / 1.25)
    lead = raw["draft-code"] / raw["prompt-lookup"] - 1  # how much faster draft-code is predicted
    under = Predictor(pred.drafts, pred.costs, pred.ensembles, pred.info, "prompt-lookup", lead * 0.99)
    over = Predictor(pred.drafts, pred.costs, pred.ensembles, pred.info, "prompt-lookup", lead * 1.01)
    assert (under.best(prompt), over.best(prompt)) == ("draft-code", "prompt-lookup")
    with pytest.raises(ModelFormatError, match="default 'nope'"):
        Predictor(pred.drafts, pred.costs, pred.ensembles, pred.info, "nope", 0.1)


def test_rate_prices_measured_quantities_as_predict_prices_its_own(synthetic):
    """The switcher weighs a request's measured tokens and draft tokens a step against the other
    drafts' predictions: Predictor.rate must price them as predict() does (step costs, margin)."""
    _, pred = synthetic
    prompt = "Rewrite in simple words: The plan was approved by the committee after a long debate."
    for margin in (0.0, 0.25):
        p = Predictor(pred.drafts, pred.costs, pred.ensembles, pred.info, "prompt-lookup", margin)
        mal, drafted = p.quantities(p.inputs(prompt)[None])
        got = p.predict(prompt)
        for i, d in enumerate(d for d in p.drafts if d != NONE):
            assert p.rate(d, float(mal[0, i]), float(drafted[0, i])) == pytest.approx(got[d])
    c = pred.costs["draft-code"]
    assert pred.rate("draft-code", 3.0, 2.0) == pytest.approx(3.0 / (c["step_s"] + 2.0 * c["per_draft_token_s"]))


def test_a_draft_that_drafts_nothing_is_priced_as_target_only():
    """The profile's steps draft one token or more, so a draft's fitted line holds from there; at no
    draft token a step it is target-only's step, not the line run down to zero: SmolLM2's shipped line
    for draft-code meets zero at 0.76 of target-only's step, and a draft its cost controller had
    stopped (mostly plain steps, a probe now and then) was priced 1.3x target-only, so the switcher
    went back to drafts that had failed (issue 67: advice at 0.91x).  Between 0 and 1 token a step the
    price runs straight from one to the other; from 1 on, the line as before."""
    from memspec.models.store import SHIPPED_MODELS

    pred = Predictor.load(SHIPPED_MODELS / "predictor-smollm2-135m-gguf.json")
    none = 1.0 / pred.costs[NONE]["step_s"]
    for d in (d for d in pred.drafts if d != NONE):
        c = pred.costs[d]
        one = c["step_s"] + c["per_draft_token_s"]
        assert pred.rate(d, 1.0, 0.0) == pytest.approx(none), d
        assert pred.rate(d, 1.0, 0.25) == pytest.approx(1.0 / (0.75 / none + 0.25 * one)), d
        assert pred.rate(d, 2.0, 3.0) == pytest.approx(2.0 / (c["step_s"] + 3.0 * c["per_draft_token_s"])), d
    code = pred.costs["draft-code"]
    assert code["step_s"] < 0.8 * pred.costs[NONE]["step_s"]  # the fitted line's intercept the rule corrects


def test_save_load_round_trip_predicts_identically(synthetic, tmp_path):
    _, pred = synthetic
    pred.save(tmp_path / "p.json")
    again = Predictor.load(tmp_path / "p.json")
    ctx = context("def f(x):\n    return", {"draft-code": 0.8}, entropy=0.7)
    for prompt, c in ((CODE, None), (REWRITE, ctx), (PROSE, ctx)):
        assert again.predict(prompt, c) == pred.predict(prompt, c)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(format="something-else"), "not a memspec predictor"),
    (lambda d: d.update(version=99), "version 99 is not supported"),
    (lambda d: d.update(features=d["features"][:-1]), "different feature set"),
    (lambda d: d["ensembles"]["draft-code"]["mal"]["trees"][0]["left"].pop(), "different lengths"),
    (lambda d: d["ensembles"]["draft-code"]["mal"]["trees"][0]["feature"].__setitem__(0, 10_000), "outside"),
    (lambda d: d["ensembles"]["draft-code"]["mal"]["trees"][0]["right"].__setitem__(0, 0), "out of order"),
    (lambda d: d["ensembles"].pop("draft-code"), "incomplete model"),
    (lambda d: d["costs"][NONE].update(step_s=-1), "malformed predictor"),
    (lambda d: d.pop("costs"), "malformed predictor"),
])
def test_load_refuses_bad_files(synthetic, tmp_path, change, message):
    _, pred = synthetic
    data = json.loads(json.dumps(pred.to_json()))
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ModelFormatError, match=message):
        Predictor.load(path)


def test_load_refuses_non_json_and_missing_files(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="is not JSON"):
        Predictor.load(tmp_path / "x.json")
    with pytest.raises(ModelFormatError, match="cannot read predictor"):
        Predictor.load(tmp_path / "missing.json")


# -- profile helpers -----------------------------------------------------------------------------------------
def test_profile_tallies_and_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2, 3], [1, 2]) == 2
    steps = [[1, 4, 2, 3, 0.02, 0.5], [4, 4, 4, 5, 0.03, 0.4], [9, 2, 0, 1, 0.01, None]]
    t = _tally(steps, 1, 9, length=12)
    assert t == {"tokens": 8, "steps": 2, "seconds": pytest.approx(0.05), "drafted": 8, "accepted": 6,
                 "entropy": pytest.approx(0.45)}
    assert _tally(steps, 9, 20, length=10)["tokens"] == 1  # committed tokens past the end are not counted


# -- the shipped predictor -------------------------------------------------------------------------------------
@pytest.mark.parametrize("file,target,variant", [("predictor.json", "smollm2-135m", "q4"),
                                                ("predictor-fp32.json", "smollm2-135m", "fp32"),
                                                ("predictor-qwen2.5-coder-1.5b-q4.json", "qwen2.5-coder-1.5b", "q4"),
                                                ("predictor-smollm2-135m-gguf.json", "smollm2-135m", "gguf"),
                                                ("predictor-qwen2.5-coder-1.5b-gguf.json", "qwen2.5-coder-1.5b", "gguf")])
def test_shipped_predictor_scores_every_shipped_draft(file, target, variant):
    """One predictor per target and variant ships, each fitted on traces of that target's pool."""
    pred = Predictor.load(SHIPPED_MODELS / file)
    assert pred.info["target"] == f"{target}:{variant}"
    assert (SHIPPED_MODELS / pred.info["traces"]).is_file()  # the traces it was fitted on ship beside it
    manifests = [json.loads(p.read_text()) for p in SHIPPED_MODELS.glob("*/manifest.json")]
    shipped = {m["name"] for m in manifests if m.get("role") == "draft" and m["extra"].get("target") == target}
    assert shipped, "no drafts in models/"
    assert shipped | {NONE, "prompt-lookup"} <= set(pred.drafts)
    for prompt in (CODE, PROSE, MATH, REWRITE):
        for ctx in (None, context("Here is the code:\n```python\n", {"draft-code": 0.6}, entropy=1.0)):
            scores = pred.predict(prompt, ctx)
            assert set(scores) == set(pred.drafts)
            assert all(np.isfinite(v) and v > 0 for v in scores.values())


def test_the_native_targets_stand_in_predictor_says_how_to_fit_its_own(caplog, monkeypatch, tmp_path):
    """A target with only a q4 predictor: the native engine runs it as "gguf" and takes the q4 one, the
    nearest; the warning names `memspec profile` (it once named `--variant gguf`, which profile refuses)."""
    import shutil

    from memspec.models import store
    from memspec.scheduling.policies import load_predictor

    shutil.copy(SHIPPED_MODELS / "predictor-qwen2.5-coder-1.5b-q4.json", tmp_path)
    monkeypatch.setattr(store, "SHIPPED_MODELS", tmp_path)  # as shipped before the 1.5B's own gguf one
    with caplog.at_level("WARNING", logger="memspec.scheduling.policies"):
        pred = load_predictor("", "gguf", "qwen2.5-coder-1.5b")
    assert pred is not None and pred.info["target"] == "qwen2.5-coder-1.5b:q4"
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "runs as gguf" in said and "(memspec profile, then memspec train-predictor)" in said, said


def test_a_target_profiled_on_the_native_engine_takes_its_own_predictor_without_a_warning(caplog):
    """SmolLM2 ships a predictor fitted on traces of its native engine (memspec profile on the
    default backend): the native target loads that one, with its own step costs, and says nothing."""
    from memspec.scheduling.policies import load_predictor

    with caplog.at_level("WARNING", logger="memspec.scheduling.policies"):
        pred = load_predictor("", "gguf", "smollm2-135m")
    assert pred is not None and pred.info["target"] == "smollm2-135m:gguf"
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert {"none", "prompt-lookup", "draft-code", "draft-math"} <= set(pred.drafts)


def test_prediction_cost_benchmark(synthetic, capsys):
    """A benchmark, not a timing assertion: prints how long predict() and the features take."""
    pred = Predictor.load(DEFAULT_PATH) if DEFAULT_PATH.is_file() else synthetic[1]
    long_prompt = (REWRITE + " " + CODE + " " + MATH + " ") * 6
    lat = measure_latency(pred, long_prompt[:2000], n=400)
    t0 = time.perf_counter()
    for _ in range(200):
        F.prompt_features(long_prompt[:2000])
    feat_us = (time.perf_counter() - t0) / 200 * 1e6
    with capsys.disabled():
        print(f"\npredict(): {lat['cached_us']:.0f} us with the prompt cached, {lat['uncached_us']:.0f} us for a "
              f"new 2k-char prompt; prompt_features(2k chars) {feat_us:.0f} us ({len(pred.drafts)} policies)")


@pytest.mark.slow
def test_profile_one_short_request_on_the_real_target(model_store):
    """Segments of every policy line up with target-only's, and a trace record makes training rows."""
    from memspec.config import Config
    from memspec.build import build_engine
    from memspec.speculation.drafts import PromptLookup
    from memspec.speculation.sources import DraftPool
    from memspec.training.predictor_fit import training_rows
    from memspec.training.profile import ProfileConfig, profile_request

    engine = build_engine(Config(), drafts="none")
    engine.drafts = DraftPool({"prompt-lookup": PromptLookup(engine.target.session.vocab_size)})
    item = {"prompt": "Repeat exactly: one two three four five six seven eight", "category": "rewriting"}
    tr = profile_request(engine, item, 0, [NONE, "prompt-lookup"], ProfileConfig(max_tokens=20, segment_tokens=6))
    assert tr["policies"] == [NONE, "prompt-lookup"] and tr["requests"][NONE]["mismatch_at"] is None
    starts = [s["start"] for s in tr["segments"]]
    assert starts and starts == list(range(1, 1 + 6 * len(starts), 6))
    for seg in tr["segments"]:
        none = seg["drafts"][NONE]
        assert none["steps"] == none["tokens"] == seg["end"] - seg["start"] and none["drafted"] == 0
    pl = tr["requests"]["prompt-lookup"]
    assert pl["drafted"] >= pl["accepted"] >= 0 and pl["entropy"] is None
    X, Y, G = training_rows([tr], ["prompt-lookup"])
    assert X.shape[1:] == (1, len(FEATURES)) and Y.shape[1:] == (1, 2) and len(X) == len(G)


def test_the_suffix_draft_is_profiled_from_its_corpus_and_the_request_never_from_another_run(model_store):
    """The predictor must know the suffix draft (it is the draft that pays on a small target), traced
    as a daemon that has served nothing runs it: its index learns no policy's run of the prompt."""
    from memspec.config import Config
    from memspec.build import build_engine
    from memspec.speculation.sources import DraftPool
    from memspec.speculation.suffix import SuffixDraft, SuffixIndex, corpus_index
    from memspec.training.profile import ProfileConfig, profile_request

    engine = build_engine(Config(), drafts="none")
    vocab = engine.target.session.vocab_size
    suffix = SuffixDraft(SuffixIndex(1 << 16), vocab, corpus=corpus_index([np.arange(100, 140)]))
    engine.drafts = DraftPool({"suffix": suffix})
    item = {"prompt": "Repeat exactly: one two three four five six seven eight", "category": "rewriting"}
    tr = profile_request(engine, item, 0, [NONE, "suffix"], ProfileConfig(max_tokens=16, segment_tokens=8))
    assert tr["requests"]["suffix"]["mismatch_at"] is None and tr["requests"]["suffix"]["drafted"] > 0
    assert suffix.index.stats.added == 0 and suffix.corpus.sequences == 1


def test_train_predictor_saves_the_chosen_default_and_margin(tmp_path, capsys):
    """`memspec train-predictor` stores the single best policy as the default and the held-out margin."""
    import argparse

    from memspec.training.predictor_fit import (add_train_predictor_parser, prior_values, run_train_predictor,
                                                single_best_policy)

    traces = _synthetic_traces(6)
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in traces))
    parser = argparse.ArgumentParser()
    add_train_predictor_parser(parser.add_subparsers())
    args = parser.parse_args(["train-predictor", "--traces", str(path), "--out", str(tmp_path / "p.json"),
                              "--folds", "3", "--trees", "20"])
    assert run_train_predictor(args) == 0
    chosen = float(re.search(r"chosen margin ([\d.]+)", capsys.readouterr().out)[1])
    pred = Predictor.load(tmp_path / "p.json")
    assert pred.default == single_best_policy(traces, pred.drafts)
    assert pred.margin == pytest.approx(chosen) and pred.info["held_out"]["margin"] == pred.margin
    # the prior it records is what memspec fills its working set by at start
    assert pred.prior() == {d: v for d, v in prior_values(traces, pred.drafts).items() if v > 0}
    assert set(pred.prior()) == {"draft-code", "prompt-lookup"}  # target-only wins chit-chat: none for it


def test_a_draft_profiled_again_replaces_its_records_priced_against_the_base_target():
    from memspec.training.predictor_fit import replace_draft_records

    base = _synthetic_traces(2)
    newer = json.loads(json.dumps(base))
    for t in newer:  # a slower machine (target-only twice as long) and a better draft-code
        t["requests"][NONE]["seconds"] *= 2
        t["requests"]["draft-code"].update(tokens=31, steps=7, seconds=9.0)
        for seg in t["segments"]:
            seg["drafts"]["draft-code"].update(steps=3, accepted=13, seconds=1.0)
        del t["requests"]["prompt-lookup"]
    kept = json.dumps(base)
    out = replace_draft_records(base, newer, "draft-code")
    assert json.dumps(base) == kept  # the traces read are left as they were
    for t, b in zip(out, base):
        code = t["requests"]["draft-code"]
        assert (code["tokens"], code["steps"]) == (31, 7) and code["seconds"] == pytest.approx(4.5)
        assert all(s["drafts"]["draft-code"]["seconds"] == pytest.approx(0.5) and
                   s["drafts"]["draft-code"]["accepted"] == 13 for s in t["segments"])
        assert t["requests"]["prompt-lookup"] == b["requests"]["prompt-lookup"]  # the others as they were
        assert t["requests"][NONE] == b["requests"][NONE]

    with pytest.raises(ModelFormatError, match="has no trace of the prompt"):
        replace_draft_records(base, newer[1:], "draft-code")
    with pytest.raises(ModelFormatError, match="without prompt-lookup"):
        replace_draft_records(base, newer, "prompt-lookup")
    cut = json.loads(json.dumps(newer))
    cut[0]["segments"] = cut[0]["segments"][:2]
    with pytest.raises(ModelFormatError, match="other segments"):
        replace_draft_records(base, cut, "draft-code")


def test_train_predictor_replace_takes_a_drafts_records_from_other_traces(tmp_path, capsys):
    import argparse

    from memspec.training.predictor_fit import add_train_predictor_parser, run_train_predictor

    traces = _synthetic_traces(4)
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    newer = json.loads(json.dumps(traces))
    for t in newer:
        for seg in t["segments"]:
            seg["drafts"]["draft-code"].update(tokens=seg["drafts"]["draft-code"]["steps"])  # accepts nothing now
        t["requests"]["draft-code"].update(tokens=t["requests"]["draft-code"]["steps"])
    (tmp_path / "n.jsonl").write_text("".join(json.dumps(t) + "\n" for t in newer))
    parser = argparse.ArgumentParser()
    add_train_predictor_parser(parser.add_subparsers())

    def train(*extra):
        return run_train_predictor(parser.parse_args(["train-predictor", "--traces", str(tmp_path / "t.jsonl"),
                                                      "--out", str(tmp_path / "p.json"), "--folds", "0",
                                                      "--trees", "20", *extra]))

    assert train() == 0 and Predictor.load(tmp_path / "p.json").best("Write a Python function that sorts.") \
        == "draft-code"
    assert train("--replace", f"draft-code={tmp_path / 'n.jsonl'}") == 0
    pred = Predictor.load(tmp_path / "p.json")
    assert pred.info["replaced"] == {"draft-code": "n.jsonl"}
    assert pred.best("Write a Python function that sorts.") != "draft-code"  # its new records say it loses
    with pytest.raises(ModelFormatError, match="--replace takes DRAFT=FILE"):
        train("--replace", "draft-code")


def test_the_prior_is_what_each_draft_added_where_it_was_fastest():
    from memspec.training.predictor_fit import prior_values

    def trace(rates):
        return {"requests": {p: {"tokens": int(r * 10), "steps": 10, "seconds": 10.0} for p, r in rates.items()}}

    traces = [trace({NONE: 10, "a": 14, "b": 12}),  # a fastest: +4
              trace({NONE: 10, "a": 11, "b": 19}),  # b fastest: +9
              trace({NONE: 10, "a": 9, "b": 8}),  # target-only fastest: nobody's
              trace({NONE: 10, "a": 20, "b": 10})]  # a: +10
    assert prior_values(traces, [NONE, "a", "b"]) == {"a": pytest.approx(14 / 4), "b": pytest.approx(9 / 4)}
    pred = Predictor.__new__(Predictor)  # prior() reads the info alone
    pred._modeled, pred.info = ["a", "b"], {"prior": {"a": 3.5, "b": "x", "c": 9.0, "none": 1.0}}
    assert pred.prior() == {"a": 3.5}  # a bad value and drafts it does not model are dropped
    pred.info = {}
    assert pred.prior() == {}  # fitted before priors were recorded


def test_train_predictor_scores_itself_on_test_traces_of_other_prompts(tmp_path, capsys):
    """--test-traces: the fitted predictor's choices on prompts it never saw, kept in its record;
    a test file that shares a prompt with the training one is refused."""
    import argparse

    from memspec.errors import ModelFormatError
    from memspec.training.predictor_fit import add_train_predictor_parser, run_train_predictor

    traces = _synthetic_traces(10)
    train = [t for i, t in enumerate(traces) if i % 10 < 6]  # topics 0-5 of each kind
    test = [t for i, t in enumerate(traces) if i % 10 >= 6]  # topics 6-9: other prompts
    for name, rows in (("train", train), ("test", test)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in rows))
    parser = argparse.ArgumentParser()
    add_train_predictor_parser(parser.add_subparsers())

    def run(test_file):
        return run_train_predictor(parser.parse_args([
            "train-predictor", "--traces", str(tmp_path / "train.jsonl"), "--out", str(tmp_path / "p.json"),
            "--folds", "0", "--trees", "20", "--test-traces", str(tmp_path / test_file)]))

    assert run("test.jsonl") == 0
    assert f"on {len(test)} prompts of" in capsys.readouterr().out
    got = Predictor.load(tmp_path / "p.json").info["test"]
    assert got["traces"] == "test.jsonl" and got["requests"] == got["request"]["n"] == len(test)
    assert got["request"]["accuracy_modeled"] > got["request"]["accuracy_single_best_modeled"]  # it tells kinds apart
    assert got["request"]["regret_modeled_tok_s"] < got["request"]["regret_single_best_modeled_tok_s"]
    with pytest.raises(ModelFormatError, match="not held out"):
        run("train.jsonl")
    for t in test:
        t["policies"] = [p for p in t["policies"] if p != "draft-code"]
    (tmp_path / "fewer.jsonl").write_text("".join(json.dumps(t) + "\n" for t in test))
    with pytest.raises(ModelFormatError, match="profiled without draft-code"):
        run("fewer.jsonl")


def test_each_shipped_target_gets_its_own_predictor_naming_its_own_drafts():
    """The 1.5B's predictor is chosen for it, and scores the 1.5B's pool; SmolLM2 keeps its own."""
    from memspec.scheduling.policies import predictor_file

    qwen = predictor_file("", "q4", "qwen2.5-coder-1.5b")
    assert qwen == SHIPPED_MODELS / "predictor-qwen2.5-coder-1.5b-q4.json"
    p = Predictor.load(qwen)
    assert p.info["target"] == "qwen2.5-coder-1.5b:q4"
    assert {"qwen2.5-coder-draft-code", "qwen2.5-coder-draft-math", "qwen2.5-coder-0.5b-draft",
            "prompt-lookup"} <= set(p.drafts)
    assert predictor_file("", "q4", "smollm2-135m") == SHIPPED_MODELS / "predictor.json"
    assert predictor_file("", "fp32", "smollm2-135m") == SHIPPED_MODELS / "predictor-fp32.json"
    # the native engine runs the targets as "gguf": each ships a predictor profiled on it (a target with
    # only a q4 one takes that, the nearest: test_the_native_targets_stand_in_predictor_says_how_to_fit_its_own)
    own = SHIPPED_MODELS / "predictor-qwen2.5-coder-1.5b-gguf.json"
    assert predictor_file("", "gguf", "qwen2.5-coder-1.5b") == own
    assert predictor_file("", "gguf", "smollm2-135m") == SHIPPED_MODELS / "predictor-smollm2-135m-gguf.json"
    scores = p.predict("Write a Python function that merges two sorted lists.")
    assert set(scores) == set(p.drafts) and all(v > 0 for v in scores.values())
