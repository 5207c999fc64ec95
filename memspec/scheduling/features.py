"""Features the predictor reads: what the prompt asks for, and where generation is now.

`prompt_features(text)` describes a request once (length, character classes,
code / math / copy / chat markers, repetition); `context_features(ctx)` describes
the moment of a decision during generation (position, recent acceptance, draft
entropy, the tail of the generated text); `overlap_features(prompt_ngrams(text), ctx)` says how
much the generated tail repeats the prompt, which is what prompt lookup feeds on.
`generation_context(decode, ids)` is the one builder of that context.

Everything is plain Python and NumPy: byte counts in NumPy for character classes,
`bytes.translate` + `split` for words, set lookups for the lexicon.
The prompt text is what the user sent (`request_text(req)`): the prompt itself, or
for chat requests the turns rendered in ChatML so the chat features can count them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

# Drafts whose recent acceptance has a feature of its own (the ones memspec ships).
KNOWN_DRAFTS = ("prompt-lookup", "draft-code", "draft-math", "draft-chat", "draft-general")
UNKNOWN = -1.0  # value of a feature that cannot be measured yet (no steps of that draft so far)

PROMPT_FEATURES: tuple[str, ...] = (
    "log_chars", "log_words", "log_lines",
    "frac_lower", "frac_upper", "frac_digit", "frac_space", "frac_newline",
    "frac_operator", "frac_bracket", "frac_punct", "frac_symbol", "frac_nonascii",
    "code_fences", "code_keywords", "code_intent", "braces", "semicolons", "indented_lines",
    "numbers", "math_words", "copy_verbs", "copy_verb_first", "given_text_frac", "quoted_frac",
    "structured_markers", "format_words", "creative_words", "question", "chat_turns", "has_system",
    "type_token_ratio", "bigram_repeat",
)
CONTEXT_FEATURES: tuple[str, ...] = (
    "has_context", "log_position", "in_code_block", "draft_entropy",
    *(f"acc:{d}" for d in KNOWN_DRAFTS), "acc_max",
    "tail_frac_alpha", "tail_frac_digit", "tail_frac_space", "tail_frac_newline", "tail_frac_code",
    "tail_indented", "tail_repeat",
)
OVERLAP_FEATURES: tuple[str, ...] = ("tail_in_prompt",)


@dataclass
class GenerationContext:
    """What the scheduler knows about a request at a decision point."""

    position: int  # tokens generated so far
    recent_acceptance: dict[str, float] = field(default_factory=dict)  # draft -> acceptance rate, recent steps
    draft_entropy: float = float("nan")  # mean draft entropy over the recent steps (nats); NaN = no model draft ran
    in_code_block: bool = False  # an unclosed ``` in the generated text
    generated_tail: str = ""  # the last ~200 characters generated

    def to_record(self) -> dict:
        """What a trace segment keeps of the context (`memspec profile`): the part the text decides.
        Acceptance and entropy depend on which draft ran before, so training rows supply them."""
        return {"position": self.position, "in_code_block": self.in_code_block, "generated_tail": self.generated_tail}

    @classmethod
    def from_record(cls, record: dict, acceptance: dict[str, float] | None = None,
                    entropy: float = float("nan")) -> "GenerationContext":
        """The context `to_record` kept, with the acceptance and entropy a scheduler would have seen."""
        return cls(record["position"], dict(acceptance or {}), entropy, record["in_code_block"],
                   record["generated_tail"])


# -- lexicon ------------------------------------------------------------------------------
_LEXICON_WORDS = {
    "code_keywords": "def class import return elif lambda print self const let var async await public static void "
                     "include struct fn impl println printf console log select from where insert join none null true "
                     "false",
    "code_intent": "python javascript typescript java sql code function functions program script method regex bash "
                   "shell html css rust golang algorithm implement compile api query loop array dict recursion "
                   "snippet debounce",
    "math_words": "calculate compute solve how many much total cost costs percent percentage sum product equation "
                  "average ratio area speed minutes hours km miles price profit rate step steps times divide "
                  "multiply plus minus equals fraction remainder cents dollars",
    "copy_verbs": "summarize summarise summary extract rewrite rephrase paraphrase convert correct translate fix "
                  "proofread edit shorten simplify reformat format restate tldr list repeat copy transform",
    "format_words": "json yaml csv markdown table xml bullet bullets points",
    "creative_words": "story poem haiku letter song imagine dialogue tale fairy character describe diary limerick "
                      "creative fictional",
}
_LEXICON = {w.encode(): name for name, words in _LEXICON_WORDS.items() for w in words.split()}
_LEXICON_SET = frozenset(_LEXICON)
_QUESTION_WORDS = frozenset(w.encode() for w in "what who why when where how which is are can does do explain".split())
_REPEAT_WORDS = 128  # bigram repetition looks at the first (prompt) / last (tail) this many words

# bytes.translate tables (C speed): word characters kept, the rest -> space; digits -> "0", the rest -> space
_WORD_TABLE = bytes(c if (97 <= c <= 122 or 48 <= c <= 57 or c == 95 or c >= 128) else 32 for c in range(256))
_DIGIT_TABLE = bytes(48 if 48 <= c <= 57 else 32 for c in range(256))
# character classes of each UTF-8 byte: lower upper digit space newline operator bracket punct symbol non-ASCII
_CLASS_OF = np.full(256, 8, dtype=np.int64)  # 8 = other symbols (#@$&|\\~`_ and control)
for _chars, _cls in (("abcdefghijklmnopqrstuvwxyz", 0), ("ABCDEFGHIJKLMNOPQRSTUVWXYZ", 1), ("0123456789", 2),
                     (" \t\r", 3), ("\n", 4), ("+-*/=<>^%", 5), ("{}[]()", 6), (".,;:!?'\"", 7)):
    _CLASS_OF[[ord(c) for c in _chars]] = _cls
_CLASS_OF[128:] = 9
_CLASS_MATRIX = np.eye(10)[:, _CLASS_OF]  # (10, 256): byte counts -> class counts


def _byte_counts(raw: bytes) -> np.ndarray:
    """(256,) how often each byte value occurs."""
    return np.bincount(np.frombuffer(raw, dtype=np.uint8), minlength=256)


def _char_classes(counts: np.ndarray) -> np.ndarray:
    """(10,) fraction of the UTF-8 bytes in each class, from _byte_counts."""
    return _CLASS_MATRIX @ counts / max(int(counts.sum()), 1)


def _words(raw_lower: bytes) -> list[bytes]:
    return raw_lower.translate(_WORD_TABLE).split()


def _bigram_repeat(words: list) -> float:
    """Share of word bigrams that occurred earlier in the same text (0 = none repeat)."""
    if len(words) < 3:
        return 0.0
    bigrams = list(zip(words, words[1:]))
    return 1.0 - len(set(bigrams)) / len(bigrams)


def chat_text(messages) -> str:
    """Chat turns as the predictor reads them: ChatML, without the template's default system prompt."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)


def request_text(req) -> str:
    """The prompt text of a GenerationRequest as the predictor reads it (the prompt, or chat_text of messages)."""
    return req.prompt if req.messages is None else chat_text(req.messages)


def _quoted_frac(text: str, n: int) -> float:
    """Share of the text between the first and the last double quote (text given verbatim)."""
    for q in ('"', "\u201c"):
        if text.count(q) >= 2 or (q == "\u201c" and q in text):
            close = '"' if q == '"' else "\u201d"
            i, j = text.find(q), text.rfind(close)
            if j > i:
                return (j - i - 1) / n
    return 0.0


def prompt_features(text: str) -> np.ndarray:
    """(len(PROMPT_FEATURES),) float64 description of a prompt."""
    n = max(len(text), 1)
    lower = text.lower()
    raw = text.encode("utf-8", "replace")
    words = _words(lower.encode("utf-8", "replace"))
    nw = max(len(words), 1)
    distinct = set(words)
    lex = dict.fromkeys(_LEXICON_WORDS, 0)
    for w in distinct & _LEXICON_SET:  # distinct lexicon words of each kind
        lex[_LEXICON[w]] += 1
    lines = text.split("\n")
    heads = [ln[:2] for ln in lines]
    indented = sum(1 for h in heads if h in ("  ", "\t") or h[:1] == "\t")
    listed = sum(1 for h in heads if h in ("- ", "* ", "1.") or h[:1] in ("#", "|"))
    bc = _byte_counts(raw)
    # text given to work on: after the first colon or line break of the instruction
    cut = min((i for i in (text.find(":"), text.find("\n")) if i >= 0), default=-1)
    given = (n - cut - 1) / n if 0 <= cut < 300 else 0.0
    structured = text.count('":') + listed
    turns = text.count("<|im_start|>") + lower.count("\nuser:") + lower.count("\nassistant:") + lower.startswith(
        ("user:", "assistant:"))
    question = float(text.rstrip().endswith("?") or (bool(words) and words[0] in _QUESTION_WORDS))
    out = [
        math.log1p(len(text)), math.log1p(len(words)), math.log1p(len(lines)), *_char_classes(bc),
        text.count("```"), lex["code_keywords"] / nw, lex["code_intent"] / nw,
        (bc[123] + bc[125]) / n, bc[59] / n, indented / len(lines),
        math.log1p(len(raw.translate(_DIGIT_TABLE).split())), lex["math_words"] / nw, lex["copy_verbs"] / nw,
        float(any(_LEXICON.get(w) == "copy_verbs" for w in words[:12])), given, _quoted_frac(text, n),
        math.log1p(structured), lex["format_words"] / nw, lex["creative_words"] / nw, question,
        turns, float("<|im_start|>system" in text or lower.startswith("system:")),
        len(distinct) / nw, _bigram_repeat(words[:_REPEAT_WORDS]),
    ]
    return np.asarray(out, dtype=np.float64)


def context_features(ctx: GenerationContext | None) -> np.ndarray:
    """(len(CONTEXT_FEATURES),) float64; `None` = before the first token (nothing known yet)."""
    if ctx is None:
        return _NO_CONTEXT.copy()
    acc = [float(ctx.recent_acceptance.get(d, UNKNOWN)) for d in KNOWN_DRAFTS]
    known = [float(a) for a in ctx.recent_acceptance.values() if a == a]
    entropy = ctx.draft_entropy if ctx.draft_entropy == ctx.draft_entropy else UNKNOWN  # NaN -> unknown
    tail = ctx.generated_tail
    n = max(len(tail.encode("utf-8", "replace")), 1)
    bc = _byte_counts(tail.encode("utf-8", "replace"))
    cc = _char_classes(bc)
    lines = tail.split("\n")
    indented = sum(1 for ln in lines[1:] if ln.startswith(("  ", "\t")))
    words = _words(tail.lower().encode("utf-8", "replace"))
    out = [
        1.0, math.log1p(ctx.position), float(ctx.in_code_block), entropy, *acc, max(known, default=UNKNOWN),
        cc[0] + cc[1], cc[2], cc[3], cc[4], cc[5] + cc[6] + bc[59] / n,
        indented / max(len(lines) - 1, 1), _bigram_repeat(words[-_REPEAT_WORDS:]),
    ]
    return np.asarray(out, dtype=np.float64)


_NO_CONTEXT = np.asarray([0.0, 0.0, 0.0, UNKNOWN, *([UNKNOWN] * len(KNOWN_DRAFTS)), UNKNOWN, *([0.0] * 7)])


def prompt_ngrams(text: str, n: int = 3) -> frozenset:
    """The word n-grams of a prompt (the predictor keeps them per prompt for `overlap_features`)."""
    words = _words(text.lower().encode("utf-8", "replace"))
    return frozenset(zip(*(words[i:] for i in range(n))))


def overlap_features(prompt_grams: frozenset, ctx: GenerationContext | None, n: int = 3) -> np.ndarray:
    """(len(OVERLAP_FEATURES),): the share of the tail's word n-grams that occur in the prompt."""
    if ctx is None or not ctx.generated_tail:
        return np.zeros(len(OVERLAP_FEATURES))
    words = _words(ctx.generated_tail.lower().encode("utf-8", "replace"))
    grams = list(zip(*(words[i:] for i in range(n))))
    if not grams:
        return np.zeros(len(OVERLAP_FEATURES))
    return np.asarray([len(prompt_grams.intersection(grams)) / len(set(grams))])


class Detokenize(Protocol):
    """Token ids -> text (memspec.models.tokenizer.Tokenizer.decode)."""

    def __call__(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


TAIL_CHARS = 200  # generated text a context keeps (GenerationContext.generated_tail)


def generation_context(decode: Detokenize, generated: Sequence[int], acceptance: dict[str, float] | None = None,
                       entropy: float = float("nan"), tail_chars: int = TAIL_CHARS) -> GenerationContext:
    """The predictor's context after `generated` (the token ids after the prompt).

    The one place a context is built: profiling records it for every trace segment (training
    rows read those records back), and the scheduler asks the predictor with it while a request
    runs, so both see the same text: every generated token, special tokens skipped."""
    text = decode(list(generated), skip_special_tokens=True)
    return GenerationContext(
        position=len(generated), recent_acceptance=dict(acceptance or {}), draft_entropy=entropy,
        in_code_block=text.count("```") % 2 == 1, generated_tail=text[-tail_chars:],
    )
