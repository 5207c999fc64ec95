"""Tokenizer for GGUF models: a llama.cpp-faithful HF ``tokenizers`` bridge.

The GGUF file carries everything needed to rebuild the tokenizer: vocabulary,
BPE merges, token types, special-token ids and the chat template. This module

* builds an HF ``tokenizer.json`` from that metadata (:func:`build_tokenizer_json`)
  whose pre-tokenizer reproduces llama.cpp's (``smollm`` for SmolLM2, ``qwen2``
  for Qwen2.5),
* wraps it in :class:`Tokenizer` (encode/decode/chat template), and
* streams text out of generated ids with :class:`IncrementalDetokenizer`.

The metadata comes from :func:`memspec.models.gguf.read_metadata`, which reads
only the GGUF key/value section.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from memspec.errors import ChatTemplateError, TokenizerError
from memspec.models.gguf import read_metadata

__all__ = [
    "ALLOWED_ROLES",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer_config",
    "build_tokenizer_json",
    "write_tokenizer_files",
]

ALLOWED_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

# llama.cpp token types (enum llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# \p{L} and \p{N} as llama.cpp classifies code points. Its tables (unicode-data.cpp) are Unicode
# 15.1; tokenizers' Oniguruma is Unicode 16, which made these ranges letters and digits. llama.cpp
# leaves them undefined, so its regex takes them as punctuation: subtract them to split the same.
_UNICODE_16_LETTERS = (
    r"\x{1C89}-\x{1C8A}\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}\x{10D4A}-\x{10D65}"
    r"\x{10D6F}-\x{10D85}\x{10EC2}-\x{10EC4}\x{11380}-\x{11389}\x{1138B}\x{1138E}\x{11390}-\x{113B5}"
    r"\x{113B7}\x{113D1}\x{113D3}\x{11BC0}-\x{11BE0}\x{13460}-\x{143FA}\x{16100}-\x{1611D}"
    r"\x{16D40}-\x{16D6C}\x{18CFF}\x{1E5D0}-\x{1E5ED}\x{1E5F0}"
)
_UNICODE_16_DIGITS = (
    r"\x{10D40}-\x{10D49}\x{116D0}-\x{116E3}\x{11BF0}-\x{11BF9}\x{16130}-\x{16139}\x{16D70}-\x{16D79}"
    r"\x{1CCF0}-\x{1CCF9}\x{1E5F1}-\x{1E5FA}"
)
_L = rf"[\p{{L}}&&[^{_UNICODE_16_LETTERS}]]"
_N = rf"[\p{{N}}&&[^{_UNICODE_16_DIGITS}]]"

# llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM applies the regexes "\p{N}" and then the
# GPT-2 regex. HF's Digits(individual_digits=True) isolates every char with
# char::is_numeric (== \p{N}); ByteLevel(use_regex=True) then applies the GPT-2
# regex to each piece, exactly as llama.cpp does on the offsets of pass one.
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    },
    # LLAMA_VOCAB_PRE_TYPE_QWEN2 applies one regex, Qwen2's own: contractions spelt out ('[sS] ...)
    # as llama.cpp writes them, and single digits (\p{N}, not llama3's \p{N}{1,3}). Each match is a
    # word; ByteLevel then only maps bytes to its alphabet.
    "qwen2": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "behavior": "Isolated", "invert": False, "pattern": {"Regex": (
                rf"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n{_L}{_N}]?{_L}+|{_N}"
                rf"| ?[^\s{_L}{_N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")}},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ],
    },
}

# Tokens that end a turn or the text, by the names llama.cpp's end-of-generation list gives them
# (llama-vocab.cpp, special_eog_ids). llama.cpp makes each one a control token whatever its GGUF
# type (Qwen2.5's plain "</s>" too, which it then matches whole in text), and so do we. Generation
# stops at each, and at the GGUF's eos/eot/eom ids: SmolLM2 and Qwen2.5 end a turn with <|im_end|>
# and may emit <|endoftext|>. (llama.cpp also stops at FIM pad/repo/file-separator tokens; we don't.)
_END_OF_GENERATION = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
    # llama.cpp also ends generation at the fill-in-the-middle pad, repository and file separators
    # (Qwen2.5-Coder's ids 151662-151664): an instruct answer that reaches one has left the chat
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})


# --------------------------------------------------------------------------- GGUF

GGUFSource = str | os.PathLike[str] | Mapping[str, Any]  # a GGUF path or metadata it holds


def _metadata(source: GGUFSource) -> Mapping[str, Any]:
    """The metadata of a GGUF path (read by models.gguf), or the mapping itself."""
    return source if isinstance(source, Mapping) else read_metadata(source)


def _require(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise TokenizerError(f"GGUF metadata lacks required key {key!r}")
    return meta[key]


# ----------------------------------------------------------------- tokenizer.json


def _check_supported(meta: Mapping[str, Any]) -> str:
    """Validate the tokenizer model/pre-tokenizer; returns the pre-tokenizer name."""
    model = _require(meta, "tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise TokenizerError(f"unsupported tokenizer.ggml.model {model!r}; only 'gpt2' (byte-level BPE) is supported")
    if pre not in _PRE_TOKENIZERS:
        raise TokenizerError(f"unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}")
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        raise TokenizerError("tokenizer.ggml.add_space_prefix=True is not supported")
    return pre


def _split_merges(merges: Sequence[str], vocab: Mapping[str, int]) -> list[list[str]]:
    """``'left right'`` merges as pairs; both sides and their join must be tokens of ``vocab``."""
    pairs = []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(parts):
            raise TokenizerError(f"malformed BPE merge {merge!r}; expected 'left right'")
        missing = [p for p in (*parts, "".join(parts)) if p not in vocab]
        if missing:
            raise TokenizerError(f"BPE merge {rank} {merge!r} does not match the vocabulary: "
                                 f"{missing[0]!r} is not a token ({len(vocab)} tokens, {len(merges)} merges)")
        pairs.append(parts)
    return pairs


def build_tokenizer_json(source: GGUFSource) -> dict[str, Any]:
    """Build an HF ``tokenizer.json`` dict from a GGUF path or its metadata dict.

    Control (type 3) and user-defined (type 4) tokens become added tokens that
    are matched whole in text; control tokens are flagged ``special``. No BOS
    or EOS is inserted by the post-processor (``add_bos_token`` must be false).
    """
    meta = _metadata(source)
    pre = _check_supported(meta)
    if meta.get("tokenizer.ggml.add_bos_token", False):
        raise TokenizerError("tokenizer.ggml.add_bos_token=True is not supported (no BOS post-processor)")
    tokens: list[str] = _require(meta, "tokenizer.ggml.tokens")
    types = _token_types(meta, tokens)
    vocab = {tok: idx for idx, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"GGUF vocabulary has {len(tokens) - len(vocab)} duplicate token strings")
    added = [
        {"id": idx, "content": tokens[idx], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": ttype == _TOKEN_TYPE_CONTROL}
        for idx, ttype in enumerate(types)
        if ttype in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[pre],
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": tokens[unk_id] if unk_id is not None else None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
            "byte_fallback": False, "ignore_merges": False, "vocab": vocab,
            "merges": _split_merges(_require(meta, "tokenizer.ggml.merges"), vocab),
        },
    }


def _token_types(meta: Mapping[str, Any], tokens: Sequence[str]) -> list[int]:
    """The GGUF's token types, with end-of-generation names made control as llama.cpp does."""
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
        raise TokenizerError(f"token_type has {len(types)} entries but tokens has {len(tokens)}")
    for idx in _named_end_tokens(tokens):
        types[idx] = _TOKEN_TYPE_CONTROL
    return types


def _named_end_tokens(tokens: Sequence[str]) -> list[int]:
    """Ids of the tokens whose text llama.cpp's end-of-generation list names."""
    return [idx for idx, text in enumerate(tokens) if text in _END_OF_GENERATION]


def build_tokenizer_config(source: GGUFSource) -> dict[str, Any]:
    """Build a ``tokenizer_config.json`` dict: chat template and special token ids/strings."""
    meta = _metadata(source)
    tokens: list[str] = _require(meta, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "chat_template": meta.get("tokenizer.chat_template"),
        "gguf_tokenizer_model": meta.get("tokenizer.ggml.model"),
        "gguf_tokenizer_pre": meta.get("tokenizer.ggml.pre"),
    }
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                      ("unk", "unknown_token_id")):
        idx = meta.get(f"tokenizer.ggml.{key}")
        if idx is not None and not 0 <= idx < len(tokens):
            raise TokenizerError(f"tokenizer.ggml.{key}={idx} is outside the vocabulary (size {len(tokens)})")
        config[f"{name}_token_id"] = idx
        config[f"{name}_token"] = tokens[idx] if idx is not None else None
    config["eos_token_ids"] = _end_of_generation_ids(meta, tokens)
    return config


def _end_of_generation_ids(meta: Mapping[str, Any], tokens: Sequence[str]) -> list[int]:
    """Every id that ends generation: the GGUF's eos id first, then its eot/eom ids and end-of-turn
    control tokens, ascending."""
    ids = {meta[f"tokenizer.ggml.{key}"] for key in ("eos_token_id", "eot_token_id", "eom_token_id")
           if meta.get(f"tokenizer.ggml.{key}") is not None}
    ids.update(_named_end_tokens(tokens))
    bad = sorted(i for i in ids if not 0 <= i < len(tokens))
    if bad:
        raise TokenizerError(f"end-of-generation ids {bad} are outside the vocabulary (size {len(tokens)})")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ([eos] if eos is not None else []) + sorted(ids - {eos})


def write_tokenizer_files(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for a GGUF into ``out_dir``."""
    meta = read_metadata(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"tokenizer.json": out / "tokenizer.json", "tokenizer_config.json": out / "tokenizer_config.json"}
    paths["tokenizer.json"].write_text(json.dumps(build_tokenizer_json(meta), ensure_ascii=False), encoding="utf-8")
    paths["tokenizer_config.json"].write_text(
        json.dumps(build_tokenizer_config(meta), ensure_ascii=False, indent=2), encoding="utf-8"
    )
    return paths


# ---------------------------------------------------------------------- Tokenizer


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 ByteLevel byte->printable-char map."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_byte_table(hf: HFTokenizer) -> tuple[list[bytes], frozenset[int]]:
    """Raw bytes of every token id, and the set of special token ids.

    Regular tokens are mapped back through the ByteLevel alphabet; added tokens
    are their literal UTF-8 text (as llama.cpp's ``token_to_piece`` does).
    """
    vocab = hf.get_vocab(with_added_tokens=True)
    table: list[bytes] = [b""] * hf.get_vocab_size(with_added_tokens=True)
    to_latin1 = {ord(c): b for c, b in _byte_decoder().items()}
    for tok, idx in vocab.items():
        try:
            table[idx] = tok.translate(to_latin1).encode("latin-1")
        except UnicodeEncodeError:  # char outside the byte alphabet: keep literal text
            table[idx] = tok.encode("utf-8")
    specials = set()
    for idx, added in hf.get_added_tokens_decoder().items():
        table[idx] = added.content.encode("utf-8")
        if added.special:
            specials.add(idx)
    return table, frozenset(specials)


def _load_json(source: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(source, Mapping):
        return dict(source)
    try:
        return json.loads(Path(source).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read JSON file {source}: {exc}") from exc


class Tokenizer:
    """Byte-level BPE tokenizer matching llama.cpp, plus chat templating."""

    def __init__(self, tokenizer_json: Mapping[str, Any], config: Mapping[str, Any]) -> None:
        """Create from a ``tokenizer.json`` dict and a ``tokenizer_config.json`` dict."""
        try:
            self._hf = HFTokenizer.from_str(json.dumps(tokenizer_json))
        except Exception as exc:  # tokenizers raises a bare Exception subclass
            raise TokenizerError(f"invalid tokenizer.json: {exc}") from exc
        self._config = dict(config)
        self._token_bytes, self._special_ids = _token_byte_table(self._hf)
        self._template: Any = None
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise TokenizerError(f"eos_token_id={self.eos_token_id} outside vocabulary of size {self.vocab_size}")

    @classmethod
    def from_file(
        cls, tokenizer_json_path: str | os.PathLike[str], config: str | os.PathLike[str] | Mapping[str, Any]
    ) -> Tokenizer:
        """Load ``tokenizer.json`` plus a ``tokenizer_config.json`` path or dict."""
        return cls(_load_json(tokenizer_json_path), _load_json(config))

    @classmethod
    def from_gguf(cls, source: GGUFSource) -> Tokenizer:
        """Build directly from a GGUF path or its metadata dict."""
        meta = _metadata(source)
        return cls(build_tokenizer_json(meta), build_tokenizer_config(meta))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, including added/special tokens."""
        return len(self._token_bytes)

    @property
    def eos_token_id(self) -> int | None:
        """The GGUF's end-of-sequence token id (``<|im_end|>`` for SmolLM2 and Qwen2.5)."""
        return self._config.get("eos_token_id")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation (Qwen2.5: ``<|im_end|>`` and ``<|endoftext|>``).

        Configs written before this field existed give just :attr:`eos_token_id`.
        """
        ids = set(self._config.get("eos_token_ids") or ())
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence token id; never added by :meth:`encode`."""
        return self._config.get("bos_token_id")

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of control tokens (``<|im_start|>``, ``<|im_end|>``, ...)."""
        return self._special_ids

    def to_json(self) -> str:
        """The tokenizer as HF ``tokenizer.json`` text (the grammar matcher builds its own from it)."""
        return self._hf.to_str()

    def encode(self, text: str) -> list[int]:
        """Tokenize ``text``; special tokens written in the text are matched whole. No BOS."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() expects str, got {type(text).__name__}")
        return self._hf.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (may be a fragment of a multi-byte character)."""
        if not 0 <= token_id < len(self._token_bytes):
            raise TokenizerError(f"token id {token_id} outside vocabulary of size {self.vocab_size}")
        return self._token_bytes[token_id]

    @property
    def byte_table(self) -> Sequence[bytes]:
        """Every token id's raw bytes, by id (the tokenizer's own table: read it, do not change it)."""
        return self._token_bytes

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        """Detokenize ``ids``; invalid UTF-8 becomes U+FFFD."""
        keep = (i for i in ids if not (skip_special_tokens and i in self._special_ids))
        return b"".join(self.token_bytes(i) for i in keep).decode("utf-8", errors="replace")

    def detokenizer(self, *, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` over this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str:
        """The model's own (GGUF) chat template, as Jinja text ("" when it has none)."""
        return self._config.get("chat_template") or ""

    @property
    def template_knows_tools(self) -> bool:
        """The chat template renders a `tools` list and tool turns itself (Qwen2.5's does)."""
        return "tools" in (self._config.get("chat_template") or "")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render ``messages`` with the model's own (GGUF) chat template; ``tools``: the functions
        it may call, for a template that lists them (:attr:`template_knows_tools`)."""
        _validate_messages(messages)
        try:
            return self._chat_template().render(
                messages=[dict(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._config.get("bos_token") or "",
                eos_token=self._config.get("eos_token") or "",
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja2 TemplateError, SecurityError, ...
            raise ChatTemplateError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc

    def _chat_template(self) -> Any:
        """Compile (once per instance) the chat template in a jinja2 sandbox."""
        if self._template is None:
            source = self._config.get("chat_template")
            if not source:
                raise ChatTemplateError("tokenizer config has no chat_template")
            self._template = _compile_template(source)
        return self._template


def _validate_messages(messages: Sequence[Mapping[str, str]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    for pos, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"messages[{pos}] must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ALLOWED_ROLES:
            raise ChatTemplateError(f"messages[{pos}] has role {role!r}; allowed roles: {', '.join(ALLOWED_ROLES)}")
        if not isinstance(msg.get("content"), str):
            raise ChatTemplateError(f"messages[{pos}]['content'] must be str, got {type(msg.get('content')).__name__}")


def _compile_template(source: str) -> Any:
    """Compile a HF-style chat template with the same sandbox settings transformers uses."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template raised: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


# ---------------------------------------------------------- incremental decoding


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas, never splitting a UTF-8 character.

    Works on token bytes with an incremental UTF-8 decoder, so each token costs
    O(len(token)) regardless of how long the stream is. Bytes of an incomplete
    character are held back until a later token completes it or :meth:`flush`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed one id or several; return the newly completed text (maybe ``""``)."""
        ids = (token_ids,) if isinstance(token_ids, int) else token_ids
        skip = self._tokenizer.special_token_ids if self._skip_special else frozenset()
        data = b"".join(self._tokenizer.token_bytes(i) for i in ids if i not in skip)
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Emit any held-back bytes (as U+FFFD if incomplete) and reset the stream."""
        tail = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return tail

    @property
    def pending_bytes(self) -> int:
        """Number of bytes held back waiting for the rest of a character."""
        return len(self._utf8.getstate()[0])
