"""The native kernels' build (setup.py's optional extension memspec.runtime._native)."""

from __future__ import annotations

import shutil

from memspec.runtime import kernels


def test_the_kernels_are_built_wherever_a_c_compiler_is():
    """The extension is optional at install (a machine without a compiler still gets memspec), so a
    failed build would otherwise only skip tests/test_native_kernels.py: where gcc or cc exists, it
    must have been built."""
    if shutil.which("gcc") or shutil.which("cc"):
        assert kernels.available(), kernels.NOT_BUILT
