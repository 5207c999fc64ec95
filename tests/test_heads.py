"""memspec.training.heads: a head on the target's features, trained with torch, run with NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.training.features import to_draft_ids
from memspec.training.heads import Head, HeadConfig, agreement, head_rows

V, H = 40, 16


def synthetic(seed: int, seqs: int = 60, length: int = 30) -> dict[str, np.ndarray]:
    """A features data set whose target writes token t + 1 = (3 t + 1) mod 31 (ids 0..30 of 40),
    with random states: token t + 2 follows from token t + 1, not from the state."""
    rng = np.random.default_rng(seed)
    tops, seq, pos = [], [], []
    for s in range(seqs):
        x = [int(rng.integers(0, 31))]
        for _ in range(length):
            x.append((3 * x[-1] + 1) % 31)
        tops += x[1:]
        seq += [s] * length
        pos += list(range(length))
    vocab = np.arange(31, dtype=np.int32)
    top = np.asarray(tops, dtype=np.int32)
    return {"hidden": rng.standard_normal((len(top), 1, H)).astype(np.float32), "top": top, "next": top,
            "top_draft": to_draft_ids(top, vocab, V), "next_draft": to_draft_ids(top, vocab, V),
            "seq": np.asarray(seq, np.int32), "pos": np.asarray(pos, np.int32), "vocab": vocab,
            "token": np.zeros(len(top), np.int32), "features": np.int32([-1])}


def test_rows_ahead_stay_inside_their_sequence():
    d = {"seq": np.int32([0, 0, 0, 1, 1, 2]), "pos": np.int32([4, 5, 6, 9, 10, 3])}
    assert head_rows(d, 1).tolist() == [0, 1, 2, 3, 4, 5]
    assert head_rows(d, 2).tolist() == [0, 1, 3]
    assert head_rows(d, 3).tolist() == [0]


def test_an_untrained_head_for_the_next_token_is_the_targets_head_cut_to_the_draft_vocabulary():
    rng = np.random.default_rng(0)
    lm = rng.standard_normal((V, H)).astype(np.float32)
    vocab = np.int32([7, 3, 12, 30])
    own = Head(np.zeros((1, H), np.float32), np.zeros(1, np.float32), np.zeros((H, 1), np.float32), lm[vocab], None,
               vocab, V, HeadConfig(ahead=1, hydra=False))
    h = rng.standard_normal((50, H)).astype(np.float32)
    got, p = own.propose(h)
    assert np.array_equal(got, vocab[(h @ lm[vocab].T).argmax(-1)]) and ((0 < p) & (p <= 1)).all()


def test_a_hydra_head_learns_what_the_next_token_tells_and_a_medusa_head_cannot(tmp_path):
    pytest.importorskip("torch")
    from memspec.training.heads import train_head

    train, held = synthetic(1), synthetic(2)
    rng = np.random.default_rng(3)
    emb = rng.standard_normal((V, H)).astype(np.float32)
    lm = rng.standard_normal((V, H)).astype(np.float32)
    cfg = dict(ahead=2, epochs=30, batch=64, lr=3e-3, threads=1)
    hydra, record = train_head(train, emb, lm, HeadConfig(hydra=True, **cfg), V)
    medusa, _ = train_head(train, emb, lm, HeadConfig(hydra=False, **cfg), V)
    assert record["rows"] == 60 * 29
    assert agreement(hydra, held)["agreement"] >= 0.95  # a function of token t + 1
    assert agreement(medusa, held)["agreement"] <= 0.2  # random states hold nothing of it: chance, 1/31
    back = Head.load(hydra.save(tmp_path / "h.npz"))
    assert back.config == hydra.config
    h, n = held["hidden"][:20, -1], held["top"][:20]
    assert np.array_equal(back.logits(h, n), hydra.logits(h, n))
    by = agreement(hydra, held, {s: "even" if s % 2 == 0 else "odd" for s in range(60)})["by_group"]
    assert set(by) == {"even", "odd"}
