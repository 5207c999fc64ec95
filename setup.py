"""Build hook: generate the gRPC modules from protos/ (see memspec/serving/proto.py).

Everything else about the package is in pyproject.toml.  `build_py` writes
memspec/_proto/ into the build directory for wheels and plain installs, and
into the source tree for editable installs (where the source tree is what gets
imported).  The generated files are never committed.  Wheels and plain installs
also carry the shipped drafts and predictor (models/) as memspec/_models/.

The native kernels (memspec/runtime/native/, the `memspec.runtime._native` extension) are
optional: without a C compiler the package still installs and memspec.runtime.kernels says
so.  They are built for plain x86-64 (or the host's baseline); faster paths are chosen at run
time, never with -march=native.
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _proto_module():
    # Load memspec/serving/proto.py by path: importing the package is not needed to build it.
    spec = importlib.util.spec_from_file_location("_memspec_proto", HERE / "memspec" / "serving" / "proto.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildWithProto(build_py):
    def run(self):
        super().run()
        proto = _proto_module()
        out = HERE / "memspec" / "_proto" if self.editable_mode else Path(self.build_lib) / "memspec" / "_proto"
        proto.generate(out, HERE / "protos")
        if not self.editable_mode and (HERE / "models").is_dir():
            # the shipped drafts and predictor travel inside the wheel (memspec.models.store.SHIPPED_MODELS)
            shutil.copytree(HERE / "models", Path(self.build_lib) / "memspec" / "_models", dirs_exist_ok=True)


NATIVE = Extension(
    "memspec.runtime._native",
    sources=[f"memspec/runtime/native/{name}.c" for name in ("module", "model", "attention", "floatops", "pool",
                                                                "matmul", "pack", "dot", "dot_avx2", "dot_avx2_x8",
                                                                "dot_avx512", "dot_avx512_x8", "dot_neon", "quants")],
    depends=[*(f"memspec/runtime/native/{name}.h" for name in ("model", "attention", "floatops", "pool", "matmul",
                                                                "pack", "dot", "dot_x86", "quants")),
             "memspec/runtime/native/dot_x8.inc"],
    # -ffp-contract=off: a float op is fused only where the code says fmaf, on every path
    extra_compile_args=["-O3", "-std=c11", "-fPIC", "-pthread", "-ffp-contract=off"],
    extra_link_args=["-pthread"],
    libraries=["m"],
    optional=True,
)

setup(cmdclass={"build_py": BuildWithProto}, ext_modules=[NATIVE])
