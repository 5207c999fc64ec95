"""A seed gives the same answer with speculation on (issue 68), on the real SmolLM2 target.

Coupled sampling (memspec.speculation.sampling) draws the token at answer position i as the
argmax of the shaped log-probabilities plus noise keyed by (seed, i, token id), and verification
is the greedy rule on the target's perturbed rows: for a seed, the sampled answer is token for
token the target-only answer, whatever draft ran (a model draft, prompt lookup, the suffix draft,
the scheduler's switches, token trees), alone or sharing batched passes.  The gRPC and HTTP paths
are in test_daemon_e2e.py and test_http_e2e.py.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from memspec.request import GenerationRequest, SamplingParams
from memspec.runtime.config import SessionConfig
from memspec.speculation.config import SpecConfig

PROMPTS = ["Write a Python function that reverses a list.", "Tell me about the history of Paris.",
           "What is 12 * 13? Explain.", "List three uses of a paperclip."]
# temperature 0.7 and 1.0, with the filters and a penalty, as users send them
SAMPLINGS = [SamplingParams(temperature=0.7, top_p=0.95),
             SamplingParams(temperature=1.0, top_k=40, min_p=0.02, frequency_penalty=0.3),
             SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1)]


@pytest.fixture(scope="module")
def pool_engine(model_store):
    """The q4 target on the native engine with every draft of the store, prompt lookup and the
    suffix draft; token trees on (the native target takes them)."""
    from memspec.build import load_pool
    from memspec.runtime.target import load_target
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool

    cfg = SessionConfig(max_context=512)
    target = load_target(model_store, "smollm2-135m", "q4", cfg)
    pool = load_pool(model_store, "smollm2-135m", target.session.vocab_size, cfg, suffix_bytes=1 << 20,
                     tokenizer=target.tokenizer)
    # the prompts' K/V kept: 200 seeds of the same four prompts prefill them once
    engine = Engine(target, drafts=DraftPool(pool), spec=SpecConfig(trees=True), prefix_cache_bytes=16 << 20)
    yield engine
    engine.close()


def request(i: int, seed: int | None, draft: str, max_tokens: int = 10) -> GenerationRequest:
    return GenerationRequest(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, draft=draft,
                             sampling=dataclasses.replace(SAMPLINGS[i % len(SAMPLINGS)], seed=seed))


def test_200_seeds_give_the_target_only_answer_whatever_the_draft(pool_engine):
    """200 seeds, each with one of the drafts in turn (every draft about 40 times), short answers."""
    e = pool_engine
    drafts = [d for d in e.drafts if d != "suffix"]  # the suffix draft: the test below, once it has seen answers
    assert {"prompt-lookup", "draft-code", "draft-chat"} <= set(drafts)
    answers, drafted = set(), 0
    for seed in range(200):
        alone = e.generate(request(seed, seed, "none"))
        got = e.generate(request(seed, seed, drafts[seed % len(drafts)]))
        assert got.token_ids == alone.token_ids, (seed, drafts[seed % len(drafts)], got.text, alone.text)
        assert got.seed == alone.seed == seed
        answers.add(tuple(alone.token_ids))
        drafted += got.stats.num_draft_tokens
    assert len(answers) > 150 and drafted > 200  # the seeds matter, and the drafts drafted


@pytest.mark.slow
def test_200_seeds_with_every_draft(pool_engine):
    e = pool_engine
    for seed in range(200):
        alone = e.generate(request(seed, seed, "none", 24)).token_ids
        for name in e.drafts:
            assert e.generate(request(seed, seed, name, 24)).token_ids == alone, (seed, name)


def test_the_suffix_draft_after_it_has_seen_the_answer_and_the_step_controller(pool_engine):
    """A repeated request: the suffix index holds its answer, proposes all of it, and the answer
    stays the seed's target-only one; so with the step controller's draft lengths."""
    e = pool_engine
    saved, e.spec = e.spec, SpecConfig(controller="step", gamma=6)  # drafts from the first step
    try:
        for seed in range(4):
            req = request(seed, 1000 + seed, "none", 24)
            alone = e.generate(req)  # the engine's drafts learn it (the suffix index)
            again = e.generate(dataclasses.replace(req, draft="suffix"))
            assert again.token_ids == alone.token_ids
            assert again.stats.num_accepted_tokens >= len(alone.token_ids) // 2, again.stats
            assert e.generate(dataclasses.replace(req, draft="draft-general")).token_ids == alone.token_ids
    finally:
        e.spec = saved


def test_a_request_without_a_seed_reports_one_that_replays_it(pool_engine):
    e = pool_engine
    first = e.generate(request(0, None, "draft-code", 16))
    assert first.seed is not None and 0 <= first.seed < 2**53
    assert e.generate(request(0, first.seed, "none", 16)).token_ids == first.token_ids
    assert e.generate(request(0, first.seed, "prompt-lookup", 16)).token_ids == first.token_ids
    other = e.generate(request(0, None, "draft-code", 16))
    assert other.seed != first.seed  # fresh each time
    greedy = e.generate(GenerationRequest(prompt=PROMPTS[0], max_tokens=4))
    assert greedy.seed is None  # nothing was drawn


def test_the_scheduler_and_batched_passes_keep_the_seeds_answer(model_store):
    """The daemon's own composition (memspec.build, the scheduler picking and switching drafts,
    batched passes): concurrent seeded requests each give their target-only answer."""
    from memspec.build import build_engine
    from memspec.config import Config

    cfg = dataclasses.replace(Config(), runtime=SessionConfig(max_context=512, batching=True))
    e = build_engine(cfg, serving=True)
    try:
        assert e.batch is not None
        # odd ones: the scheduler's pick (draft=None); even ones: a draft named
        reqs = [dataclasses.replace(request(i, 300 + i, "draft-code", 24), draft=None if i % 2 else "draft-code")
                for i in range(6)]
        want = [e.generate(dataclasses.replace(r, draft="none")).token_ids for r in reqs]
        for r, w in zip(reqs, want):  # alone, through the scheduler
            assert e.generate(r).token_ids == w
        got: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: got.setdefault(i, e.generate(reqs[i]).token_ids))
                   for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert [got[i] for i in range(len(reqs))] == want
        assert sum(n for b, n in e.batch.stats.rows.items() if b > 1) > 0  # passes were shared
    finally:
        e.close()


def test_20_seeds_on_the_1_5b_give_its_target_only_answer_with_prompt_lookup_and_trees(qwen_store):
    """The real-sized target (151,936 ids, token trees on the native engine): prompt lookup's
    proposals (with its alternatives as branches) and the suffix draft's after it saw the answer."""
    from memspec.build import load_pool
    from memspec.runtime.target import load_target
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool

    from conftest import QWEN

    cfg = SessionConfig(max_context=256)
    target = load_target(qwen_store, QWEN, "q4", cfg)
    pool = load_pool(qwen_store, QWEN, target.session.vocab_size, cfg, names=[], suffix_bytes=1 << 20,
                     tokenizer=target.tokenizer)
    e = Engine(target, drafts=DraftPool(pool), spec=SpecConfig(trees=True, controller="step", gamma=4),
               prefix_cache_bytes=16 << 20)
    try:
        for seed in range(20):
            req = dataclasses.replace(request(seed, 500 + seed, "none", 8),
                                      prompt="Write a Python function that returns the sum of a list of numbers.")
            alone = e.generate(req).token_ids
            draft = ("prompt-lookup", "suffix")[seed % 2]
            assert e.generate(dataclasses.replace(req, draft=draft)).token_ids == alone, (seed, draft)
    finally:
        e.close()
