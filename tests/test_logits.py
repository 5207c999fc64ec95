"""Logits shapers (memspec.speculation.logits): the controls on literal arrays, and the contract
the speculative loop keeps with them: every verified position is shaped exactly as one-token
decoding would shape it, rejections included."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.request import SamplingParams
from memspec.speculation import logits as L
from memspec.speculation import sampling


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    s = L.Penalties(prompt=[0, 1], repetition=2.0)
    row = np.array([4.0, -4.0, 4.0, -4.0, 0.5], dtype=np.float32)
    np.testing.assert_allclose(s.shape(row), [2.0, -8.0, 4.0, -4.0, 0.5])  # the prompt counts
    s.push(4)
    np.testing.assert_allclose(s.shape(row), [2.0, -8.0, 4.0, -4.0, 0.25])  # and generated tokens
    s.pop(1)
    np.testing.assert_allclose(s.shape(row), [2.0, -8.0, 4.0, -4.0, 0.5])
    np.testing.assert_array_equal(row, [4.0, -4.0, 4.0, -4.0, 0.5])  # the raw row is never written


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    s = L.Penalties(prompt=[2, 2, 2], frequency=0.5, presence=1.0)
    zero = np.zeros(4, dtype=np.float32)
    np.testing.assert_allclose(s.shape(zero), 0.0)  # the prompt does not count (OpenAI)
    for t in (1, 1, 3):
        s.push(t)
    np.testing.assert_allclose(s.shape(zero), [0.0, -2.0, 0.0, -1.5])  # 2 x 0.5 + 1; 1 x 0.5 + 1
    s.pop(2)
    np.testing.assert_allclose(s.shape(zero), [0.0, -1.5, 0.0, 0.0])
    with pytest.raises(ValueError, match="only 1 tokens pushed"):
        s.pop(2)


def test_logit_bias_adds_to_its_tokens():
    s = L.LogitBias(((1, 5.0), (3, -100.0)))
    np.testing.assert_allclose(s.shape(np.ones(4, dtype=np.float32)), [1.0, 6.0, 1.0, -99.0])


def test_compose_skips_identities_and_chains_in_order():
    assert L.compose() is L.IDENTITY and L.compose(L.IDENTITY, L.IDENTITY) is L.IDENTITY
    assert L.for_sampling(SamplingParams(temperature=0.7, top_p=0.9, min_p=0.1), [1, 2]) is L.IDENTITY
    bias = L.LogitBias(((0, 1.0),))
    assert L.compose(L.IDENTITY, bias) is bias
    chain = L.for_sampling(SamplingParams(repetition_penalty=2.0, logit_bias=((0, 1.0),)), [0])
    assert isinstance(chain, L.Chain) and len(chain.parts) == 2
    # repetition first (4 / 2), then the bias (+1): not (4 + 1) / 2
    np.testing.assert_allclose(chain.shape(np.array([4.0, 0.0], dtype=np.float32)), [3.0, 0.0])


def test_min_p_keeps_tokens_within_a_ratio_of_the_top_after_temperature():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    np.testing.assert_allclose(sampling.probabilities(logits, 1.0, min_p=0.5), [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(sampling.probabilities(logits, 1.0, min_p=0.1), [0.5, 0.3, 0.15, 0.05])
    # at temperature 2 the ratios are square roots: 0.15 is sqrt(0.3) of the top, kept at min_p=0.5
    p = sampling.probabilities(logits, 2.0, min_p=0.5)
    assert p[2] > 0 and p[3] == 0
    assert sampling.pick(logits, 0.0, 0, 1.0, np.random.default_rng(0), min_p=1.0) == 0  # greedy: unaffected
    assert {sampling.pick(logits, 1.0, 0, 1.0, np.random.default_rng(i), min_p=1.0) for i in range(30)} == {0}


class Grammarish:
    """A shaper whose mask depends on the stack, as a grammar's does: after token t, token t is forbidden."""

    def __init__(self):
        self.stack: list[int] = []

    def shape(self, row):
        out = row.astype(np.float32, copy=True)
        if self.stack:
            out[self.stack[-1]] = -np.inf
        return out

    def push(self, token):
        self.stack.append(token)

    def pop(self, n):
        del self.stack[len(self.stack) - n:]


def one_token_row(params, prompt, before, row):
    """The row one-token decoding decodes from after `before`: a fresh shaper fed token by token."""
    s = L.compose(L.for_sampling(params, prompt), Grammarish())
    for t in before:
        s.push(t)
    return s.shape(row)


@pytest.mark.parametrize("seed", range(5))
def test_verified_rows_are_the_rows_of_one_token_decoding_through_rejections(seed):
    """Random steps of k drafts, random acceptance: each verified row equals the one-token row at its
    position (penalties from every token before it), and after settle() the state is the committed one."""
    rng = np.random.default_rng(seed)
    V, prompt = 12, [1, 2, 3]
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.6,
                            logit_bias=((5, 2.0), (7, -3.0)))
    shaper = L.compose(L.for_sampling(params, prompt), Grammarish())
    committed: list[int] = [int(rng.integers(V))]
    shaper.push(committed[0])
    for _ in range(30):
        k = int(rng.integers(0, 5))
        draft = rng.integers(0, V, size=k).tolist()
        rows = rng.normal(size=(k + 1, V)).astype(np.float32)
        got = L.verify_rows(shaper, rows, draft)
        for i in range(k + 1):
            np.testing.assert_array_equal(got[i], one_token_row(params, prompt, committed + draft[:i], rows[i]))
        n = int(rng.integers(0, k + 1))
        nxt = int(rng.integers(V))
        L.settle(shaper, k, n, nxt)
        committed += [*draft[:n], nxt]
        probe = rng.normal(size=V).astype(np.float32)
        np.testing.assert_array_equal(shaper.shape(probe), one_token_row(params, prompt, committed, probe))


def test_allowed_prefix_stops_before_the_first_forbidden_token_and_leaves_the_state():
    s = Grammarish()
    s.push(4)
    assert L.allowed_prefix(s, [3, 5, 5, 6], vocab=8) == [3, 5]  # the second 5 follows a 5
    assert L.allowed_prefix(s, [4, 1], vocab=8) == []
    assert s.stack == [4]
