"""Tokenizer fidelity against llama.cpp golden fixtures, chat template, streaming detokenizer."""

from __future__ import annotations

import json
import lzma
import time
from pathlib import Path
from typing import Any

import pytest

from memspec.errors import InvalidRequestError, MemspecError, ModelFormatError
from memspec.models.gguf import read_metadata
from memspec.models.tokenizer import (
    ChatTemplateError,
    Tokenizer,
    TokenizerError,
    build_tokenizer_config,
    build_tokenizer_json,
    write_tokenizer_files,
)
from tokenizer_fuzz import fuzz_strings, ids_digest

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN_TOKENS: list[dict[str, Any]] = json.loads((FIXTURES / "golden_tokenization.json").read_text("utf-8"))["cases"]
CASE_IDS = [f"{i}:{c['text'][:24]!r}" for i, c in enumerate(GOLDEN_TOKENS)]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_path)


# ------------------------------------------------------------------ encode/decode


def test_fixture_file_is_substantial() -> None:
    assert len(GOLDEN_TOKENS) >= 40
    assert any("<|im_start|>" in c["text"] for c in GOLDEN_TOKENS)


@pytest.mark.parametrize("case", GOLDEN_TOKENS, ids=CASE_IDS)
def test_encode_matches_llama_cpp(tokenizer: Tokenizer, case: dict[str, Any]) -> None:
    assert tokenizer.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", GOLDEN_TOKENS, ids=CASE_IDS)
def test_decode_roundtrip(tokenizer: Tokenizer, case: dict[str, Any]) -> None:
    assert tokenizer.decode(case["ids"]) == case["text"]


def test_build_from_gguf_is_fast(gguf_path: Path) -> None:
    start = time.perf_counter()
    Tokenizer.from_gguf(gguf_path)
    assert time.perf_counter() - start < 2.0


def test_special_tokens(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    assert tokenizer.encode("<|im_start|><|im_end|><|endoftext|>") == [1, 2, 0]
    assert set(range(17)) == tokenizer.special_token_ids
    assert tokenizer.decode([1, 9519, 2], skip_special_tokens=True) == tokenizer.decode([9519])


def test_both_end_tokens_stop_generation(tokenizer: Tokenizer, gguf_path: Path) -> None:
    assert tokenizer.eos_token_ids == {2, 0}  # <|im_end|> (the GGUF's eos) and <|endoftext|>, as llama.cpp
    assert build_tokenizer_config(gguf_path)["eos_token_ids"] == [2, 0]  # the GGUF's eos first
    old_config = {"eos_token_id": 2}  # written before eos_token_ids existed
    assert Tokenizer(_tokenizer_json(tokenizer), old_config).eos_token_ids == {2}


def test_no_bos_added(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("") == []
    assert tokenizer.encode("hi")[0] != tokenizer.bos_token_id


def test_invalid_input_raises(tokenizer: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="expects str, got bytes"):
        tokenizer.encode(b"hi")  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="token id 49152 outside"):
        tokenizer.decode([5, 49152])
    assert issubclass(TokenizerError, MemspecError)


def test_unsupported_pretokenizer_raises(gguf_path: Path) -> None:
    meta = dict(read_metadata(gguf_path), **{"tokenizer.ggml.pre": "llama-bpe"})
    with pytest.raises(TokenizerError, match=r"'llama-bpe'; supported: \['qwen2', 'smollm'\]"):
        build_tokenizer_json(meta)


def test_fast_metadata_reader_matches_gguf_package(gguf_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    ours = read_metadata(gguf_path)
    reader = gguf.GGUFReader(gguf_path)
    theirs = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert ours == theirs


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "it is empty"),
        (b"this is not a gguf file", r"magic b'this', expected b'GGUF'"),
        (b"GGUF\x07\x00\x00\x00" + b"\0" * 16, r"unsupported GGUF version 7 \(expected 2 or 3\)"),
        (b"GGUF\x03\x00\x00\x00" + b"\xff" * 64, r"metadata needs \d+ bytes at byte 32, past the end \(72 bytes\)"),
        (b"GGUF\x03\x00\x00\x00" + bytes(8) + (1).to_bytes(8, "little") + (1).to_bytes(8, "little") + b"k"
         + (13).to_bytes(4, "little"), "unknown metadata value type 13 at byte 37"),
    ],
    ids=["empty", "magic", "version", "truncated", "value-type"],
)
def test_metadata_reader_names_what_is_wrong(tmp_path: Path, data: bytes, match: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFormatError, match=match) as info:
        read_metadata(path)
    assert "is not a readable GGUF file" in str(info.value)
    with pytest.raises(ModelFormatError, match="GGUF file not found"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


def test_written_files_roundtrip(tokenizer: Tokenizer, gguf_path: Path, tmp_path: Path) -> None:
    paths = write_tokenizer_files(gguf_path, tmp_path / "tok")
    config = json.loads(paths["tokenizer_config.json"].read_text("utf-8"))
    assert config["eos_token"] == "<|im_end|>" and config["eos_token_id"] == 2
    assert config["bos_token"] == "<|im_start|>" and config["unk_token_id"] == 0 and config["pad_token_id"] == 2
    assert config["add_bos_token"] is False and config["chat_template"].startswith("{% for message")
    loaded = Tokenizer.from_file(paths["tokenizer.json"], paths["tokenizer_config.json"])
    for case in GOLDEN_TOKENS:
        assert loaded.encode(case["text"]) == case["ids"]


def test_hf_decoder_agrees(gguf_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(json.dumps(build_tokenizer_json(gguf_path)))
    for case in GOLDEN_TOKENS:
        assert hf.decode(case["ids"], skip_special_tokens=False) == case["text"]


def test_logit_fixture_prompts_tokenize_identically(tokenizer: Tokenizer) -> None:
    golden = json.loads((FIXTURES / "golden_logits.json").read_text("utf-8"))
    assert golden["cases"]
    for case in golden["cases"]:
        assert tokenizer.encode(case["prompt_text"]) == case["ids"][: case["n_prompt"]]
        assert len(case["ids"]) == len(case["argmax"]) == len(case["margin"]) == len(case["top1_logit"])


# ------------------------------------------------------------------ chat template


def test_chat_template_system_and_user(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_default_system(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "robot", "content": "x"}], r"role 'robot'; allowed roles: system, user, assistant, tool"),
        ([{"content": "x"}], r"messages\[0\] has role None"),
        ([{"role": "user", "content": 3}], r"\['content'\] must be str, got int"),
        ([], "non-empty list"),
        ("hello", "non-empty list"),
    ],
)
def test_chat_template_rejects_bad_messages(tokenizer: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match) as info:
        tokenizer.apply_chat_template(messages)
    assert isinstance(info.value, ValueError) and isinstance(info.value, InvalidRequestError)


def test_chat_template_is_sandboxed(tokenizer: Tokenizer) -> None:
    evil = Tokenizer(_tokenizer_json(tokenizer), {"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template(tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        Tokenizer(_tokenizer_json(tokenizer), {}).apply_chat_template([{"role": "user", "content": "x"}])


def _tokenizer_json(tokenizer: Tokenizer) -> dict[str, Any]:
    return json.loads(tokenizer._hf.to_str())  # noqa: SLF001 - test helper


# ------------------------------------------------------------- streaming decode


@pytest.mark.parametrize("case", GOLDEN_TOKENS, ids=CASE_IDS)
def test_incremental_deltas_concatenate_to_text(tokenizer: Tokenizer, case: dict[str, Any]) -> None:
    detok = tokenizer.detokenizer()
    deltas = [detok.add(i) for i in case["ids"]]
    deltas.append(detok.flush())
    assert "".join(deltas) == case["text"] == tokenizer.decode(case["ids"])
    assert not any("\ufffd" in d for d in deltas)


def test_emoji_split_across_tokens_is_held_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀!")
    assert [tokenizer.token_bytes(i) for i in ids] == [b"ok", b" \xf0\x9f\x98", b"\x80", b"!"]
    detok = tokenizer.detokenizer()
    assert [detok.add(i) for i in ids] == ["ok", " ", "😀", "!"]  # partial emoji bytes held back
    assert detok.pending_bytes == 0 and detok.flush() == ""
    ids = tokenizer.encode("👍🏽")  # two 4-byte code points over six tokens
    assert [detok.add(i) for i in ids] == ["", "", "👍", "", "", "🏽"]


def test_flush_replaces_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀")
    detok = tokenizer.detokenizer()
    assert detok.add(ids[:-1]) == ""
    assert detok.pending_bytes > 0
    assert detok.flush() == "\ufffd"
    assert detok.add(tokenizer.encode("fine")) == "fine"


def test_detokenizer_skips_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nDone.<|im_end|>")
    detok = tokenizer.detokenizer(skip_special_tokens=True)
    assert detok.add(ids) + detok.flush() == "assistant\nDone."


# ------------------------------------------------------------------- Qwen2.5 (qwen2)
# The Qwen2.5-Coder GGUF's tokenizer metadata is a fixture (1 MB, xz), so these tests need no
# model file; scripts/make_golden_fixtures.py --qwen-gguf records it and llama.cpp's ids.

QWEN_GOLDEN: dict[str, Any] = json.loads((FIXTURES / "golden_tokenization_qwen2.json").read_text("utf-8"))
QWEN_CASES: list[dict[str, Any]] = QWEN_GOLDEN["cases"]
QWEN_IDS = [f"{i}:{c['text'][:24]!r}" for i, c in enumerate(QWEN_CASES)]
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
PLAIN_END_S = 128247  # "</s>", a plain token in Qwen's GGUF


@pytest.fixture(scope="module")
def qwen_meta() -> dict[str, Any]:
    return json.loads(lzma.decompress((FIXTURES / "qwen2_tokenizer.json.xz").read_bytes()))


@pytest.fixture(scope="module")
def qwen(qwen_meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf(qwen_meta)


def test_qwen_fixture_is_the_real_vocabulary(qwen_meta: dict[str, Any]) -> None:
    assert qwen_meta["tokenizer.ggml.pre"] == "qwen2" and qwen_meta["tokenizer.ggml.model"] == "gpt2"
    assert len(qwen_meta["tokenizer.ggml.tokens"]) == 151936 and len(qwen_meta["tokenizer.ggml.merges"]) == 151387
    assert QWEN_GOLDEN["meta"]["gguf_sha256"] == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert len(QWEN_CASES) >= 60 and QWEN_GOLDEN["meta"]["fuzz"]["n"] == 20000


@pytest.mark.parametrize("case", QWEN_CASES, ids=QWEN_IDS)
def test_qwen_encode_matches_llama_cpp(qwen: Tokenizer, case: dict[str, Any]) -> None:
    assert qwen.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", QWEN_CASES, ids=QWEN_IDS)
def test_qwen_decode_roundtrip(qwen: Tokenizer, case: dict[str, Any]) -> None:
    assert qwen.decode(case["ids"]) == case["text"]
    detok = qwen.detokenizer()
    assert "".join(detok.add(i) for i in case["ids"]) + detok.flush() == case["text"]


def test_qwen_fuzz_matches_llama_cpp(qwen: Tokenizer) -> None:
    spec = QWEN_GOLDEN["meta"]["fuzz"]
    strings = fuzz_strings(spec["generator"], spec["seed"], spec["n"])
    expected = QWEN_GOLDEN["fuzz_ids_sha256_12"]
    assert len(strings) == len(expected) == 20000
    bad = [s for s, digest in zip(strings, expected) if ids_digest(qwen.encode(s)) != digest]
    assert not bad, f"{len(bad)}/{len(strings)} fuzz strings differ from llama.cpp, first: {bad[:3]!r}"


def test_qwen_special_tokens(qwen: Tokenizer) -> None:
    assert qwen.vocab_size == 151936
    assert qwen.encode("<|im_start|><|im_end|><|endoftext|>") == [IM_START, IM_END, ENDOFTEXT]
    assert qwen.encode("<tool_call></tool_call>") == [151657, 151658]  # user-defined: matched whole, not special
    assert {IM_START, IM_END, ENDOFTEXT} <= qwen.special_token_ids and 151657 not in qwen.special_token_ids
    assert qwen.decode([IM_START, 872, IM_END], skip_special_tokens=True) == qwen.decode([872])


def test_qwen_both_end_tokens_stop_generation(qwen: Tokenizer, qwen_meta: dict[str, Any]) -> None:
    assert qwen.eos_token_id == IM_END
    assert {IM_END, ENDOFTEXT} <= qwen.eos_token_ids
    # llama.cpp's end-of-generation set, <|fim_pad|>, <|repo_name|> and <|file_sep|> (151662-4) included
    assert qwen.eos_token_ids == set(QWEN_GOLDEN["meta"]["eog_ids"])
    assert {151662, 151663, 151664} <= qwen.eos_token_ids
    assert build_tokenizer_config(qwen_meta)["eos_token_ids"] == [IM_END, PLAIN_END_S, ENDOFTEXT,
                                                                  151662, 151663, 151664]


def test_qwen_plain_end_s_is_control_as_in_llama_cpp(qwen: Tokenizer) -> None:
    assert qwen.encode("a</s>b") == [64, PLAIN_END_S, 65]  # GGUF type 1, but llama.cpp matches it whole
    assert PLAIN_END_S in qwen.special_token_ids


def test_qwen_build_is_fast(qwen_meta: dict[str, Any]) -> None:
    start = time.perf_counter()
    Tokenizer.from_gguf(qwen_meta)
    assert time.perf_counter() - start < 5.0


def test_vocabulary_that_does_not_match_merges_is_refused(qwen_meta: dict[str, Any]) -> None:
    merges = list(qwen_meta["tokenizer.ggml.merges"])
    merges[7] = "Ġ ZZZQQQ"
    with pytest.raises(TokenizerError, match=r"BPE merge 7 'Ġ ZZZQQQ' does not match the vocabulary: 'ZZZQQQ' is not"):
        build_tokenizer_json(dict(qwen_meta, **{"tokenizer.ggml.merges": merges}))


@pytest.fixture(scope="module", params=["0.5B", "1.5B"])
def qwen_chat(request: pytest.FixtureRequest, qwen: Tokenizer, qwen_meta: dict[str, Any]) -> Tokenizer:
    """The Qwen tokenizer with the chat template of the 0.5B's GGUF, or of the 1.5B's (its tools text differs)."""
    if request.param == "0.5B":
        return qwen
    templates = json.loads((FIXTURES / "qwen2_chat_templates.json").read_text("utf-8"))
    template = templates["Qwen2.5 Coder 1.5B Instruct GGUF"]
    assert template != qwen_meta["tokenizer.chat_template"]
    return Tokenizer(_tokenizer_json(qwen), dict(build_tokenizer_config(qwen_meta), chat_template=template))


def test_qwen_chat_template_user_only_has_default_system(qwen_chat: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Write a palindrome check."}]
    assert qwen_chat.apply_chat_template(messages) == (
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWrite a palindrome check.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen_chat_template_system_and_user(qwen_chat: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    text = qwen_chat.apply_chat_template(messages)
    assert text == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert QWEN_SYSTEM not in text


def test_qwen_chat_template_multi_turn(qwen_chat: Tokenizer) -> None:
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "3+3?"}]
    text = qwen_chat.apply_chat_template(messages, add_generation_prompt=False)
    assert text == (
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n"
    )
    ids = qwen_chat.encode(text)
    assert ids.count(IM_START) == ids.count(IM_END) == 4


def test_qwen_chat_template_tools_branch_renders_in_sandbox(qwen_chat: Tokenizer) -> None:
    tool = {"name": "add", "parameters": {"a": "int"}}
    text = qwen_chat._chat_template().render(  # noqa: SLF001 - the branch memspec's tools take
        messages=[{"role": "user", "content": "1+2"}], tools=[tool], add_generation_prompt=True)
    assert text.startswith(f"<|im_start|>system\n{QWEN_SYSTEM}\n\n# Tools\n")
    assert '\n{"name": "add", "parameters": {"a": "int"}}\n</tools>' in text
    assert text.endswith("<|im_start|>user\n1+2<|im_end|>\n<|im_start|>assistant\n")
