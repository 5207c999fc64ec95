"""The probability maths of sampling and speculative verification, on literal arrays."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.speculation import sampling


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test of counts against probs (cells with p=0 must be empty)."""
    from scipy.stats import chisquare  # scipy comes with scikit-learn

    assert counts[probs == 0].sum() == 0, "a token with probability 0 was drawn"
    keep = probs > 0
    n = counts.sum()
    return float(chisquare(counts[keep], probs[keep] / probs[keep].sum() * n).pvalue)


def test_greedy_accepts_matching_prefix():
    assert sampling.verify_greedy(np.array([5, 6, 7, 8]), np.array([5, 6, 7])) == (3, 8)  # all + bonus
    assert sampling.verify_greedy(np.array([5, 9, 7, 8]), np.array([5, 6, 7])) == (1, 9)  # recovered
    assert sampling.verify_greedy(np.array([4, 6, 7, 8]), np.array([5, 6, 7])) == (0, 4)  # none
    assert sampling.verify_greedy(np.array([3]), np.array([], dtype=np.int64)) == (0, 3)  # no draft


def test_probabilities_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    np.testing.assert_allclose(sampling.probabilities(logits, 1.0), [0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(sampling.probabilities(logits, 1.0, top_k=2), [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(sampling.probabilities(logits, 1.0, top_p=0.75), [0.625, 0.375, 0, 0])
    np.testing.assert_allclose(sampling.probabilities(logits, 1.0, top_p=0.81), [0.5, 0.3, 0.15, 0] / np.float64(0.95))
    sharp = sampling.probabilities(logits, 0.1)
    assert sharp[0] > 0.99
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sampling.probabilities(logits, 0.0)


def test_sample_follows_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.1, 0.0, 0.6, 0.3])
    counts = np.bincount([sampling.sample(p, rng) for _ in range(4000)], minlength=4)
    assert chi_square_p(counts, p) > 1e-3


P = np.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.4, 0.4], [0.25, 0.25, 0.25, 0.25]])  # target rows
Q = np.array([[0.1, 0.6, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]])  # draft rows, far from the target


def first_token_counts(verify, n: int = 6000, seed: int = 1) -> np.ndarray:
    """Counts of the first committed token when drafts are drawn from Q and verified against P."""
    rng = np.random.default_rng(seed)
    counts = np.zeros(4, dtype=np.int64)
    for _ in range(n):
        draft = np.array([sampling.sample(Q[0], rng), sampling.sample(Q[1], rng)])
        n_acc, nxt = verify(P, sampling.DraftRows(Q, np.arange(Q.shape[1])), draft, rng)
        counts[draft[0] if n_acc > 0 else nxt] += 1
    return counts


def test_speculative_sampling_reproduces_target_distribution():
    assert chi_square_p(first_token_counts(sampling.verify_sampled), P[0]) > 1e-3


def test_target_rows_build_each_row_on_first_read_and_verification_stops_reading_at_a_rejection():
    logits = np.log(np.vstack([P, [[0.4, 0.3, 0.2, 0.1]]]))  # 4 rows: 3 draft positions and the bonus
    rows = sampling.TargetRows(logits, 0.7, top_k=3, min_p=0.1)
    assert len(rows) == 4 and rows.built == {}
    np.testing.assert_array_equal(rows[2], sampling.probabilities(logits[2], 0.7, top_k=3, min_p=0.1))
    assert list(rows.built) == [2] and rows[2] is rows[2]
    q = sampling.DraftRows.one_hot([1, 1, 1])  # a one-hot draft on token 1, which P[0] mostly rejects
    stacked = np.stack([sampling.probabilities(r, 0.7, top_k=3, min_p=0.1) for r in logits])
    for seed in range(40):  # the same draws from the lazy rows as from the stacked ones
        lazy = sampling.TargetRows(logits, 0.7, top_k=3, min_p=0.1)
        got = sampling.verify_sampled(lazy, q, np.array([1, 1, 1]), np.random.default_rng(seed))
        assert got == sampling.verify_sampled(stacked, q, np.array([1, 1, 1]), np.random.default_rng(seed))
        assert sorted(lazy.built) == list(range(min(got[0] + 1, 4)))  # nothing past the deciding row


def test_draft_rows_are_q_over_the_target_vocabulary_kept_on_the_drafts_ids():
    ids = np.array([5, 1, 7])  # the draft's vocabulary in target ids (draft id -> target id)
    q = sampling.DraftRows(np.array([[0.2, 0.5, 0.3], [0.6, 0.0, 0.4]]), ids)
    dense = np.zeros((2, 9))
    dense[:, ids] = q.probs
    np.testing.assert_array_equal(q.dense(9), dense)
    assert [q.at(i, x) for i in range(2) for x in range(9)] == dense.ravel().tolist()
    p = np.array([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2])
    for i in range(2):
        np.testing.assert_array_equal(q.residual(i, p), np.maximum(p - dense[i], 0.0))
    assert len(q.prefix(1)) == 1 and q.prefix(1).at(0, 1) == 0.5
    hot = sampling.DraftRows.one_hot([4, 2])
    np.testing.assert_array_equal(hot.dense(5), np.eye(5)[[4, 2]])
    assert hot.prefix(1).ids.tolist() == [[4]]
    with pytest.raises(ValueError, match="line up"):
        sampling.DraftRows(np.ones((2, 3)), np.arange(4))


def wrong_resample_from_p(p, q, draft, rng):
    """A classic bug: on rejection, resample from p instead of the residual max(p - q, 0)."""
    for i, x in enumerate(draft):
        if rng.random() * q.at(i, x) >= p[i, x]:
            return i, sampling.sample(p[i], rng)
    return len(draft), sampling.sample(p[len(draft)], rng)


def wrong_accept_ratio(p, q, draft, rng):
    """Another: accept with min(1, q/p) instead of min(1, p/q)."""
    for i, x in enumerate(draft):
        if rng.random() * p[i, x] >= q.at(i, x):
            res = q.residual(i, p[i])
            return i, sampling.sample(res / res.sum(), rng)
    return len(draft), sampling.sample(p[len(draft)], rng)


@pytest.mark.parametrize("wrong", [wrong_resample_from_p, wrong_accept_ratio])
def test_wrong_rules_fail_the_same_test(wrong):
    assert chi_square_p(first_token_counts(wrong), P[0]) < 1e-6


def test_pick_is_argmax_at_temperature_zero_and_a_draw_otherwise():
    logits = np.log(np.array([0.1, 0.6, 0.3]))
    rng = np.random.default_rng(0)
    assert sampling.pick(logits, 0.0, 0, 1.0, rng) == 1
    counts = np.bincount([sampling.pick(logits, 1.0, 0, 1.0, rng) for _ in range(3000)], minlength=3)
    assert chi_square_p(counts, np.array([0.1, 0.6, 0.3])) > 1e-3
    assert {sampling.pick(logits, 1.0, 1, 1.0, rng) for _ in range(50)} == {1}  # top_k=1 leaves the argmax


def test_log_probs_are_a_log_softmax_with_the_top_k_most_likely_first():
    logits = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)
    lp, top = sampling.log_probs(logits, 2, k=2)
    expected = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert lp == pytest.approx(expected[2])
    assert [i for i, _ in top] == [1, 2] and [v for _, v in top] == pytest.approx([expected[1], expected[2]])
    assert sampling.log_probs(logits, 0, k=0)[1] == []
    assert [i for i, _ in sampling.log_probs(logits, 0, k=4)[1]] == [1, 2, 0, 3]
    tied = np.array([0.0, 5.0, 1.0, 5.0, 1.0, 1.0, -2.0], dtype=np.float32)
    assert [i for i, _ in sampling.log_probs(tied, 0, k=3)[1]] == [1, 3, 2]  # equal logits: the lower id first
    rng = np.random.default_rng(7)
    for scale in (0.01, 1.0, 30.0):  # a full row: the k largest, as a sort of all of them gives them
        row = (rng.standard_normal(20000) * scale).astype(np.float32)
        want = np.argsort(-row.astype(np.float64), kind="stable")[:20]
        assert [i for i, _ in sampling.log_probs(row, 0, k=20)[1]] == want.tolist()


@pytest.mark.parametrize("scale", [0.1, 3.0, 40.0])
def test_greedy_summary_is_the_argmax_and_the_softmaxs_top_and_entropy(scale):
    """What a greedy draft reads of its logits (sampling.greedy_summary), in float32, against the
    float64 distribution probabilities() builds: the same token, top probability and entropy."""
    rng = np.random.default_rng(int(scale * 10))
    for V in (7, 16384, 32768):
        x = (rng.standard_normal(V) * scale).astype(np.float32)
        p = sampling.probabilities(x, 1.0)
        token, top, ent = sampling.greedy_summary(x)
        assert token == int(np.argmax(p))
        assert top == pytest.approx(float(p.max()), rel=1e-5)
        assert ent == pytest.approx(float(-(p * np.log(np.maximum(p, 1e-300))).sum()), rel=1e-4, abs=1e-5)


def test_greedy_summary_of_a_row_with_forbidden_tokens():
    """-inf logits (tokens a shaper or a vocabulary map forbids) count for nothing, not NaN."""
    x = np.array([-np.inf, 2.0, -np.inf, 2.0], dtype=np.float32)
    assert sampling.greedy_summary(x) == (1, pytest.approx(0.5), pytest.approx(np.log(2)))
    one = np.array([-np.inf, 5.0, -np.inf], dtype=np.float32)
    assert sampling.greedy_summary(one) == (1, pytest.approx(1.0), pytest.approx(0.0))


def test_the_nucleus_is_the_full_sorts_prefix():
    """nucleus() sorts only the likeliest tokens first: its set and order must be those of the
    stable descending sort of every token it replaced, on peaked, tied, flat and top_k'd rows."""
    def full_sort(p, top_p):
        order = np.argsort(-p, kind="stable")
        return order[: int(np.searchsorted(np.cumsum(p[order]), top_p, side="left")) + 1]

    rng = np.random.default_rng(0)
    for trial in range(100):
        V = int(rng.choice([1, 5, 300, 40000]))
        x = [rng.standard_normal(V) * rng.uniform(0.1, 10), np.round(rng.standard_normal(V) * 2), np.zeros(V),
             rng.standard_normal(V) * 0.01, rng.standard_normal(V) * 3][trial % 5]
        if trial % 5 == 4:  # what top_k leaves: a few tokens and many zeros
            x = np.where(x >= np.sort(x)[-min(V, int(rng.integers(1, 70)))], x, -np.inf)
        p = np.exp(x - x.max())
        p /= p.sum()
        for top_p in (0.01, 0.5, 0.9, 0.999, 1 - 1e-15):
            np.testing.assert_array_equal(sampling.nucleus(p, top_p), full_sort(p, top_p))


def test_the_kth_largest_is_the_full_partitions():
    """kth_largest() partitions only the values near the top: it must equal a partition of all of
    them on peaked, tied, flat, wide and -inf rows, for any k."""
    rng = np.random.default_rng(5)
    for trial in range(200):
        V = int(rng.choice([1, 2, 40, 300, 40000]))
        z = [rng.standard_normal(V) * rng.uniform(0.1, 30), np.round(rng.standard_normal(V) * 2), np.zeros(V),
             rng.standard_normal(V) * 200, np.where(rng.random(V) < 0.5, -np.inf, rng.standard_normal(V))][trial % 5]
        for k in {1, 2, 7, 40, V // 2 + 1, V}:
            if 1 <= k <= V:
                assert sampling.kth_largest(z, k) == np.partition(z, -k)[-k], (trial, V, k)
    z = np.full(10, -np.inf)
    assert sampling.kth_largest(z, 3) == -np.inf  # every value filtered: the band is everything


def test_probabilities_are_the_float64_softmax_bit_for_bit():
    """probabilities() works in place (its fresh arrays cost more than its arithmetic): the values
    are still those of the plain float64 formulas, filters included."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(5000) * 4).astype(np.float32)
    z = x.astype(np.float64) / 0.7
    ref = np.exp(z - z.max())
    ref /= ref.sum()
    np.testing.assert_array_equal(sampling.probabilities(x, 0.7), ref)
    kth = np.partition(z, -7)[-7]
    zk = np.where(z >= kth, z, -np.inf)
    ref = np.exp(zk - zk.max())
    ref /= ref.sum()
    ref = np.where(ref >= 0.2 * ref.max(), ref, 0.0)
    ref /= ref.sum()
    np.testing.assert_array_equal(sampling.probabilities(x, 0.7, top_k=7, min_p=0.2), ref)
    row = z.copy()  # a float64 row (a shaped one) is the caller's: left as it was
    sampling.probabilities(row, 0.7, top_k=7, top_p=0.9, min_p=0.2)
    np.testing.assert_array_equal(row, z)


# -- coupled sampling: Gumbel-max with noise keyed by (seed, position, token) -------------------
def test_gumbel_noise_is_a_function_of_seed_position_and_token_alone():
    ids = np.arange(5000)
    row = sampling.gumbel(7, 3, ids)
    assert np.array_equal(sampling.gumbel(7, 3, ids[[4999, 2, 17]]), row[[4999, 2, 17]])  # any subset, any order
    assert np.array_equal(sampling.gumbel(7, 3, ids), row)  # and again: no state
    for other in (sampling.gumbel(8, 3, ids), sampling.gumbel(7, 4, ids)):  # the next seed, the next position
        assert abs(np.corrcoef(row, other)[0, 1]) < 0.05
    # standard Gumbel: mean Euler's gamma, variance pi^2 / 6; and the CDF exp(-exp(-x)) (Kolmogorov-Smirnov)
    from scipy.stats import kstest

    big = sampling.gumbel(123, 0, np.arange(200_000))
    assert abs(big.mean() - 0.5772) < 0.01 and abs(big.var() - np.pi ** 2 / 6) < 0.03
    assert kstest(big, "gumbel_r").pvalue > 1e-3
    assert np.isfinite(big).all() and big.min() > -3.7 and big.max() < 37.5  # GUMBEL_SPAN bounds it
    with pytest.raises(ValueError, match="seed"):
        sampling.noise_key(-1, 0)


P_LITERAL = np.array([0.05, 0.3, 0.0, 0.15, 0.4, 0.1])


def test_the_gumbel_argmax_over_many_seeds_is_a_draw_from_p():
    counts = np.bincount([sampling.gumbel_argmax(P_LITERAL, s, 0) for s in range(6000)], minlength=6)
    assert chi_square_p(counts, P_LITERAL) > 1e-3
    # over positions of one seed too (the tokens of one answer)
    counts = np.bincount([sampling.gumbel_argmax(P_LITERAL, 5, i) for i in range(6000)], minlength=6)
    assert chi_square_p(counts, P_LITERAL) > 1e-3


def test_noise_keyed_by_position_alone_is_caught():
    """The test above can fail: noise that ignores the seed gives every seed the same token."""
    counts = np.bincount([sampling.gumbel_argmax(P_LITERAL, 0, 0) for _ in range(6000)], minlength=6)
    assert chi_square_p(counts, P_LITERAL) < 1e-6


def test_the_gumbel_argmax_sees_only_what_can_win_and_maps_a_drafts_ids():
    rng = np.random.default_rng(0)
    p = sampling.probabilities(rng.normal(0, 6, 3000).astype(np.float32), 1.0)
    for s in range(50):  # the candidates within GUMBEL_SPAN: the argmax over the whole row
        whole = int(np.argmax(np.log(np.maximum(p, 1e-300)) + sampling.gumbel(s, 2, np.arange(3000))))
        assert sampling.gumbel_argmax(p, s, 2) == whole
    ids = np.array([10, 3, 7, 42, 5, 1])  # a draft's row: its entries stand for these target ids
    full = np.zeros(50)
    full[ids] = P_LITERAL
    for s in range(50):  # the same noise as the target's row over the target's ids
        assert ids[sampling.gumbel_argmax(P_LITERAL, s, 4, ids)] == sampling.gumbel_argmax(full, s, 4)


def test_coupled_verification_is_the_greedy_rule_on_the_perturbed_rows():
    rows = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.9, 0.05, 0.05], [1 / 3, 1 / 3, 1 / 3]])
    noise = sampling.Coupled(99, origin=10)
    want = [noise.argmax(rows[i], 12 + i) for i in range(4)]  # the target alone, token by token
    for k in range(4):
        for wrong_at in range(k + 1):
            draft = np.array(want[:k])
            if wrong_at < k:
                draft[wrong_at] = (want[wrong_at] + 1) % 3
            n, nxt = sampling.verify_coupled(rows, draft, noise, at=12)
            assert (n, nxt) == (wrong_at, want[wrong_at]) if wrong_at < k else (k, want[k])
    with pytest.raises(ValueError, match="before the answer"):
        noise.position(9)


def test_draw_takes_a_stream_or_coupled_noise():
    rng = np.random.default_rng(0)
    assert sampling.draw(np.array([0.0, 1.0, 0.0]), rng, 0) == 1
    noise = sampling.Coupled(3, 4)
    assert sampling.draw(P_LITERAL, noise, 9) == sampling.gumbel_argmax(P_LITERAL, 3, 5)
    assert sampling.coupled(noise) and not sampling.coupled(rng) and not sampling.coupled(None)
