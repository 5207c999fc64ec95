"""The package's layers: data flows one way, and no import (at module level or inside a
function) runs back up a layer.  Read from the source with `ast`, so it needs no model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "memspec"

# lowest first; a module may import its own layer and the ones below it
LAYERS = [
    {"memspec", "memspec.errors", "memspec.request", "memspec.config"},  # values every layer shares
    {"memspec.models", "memspec.runtime"},  # models on disk; ONNX Runtime sessions and memory
    {"memspec.speculation"},  # sampling, drafts, the decode loop, the engine
    {"memspec.scheduling"},  # policies, working set, predictor: the engine's draft source
    {"memspec.build"},  # composition: an engine and its draft source from a config
    {"memspec.serving"},  # the daemon and its client
    {"memspec.training", "memspec.bench", "memspec.doctor"},  # developer tooling; the machine's report
    {"memspec.cli", "memspec.__main__"},  # the command line (`memspec`, `python -m memspec`)
]


def layer_of(module: str) -> int:
    """The layer of a module; each sub-package's config.py is a plain dataclass, at the bottom."""
    if module.endswith(".config") or module.startswith("memspec._proto"):
        return 0
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        for level, names in enumerate(LAYERS):
            if ".".join(parts[:i]) in names:
                return level
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: add it")


def imports() -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every memspec import in the package."""
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE.parent).with_suffix("")
        if "_proto" in rel.parts:
            continue
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "memspec":
                out += [(module, node.module, node.lineno)]
            elif isinstance(node, ast.Import):
                out += [(module, a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "memspec"]
    return out


def test_the_layer_table_sees_every_import():
    found = imports()
    assert len(found) > 100 and {m for m, _, _ in found} >= {"memspec.speculation.engine", "memspec.cli"}


def test_no_import_runs_back_up_a_layer():
    upward = [f"{m}:{line} imports {target} (layer {layer_of(m)} -> {layer_of(target)})"
              for m, target, line in imports() if layer_of(target) > layer_of(m)]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module,target", [("memspec.speculation.engine", "memspec.scheduling.scheduler"),
                                           ("memspec.runtime.sessions", "memspec.speculation.drafts")])
def test_an_upward_import_would_be_seen(module, target):
    assert layer_of(target) > layer_of(module)
