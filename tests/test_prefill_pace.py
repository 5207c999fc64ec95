"""Issue 69: a long prompt's chunks are sized by time (memspec.speculation.batching.PrefillPace).
While another request decodes, a chunk costs about one of its steps; alone, a prompt is fed
[runtime] prefill_chunk tokens a pass.  Passes run on a fake target and a fake clock: counted in
passes, never in wall time."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from memspec.speculation.batching import PREFILL_FLOOR, PREFILL_PROBE, BatchLoop, PrefillPace

V = 8


def test_a_shared_chunk_costs_about_one_step_between_the_floor_and_the_bound():
    pace = PrefillPace(floor=32, share=1.0)
    assert pace.chunk(512, others=True) == 512  # no step timed yet: nobody is streaming
    pace.observe(steps=True, prompt_tokens=0, seconds=0.1)  # another request's decode step
    assert pace.chunk(512, others=True) == 32  # a prompt token's cost unknown: a probe measures it
    assert pace.chunk(512, others=False) == 512  # alone: the whole bound
    pace.observe(steps=True, prompt_tokens=32, seconds=0.1 + 32 * 0.001)  # a step and a 32-token chunk
    assert pace.token_s == pytest.approx(0.001)
    assert pace.chunk(512, others=True) == 100  # 0.1 s of prompt tokens
    assert pace.chunk(64, others=True) == 64  # never past [runtime] prefill_chunk
    pace.observe(steps=True, prompt_tokens=0, seconds=0.004)  # the steps got cheap (EMA: 0.052)
    assert pace.chunk(512, others=True) == 52
    pace.observe(steps=True, prompt_tokens=0, seconds=0.0)
    pace.observe(steps=True, prompt_tokens=0, seconds=0.0)
    assert pace.chunk(512, others=True) == 32  # but never under the floor
    assert pace.chunk(16, others=True) == 16  # ... unless the bound is


def test_the_default_floor_lets_a_dear_model_share_one_step_and_probes_first():
    """The 1.5B on 2 cores: a decode step 70 ms, a prompt token 9.5 ms more in its pass.  At 32 tokens
    a chunk (the old floor) the other client's pass took 5.3 steps (issue 69's bar: p99 within 3x the
    median); the default floor gives it the tokens of one step, after a first probe of 32."""
    pace = PrefillPace()
    pace.observe(steps=True, prompt_tokens=0, seconds=0.070)
    assert pace.chunk(512, others=True) == PREFILL_PROBE == 32
    pace.observe(steps=True, prompt_tokens=32, seconds=0.070 + 32 * 0.0095)
    n = pace.chunk(512, others=True)
    assert n == 7 and (0.070 + n * 0.0095) / 0.070 < 2.0
    pace.observe(steps=True, prompt_tokens=0, seconds=0.070)
    pace.observe(steps=True, prompt_tokens=n, seconds=0.070 + n * 0.1)  # a token got very dear
    assert pace.chunk(512, others=True) == PREFILL_FLOOR == 4  # the prompt still moves


def test_a_pass_whose_time_noise_hides_its_chunk_keeps_the_last_estimate():
    pace = PrefillPace(step_s=0.1, token_s=0.001)
    pace.observe(steps=True, prompt_tokens=50, seconds=0.09)
    assert pace.token_s == 0.001
    pace.observe(steps=False, prompt_tokens=50, seconds=0.1)  # a prompt alone: all its time is its tokens
    assert pace.token_s == pytest.approx((0.001 + 0.002) / 2)


class FakeCache:
    def __init__(self, capacity: int = 4096):
        self.length, self.capacity = 0, capacity


class FakeTarget:
    """A pass costs base + per x tokens seconds of the fake clock; logits are zeros."""

    def __init__(self, base: float, per: float):
        self.now, self.base, self.per = 0.0, base, per
        self.passes: list[list[int]] = []  # tokens of each row, per batched pass
        self.target = self  # the one-request target is the same fake
        self.rows = 2

    def clock(self) -> float:
        return self.now

    def _cost(self, feeds) -> None:
        self.now += self.base + self.per * sum(len(f) for f in feeds)

    def forward(self, *args, **kw):
        if isinstance(args[0], FakeCache):  # the one-request target: (cache, ids, keep)
            cache, ids = args[0], args[1]
            keep = kw.get("keep", args[2] if len(args) > 2 else 1)
            self._cost([ids])
            cache.length += len(ids)
            return np.zeros((keep, V))
        caches, feeds, keeps = args
        self.passes.append([len(f) for f in feeds])
        self._cost(feeds)
        for c, f in zip(caches, feeds):
            c.length += len(f)
        return [np.zeros((k, V)) for k in keeps]

    def release(self, cache) -> None:
        pass


def chunks_beside_a_stream(base: float, per: float, prompt: int = 600, most: int = 64) -> tuple[list[int], int]:
    """Request B decodes one token a step while request A's prompt prefills: A's chunk sizes, and
    B's steps during A's prefill."""
    target = FakeTarget(base, per)
    loop = BatchLoop(target, max_wait_s=1.0, prefill_chunk=most, clock=target.clock, pace=PrefillPace(floor=4))
    b, a = loop.join(), None
    b_cache = FakeCache()
    b.forward(b_cache, [1, 2, 3, 4], keep=1)  # B's prompt, alone
    for _ in range(3):
        b.forward(b_cache, [5], keep=1)  # B's steps, alone: the step time
    a = loop.join()  # both members before either queues: every pass below holds both rows
    told: list[int] = []
    a.progress = lambda done, total: told.append(done)
    a_done = threading.Event()
    b_steps = [0]

    def stream() -> None:
        while not a_done.is_set():
            b.forward(b_cache, [5], keep=1)
            b_steps[0] += 1
        b.leave()

    t = threading.Thread(target=stream)
    t.start()
    try:
        a.forward(FakeCache(), list(range(prompt)), keep=1)
    finally:
        a_done.set()
        a.leave()
        t.join(10)
        loop.close()
    sizes = np.diff([0, *told]).tolist()
    assert all(p == [1, n] or p == [n, 1] for p, n in zip(target.passes, sizes))  # each chunk beside a step
    return sizes, b_steps[0]


def test_chunks_beside_a_stream_cost_about_one_of_its_steps():
    sizes, b_steps = chunks_beside_a_stream(base=0.010, per=0.0005)
    assert sizes[0] == 4  # the floor first (B's 4-token prompt made a token look dear)
    assert sizes == sorted(sizes) and all(4 <= s <= 64 for s in sizes)
    assert sizes[-5:] == [21] * 5  # a step (0.0105 s) of prompt tokens at 0.0005 s each
    assert b_steps >= len(sizes)  # counted in steps: B got a token beside every chunk
    dearer, _ = chunks_beside_a_stream(base=0.020, per=0.0005)
    assert dearer[-5:] == [41] * 5  # dearer steps, bigger chunks: sized by time, not tokens
    capped, _ = chunks_beside_a_stream(base=0.100, per=0.0005)
    assert capped[-5:] == [64] * 5  # at most [runtime] prefill_chunk


def test_a_prompt_alone_is_fed_the_whole_bound_a_pass():
    target = FakeTarget(0.01, 0.0005)
    loop = BatchLoop(target, prefill_chunk=64, clock=target.clock, pace=PrefillPace(floor=4, step_s=0.01))
    s = loop.join()
    told: list[int] = []
    s.progress = lambda done, total: told.append(done)
    assert "prompt_token_ms" not in loop.report()
    s.forward(FakeCache(), list(range(200)), keep=1)
    assert told == [64, 128, 192]
    rep = loop.report()  # what sizes chunks, in GetStatus's batch map
    assert rep["step_ms"] == 10.0 and rep["prompt_token_ms"] > 0
    s.leave()
    loop.close()


def test_a_feed_that_keeps_more_rows_than_a_chunk_holds_gets_every_kept_row():
    """A verification (a logits row per token) longer than the chunk the pace gives: the rows before the
    kept ones go in chunks, the kept ones in the last pass.  (With the floor at 4 a 6-token
    verification beside another stream got 2 rows back, and sampled verification indexed past them.)"""
    target = FakeTarget(0.01, 0.001)
    loop = BatchLoop(target, max_wait_s=0.0, prefill_chunk=64, clock=target.clock,
                     pace=PrefillPace(floor=4, probe=4, step_s=0.01))
    a, b = loop.join(), loop.join()  # b is another member: a's chunks are sized by the pace
    try:
        cache = FakeCache()
        rows = a.forward(cache, list(range(6)), keep=6)
        assert rows.shape == (6, V) and cache.length == 6
        rows = a.forward(cache, list(range(10)), keep=6)  # 4 rows first, then the 6 kept
        assert rows.shape == (6, V) and cache.length == 16
        assert [p for p in target.passes[-2:]] == [[4], [6]]
    finally:
        a.leave(), b.leave()
        loop.close()
