"""Constrained decoding: a request's grammar as a logits shaper (memspec.speculation.logits).

A Constraint (memspec.request: a JSON schema, JSON mode, a Lark or GBNF grammar) is compiled by
llguidance against the target's tokenizer into a matcher.  The matcher is the shaper:

    shape(row)  the row with -inf on every token the grammar forbids after the tokens pushed
    push(t)     the matcher consumes t
    pop(n)      the matcher rolls n tokens back (rejected drafts)

so the mask applies at every verified position as in one-token decoding, drafts propose under
it, and a rejection rolls the matcher back (the loop's calls are in memspec.speculation.logits).
Greedy output under a grammar is therefore the target-only output under the same grammar, and
sampling draws from the masked, renormalised distribution.  Once the grammar is complete and
admits nothing more (`done`), the engine ends the answer with finish reason "stop".

Figures (bench/grammar_libraries.py, Qwen2.5's 151,936-token vocabulary): the llguidance
tokenizer takes ~1.4 s to build (once per target, on the first constrained request), a schema
~1 ms to compile, a mask ~30 us per position.
"""

from __future__ import annotations

import json
import threading
from typing import Iterable

import llguidance
import numpy as np

from memspec.errors import InvalidRequestError
from memspec.models.tokenizer import Tokenizer
from memspec.request import Constraint

# JSON as models write it: one space after ',' and ':', no other whitespace (flexible whitespace
# lets a small model pad an answer with newlines until max_tokens)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid"


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for a constraint, unchecked; InvalidRequestError naming the field for
    text that is not even a schema or a grammar."""
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.text)
        except ValueError as exc:
            raise InvalidRequestError(f"{c.field}: is not valid JSON ({exc})") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{c.field}: a JSON schema is an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if c.kind == "grammar":  # GBNF (llama.cpp's) is converted; Lark is taken as it is
        try:
            return llguidance.grammar_from("grammar", c.text)
        except ValueError as exc:
            raise InvalidRequestError(f"{c.field}: {_first_line(str(exc))}") from None
    raise InvalidRequestError(f"{c.field}: unknown constraint kind {c.kind!r}")


class _Vocabulary:
    """The tokenizer as llguidance's TokenizerWrapper reads it: every id's bytes, the special ids,
    and encode.  Built from memspec's own byte table rather than tokenizer.json, so that the two
    agree on what is text: llguidance takes every added token of a tokenizer.json as special (as
    bytes it never matches), while Qwen2.5's <tool_call> is an added token that the model writes
    as text, and a forced call's grammar must match it."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos_ids: list[int]):
        n = tokenizer.vocab_size
        self.tokens = [tokenizer.token_bytes(i) if i < n else b"" for i in range(vocab)]  # ids past it: never
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self.eos_token_id = eos_ids[0] if eos_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self.tokenizer.encode(text.decode("utf-8", errors="replace"))


class Grammars:
    """Compiles constraints for one target: its tokenizer, its logits' width, its end tokens."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.vocab = vocab  # the target's logits per row (may exceed the tokenizer's ids)
        self.eos_ids = sorted(eos_ids)  # allowed wherever the grammar is complete
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built on first use (about a second for 150k tokens)."""
        with self._lock:
            if self._ll is None:
                wrapper = llguidance.TokenizerWrapper(_Vocabulary(self.tokenizer, self.vocab, self.eos_ids))
                self._ll = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab, eos_token=self.eos_ids)
            return self._ll

    def compile(self, c: Constraint) -> str:
        """The checked grammar; InvalidRequestError naming the field with llguidance's reason (an
        invalid schema, a keyword it does not implement, a grammar that does not parse)."""
        grammar = grammar_text(c)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer())
        if failed:
            raise InvalidRequestError(f"{c.field}: {_first_line(messages[0])}")
        return grammar

    def mask(self, c: Constraint) -> "GrammarMask":
        """A fresh shaper for one request, at the start of its answer."""
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), self.compile(c), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{c.field}: {_first_line(matcher.get_error())}")
        return GrammarMask(matcher, self.vocab, self.eos_ids)


class GrammarMask:
    """One request's matcher as a logits shaper (the module docstring).

    An end token is not given to the matcher: a draft may propose it, and tokens after it, which
    are then verified and rolled back, and llguidance does not count a consumed end token as one
    it can roll back.  The mask counts the end tokens pushed on top of the matcher itself, and
    admits only end tokens after one."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, eos_ids: Iterable[int]):
        self.matcher = matcher
        self.vocab = vocab
        self.eos_ids = np.asarray(sorted(eos_ids), dtype=np.int64)
        self.ended = 0  # end tokens pushed on top of what the matcher consumed
        self.bits = np.zeros((vocab + 31) // 32, dtype=np.int32)  # one bit a token, as llguidance writes it

    def allowed(self) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar admits next."""
        if self.ended:
            out = np.zeros(self.vocab, dtype=bool)
            out[self.eos_ids] = True
            return out
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return np.unpackbits(self.bits.view(np.uint8), bitorder="little", count=self.vocab).view(bool)

    def shape(self, row: np.ndarray) -> np.ndarray:
        allowed = self.allowed()
        if row.shape[-1] != self.vocab:  # a logits row the matcher was not built for: a bug, not a request's fault
            raise ValueError(f"a logits row of {row.shape[-1]} entries; the grammar masks {self.vocab}")
        return np.where(allowed, row, np.float32(-np.inf)).astype(np.float32, copy=False)

    def push(self, token: int) -> None:
        if token in self.eos_ids and (self.ended or self.matcher.is_accepting()):
            self.ended += 1
            return
        if self.ended or not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its mask allowed: "
                               f"{_first_line(self.matcher.get_error())}")

    def pop(self, n: int) -> None:
        ends = min(n, self.ended)
        self.ended -= ends
        n -= ends
        if n and not self.matcher.rollback(n):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {_first_line(self.matcher.get_error())}")

    def forced_tokens(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward: the bytes only one way on
        admits, tokenized as the tokenizer would), at most `limit`; [] once an end token was pushed.
        A proposal, not a commitment: the target may still spell the same bytes in other tokens."""
        if self.ended or self.matcher.is_stopped():
            return []
        out = []
        for t in self.matcher.compute_ff_tokens()[:limit]:
            if not 0 <= t < self.vocab or t in self.eos_ids:
                break
            out.append(int(t))
        return out

    @property
    def complete(self) -> bool:
        """The grammar was complete before any end token: it admits nothing but one."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing but an end token."""
        return self.ended > 0 or (self.matcher.is_stopped() and not self.matcher.is_error())
