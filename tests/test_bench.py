"""The benchmark: its default memory budget (room for at most half the drafts, whichever they
are), and the stream benchmark end to end."""

from __future__ import annotations

import importlib.util
import itertools
import json

from memspec.bench import default_budget_mb, draft_room

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


def test_default_budget_adds_the_process_and_one_request_and_rounds_up():
    sizes = {"a": 30 * MiB, "b": 40 * MiB}
    assert default_budget_mb(300 * MiB, 10 * MiB + 1, sizes) == 300 + 11 + 40


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
            assert row["peak_rss_mb"] <= row["budget_mb"]
    assert rows[("oracle", "all")]["fraction_of_oracle"] == 1.0 and rows[("bandit", "all")]["ratio_vs_bandit"] == 1.0
    assert {c for _, c in rows} == {"all", "code", "math", "summarization"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 1000
    else:  # an optional extra: the run says how to get the chart instead of failing
        assert not png.exists() and "pip install -e .[bench]" in r.stderr


# -- bench/ep_check.py: an execution provider against the CPU --------------------------------------
def _ep_check():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "ep_check.py"
    spec = importlib.util.spec_from_file_location("ep_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ep_check_lines_up_rollback_logits_with_the_steps_they_repeat(tmp_path):
    """The CPU against itself: identical logits, and a rolled-back verification pass that matches
    the one-token steps over the same positions.  An off-by-one in lining the two up would compare
    logits of different positions, which differ by far more than rounding."""
    import numpy as np
    from tiny_models import build_tiny

    ep = _ep_check()
    path = build_tiny(tmp_path / "m.onnx", seed=4, vocab=64)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 64, 40)]
    r = ep.check_model("tiny", path, ids, ["CPUExecutionProvider"], max_context=64, threads=1)
    assert r["placement"] == "all nodes (CPU)" and r["kv_device"] == "cpu"
    assert r["positions"] == len(ids) - len(ids) // 2 + 1
    assert r["max_abs_logit_diff"] == 0.0 and r["argmax_agreement"] == 1.0
    assert r["rollback_max_abs_diff"] < 1e-4
    steps, verify = ep.run_sequence(ep.DecoderSession(path), ids, len(ids) // 2)
    assert np.max(np.abs(steps[-ep.VERIFY + 1:] - verify[:-1])) > 1e-2  # shifted by one: far apart
