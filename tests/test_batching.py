"""Continuous batching (memspec.speculation.batching): requests that share target passes get
exactly their solo output, greedy or sampled, whatever joins or leaves around them."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from memspec.request import GenerationRequest, SamplingParams
from memspec.runtime.batch import BatchedTarget
from memspec.runtime.config import SessionConfig
from memspec.runtime.sessions import DecoderSession
from memspec.speculation import sampling
from memspec.speculation.batching import BatchLoop
from memspec.speculation.config import SpecConfig
from memspec.speculation.drafts import DraftModel
from memspec.speculation.metrics import SpecMetrics
from memspec.speculation.speculative import FixedDraft, NoDraft, speculative_steps
from test_sampling import chi_square_p
from tiny_models import build_tiny

V = 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("batching")
    cfg = SessionConfig(max_context=96, intra_op_threads=1)
    target = DecoderSession(build_tiny(d / "t.onnx", seed=1, scale=0.3, vocab=V), cfg, min_rows=2)
    draft = DecoderSession(build_tiny(d / "d.onnx", seed=2, scale=0.3, vocab=V), cfg)
    return target, DraftModel("d", draft, np.arange(V), V)


def run(target, draft, prompt, params, n, cfg=SpecConfig(gamma=3, controller="step"), stop_after=None):
    """Committed tokens of one request (speculative_steps over `target`: a session or a slot)."""
    select = FixedDraft("d", draft.begin(96)) if draft is not None else NoDraft()
    rng = np.random.default_rng(params.seed)
    cache = target_cache(target)
    out: list[int] = []
    steps = speculative_steps(target, cache, prompt, select, params, rng, cfg, SpecMetrics())
    try:
        for committed in steps:
            out.extend(committed)
            if len(out) >= n or (stop_after is not None and len(out) >= stop_after):
                break
    finally:
        steps.close()
        select.close()
    return out[:n], cache


def target_cache(target):
    sess = target if isinstance(target, DecoderSession) else target._loop.target.target
    return sess.new_cache()


def test_random_arrivals_and_cancellations_keep_every_output(tiny):
    target, draft = tiny
    loop = BatchLoop(BatchedTarget(target, rows=3), max_wait_s=0.01)
    rng = np.random.default_rng(3)
    jobs = []
    for i in range(10):
        prompt = list(map(int, rng.integers(0, V, int(rng.integers(2, 12)))))
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=100 + i)
        uses_draft = i % 3 != 0
        cancel_at = int(rng.integers(3, 10)) if i % 4 == 1 else None
        jobs.append((prompt, params, uses_draft, cancel_at, float(rng.uniform(0, 0.05))))
    results: dict[int, list[int]] = {}

    def client(i):
        prompt, params, uses_draft, cancel_at, delay = jobs[i]
        time.sleep(delay)
        slot = loop.join()
        try:
            out, cache = run(slot, draft if uses_draft else None, prompt, params, 30, stop_after=cancel_at)
        finally:
            slot.leave()
        loop.release(cache)
        results[i] = out

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    loop.close()
    assert len(results) == len(jobs)
    for i, (prompt, params, uses_draft, cancel_at, _) in enumerate(jobs):
        solo, _ = run(target, draft if uses_draft else None, prompt, params, 30, stop_after=cancel_at)
        # greedy and seeded sampling alike: the logits are the solo ones, and the request's own
        # generator draws the same numbers in the same order (the step controller's draft lengths
        # do not depend on time), so the tokens are the solo tokens
        assert results[i] == solo, f"request {i} ({'greedy' if params.greedy else 'sampled'}) changed"
    assert sum(n for b, n in loop.stats.rows.items() if b > 1) > 0, f"no pass was batched: {loop.stats.rows}"
    assert loop.in_use() == 0


def test_sampled_distribution_is_unchanged_under_batching(tiny):
    """Chi-square: the second token of sampled requests that share passes (cost controller, whose
    draft lengths do depend on timing) follows the target's exact distribution."""
    target, draft = tiny
    prompt = [3, 1, 4, 1, 5]
    c = target.new_cache()
    p1 = sampling.probabilities(target.forward(c, prompt, keep=1)[-1], 1.0)
    p2 = np.zeros(V)
    for t1 in range(V):
        c.truncate(len(prompt))
        p2 += p1[t1] * sampling.probabilities(target.forward(c, [t1], keep=1)[-1], 1.0)
    loop = BatchLoop(BatchedTarget(target, rows=4), max_wait_s=0.005)
    counts = np.zeros(V, dtype=np.int64)
    lock = threading.Lock()
    costs = target.measure_step_costs(5)

    def client(k):
        for j in range(300):
            slot = loop.join()
            params = SamplingParams(temperature=1.0, seed=10_000 * k + j)
            select = FixedDraft("d", draft.begin(96))
            cache = target.new_cache()
            steps = speculative_steps(slot, cache, prompt, select, params, np.random.default_rng(params.seed),
                                      SpecConfig(gamma=3), SpecMetrics(), verify_cost_s=costs)
            next(steps)
            t2 = next(steps)[0]
            steps.close()
            select.close()
            slot.leave()
            loop.release(cache)
            with lock:
                counts[t2] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    loop.close()
    assert counts.sum() == 1200
    assert sum(n for b, n in loop.stats.rows.items() if b > 1) > 100
    assert chi_square_p(counts, p2) > 1e-3


def test_status_counts_passes_rows_and_slots(tiny):
    target, _ = tiny
    loop = BatchLoop(BatchedTarget(target, rows=2))
    a, b = loop.join(), loop.join()
    ca, cb = target.new_cache(), target.new_cache()
    got = {}
    ta = threading.Thread(target=lambda: got.setdefault("a", a.forward(ca, [1, 2, 3], keep=1)))
    ta.start()
    got["b"] = b.forward(cb, [4, 5], keep=2)
    ta.join()
    rep = loop.report()
    assert rep["slots"] == 2 and rep["slots_in_use"] == 2 and rep["passes"] >= 1
    assert rep.get("rows_2", 0) >= 1 or rep.get("rows_1", 0) == 2
    a.leave(), b.leave()
    assert loop.report()["slots_in_use"] == 0
    np.testing.assert_array_equal(got["b"], target.forward(target.new_cache(), [4, 5], keep=2))
    loop.close()


def test_a_failed_pass_fails_its_rows_and_the_loop_goes_on(tiny):
    target, _ = tiny
    loop = BatchLoop(BatchedTarget(target, rows=2))
    s = loop.join()
    c = target.new_cache()
    with pytest.raises(ValueError, match="at least one token"):
        s.forward(c, [], keep=1)
    with pytest.raises(Exception, match="context overflow"):
        s.forward(c, list(range(97)), keep=1)
    assert s.forward(c, [1, 2], keep=1).shape == (1, V)  # still serving
    s.leave()
    loop.close()


def test_long_prompts_are_prefilled_in_chunks(tiny):
    target, _ = tiny
    loop = BatchLoop(BatchedTarget(target, rows=2), prefill_chunk=8)
    s = loop.join()
    told = []
    s.progress = lambda done, total: told.append((done, total))  # the engine logs it and tells the stream
    c = target.new_cache()
    prompt = list(range(1, 30))
    got = s.forward(c, prompt, keep=1)
    assert c.length == len(prompt) and loop.stats.passes == 4  # 8 + 8 + 8 + 5
    assert told == [(8, 29), (16, 29), (24, 29)]  # after each chunk; the last comes with its logits
    np.testing.assert_allclose(got, target.forward(target.new_cache(), prompt, keep=1), atol=1e-4)
    s.leave()
    loop.close()


def test_engine_batched_greedy_is_solo_token_for_token(model_store):
    """The real q4 target, real drafts: concurrent requests with cancellations through
    Engine(batched=open_batched(target, 3)) give every finished greedy request its solo answer."""
    from memspec.build import load_pool
    from memspec.runtime.target import load_target, open_batched
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool

    cfg = SessionConfig(max_context=256, backend="onnxruntime")  # the batched graph (the native pass: test_native_target)
    target = load_target(model_store, "smollm2-135m", "q4", cfg)
    pool = DraftPool(load_pool(model_store, "smollm2-135m", target.session.vocab_size, cfg))
    solo = Engine(target, drafts=pool)
    batched = Engine(target, drafts=pool, batched=open_batched(target.session, 3))
    prompts = ["Write a Python function that reverses a list.", "What is 12 * 13?",
               "Name three colors.", "Tell me a joke about cats.", "Summarise: the sky is blue today.",
               "Convert to JSON: name Bob, age 4."]
    drafts = ["draft-code", "draft-math", "none", "draft-chat", "prompt-lookup", "draft-general"]
    reqs = [GenerationRequest(prompt=p, max_tokens=24, draft=d) for p, d in zip(prompts, drafts)]
    expected = [solo.generate(r).token_ids for r in reqs]
    got: dict[int, object] = {}
    cancels = {i: threading.Event() for i in range(len(reqs))}

    def client(i):
        time.sleep(0.02 * i)
        got[i] = batched.generate(reqs[i], cancels[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    time.sleep(0.1)
    cancels[3].set()  # cancelled mid-batch
    for t in threads:
        t.join(60)
    for i, r in got.items():
        if r.finish_reason == "cancelled":
            assert r.token_ids == expected[i][: len(r.token_ids)]
        else:
            assert r.token_ids == expected[i], f"request {i} ({drafts[i]}) changed under batching"
    rep = batched.batch.report()
    assert rep["slots_in_use"] == 0 and sum(v for k, v in rep.items() if k.startswith("rows_")) == rep["passes"]
    assert rep.get("rows_2", 0) + rep.get("rows_3", 0) > 0
    # the batched graph's own copy of the weights is counted: the target's pinned bytes, and status
    from memspec.serving.backend import _resident

    rows = {m["role"]: m["bytes"] for m in _resident(batched)}
    assert rows["batched"] == batched.batch.target.weight_bytes > 0.9 * target.file_bytes
    batched.close()


@pytest.mark.parametrize("backend", ["onnxruntime", "native"])
def test_engine_greedy_with_output_controls_is_target_only_with_drafts_and_under_batching(model_store, backend):
    """Penalties and logit_bias on the real q4 target, on either engine: every draft's greedy answer is
    the target-only answer under the same controls, alone and with requests sharing batched passes."""
    from memspec.build import load_pool
    from memspec.runtime.target import load_target, open_batched
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool

    cfg = SessionConfig(max_context=256, backend=backend)
    target = load_target(model_store, "smollm2-135m", "q4", cfg)
    pool = DraftPool(load_pool(model_store, "smollm2-135m", target.session.vocab_size, cfg))
    solo = Engine(target, drafts=pool)
    batched = Engine(target, drafts=pool, batched=open_batched(target.session, 3))
    the = target.tokenizer.encode(" the")[0]
    controls = SamplingParams(frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.2,
                              logit_bias=((the, -100.0), (target.tokenizer.encode(" very")[0], 2.0)))
    prompts = ["Write a Python function that reverses a list.", "Tell me about the history of the city of Paris.",
               "List the planets of the solar system."]
    drafts = ["draft-code", "draft-chat", "prompt-lookup"]
    reqs = [GenerationRequest(prompt=p, max_tokens=32, draft=d, sampling=controls) for p, d in zip(prompts, drafts)]
    expected = [solo.generate(dataclasses.replace(r, draft="none")).token_ids for r in reqs]
    plain = [solo.generate(dataclasses.replace(r, draft="none", sampling=SamplingParams())).token_ids for r in reqs]
    assert all(the not in e for e in expected) and any(the in p for p in plain)  # the bias held, and mattered
    assert expected != plain
    accepted = 0
    for r, want in zip(reqs, expected):
        done = solo.generate(r)
        assert done.token_ids == want, f"{r.draft}: speculation changed the controlled answer"
        accepted += done.stats.num_accepted_tokens
    assert accepted > 0  # the drafts proposed under the controls, and the target took some
    got: dict[int, object] = {}
    threads = [threading.Thread(target=lambda i=i: got.setdefault(i, batched.generate(reqs[i])))
               for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i].token_ids for i in range(len(reqs))] == expected
    assert sum(n for b, n in batched.batch.stats.rows.items() if b > 1) > 0  # passes were shared
    batched.close()
