"""Seeded random strings for tokenizer fuzzing, shared by the fixture script and the tests.

The Qwen fixture stores only a seed, a count and a hash of llama.cpp's ids for each
string; the test regenerates the strings here. Changing a pool changes every string
after it, so a change here needs the fixture re-recorded (scripts/make_golden_fixtures.py).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

# Pieces a string is built from: ASCII words, digits, whitespace runs, punctuation and
# contractions, Latin accents, CJK, emoji and joiners, other numbers, unusual spaces.
_POOLS = ["abcXYZ", "0123456789", " ", "  \t\n\r", ".,;:!?'\"()[]{}<>-_/\\|@#$%^&*", "'s'll'd'm've're",
          "éüßøñçÅ", "日本語中文한국", "😀🍕👍🏽\u200d❤️", "²½Ⅻ٣", "\u00a0\u2003\u3000\u200b\u0301"]
_WHOLE = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
_QWEN_WHOLE = [*_WHOLE, "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
               "<|file_sep|>", "[PAD151665]", "def f(x):\n    return x\n", "    ", "\n\n", "'S", "'LL"]


def random_text(rng: random.Random) -> str:
    """A random string mixing scripts, digits, whitespace, punctuation and special tokens (SmolLM2)."""
    return _compose(rng, _POOLS + _WHOLE, set(_WHOLE), 12)


def qwen_text(rng: random.Random) -> str:
    """Like :func:`random_text`, with Qwen's added tokens, code and random code points of any plane."""
    parts = []
    for _ in range(rng.randint(1, 10)):
        if rng.random() < 0.15:
            parts.append("".join(_random_code_point(rng) for _ in range(rng.randint(1, 4))))
        else:
            parts.append(_compose(rng, _POOLS + _QWEN_WHOLE, set(_QWEN_WHOLE), 1))
    return "".join(parts)


def _compose(rng: random.Random, pools: Sequence[str], whole: set[str], max_parts: int) -> str:
    parts = []
    for _ in range(rng.randint(1, max_parts)):
        pool = rng.choice(pools)
        parts.append(pool if pool in whole else "".join(rng.choices(pool, k=rng.randint(1, 5))))
    return "".join(parts)


def _random_code_point(rng: random.Random) -> str:
    """Any scalar value below U+30000 (assigned or not), weighted towards the BMP."""
    while True:
        cp = rng.randrange(0x20, 0x10000 if rng.random() < 0.8 else 0x30000)
        if not 0xD800 <= cp < 0xE000:
            return chr(cp)


def fuzz_strings(generator: str, seed: int, n: int) -> list[str]:
    """The ``n`` strings ``generator`` (a function name here) makes from ``seed``."""
    make = {"random_text": random_text, "qwen_text": qwen_text}[generator]
    rng = random.Random(seed)
    return [make(rng) for _ in range(n)]


def ids_digest(ids: Sequence[int]) -> str:
    """A short hash of one token-id sequence (12 hex digits), as the fixture stores it."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:12]
