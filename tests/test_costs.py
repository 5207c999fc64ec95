"""The measured pass costs the cost controller uses, kept across processes (runtime/costs.py)."""

from __future__ import annotations

import json

import os
import subprocess
import sys
import time

from memspec.runtime.costs import BUSY_SHARE, MAX_AGE_S, MAX_ENTRIES, CostCache, others_cpu_share, timed_curve


def quiet(fn):
    """CostCache's contention check on a machine nothing else uses (the real one reads the CPU
    times of the machine, which a parallel test run would make busy)."""
    return fn(), 0.0


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_curve_is_measured_once_then_read_back_by_another_process(tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return [0.0, 0.05, 0.06]

    clock = Clock()
    assert CostCache(tmp_path / "costs.json", clock, quiet).measured("k", measure) == [0.0, 0.05, 0.06]
    assert CostCache(tmp_path / "costs.json", clock, quiet).measured("k", measure) == [0.0, 0.05, 0.06]
    assert len(calls) == 1
    assert CostCache(tmp_path / "costs.json", clock, quiet).measured("other", measure) and len(calls) == 2


def test_a_curve_measured_on_a_busy_machine_is_used_but_not_kept(tmp_path):
    """Regression: a daemon started beside a training run kept a 1.5B curve whose one-token pass
    looked twice as slow as it is, for a day.  Now such a curve serves only the process that
    measured it, and the next start measures again."""
    calls = []

    def measure():
        calls.append(1)
        return [0.0, 0.12, 0.15]

    for share in (BUSY_SHARE + 0.01, 0.9):
        busy = CostCache(tmp_path / "costs.json", Clock(), lambda fn, s=share: (fn(), s))
        assert busy.measured("k", measure) == [0.0, 0.12, 0.15]
        assert busy.get("k") is None
    assert len(calls) == 2
    assert CostCache(tmp_path / "costs.json", Clock(), lambda fn: (fn(), BUSY_SHARE)).measured("k", measure)
    assert CostCache(tmp_path / "costs.json", Clock(), quiet).get("k") == [0.0, 0.12, 0.15]


def test_other_processes_cpu_share_is_read_off_the_machine():
    """others_cpu_share sees a process that keeps a core busy, and not the caller's own work."""
    spin = "import time\nt = time.time()\nwhile time.time() - t < 3: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # the child is running
        _, share = others_cpu_share(lambda: time.sleep(0.8))
    finally:
        child.kill()
        child.wait()
    assert share >= 0.5 / (os.cpu_count() or 1)

    def own_work():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.3:
            pass
        return "done"

    result, mine = others_cpu_share(own_work)
    assert result == "done" and mine < share


def test_a_timed_curve_takes_each_ks_fastest_run_in_turns_and_never_falls():
    """timed_curve runs k = 1..max_k once per repeat, in turn (a burst of other work lands on all
    k, not on one); keeps each k's fastest run; and lifts a dip, so that a longer pass never looks
    cheaper than a shorter one."""
    now = [0.0]
    order = []
    cost = {1: 1.0, 2: 3.0, 3: 2.5}  # k = 3 measured cheaper than k = 2: noise

    def run(k):
        order.append(k)
        now[0] += cost[k] + (10.0 if len(order) == 2 else 0.0)  # one slow run of k = 2

    curve = timed_curve(run, 3, repeats=2, clock=lambda: now[0])
    assert order == [1, 2, 3, 1, 2, 3]
    assert curve == [0.0, 1.0, 3.0, 3.0]


def test_an_old_or_future_curve_is_measured_again(tmp_path):
    clock = Clock()
    cache = CostCache(tmp_path / "costs.json", clock, quiet)
    cache.put("k", [0.0, 1.0])
    clock.t += MAX_AGE_S + 1
    assert cache.get("k") is None
    cache.put("k", [0.0, 2.0])
    clock.t -= 10 * MAX_AGE_S  # a clock set back: not trusted either
    assert cache.get("k") is None


def test_a_damaged_file_means_measuring_again_not_an_error(tmp_path):
    path = tmp_path / "costs.json"
    cache = CostCache(path, Clock(), quiet)
    for text in ("not json", "[1, 2]", json.dumps({"k": [0.1]}), json.dumps({"k": {"costs": ["a"], "at": 1000}}),
                 json.dumps({"k": {"costs": [-1.0], "at": 1000}}), json.dumps({"k": {"costs": [], "at": 1000}})):
        path.write_text(text)
        assert cache.get("k") is None, text
    assert cache.measured("k", lambda: [0.0, 0.3]) == [0.0, 0.3] and cache.get("k") == [0.0, 0.3]


def test_no_store_no_file_and_a_bounded_file(tmp_path):
    missing = CostCache(tmp_path / "absent" / "costs.json", Clock())
    missing.put("k", [0.0])
    assert not (tmp_path / "absent").exists()
    cache = CostCache(tmp_path / "costs.json", Clock())
    for i in range(MAX_ENTRIES + 5):
        cache.put(f"k{i}", [float(i)])
    data = json.loads((tmp_path / "costs.json").read_text())
    assert len(data) == MAX_ENTRIES and "k0" not in data and f"k{MAX_ENTRIES + 4}" in data


def test_the_engine_calibrates_from_the_stores_costs_once(model_store, tmp_path, monkeypatch):
    """A second engine on the same target file and machine reads the first one's curve instead of
    spending its first request measuring; the key names the file, so another file measures anew."""
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.target import load_target
    from memspec.speculation.engine import Engine

    target = load_target(model_store, "smollm2-135m", "q4", SessionConfig(max_context=256))
    measured = []
    real = target.session.measure_step_costs
    monkeypatch.setattr(target.session, "measure_step_costs", lambda k: measured.append(k) or real(k))
    cache = CostCache(tmp_path / "costs.json", contention=quiet)
    first = Engine(target, costs=cache).calibrate()
    second = Engine(target, costs=CostCache(tmp_path / "costs.json", contention=quiet)).calibrate()
    assert first == second and len(first) == first_k(target) + 1 and measured == [first_k(target)]
    assert target.session.cost_key(4) != target.session.cost_key(5)
    assert str(target.session.path.resolve()) in json.loads(target.session.cost_key(4))


def first_k(target) -> int:
    from memspec.speculation.config import SpecConfig

    return SpecConfig().gamma_max + 1


def test_the_batched_pass_cost_table_is_kept_beside_the_solo_curve(model_store, tmp_path, monkeypatch):
    """Under batching the cost controller also needs a pass of b rows for b = 1..slots: measured once
    into the store's cost file, then read back by the next engine, row for row."""
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.target import load_target, open_batched
    from memspec.speculation.engine import Engine

    target = load_target(model_store, "smollm2-135m", "q4", SessionConfig(max_context=256))
    first = Engine(target, costs=CostCache(tmp_path / "costs.json", contention=quiet),
                   batched=open_batched(target.session, 2))
    try:
        first.calibrate()
        table = first.pass_cost_s
        assert sorted(table) == [1, 2] and all(len(row) == first_k(target) + 1 for row in table.values())
        assert table[1] == first.verify_cost_s  # the native pass of one row is the target's forward: not timed twice
    finally:
        first.close()
    second = Engine(target, costs=CostCache(tmp_path / "costs.json", contention=quiet),
                   batched=open_batched(target.session, 2))
    try:
        again = lambda *a, **kw: (_ for _ in ()).throw(AssertionError("measured again"))  # noqa: E731
        monkeypatch.setattr(second.batch.target, "measure_pass_costs", again)
        monkeypatch.setattr("memspec.speculation.engine.pass_costs", again)
        second.calibrate()
        assert second.pass_cost_s == table
    finally:
        second.close()
    assert len(json.loads((tmp_path / "costs.json").read_text())) == 2  # the solo curve and the table


def test_a_pass_table_times_one_row_and_every_row_and_draws_the_rows_between():
    """Issue 45: timing a pass of every b = 1..rows was 25 of the 30 s a 0.5B took to load on
    demand. Only b = 1 and b = rows are timed now; the rows between lie on the line through them."""
    from types import SimpleNamespace

    import pytest

    from memspec.runtime.costs import interpolate_rows, pass_costs

    class Cache:
        def truncate(self, n):
            pass

    passes = []

    class Batched:
        rows = 4
        target = SimpleNamespace(vocab_size=100, new_cache=lambda n: Cache(), forward=lambda c, ids, keep: None)

        def forward(self, caches, feeds, keep):
            passes.append(len(caches))

        def release(self, cache):
            pass

    table = pass_costs(Batched(), max_k=3, repeats=1)
    assert sorted(set(passes)) == [1, 4] and len(passes) == 2 * 3  # one row and every row, k = 1..3, once
    assert sorted(table) == [1, 2, 3, 4] and all(len(curve) == 4 for curve in table.values())
    line = interpolate_rows({1: [0.0, 1.0, 2.0], 4: [0.0, 4.0, 5.0]}, 4)
    assert line[2] == pytest.approx([0.0, 2.0, 3.0]) and line[3] == pytest.approx([0.0, 3.0, 4.0])
    assert interpolate_rows({1: [0.0, 1.0]}, 1) == {1: [0.0, 1.0]}


# -- the curve as the machine runs now (LiveCosts) ----------------------------------------------
def test_live_costs_start_as_calibrated_and_follow_the_passes_timed():
    """A 2-core Zen 4 VM's one-row pass went from 23.8 to 30 ms between quarters of an hour while
    its 4-row pass stayed at 38-39 ms: the curve's shape, which the cost controller reads, moved."""
    from memspec.runtime.costs import LiveCosts

    base = [0.0, 0.024, 0.029, 0.034, 0.039, 0.044]
    live = LiveCosts(base)
    assert live() == base  # nothing timed yet
    for _ in range(200):
        live.observe(1, 0.030)
        live.observe(4, 0.038)
    now = live()
    assert abs(now[1] - 0.030) < 0.0005 and abs(now[4] - 0.038) < 0.0005
    assert abs(now[2] / base[2] - 0.030 / 0.024) < 0.01  # never timed: the nearest timed row count's correction
    assert abs(now[5] / base[5] - 0.038 / 0.039) < 0.01
    assert all(b >= a for a, b in zip(now[1:], now[2:]))  # never falls with k
    assert now[4] / now[1] < base[4] / base[1]  # rows beside the first now cost less of a step


def test_one_stalled_pass_moves_the_live_curve_a_little_and_nonsense_not_at_all():
    from memspec.runtime.costs import LiveCosts

    live = LiveCosts([0.0, 0.02, 0.03])
    live.observe(1, 2.0)  # a pass 100x as long: a collector pause, a neighbour
    assert live()[1] < 0.02 * 1.04
    before = live()
    for rows, seconds in ((0, 0.02), (3, 0.02), (-1, 0.02), (1, 0.0), (1, -1.0), (1, float("nan"))):
        live.observe(rows, seconds)
    assert live() == before


def test_an_engine_corrects_its_curve_from_its_requests_passes_unless_pinned(model_store, tmp_path):
    from memspec.request import GenerationRequest
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.target import load_target
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool
    from memspec.speculation.drafts import PROMPT_LOOKUP, PromptLookup

    target = load_target(model_store, "smollm2-135m", "q4", SessionConfig(max_context=256))
    pool = DraftPool({PROMPT_LOOKUP: PromptLookup(target.session.vocab_size)})
    engine = Engine(target, drafts=pool, costs=CostCache(tmp_path / "costs.json", contention=quiet))
    engine.calibrate()
    base = list(engine.verify_cost_s)
    req = GenerationRequest(prompt="Count: 1 2 3 4 5 6 7 8", max_tokens=24, draft=PROMPT_LOOKUP)
    engine.generate(req)
    assert engine.live is not None and engine.live() != base and engine.verify_cost_s == base
    pinned = Engine(target, drafts=pool)
    pinned.pin_costs(base)
    pinned.generate(req)
    assert pinned.live is None and pinned.verify_cost_s == base


def test_a_batching_engines_lone_request_corrects_the_curve_too(model_store, tmp_path):
    """The daemon batches by default on the native engine, and one client's request runs alone on
    the one-request pass: those passes correct the curve (a shared pass's would not)."""
    from memspec.request import GenerationRequest
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.target import load_target, open_batched
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool
    from memspec.speculation.drafts import PROMPT_LOOKUP, PromptLookup

    target = load_target(model_store, "smollm2-135m", "q4", SessionConfig(max_context=256))
    engine = Engine(target, drafts=DraftPool({PROMPT_LOOKUP: PromptLookup(target.session.vocab_size)}),
                    costs=CostCache(tmp_path / "costs.json", contention=quiet), batched=open_batched(target.session, 2))
    try:
        engine.calibrate()
        base = list(engine.verify_cost_s)
        engine.generate(GenerationRequest(prompt="Count: 1 2 3 4 5 6 7 8", max_tokens=24, draft=PROMPT_LOOKUP))
        assert engine.live is not None and engine.batch.on_alone == engine.live.observe and engine.live() != base
    finally:
        engine.close()
