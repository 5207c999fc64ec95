"""Memory accounting, and unloading a real ONNX draft giving its memory back."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from fakes import FakeClock, FakeProbe, MiB
from memspec.speculation.drafts import DraftModel
from memspec.runtime.memory import Ledger, PsutilProbe, RssSampler, measure, release_heap
from memspec.request import SamplingParams
from memspec.runtime.config import SessionConfig
from memspec.runtime.sessions import DecoderSession
from memspec.scheduling.workingset import WorkingSet
from tiny_models import build_tiny


def test_ledger_accounts_by_kind_and_keeps_the_peak():
    led = Ledger()
    led.add("target", "t", 100)
    led.add("draft", "a", 10)
    led.add("kv", "req1", 5)
    assert led.total() == 115 and led.total("draft") == 10
    assert led.remove("draft", "a") == 10 and led.remove("draft", "a") == 0
    led.remove("kv", "req1", 2)
    d = led.to_dict()
    assert d["kv"] == {"req1": 3} and d["draft"] == {} and d["total_bytes"] == 103 and d["peak_bytes"] == 115
    with pytest.raises(AssertionError, match="ledger kind"):
        led.add("weights", "x", 1)


def test_measure_reports_declared_size_beside_rss_delta():
    probe, clock = FakeProbe(rss=100), FakeClock()

    def load():
        probe.rss += 70
        clock.advance(0.5)
        return "model", 64

    thing, fp = measure("m", load, probe, clock)
    assert thing == "model" and (fp.declared_bytes, fp.rss_delta_bytes, fp.seconds) == (64, 70, 0.5)


def test_release_heap_and_probe_on_linux():
    assert release_heap() == sys.platform.startswith("linux")
    p = PsutilProbe()
    assert p.rss_bytes() > 10 * MiB and p.available_bytes() > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_loading_the_target_leaves_no_freed_heap_behind(model_store):
    """ONNX Runtime frees its load-time copies of the weights once it has packed them; the load
    hands those pages back (a trim right after a q4 load used to release 56 MiB), so the memory
    budget and the device see only what stays resident."""
    from memspec.runtime.target import load_target

    target = load_target(model_store, "smollm2-135m", "q4")
    probe = PsutilProbe()
    before = probe.rss_bytes()
    release_heap()
    assert before - probe.rss_bytes() < 8 * MiB
    assert target.session.vocab_size == 49152  # still loaded while measured


def test_rss_sampler_sees_a_peak_between_samples():
    probe = FakeProbe(rss=100)
    with RssSampler(probe, interval_s=0.001) as s:
        probe.rss = 500
        time.sleep(0.02)
        probe.rss = 100
        time.sleep(0.01)
    assert s.peak_bytes == 500 and s.samples > 2


def test_50_load_unload_cycles_give_rss_back(tmp_path):
    """A draft-sized model (about 11 MB) loaded, used and unloaded 50 times through the working set."""
    path = build_tiny(tmp_path / "draft.onnx", seed=3, vocab=2048, hidden=256, layers=4)
    nbytes = path.stat().st_size
    assert nbytes > 5 * MiB
    cfg = SessionConfig(max_context=128, intra_op_threads=1)

    def loader(name):
        return DraftModel(name, DecoderSession(path, cfg), np.arange(2048), 2048), nbytes

    probe = PsutilProbe()
    ws = WorkingSet(0, loader, probe, time.monotonic, sizes={"d": nbytes})
    rng = np.random.default_rng(0)

    def cycle():
        lease = ws.lease("d")
        state = lease.proposer.begin(128)
        assert len(state.propose([5, 6, 7, 8], 4, SamplingParams(), rng).tokens) >= 1
        state.close()
        del state
        lease.release()
        assert ws.unload("d") >= nbytes  # its footprint: what the load added to the RSS (about 2x the file)

    cycle()  # warm-up: ORT's one-time allocations
    start = probe.rss_bytes()
    for _ in range(50):
        cycle()
    end = probe.rss_bytes()
    ws.close()
    assert ws.counters.loads == 51 and ws.counters.evictions == 51
    assert abs(end - start) <= 0.05 * start, f"RSS {start / MiB:.1f} MiB -> {end / MiB:.1f} MiB after 50 cycles"


def test_one_request_footprint_counts_the_slack_and_the_largest_draft_cache():
    from memspec.runtime.memory import request_kv_bytes

    per_token = lambda k: (lambda tokens: tokens * k)  # noqa: E731
    assert request_kv_bytes(100, per_token(10), [], slack=9) == 1090  # target only: no draft cache
    assert request_kv_bytes(100, per_token(10), [per_token(1), per_token(3)], slack=9) == 1090 + 327
    assert request_kv_bytes(100, per_token(10), iter([per_token(2)]), slack=0) == 1200


def test_the_cgroup_v2_limit_is_read_from_the_process_cgroup(tmp_path):
    from memspec.runtime.memory import cgroup_memory

    proc = tmp_path / "cgroup"
    folder = tmp_path / "fs" / "system.slice" / "memspec.service"
    folder.mkdir(parents=True)
    proc.write_text("0::/system.slice/memspec.service\n")
    (folder / "memory.max").write_text("max\n")  # no limit
    assert cgroup_memory(proc, tmp_path / "fs") is None
    (folder / "memory.max").write_text(f"{800 << 20}\n")
    (folder / "memory.high").write_text(f"{600 << 20}\n")  # throttled above this: the one that holds
    (folder / "memory.current").write_text(f"{450 << 20}\n")
    cg = cgroup_memory(proc, tmp_path / "fs")
    assert cg.limit == 600 << 20 and cg.available() == 150 << 20
    proc.write_text("4:memory:/x\n")  # cgroup v1 only
    assert cgroup_memory(proc, tmp_path / "fs") is None
    assert cgroup_memory(tmp_path / "missing", tmp_path / "fs") is None


def test_the_probe_and_the_budget_keep_to_the_cgroup_limit(tmp_path):
    from fakes import FakeLoader
    from memspec.runtime.memory import CgroupMemory, PsutilProbe
    from memspec.scheduling.config import SchedulerConfig
    from memspec.scheduling.scheduler import Scheduler

    (tmp_path / "memory.current").write_text(f"{900 << 20}\n")
    probe = PsutilProbe(CgroupMemory(tmp_path, 1000 << 20))
    assert probe.available_bytes() == 100 << 20 and probe.limit_bytes() == 1000 << 20
    (tmp_path / "memory.current").unlink()  # the cgroup went away: the system's figure holds
    assert probe.available_bytes() > 0

    fake = FakeProbe()
    fake.limit = 1600 * MiB  # the unit's MemoryHigh=
    sizes = {"d": MiB}
    sched = Scheduler(SchedulerConfig(policy="bandit", budget_mb=0), FakeLoader(sizes), sizes, fake)
    assert sched.ws.budget == 1040 * MiB  # budget_mb = 0 under a cgroup limit: what the unit's rule leaves
    sched.close()
    sched = Scheduler(SchedulerConfig(policy="bandit", budget_mb=300), FakeLoader(sizes), sizes, fake)
    assert sched.ws.budget == 300 * MiB  # a configured budget wins
    sched.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_preallocated_cache_holds_only_the_pages_its_positions_were_written_in():
    """A native KV cache (64 MiB here) is committed as its positions are written, as kv_cache_nbytes
    plans (regression: numpy's np.empty asked for transparent huge pages, and writing 30 positions
    committed and zeroed the whole array)."""
    from memspec.runtime.kvcache import committed_as_written, kv_cache_nbytes

    shape = (16, 2, 4, 4096, 64)  # (layers, K/V, kv heads, capacity, head_dim) float16
    before = _rss()
    kv = committed_as_written(shape, np.uint16)
    assert kv.shape == shape and kv.flags.writeable and not kv[:, :, :, :30].any()
    kv[:, :, :, :30, :] = 1
    grown = _rss() - before
    planned = kv_cache_nbytes(16 * 2 * 4, 64, 30, 4096, itemsize=2)
    assert grown <= planned + 2 * MiB, f"writing 30 positions committed {grown / MiB:.1f} MiB, planned {planned / MiB:.1f}"
    assert kv.nbytes == 64 * MiB
