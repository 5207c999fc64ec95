"""The benchmark: its default memory budget (room for at most half the drafts, whichever they
are), the stream benchmark end to end, ep_check, and bench/engines.py (memspec side by side with
onnxruntime-genai and llama.cpp)."""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import os

import pytest

from memspec.bench.policies import default_budget_mb, draft_room, spread
from memspec.errors import InvalidRequestError

MiB = 1 << 20


def test_draft_room_holds_at_most_half_the_drafts_in_any_combination():
    sizes = {"code": 31 * MiB, "math": 31 * MiB, "chat": 31 * MiB, "general": 65 * MiB, "prompt-lookup": 0}
    room = draft_room(sizes)
    assert room == 65 * MiB  # the largest alone, or two of the specialists
    models = [b for b in sizes.values() if b]
    for k in range(1, len(models) + 1):
        fits = [c for c in itertools.combinations(models, k) if sum(c) <= room]
        assert bool(fits) == (k <= len(models) // 2), k
    assert draft_room({"a": 10 * MiB, "prompt-lookup": 0}) == 10 * MiB  # one draft: it fits
    assert draft_room({"prompt-lookup": 0}) == 0


def test_draft_room_leaves_the_largest_draft_room_beside_what_the_scheduler_holds_for_good():
    """The suffix draft's index is held for good: without room for it beside the largest draft, the
    largest never loads (a regression: the 0.5B sibling drafted for no request under fixed:)."""
    sizes = {"sibling": 280 * MiB, "code": 16 * MiB, "math": 16 * MiB, "chat": 16 * MiB, "suffix": 4 * MiB,
             "prompt-lookup": 0}
    assert draft_room(sizes) == 280 * MiB  # the largest alone: not with the suffix index beside it
    room = draft_room(sizes, held=("suffix",))
    assert room == 284 * MiB and room - sizes["suffix"] >= sizes["sibling"]
    assert room - sizes["suffix"] == draft_room({n: b for n, b in sizes.items() if n != "suffix"})  # as before
    assert draft_room({"suffix": 4 * MiB}, held=("suffix",)) == 4 * MiB
    assert default_budget_mb(300 * MiB, 10 * MiB, sizes, held=("suffix",)) == 300 + 10 + 284


def test_all_among_other_policies_is_target_only_and_every_draft_fixed_in_its_place(model_store):
    """`--policies all,bandit,memspec` ran nothing: 'all' was known only alone (a regression)."""
    from memspec.bench.policies import expand_all
    from memspec.config import Config
    from memspec.scheduling.scheduler import draft_names

    config = Config()
    got = expand_all(["bandit", "all", "memspec", "target-only"], config)
    drafts = draft_names(model_store, config.model.target, suffix=False, session_config=config.runtime)
    assert got == ["bandit", "target-only", *(f"fixed:{d}" for d in sorted(drafts)), "memspec"]
    assert "fixed:prompt-lookup" in got and not any("suffix" in p for p in got)


def test_default_budget_adds_the_process_and_one_request_and_rounds_up():
    sizes = {"a": 30 * MiB, "b": 40 * MiB}
    assert default_budget_mb(300 * MiB, 10 * MiB + 1, sizes) == 300 + 11 + 40


def test_rounds_run_forward_then_backward():
    from memspec.bench.policies import round_order

    assert round_order(["a", "b", "c"], 1) == [(0, "a"), (0, "b"), (0, "c")]
    assert [p for _, p in round_order(["a", "b"], 3)] == ["a", "b", "b", "a", "a", "b"]


def test_stream_ratios_over_rounds_are_the_medians_of_each_rounds_ratio():
    """A machine that slows down between rounds: each round's ratio holds, the pooled tok/s' would not."""
    from memspec.bench.policies import PolicyRun, Tally, stream_rows
    from memspec.runtime.memory import MiB

    runs = {p: PolicyRun() for p in ("target-only", "bandit", "memspec", "oracle")}
    for p, rates in {"target-only": (20, 10, 10), "bandit": (30, 15, 12), "memspec": (40, 18, 20),
                     "oracle": (44, 20, 20)}.items():
        for i, v in enumerate(rates):
            runs[p].add_round(100 * MiB * (i + 1), {"stalls": 1, "stall_ms": 2.0, "loads": 3,
                                                    "prediction_mean_rel_error": 0.5}, float(v))
    cells = {}
    for p, run_ in runs.items():
        t = Tally(requests=3, tokens=int(sum(run_.round_tok_per_s)), seconds=3.0)
        cells[(p, "code")] = t
    rows = {r["policy"]: r for r in stream_rows(cells, runs, list(runs), 500) if r["category"] == "all"}
    assert rows["memspec"]["speedup_vs_target"] == 2.0  # rounds 2.0, 1.8, 2.0 (pooled: 78/40 = 1.95)
    assert rows["memspec"]["ratio_vs_bandit"] == pytest.approx(1.333, abs=1e-3)  # 1.333, 1.2, 1.667
    assert rows["memspec"]["fraction_of_oracle"] == pytest.approx(0.909, abs=1e-3)  # 0.909, 0.9, 1.0
    assert rows["memspec"]["rounds_tok_per_s"] == [40, 18, 20]
    assert rows["memspec"]["load_stalls"] == 3 and rows["memspec"]["loads"] == 9
    assert rows["memspec"]["peak_rss_mb"] == 300 and rows["memspec"]["load_stall_ms"] == 6.0
    assert "prediction_mean_rel_error" not in runs["memspec"].counters  # a mean: not summed over rounds


# -- the stream benchmark, end to end on the real fp32 target --------------------------------------
STREAM_KEYS = {"policy", "category", "tokens", "seconds", "tok_per_s", "speedup_vs_target",
               "mean_acceptance_length", "wasted_draft_tokens", "peak_rss_mb", "budget_mb", "load_stalls",
               "load_stall_ms", "ratio_vs_bandit", "fraction_of_oracle"}


def test_stream_bench_runs_every_policy_under_the_budget_with_target_only_output(model_store, tmp_path):
    from test_cli import memspec

    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps(w) for w in [
        {"prompt": "Write a Python function that reverses a string.", "category": "code"},
        {"prompt": "What is 12 times 7? Show your work.", "category": "math"},
        {"prompt": "Summarize in one sentence: The cat sat on the mat all day.", "category": "summarization"},
    ]) + "\n")
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    r = memspec("bench", "--variant", "fp32", "--workload", str(workload), "--max-tokens", "12",
                "--policies", "target-only,bandit,memspec,oracle", "--shuffle", "1",
                "--json", str(out), "--png", str(png), home=model_store.home)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    rows = {(x["policy"], x["category"]): x for x in doc["runs"]}
    for policy in ("target-only", "bandit", "memspec", "oracle"):
        row = rows[(policy, "all")]
        assert STREAM_KEYS <= set(row), STREAM_KEYS - set(row)
        assert row["tokens"] == rows[("target-only", "all")]["tokens"] and row["mismatches_vs_target"] == 0
        if policy != "oracle":  # the oracle is the unbudgeted upper bound
            # the budget books weights, caches and indexes; a pass's logits rows and their copies come
            # and go beside them (9 rows of SmolLM2's 49,152 logits: 1.7 MiB), which the sampler may catch
            assert row["peak_rss_mb"] <= row["budget_mb"] + 2
    assert rows[("oracle", "all")]["fraction_of_oracle"] == 1.0 and rows[("bandit", "all")]["ratio_vs_bandit"] == 1.0
    assert {c for _, c in rows} == {"all", "code", "math", "summarization"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 1000
    else:  # an optional extra: the run says how to get the chart instead of failing
        assert not png.exists() and "pip install -e .[bench]" in r.stderr


def test_stream_bench_runs_rounds_and_refuses_rounds_it_cannot_run(model_store, tmp_path):
    from test_cli import memspec

    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"prompt": "Write a Python function that adds two numbers.",
                                    "category": "code"}) + "\n")
    out = tmp_path / "out.json"
    r = memspec("bench", "--variant", "fp32", "--workload", str(workload), "--max-tokens", "6",
                "--policies", "memspec", "--rounds", "2", "--json", str(out), home=model_store.home)
    assert r.returncode == 0, r.stderr
    rows = {x["policy"]: x for x in json.loads(out.read_text())["runs"] if x["category"] == "all"}
    assert set(rows) == {"target-only", "memspec"} and json.loads(out.read_text())["config"]["rounds"] == 2
    for row in rows.values():
        assert len(row["rounds_tok_per_s"]) == 2 and row["mismatches_vs_target"] == 0 and row["requests"] == 2
    assert "tok/s by round" in r.stdout
    for extra, says in ((["--policies", "memspec", "--rounds", "0"], "--rounds must be at least 1, got 0"),
                        (["--policies", "target-only,fixed:prompt-lookup", "--rounds", "2"],
                         "the fixed drafts run once each")):
        bad = memspec("bench", "--workload", str(workload), "--max-tokens", "4", *extra, home=model_store.home)
        assert bad.returncode != 0 and says in bad.stderr, bad.stderr


def test_stream_bench_measures_the_verification_costs_before_any_policy_runs(model_store, monkeypatch):
    """Regression: the policy bench's engine had no cost file and measured the target's cost curve
    (4 s on the 1.5B) inside the first request that drafted, charged to whichever policy that was."""
    import argparse

    from memspec.bench import policies as P
    from memspec.config import Config

    seen = {}

    def stop(engine, *args, **kwargs):
        seen["costs"], seen["file"] = engine.verify_cost_s, engine.costs
        raise KeyboardInterrupt  # enough: the policies would run now

    monkeypatch.setattr(P, "run_stream", stop)
    args = argparse.Namespace(config=Config(), variant="fp32", budget_mb=None, oracle_table=None, max_tokens=4,
                              lookahead=1)
    workload = [{"prompt": "Write a Python function that reverses a string.", "category": "code"}]
    with pytest.raises(KeyboardInterrupt):
        P.run_bench_stream(args, ["target-only", "bandit"], workload, Config().speculative)
    assert seen["costs"] is not None and len(seen["costs"]) == Config().speculative.gamma_max + 2
    assert seen["file"] is not None and seen["file"].path.parent == model_store.home  # the store's, as the daemon's


def test_fixed_bench_runs_a_pool_and_refuses_what_a_pool_cannot_run(model_store, tmp_path):
    """The fixed-policy bench (no budget): every policy on a DraftPool, checked before anything runs."""
    from test_cli import memspec

    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"prompt": "Repeat: one two three one two three", "category": "rewriting"}) + "\n")
    out = tmp_path / "out.json"
    r = memspec("bench", "--variant", "fp32", "--workload", str(workload), "--max-tokens", "8",
                "--policies", "target-only,fixed:prompt-lookup", "--json", str(out), home=model_store.home)
    assert r.returncode == 0, r.stderr
    rows = {(x["policy"], x["category"]): x for x in json.loads(out.read_text())["runs"]}
    assert rows[("fixed:prompt-lookup", "all")]["mismatches_vs_target"] == 0
    bad = memspec("bench", "--workload", str(workload), "--max-tokens", "8", "--policies", "fixed:nope",
                  home=model_store.home)
    assert bad.returncode != 0 and "policies: unknown draft 'nope'; available: none, " in bad.stderr
    bad = memspec("bench", "--workload", str(workload), "--max-tokens", "8", "--policies", "fastest",
                  home=model_store.home)
    assert bad.returncode != 0 and "policies: unknown policy 'fastest'" in bad.stderr


def test_a_pool_policy_is_its_draft():
    from memspec.bench.policies import policy_draft
    from memspec.speculation.drafts import PromptLookup
    from memspec.speculation.sources import DraftPool

    pool = DraftPool({"prompt-lookup": PromptLookup(10)})
    assert policy_draft("target-only", pool) == "none" and policy_draft("fixed:prompt-lookup", pool) == "prompt-lookup"
    with pytest.raises(InvalidRequestError, match="policies: unknown policy 'bandit'; known: target-only, fixed:"):
        policy_draft("bandit", pool)


def _bench_module(name: str):
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- bench/sampling.py: the sampling schemes and filters, per category ------------------------------
def sampling_rows(out: str) -> list[list[str]]:
    """The table's rows (T, filters, scheme, policy, category, tok/s, ratio, accept, same)."""
    lines = out.splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("coupled tok/s")), len(lines))
    return [line.split() for line in lines[2:end]]


def test_sampling_bench_prices_each_scheme_and_filter_per_category(model_store, capsys):
    bench = _bench_module("sampling")
    assert bench.parse_filters("top_p=0.9,top_k=40;min_p=0.05;") == [{"top_p": 0.9, "top_k": 40}, {"min_p": 0.05}, {}]
    with pytest.raises(SystemExit, match="'top_q=1' is not"):
        bench.parse_filters("top_q=1")
    with pytest.raises(SystemExit, match="--scheme: 'coupled,fancy'"):
        bench.main(["--scheme", "coupled,fancy"])
    assert bench.main(["--drafts", "draft-code", "--filters", "top_p=0.9,top_k=20", "--max-tokens", "6",
                       "--rounds", "1", "--temperature", "0.7,1.0"]) == 0
    out = capsys.readouterr().out
    rows = sampling_rows(out)
    alls = [r for r in rows if r[4] == "all"]
    assert [(r[0], r[1], r[2], r[3]) for r in alls] == [
        (t, "top_p=0.9,top_k=20", s, p) for t in ("0.7", "1.0") for s in ("coupled", "standard")
        for p in ("none", "draft-code")]
    assert all(float(r[5]) > 0 for r in rows)
    assert all(r[6] == "1.00x" and r[8] == "1.00" for r in rows if r[3] == "none")
    assert all(r[8] == "1.00" for r in rows if r[2] == "coupled")  # the guarantee: a seed's target-only answer
    assert len({r[4] for r in rows}) == 7  # the built-in workload's six categories and all
    assert "coupled tok/s over standard tok/s" in out
    with pytest.raises(SystemExit, match="draft 'nope' is not in the pool"):
        bench.main(["--drafts", "nope", "--max-tokens", "1", "--rounds", "1"])


def test_sampling_bench_reads_a_workload_and_runs_the_scheduler_beside_a_named_draft(model_store, capsys,
                                                                                     monkeypatch, tmp_path):
    """`scheduled`: requests that name no draft, the scheduler picking as the daemon does, its suffix
    index emptied before each (the same prompt ran under the other policies just before)."""
    from memspec.scheduling.scheduler import Scheduler

    bench = _bench_module("sampling")
    forgot = []
    monkeypatch.setattr(Scheduler, "forget", lambda self: forgot.append(1))
    work = tmp_path / "w.jsonl"
    work.write_text('{"prompt": "Write a haiku about rain.", "category": "poem"}\n'
                    '{"prompt": "Sort [3, 1, 2] in Python.", "category": "code"}\n'
                    '{"prompt": "Another poem, on snow.", "category": "poem"}\n')
    assert bench.main(["--drafts", "scheduled,prompt-lookup", "--filters", "top_k=20", "--max-tokens", "4",
                       "--rounds", "1", "--limit", "1", "--workload", str(work), "--scheme", "coupled"]) == 0
    out = capsys.readouterr().out
    rows = sampling_rows(out)
    assert [(r[3], r[4]) for r in rows] == [(p, c) for p in ("none", "scheduled", "prompt-lookup")
                                           for c in ("code", "poem", "all")]
    assert all(float(r[5]) > 0 and r[8] == "1.00" for r in rows) and "coupled tok/s over" not in out
    assert len(forgot) == 2  # one a scheduled request: 2 prompts (one a category), one filter set
    with pytest.raises(SystemExit, match="draft 'nope' is not in the pool: .*scheduled"):
        bench.main(["--drafts", "scheduled,nope", "--max-tokens", "1", "--rounds", "1"])


# -- bench/ep_check.py: an execution provider against the CPU --------------------------------------
def test_ep_check_lines_up_rollback_logits_with_the_steps_they_repeat(tmp_path):
    """The CPU against itself: identical logits, and a rolled-back verification pass that matches
    the one-token steps over the same positions.  An off-by-one in lining the two up would compare
    logits of different positions, which differ by far more than rounding."""
    import numpy as np
    from tiny_models import build_tiny

    ep = _bench_module("ep_check")
    path = build_tiny(tmp_path / "m.onnx", seed=4, vocab=64)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 64, 40)]
    r = ep.check_model("tiny", path, ids, ["CPUExecutionProvider"], max_context=64, threads=1)
    assert r["placement"] == "all nodes (CPU)" and r["kv_device"] == "cpu"
    assert r["positions"] == len(ids) - len(ids) // 2 + 1
    assert r["max_abs_logit_diff"] == 0.0 and r["argmax_agreement"] == 1.0
    assert r["rollback_max_abs_diff"] < 1e-4
    steps, verify = ep.run_sequence(ep.DecoderSession(path), ids, len(ids) // 2)
    assert np.max(np.abs(steps[-ep.VERIFY + 1:] - verify[:-1])) > 1e-2  # shifted by one: far apart


# -- bench/engines.py: memspec side by side with onnxruntime-genai and llama.cpp ---------------------
def test_onnxruntime_genai_runs_memspecs_q4_graph_token_for_token(tmp_path):
    """The graph the bench hands onnxruntime-genai (memspec's own, logits_to_keep fixed) decodes
    exactly as memspec's session does: genai runs our file, not something like it."""
    import dataclasses

    import numpy as np
    import onnx
    import pytest
    from tiny_models import tiny_config, tiny_weights

    from memspec.models.convert import DecoderBuilder
    from memspec.models.gguf import ArrayWeights
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.sessions import DecoderSession

    og = pytest.importorskip("onnxruntime_genai")
    engines = _bench_module("engines")
    cfg = dataclasses.replace(tiny_config(vocab=32), tied_embeddings=False)  # untied: varied output
    tensors = dict(tiny_weights(cfg, 7)._tensors)
    tensors["output.weight"] = np.random.default_rng(1).standard_normal((cfg.vocab, cfg.hidden)) * 4
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "q4.onnx"
    onnx.save(DecoderBuilder(ArrayWeights(cfg, tensors, quantize="Q4_1"), "q4", 256).build(), str(path))
    arch = {k: getattr(cfg, k) for k in ("vocab", "head_dim", "hidden", "n_heads", "n_kv_heads", "n_layers")}
    (tmp_path / "g").mkdir()
    folder = engines.genai_folder(path, tmp_path / "g", arch, eos=31, threads=1)
    worker = engines.GenaiWorker.__new__(engines.GenaiWorker)  # its model, without the temp folder
    worker.og, worker.model, worker.speculative = og, og.Model(str(folder)), False
    prompt = [1, 4, 9, 2, 7]
    got = worker.generate(prompt, "", 24)

    s = DecoderSession(path, SessionConfig(max_context=256, intra_op_threads=1))
    cache = s.new_cache(64)
    logits, want = s.forward(cache, prompt), []
    while len(want) < 24 and (not want or want[-1] != 31):
        want.append(int(logits[-1].argmax()))
        logits = s.forward(cache, want[-1:])
    assert len(set(want)) >= 5, want  # a sequence worth comparing
    assert got == want


def test_onnxruntime_genai_speculative_decoding_runs_on_memspec_graphs_losslessly(tmp_path):
    """The -spec engine's folder: genai's own draft-model speculation with a memspec graph as the
    draft (the target itself, or another tiny model of one vocabulary) answers exactly what its
    plain decoding answers."""
    import dataclasses

    import numpy as np
    import onnx
    import pytest
    from tiny_models import tiny_config, tiny_weights

    from memspec.models.convert import DecoderBuilder
    from memspec.models.gguf import ArrayWeights

    og = pytest.importorskip("onnxruntime_genai")
    engines = _bench_module("engines")
    paths, archs = {}, {}
    for name, seed, head_seed, layers in (("target", 7, 1, 2), ("draft", 3, 2, 1)):
        cfg = dataclasses.replace(tiny_config(vocab=32), tied_embeddings=False, n_layers=layers)
        tensors = {k: v for k, v in tiny_weights(cfg, seed)._tensors.items()}
        tensors["output.weight"] = np.random.default_rng(head_seed).standard_normal((cfg.vocab, cfg.hidden)) * 4
        (tmp_path / name).mkdir()
        paths[name] = tmp_path / name / "q4.onnx"
        onnx.save(DecoderBuilder(ArrayWeights(cfg, tensors, quantize="Q4_1"), "q4", 256).build(), str(paths[name]))
        archs[name] = {k: getattr(cfg, k) for k in ("vocab", "head_dim", "hidden", "n_heads", "n_kv_heads", "n_layers")}
    got, drafted = {}, {}
    for mode, draft in (("plain", None), ("self", {"arch": archs["target"], "path": str(paths["target"])}),
                        ("other", {"arch": archs["draft"], "path": str(paths["draft"])})):
        (tmp_path / mode).mkdir()
        folder = engines.genai_folder(paths["target"], tmp_path / mode, archs["target"], eos=31, threads=1,
                                      draft=draft, draft_max=3)
        config = json.loads((folder / "genai_config.json").read_text())
        assert ("draft" in config["model"]) == (draft is not None)
        worker = engines.GenaiWorker.__new__(engines.GenaiWorker)
        worker.og, worker.model, worker.speculative = og, og.Model(str(folder)), draft is not None
        got[mode] = [worker.generate([1, 4, 9, 2, 7], "", 24), worker.generate([5, 5, 3], "", 24)]
        drafted[mode] = worker.drafted if draft is not None else None
    assert len(set(got["plain"][0])) >= 5, got  # a sequence worth comparing
    assert got["self"] == got["plain"]
    assert drafted["self"][0] > 0 and drafted["self"][1] == drafted["self"][0]  # it drafted; all accepted
    assert got["other"] == got["plain"]
    assert drafted["other"][1] < drafted["other"][0]  # some rejected
    with pytest.raises(ValueError, match="one vocabulary"):
        engines.genai_config(archs["target"], "model.onnx", 31, 1, {"arch": {**archs["draft"], "vocab": 40},
                                                                    "filename": "draft.onnx"})


def test_a_speculative_engine_without_its_binary_or_draft_is_left_out_with_the_reason(tmp_path):
    engines = _bench_module("engines")
    said = []
    setup = {"threads": 1, "llama_server": str(tmp_path / "no-such-llama-server"), "draft_gguf": "x.gguf"}
    assert engines.run(["llama.cpp-spec"], [{"ids": [1], "prompt": "hi"}], setup, 2, 1, said.append) == {"rows": []}
    assert said == [f"llama.cpp-spec: left out: no llama-server binary ({tmp_path / 'no-such-llama-server'}): "
                    f"build one with `bash bench/build_llama_cpp.sh` and pass --llama-server PATH"]
    said.clear()
    setup = {"threads": 1, "no_draft": "the same-family draft's GGUF is not in the store: memspec pull d"}
    engines.run(["onnxruntime-genai-spec"], [{"ids": [1], "prompt": "hi"}], setup, 2, 1, said.append)
    assert said == ["onnxruntime-genai-spec: left out: the same-family draft's GGUF is not in the store: memspec pull d"]


def test_engines_summary_gives_ratios_memory_and_agreement():
    engines = _bench_module("engines")
    per_round = {"memspec": [{"tokens": 30, "seconds": 0.3, "tok_per_s": 100.0},
                             {"tokens": 30, "seconds": 0.25, "tok_per_s": 120.0},
                             {"tokens": 30, "seconds": 0.2, "tok_per_s": 150.0}],
                 "target-only": [{"tokens": 30, "seconds": 0.5, "tok_per_s": 60.0}] * 3,
                 "llama.cpp": [{"tokens": 29, "seconds": 0.58, "tok_per_s": 50.0}] * 3}
    outputs = {"memspec": [[1, 2], [3, 4], [5]], "target-only": [[1, 2], [3, 4], [6]],
               "llama.cpp": [[1, 2], [3, 5], [6]]}
    rows = {r["engine"]: r for r in engines.summarize(per_round, outputs, {n: 300.0 for n in per_round},
                                                      {n: 1.0 for n in per_round})["rows"]}
    assert rows["memspec"]["tok_per_s"] == 120.0  # the median round
    assert rows["memspec"]["vs_llama_cpp"] == 2.4 and rows["memspec"]["vs_target_only"] == 2.0
    assert rows["llama.cpp"]["vs_llama_cpp"] == 1.0 and rows["llama.cpp"]["tokens"] == 29
    assert [rows[n]["same_output_as_target_only"] for n in ("memspec", "target-only", "llama.cpp")] == [2, 3, 2]
    assert rows["memspec"]["same_output_as_plain"] is None
    spec = engines.summarize({**per_round, "llama.cpp-spec": per_round["memspec"]},
                             {**outputs, "llama.cpp-spec": [[1, 2], [3, 5], [7]]}, {n: 1.0 for n in engines.ENGINES},
                             {n: 1.0 for n in engines.ENGINES})["rows"]
    assert {r["engine"]: r["same_output_as_plain"] for r in spec}["llama.cpp-spec"] == 2  # against llama.cpp's own
    out = io.StringIO()
    engines.print_report({"rows": list(rows.values())}, out)
    assert "2.40x" in out.getvalue() and "2/3" in out.getvalue()
    without = engines.summarize({"memspec": per_round["memspec"]}, {"memspec": outputs["memspec"]},
                                {"memspec": 1.0}, {"memspec": 1.0})["rows"][0]
    assert without["vs_llama_cpp"] is None and without["same_output_as_target_only"] is None


def test_engines_summary_breaks_speed_and_drafting_down_by_category():
    engines = _bench_module("engines")

    def prompt(cat, tokens, seconds, drafted=None, spec=None):
        return {"category": cat, "tokens": tokens, "seconds": seconds, "drafted": drafted, "spec": spec}

    per_round = {
        "memspec": [{"tokens": 40, "seconds": 0.5, "tok_per_s": 80.0, "prompts": [
            prompt("code", 20, 0.1, (12, 9), {"steps": 5, "draft_ms": 20.0, "draft": "sib"}),
            prompt("qa", 20, 0.4, (4, 1), {"steps": 3, "draft_ms": 40.0, "draft": "chat"})]}],
        "target-only": [{"tokens": 40, "seconds": 0.6, "tok_per_s": 66.7, "prompts": [
            prompt("code", 20, 0.2), prompt("qa", 20, 0.4)]}],
    }
    cats = {(c["category"], c["engine"]): c for c in engines.by_category(per_round)}
    code, qa = cats[("code", "memspec")], cats[("qa", "memspec")]
    assert code["tok_per_s"] == 200.0 and code["vs_target_only"] == 2.0
    assert code["acceptance"] == 0.75 and code["tokens_per_step"] == 2.8 and code["draft_share"] == 0.2
    assert code["draft"] == "sib" and qa["draft"] == "chat" and qa["vs_target_only"] == 1.0
    assert cats[("qa", "target-only")]["acceptance"] is None and cats[("qa", "target-only")]["draft"] is None
    out = io.StringIO()
    engines.print_report({"rows": [], "categories": list(cats.values())}, out)
    assert "2.00x" in out.getvalue() and "75%" in out.getvalue() and "sib" in out.getvalue()


def test_engines_bench_runs_each_engine_in_its_own_process(model_store, tmp_path):
    """Real model, two prompts, a few tokens: every engine that is installed answers, target-only
    agrees with itself, and the JSON holds the rows."""
    import subprocess
    import sys
    from pathlib import Path

    names = ["memspec", "target-only"] + [n for n, mod in (("onnxruntime-genai", "onnxruntime_genai"),
                                                          ("llama.cpp", "llama_cpp"))
                                         if importlib.util.find_spec(mod)]
    out = tmp_path / "engines.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "engines.py"
    r = subprocess.run([sys.executable, str(script), "--limit", "2", "--max-tokens", "6", "--rounds", "1",
                        "--threads", "1", "--engines", ",".join(names), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(names)
    assert rows["target-only"]["same_output_as_target_only"] == 2 and rows["target-only"]["vs_target_only"] == 1.0
    for row in rows.values():
        assert row["tok_per_s"] > 0 and 2 <= row["tokens"] <= 12 and row["peak_rss_mib"] > 50
    bad = subprocess.run([sys.executable, str(script), "--engines", "ollama"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown ollama" in bad.stderr


def test_an_engine_from_another_checkout_runs_beside_this_ones(model_store, tmp_path):
    """NAME@CHECKOUT: a memspec engine from another checkout (here this one again, through its own
    path), side by side with this one's: the way a change is compared with main end to end."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, str(root / "bench" / "engines.py"), "--limit", "1", "--max-tokens", "5",
                        "--rounds", "1", "--threads", "1", "--engines", f"target-only,target-only@{root}",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows[f"target-only@{root}"]["same_output_as_target_only"] == 1
    for bad, says in (([f"llama.cpp@{root}"]), "takes a memspec engine"), (["memspec@" + str(tmp_path)], "checkout"):
        got = subprocess.run([sys.executable, str(root / "bench" / "engines.py"), "--engines", ",".join(bad)],
                             capture_output=True, text=True)
        assert got.returncode == 2 and says in got.stderr, got.stderr


def test_engines_run_each_prompt_on_every_engine_in_turn_in_rotating_order(monkeypatch):
    """So that the machine's drift over a run falls on every engine alike, not on whichever ran last."""
    engines = _bench_module("engines")
    calls = []

    class Worker:
        def __init__(self, name, setup):
            self.name, self.info, self.peak_rss_mb = name, {"load_s": 0.1, "rss_mb": 10.0}, 10.0

        def generate(self, ids, text, max_new):
            calls.append((self.name, text))
            return {"ids": [len(calls)] * (1 + ids[0]), "seconds": 0.5 + ids[0] * 0.25, "rss_mb": 10.0}

        def forget(self):
            calls.append((self.name, "forget"))

        def close(self):
            pass

    monkeypatch.setattr(engines, "Engine", Worker)
    items = [{"ids": [i], "prompt": f"p{i}"} for i in range(3)]
    result = engines.run(["a", "b", "c"], items, {}, max_new=4, rounds=2, progress=lambda _: None)
    assert calls[:3] == [("a", "p0"), ("b", "p0"), ("c", "p0")]  # the warm-ups, as each loads
    # each round starts with every engine forgetting what it learned (memspec's suffix index)
    assert calls[3:6] == calls[6 + 9:6 + 9 + 3] == [("a", "forget"), ("b", "forget"), ("c", "forget")]
    runs = [c for c in calls[3:] if c[1] != "forget"]
    order = [[n for n, t in runs[j:j + 3]] for j in range(0, len(runs), 3)]
    assert [t for _, t in runs[::3]] == ["p0", "p1", "p2"] * 2
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],  # round 1, then round 2 starts one on
                     ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    rows = {r["engine"]: r for r in result["rows"]}
    # 6 tokens in 2.25 s a round
    assert all(r["tokens"] == 1 + 2 + 3 and r["rounds"] == [2.67, 2.67] for r in rows.values())


@pytest.mark.parametrize("args, says", [
    (["--draft-max", "0"], "--draft-max must be 1..16 (onnxruntime-genai's range), got 0"),
    (["--draft-max", "17"], "--draft-max must be 1..16 (onnxruntime-genai's range), got 17"),
    (["--rounds", "0"], "--max-tokens, --rounds and --limit must be at least 1"),
])
def test_engines_bench_refuses_bad_options_before_loading_anything(args, says, capsys):
    engines = _bench_module("engines")
    with pytest.raises(SystemExit) as exc:
        engines.main(args)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_an_engine_that_cannot_load_is_left_out(tmp_path):
    """A worker that dies while loading (here: memspec with an unreadable config) is named and left
    out; the run goes on with the others (none here)."""
    engines = _bench_module("engines")
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nproviders = 3\n")
    said = []
    result = engines.run(["target-only"], [{"ids": [1, 2], "prompt": "hi"}], {"config": str(bad), "threads": 1},
                         max_new=2, rounds=1, progress=said.append)
    assert result == {"rows": []}
    assert said and said[0].startswith("target-only: left out: the target-only worker exited (status 1)")


def test_soak_runs_clients_with_cancels_deadlines_and_model_calls_and_checks_the_end_state(model_store, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "soak.py"
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(script), "--requests", "40", "--clients", "3", "--max-tokens", "8",
                        "--model-calls-every", "15", "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "MEMSPEC_HOME": str(model_store.home)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["unexpected"] == 0 and report["at_end"] == {"active_streams": 0, "queue_depth": 0, "kv_bytes": 0}
    assert sum(report["codes"].values()) == 40 and any(k.startswith(("load:", "unload:")) for k in report["codes"])


def test_target_bench_counts_the_weights_a_decode_step_reads(model_store):
    """bench/target.py's floor for the decode ratio: our q4 graph reads the Q4_1 GGUF's weights
    plus a float32 scale per block and the block-sum correction, and skips the gathered embedding."""
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("target_bench", Path(__file__).parents[1] / "bench" / "target.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    m = model_store.get("smollm2-135m")
    ours, theirs = bench.weight_bytes_per_token(m.variant_path("q4"), model_store.downloads_dir / m.provenance["gguf_file"])
    # SmolLM2-135M: 134.5M weights; the tied Q8_0 embedding is the head, read every step by both
    assert 90e6 < theirs < 100e6 and theirs < ours < 1.3 * theirs


# -- bench/concurrency.py against llama.cpp's server ------------------------------------------------
def test_concurrency_reads_a_llama_server_stream_and_counts_its_tokens():
    """The llama-server client of bench/concurrency.py, against a server speaking llama-server's
    /completion stream (server-sent events, the last one with stop and timings)."""
    import http.server
    import json
    import threading

    conc = _bench_module("concurrency")
    asked: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            n = body["n_predict"]
            for i in range(n):
                self.wfile.write(f"data: {json.dumps({'content': str(i), 'stop': False})}\n\n".encode())
            last = {"content": "", "stop": True, "timings": {"predicted_n": n, "predicted_per_second": 50.0 + n}}
            self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = conc.LlamaServer.__new__(conc.LlamaServer)  # the client half, on the fake's port
        server.label, server.port = "llama-server", httpd.server_address[1]
        items = [{"prompt": f"p{i}", "ids": [1, 2, i]} for i in range(5)]
        res = conc.run(server, items, clients=2, max_tokens=7)
    finally:
        httpd.shutdown()
    assert res["requests"] == 5 and res["req_tok_s_p50"] == 57.0 and res["ttft_ms_p50"] > 0
    assert sorted(b["prompt"][2] for b in asked) == list(range(5))  # token ids, each prompt once
    assert all(b["stream"] and b["temperature"] == 0.0 and b["cache_prompt"] is True for b in asked)


def test_concurrency_says_how_to_build_a_missing_llama_server(tmp_path):
    conc = _bench_module("concurrency")
    with pytest.raises(SystemExit, match="build_llama_cpp.sh"):
        conc.LlamaServer("llama-server", str(tmp_path / "none"), "x.gguf", 2, 1, 512, tmp_path)


def test_the_default_llama_server_follows_this_cpus_instruction_set():
    engines = _bench_module("engines")
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    want = "build-avx512" if {"avx512f", "avx512_vnni"} <= flags else "build-avx2"
    assert engines.default_llama_server().parts[-3] == want


def test_draft_length_replay_prices_each_rule_with_the_recorded_costs():
    """bench/draft_length.py: a rule's tokens per unit of target time from the recorded steps; a stop
    on the next token's probability pays the forward that read it."""
    dl = _bench_module("draft_length")
    flat = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # every pass costs one row's
    sure = {"p": [1.0] * 8, "entropy": [0.0] * 8, "accepted": 8}
    data = {"model": "t", "draft": "d", "pass_s": flat,
            "prompts": [{"category": "code", "steps": [sure] * 4, "draft_s": 0.0, "verify_s": 4.0}]}
    rows = dict(dl.replay(data))
    assert rows["draft step / target step"]["all"] == 0.0
    assert rows["fixed 1"]["code"] == 2.0 and rows["fixed 4"]["code"] == 5.0  # free drafts, all accepted
    unsure = {"p": [0.9, 0.2] + [0.9] * 6, "entropy": [0.1] * 8, "accepted": 1}
    data = {"model": "t", "draft": "d", "pass_s": flat,
            "prompts": [{"category": "qa", "steps": [unsure] * 2, "draft_s": 0.4 * 2 * 8, "verify_s": 2.0}]}
    rows = dict(dl.replay(data))
    assert abs(rows["draft step / target step"]["all"] - 0.4) < 1e-9
    # p < 0.3 stops before the second token: 1 proposed, 2 committed, at 1 + 2 draft steps (the stop's own)
    assert abs(rows["p < 0.3 (shipped rule), at most 4"]["qa"] - 2 / (1 + 2 * 0.4)) < 1e-9
    assert abs(rows["fixed 2"]["qa"] - 2 / (1 + 2 * 0.4)) < 1e-9  # two proposed, one accepted
    assert [lo for lo, _, _ in dl.calibration(data)] == [0.2, 0.9]


def test_a_memspec_worker_forgets_what_it_learned_when_told(model_store):
    """The worker's side of the forget message each round starts with: a prompt asked again is
    recalled from the suffix index (its steps are the suffix draft's), and after forget it is drafted
    as the first time, not recalled."""
    engines = _bench_module("engines")
    items, setup = engines.prompts(None, 1, None, "smollm2-135m")
    e = engines.Engine("memspec", {**setup, "threads": 1})
    try:
        assert e.info["forgets"]
        first = e.generate(items[0]["ids"], items[0]["prompt"], 32)
        again = e.generate(items[0]["ids"], items[0]["prompt"], 32)
        e.forget()
        fresh = e.generate(items[0]["ids"], items[0]["prompt"], 32)
    finally:
        e.close()
    assert first["ids"] == again["ids"] == fresh["ids"]
    assert [r["spec"]["draft"] == "suffix" for r in (first, again, fresh)] == [False, True, False]


def test_spread_takes_each_category_in_turn_and_skips_one_that_runs_out():
    items = [{"category": c, "prompt": p} for c, p in (("b", "b1"), ("a", "a1"), ("b", "b2"), ("b", "b3"), ("a", "a2"))]
    assert [i["prompt"] for i in spread(items, 4)] == ["a1", "b1", "a2", "b2"]
    assert [i["prompt"] for i in spread(items, 99)] == ["a1", "b1", "a2", "b2", "b3"]
    assert spread([], 3) == []


def test_kv_fidelity_floor_changes_only_the_last_bit_of_finite_float16s():
    """bench/kv_fidelity.py's floor: f16 KV with each finite element's last bit made random, in place
    in a view of the cache; infinities and NaNs are left as they are (a flipped bit would make a NaN)."""
    import numpy as np

    bench = _bench_module("kv_fidelity")
    cache = np.zeros((2, 3, 64), np.uint16)
    cache[:] = np.arange(1.0, 7.0, dtype=np.float16).view(np.uint16).reshape(2, 3, 1)
    cache[0, 0, :2] = np.array([np.inf, np.nan], np.float16).view(np.uint16)
    before = cache.copy()
    bench.last_bit(cache[:, 1:], np.random.default_rng(0))  # a view, as the bench passes the fed rows
    assert np.array_equal(cache[:, 0], before[:, 0])
    changed = cache[:, 1:] ^ before[:, 1:]
    assert set(np.unique(changed)) == {0, 1} and 0.3 < changed.mean() < 0.7
    bench.last_bit(cache, np.random.default_rng(1))
    assert np.array_equal(cache[0, 0, :2], before[0, 0, :2])
