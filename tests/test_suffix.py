"""The suffix draft: its index on literal token lists (matching, voting, eviction by age, a
byte bound over a long run, threads), its place in the pool and the scheduler, and the real
target: greedy output unchanged, and a repeated request accepting far more the second time."""

from __future__ import annotations

import random
import threading
from collections import deque
import tracemalloc

import numpy as np
import pytest

from fakes import FakeProbe
from memspec.errors import ConfigError, InvalidRequestError
from memspec.request import GenerationRequest, SamplingParams
from memspec.scheduling.config import SchedulerConfig
from memspec.scheduling.scheduler import Scheduler, draft_footprints
from memspec.speculation.config import SpecConfig
from memspec.speculation.sources import DraftPool, DraftRow
from memspec.speculation.suffix import (KEY, MAX_CANDIDATES, MAX_MATCH, SUFFIX, Match, Recall, SuffixDraft, SuffixIndex,
                                        _bucket, _buckets, index_layout, index_nbytes, own_match, vote)
from test_sampling import chi_square_p
from test_speculative import V, second_token_counts, tiny  # noqa: F401  (tiny: the fixture)

KiB = 1 << 10
GREEDY = SamplingParams()


def proposal(draft: SuffixDraft, context: list[int], k: int = 8) -> list[int]:
    return draft.begin(64).propose(context, k, GREEDY, None).tokens


def test_one_keys_bucket_is_the_bucket_indexing_gave_it():
    """find() hashes its one key in Python's integers, add() hashes arrays: the same buckets, or
    every lookup misses."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 1 << 18, 2000), rng.integers(0, 1 << 18, 2000)
    for bits in (8, 16, 24):
        assert _buckets(a, b, bits).tolist() == [_bucket(int(x), int(y), bits) for x, y in zip(a, b)]


def brute_force(live: list[list[int]], suffix: list[int], k: int) -> tuple[int, list[list[int]], int]:
    """What find() must return, by scanning: the longest agreement of an occurrence of the suffix's
    last KEY tokens (at most MAX_MATCH) and what followed each occurrence that agrees that long,
    newest first (later sequences, then later positions); and how many occurrences there were."""
    found = []
    for seq in reversed(live):
        for p in range(len(seq) - 2, KEY - 2, -1):
            if seq[p - 1: p + 1] != suffix[-2:]:
                continue
            n = KEY
            while n < min(MAX_MATCH, len(suffix)) and p - n >= 0 and seq[p - n] == suffix[-1 - n]:
                n += 1
            found.append((n, seq[p + 1: p + 1 + k]))
    if not found:
        return 0, [], 0
    best = max(n for n, _ in found)
    return best, [c for n, c in found if n == best], len(found)


def continuations(m: Match) -> list[list[int]]:
    return [row[valid].tolist() for row, valid in zip(m.rows, m.valid)]


# -- the index -------------------------------------------------------------------------------
def test_the_longest_match_wins_and_its_continuation_is_proposed():
    index = SuffixIndex(64 * KiB)
    index.add([1, 2, 3, 4, 5, 6, 7])
    index.add([9, 2, 3, 4, 8, 8])
    m = index.find(np.array([5, 9, 2, 3]), 4)  # "9 2 3" occurred once: it beats the two "2 3"s
    assert m.length == 3 and continuations(m) == [[4, 8, 8]]
    m = index.find(np.array([5, 0, 2, 3]), 4)  # only "2 3": both occurrences, newest first
    assert m.length == 2 and continuations(m) == [[4, 8, 8], [4, 5, 6, 7]]
    assert index.find(np.array([3, 9]), 4).length == 0  # never seen
    assert index.find(np.array([6, 7]), 4).length == 0  # seen, but nothing followed it
    draft = SuffixDraft(index, 16, loop_tokens=0)
    assert proposal(draft, [5, 9, 2, 3]) == [4, 8, 8]  # up to the end of that sequence
    assert proposal(draft, [1, 2, 3]) == [4, 5, 6]  # a 3-token match proposes at most 3 tokens


def test_find_agrees_with_a_brute_force_scan():
    rng = random.Random(5)
    index = SuffixIndex(8 * KiB)  # small: the run below evicts
    added = []
    checked = 0
    for step in range(300):
        seq = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        index.add(seq)
        if len(seq) > KEY:  # shorter ones are not indexed
            added.append(seq)
        live = added[len(added) - index.sequences:] if index.sequences else []
        suffix = [rng.randrange(6) for _ in range(rng.randrange(2, 30))]
        k = rng.randrange(1, 10)
        m = index.find(np.asarray(suffix), k)
        want_len, want, occurrences = brute_force(live, suffix, k)
        if occurrences <= MAX_CANDIDATES:  # find() sees every occurrence below its cap
            assert (m.length, continuations(m)) == (want_len, want), f"step {step}"
            checked += 1
    assert checked > 250 and index.stats.evicted > 100


def test_the_most_frequent_path_is_proposed_while_it_is_likely_enough():
    rows = np.array([[4, 5, 6], [4, 7, 1], [4, 5, 2], [3, 5, 6]])
    m = Match(2, rows, np.ones_like(rows, dtype=bool))
    # 4 (3 of 4), then 5 (2 of the 3), then a tie of 6 and 2 at 1 of 2: the newest row's, 6
    assert vote(m, 3, min_prob=0.1) == [4, 5, 6]
    assert vote(m, 3, min_prob=0.3) == [4, 5]  # 3/4 * 2/3 * 1/2 = 0.25 < 0.3
    assert vote(m, 3, min_prob=0.8) == []  # 3/4 already too unlikely
    ended = Match(2, rows, np.array([[1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=bool))
    assert vote(ended, 3, min_prob=0.3) == [4]  # rows that ended still count as not going on: 1 of 3 is too few


def test_the_requests_own_context_counts_as_prompt_lookup_does():
    ctx = np.array([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3])
    m = own_match(ctx, 3)
    assert m.length == 3 and continuations(m) == [[9, 2, 3]]  # "1 2 3" at the start
    draft = SuffixDraft(SuffixIndex(64 * KiB), 16, loop_tokens=0)
    assert proposal(draft, ctx.tolist(), 3) == [9, 2, 3]  # an empty index: prompt lookup
    draft.learn([4, 4, 1, 2, 3, 5, 5, 5])  # indexed, "4 1 2 3" agrees one token further than the context's
    assert proposal(draft, [6, 1, 2, 3, 0, 4, 1, 2, 3], 3) == [5, 5, 5]
    looping = SuffixDraft(SuffixIndex(64 * KiB), 16, loop_tokens=4)
    assert proposal(looping, [3, 8, 7, 8, 7, 8, 7], 5) == [8, 7, 8, 7, 8]  # a loop continues, as prompt lookup's


def test_a_sampled_proposal_is_one_hot():
    draft = SuffixDraft(SuffixIndex(64 * KiB), 16)
    draft.learn([1, 2, 3, 4, 5])
    got = draft.begin(64).propose([9, 1, 2, 3], 2, SamplingParams(temperature=0.7), np.random.default_rng(0))
    q = got.q.dense(16)
    assert got.tokens == [4, 5] and (q[[0, 1], [4, 5]] == 1.0).all() and q.sum() == 2.0


def test_evicts_the_oldest_sequences_first():
    index = SuffixIndex(8 * KiB)
    first = [100, 101, 102, 103, 104]
    filler = [[1000 + 60 * j + i for i in range(60)] for j in range(40)]  # every key distinct

    def found(seq):
        return index.find(np.array(seq[-3:-1]), 1).length >= KEY

    index.add(first)
    n = 0
    while found(first):
        index.add(filler[n])
        n += 1
    # the oldest went when the n-th filler no longer fitted (each sequence with its SEP), and the
    # next oldest with it, since its 6 slots were not room enough for 61
    assert 6 + (n - 1) * 61 <= index.slots < 6 + n * 61 and index.stats.evicted == 2
    assert not found(filler[0]) and all(found(s) for s in filler[1:n])
    while index.stats.evicted < 4:
        index.add(filler[n])
        n += 1
    assert not found(filler[1]) and not found(filler[2])  # then the next oldest, in order
    assert all(found(s) for s in filler[3:n]) and index.sequences == n - 3


def test_a_sequence_longer_than_the_ring_keeps_its_latest_tokens():
    index = SuffixIndex(8 * KiB)
    long = list(range(3 * index.slots))
    index.add(long)
    assert index.sequences == 1 and index.end - index.tail == index.slots
    assert index.find(np.array(long[-4:-2]), 2).length >= KEY
    assert index.find(np.array(long[:2]), 2).length == 0


def test_memory_stays_within_the_bound_over_a_long_run():
    cap = 256 * KiB
    index = SuffixIndex(cap)
    assert index.nbytes == index_nbytes(cap) <= cap
    assert index.nbytes > 0.8 * cap  # the cap is what it may use, and it uses most of it
    rng = np.random.default_rng(0)
    for _ in range(50):  # warm: the ring wraps
        index.add(rng.integers(0, 49152, rng.integers(1, 2000)).tolist())
    # only what the index's own code allocated and still holds: the process's total also counts other
    # threads' allocations and NumPy's caches (a fresh clone's run saw 6 KiB of those in this window)
    import memspec.speculation.suffix as suffix_module

    own = [tracemalloc.Filter(True, suffix_module.__file__)]
    tracemalloc.start()
    before = tracemalloc.take_snapshot().filter_traces(own)
    for i in range(3000):
        index.add(rng.integers(0, 49152, rng.integers(1, 2000)).tolist())
        if i % 100 == 0:
            index.find(rng.integers(0, 49152, 30), 8)
    after = tracemalloc.take_snapshot().filter_traces(own)
    tracemalloc.stop()
    grown = sum(d.size_diff for d in after.compare_to(before, "filename"))
    assert grown < 1 * KiB, f"the index grew by {grown} bytes over a long run"
    assert index.nbytes == index_nbytes(cap)
    assert index.end - index.tail <= index.slots and index.sequences <= len(index.starts)
    assert index.stats.evicted > 2000


def test_tiny_sequences_evict_by_count_when_the_start_ring_fills():
    index = SuffixIndex(8 * KiB)
    _, _, starts = index_layout(8 * KiB)
    for i in range(3 * starts):
        index.add([i % 7, 1, 2])
    assert index.sequences == starts and index.stats.evicted == 2 * starts


def test_threads_add_and_find_at_once():
    index = SuffixIndex(32 * KiB)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(300):
                index.add([rng.randrange(20) for _ in range(rng.randrange(3, 80))])
                m = index.find(np.asarray([rng.randrange(20) for _ in range(10)]), 5)
                assert m.rows.shape == m.valid.shape and (m.rows[m.valid] >= 0).all()
        except Exception as exc:  # a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and index.stats.added == 1200
    assert index.end - index.tail <= index.slots


def test_the_index_needs_room_for_a_match():
    with pytest.raises(ValueError, match="at least"):
        SuffixIndex(100)


def test_suffix_proposals_keep_the_sampling_distribution(tiny):  # noqa: F811
    """The draft copies from the index (q one-hot); the rejection rule must still give the
    target's next-token distribution."""
    index = SuffixIndex(64 * KiB)
    prompt = [3, 1, 4, 1, 5]
    for t in range(V):  # whatever the first token, an indexed sequence continues it
        index.add(prompt + [t, (t * 5 + 3) % V, t])
    draft = SuffixDraft(index, V, loop_tokens=0)
    assert all(proposal(draft, prompt + [t], 3) for t in range(V))
    counts, p2 = second_token_counts(tiny, prompt=prompt, draft=draft)
    assert chi_square_p(counts, p2) > 1e-3


# -- the pool and the scheduler ----------------------------------------------------------------
def test_the_pool_teaches_its_suffix_draft():
    draft = SuffixDraft(SuffixIndex(64 * KiB), 16)
    pool = DraftPool({SUFFIX: draft})
    pool.learn([1, 2, 3, 4])
    assert proposal(draft, [7, 2, 3]) == [4] and pool.report().drafts[0].bytes == draft.nbytes
    DraftPool({}).learn([1, 2, 3])  # no suffix draft: nothing to teach


def test_the_scheduler_holds_the_suffix_index_in_its_budget():
    cap = 64 * KiB
    made = []

    def loader(name):
        made.append(SuffixDraft(SuffixIndex(cap), 16))
        return made[-1], made[-1].nbytes

    sizes = draft_footprints([], index_nbytes(cap))
    assert sizes == {"prompt-lookup": 0, SUFFIX: index_nbytes(cap)}
    sched = Scheduler(SchedulerConfig(policy="bandit", budget_mb=1, pressure_floor_mb=0), loader, sizes,
                      FakeProbe(rss=0), target=("t", 512 * KiB))
    try:
        st = sched.ws.status()
        assert st["drafts"][SUFFIX] == {**st["drafts"][SUFFIX], "state": "resident", "leases": 1,
                                        "bytes": index_nbytes(cap)}
        assert st["used_bytes"] == 512 * KiB + index_nbytes(cap)
        assert sched.shrink(1 << 30) == 0  # held for the scheduler's life: never evicted
        sched.learn([1, 2, 3, 4])
        assert proposal(made[0], [9, 2, 3]) == [4]
        counters = sched.counters()
        assert (counters["suffix.sequences"], counters["suffix.tokens"], counters["suffix.hits"]) == (1, 4, 1)
        assert counters["suffix.bytes"] == index_nbytes(cap)
        req = GenerationRequest(prompt="x", draft=SUFFIX)
        sel = sched.selector(req, [9, 2, 3], 64)
        name, state = sel([9, 2, 3], sel.metrics)
        assert name == SUFFIX and state.propose([9, 2, 3], 4, GREEDY, None).tokens == [4]
        with pytest.raises(InvalidRequestError, match="in use"):
            sched.unload(SUFFIX)  # a request runs on it: it stays, held, and goes on learning
        sched.learn([7, 8, 9])
        assert made[0].index.stats.added == 2 and sched.ws.status()["drafts"][SUFFIX]["leases"] == 2
        sel.close()
        assert sched.unload(SUFFIX) == index_nbytes(cap)  # UnloadModel frees it ...
        sched.learn([5, 6, 7])  # ... and nothing learns any more
        assert made[0].index.stats.added == 2 and sched.ws.status()["used_bytes"] == 512 * KiB
    finally:
        sched.close()


def test_clear_forgets_every_sequence_and_the_index_learns_again():
    index = SuffixIndex(64 * KiB)
    index.add([1, 2, 3, 4, 5])
    index.add([6, 2, 3, 7])
    index.clear()
    assert index.find(np.array([2, 3]), 4).length == 0 and index.report()["sequences"] == 0
    assert index.stats.evicted == 2
    index.add([2, 3, 9])
    assert continuations(index.find(np.array([2, 3]), 4)) == [[9]]  # nothing from before the clear
    for _ in range(3000):  # the ring wraps after a clear as before
        index.add([2, 3, 8, 8, 8, 8])
    assert continuations(index.find(np.array([2, 3]), 1))[0] == [8]


# -- recall: the index consulted before the picked draft ---------------------------------------
SEEN = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62]  # an earlier request's prompt and answer


def test_recall_needs_a_match_as_long_as_asked_and_longer_than_the_texts_own():
    draft = SuffixDraft(SuffixIndex(64 * KiB), 100)
    draft.learn(SEEN)
    assert draft.recall([1, 2, *SEEN[:8]], 8, 8) == SEEN[8:13]  # 8 tokens agree: what followed (at most 8)
    assert draft.recall([1, 2, *SEEN[:8]], 3, 8) == SEEN[8:11]
    assert draft.recall([1, 2, *SEEN[1:8]], 8, 8) == []  # 7 agree: too short
    assert draft.recall([1, 2, *SEEN[1:8]], 8, 7) == SEEN[8:13]
    # the text holds the same words itself: its own copy is the draft's (prompt lookup) to follow
    assert draft.recall([*SEEN[:9], 1, 2, *SEEN[:8]], 8, 8) == []
    assert draft.recall([9, 9], 8, KEY) == []  # nothing indexed ends so


def test_recall_stops_where_the_earlier_requests_disagree():
    draft = SuffixDraft(SuffixIndex(64 * KiB), 100)
    for then in (71, 80, 90):
        draft.learn([*SEEN[:8], 70, then, 72])
    assert draft.recall(SEEN[:8], 8, 8) == [70]  # all three agree on 70, then each goes its own way
    draft.learn([*SEEN[:8], 70, 80, 73])
    assert draft.recall(SEEN[:8], 8, 8) == [70, 80]  # half of them go on with 80, and then split


def test_a_recall_proposes_what_its_check_found_and_rechecks_another_text():
    draft = SuffixDraft(SuffixIndex(64 * KiB), 100)
    draft.learn(SEEN)
    recall = Recall(draft, 8)
    text = [1, *SEEN[:9]]
    assert recall.check(text) and recall.propose(text, 3, GREEDY, None).tokens == SEEN[9:12]
    assert not recall.check([1, 2, 3])
    assert recall.propose(text, 8, GREEDY, None).tokens == SEEN[9:13]  # a text it did not check: looked up
    sampled = recall.propose(text, 2, SamplingParams(temperature=0.8), None)
    assert (sampled.q.dense(100).argmax(axis=1) == SEEN[9:11]).all()
    with pytest.raises(ValueError, match="match"):
        Recall(draft, MAX_MATCH + 1)


def test_a_recall_leaves_to_the_draft_what_its_own_lookup_copies_the_same():
    """A rewrite of an answer sent back: the index holds the answer, and so does the text; where the
    draft's own lookup (lookup_ngram) proposes the same tokens, the step stays the draft's."""
    draft = SuffixDraft(SuffixIndex(64 * KiB), 100)
    draft.learn([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 22, 23])
    end = [99, 3, 4, 5, 6, 7, 8, 9, 10]  # agrees with the index for 8 tokens
    fresh = [30, 31, *end]  # nothing of it earlier in the text
    assert Recall(draft, 8).check(fresh) and Recall(draft, 8).propose(fresh, 8, GREEDY, None).tokens == [20, 21, 22, 23]
    sent_back = [9, 10, 20, 21, 22, 23, *end]  # the text holds "9 10" and what followed: the draft copies it
    assert draft.recall(sent_back, 8, 8) == [20, 21, 22, 23]  # longer in the index than in the text ...
    assert not Recall(draft, 8).check(sent_back)  # ... but the draft's own lookup proposes the same
    assert Recall(draft, 8, lookup_ngram=0).check(sent_back)  # a draft that copies nothing: recalled
    assert Recall(draft, 8, lookup_ngram=3).check(sent_back)  # ... or one that needs 3 tokens to copy
    differs = [9, 10, 20, 77, *end]  # its own copy goes elsewhere after one token: recalled
    assert Recall(draft, 8).check(differs)


def recall_scheduler(recall_tokens: int, policy: str = "bandit", cap: int = 64 * KiB) -> Scheduler:
    def loader(name):
        if name == SUFFIX:
            d = SuffixDraft(SuffixIndex(cap), 100)
            return d, d.nbytes
        from memspec.speculation.drafts import PromptLookup
        return PromptLookup(100), 0

    return Scheduler(SchedulerConfig(policy=policy, budget_mb=1, pressure_floor_mb=0), loader,
                     draft_footprints([], index_nbytes(cap)), FakeProbe(rss=0), target=("t", 512 * KiB), recall_tokens=recall_tokens)


def test_a_scheduled_step_recalls_what_followed_where_the_text_matches_the_index_long():
    sched = recall_scheduler(8)
    try:
        sched.learn(SEEN)
        sel = sched.selector(GenerationRequest(prompt="x"), [1, 2], 64)
        assert sel.name == "prompt-lookup"  # the only arm: the bandit's pick
        name, state = sel([1, 2, 3], sel.metrics)
        assert name == "prompt-lookup"  # nothing indexed agrees with this text
        name, state = sel([1, *SEEN[:8]], sel.metrics)
        assert name == SUFFIX and state.propose([1, *SEEN[:8]], 4, GREEDY, None).tokens == SEEN[8:12]
        name, _ = sel([1, *SEEN[:8], 99, 98], sel.metrics)
        assert name == "prompt-lookup"  # the text went its own way: the picked draft again
        sel.window = {SUFFIX: deque([(4, 4)]), "prompt-lookup": deque([(4, 2)])}  # 4 drafted: enough to tell
        assert sel.recent_acceptance() == {"prompt-lookup": 0.5}  # the recall's copies are no draft's evidence
        sel.close()
        # a request that names its draft runs as named
        named = sched.selector(GenerationRequest(prompt="x", draft="prompt-lookup"), [1, 2], 64)
        assert named([1, *SEEN[:8]], named.metrics)[0] == "prompt-lookup"
        named.close()
        sched.forget()  # the index is empty: nothing to recall
        sel = sched.selector(GenerationRequest(prompt="x"), [1, 2], 64)
        assert sel([1, *SEEN[:8]], sel.metrics)[0] == "prompt-lookup"
        sel.close()
    finally:
        sched.close()


def test_recall_is_off_at_zero_and_refused_outside_its_range():
    sched = recall_scheduler(0)
    try:
        sched.learn(SEEN)
        sel = sched.selector(GenerationRequest(prompt="x"), [1, 2], 64)
        assert sel([1, *SEEN[:8]], sel.metrics)[0] == "prompt-lookup"
        sel.close()
    finally:
        sched.close()
    for bad in (1, MAX_MATCH + 1):
        with pytest.raises(ConfigError, match="recall_tokens"):
            recall_scheduler(bad)


def test_the_scheduler_reports_the_prompts_each_resident_draft_keeps():
    from memspec.runtime.prefixes import PrefixCache
    from memspec.scheduling.scheduler import DRAFT_PREFIX

    class Keeping:  # a loaded draft with a prompt prefix cache, as a native DraftModel has
        prefixes = PrefixCache(1 << 20)

    sched = Scheduler(SchedulerConfig(policy="bandit", budget_mb=1, pressure_floor_mb=0),
                      lambda name: (Keeping(), 1024), {"keeping": 1024}, FakeProbe(rss=0), target=("t", 512 * KiB))
    try:
        assert not any(k.startswith(DRAFT_PREFIX) for k in sched.counters())  # not loaded yet
        sched.ws.preload("keeping")
        sched.ws.wait_idle()
        got = {k: v for k, v in sched.counters().items() if k.startswith(DRAFT_PREFIX)}
        assert got == {f"{DRAFT_PREFIX}keeping.{k}": v for k, v in Keeping.prefixes.report().items()}
    finally:
        sched.close()


def test_the_pool_forgets_what_its_suffix_draft_learned():
    draft = SuffixDraft(SuffixIndex(64 * KiB), 16)
    pool = DraftPool({SUFFIX: draft})
    pool.learn([1, 2, 3, 4])
    pool.forget()
    assert proposal(draft, [7, 2, 3]) == [] and draft.index.stats.evicted == 1
    DraftPool({}).forget()  # no suffix draft: nothing to forget


def test_a_suffix_index_too_big_for_the_budget_is_left_out():
    sched = Scheduler(SchedulerConfig(policy="bandit", budget_mb=1, pressure_floor_mb=0),
                      lambda name: (SuffixDraft(SuffixIndex(2 << 20), 16), index_nbytes(2 << 20)),
                      draft_footprints([], index_nbytes(2 << 20)), FakeProbe(rss=0), target=("t", 512 * KiB))
    try:
        assert SUFFIX not in sched.ws.resident()
        sched.learn([1, 2, 3])  # nothing holds it: a no-op
    finally:
        sched.close()


# -- the real target -----------------------------------------------------------------------------
REPEAT = "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday."


@pytest.fixture(scope="module")
def smollm(model_store):
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.target import load_target
    from memspec.speculation.engine import Engine

    target = load_target(model_store, "smollm2-135m", "fp32", SessionConfig(max_context=512))
    plain = Engine(target, drafts=DraftPool())
    draft = SuffixDraft(SuffixIndex(1 << 20), target.session.vocab_size)
    return plain, Engine(target, drafts=DraftPool({SUFFIX: draft}), spec=SpecConfig(controller="step")), draft


def test_greedy_output_is_the_targets_and_a_repeat_accepts_far_more(smollm):
    plain, engine, draft = smollm
    for prompt in (REPEAT, "Write a Python function that checks whether a number is prime."):
        base = plain.generate(GenerationRequest(prompt=prompt, max_tokens=48))
        first = engine.generate(GenerationRequest(prompt=prompt, max_tokens=48, draft=SUFFIX))
        second = engine.generate(GenerationRequest(prompt=prompt, max_tokens=48, draft=SUFFIX))
        assert first.token_ids == base.token_ids and second.token_ids == base.token_ids, prompt
        assert first.text == base.text == second.text
        # the first run proposes only from its own context; the second finds the first's answer
        assert second.stats.mean_acceptance_length >= 4.0, second.stats
        assert second.stats.mean_acceptance_length > first.stats.mean_acceptance_length + 2.0
        assert second.stats.drafts_used == {SUFFIX: second.stats.num_drafts}
    assert draft.index.stats.added == 4  # only the suffix engine's requests, each once


def test_the_engine_indexes_the_committed_tokens_and_a_failing_index_fails_no_request(smollm, monkeypatch):
    plain, engine, draft = smollm
    req = GenerationRequest(prompt="Name three colours.", max_tokens=12, draft="none")
    done = engine.generate(req)
    index = draft.index
    last = index.starts[(index._first + index.sequences - 1) % len(index.starts)]
    learned = index.buf[np.arange(last, index.end - 1) % index.slots].tolist()  # the newest sequence
    kept = done.prompt_token_ids + done.token_ids
    assert learned[: len(kept)] == kept  # the prompt and the answer (a last step may commit a few more)

    def broken(tokens):
        raise RuntimeError("index broken")

    monkeypatch.setattr(draft.index, "add", broken)
    again = engine.generate(req)
    assert again.token_ids == done.token_ids and again.finish_reason == done.finish_reason


def test_a_scheduled_engine_teaches_its_suffix_draft_whichever_draft_runs(smollm, model_store):
    from memspec.scheduling.scheduler import from_store
    from memspec.speculation.config import DraftLimits
    from memspec.speculation.engine import Engine

    target = smollm[0].target
    with_corpus = from_store(SchedulerConfig(policy="bandit", pressure_floor_mb=0), model_store, target, None,
                             DraftLimits(), names=[], suffix_bytes=1 << 20)
    try:  # SmolLM2's shipped corpus: planned and held beside the index, in the suffix draft's bytes
        planned, held = with_corpus.drafts[SUFFIX], with_corpus.report().drafts[1]
        assert planned > 2 * index_nbytes(1 << 20)  # SmolLM2's corpus (2.6 MB of index) beside 1 MiB
        assert held.name == SUFFIX and held.resident and held.bytes >= planned
    finally:
        with_corpus.close()
    sched = from_store(SchedulerConfig(policy="bandit", pressure_floor_mb=0), model_store, target, None,
                       DraftLimits(), names=[], suffix_bytes=1 << 20, corpus=False)
    engine = Engine(target, drafts=sched, spec=SpecConfig(controller="step"))
    try:
        assert set(sched.drafts) == {"prompt-lookup", SUFFIX}
        lookup, suffix = sched.report().drafts
        assert lookup == DraftRow("prompt-lookup", False, 0)  # loaded on first use
        # held from the start, at its bytes (or what its load added to the RSS, when that was more)
        assert suffix.resident and index_nbytes(1 << 20) <= suffix.bytes < 2 * index_nbytes(1 << 20)
        base = engine.generate(GenerationRequest(prompt=REPEAT, max_tokens=32, draft="none"))  # learned too
        again = engine.generate(GenerationRequest(prompt=REPEAT, max_tokens=32, draft=SUFFIX))
        assert again.token_ids == base.token_ids and again.stats.mean_acceptance_length >= 4.0, again.stats
        assert sched.counters()["suffix.sequences"] == 2
    finally:
        engine.close()


def test_a_repeated_request_recalls_its_answer_under_the_picked_draft_and_answers_the_same(smollm, model_store):
    """The oracle picks prompt lookup for the prompt; the second time the prompt comes, its steps
    recall the first answer from the suffix index instead, and the answer is target-only's."""
    from memspec.scheduling.scheduler import from_store
    from memspec.speculation.config import DraftLimits
    from memspec.speculation.engine import Engine

    plain, target = smollm[0], smollm[0].target
    base = plain.generate(GenerationRequest(prompt=REPEAT, max_tokens=48))
    for recall_tokens in (8, 0):
        sched = from_store(SchedulerConfig(policy="oracle", pressure_floor_mb=0), model_store, target, None,
                           DraftLimits(recall_tokens=recall_tokens), names=[], suffix_bytes=1 << 20,
                           oracle_table={REPEAT: "prompt-lookup"})
        engine = Engine(target, drafts=sched, spec=SpecConfig(controller="step"))
        try:
            first = engine.generate(GenerationRequest(prompt=REPEAT, max_tokens=48))
            second = engine.generate(GenerationRequest(prompt=REPEAT, max_tokens=48))
            assert first.token_ids == base.token_ids == second.token_ids
            assert SUFFIX not in first.stats.drafts_used  # nothing indexed yet
            if recall_tokens:
                assert set(second.stats.drafts_used) == {SUFFIX}, second.stats  # every step recalled
                assert second.stats.mean_acceptance_length >= 4.0, second.stats
            else:
                assert set(second.stats.drafts_used) == {"prompt-lookup"}
        finally:
            engine.close()


def test_schedulers_made_one_after_another_book_the_process_they_are_given(smollm, model_store):
    """The policy bench makes a scheduler per policy in one process: each booked the RSS of its own
    moment, so the heap grown under earlier policies left the largest draft no room in later ones.
    With process_bytes every scheduler books the process its budget was set from."""
    from memspec.scheduling.scheduler import from_store
    from memspec.speculation.config import DraftLimits

    target = smollm[0].target
    given = target.file_bytes + (300 << 20)  # above the file: the pin is the larger of the two
    for _ in range(2):
        sched = from_store(SchedulerConfig(policy="bandit", pressure_floor_mb=0), model_store, target, None,
                           DraftLimits(), names=[], process_bytes=given)
        try:
            assert sched.ws.used_bytes() == given  # the target pinned at what it was given, nothing else yet
        finally:
            sched.close()
    measured = from_store(SchedulerConfig(policy="bandit", pressure_floor_mb=0), model_store, target, None,
                          DraftLimits(), names=[])
    try:
        assert measured.ws.used_bytes() >= target.file_bytes and measured.ws.used_bytes() != given
    finally:
        measured.close()


# -- the corpus: the target's own answers, shipped (memspec.speculation.corpus) -------------------
def test_the_corpus_proposes_is_never_forgotten_nor_evicted_and_is_counted():
    from memspec.speculation.suffix import corpus_index, corpus_max_bytes

    answer = list(range(100, 130))
    corpus = corpus_index([np.asarray(answer), np.asarray(list(range(300, 340)))])
    draft = SuffixDraft(SuffixIndex(4 * KiB), V, corpus=corpus)
    assert corpus.nbytes == index_nbytes(corpus_max_bytes([30, 40]))
    assert draft.nbytes == draft.index.nbytes + corpus.nbytes
    assert proposal(draft, [7, 100, 101, 102, 103], 4) == [104, 105, 106, 107]
    draft.forget()  # a benchmark round starts over: what was learned goes, the corpus stays
    assert proposal(draft, [7, 100, 101, 102, 103], 4) == [104, 105, 106, 107]
    for i in range(200):  # far more than the learned index holds: it evicts its own, never the corpus
        draft.learn([1000 + i] * 3 + list(range(2000, 2010)))
    assert draft.index.stats.evicted > 0 and corpus.sequences == 2 and corpus.stats.evicted == 0
    assert proposal(draft, [7, 100, 101, 102, 103], 4) == [104, 105, 106, 107]


def test_what_the_daemon_served_wins_a_tie_with_the_corpus_and_a_longer_corpus_match_wins():
    from memspec.speculation.suffix import corpus_index

    corpus = corpus_index([np.asarray([5, 6, 7, 8, 9, 40, 41, 42])])
    draft = SuffixDraft(SuffixIndex(16 * KiB), V, corpus=corpus)
    draft.learn([1, 2, 8, 9, 50, 51, 52])
    assert proposal(draft, [3, 8, 9], 2) == [50, 51]  # both agree 2 tokens back: the served one is newer
    assert proposal(draft, [6, 7, 8, 9], 2) == [40, 41]  # the corpus agrees 4 back, the served one 2


def test_a_corpus_file_round_trips_and_is_refused_for_another_target(tmp_path):
    from memspec.speculation.corpus import Corpus

    meta = {"target": "t", "vocab": 50, "domains": ["code"], "per_domain": 2, "seed": 0, "max_new": 8}
    path = Corpus([np.arange(10), np.arange(5, 20)], meta).save(tmp_path / "corpus-t.npz")
    back = Corpus.load(path, "t", 50)
    assert [s.tolist() for s in back.sequences] == [list(range(10)), list(range(5, 20))] and back.meta == meta
    with pytest.raises(ValueError, match="'t''s answers, not 'u''s"):
        Corpus.load(path, "u", 50)
    with pytest.raises(ValueError, match="token id 19, the target's vocabulary has 19"):
        Corpus.load(path, "t", 19)


def test_the_draft_maker_starts_the_suffix_draft_from_the_shipped_corpus(tmp_path, caplog):
    from memspec.models.store import ModelStore
    from memspec.speculation.corpus import Corpus, corpus_path
    from memspec.speculation.sources import DraftMaker

    shipped = tmp_path / "models"
    store = ModelStore(tmp_path / "home", shipped=shipped)
    meta = {"target": "t", "vocab": V, "domains": ["code"], "per_domain": 1, "seed": 0, "max_new": 8}
    Corpus([np.asarray([3, 4, 5, 6, 7, 8])], meta).save(corpus_path(shipped, "t"))
    maker = DraftMaker.for_target(store, "t", V, suffix_bytes=64 * KiB)
    draft = maker.make(SUFFIX)
    assert draft.corpus is not None and proposal(draft, [9, 4, 5], 3) == [6, 7]
    assert draft.nbytes == maker.suffix_nbytes() > index_nbytes(64 * KiB)  # what the budget plans is what it holds
    assert DraftMaker.for_target(store, "t", V, suffix_bytes=64 * KiB, corpus=False).make(SUFFIX).corpus is None
    assert DraftMaker.for_target(store, "other", V, suffix_bytes=64 * KiB).corpus is None  # none shipped for it
    corpus_path(shipped, "t").write_bytes(b"not a corpus")
    assert DraftMaker.for_target(store, "t", V, suffix_bytes=64 * KiB).corpus is None  # a bad file: a warning
    assert "corpus for t is not used" in caplog.text


def test_memspec_bench_plans_the_suffix_draft_with_its_corpus(model_store):
    """`memspec bench` sets its default budget from the drafts' planned bytes: the suffix draft's
    shipped corpus is in them, as the scheduler plans and holds it (it was not: 2.6 MB under)."""
    from types import SimpleNamespace

    from memspec.bench.policies import draft_sizes
    from memspec.speculation.sources import DraftMaker

    smollm2 = SimpleNamespace(name="smollm2-135m", vocab_size=49152)
    planned = draft_sizes(model_store, smollm2, 1 << 20)[SUFFIX]
    assert planned == DraftMaker.for_target(model_store, "smollm2-135m", 49152, suffix_bytes=1 << 20).suffix_nbytes()
    assert planned > 2 * index_nbytes(1 << 20)
    assert draft_sizes(model_store, smollm2, 1 << 20, corpus=False)[SUFFIX] == index_nbytes(1 << 20)
