"""Prompt prefixes kept with their KV: a new request starts where an earlier one's tokens agree.

    prefixes = PrefixCache(max_bytes=64 << 20)
    n = prefixes.fill(cache, prompt)   # the longest stored start of `prompt` (never all of it), copied in
    logits = target.forward(cache, prompt[n:], keep=1)
    prefixes.store(prompt, cache)      # after the prefill: this prompt's KV for the requests after it

Every chat request starts with the same template and system prompt, and each turn of a
conversation resends the turns before it: their KV need not be computed again.  A stored
entry is the tokens and a copy of their K/V (`cache.prefix(n)`); a new request takes the
entry that agrees with its prompt for the most tokens, at least `min_tokens`, and feeds only
the rest.  Entries are kept least recently used first out, within `max_bytes`; an entry whose
tokens start another's is dropped for the longer one.

Lossless only where a position's K/V and logits do not depend on how many rows shared its
pass (row invariance, memspec.runtime.invariance): the native engine computes every row by one
fixed sequence of operations, so a reused prefix is the prefix it would have computed, bit for
bit.  A target says so with `prefix_reuse`; the engine keeps no prefix cache for one that
does not.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np


class PrefixKV(Protocol):
    """What a cache must offer for reuse (memspec.runtime.native_target.NativeCache)."""

    length: int

    def prefix(self, n: int) -> np.ndarray: ...  # a copy of the first n positions' K/V

    def load_prefix(self, kv: np.ndarray, n: int) -> None: ...  # those of kv's first n, as committed


@dataclass
class PrefixStats:
    """The cache's counters (report() adds what it holds: entries and bytes)."""

    lookups: int = 0  # requests that asked
    hits: int = 0  # ... and started from a stored prefix
    reused_tokens: int = 0  # prompt tokens not computed again


def _agree(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens a and b share."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class PrefixCache:
    """Stored token prefixes and their K/V (module docstring); safe to share between request threads."""

    def __init__(self, max_bytes: int, min_tokens: int = 8):
        if max_bytes < 0 or min_tokens < 1:
            raise ValueError(f"a prefix cache needs max_bytes >= 0 and min_tokens >= 1 "
                             f"(got {max_bytes}, {min_tokens})")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # id -> (tokens, kv)
        self._next_id = 0
        self.stats = PrefixStats()

    def fill(self, cache: PrefixKV, ids: Sequence[int]) -> int:
        """Load into the empty `cache` the K/V of the longest stored start of `ids`, leaving at
        least its last token to feed (a pass must compute the logits that follow the prompt); the
        number of tokens loaded, 0 when none agrees for min_tokens."""
        if cache.length:
            raise ValueError("a prefix is loaded into an empty cache")
        want = np.asarray(ids[:-1], dtype=np.int64)
        best, best_n = None, 0
        with self._lock:
            self.stats.lookups += 1
            for key, (tokens, kv) in self._entries.items():
                n = _agree(tokens, want)
                if n > best_n:
                    best, best_n = key, n
            if best is None or best_n < self.min_tokens:
                return 0
            self._entries.move_to_end(best)
            kv = self._entries[best][1]  # never written again: safe to read outside the lock
            self.stats.hits += 1
            self.stats.reused_tokens += best_n
        cache.load_prefix(kv, best_n)
        return best_n

    def store(self, ids: Sequence[int], cache: PrefixKV) -> bool:
        """Keep the cache's committed tokens, the first cache.length of `ids`, for later requests
        (copied: the cache goes on).  False when they are too short, too large, or held already."""
        n = min(len(ids), cache.length)
        if n < self.min_tokens:
            return False
        tokens = np.asarray(ids[:n], dtype=np.int64)
        with self._lock:
            for key, (held, _) in self._entries.items():
                if len(held) >= n and _agree(held, tokens) == n:  # held already, as the start of a longer one
                    self._entries.move_to_end(key)
                    return False
        kv = cache.prefix(n)
        if kv.nbytes > self.max_bytes:
            return False
        with self._lock:
            for key in [k for k, (held, _) in self._entries.items() if _agree(held, tokens) == len(held)]:
                del self._entries[key]  # starts of this one: the longer entry serves them too
            self._entries[self._next_id] = (tokens, kv)
            self._next_id += 1
            held = self._held()
            while held > self.max_bytes:  # least recently used out
                held -= self._entries.popitem(last=False)[1][1].nbytes
        return True

    def clear(self) -> int:
        """Drop every entry (memory pressure); the bytes freed."""
        with self._lock:
            freed = self._held()
            self._entries.clear()
        return freed

    def _held(self) -> int:
        """Bytes of K/V the entries hold (under the lock)."""
        return sum(kv.nbytes for _, kv in self._entries.values())

    def report(self) -> dict:
        """What GetStatus and /metrics show: the counters, entries and bytes held."""
        with self._lock:
            out = {k: float(v) for k, v in vars(self.stats).items()}
            out.update(entries=float(len(self._entries)), bytes=float(self._held()))
        return out
