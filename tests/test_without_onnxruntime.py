"""Without ONNX Runtime installed, the native engine, the speculation layer and the daemon import
and serve: memspec's own kernels need none of it, and nothing above runtime/ imports an engine
(tests/test_layers.py).  ONNX Runtime is hidden from a child process by a `sitecustomize` whose
import finder refuses every `onnxruntime*` module, as on a machine that never installed it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from memspec.request import GenerationRequest

TARGET = "smollm2-135m"
PROMPT = "Write a Python function that reverses a string."
TOKENS = 16

HIDE = '''
import importlib.abc
import sys


class HideOnnxRuntime(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0].startswith("onnxruntime"):
            raise ImportError(f"No module named {name!r} (hidden: this machine has no ONNX Runtime)")
        return None


sys.meta_path.insert(0, HideOnnxRuntime())
'''

GENERATE = '''
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import memspec.speculation.speculative  # the decode loop, with no ONNX Runtime
from memspec.build import build_engine
from memspec.config import load_config
from memspec.request import GenerationRequest

config = load_config(sys.argv[1])
engine = build_engine(config, drafts=sys.argv[2])
out = engine.generate(GenerationRequest(prompt=sys.argv[3], max_tokens=int(sys.argv[4])))
engine.close()
print(json.dumps({"token_ids": out.token_ids, "variant": engine.target.variant, "stats": out.stats.to_dict(),
                  "onnxruntime": sorted(m for m in sys.modules if m.startswith("onnxruntime"))}))
'''


@pytest.fixture(scope="module")
def hidden(tmp_path_factory) -> dict:
    """The environment of a child process that cannot import ONNX Runtime."""
    folder = tmp_path_factory.mktemp("no-ort")
    (folder / "sitecustomize.py").write_text(HIDE)
    path = os.pathsep.join([str(folder), str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path)


def native_config(folder: Path, home: Path, policy: str = "memspec") -> Path:
    path = folder / "native.toml"
    path.write_text(f'home = "{home}"\n[model]\ntarget = "{TARGET}"\n[runtime]\nbackend = "native"\n'
                    f'max_context = 512\n[scheduler]\npolicy = "{policy}"\n')
    return path


def test_the_hiding_holds(hidden):
    code = "import memspec.runtime.sessions"
    out = subprocess.run([sys.executable, "-c", code], env=hidden, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "ONNX Runtime is not installed" in out.stderr, out.stderr[-2000:]


@pytest.fixture(scope="module")
def target_only(model_store, tmp_path_factory) -> list[int]:
    """Greedy target-only output on the native engine, here, where ONNX Runtime is installed."""
    from memspec.build import build_engine
    from memspec.config import load_config

    engine = build_engine(load_config(str(native_config(tmp_path_factory.mktemp("ref"), model_store.home))),
                          drafts="none")
    try:
        return engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=TOKENS)).token_ids
    finally:
        engine.close()


@pytest.mark.parametrize("drafts", ["scheduler", "pool"])
def test_the_native_engine_generates_with_drafts(model_store, hidden, tmp_path, target_only, drafts):
    """The engine builds on the native engine, drafts with the store's GGUF drafts (the scheduler's,
    or the fixed pool), and greedy output is target-only output token for token."""
    config = native_config(tmp_path, model_store.home)
    out = subprocess.run([sys.executable, "-c", GENERATE, str(config), drafts, PROMPT, str(TOKENS)], env=hidden,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["onnxruntime"] == [] and got["variant"] == "gguf"
    assert got["token_ids"] == target_only
    if drafts == "scheduler":  # a draft model ran (the memspec policy, or prompt lookup / suffix)
        assert got["stats"]["num_drafts"] > 0, got["stats"]


def test_the_daemon_serves(model_store, hidden, target_only, monkeypatch):
    from test_daemon_e2e import Daemon

    with tempfile.TemporaryDirectory(prefix="ms-no-ort-") as d:  # short: socket paths are limited
        dm = Daemon(Path(d), model_store.home, name="n")
        dm.config.write_text(native_config(Path(d), model_store.home).read_text())
        monkeypatch.setenv("PYTHONPATH", hidden["PYTHONPATH"])
        dm.start(timeout=180)
        try:
            with dm.client(timeout=120) as c:
                done = [i for i in c.generate(PROMPT, max_tokens=TOKENS)][-1]
                status = c.status()
        finally:
            dm.stop()
    assert done.token_ids == target_only
    assert [r["variant"] for r in status["resident"] if r["role"] == "target"] == ["gguf"]


def test_drafts_that_need_onnx_runtime_are_left_out_and_said(monkeypatch, caplog):
    from memspec.runtime.config import SessionConfig
    from memspec.speculation.drafts import runnable_drafts, say_left_out

    gguf = types.SimpleNamespace(name="small-gguf", variants={"gguf": {}}, extra={})
    graph = types.SimpleNamespace(name="graph-only", variants={"q8": {}}, extra={})
    config = SessionConfig(backend="native")
    assert runnable_drafts([gguf, graph], config) == ([gguf, graph], [])  # ONNX Runtime is installed here
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # and now it is not
    kept, left = runnable_drafts([gguf, graph], config)
    if kept != [gguf]:  # the native kernels are not built here: no draft model runs at all
        from memspec.runtime import kernels

        assert not kernels.available() and kept == []
    assert graph in left
    with caplog.at_level("WARNING"):
        say_left_out(left, config)
    assert "graph-only" in caplog.text and "need ONNX Runtime" in caplog.text and "prompt lookup" in caplog.text
    assert "ONNX Runtime is not installed" in caplog.text


def test_a_draft_in_its_own_tokens_is_left_out_where_the_drafts_run_in_onnx_runtime(caplog):
    from memspec.runtime.config import SessionConfig
    from memspec.runtime import kernels
    from memspec.speculation.drafts import runnable_drafts, say_left_out

    text = types.SimpleNamespace(name="text-draft", variants={"gguf": {}}, extra={"tokenizer": "own"})
    gguf = types.SimpleNamespace(name="small-gguf", variants={"gguf": {}}, extra={})
    if kernels.available():
        assert runnable_drafts([text, gguf], SessionConfig(backend="native")) == ([text, gguf], [])
    kept, left = runnable_drafts([text, gguf], SessionConfig(backend="onnxruntime"))
    assert kept == [gguf] and left == [text]  # the GGUF draft's graph is built for ONNX Runtime; text has none
    with caplog.at_level("WARNING"):
        say_left_out(left, SessionConfig(backend="onnxruntime"))
    assert "text-draft" in caplog.text and "own tokens" in caplog.text and "need ONNX Runtime" not in caplog.text
