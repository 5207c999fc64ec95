"""The model store confines model control: names, the files a manifest names, and the files
a load reads, checked against the manifest (on literal files; no model)."""

from __future__ import annotations

import os

import pytest

from memspec.errors import InvalidRequestError, ModelFormatError
from memspec.models import store as store_module
from memspec.models.store import Manifest, ModelStore, check_name, file_record


def make(tmp_path, name="m", payload=b"weights" * 100):
    store = ModelStore(tmp_path / "home", shipped=None)
    folder = store.model_dir(name)
    folder.mkdir(parents=True)
    (folder / "q4.onnx").write_bytes(payload)
    (folder / "tokenizer.json").write_text("{}")
    m = Manifest(name, "target", "onnx", {"q4": file_record(folder / "q4.onnx")},
                 {"tokenizer.json": file_record(folder / "tokenizer.json")}, {}, folder=folder)
    store.write_manifest(m)
    return store, store.get(name)


@pytest.mark.parametrize("name", ["/dev/shm/x", "../x", "smollm2-135m/../../..", "a/b", "", ".", "..", "-x",
                                  "x" * 129, "name with space", "é"])
def test_a_model_name_is_one_folder_of_the_store_and_nothing_else(tmp_path, name):
    with pytest.raises(InvalidRequestError, match="is not a model name"):
        check_name(name)
    with pytest.raises(InvalidRequestError, match="^name: "):
        ModelStore(tmp_path).get(name)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-1.5b", "draft_code", "A1"])
def test_ordinary_names_pass(name):
    assert check_name(name) == name


@pytest.mark.parametrize("path", ["/dev/shm/x.onnx", "../other/q4.onnx", "sub/../../q4.onnx"])
def test_a_manifest_cannot_point_outside_its_folder(tmp_path, path):
    store, m = make(tmp_path)
    m.variants["q4"]["path"] = path
    with pytest.raises(ModelFormatError, match="is outside the model's folder"):
        m.variant_path("q4")
    assert any("outside the model's folder" in p for p in store.verify(m))


def test_a_link_out_of_the_folder_is_refused_too(tmp_path):
    store, m = make(tmp_path)
    outside = tmp_path / "elsewhere.onnx"
    outside.write_bytes(b"x")
    (m.folder / "link.onnx").symlink_to(outside)
    m.variants["q4"]["path"] = "link.onnx"
    with pytest.raises(ModelFormatError, match="is outside the model's folder"):
        m.variant_path("q4")


def test_a_flipped_byte_is_refused_at_load_and_named(tmp_path):
    store, m = make(tmp_path)
    store.check_files(m, "q4")  # intact
    f = m.folder / "q4.onnx"
    data = bytearray(f.read_bytes())
    data[10] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match=r"model 'm' \(q4\) does not match its manifest: .*q4.onnx: sha256"):
        store.check_files(m, "q4")
    f.write_bytes(bytes(data[:-1]))
    with pytest.raises(ModelFormatError, match="bytes, manifest says"):
        store.check_files(m, "q4")


def test_a_verified_file_is_not_hashed_again_until_it_changes(tmp_path, monkeypatch):
    store, m = make(tmp_path)
    calls = []
    real = store_module.sha256_file
    monkeypatch.setattr(store_module, "sha256_file", lambda p, *a: calls.append(p.name) or real(p, *a))
    store.check_files(m, "q4")
    assert sorted(calls) == ["q4.onnx", "tokenizer.json"]
    calls.clear()
    ModelStore(store.home, shipped=None).check_files(m, "q4")  # a restart: remembered in verified.json
    assert calls == []
    f = m.folder / "q4.onnx"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: hashed again
    store.check_files(m, "q4")
    assert calls == ["q4.onnx"]


def test_checking_a_model_never_makes_a_store_folder(tmp_path):
    store, m = make(tmp_path)
    elsewhere = ModelStore(tmp_path / "no-store-here", shipped=None)
    elsewhere.check_files(m, "q4")  # a model from another root (the shipped drafts): checked, not remembered
    assert not (tmp_path / "no-store-here").exists()
