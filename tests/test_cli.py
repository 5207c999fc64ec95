"""The command line on bad input: a clear message and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def memspec(*args, home=None, timeout=300):
    env = dict(os.environ)
    if home is not None:
        env["MEMSPEC_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "memspec.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def home(model_store):
    return model_store.home


def test_generate_json_keys(home):
    r = memspec("generate", "--local", "--json", "--max-tokens", "8", "What is the capital of France?", home=home)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"prompt_token_ids", "token_ids", "text", "finish_reason", "timings", "stats"} <= set(out)
    assert len(out["token_ids"]) <= 8 and out["finish_reason"] in ("eos", "length")
    assert out["prompt_token_ids"][:3] == [1, 9690, 198]  # <|im_start|>system\n: the chat template


@pytest.mark.parametrize("args, message", [
    (["generate", "--local", ""], "prompt is empty"),
    (["generate", "--local", "   "], "prompt is empty"),
    (["generate", "--local", "--max-tokens", "0", "hi"], "--max-tokens must be at least 1, got 0"),
    (["generate", "--local", "--max-tokens", "-5", "hi"], "--max-tokens must be at least 1, got -5"),
    (["generate", "--local", "--temperature", "9", "hi"], "temperature: 9.0 is out of range"),
    (["generate", "--local", "--top-p", "0", "hi"], "top_p: 0.0 is out of range"),
    (["generate", "--local", "--draft", "no-such-draft", "hi"], "unknown draft 'no-such-draft'"),
])
def test_bad_generate_arguments(home, args, message):
    r = memspec(*args, home=home)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_prompt_longer_than_context(home, tmp_path):
    cfg = tmp_path / "small.toml"
    cfg.write_text("[runtime]\nmax_context = 64\n")
    r = memspec("--config", str(cfg), "generate", "--local", "--raw", "word " * 200, home=home)
    assert r.returncode != 0
    assert "do not fit the context of 64 tokens" in r.stderr, r.stderr


def test_missing_model(tmp_path):
    r = memspec("generate", "--local", "hello", home=tmp_path / "empty-store")
    assert r.returncode != 0
    assert "model 'smollm2-135m' is not in the store" in r.stderr and "memspec pull smollm2-135m" in r.stderr


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    r = memspec("pull", "--gguf", str(bad), home=tmp_path / "store")
    assert r.returncode != 0
    assert "not a readable GGUF file" in r.stderr, r.stderr


def test_bad_config_file(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[runtime]\nmax_contxt = 64\n")
    r = memspec("--config", str(cfg), "models", home=tmp_path)
    assert r.returncode != 0
    assert "unknown option(s) max_contxt" in r.stderr, r.stderr


def test_models_lists_the_store(home):
    r = memspec("models", home=home)
    assert r.returncode == 0 and "smollm2-135m" in r.stdout and "fp32,q4" in r.stdout
