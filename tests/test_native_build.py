"""The native kernels' build (setup.py's optional extension memspec.runtime._native)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from memspec.runtime import kernels


def test_the_kernels_are_built_wherever_a_c_compiler_is():
    """The extension is optional at install (a machine without a compiler still gets memspec), so a
    failed build would otherwise only skip tests/test_native_kernels.py: where gcc or cc exists, it
    must have been built."""
    if shutil.which("gcc") or shutil.which("cc"):
        assert kernels.available(), kernels.NOT_BUILT


NATIVE = Path(__file__).resolve().parent.parent / "memspec" / "runtime" / "native"
SELFTEST = [Path(__file__).resolve().parent / "native" / "selftest.c",
            *(NATIVE / f"{name}.c" for name in ("quants", "pack", "dot", "dot_avx2", "dot_avx2_x8", "dot_avx512", "dot_avx512_x8",
                                                    "dot_neon", "matmul", "floatops", "attention"))]
FLAGS = ["-O2", "-std=c11", "-ffp-contract=off", "-pthread", f"-I{NATIVE}"]


def _selftest(cc: list[str], out: Path, run: list[str], *args: str) -> str:
    """Build tests/native/selftest.c with `cc`, run it (through `run`, e.g. qemu), return its stdout."""
    subprocess.run([*cc, *FLAGS, *map(str, SELFTEST), "-lm", "-o", str(out)], check=True, capture_output=True)
    proc = subprocess.run([*run, str(out), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(run + [out.name, *args])} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def test_every_path_and_architecture_computes_the_same_bits(tmp_path):
    """The kernels without Python (tests/native/selftest.c): on every type, a row's outputs are the
    same in 1..9-row calls and at 1 and 3 threads, within the 8-bit bound of a double reference; and
    the hash of all outputs is the same for the scalar path, this CPU's SIMD path, and aarch64 (the
    Jetson's architecture) under qemu-aarch64, scalar and NEON with the dot-product instructions.  CI installs the cross compiler and qemu (.ci/run)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    scalar = _selftest([cc], tmp_path / "selftest", [], "scalar")
    assert len(scalar.splitlines()) == 14, scalar  # 10 types, then floatops, quantize, attention (f16, q8)
    assert _selftest([cc], tmp_path / "selftest", []) == scalar  # the best path here (AVX2 where present)
    cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
    if not (cross and qemu):
        assert not os.environ.get("CI"), "CI installs gcc-aarch64-linux-gnu and qemu-user (.ci/run)"
        pytest.skip("no aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)")
    arm = tmp_path / "selftest.arm"
    assert _selftest([cross, "-static"], arm, [qemu], "scalar") == scalar
    # qemu's default CPU has the dot-product instructions (as the Jetson's Cortex-A78AE): the NEON path
    assert _selftest([cross, "-static"], arm, [qemu], "neon") == scalar
    assert _selftest([cross, "-static"], arm, [qemu]) == scalar  # the best path there: NEON
    # and an ARMv8.0 CPU without them falls back to the scalar path instead of dying of SIGILL
    assert _selftest([cross, "-static"], arm, [qemu, "-cpu", "cortex-a53"]) == scalar
