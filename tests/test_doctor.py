"""`memspec doctor`: its arithmetic on fakes, its probes on fake files, and the command in process on
an empty store and on a store holding SmolLM2's GGUF alone (a copy of the real one's entry, so that
what others pull into the real store changes nothing here)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from memspec import cli, doctor
from memspec.runtime import kernels

TOP_KEYS = {"schema", "memspec", "ok", "problems", "warnings", "system", "kernels", "onnxruntime", "gpu", "memory",
            "bandwidth", "default_target", "targets", "exactness", "speed"}
SECTION_KEYS = {  # the schema memspec/doctor.py documents
    "system": {"os", "machine", "cpu", "physical_cores", "logical_cores", "python"},
    "kernels": {"built", "isa", "isa_name", "isas", "forced", "error"},
    "onnxruntime": {"installed", "version", "providers", "cuda", "tensorrt", "error"},
    "gpu": {"found", "name", "memory_bytes", "source", "variant", "pulled", "note"},
    "memory": {"total_bytes", "available_bytes", "cgroup_limit_bytes", "budget_bytes", "budget_from"},
    "bandwidth": {"bytes_per_s", "buffer_bytes", "passes", "threads", "seconds", "others_cpu_share"},
    "default_target": {"name", "variant", "engine", "pulled", "footprint_bytes", "context", "context_reason",
                       "kv"},
}
TARGET_KEYS = {"name", "default", "engine", "variant", "bytes_per_token", "limit_tok_per_s", "error"}
EXACTNESS_KEYS = {"engine", "variant", "exact", "pad_rows", "max_diff", "reason", "load_s", "error"}
SPEED_KEYS = {"engine", "variant", "tokens", "tok_per_s", "limit_tok_per_s", "share_of_limit", "others_cpu_share"}


class FakeClock:
    """Advances `step` seconds each time it is read."""

    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


@pytest.fixture
def quick(monkeypatch):
    """A bandwidth probe of 0.1 s over 64 MiB, so that a whole report takes about a second."""
    monkeypatch.setattr(doctor, "PROBE_SECONDS", 0.1)
    monkeypatch.setattr(doctor, "PROBE_MIN_BYTES", 64 << 20)
    monkeypatch.setattr(doctor, "largest_cache", lambda: 0)


def run(capsys, *args, home: Path, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.setenv("MEMSPEC_HOME", str(home))
    rc = cli.main(["doctor", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# -- arithmetic --------------------------------------------------------------------------------
def test_bandwidth_is_the_median_pass():
    # 1 GB read in 0.5 s (median of 0.25, 0.5 and a pass that other work slowed to 3 s): 2 GB/s
    assert doctor.median_bandwidth(10**9, [0.25, 3.0, 0.5]) == 2e9
    with pytest.raises(ValueError, match="positive"):
        doctor.median_bandwidth(10**9, [0.5, 0.0])
    with pytest.raises(ValueError):
        doctor.median_bandwidth(10**9, [])


def test_decode_limit_is_bandwidth_over_bytes_read_a_token():
    assert doctor.decode_limit(100 * 10**6, 30e9) == pytest.approx(300.0)  # 100 MB a token at 30 GB/s
    assert doctor.decode_limit(980_097_536, 32.2e9) == pytest.approx(32.854, rel=1e-4)
    with pytest.raises(ValueError, match="positive"):
        doctor.decode_limit(0, 30e9)


def test_time_passes_runs_for_its_budget_and_at_least_min_passes():
    calls = []
    # each clock read adds 0.1 s: a pass reads it twice (0.1 s apart), the loop's check once more
    seconds = doctor.time_passes(lambda: calls.append(1), budget_s=1.0, min_passes=3, clock=FakeClock(0.1))
    assert seconds == pytest.approx([0.1] * len(seconds)) and len(seconds) == len(calls)
    assert 3 <= len(seconds) and len(seconds) * 0.3 >= 1.0 - 0.3  # stopped once the budget was spent
    few = doctor.time_passes(lambda: None, budget_s=0.0, min_passes=3, clock=FakeClock(5.0))
    assert len(few) == 3  # slow passes: still three of them


def test_probe_bandwidth_divides_the_buffer_by_the_median_pass(monkeypatch):
    monkeypatch.setattr(doctor, "PROBE_MIN_BYTES", 8 << 20)
    monkeypatch.setattr(doctor, "largest_cache", lambda: 1 << 20)  # 16 x 1 MiB: 16 MiB, more than the minimum
    out = doctor.probe_bandwidth(threads=2, available_bytes=1 << 40, budget_s=0.5, clock=FakeClock(0.05))
    assert out["buffer_bytes"] == 16 << 20 and out["threads"] == 2
    assert out["bytes_per_s"] == pytest.approx((16 << 20) / 0.05)  # every fake pass took 0.05 s
    assert out["passes"] >= doctor.MIN_PASSES
    monkeypatch.setattr(doctor, "PROBE_MIN_BYTES", 1 << 30)
    small = doctor.probe_bandwidth(threads=1, available_bytes=400 << 20, budget_s=0.0, clock=FakeClock(0.05))
    assert small["buffer_bytes"] == 100 << 20  # never more than a quarter of what is available
    tiny = doctor.probe_bandwidth(threads=1, available_bytes=16 << 20, budget_s=0.0, clock=FakeClock(0.05))
    assert tiny["buffer_bytes"] == 64 << 20  # ... nor less than 64 MiB


class CountingTarget:
    """A target whose greedy next token is always its input + 1 (mod vocab)."""

    vocab_size = 50

    def __init__(self):
        self.fed: list[list[int]] = []

    def new_cache(self, capacity):
        return capacity

    def forward(self, cache, ids, keep=1):
        self.fed.append(list(ids))
        logits = np.zeros((keep, self.vocab_size), dtype=np.float32)
        logits[-1, (ids[-1] + 1) % self.vocab_size] = 1.0
        return logits


def test_decode_speed_feeds_its_own_greedy_tokens_one_a_pass():
    t = CountingTarget()
    tok_s = doctor.decode_speed(t, tokens=5, clock=FakeClock(0.01))  # every pass: 0.01 s apart on the clock
    assert tok_s == pytest.approx(100.0)
    prompt, *steps = t.fed
    assert len(prompt) == 16 and len(steps) == 5 and all(len(s) == 1 for s in steps)
    assert [s[0] for s in steps] == [(prompt[-1] + i) % 50 for i in range(1, 6)]  # each pass its argmax


def test_a_busy_machine_is_named_in_the_warnings():
    quiet = {"bandwidth": {"others_cpu_share": 0.1}, "speed": None}
    assert doctor.busy_warnings(quiet) == []
    busy = {"bandwidth": {"others_cpu_share": 0.6}, "speed": {"others_cpu_share": 0.3}}
    assert doctor.busy_warnings(busy) == [
        "other processes used 60% of the CPU during the bandwidth probe: its figures read low; run it again on an "
        "idle machine",
        "other processes used 30% of the CPU during the --speed decode: its figures read low; run it again on an "
        "idle machine"]


def test_largest_cache_reads_sysfs(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "32M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "size").write_text("unknown\n")  # skipped, not fatal
    assert doctor.largest_cache(tmp_path) == 32 << 20
    assert doctor.largest_cache(tmp_path / "none") == 0


def _gguf(path: Path, head: bool) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))  # 2048 bytes
    w.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float32))  # 4096
    if head:
        w.add_tensor("output.weight", np.zeros((16, 32), dtype=np.float32))  # 2048
    w.add_tensor("output_norm.weight", np.zeros(40, dtype=np.float32))  # 160, padded to 192 if not last
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bytes_per_token_counts_every_weight_but_an_untied_embedding(tmp_path):
    tied = _gguf(tmp_path / "tied.gguf", head=False)
    untied = _gguf(tmp_path / "untied.gguf", head=True)
    # the head is the embedding: read whole; a head of its own: the embedding's 2048 bytes are not read
    assert doctor.bytes_per_token(tied) == 2048 + 4096 + 160
    assert doctor.bytes_per_token(untied) == 4096 + 2048 + 160


# -- the machine's probes on fake files ---------------------------------------------------------------
def test_gpu_from_nvidia_smi():
    calls = []

    def smi(cmd):
        calls.append(cmd)
        return "NVIDIA H200, 143771\n"

    g = doctor.gpu_section(run=smi, root=Path("/nonexistent"))
    assert g == {"found": True, "name": "NVIDIA H200", "memory_bytes": 143771 << 20, "source": "nvidia-smi"}
    assert calls[0][0] == "nvidia-smi"


def test_gpu_memory_nvidia_smi_does_not_know_is_the_shared_memory():
    g = doctor.gpu_section(run=lambda cmd: "Orin (nvgpu), [N/A]\n", root=Path("/nonexistent"), total_memory=8 << 30)
    assert g["name"] == "Orin (nvgpu)" and g["memory_bytes"] == 8 << 30


def test_gpu_from_the_driver_then_a_jetson_then_none(tmp_path):
    info = tmp_path / "proc/driver/nvidia/gpus/0000:01:00.0/information"
    info.parent.mkdir(parents=True)
    info.write_text("Model: \t\t NVIDIA GeForce RTX 3060\nIRQ:   120\n")
    g = doctor.gpu_section(run=lambda cmd: None, root=tmp_path)
    assert g["found"] and g["name"] == "NVIDIA GeForce RTX 3060" and g["memory_bytes"] is None

    shutil.rmtree(tmp_path / "proc/driver")
    model = tmp_path / "proc/device-tree/model"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super\x00")
    g = doctor.gpu_section(run=lambda cmd: None, root=tmp_path, total_memory=8 << 30)
    assert g["name"].startswith("NVIDIA Jetson Orin Nano") and g["memory_bytes"] == 8 << 30  # shared memory

    model.write_bytes(b"Raspberry Pi 5 Model B Rev 1.0\x00")
    assert doctor.gpu_section(run=lambda cmd: None, root=tmp_path)["found"] is False
    assert doctor.gpu_section(run=lambda cmd: "", root=tmp_path / "nothing")["found"] is False


def test_os_name_from_os_release(tmp_path):
    release = tmp_path / "os-release"
    release.write_text('NAME="Ubuntu"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n')
    assert doctor.os_name(release).startswith("Ubuntu 22.04.4 LTS (kernel ")
    assert doctor.os_name(tmp_path / "missing")  # platform's words instead


# -- the command ----------------------------------------------------------------------------------------
def test_an_empty_store_cannot_serve(tmp_path, capsys, monkeypatch, quick):
    rc, out, _ = run(capsys, "--json", home=tmp_path / "empty", monkeypatch=monkeypatch)
    report = json.loads(out)
    assert rc == 1 and report["ok"] is False
    assert set(report) == TOP_KEYS
    assert any("smollm2-135m is not pulled" in p and "memspec pull smollm2-135m" in p for p in report["problems"])
    assert report["default_target"]["pulled"] is False and report["targets"] == [] and report["exactness"] == []
    rc, out, _ = run(capsys, home=tmp_path / "empty", monkeypatch=monkeypatch)
    assert rc == 1 and "problem     the default target smollm2-135m is not pulled" in out
    assert out.rstrip().endswith("memspec cannot serve here (the problems above say what to do)")


def test_doctor_help_imports_no_numpy():
    from test_cli import HEAVY, imported, memspec

    r = memspec("doctor", "--help", python=("-X", "importtime"))
    assert r.returncode == 0 and "--speed" in r.stdout and "--json" in r.stdout, r.stderr[-2000:]
    assert not imported(r.stderr) & set(HEAVY)


def test_a_forced_kernel_path_this_cpu_lacks_cannot_serve(tmp_path):
    """The extension refuses to import under such a $MEMSPEC_NATIVE_ISA: a fresh process, with it set."""
    import subprocess
    import sys

    lacking = next(isa for isa in ("neon", "avx512", "avx2") if isa not in kernels.isas())
    env = dict(os.environ, MEMSPEC_HOME=str(tmp_path), MEMSPEC_NATIVE_ISA=lacking)
    code = ("import sys; from memspec import doctor, cli; doctor.PROBE_SECONDS = 0.1; "
            "sys.exit(cli.main(['doctor', *sys.argv[1:]]))")
    r = subprocess.run([sys.executable, "-c", code, "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["kernels"]["forced"] == lacking and f"MEMSPEC_NATIVE_ISA='{lacking}'" in report["kernels"]["error"]
    assert report["problems"] == [f"the native kernels do not load: {report['kernels']['error']}"]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "kernels     NOT LOADING: MEMSPEC_NATIVE_ISA=" in r.stdout, r.stdout + r.stderr


@pytest.fixture
def gguf_only_home(tmp_path) -> Path:
    """A store with smollm2-135m as a pull where the native engine runs it leaves it: its GGUF, no graph
    (the manifest and tokenizer copied from the real store, the GGUF linked)."""
    from memspec.models.store import ModelStore, default_home

    real = ModelStore(default_home())
    try:
        m = real.get("smollm2-135m")
        gguf = real.gguf_of(m)
    except Exception as exc:  # noqa: BLE001 (whatever keeps the real model away)
        pytest.skip(f"smollm2-135m is not pulled with its GGUF: {exc}")
    home = tmp_path / "home"
    folder = home / "models" / m.name
    folder.mkdir(parents=True)
    data = json.loads((m.folder / "manifest.json").read_text())
    data["variants"] = {}
    (folder / "manifest.json").write_text(json.dumps(data))
    for rec in m.tokenizer.values():
        shutil.copy(m.folder / rec["path"], folder / rec["path"])
    (home / "downloads").mkdir()
    os.symlink(gguf, home / "downloads" / gguf.name)
    return home


@pytest.mark.model
def test_the_report_on_this_machine(gguf_only_home, capsys, monkeypatch, quick):
    rc, out, _ = run(capsys, "--json", "--speed", home=gguf_only_home, monkeypatch=monkeypatch)
    r = json.loads(out)
    assert rc == 0 and r["ok"] and r["problems"] == [], r["problems"]
    assert set(r) == TOP_KEYS and r["schema"] == 1
    for section, keys in SECTION_KEYS.items():
        assert set(r[section]) == keys, section
    assert r["kernels"]["built"] and r["kernels"]["isa"] == kernels.isa()
    assert r["kernels"]["isas"] == list(kernels.isas())
    [t] = r["targets"]
    assert set(t) == TARGET_KEYS and t["default"] and t["engine"] == "native" and t["variant"] == "gguf"
    assert t["bytes_per_token"] == 96_576_768  # SmolLM2's GGUF (98,362,432 bytes) less its metadata
    assert t["limit_tok_per_s"] == pytest.approx(r["bandwidth"]["bytes_per_s"] / t["bytes_per_token"])
    native, ort = r["exactness"]
    assert set(native) == set(ort) == EXACTNESS_KEYS
    assert native["engine"] == "native" and native["exact"] is True and native["max_diff"] == 0.0
    assert ort["engine"] == "onnxruntime" and ort["exact"] is None and "--variant q4" in ort["error"]
    sp = r["speed"]
    assert set(sp) == SPEED_KEYS and sp["engine"] == "native" and sp["tokens"] == doctor.SPEED_TOKENS
    assert sp["tok_per_s"] > 0 and sp["share_of_limit"] == pytest.approx(sp["tok_per_s"] / t["limit_tok_per_s"])
    assert r["default_target"]["footprint_bytes"] > 98_362_432  # the mapped GGUF and the pass's buffers
    # the context the daemon would give it: "auto", SmolLM2's trained 8,192 within the available memory
    d = r["default_target"]
    assert 0 < d["context"] <= 8192 and d["context_reason"].startswith("auto: the model's trained context 8192")
    assert d["kv"] == "f16"  # [runtime] kv's default, shown with the context

    rc, text, _ = run(capsys, home=gguf_only_home, monkeypatch=monkeypatch)
    assert rc == 0
    lines = {line.split()[0] for line in text.splitlines()[1:]}
    assert {"system", "cpu", "kernels", "onnxruntime", "gpu", "memory", "bandwidth", "target", "exactness",
            "verdict"} <= lines
    assert f"path {kernels.isa()} " in text and "smollm2-135m on native: exact" in text
    assert f"context     smollm2-135m: {d['context']:,} tokens (auto: " in text and "), KV f16" in text
    assert "speed" not in lines  # without --speed


@pytest.mark.model
def test_without_the_kernels_neither_engine_runs_a_gguf_only_target(gguf_only_home, capsys, monkeypatch, quick):
    monkeypatch.setattr(kernels, "_native", None)
    rc, out, _ = run(capsys, "--json", home=gguf_only_home, monkeypatch=monkeypatch)
    r = json.loads(out)
    assert rc == 1 and not r["ok"]
    assert r["kernels"] == dict(r["kernels"], built=False, isa=None, error=kernels.NOT_BUILT)
    assert r["default_target"]["engine"] == "onnxruntime"  # auto falls back to ONNX Runtime ...
    [problem] = r["problems"]  # ... which has no graph to run
    assert "does not load on the onnxruntime engine" in problem and "--variant q4" in problem
    assert "native kernels are not built" in problem
    assert [e["exact"] for e in r["exactness"]] == [None, None]
    [t] = r["targets"]
    assert t["engine"] == "onnxruntime" and t["limit_tok_per_s"] is None
    assert t["error"] == "no q4 graph for ONNX Runtime: memspec pull smollm2-135m --variant q4"


@pytest.mark.model
def test_a_budget_below_the_footprint_cannot_serve(gguf_only_home, tmp_path, capsys, monkeypatch, quick):
    config = tmp_path / "memspec.toml"
    config.write_text("[scheduler]\nbudget_mb = 64\n")
    rc, out, _ = run(capsys, "--config", str(config), home=gguf_only_home, monkeypatch=monkeypatch)
    assert rc == 1
    [problem] = [line for line in out.splitlines() if line.startswith("problem")]
    assert "the memory budget (64 MiB, from [scheduler] budget_mb) is below smollm2-135m's footprint" in problem
    assert "raise [scheduler] budget_mb" in problem
