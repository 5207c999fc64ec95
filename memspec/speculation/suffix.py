"""The suffix draft: propose what followed the context's last tokens in what the daemon has seen.

    index = SuffixIndex(max_bytes=4 << 20)   # one per target, shared by every request's thread
    index.add(prompt + output)                # a finished request's committed tokens (Engine)
    draft = SuffixDraft(index, target_vocab)  # a Proposer: zero weights, its index's bytes
    state = draft.begin(capacity)             # a request: proposes from the index and its own context

SuffixDecoding (ArcticInference) keeps a suffix tree over past prompts and outputs and
proposes the most frequent continuation of the longest suffix match; llama.cpp's
`--spec-type ngram-mod` keeps a fixed-size rolling-hash pool shared by all slots.  This is
both, on fixed NumPy arrays:

* `buf` (slots,) int32: a ring of token ids, each sequence followed by SEP.  Whole sequences
  leave it oldest first (`tail` moves on) when a new one needs the room, or when the ring of
  sequence starts is full: eviction is by age, and nothing is ever allocated after the start.
* `head` (buckets,) and `nxt` (slots,) int64: a chained hash of each position's last KEY
  tokens, newest first.  Positions are absolute (they only grow); a link below `tail` points
  into evicted tokens, so a walk stops there and eviction needs no index clean-up.

A lookup walks the chain of the context's last KEY tokens, measures how far back each
occurrence agrees with the context (at most MAX_MATCH tokens), keeps the occurrences that agree
longest (with the request's own earlier tokens as more candidates: prompt lookup, subsumed)
and follows their continuations token by token while the most frequent next token keeps the
path's empirical probability at `min_prob` or more.  It proposes at most `spec_factor` times
the match length: a long match earns a long proposal (SuffixDecoding's max_spec_factor).

Proposals are deterministic (one-hot q when sampling, deterministic_proposal), and only
committed, target-verified tokens are ever indexed: output is the target's, as with any draft.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

import numpy as np

from memspec.request import SamplingParams
from memspec.speculation.config import DraftLimits
from memspec.speculation.drafts import LOOKUP_MAX_NGRAM, Proposal, deterministic_proposal, loop_continuation, ngram_continuation
from memspec.speculation.logits import IDENTITY, LogitsShaper

SUFFIX = "suffix"
SEP = -1  # ends each sequence in the ring; no token id equals it
KEY = 2  # the index is keyed on a position's last KEY tokens: the shortest match it finds
MAX_MATCH = 24  # a match is measured back at most this many tokens (longer ones tie)
MAX_CANDIDATES = 64  # the newest this many occurrences of the context's key vote ...
MAX_WALK = 256  # ... found within this many links of its hash chain (a lookup's time is bounded)
MIN_PROB = 0.1  # stop proposing once the path's empirical probability falls below this
RECALL_MIN_PROB = 0.5  # a recall (Recall) stops where fewer than half the occurrences still agree on its path
SPEC_FACTOR = 1.0  # propose at most this many tokens per token of match
SEQ_SLOTS_PER = 8  # the ring of sequence starts has one entry per this many token slots
# bytes a token slot costs: buf (4) + nxt (8) + at most half a head bucket (4) + 1/SEQ_SLOTS_PER of a start (1)
SLOT_BYTES = 4 + 8 + 4 + 8 // SEQ_SLOTS_PER
_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)  # odd 64-bit multipliers
_M1_INT, _M2_INT, _MASK = int(_M1), int(_M2), (1 << 64) - 1


def index_layout(max_bytes: int) -> tuple[int, int, int]:
    """(token slots, hash buckets, sequence starts) of an index of at most `max_bytes`."""
    slots = max_bytes // SLOT_BYTES
    if slots < 4 * MAX_MATCH:
        raise ValueError(f"a suffix index needs at least {4 * MAX_MATCH * SLOT_BYTES} bytes, got {max_bytes}")
    buckets = 1 << ((slots // 2).bit_length() - 1)  # a power of two <= slots / 2
    return slots, buckets, max(slots // SEQ_SLOTS_PER, 1)


def corpus_max_bytes(lengths) -> int:
    """The max_bytes of an index that holds sequences of these lengths and never evicts one."""
    kept = [n for n in lengths if n > KEY]
    slots = max(sum(n + 1 for n in kept) + 1, 4 * MAX_MATCH, SEQ_SLOTS_PER * (len(kept) + 1))
    return (slots + 1) * SLOT_BYTES


def corpus_index(sequences) -> SuffixIndex:
    """An index holding exactly `sequences` (token id arrays), as the suffix draft's corpus: sized
    for them, so none is ever evicted, and never written again."""
    index = SuffixIndex(corpus_max_bytes([len(s) for s in sequences]))
    for s in sequences:
        index.add(s)
    return index


def index_nbytes(max_bytes: int) -> int:
    """What an index of at most `max_bytes` holds: its arrays, allocated whole at the start."""
    slots, buckets, starts = index_layout(max_bytes)
    return slots * (4 + 8) + buckets * 8 + starts * 8


def _buckets(a: np.ndarray, b: np.ndarray, bits: int) -> np.ndarray:
    """The hash bucket of each key (a[i], b[i]): the top `bits` bits of a multiplicative hash."""
    h = (a.astype(np.uint64) * _M1 + b.astype(np.uint64)) * _M2  # wraps modulo 2^64
    return (h >> np.uint64(64 - bits)).astype(np.int64)


def _bucket(a: int, b: int, bits: int) -> int:
    """_buckets of one key in Python's integers (the same bucket; a lookup before every step of a
    request reads one key, and NumPy's arrays of one cost 10-15 us of a SmolLM2 step's 3-4 ms)."""
    return (((a * _M1_INT + b) & _MASK) * _M2_INT & _MASK) >> (64 - bits)


@dataclass
class SuffixStats:
    """What the index did (report() adds what it holds)."""

    added: int = 0  # sequences indexed
    evicted: int = 0  # sequences evicted, oldest first
    lookups: int = 0  # lookups
    hits: int = 0  # ... that found an occurrence of the context's key


@dataclass
class Match:
    """The continuations of the longest-agreeing occurrences, newest first."""

    length: int  # tokens each occurrence agrees with the context, counted back from its end
    rows: np.ndarray  # (m, k) int64 tokens that followed each occurrence
    valid: np.ndarray  # (m, k) bool: rows[i, j] is a real token (not past its sequence's end)


NO_MATCH = Match(0, np.zeros((0, 0), np.int64), np.zeros((0, 0), bool))


class SuffixIndex:
    """Recent requests' tokens and a hash of their positions, in fixed memory (module docstring);
    safe to share between request threads."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.slots, nbuckets, nstarts = index_layout(max_bytes)
        self._bits = nbuckets.bit_length() - 1
        self._lock = threading.Lock()
        self.buf = np.full(self.slots, SEP, np.int32)  # (slots,) token ids; position p at p % slots
        self.nxt = np.full(self.slots, -1, np.int64)  # (slots,) the previous position with the same bucket
        self.head = np.full(nbuckets, -1, np.int64)  # (buckets,) the newest position in each bucket
        self.starts = np.zeros(nstarts, np.int64)  # (nstarts,) ring: live sequences' first positions, oldest first
        self._first = 0  # slot in `starts` of the oldest live sequence
        self.sequences = 0  # live sequences
        self.tail = 0  # absolute position of the oldest live token
        self.end = 0  # absolute position of the next token written
        self.stats = SuffixStats()

    @property
    def nbytes(self) -> int:
        """The bytes it holds: its arrays, whole (index_nbytes), however full they are."""
        return self.buf.nbytes + self.nxt.nbytes + self.head.nbytes + self.starts.nbytes

    def add(self, tokens) -> None:
        """Index one sequence of committed token ids (a request's prompt and output), evicting the
        oldest sequences to make room; one longer than the ring keeps its latest tokens."""
        t = np.asarray(tokens, dtype=np.int64)
        if len(t) <= KEY:
            return  # no key with a token after it: nothing to propose from
        if t.min() < 0 or t.max() > np.iinfo(np.int32).max:
            raise ValueError(f"token ids must be in 0..{np.iinfo(np.int32).max}, got {t.min()}..{t.max()}")
        t = t[-(self.slots - 1):]  # the sequence and its SEP must fit the ring
        n = len(t)
        with self._lock:
            while self.sequences and (self.end + n + 1 - self.tail > self.slots or self.sequences == len(self.starts)):
                self._evict_oldest()
            base = self.end
            if not self.sequences:
                self.tail = base
            self.buf[(base + np.arange(n)) % self.slots] = t
            self.buf[(base + n) % self.slots] = SEP
            self._link(t, base)
            self.starts[(self._first + self.sequences) % len(self.starts)] = base
            self.sequences += 1
            self.end = base + n + 1
            self.stats.added += 1

    def _link(self, t: np.ndarray, base: int) -> None:
        """Chain each position that has a key and a token after it onto its bucket, in order."""
        j = np.arange(KEY - 1, len(t) - 1)
        pos = base + j
        b = _buckets(t[j - 1], t[j], self._bits)
        order = np.argsort(b, kind="stable")  # positions of one bucket stay oldest first
        bs, ps = b[order], pos[order]
        new_run = np.r_[True, bs[1:] != bs[:-1]]
        prev = np.r_[np.int64(-1), ps[:-1]]
        prev[new_run] = self.head[bs[new_run]]  # the first of a bucket links to its old head
        self.nxt[ps % self.slots] = prev
        last = np.r_[bs[1:] != bs[:-1], True]
        self.head[bs[last]] = ps[last]

    def clear(self) -> None:
        """Forget every sequence (a benchmark's rounds each start from nothing): positions only grow,
        so with `tail` moved to the end every old link falls below it, and no array is touched."""
        with self._lock:
            self._first = (self._first + self.sequences) % len(self.starts)
            self.stats.evicted += self.sequences
            self.sequences = 0
            self.tail = self.end

    def _evict_oldest(self) -> None:
        self._first = (self._first + 1) % len(self.starts)
        self.sequences -= 1
        self.tail = int(self.starts[self._first]) if self.sequences else self.end
        self.stats.evicted += 1

    def find(self, suffix: np.ndarray, k: int) -> Match:
        """The indexed occurrences of `suffix`'s last KEY or more tokens that agree with it longest
        (at most MAX_MATCH back), newest first, with up to `k` tokens that followed each."""
        if len(suffix) < KEY or k <= 0:
            return NO_MATCH
        a, b = int(suffix[-2]), int(suffix[-1])
        with self._lock:
            self.stats.lookups += 1
            found = []
            p = int(self.head[_bucket(a, b, self._bits)])
            for _ in range(MAX_WALK):
                if p < self.tail or len(found) == MAX_CANDIDATES:
                    break
                s = p % self.slots
                if self.buf[s] == b and self.buf[(p - 1) % self.slots] == a:  # p - 1 is in p's sequence
                    found.append(p)
                p = int(self.nxt[s])
            if not found:
                return NO_MATCH
            self.stats.hits += 1
            ends = np.asarray(found, dtype=np.int64)
            lengths = _agreement(lambda q: self.buf[q % self.slots], ends, suffix, KEY, self.tail)
            best = ends[lengths == lengths.max()]
            idx = best[:, None] + 1 + np.arange(k)  # (m, k) positions after each occurrence
            rows = self.buf[idx % self.slots].astype(np.int64)
        valid = np.cumprod(rows != SEP, axis=1).astype(bool)  # up to its sequence's SEP (always before `end`)
        return Match(int(lengths.max()), rows, valid)

    def report(self) -> dict:
        with self._lock:
            return {"bytes": self.nbytes, "sequences": self.sequences, "tokens": self.end - self.tail - self.sequences,
                    **asdict(self.stats)}


def _agreement(at, ends: np.ndarray, suffix: np.ndarray, known: int, floor: int) -> np.ndarray:
    """(m,) how many tokens back each occurrence ending at `ends` agrees with `suffix` (its last
    `known` tokens are known to agree), up to MAX_MATCH; `at(positions)` reads tokens, and no
    position below `floor` is read."""
    lengths = np.full(len(ends), known, dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for d in range(known, min(MAX_MATCH, len(suffix))):
        q = ends - d
        ok = alive & (q >= floor)
        ok[ok] = at(q[ok]) == suffix[-1 - d]
        lengths += ok
        alive = ok
        if not alive.any():
            break
    return lengths


def own_match(context: np.ndarray, k: int) -> Match:
    """Prompt lookup as a Match: the context's own earlier occurrences of its last token that agree
    with its end longest (at most MAX_CANDIDATES, newest first), with up to `k` tokens after each."""
    n = len(context)
    if n < 2 or k <= 0:
        return NO_MATCH
    ends = np.flatnonzero(context[:-1] == context[-1])[::-1][:MAX_CANDIDATES]
    if not len(ends):
        return NO_MATCH
    lengths = _agreement(lambda q: context[q], ends, context[-MAX_MATCH:], 1, 0)
    best = ends[lengths == lengths.max()]
    idx = best[:, None] + 1 + np.arange(k)
    valid = idx < n
    return Match(int(lengths.max()), np.where(valid, context[np.minimum(idx, n - 1)], SEP), valid)


def vote(match: Match, k: int, min_prob: float = MIN_PROB) -> list[int]:
    """The most frequent continuation path among the match's rows, token by token (a tie goes to
    the newest row), while the path's empirical probability stays at `min_prob` or more: at each
    depth, the rows still on the path that carry its next token over the rows still on it."""
    rows, valid = match.rows, match.valid
    on = np.ones(len(rows), dtype=bool)
    out: list[int] = []
    prob = 1.0
    for i in range(min(k, rows.shape[1] if rows.ndim == 2 else 0)):
        live = on & valid[:, i]
        if not live.any():
            break
        toks = rows[live, i]
        vals, counts = np.unique(toks, return_counts=True)
        top = counts.max()
        prob *= top / on.sum()
        if prob < min_prob:
            break
        winners = vals[counts == top]
        tok = int(toks[np.isin(toks, winners)][0])  # rows are newest first
        out.append(tok)
        on = live & (rows[:, i] == tok)
    return out


# -- the draft ------------------------------------------------------------------------------
class SuffixDraft:
    """A zero-weight Proposer over a SuffixIndex: its bytes are the index's."""

    name = SUFFIX
    session = None  # no model, no KV cache

    def __init__(self, index: SuffixIndex, target_vocab: int, loop_tokens: int = DraftLimits.loop_tokens,
                 min_prob: float = MIN_PROB, spec_factor: float = SPEC_FACTOR, corpus: "SuffixIndex | None" = None):
        self.index = index
        self.target_vocab = target_vocab
        self.loop_tokens = loop_tokens  # a context ending in a loop this long continues it (0: never)
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self.corpus = corpus  # the target's own answers (memspec.training.corpus): never evicted nor forgotten

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + (self.corpus.nbytes if self.corpus is not None else 0)

    def begin(self, capacity: int) -> "SuffixState":
        return SuffixState(self)

    def feed_seconds_per_token(self) -> float:
        return 0.0  # nothing to catch up on

    def learn(self, tokens: list[int]) -> None:
        """A finished request's committed tokens (prompt and output): indexed for the ones after it."""
        self.index.add(tokens)

    def forget(self) -> None:
        """Drop everything learned (SuffixIndex.clear)."""
        self.index.clear()

    def recall(self, context: list[int], k: int, min_match: int) -> list[int]:
        """Up to k tokens that followed the context's end in the requests indexed, where its last
        `min_match` tokens or more agree with them there, and longer than with any earlier place in
        the context itself (the request's own text is what prompt lookup and every model draft's
        lookup copy from: a rewrite of text sent back follows its own copy), while at least half of
        the longest-agreeing occurrences agree on the path; [] otherwise."""
        if k <= 0 or len(context) < min_match:
            return []
        match = self.index.find(np.asarray(context[-MAX_MATCH:], dtype=np.int64), k)
        if match.length < min_match or own_match(np.asarray(context, dtype=np.int64), 1).length >= match.length:
            return []  # (the whole text is read only where the index matched that long)
        return vote(match, min(k, max(1, int(self.spec_factor * match.length))), RECALL_MIN_PROB)


class SuffixState:
    """One request's use of the shared index; it keeps no state of its own."""

    def __init__(self, draft: SuffixDraft):
        self.d = draft

    def find(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens: the loop the context ends in, else the vote of the longest matches
        among the index and the context itself, at most spec_factor tokens per token of match."""
        loop = loop_continuation(context, k, self.d.loop_tokens)
        if loop:
            return loop
        ctx = np.asarray(context, dtype=np.int64)
        seen, own = self.d.index.find(ctx[-MAX_MATCH:], k), own_match(ctx, k)
        corpus = self.d.corpus.find(ctx[-MAX_MATCH:], k) if self.d.corpus is not None else NO_MATCH
        length = max(seen.length, own.length, corpus.length)
        if not length:
            return []
        # the request's own tokens first (newest), then what the daemon served, then the corpus
        both = [m for m in (own, seen, corpus) if m.length == length]
        match = Match(length, np.concatenate([m.rows for m in both]), np.concatenate([m.valid for m in both]))
        return vote(match, min(k, max(1, int(self.d.spec_factor * length))), self.d.min_prob)

    def propose(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator,
                shaper: LogitsShaper = IDENTITY, alternatives: bool = False) -> Proposal:
        return deterministic_proposal(self.find(context, k), self.d.target_vocab, params, shaper)

    def close(self) -> None:
        pass


class Recall:
    """One request's recall of what the daemon saw (SuffixDecoding's hybrid: the index where the text
    matches it long, the picked draft elsewhere).  Before each step its selector
    (memspec.scheduling.selector) asks `check`: where the text's last `min_match` tokens or more agree
    with a request in the index (a retried or regenerated request, a conversation's earlier turn sent
    back, code edited again), the step proposes what followed there and the picked draft does not run
    (its cache catches up when it next does).  Not where the picked draft's own lookup (its last
    `lookup_ngram` tokens or more earlier in the text: drafts.ngram_continuation) would propose the
    same tokens: a rewrite of an answer sent back copies it from the prompt either way, and one draft
    keeps its step controller's record.  The proposal is one-hot, as any copy: the output is the
    target's."""

    def __init__(self, draft: SuffixDraft, min_match: int, lookup_ngram: int = DraftLimits.lookup_ngram):
        if not KEY <= min_match <= MAX_MATCH:
            raise ValueError(f"a recall needs a match of {KEY}..{MAX_MATCH} tokens, got {min_match}")
        self.draft, self.min_match, self.lookup_ngram = draft, min_match, lookup_ngram
        self._at, self._found = -1, []  # the text length the last check was for, and what it found

    def _find(self, context: list[int]) -> list[int]:
        found = self.draft.recall(context, MAX_MATCH, self.min_match)
        if found and ngram_continuation(context, len(found), self.lookup_ngram, LOOKUP_MAX_NGRAM) == found:
            return []  # the text's own copy says the same (lookup_ngram 0: the draft copies nothing)
        return found

    def check(self, context: list[int]) -> bool:
        """Whether the index continues the text's end (what it found is kept for propose)."""
        self._at, self._found = len(context), self._find(context)
        return bool(self._found)

    def propose(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator,
                shaper: LogitsShaper = IDENTITY, alternatives: bool = False) -> Proposal:
        found = self._found if self._at == len(context) else self._find(context)
        return deterministic_proposal(found[:k], self.draft.target_vocab, params, shaper)

    def close(self) -> None:
        pass
