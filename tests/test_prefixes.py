"""The prompt-prefix cache (memspec.runtime.prefixes) on caches of plain arrays: which entry a prompt
starts from, what is kept, and within what memory.  tests/test_native_target.py runs it on the native
target and checks that a reused prefix changes no token."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from memspec.runtime.prefixes import PrefixCache

WIDTH = 4  # values per position


class ArrayCache:
    """A cache whose position i holds the token fed there (what a real cache's K/V stand for)."""

    def __init__(self, capacity: int = 64):
        self.data = np.full((capacity, WIDTH), -1, dtype=np.int64)
        self.length = 0

    def feed(self, ids):
        self.data[self.length: self.length + len(ids)] = np.asarray(ids)[:, None]
        self.length += len(ids)

    def prefix(self, n):
        return self.data[:n].copy()

    def load_prefix(self, kv, n):
        self.data[:n] = kv[:n]
        self.length = n


def cached(ids):
    c = ArrayCache()
    c.feed(ids)
    return c


SYSTEM = list(range(100, 120))  # a template and system prompt every prompt starts with


def test_a_prompt_starts_from_the_entry_that_agrees_longest_never_all_of_it():
    p = PrefixCache(1 << 20, min_tokens=4)
    assert p.store(SYSTEM + [1, 2, 3], cached(SYSTEM + [1, 2, 3]))
    assert p.store(SYSTEM + [1, 2, 9, 9], cached(SYSTEM + [1, 2, 9, 9]))
    c = ArrayCache()
    assert p.fill(c, SYSTEM + [1, 2, 9, 5]) == len(SYSTEM) + 3
    assert c.length == len(SYSTEM) + 3 and (c.data[: c.length, 0] == SYSTEM + [1, 2, 9]).all()
    c = ArrayCache()  # the same prompt again: its last token is still fed, for the logits after it
    assert p.fill(c, SYSTEM + [1, 2, 3]) == len(SYSTEM) + 2
    assert p.report()["hits"] == 2 and p.report()["reused_tokens"] == 2 * len(SYSTEM) + 5


def test_too_short_an_agreement_is_a_miss_and_leaves_the_cache_empty():
    p = PrefixCache(1 << 20, min_tokens=8)
    p.store(SYSTEM, cached(SYSTEM))
    c = ArrayCache()
    assert p.fill(c, SYSTEM[:5] + [7, 7, 7, 7, 7]) == 0 and c.length == 0
    assert p.fill(ArrayCache(), [1, 2, 3]) == 0
    assert p.report()["lookups"] == 2 and p.report()["hits"] == 0
    with pytest.raises(ValueError, match="empty cache"):
        p.fill(cached([1]), SYSTEM)


def test_a_longer_entry_replaces_its_starts_and_a_start_of_one_held_is_not_stored():
    p = PrefixCache(1 << 20, min_tokens=4)
    p.store(SYSTEM, cached(SYSTEM))  # a prompt, after its prefill ...
    answer = SYSTEM + [5, 6, 7, 8]
    assert p.store(answer, cached(answer))  # ... and the same request at its end, answer and all
    assert p.report()["entries"] == 1
    assert not p.store(SYSTEM[:10], cached(SYSTEM[:10]))  # held already, inside the longer one
    assert p.report()["entries"] == 1
    # only what the cache has committed is kept: the last token of an answer is never fed
    assert p.store(answer + [9, 10], cached(answer + [9]))
    assert p.fill(ArrayCache(), answer + [9, 10, 11]) == len(answer) + 1


def test_entries_stay_within_the_byte_limit_least_recently_used_out():
    entry = 24 * WIDTH * 8  # bytes of a 24-token entry
    p = PrefixCache(2 * entry, min_tokens=4)
    a, b, c = ([k] * 24 for k in (1, 2, 3))
    p.store(a, cached(a))
    p.store(b, cached(b))
    assert p.fill(ArrayCache(), a + [0]) == 24  # a used: b is now the oldest
    p.store(c, cached(c))
    assert p.report()["entries"] == 2 and p.report()["bytes"] <= 2 * entry
    assert p.fill(ArrayCache(), b + [0]) == 0 and p.fill(ArrayCache(), a + [0]) == 24
    assert not PrefixCache(entry - 1, min_tokens=4).store(a, cached(a))  # larger than the whole cache


def test_clear_gives_back_every_byte():
    p = PrefixCache(1 << 20, min_tokens=4)
    p.store(SYSTEM, cached(SYSTEM))
    held = p.report()["bytes"]
    assert held > 0 and p.clear() == held
    assert p.report()["entries"] == 0 and p.fill(ArrayCache(), SYSTEM + [1]) == 0


def test_threads_storing_and_filling_at_once_always_load_a_true_prefix():
    p = PrefixCache(64 * 24 * WIDTH * 8, min_tokens=4)
    rng = np.random.default_rng(0)
    prompts = [SYSTEM + list(rng.integers(0, 50, 12)) for _ in range(40)]
    bad = []

    def worker(seed):
        r = np.random.default_rng(seed)
        for _ in range(200):
            ids = prompts[r.integers(len(prompts))]
            c = ArrayCache()
            n = p.fill(c, ids)
            if n and not (c.data[:n, 0] == ids[:n]).all():
                bad.append((ids, n))
            c.feed(ids[n:])
            p.store(ids, c)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and p.report()["hits"] > 0


def test_a_bad_limit_is_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(-1)
