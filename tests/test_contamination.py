"""bench/everyday.jsonl: prompts no draft and no predictor was trained near, checked here.

Every prompt any shipped draft or predictor learned from is gathered from where it comes from, and
none may share NGRAM (8) words in a row with a prompt of the workload (numbers read as one word,
case and punctuation ignored: memspec.training.prompts.ngrams):

* each draft's data sets, as its manifest records them (provenance.data: domain, seed), and each
  suffix draft corpus's prompts, as its file records them (models/corpus-*.npz): a built-in
  domain's prompts are drawn again from its generator (memspec.training.prompts), every draw
  domain_prompts could have made for that seed, so the near-copy filter and earlier seeds' prompts
  are no help to a prompt that slipped in; a --prompts file must ship in the checkout (or be one of
  UNSHIPPED, which says why it cannot be read);
* the generators' own string pieces (templates, lists, passages, the write-prompts tasks), so a
  run of words split across two drawn pieces is the only kind the draws must find;
* each predictor's traces (the file its record names), and the calibration sets they are profiled
  on: the built-in 48, bench/fresh_profile.jsonl and bench/profile_kinds.jsonl (the everyday
  workload's kinds, written apart from it).

The generators have changed since some drafts were trained; what is checked is what they draw now.
"""

from __future__ import annotations

import ast
import json
import random
import shlex
from collections import Counter
from pathlib import Path

from memspec.bench.policies import load_workload
from memspec.speculation.corpus import Corpus
from memspec.training.prompts import _MAKERS, DOMAINS, NGRAM, copied_runs, ngrams

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "bench" / "everyday.jsonl"
KINDS = ("code-edit", "explain-error", "sql", "shell", "extract", "summarize", "email", "translate", "math", "poem",
         "advice", "rewrite")
# --prompts files a shipped draft was trained on that are not in the checkout
UNSHIPPED = {
    "prompts-self-0": "qwen2.5-coder-draft-chat's 673 prompts the 1.5B wrote itself (memspec write-prompts, sampled); "
                      "the file was not kept. Its passage tasks are checked as write-prompts' own pieces.",
}
GENERATOR_MODULES = ("memspec/training/prompts.py", "memspec/training/self_instruct.py")


def test_the_copy_check_flags_a_copied_run_of_words_and_nothing_shorter():
    """The checker on literal strings: a benchmark prompt with a training prompt pasted into it is
    found whatever the case, punctuation and numbers around it; seven shared words in a row are not
    a copy, nor are the same words in another order."""
    bench = ["Can you fix this?\n\ndef area(w, h):\n    return w * h * 2  # should be the area of a rectangle"]
    copied = "Please explain: DEF AREA(w, h): return w*h*3 -- should be the area!"
    hits = copied_runs(bench, [("pool", copied)])
    assert hits and hits[0][:2] == ("pool", copied)
    assert hits[0][3] == "def area w h return w h #"
    seven = "I said: times two, it should be the area of a rectangle"  # "should be the area of a rectangle": 7
    reordered = "rectangle a of area the be should h w area def"
    assert copied_runs(bench, [("pool", seven), ("pool", reordered)]) == []
    assert len(ngrams("one two three four five six seven")) == 0 and NGRAM == 8


def test_the_everyday_workload_holds_every_kind_of_request_with_its_input():
    work = load_workload(str(WORKLOAD))
    kinds = Counter(w["category"] for w in work)
    assert len(work) >= 48 and set(kinds) == set(KINDS) and min(kinds.values()) >= 4, kinds
    assert len({w["prompt"] for w in work}) == len(work)
    # the inputs to copy from: code, tracebacks, schemas, messages and paragraphs
    with_input = [w for w in work if "\n" in w["prompt"] or "(" in w["prompt"] or '"' in w["prompt"]]
    for kind in ("code-edit", "explain-error", "sql", "extract", "summarize", "rewrite"):
        assert all(w in with_input for w in work if w["category"] == kind), kind


def _draft_streams() -> tuple[dict[tuple[str, int], int], list[tuple[str, str]]]:
    """{(domain, seed): prompts asked for} over every shipped draft's built-in data sets, and
    (source, prompt) for its --prompts files."""
    streams: dict[tuple[str, int], int] = {}
    files: list[tuple[str, str]] = []
    manifests = sorted(ROOT.glob("models/*/manifest.json"))
    assert len(manifests) >= 8, manifests
    for path in manifests:
        record = json.loads(path.read_text())
        if record.get("role") not in (None, "draft"):
            continue
        provenance = record["provenance"]
        assert provenance.get("data"), f"{path}: no record of the data it was trained on"
        command = shlex.split(provenance["command"])
        asked = int(command[command.index("--n-prompts") + 1]) if "--n-prompts" in command else 256
        for key, info in provenance["data"].items():
            if info["domain"] in DOMAINS:
                k = (info["domain"], info["seed"])
                streams[k] = max(streams.get(k, 0), asked, info["prompts"])
            elif key in UNSHIPPED:
                continue
            else:
                name = key.removeprefix("prompts-")
                found = [p for p in ROOT.rglob(f"{name}.jsonl") if ".git" not in p.parts]
                assert found, f"{path.parent.name} was trained on --prompts {name}.jsonl, which is not in the checkout"
                files += [(f"{path.parent.name}: {found[0].name}", w["prompt"]) for w in load_workload(str(found[0]))]
    for path in sorted(ROOT.glob("models/corpus-*.npz")):  # the suffix draft's corpora: answers to drawn prompts
        meta = Corpus.load(path).meta
        for domain in meta["domains"]:
            assert domain in DOMAINS, f"{path.name}: answers to prompts of {domain!r}, which no generator draws"
            k = (domain, meta["seed"])
            streams[k] = max(streams.get(k, 0), meta["per_domain"])
    return streams, files


def _drawn(domain: str, seed: int, n: int) -> set[str]:
    """Every prompt domain_prompts(domain, n, seed) could have drawn: it draws at most 50 n."""
    rng = random.Random(f"{domain}-{seed}")
    return {_MAKERS[domain](rng) for _ in range(50 * n)}


def _pieces(module: str) -> list[str]:
    """The string constants of a generator module (f-strings' literal parts too), docstrings left out."""
    tree = ast.parse((ROOT / module).read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def _predictor_prompts() -> list[tuple[str, str]]:
    out = []
    predictors = sorted(ROOT.glob("models/predictor*.json"))
    assert predictors
    for path in predictors:
        traces = path.parent / json.loads(path.read_text())["info"]["traces"]
        assert traces.is_file(), f"{path.name} was fitted on {traces.name}, which is not in the checkout"
        for line in traces.read_text().splitlines():
            if line.strip():
                t = json.loads(line)
                out += [(traces.name, t[k]) for k in ("prompt", "prompt_text") if k in t]
    calibration = [("built-in bench_prompts.jsonl", w["prompt"]) for w in load_workload(None)]
    fit = [(f"bench/{name}", w["prompt"]) for name in ("fresh_profile.jsonl", "profile_kinds.jsonl")
           for w in load_workload(str(ROOT / "bench" / name))]
    return out + calibration + fit


def test_no_draft_or_predictor_was_trained_on_a_prompt_near_the_everyday_workload():
    bench = [w["prompt"] for w in load_workload(str(WORKLOAD))]
    streams, files = _draft_streams()
    assert {d for d, _ in streams} == set(DOMAINS)  # every generator is drawn from
    training = [(f"{d} seed {s}", p) for (d, s), n in sorted(streams.items()) for p in _drawn(d, s, n)]
    training += files + [(m, p) for m in GENERATOR_MODULES for p in _pieces(m)] + _predictor_prompts()
    assert len(training) > 100_000
    hits = copied_runs(bench, training)
    assert not hits, "\n".join(f"{src}: {p[:80]!r} shares {run!r} with {b[:60]!r}" for src, p, b, run in hits[:20])
