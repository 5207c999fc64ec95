"""The docs against the code: every `module.function` or `Class.method` docs/architecture.md names
exists, every file it names is there, and it names every module of the package; docs/reference.md
is what scripts/reference.py makes from the parser, memspec.example.toml and the environment
variables the code reads.  No model needed."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "memspec"
ARCHITECTURE = REPO / "docs" / "architecture.md"
FILE_SUFFIXES = (".py", ".c", ".h", ".inc", ".json", ".toml", ".md", ".proto", ".service", ".jsonl", ".sock")
ELSEWHERE = {"ggml-common.h"}  # files of other projects the page points at (llama.cpp's block layouts)
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(\(\))?")


def spans(text: str) -> list[str]:
    """Every `code span` of a page, outside fenced blocks."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return re.findall(r"`([^`\n]+)`", text)


def package_modules() -> list[str]:
    """memspec's modules by dotted name (packages by their own name), generated code left out."""
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(REPO).with_suffix("")
        if "_proto" not in rel.parts:
            out.append(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    return out


def defining_modules(class_name: str) -> list[str]:
    """The modules that define a class or protocol of this name."""
    pattern = re.compile(rf"^class {re.escape(class_name)}\b", re.MULTILINE)
    return [m for m in package_modules() if pattern.search(_source(m))]


def _source(module: str) -> str:
    path = REPO.joinpath(*module.split("."))
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def resolves(ref: str) -> bool:
    """`runtime.plan.plan`, `drafts.ModelDraftState`, `WorkingSet.reserve`, `Engine.close()`: the
    longest leading run of names that is a module (or a class, by its name) of the package, then
    the rest as attributes.  A short module name may be any of the modules that end with it."""
    parts = ref.removesuffix("()").split(".")
    if parts[0] == "memspec":
        try:
            if importlib.util.find_spec(".".join(parts)) is not None:
                return True  # a module by its full name (a compiled one too: memspec.runtime._native)
        except ModuleNotFoundError:
            pass
    for cut in range(len(parts) - 1, 0, -1):
        head, rest = ".".join(parts[:cut]), parts[cut:]
        modules = [m for m in package_modules() if m == f"memspec.{head}" or m.endswith(f".{head}")]
        for module in modules:
            obj = importlib.import_module(module)
            if _has(obj, rest):
                return True
    for module in defining_modules(parts[0]):
        if _has(getattr(importlib.import_module(module), parts[0]), parts[1:]):
            return True
    return False


def _has(obj, names: list[str]) -> bool:
    for name in names:
        annotations = getattr(obj, "__annotations__", {}) if isinstance(obj, type) else {}
        fields = getattr(obj, "__dataclass_fields__", {})
        if hasattr(obj, name):
            obj = getattr(obj, name)
        elif name in annotations or name in fields:  # a protocol's or dataclass's field, no value on the class
            return name == names[-1]
        else:
            return False
    return True


def code_references(text: str) -> list[str]:
    return sorted({s for s in spans(text) if DOTTED.fullmatch(s) and not s.endswith(FILE_SUFFIXES)})


def file_references(text: str) -> list[str]:
    return sorted({s for s in spans(text) if re.fullmatch(r"[\w./-]+\.(py|c|h|inc|proto)", s)})


def test_code_references_find_dotted_names_and_skip_files():
    text = "`drafts.load_pool`, `Engine.close()`, `serving/http.py`, `costs.json`, `--listen`, `x`\n```\n`a.b`\n```"
    assert code_references(text) == ["Engine.close()", "drafts.load_pool"]
    assert file_references(text) == ["serving/http.py"]


def test_resolves_tells_a_moved_function_from_a_present_one():
    assert resolves("build.load_pool") and resolves("runtime.plan.plan") and resolves("WorkingSet.reserve")
    assert not resolves("drafts.load_pool")  # it moved to build.py (issue 70)
    assert not resolves("memory.planned_footprint")  # now planned_draft_footprint and planned_target_footprint


def test_every_name_architecture_md_gives_exists():
    missing = [ref for ref in code_references(ARCHITECTURE.read_text()) if not resolves(ref)]
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"


def test_every_bare_name_architecture_md_gives_is_in_the_source():
    """`WorkingSet`, `draft_footprints`, `k_update`: a name of four characters or more, alone in
    backticks, is a word of the package's Python, C or tests."""
    sources = [*PACKAGE.rglob("*.py"), *(PACKAGE / "runtime" / "native").glob("*.[ch]"),
               *(PACKAGE / "runtime" / "native").glob("*.inc"), *(REPO / "tests").rglob("*.py"),
               *(REPO / "tests" / "native").glob("*.c"), REPO / "setup.py"]
    words = set(re.findall(r"\w+", "\n".join(f.read_text() for f in sources if "_proto" not in f.parts)))
    names = {s.split("(")[0] for s in spans(ARCHITECTURE.read_text())}
    missing = sorted(n for n in names if re.fullmatch(r"[A-Za-z_]\w{3,}", n) and n not in words)
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"


def test_every_file_architecture_md_gives_exists():
    def found(name: str) -> bool:
        if name in ELSEWHERE:
            return True
        roots = [PACKAGE, PACKAGE / "runtime" / "native", REPO, REPO / "tests", REPO / "tests" / "native"]
        return any((root / name).exists() for root in roots) or (
            "/" not in name and any(PACKAGE.rglob(name)))

    missing = [f for f in file_references(ARCHITECTURE.read_text()) if not found(f)]
    assert not missing, f"docs/architecture.md names files that are not there: {missing}"


def test_architecture_md_names_every_module():
    text = ARCHITECTURE.read_text()
    named = {Path(s).name for s in spans(text) if s.endswith(".py")}
    named |= {w for s in spans(text) for w in re.findall(r"[\w]+\.py", s)}  # lists such as `a.py`, `b.py`
    leaves = {m.rsplit(".", 1)[-1] + ".py" for m in package_modules()
              if not REPO.joinpath(*m.split(".")).is_dir() and not m.rsplit(".", 1)[-1].startswith("_")}
    absent = sorted(leaves - named)
    assert not absent, f"docs/architecture.md does not mention these modules of memspec/: {absent}"


# -- the reference page ---------------------------------------------------------------------------
def _reference():
    spec = importlib.util.spec_from_file_location("reference", REPO / "scripts" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_md_is_what_the_generator_makes_now():
    reference = _reference()
    page = (REPO / "docs" / "reference.md").read_text()
    assert page == reference.render(), (
        "docs/reference.md is stale: run `.venv/bin/python scripts/reference.py` and commit the page")


def test_the_reference_lists_every_environment_variable_the_code_reads():
    reference = _reference()
    read = reference.variables_read()
    assert {"MEMSPEC_HOME", "MEMSPEC_ADDRESS", "MEMSPEC_API_KEY", "MEMSPEC_NATIVE_ISA"} <= read
    undescribed = sorted(read - set(reference.ENVIRONMENT))
    assert not undescribed, f"describe these in scripts/reference.py's ENVIRONMENT: {undescribed}"
    unread = sorted(set(reference.ENVIRONMENT) - read)
    assert not unread, f"scripts/reference.py describes variables no code reads: {unread}"


def test_the_reference_lists_every_flag_and_config_key():
    reference = _reference()
    page = reference.render()
    parser = reference.parsers()
    for command, p in parser.items():
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):  # every command's -h, --help: the page says so once
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in page, (command, flag)
    from memspec.config import load_config

    config = load_config(REPO / "memspec.example.toml")
    for section, key, _value, _comment in reference.config_keys():
        owner = getattr(config, section) if section else config
        assert hasattr(owner, key), (section, key)
        assert f"`{key}`" in page


def test_config_keys_keep_the_comment_right_above_each_key(tmp_path):
    reference = _reference()
    f = tmp_path / "c.toml"
    f.write_text("# the file\n\nhome = \"\"\n[x]\n# a comment\n#   an example\nkey = 1\n\nbare = 2\n"
                 "hash = \"a # b\"  # a comment on the line\n")
    assert reference.config_keys(f) == [("", "home", '""', ""), ("x", "key", "1", "a comment\n  an example"),
                                        ("x", "bare", "2", ""), ("x", "hash", '"a # b"', "")]


# -- the README and the results page --------------------------------------------------------------
def test_the_readme_is_a_page_a_newcomer_reads():
    """Issue 70: 120-200 lines, a figures table of at most 6 rows, each naming its machine and workload, and the
    two commands CI runs (.ci/run): the setup and the tests."""
    readme = (REPO / "README.md").read_text()
    assert 120 <= len(readme.splitlines()) <= 200, len(readme.splitlines())
    figures = readme.split("\n## Figures", 1)[1].split("\n## ", 1)[0]
    table = [line for line in figures.splitlines() if line.startswith("| ")]
    assert "| machine |" in table[0] and "| workload |" in table[0], table[0]
    assert 1 <= len(table[2:]) <= 6, table  # rows past the header and its rule
    ci = (REPO / ".ci" / "run").read_text()
    for command in ("./setup.sh", ".venv/bin/python -m pytest -q"):
        assert command in readme and command in ci, command


def test_results_md_holds_the_current_results_only():
    page = (REPO / "docs" / "results.md").read_text()
    assert len(page.splitlines()) < 600, len(page.splitlines())
    assert (REPO / "docs" / "history" / "results.md").exists()
