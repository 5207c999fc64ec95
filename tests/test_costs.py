"""The measured pass costs the cost controller uses, kept across processes (runtime/costs.py)."""

from __future__ import annotations

import json

from memspec.runtime.costs import MAX_AGE_S, MAX_ENTRIES, CostCache


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
    assert CostCache(tmp_path / "costs.json", clock).measured("k", measure) == [0.0, 0.05, 0.06]
    assert CostCache(tmp_path / "costs.json", clock).measured("k", measure) == [0.0, 0.05, 0.06]
    assert len(calls) == 1
    assert CostCache(tmp_path / "costs.json", clock).measured("other", measure) and len(calls) == 2


def test_an_old_or_future_curve_is_measured_again(tmp_path):
    clock = Clock()
    cache = CostCache(tmp_path / "costs.json", clock)
    cache.put("k", [0.0, 1.0])
    clock.t += MAX_AGE_S + 1
    assert cache.get("k") is None
    cache.put("k", [0.0, 2.0])
    clock.t -= 10 * MAX_AGE_S  # a clock set back: not trusted either
    assert cache.get("k") is None


def test_a_damaged_file_means_measuring_again_not_an_error(tmp_path):
    path = tmp_path / "costs.json"
    cache = CostCache(path, Clock())
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
    from memspec.speculation.engine import Engine, TargetModel

    target = TargetModel.load(model_store, "smollm2-135m", "q4", SessionConfig(max_context=256))
    measured = []
    real = target.session.measure_step_costs
    monkeypatch.setattr(target.session, "measure_step_costs", lambda k: measured.append(k) or real(k))
    cache = CostCache(tmp_path / "costs.json")
    first = Engine(target, costs=cache).calibrate()
    second = Engine(target, costs=CostCache(tmp_path / "costs.json")).calibrate()
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
    from memspec.speculation.engine import Engine, TargetModel

    target = TargetModel.load(model_store, "smollm2-135m", "q4", SessionConfig(max_context=256))
    first = Engine(target, costs=CostCache(tmp_path / "costs.json"), batch_slots=2)
    try:
        first.calibrate()
        table = first.pass_cost_s
        assert sorted(table) == [1, 2] and all(len(row) == first_k(target) + 1 for row in table.values())
    finally:
        first.close()
    second = Engine(target, costs=CostCache(tmp_path / "costs.json"), batch_slots=2)
    try:
        monkeypatch.setattr(second.batch.target, "measure_pass_costs",
                            lambda *a: (_ for _ in ()).throw(AssertionError("measured again")))
        second.calibrate()
        assert second.pass_cost_s == table
    finally:
        second.close()
    assert len(json.loads((tmp_path / "costs.json").read_text())) == 2  # the solo curve and the table
