"""Issue 69, item 4: a long prompt is prefilled in chunks ([runtime] prefill_chunk) that share the
batch loop's passes with the other requests' decode steps, so their tokens keep coming, and no
answer changes (the native engine's rows are exact at any row count)."""

from __future__ import annotations

import logging
import threading

import pytest

from memspec.request import Chunk, Completion, GenerationRequest
from memspec.runtime.config import SessionConfig

CHUNK = 16
LONG = ("Here are the notes of a long meeting about the garden. " * 12 +
        "In one sentence, what was the meeting about?")  # about 160 tokens: 10 chunks of 16
SHORT = GenerationRequest(prompt="1, 2, 3, 4, 5,", raw=True, max_tokens=24)
ALONE: dict[str, list[int]] = {}  # each request's answer alone (greedy), computed once


@pytest.fixture(scope="module")
def engine(model_store):
    """SmolLM2 on the native engine, two batch slots, prompts fed 16 tokens a pass; no prompt
    prefixes kept (a second run of a prompt would skip its prefill)."""
    from memspec.runtime.target import load_target, open_batched
    from memspec.speculation.engine import Engine

    target = load_target(model_store, "smollm2-135m", None, SessionConfig(max_context=512, backend="native"))
    e = Engine(target, batched=open_batched(target.session, 2), prefill_chunk=CHUNK)
    yield e
    e.close()


def test_a_chunked_prefill_gives_the_answer_of_one_pass(engine):
    req = GenerationRequest(prompt=LONG, max_tokens=8)
    prompt = engine.check(req)
    assert len(prompt) > 8 * CHUNK
    passes = engine.batch.stats.passes
    chunked = engine.generate(req)
    ALONE["long"] = chunked.token_ids
    assert engine.batch.stats.passes - passes >= len(prompt) // CHUNK  # it was fed in chunks
    engine.batch.prefill_chunk = 10_000  # the whole prompt in one pass
    try:
        whole = engine.generate(req)
    finally:
        engine.batch.prefill_chunk = CHUNK
    assert chunked.token_ids == whole.token_ids and chunked.finish_reason == whole.finish_reason


def test_another_stream_keeps_getting_tokens_while_a_long_prompt_prefills_and_both_answers_stay(engine, caplog):
    long_req = GenerationRequest(prompt=LONG, max_tokens=8)
    alone = {"long": ALONE.get("long") or engine.generate(long_req).token_ids,
             "short": engine.generate(SHORT).token_ids}
    events: list[str] = []  # in the order they happened: "short" (a token of it), "chunk" (one of the prompt's)
    lock = threading.Lock()
    got: dict[str, Completion] = {}
    short_started = threading.Event()

    def note(what: str) -> None:
        with lock:
            events.append(what)

    def short() -> None:
        for item in engine.stream(SHORT):
            if isinstance(item, Chunk) and item.token_ids:
                note("short")
                short_started.set()
            elif isinstance(item, Completion):
                got["short"] = item

    def long() -> None:
        messages = []
        for item in engine.stream(long_req, progress=lambda m: (messages.append(m), note("chunk"))):
            if isinstance(item, Completion):
                got["long"], got["messages"] = item, messages

    t_short = threading.Thread(target=short)
    t_short.start()
    assert short_started.wait(60)
    with caplog.at_level(logging.INFO, logger="memspec.speculation.engine"):
        t_long = threading.Thread(target=long)
        t_long.start()
        t_long.join(120)
    t_short.join(120)
    assert got["long"].token_ids == alone["long"] and got["short"].token_ids == alone["short"]
    chunks = [i for i, e in enumerate(events) if e == "chunk"]
    n_chunks = (len(got["long"].prompt_token_ids) - 1) // CHUNK
    assert len(chunks) >= n_chunks  # chunks of at most CHUNK tokens: fewer while the other streams (the pace)
    # counted in steps: the short request's tokens came between the long prompt's chunks, not after them
    between = events[chunks[0]:chunks[-1]].count("short")
    assert between >= n_chunks // 2, events
    first = got["messages"][0]
    fed = int(first.split()[1])  # the first chunk's tokens: at most CHUNK (the pace may give fewer)
    assert 1 <= fed <= CHUNK and first.startswith(f"prefill: {fed} of {len(got['long'].prompt_token_ids)} prompt tokens")
    assert any("prefill: " in r.getMessage() for r in caplog.records)  # the log says how far it is


class ScriptedPace:
    """Chunks of uneven sizes, as the time-sized pace gives them (batching.PrefillPace), in a fixed
    order: the rows' exactness must not depend on where a chunk ends."""

    def __init__(self, sizes: list[int]):
        self.sizes, self.given = sizes, []

    def observe(self, steps: bool, prompt_tokens: int, seconds: float) -> None:
        pass

    def chunk(self, most: int, others: bool) -> int:
        n = self.sizes[len(self.given) % len(self.sizes)] if others else most
        self.given.append(n)
        return n


def test_chunks_sized_by_time_beside_another_stream_keep_both_answers(engine):
    long_req = GenerationRequest(prompt=LONG, max_tokens=8)
    alone = {"long": ALONE.get("long") or engine.generate(long_req).token_ids,
             "short": engine.generate(SHORT).token_ids}
    got: dict[str, Completion] = {}
    short_started, long_done = threading.Event(), threading.Event()
    chunks: list[int] = []
    short_tokens_during: list[int] = [0]

    def short() -> None:
        for item in engine.stream(SHORT):
            if isinstance(item, Chunk) and item.token_ids:
                short_started.set()
                if chunks and not long_done.is_set():
                    short_tokens_during[0] += 1
            elif isinstance(item, Completion):
                got["short"] = item

    pace, engine.batch.pace = engine.batch.pace, ScriptedPace([3, 16, 7, 11, 1])
    try:
        t_short = threading.Thread(target=short)
        t_short.start()
        assert short_started.wait(60)
        for item in engine.stream(long_req, progress=lambda m: chunks.append(1)):
            if isinstance(item, Completion):
                got["long"] = item
        long_done.set()
        t_short.join(120)
        given = engine.batch.pace.given
    finally:
        engine.batch.pace = pace
    assert got["long"].token_ids == alone["long"] and got["short"].token_ids == alone["short"]
    assert {3, 16, 7, 11, 1} <= set(given)  # the prompt went in those uneven chunks
    assert short_tokens_during[0] >= 1
