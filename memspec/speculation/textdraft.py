"""A draft that speaks its own tokenizer: it reads the context as text and proposes text.

A model draft (memspec.speculation.drafts) shares the target's tokens, through a map of its own
vocabulary into the target's; that leaves out every small model of another family.  SmolLM2-135M
answers plain-English questions much as Qwen2.5-Coder-1.5B does (it guesses the 1.5B's next token
on the built-in qa prompts about two times in three, where the trained chat draft guesses one in
three), at 0.11 of the 1.5B's step.  A text draft lets it propose:

* the committed context (target ids) becomes text, and the text the draft's own ids; only the tail
  after an *anchor* is encoded again each step: a place where a target token and a draft token both
  end, at least ANCHOR_GUARD bytes before the end of the text (a word still being written can merge
  with what follows it, so its encoding is not settled);
* the draft continues greedily in its own ids (catch-up, prefix reuse, the confidence stop and the
  n-gram shortcuts are the model draft's own: its vocabulary map is the identity);
* its text is encoded in the target's tokens, every one proposed: the last may be a word the draft
  stopped inside, which the target rejects for one verified row (nearly free), where knowing it
  would take one more draft step every time; an end of answer becomes the target's token of the
  same text (ChatML's `<|im_end|>` for both).

The proposal is a list of target tokens with no distribution: when sampling, q is one-hot on each
(drafts.deterministic_proposal), which the speculative-sampling rule accepts exactly, so output
stays what the target alone would give, greedy or sampled, whatever the draft's text was.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memspec.errors import ConfigError, ModelFormatError
from memspec.models.store import Manifest, ModelStore, speaks_own_tokenizer
from memspec.models.tokenizer import Tokenizer
from memspec.request import SamplingParams
from memspec.runtime.config import SessionConfig
from memspec.speculation.config import DraftLimits
from memspec.speculation.drafts import (GGUF_VARIANT, DraftModel, Proposal, deterministic_proposal, draft_engine,
                                        draft_prefixes, draft_threads)
from memspec.speculation.logits import IDENTITY, LogitsShaper
from memspec.runtime.target import open_draft

ANCHOR_GUARD = 16  # bytes of text before the end where the draft's encoding is not yet settled
GREEDY = SamplingParams()
CAPACITY_RATIO = 2  # draft tokens held per target token of the request's capacity (SmolLM2 writes code in
#                     about 1.3 of its tokens per Qwen token; Chinese text in up to about 2)


__all__ = ["TextBridge", "TextDraft", "end_map", "load_draft"]


def load_draft(store: ModelStore, name: str, target_vocab: int, config: SessionConfig = SessionConfig(),
               limits: DraftLimits = DraftLimits(), target_tokenizer: Tokenizer | None = None):
    """A draft from the store, of either kind: a DraftModel (the target's tokens, through its
    vocabulary map), or a TextDraft for a draft with a tokenizer of its own (it needs
    `target_tokenizer`)."""
    if speaks_own_tokenizer(store.get(name)):
        return TextDraft.load(store, name, target_tokenizer, target_vocab, config, limits)
    return DraftModel.load(store, name, target_vocab, config, limits)


def draft_tokenizer(m: Manifest) -> Tokenizer:
    """The draft's own tokenizer, from the files its manifest names."""
    files = {path.name: path for path in (m.path_of(r) for r in m.tokenizer.values())}
    if "tokenizer.json" not in files:
        raise ModelFormatError(f"draft {m.name!r} speaks its own tokenizer but its manifest names no tokenizer.json")
    return Tokenizer.from_file(files["tokenizer.json"], files.get("tokenizer_config.json"))


class TextBridge:
    """The way between the target's tokens and a draft's, by text; one request's anchor.

    draft_context(): the committed context (target ids) in the draft's ids, the text unchanged;
    target_tokens(): the draft's proposed ids as the target's tokens."""

    def __init__(self, tokenizer: Tokenizer, target_tokenizer: Tokenizer, target_end: dict[int, int]):
        self.tokenizer, self.target_tokenizer = tokenizer, target_tokenizer
        self.target_bytes: Sequence[bytes] = target_tokenizer.byte_table  # each token id's bytes
        self.draft_bytes: Sequence[bytes] = tokenizer.byte_table
        self.ends = tokenizer.eos_token_ids
        self.target_end = target_end
        self.anchor: list[int] = []  # target ids whose text is settled in the draft's ids ...
        self.anchor_ids: list[int] = []  # ... these

    def draft_context(self, context: list[int]) -> list[int]:
        """The context in the draft's ids: the anchor's, then the rest encoded again; the anchor moves
        to the last place where a target token and a draft token both end, ANCHOR_GUARD bytes or more
        before the text's end."""
        n = len(self.anchor)
        if n > len(context) or context[:n] != self.anchor:
            self.anchor, self.anchor_ids, n = [], [], 0  # another context: start again
        tail = context[n:]
        raw = b"".join(self.target_bytes[t] for t in tail)
        ids = self.tokenizer.encode(raw.decode("utf-8", "ignore"))
        out = self.anchor_ids + ids
        settled = len(raw) - ANCHOR_GUARD
        if settled > 0:
            ends_t, off = {}, 0
            for i, t in enumerate(tail):
                off += len(self.target_bytes[t])
                if off > settled:
                    break
                ends_t[off] = i + 1
            best, off = None, 0
            for j, t in enumerate(ids):
                off += len(self.draft_bytes[t])
                if off > settled:
                    break
                if off in ends_t:
                    best = (ends_t[off], j + 1)
            if best is not None:
                self.anchor = context[: n + best[0]]
                self.anchor_ids = self.anchor_ids + ids[: best[1]]
        return out

    def target_tokens(self, draft_ids: list[int]) -> list[int]:
        """The draft's continuation as target tokens: its text encoded, every token kept (the last
        may be a word the draft stopped inside, which the target then rejects at the price of one
        verified row, nearly nothing; finding out would cost a draft step each time); its end
        becomes the target's end of answer where the target has one of the same text."""
        raw, end = [], None
        for t in draft_ids:
            if t in self.ends:
                end = self.target_end.get(t)  # none: the target's end is its own to propose
                break
            raw.append(self.draft_bytes[t])
        text = b"".join(raw).decode("utf-8", "ignore")
        tokens = self.target_tokenizer.encode(text) if text else []
        return tokens if end is None else tokens + [end]


def end_map(tokenizer: Tokenizer, target_tokenizer: Tokenizer) -> dict[int, int]:
    """Each of the draft's end-of-answer ids whose text is one of the target's end-of-answer tokens."""
    out = {}
    for e in tokenizer.eos_token_ids:
        ids = target_tokenizer.encode(tokenizer.token_bytes(e).decode("utf-8", "replace"))
        if len(ids) == 1 and ids[0] in target_tokenizer.eos_token_ids:
            out[e] = ids[0]
    return out


class TextDraft:
    """A draft model with a tokenizer of its own, proposing target tokens by text (see the module)."""

    def __init__(self, name: str, inner: DraftModel, tokenizer: Tokenizer, target_tokenizer: Tokenizer,
                 target_vocab: int):
        self.name = name
        self.inner = inner  # the model in its own ids (an identity vocabulary map)
        self.session = inner.session
        self.nbytes = inner.nbytes
        self.variant = inner.variant
        self.manifest = inner.manifest
        self.limits = inner.limits
        self.tokenizer = tokenizer
        self.target_tokenizer = target_tokenizer
        self.target_vocab = target_vocab
        self.target_end = end_map(tokenizer, target_tokenizer)  # once: every request's bridge reads it

    def bridge(self) -> TextBridge:
        return TextBridge(self.tokenizer, self.target_tokenizer, self.target_end)

    @classmethod
    def load(cls, store: ModelStore, name: str, target_tokenizer: Tokenizer | None, target_vocab: int,
             config: SessionConfig = SessionConfig(), limits: DraftLimits = DraftLimits()) -> "TextDraft":
        m = store.get(name)
        if target_tokenizer is None:
            raise ConfigError(f"draft {name!r} speaks its own tokenizer: it needs the target's tokenizer to draft")
        if GGUF_VARIANT not in m.variants:
            raise ModelFormatError(f"draft {name!r} speaks its own tokenizer and ships no GGUF")
        store.check_files(m, GGUF_VARIANT)  # a tampered or truncated file is refused before it is parsed
        if draft_engine(m, config) != "native":
            raise ConfigError(f"draft {name!r} runs on the native engine only; this configuration drafts in "
                              f"ONNX Runtime")
        tok = draft_tokenizer(m)
        threads = draft_threads(config, m.variant_bytes(GGUF_VARIANT))
        try:
            session = open_draft(m.variant_path(GGUF_VARIANT), "native", config, threads)
        except ModelFormatError as exc:
            raise ModelFormatError(f"draft {name!r}: {exc}") from None
        vocab = session.vocab_size or tok.vocab_size
        if tok.vocab_size > vocab:
            raise ModelFormatError(f"draft {name!r}: its tokenizer has {tok.vocab_size} tokens, the model "
                                   f"{vocab} logits")
        identity = np.arange(vocab, dtype=np.int64)
        inner = DraftModel(name, session, identity, vocab, limits, m,
                           draft_prefixes(session, m.variant_bytes(GGUF_VARIANT), config))
        return cls(name, inner, tok, target_tokenizer, target_vocab)

    def begin(self, capacity: int) -> "TextDraftState":
        return TextDraftState(self, capacity)

    def feed_seconds_per_token(self) -> float | None:
        return self.inner.feed_seconds_per_token()


class TextDraftState:
    """One request's draft: its cache (a model draft's state, in the draft's own ids) and its bridge."""

    def __init__(self, draft: TextDraft, capacity: int):
        self.d = draft
        max_context = getattr(draft.session, "max_context", None) or capacity * CAPACITY_RATIO
        self.inner = draft.inner.begin(min(capacity * CAPACITY_RATIO + 16, max_context))
        self.bridge = draft.bridge()

    def propose(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator,
                shaper: LogitsShaper = IDENTITY, alternatives: bool = False) -> Proposal:
        if k <= 0:
            return Proposal([], None, [])
        inner = self.inner.propose(self.bridge.draft_context(context), k, GREEDY, rng)
        tokens = self.bridge.target_tokens(inner.tokens)[:k]
        prop = deterministic_proposal(tokens, self.d.target_vocab, params, shaper)
        ents = inner.entropy or [0.0]  # the draft's, by position (its tokens and the target's differ in length)
        prop.entropy = [ents[min(i, len(ents) - 1)] for i in range(len(prop.tokens))]
        prop.setup_s = inner.setup_s
        return prop

    def close(self) -> None:
        self.inner.close()
