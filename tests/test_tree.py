"""Token trees (memspec.speculation.tree): a draft's alternatives verified beside its chain in one
pass of the native target.  The walk and the shape on literal arrays; the answer unchanged,
greedy token for token and sampled in distribution, with trees on."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.request import GenerationRequest, SamplingParams
from memspec.runtime import kernels
from memspec.speculation import sampling, tree
from memspec.speculation.config import SpecConfig
from memspec.speculation.drafts import Proposal, ngram_alternatives, top_alternatives
from memspec.speculation.metrics import SpecMetrics
from memspec.speculation.speculative import FixedDraft, speculative_steps
from test_sampling import chi_square_p

GREEDY = SamplingParams()
FLAT = [0.0] + [1.0 + 0.001 * k for k in range(12)]  # extra rows nearly free: trees wherever they may win
STEEP = [0.0] + [float(k) for k in range(1, 13)]  # a row costs a whole step: never


def one_hot_rows(argmax: list[int], v: int = 10) -> np.ndarray:
    rows = np.zeros((len(argmax), v), dtype=np.float32)
    rows[np.arange(len(argmax)), argmax] = 1.0
    return rows


def test_a_tree_is_the_chain_then_each_branch_under_its_position():
    t = tree.Tree.build(9, [1, 2, 3], [tree.Branch(0, (4,), 0), tree.Branch(1, (5, 6), 0)])
    assert t.tokens == [9, 1, 2, 3, 4, 5, 6] and t.parents == [-1, 0, 1, 2, 0, 1, 5] and t.chain == 3
    assert t.children(0) == [1, 4] and t.children(5) == [6]


def test_greedy_walk_follows_the_targets_argmax_down_a_branch():
    t = tree.Tree.build(9, [1, 2, 3], [tree.Branch(0, (4,), 0), tree.Branch(1, (5, 6), 0)])
    # node rows: root, 1, 2, 3, 4, 5, 6
    assert tree.walk(t, one_hot_rows([1, 2, 3, 7, 0, 0, 0]), None, GREEDY, None) == ([0, 1, 2, 3], 7, 3)
    assert tree.walk(t, one_hot_rows([4, 2, 3, 7, 8, 0, 0]), None, GREEDY, None) == ([0, 4], 8, 0)
    assert tree.walk(t, one_hot_rows([1, 5, 3, 7, 8, 6, 2]), None, GREEDY, None) == ([0, 1, 5, 6], 2, 1)
    assert tree.walk(t, one_hot_rows([1, 5, 3, 7, 8, 8, 2]), None, GREEDY, None) == ([0, 1, 5], 8, 1)
    assert tree.walk(t, one_hot_rows([0, 5, 3, 7, 8, 8, 2]), None, GREEDY, None) == ([0], 0, 0)


def test_a_sampled_walk_draws_under_every_filter_the_request_set():
    """Regression: the walk built its rows without min_p, so a sampled request with trees on could
    commit a token its min_p removes."""
    t = tree.Tree.build(9, [1], [tree.Branch(0, (4,), 0)])
    rows = np.log(np.array([[0.05, 0.5, 0.05, 0.05, 0.3, 0.05]] * 3))
    q = sampling.DraftRows.one_hot([1])
    params = SamplingParams(temperature=1.0, min_p=0.5)  # only tokens 1 and 4 (0.3 >= 0.5 x 0.5) stay
    rng = np.random.default_rng(3)
    seen = {tree.walk(t, rows, q, params, rng)[1] for _ in range(300)}
    assert seen <= {1, 4}


def test_the_shape_adds_a_branch_only_where_it_beats_the_chain():
    prop = Proposal([1, 2, 3], None, [0.0] * 3, alternatives=[[[4]], [[5], [6]], []])
    stats = tree.AltStats()
    got = tree.choose(prop, 0.5, stats, FLAT, 0.0, room=100)
    assert [(b.at, b.tokens) for b in got] == [(0, (4,)), (1, (5,)), (1, (6,))]
    assert tree.choose(prop, 0.5, stats, STEEP, 0.0, room=100) == []
    assert tree.choose(prop, 0.5, stats, FLAT, 0.0, room=5) == [tree.Branch(0, (4,), 0)]  # the cache's room
    assert tree.choose(prop, 0.5, stats, FLAT[:6], 0.0, room=100) == [tree.Branch(0, (4,), 0)]  # rows measured
    curve = [0.0, 1.0, 1.26, 1.44, 1.66, 1.84, 2.02, 2.2]  # the 1.5B's, extended by 0.18 a row
    assert tree.choose(prop, 0.5, stats, curve, 0.1, room=100) == []  # beta 0.15: 0.075 tokens for 0.18 of a step
    for _ in range(40):  # its second choice right every time its first was wrong
        stats.observe([4], 4)
    assert stats.beta(0) > 0.8  # then the first two positions' best alternatives pay, the third choice not
    assert tree.choose(prop, 0.5, stats, curve, 0.1, room=100) == [tree.Branch(0, (4,), 0), tree.Branch(1, (5,), 0)]
    assert tree.choose(prop, 0.95, stats, curve, 0.1, room=100) == []  # a draft that is rarely wrong: the chain


def test_a_branch_of_several_tokens_is_cut_where_its_rows_stop_paying():
    prop = Proposal([1, 2, 3, 4], None, [0.0] * 4, alternatives=[[[5, 6, 7, 8, 9]]])
    stats = tree.AltStats(hits=[5.0, 0.3], misses=[1.0, 1.7])
    got = tree.choose(prop, 0.6, stats, FLAT, 0.0, room=100)
    assert got == [tree.Branch(0, (5, 6, 7, 8), 0)]  # never deeper than the chain
    curve = [0.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 2.5, 3.5, 4.5]  # rows past 6 cost a step each
    assert tree.choose(prop, 0.6, stats, curve, 0.0, room=100) == [tree.Branch(0, (5,), 0)]


def test_alternatives_are_the_drafts_next_choices_and_other_continuations():
    p = np.array([0.1, 0.4, 0.0, 0.3, 0.2])
    assert top_alternatives(p, 1) == [3, 4] and p.tolist() == [0.1, 0.4, 0.0, 0.3, 0.2]  # restored
    assert top_alternatives(np.array([0.0, 1.0, 0.0]), 1) == []  # nothing else possible
    ctx = [1, 2, 3, 9, 1, 2, 4, 4, 1, 2, 3, 5, 1, 2]
    assert ngram_alternatives(ctx, 3, 3, 1, 8) == [[4, 4, 1]]  # "1 2" was followed by 3, 4, 3
    assert ngram_alternatives(ctx, 3, 2, 1, 8, width=1) == [[4, 4]]
    assert ngram_alternatives([7, 1, 2, 8, 2], 8, 3, 1, 8) == []  # after "2": 8 only


V = 16
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def tiny_native(tmp_path_factory):
    """A tiny target and draft, both GGUFs on the native engine (a vocabulary of 16)."""
    if not kernels.available():
        pytest.skip(kernels.NOT_BUILT)
    from memspec.models.gguf_write import write_decoder
    from memspec.runtime.native_target import NativeTarget
    from memspec.speculation.drafts import DraftModel
    from tiny_models import tiny_config, tiny_weights

    d = tmp_path_factory.mktemp("tree")
    cfg = tiny_config(vocab=V)
    paths = [write_decoder(d / f"{n}.gguf", cfg, tiny_weights(cfg, seed=s, scale=0.5)._tensors, "F32")
             for n, s in (("target", 1), ("draft", 2))]
    target = NativeTarget(paths[0], threads=1, max_context=64)
    draft = NativeTarget(paths[1], threads=1, max_context=64, check_rows=False)
    return target, DraftModel("tiny-draft", draft, np.arange(V), V)


def first_tokens(target, draft, params, n, rng, trees=True) -> tuple[list[list[int]], SpecMetrics]:
    """The first three tokens of n runs (the prefill's, then the draft-and-verify steps')."""
    metrics, out = SpecMetrics(), []
    for _ in range(n):
        steps = speculative_steps(target, target.new_cache(), PROMPT, FixedDraft("d", draft.begin(64)), params, rng,
                                  SpecConfig(gamma_max=3, trees=trees), metrics, verify_cost_s=FLAT)
        got = []
        for committed in steps:
            got.extend(committed)
            if len(got) >= 3:
                break
        steps.close()
        out.append(got[:3])
    return out, metrics


@pytest.fixture(scope="module")
def joint(tiny_native) -> np.ndarray:
    """(V, V): P(second, third token) after PROMPT, from the target alone."""
    target = tiny_native[0]

    def softmax(row):
        e = np.exp(row.astype(np.float64) - row.max())
        return e / e.sum()

    c = target.new_cache()
    p1 = softmax(target.forward(c, PROMPT)[-1])
    out = np.zeros((V, V))
    for t1 in range(V):
        c.truncate(len(PROMPT))
        p2 = softmax(target.forward(c, [t1])[-1])
        for t2 in range(V):
            c.truncate(len(PROMPT) + 1)
            out[t2] += p1[t1] * p2[t2] * softmax(target.forward(c, [t2])[-1])
    return out


def test_sampling_with_trees_keeps_the_targets_distribution(tiny_native, joint):
    """Chi-square on the second and third tokens together: the first step's chain, its branches
    (a branch's row draws the third) and the next step all leave the target's joint distribution."""
    target, draft = tiny_native
    params = SamplingParams(temperature=1.0)
    runs, metrics = first_tokens(target, draft, params, 3000, np.random.default_rng(3))
    counts = np.zeros((V, V), dtype=np.int64)
    for t in runs:
        counts[t[1], t[2]] += 1
    assert metrics.tree_steps > 1000 and metrics.tree_tokens > 50, metrics.to_dict()  # branches taken, and won
    assert chi_square_p(counts.ravel(), joint.ravel()) > 1e-3


def test_a_walk_that_takes_the_branches_unchecked_fails_that_test(tiny_native, joint, monkeypatch):
    """The test above can fail: a walk that goes down the last child of each node (a branch where
    there is one) without drawing from the target is caught."""

    def take_branches(t, rows, q, params, rng, at=0):
        node, path = 0, [0]
        while t.children(node):
            node = t.children(node)[-1]
            path.append(node)
        return path, sampling.pick(rows[node], 1.0, 0, 1.0, rng), 0

    monkeypatch.setattr(tree, "walk", take_branches)
    runs, metrics = first_tokens(tiny_native[0], tiny_native[1], SamplingParams(temperature=1.0), 600,
                                 np.random.default_rng(3))
    counts = np.zeros((V, V), dtype=np.int64)
    for t in runs:
        counts[t[1], t[2]] += 1
    assert metrics.tree_steps > 100
    assert chi_square_p(counts.ravel(), joint.ravel()) < 1e-6


def test_greedy_with_trees_is_target_only_on_the_tiny_target(tiny_native):
    target, draft = tiny_native
    base, _ = first_tokens(target, draft, GREEDY, 1, None, trees=False)
    steps = speculative_steps(target, target.new_cache(), PROMPT, FixedDraft("d", draft.begin(64)), GREEDY, None,
                              SpecConfig(gamma_max=3, trees=True), metrics := SpecMetrics(), verify_cost_s=FLAT)
    with_trees = [t for _, step in zip(range(40), steps) for t in step][:40]
    c, alone = target.new_cache(), []
    row = target.forward(c, PROMPT)[-1]
    for _ in range(40):
        alone.append(int(row.argmax()))
        row = target.forward(c, [alone[-1]])[-1]
    assert with_trees == alone and metrics.tree_steps > 0


# -- SmolLM2 on the native engine ------------------------------------------------------------
from test_q4_agreement import PROMPTS  # noqa: E402


@pytest.fixture(scope="module")
def tree_engine(model_store):
    if not kernels.available():
        pytest.skip(kernels.NOT_BUILT)
    from memspec.runtime.config import SessionConfig
    from memspec.build import load_pool
    from memspec.runtime.target import load_target
    from memspec.speculation.engine import Engine
    from memspec.speculation.sources import DraftPool

    config = SessionConfig(max_context=512, backend="native", intra_op_threads=2)
    target = load_target(model_store, "smollm2-135m", "q4", config)
    engine = Engine(target, drafts=DraftPool(load_pool(model_store, "smollm2-135m", 49152, config)),
                    spec=SpecConfig(trees=True, gamma_max=5))
    # rows nearly free: trees wherever a branch may win a token
    engine.pin_costs([0.0] + [0.01 * (1.0 + 0.01 * k) for k in range(10)])
    yield engine
    engine.close()


def test_greedy_with_trees_is_target_only_with_every_kind_of_draft(tree_engine):
    """A model draft (its next choices as branches) and prompt lookup (other earlier continuations)."""
    won = {}
    for prompt in PROMPTS:
        base = tree_engine.generate(GenerationRequest(prompt=prompt, max_tokens=40, draft="none"))
        for name in ("draft-code", "draft-chat", "prompt-lookup"):
            r = tree_engine.generate(GenerationRequest(prompt=prompt, max_tokens=40, draft=name))
            assert r.token_ids == base.token_ids, f"{name} on {prompt!r}"
            won[name] = [a + b for a, b in zip(won.get(name, [0, 0]), (r.stats.tree_steps, r.stats.tree_tokens))]
    assert all(steps > 0 for steps, _ in won.values()), won
    assert sum(tokens for _, tokens in won.values()) > 0, won  # some branch won a token


def test_trees_reach_the_drafts_the_scheduler_hands_out(model_store, tmp_path):
    """Regression: with `[speculative] trees = true`, every draft the scheduler handed a request (the
    daemon's way, not a fixed pool) failed at its first proposal, since the watcher around it took
    no `alternatives`, and the request went on target-only."""
    if not kernels.available():
        pytest.skip(kernels.NOT_BUILT)
    from memspec.build import build_engine
    from memspec.config import load_config

    path = tmp_path / "trees.toml"
    path.write_text(f'home = "{model_store.home}"\n[model]\ntarget = "smollm2-135m"\n[runtime]\nbackend = "native"\n'
                    f'max_context = 512\n[speculative]\ntrees = true\ngamma_max = 5\n')
    engine = build_engine(load_config(str(path)), drafts="scheduler")
    engine.pin_costs([0.0] + [0.01 * (1.0 + 0.01 * k) for k in range(10)])  # trees wherever they may win
    try:
        base = engine.generate(GenerationRequest(prompt=PROMPTS[0], max_tokens=40, draft="none"))
        for name in ("draft-code", "prompt-lookup"):
            r = engine.generate(GenerationRequest(prompt=PROMPTS[0], max_tokens=40, draft=name))
            assert r.token_ids == base.token_ids, name
            assert r.stats.tree_steps > 0 and r.stats.num_accepted_tokens > 0, (name, r.stats)
    finally:
        engine.close()


def test_a_target_that_takes_no_trees_gets_chains(tmp_path):
    """ONNX Runtime's target says it takes chains only: trees on changes nothing there."""
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.sessions import DecoderSession
    from memspec.speculation.drafts import PromptLookup
    from tiny_models import build_tiny

    target = DecoderSession(build_tiny(tmp_path / "t.onnx", seed=1, scale=0.1, vocab=V),
                            SessionConfig(max_context=64, intra_op_threads=1))
    assert target.trees is False
    metrics = SpecMetrics()
    steps = speculative_steps(target, target.new_cache(), [1, 2, 3, 1, 2, 3, 1, 2],
                              FixedDraft("pl", PromptLookup(V).begin(64)), GREEDY, None, SpecConfig(trees=True),
                              metrics, verify_cost_s=FLAT)
    for _, _ in zip(range(10), steps):
        pass
    assert metrics.num_drafts > 0 and metrics.tree_steps == 0


def test_the_planner_learns_from_the_position_the_chain_stopped_at():
    planner = tree.Planner()
    prop = Proposal([1, 2, 3], None, [0.0] * 3, alternatives=[[[4], [5]], [[6]]])
    planner.observe("d", prop, 1, 6)  # d2 rejected, the target's token was its alternative
    planner.observe("d", prop, 0, 5)  # d1 rejected, the target's token its 3rd choice
    planner.observe("d", prop, 2, 9)  # no alternatives offered at the third position: nothing learnt
    planner.observe("d", prop, 3, 9)  # all accepted: nothing learnt
    s = planner.stats["d"]
    prior = tree.AltStats()
    assert s.beta(0) > prior.beta(0) and s.beta(1) > prior.beta(1)
    assert s.hits[0] == pytest.approx(prior.hits[0] * 0.95 ** 2 + 1 * 0.95)  # a hit, then a miss
