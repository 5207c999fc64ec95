"""The package's layers: data flows one way, no import (at module level, inside a function, or for
type checking only) runs back up a layer, no two modules of a layer import each other round a
circle, and nothing above runtime/ imports an engine.  Read from the source with `ast`, so it needs
no model (nor ONNX Runtime, nor the native kernels)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "memspec"

# lowest first; a module may import its own layer and the ones below it
LAYERS = [
    {"memspec", "memspec.errors", "memspec.request", "memspec.config"},  # values every layer shares
    {"memspec.models", "memspec.runtime"},  # models on disk; the engines behind their contracts, the planner, memory
    {"memspec.speculation"},  # sampling, drafts, the decode loop, the engine
    {"memspec.scheduling"},  # policies, working set, predictor: the engine's draft source
    {"memspec.build"},  # composition: an engine and its draft source from a config
    {"memspec.serving"},  # the daemon and its client
    {"memspec.training", "memspec.bench", "memspec.doctor"},  # developer tooling; the machine's report
    {"memspec.cli", "memspec.__main__"},  # the command line (`memspec`, `python -m memspec`)
]


# the modules that run a target on one engine: ONNX Runtime (sessions, batch) or memspec's native kernels;
# above runtime/ a target is only its contract (memspec.runtime.contracts), opened by the loader
ENGINES = {"memspec.runtime.sessions", "memspec.runtime.batch", "memspec.runtime.native_target"}


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


def modules() -> dict[str, Path]:
    """Every module of the package by name, its compiled extensions (memspec.runtime._native) too."""
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE.parent).with_suffix("")
        if "_proto" not in rel.parts:
            out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    for f in sorted(PACKAGE.rglob("*.so")) + sorted(PACKAGE.rglob("*.pyd")):
        rel = f.relative_to(PACKAGE.parent)
        out[".".join(rel.parts[:-1] + (rel.name.split(".")[0],))] = f
    return out


def imports() -> list[tuple[str, str, int]]:
    """(importing module, imported module, line) for every memspec import in the package; `from
    memspec.x import y` imports memspec.x.y where that is a module, else memspec.x."""
    known = modules()
    out = []
    for module, f in known.items():
        if f.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "memspec":
                out += [(module, f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module,
                         node.lineno) for a in node.names]
            elif isinstance(node, ast.Import):
                out += [(module, a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "memspec"]
    return out


def cycles(edges: list[tuple[str, str, int]]) -> list[list[str]]:
    """The import circles among `edges`' modules: each strongly connected set of two or more
    modules, as one circle through them (Tarjan's algorithm, then a path back to the start)."""
    graph: dict[str, set[str]] = {}
    for m, target, _ in edges:
        if m != target:
            graph.setdefault(m, set()).add(target)
            graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(members) > 1:
                found.append(circle(graph, sorted(members)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def circle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A path from members[0] back to itself inside `members` (breadth first: the shortest)."""
    start, inside = members[0], set(members)
    paths = {w: [start, w] for w in sorted(graph[start] & inside)}
    frontier = list(paths)
    while start not in paths:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return paths[start]


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


def test_no_layer_imports_round_a_circle():
    """Within a layer modules import one way too: a circle (a imports b, which imports a) means
    neither can be read, tested or replaced without the other."""
    found = imports()
    circles = [" -> ".join(c) for level in range(len(LAYERS))
               for c in cycles([e for e in found if layer_of(e[0]) == layer_of(e[1]) == level])]
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_nothing_above_runtime_imports_an_engine():
    """The speculation layer and everything above it know a target by its contract alone, so that
    they import (and the native engine serves) on a machine without ONNX Runtime."""
    floor = layer_of("memspec.speculation")
    direct = [f"{m}:{line} imports {target}" for m, target, line in imports()
              if layer_of(m) >= floor and (target in ENGINES or target.rsplit(".", 1)[0] in ENGINES)]
    assert not direct, "\n".join(direct)
    assert ENGINES <= set(modules()), "an engine module was renamed: update ENGINES"


def test_a_circle_and_an_engine_import_would_be_seen():
    edges = [("memspec.runtime.a", "memspec.runtime.b", 1), ("memspec.runtime.b", "memspec.runtime.c", 2),
             ("memspec.runtime.c", "memspec.runtime.a", 3), ("memspec.runtime.c", "memspec.runtime.d", 4)]
    assert cycles(edges) == [["memspec.runtime.a", "memspec.runtime.b", "memspec.runtime.c", "memspec.runtime.a"]]
    assert cycles(edges[:2] + edges[3:]) == []
    floor = layer_of("memspec.speculation")
    assert layer_of("memspec.speculation.engine") >= floor > layer_of("memspec.runtime.sessions")
