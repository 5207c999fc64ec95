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
