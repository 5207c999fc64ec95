"""What ships around the code: the example config, the systemd unit, the gRPC codegen."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memspec.serving import proto
from memspec.config import _SECTIONS, Config, load_config, tomllib

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "memspec.example.toml"
UNIT = REPO / "systemd" / "memspec.service"


# -- memspec.example.toml ---------------------------------------------------------------------
def test_example_config_loads_and_holds_the_defaults():
    assert load_config(EXAMPLE) == Config()


def test_example_config_documents_every_option():
    data = tomllib.loads(EXAMPLE.read_text())
    lines = EXAMPLE.read_text().splitlines()
    missing, undocumented = [], []
    for section, cls in [(None, Config), *_SECTIONS.items()]:
        table = data if section is None else data.get(section, {})
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or f.name in _SECTIONS:
                continue
            name = f.name if section is None else f"[{section}] {f.name}"
            if f.name not in table:
                missing.append(name)
                continue
            at = next(i for i, line in enumerate(lines) if line.startswith(f"{f.name} ="))
            if not lines[at - 1].startswith("#"):
                undocumented.append(name)
    assert not missing, f"options missing from {EXAMPLE.name}: {missing}"
    assert not undocumented, f"options without a comment above them: {undocumented}"


# -- systemd/memspec.service ----------------------------------------------------------------------
def test_unit_has_what_the_daemon_relies_on():
    unit = UNIT.read_text()
    for line in ("Type=notify", "WatchdogSec=", "StateDirectory=memspec", "RuntimeDirectory=memspec",
                 "Environment=MEMSPEC_HOME=/var/lib/memspec", "MemoryHigh=", "MemoryMax=", "Restart=on-failure",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "SupplementaryGroups=video", "DeviceAllow=/dev/nvmap rw", "ExecReload=/bin/kill -HUP $MAINPID"):
        assert line in unit, line
    assert "PrivateDevices=yes" not in unit  # would hide the GPU


def test_unit_and_readme_say_how_to_turn_on_the_http_api():
    unit, readme = UNIT.read_text(), (REPO / "README.md").read_text()
    assert "EnvironmentFile=-/etc/memspec/http.env" in unit and 'listen = "127.0.0.1:8080"' in unit
    assert "memspec serve --http" in readme and "/etc/memspec/http.env" in readme
    assert load_config(EXAMPLE).http.listen == ""  # off by default


@pytest.mark.parametrize("where", ["README.md", "systemd/memspec.service"])
def test_install_steps_make_the_store_then_pull_then_enable(where):
    """`useradd --system` makes no home: the store must be made, owned by memspec, before the
    pull, and the pull must come before the daemon is enabled (it serves the pulled model)."""
    text = (REPO / where).read_text()
    steps = text[text.index("useradd --system"):]  # the install steps, from the user on
    make = steps.index("install -d -o memspec -g memspec -m 0750 /var/lib/memspec")
    pull = steps.index("MEMSPEC_HOME=/var/lib/memspec /opt/memspec/venv/bin/memspec pull")
    assert make < pull < steps.index("enable --now memspec")


def test_unit_documentation_names_a_file_the_install_steps_put_there():
    doc = next(line for line in UNIT.read_text().splitlines() if line.startswith("Documentation="))
    path = doc.split("file://", 1)[1]
    assert f"install -D -m 0644 memspec.example.toml {path}" in (REPO / "README.md").read_text()


def test_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI"):
            pytest.fail("systemd-analyze is missing (apt-get install systemd)")
        pytest.skip("systemd-analyze is not installed")
    memspec = Path(sys.executable).parent / "memspec"
    assert memspec.is_file(), f"{memspec}: memspec is not installed in this environment"
    # verify checks that ExecStart exists: point it at this environment's memspec
    unit = tmp_path / "memspec.service"
    unit.write_text(UNIT.read_text().replace("/opt/memspec/venv/bin/memspec", str(memspec)))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


# -- gRPC codegen ---------------------------------------------------------------------------------
def test_generated_code_is_fresh_and_not_tracked():
    proto.load()
    assert not proto.stale()
    if shutil.which("git") and (REPO / ".git").exists():
        generated = proto.generated_files()[0].relative_to(REPO)
        assert subprocess.run(["git", "check-ignore", "-q", str(generated)], cwd=REPO).returncode == 0


def test_stale_when_the_proto_is_newer(tmp_path):
    root = tmp_path / "protos"
    (root / proto.PROTO).parent.mkdir(parents=True)
    shutil.copy(proto.CHECKOUT_PROTOS / proto.PROTO, root / proto.PROTO)
    out = tmp_path / "out"
    assert proto.stale(out, root)
    written = proto.generate(out, root)
    assert sorted(p.name for p in written) == ["memspec_pb2.py", "memspec_pb2_grpc.py"]
    assert not proto.stale(out, root)
    os.utime(root / proto.PROTO, (2**31, 2**31))
    assert proto.stale(out, root)
    assert f"from {proto.MODULE} import memspec_pb2" in written[1].read_text()


def test_build_hook_ships_generated_code_in_a_plain_build(tmp_path):
    """setup.py's build_py (what `pip install .` and wheels run) writes memspec/_proto."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "protos", src / "protos")
    shutil.copytree(REPO / "memspec", src / "memspec", ignore=shutil.ignore_patterns("_proto", "__pycache__"))
    lib = tmp_path / "lib"
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=src,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    gen = lib / "memspec" / "_proto" / "memspec" / "v1"
    assert {"memspec_pb2.py", "memspec_pb2_grpc.py", "memspec.proto"} <= {p.name for p in gen.iterdir()}
    check = ("import memspec.serving.proto as p; pb2, grpc_mod = p.load(); "
             "assert p.proto_root() == p.OUT_DIR and not p.stale(); print(pb2.DESCRIPTOR.name)")
    ran = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(lib)},
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == "memspec/v1/memspec.proto"


def test_onnx_runtime_is_an_extra_so_a_jetsons_onnxruntime_gpu_is_not_replaced():
    try:
        import tomllib
    except ImportError:  # Python 3.10 (JetPack 6)
        import tomli as tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.split(">")[0].split("=")[0].strip() == "onnxruntime" for d in project["dependencies"])
    assert any(d.startswith("onnxruntime>=") for d in project["optional-dependencies"]["cpu"])
    assert '".[cpu,test]"' in (REPO / "setup.sh").read_text()  # the README's setup still gets the CPU build


def test_without_onnx_runtime_memspec_says_what_to_install():
    code = ("import sys; sys.modules['onnxruntime'] = None\n"
            "from memspec.errors import ConfigError\n"
            "try:\n    import memspec.runtime.sessions\nexcept ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ONNX Runtime is not installed" in out.stdout and "memspec[cpu]" in out.stdout, out.stdout + out.stderr


def test_the_example_config_and_the_unit_agree_on_the_budget():
    """budget_mb = 0 under the unit: the budget memspec derives from MemoryHigh= is the one both
    files name, and MemoryMax= sits above MemoryHigh=."""
    from memspec.runtime.memory import MiB, budget_under

    unit = UNIT.read_text()
    value = {k: int(v.rstrip("M")) * MiB for k, v in
             (line.split("=", 1) for line in unit.splitlines() if line.startswith(("MemoryHigh=", "MemoryMax=")))}
    budget_mib = budget_under(value["MemoryHigh"]) // MiB
    assert value["MemoryMax"] > value["MemoryHigh"]
    assert f"{budget_mib} MiB" in unit and f"{budget_mib} MiB" in EXAMPLE.read_text()
    assert load_config(EXAMPLE).scheduler.budget_mb == 0


def test_the_unit_and_the_readme_install_the_same_package():
    """Issue 45: the unit's comment installed memspec without [cpu], the README with it (without an
    ONNX Runtime memspec exits at start)."""
    readme, unit = (REPO / "README.md").read_text(), UNIT.read_text()
    assert '/opt/memspec/venv/bin/pip install "/path/to/memspec[cpu]"' in readme
    assert '/opt/memspec/venv/bin/pip install "/path/to/memspec[cpu]"' in unit


def test_a_sampling_scheme_memspec_does_not_know_is_a_config_error(tmp_path):
    from memspec.errors import ConfigError

    bad = tmp_path / "s.toml"
    bad.write_text('[speculative]\nsampling = "fancy"\n')
    with pytest.raises(ConfigError, match="sampling: 'fancy' is not one of coupled, standard"):
        load_config(bad)
