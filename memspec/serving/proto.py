"""The gRPC code generated from ``protos/`` (never edited, never committed).

``protos/memspec/v1/memspec.proto`` is the source of the API.  Its Python
modules, ``memspec/_proto/memspec/v1/memspec_pb2{,_grpc}.py``, are produced by
``grpc_tools.protoc`` in two places:

* at build time, by ``setup.py``'s ``build_py`` (wheels, ``pip install .``):
  an installed package ships the generated code and a copy of the .proto, so a
  read-only site-packages (the hardened systemd unit) never needs to write;
* at import time, by `load()`, in a source checkout (``pip install -e .``):
  the files are regenerated when missing or older than the .proto, so editing
  the API needs no reinstall.  ``python -m memspec.serving.proto`` does it on demand.

protoc writes ``from memspec.v1 import memspec_pb2`` into the _grpc module (its
import path mirrors the .proto path); that would resolve inside this package,
so `generate` rewrites it to the real location.  The .proto keeps its path
``memspec/v1/memspec.proto``, which is what server reflection reports.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # memspec/
OUT_DIR = PACKAGE_DIR / "_proto"  # the generated package root
CHECKOUT_PROTOS = PACKAGE_DIR.parent / "protos"  # the source of truth in a checkout
PROTO = "memspec/v1/memspec.proto"  # path below the include root
MODULE = "memspec._proto.memspec.v1"


def proto_root() -> Path | None:
    """Where memspec.proto is: the checkout's protos/, else the installed copy."""
    for root in (CHECKOUT_PROTOS, OUT_DIR):
        if (root / PROTO).is_file():
            return root
    return None


def generated_files(out_dir: Path = OUT_DIR) -> list[Path]:
    stem = out_dir / PROTO[: -len(".proto")]
    return [stem.with_name(stem.name + "_pb2.py"), stem.with_name(stem.name + "_pb2_grpc.py")]


def stale(out_dir: Path = OUT_DIR, root: Path | None = None) -> bool:
    """True when a generated module is missing or older than the .proto."""
    root = root or proto_root()
    files = generated_files(out_dir)
    if any(not f.is_file() for f in files):
        return True
    if root is None or root == out_dir:
        return False  # an installed copy: generated together with it
    src = (root / PROTO).stat().st_mtime
    return any(f.stat().st_mtime < src for f in files)


def generate(out_dir: Path = OUT_DIR, root: Path | None = None) -> list[Path]:
    """Run protoc on the .proto into out_dir (atomically) and return the modules written."""
    root = root or proto_root()
    if root is None:
        raise RuntimeError(f"{PROTO} not found in {CHECKOUT_PROTOS} or {OUT_DIR}")
    try:
        from grpc_tools import protoc
    except ImportError:
        raise RuntimeError(
            "generating the gRPC modules needs grpcio-tools: pip install grpcio-tools "
            "(then `python -m memspec.serving.proto`)"
        ) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".gen-") as tmp:
        well_known = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
        rc = protoc.main([
            "grpc_tools.protoc", f"-I{root}", f"-I{well_known}",
            f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(root / PROTO),
        ])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {root / PROTO} (exit {rc})")
        grpc_mod = Path(tmp) / generated_files(Path("."))[1]
        src = grpc_mod.read_text()
        grpc_mod.write_text(src.replace("from memspec.v1 import", f"from {MODULE} import"))
        written = []
        for f in sorted(Path(tmp).rglob("*.py*")):
            dest = out_dir / f.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, dest)  # atomic: a concurrent importer sees old or new, never half
            written.append(dest)
        for pkg in (out_dir, out_dir / "memspec", out_dir / "memspec" / "v1"):
            (pkg / "__init__.py").touch()
        if root != out_dir:  # ship the API source with the generated code
            shutil.copyfile(root / PROTO, out_dir / PROTO)
    return [w for w in written if w.suffix == ".py"]


def load() -> tuple[ModuleType, ModuleType]:
    """(memspec_pb2, memspec_pb2_grpc), regenerated first in a checkout when stale.

    In a checkout, code that fails to import (made by another grpcio-tools than
    the installed protobuf/grpcio accept) is regenerated once as well.
    """
    checkout = proto_root() == CHECKOUT_PROTOS
    if checkout and stale():
        generate()
    try:
        return _import()
    except Exception as exc:  # ImportError, protobuf's VersionError, grpc's RuntimeError
        if checkout:
            generate()
            return _import()
        raise RuntimeError(
            f"the generated gRPC modules under {OUT_DIR} cannot be imported ({exc}); "
            f"reinstall memspec, or run `python -m memspec.serving.proto` with a matching grpcio-tools"
        ) from None


def _import() -> tuple[ModuleType, ModuleType]:
    importlib.invalidate_caches()
    return (importlib.import_module(f"{MODULE}.memspec_pb2"),
            importlib.import_module(f"{MODULE}.memspec_pb2_grpc"))


def main(argv: list[str] | None = None) -> int:
    """``python -m memspec.serving.proto [OUT_DIR]``: regenerate the modules now."""
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else OUT_DIR
    for path in generate(out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
