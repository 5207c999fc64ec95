"""Teacher-forced features: what a draft that reads the target (EAGLE, Medusa, Hydra) learns from.

    vocab = draft_vocabulary([s.answer for s in seqs], target.vocab_size, coverage=0.99)
    data = extract_features(target, [(prompt, answer), ...], vocab, features=(-1,))
    save_features(path, data)                                   # one .npz
    data = load_features(path)

Each (prompt, answer) is fed as one sequence, in prefill chunks (`chunk` rows a pass, as a long
prompt is), and the pass hands back the hidden states of the rows it keeps
(contracts.FeatureTarget): no extra pass, and each row's states are the same bits the target
computes when it serves that row.  A kept row is one that predicts an answer token: the prompt's
last token and every answer token but the last.  The answers are the target's own (NativeTeacher
in memspec.training.teacher), so each row's next token is also the target's greedy choice there;
`top` keeps that choice as the pass saw it, so a sequence that is not the target's own answer
still gives the target's tokens to learn.

The draft vocabulary is cut to the tokens the target actually writes: the answers' tokens by
frequency, as few as cover `coverage` of their occurrences (EAGLE-3 maps a draft vocabulary of
about 32k onto the target's).  A draft proposes only ids in it; `next_draft` and `top_draft` are
the labels in draft ids, -1 where the token is outside it.

The arrays of a data set (N rows, F hidden states of width H, Vd draft ids):
    hidden      (N, F, H) float32   the rows' hidden states, numbered as `features` says
    token       (N,) int32          the token each row fed
    next        (N,) int32          the sequence's next token (the answer's)
    top         (N,) int32          the target's greedy token at the row (argmax of its logits)
    seq, pos    (N,) int32          the row's sequence (its index in the input) and position
    next_draft, top_draft (N,) int32  next and top as draft ids (-1: outside the vocabulary)
    vocab       (Vd,) int32         draft id -> target id, most frequent first
    features    (F,) int32          the hidden states' indices (FeatureTarget's numbering)
Rows of a sequence are consecutive and in position order: row i + 1 of the same sequence is the
next position, so labels further ahead (Medusa's t + 2, ...) are `next` of the rows after.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import numpy as np

from memspec.training import log

CHUNK = 128  # rows a prefill pass feeds
COVERAGE = 0.99  # share of the answers' token occurrences the draft vocabulary covers


def draft_vocabulary(answers: Sequence[Sequence[int]], vocab: int, coverage: float = COVERAGE,
                     required: Sequence[int] = (), size: int = 0) -> np.ndarray:
    """Target ids of a draft vocabulary: `required` ids first (an end-of-sequence id, say), then the
    answers' tokens by count (ties: the lower id), as few as cover `coverage` of all occurrences;
    then, up to `size` ids in all, the lowest ids not yet in it (a BPE tokenizer merged them first:
    its corpus's commonest), for the tokens a small set of answers never showed.
    (Vd,) int32; its index is the draft id."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    counts = np.zeros(vocab, dtype=np.int64)
    for a in answers:
        np.add.at(counts, np.asarray(a, dtype=np.int64), 1)
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no answer tokens to count")
    order = np.lexsort((np.arange(vocab), -counts))
    order = order[counts[order] > 0]
    n = int(np.searchsorted(np.cumsum(counts[order]), coverage * total - 1e-9)) + 1  # first n reaching it
    head = [int(i) for i in dict.fromkeys(int(r) for r in required)]
    ids = head + [int(i) for i in order[:n] if int(i) not in set(head)]
    if len(ids) < size:
        taken = set(ids)
        ids += [i for i in range(vocab) if i not in taken][:size - len(ids)]
    return np.asarray(ids, dtype=np.int32)


def to_draft_ids(ids: np.ndarray, vocab: np.ndarray, target_vocab: int) -> np.ndarray:
    """Target ids as draft ids (-1 where outside the draft vocabulary)."""
    table = np.full(target_vocab, -1, dtype=np.int32)
    table[vocab] = np.arange(len(vocab), dtype=np.int32)
    return table[np.asarray(ids, dtype=np.int64)]


def extract_features(target, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], vocab: np.ndarray,
                     features: Sequence[int] = (-1,), chunk: int = CHUNK) -> dict[str, np.ndarray]:
    """The data set of (prompt, answer) pairs on `target` (a contracts.FeatureTarget, its
    `features` True), teacher-forced in passes of up to `chunk` rows; the arrays the module's
    docstring lists."""
    if not target.features:  # the contract's own word (an ONNX target says False)
        raise ValueError(f"{target.providers[0]} hands over no hidden states: features need the native engine")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    index = target.feature_index(features)
    cols: dict[str, list] = {k: [] for k in ("hidden", "token", "next", "top", "seq", "pos")}
    t0, rows = time.perf_counter(), 0
    for s, (prompt, answer) in enumerate(sequences):
        prompt, answer = list(prompt), list(answer)
        if not prompt or not answer:
            raise ValueError(f"sequence {s}: a prompt and an answer of one or more tokens each, got "
                             f"{len(prompt)} and {len(answer)}")
        fed = prompt + answer[:-1]  # the answer's last token predicts nothing we know
        first = len(prompt) - 1  # the first row that predicts an answer token
        cache = target.new_cache(len(fed))
        for at in range(0, len(fed), chunk):
            part = fed[at:at + chunk]
            keep = min(len(part), at + len(part) - first)  # this chunk's rows from `first` on
            if keep <= 0:
                target.forward(cache, part)
                continue
            logits, hidden = target.forward(cache, part, keep=keep, features=index)
            lo = at + len(part) - keep
            cols["hidden"].append(hidden)
            cols["token"].append(np.asarray(fed[lo:at + len(part)], dtype=np.int32))
            cols["next"].append(np.asarray((prompt + answer)[lo + 1:at + len(part) + 1], dtype=np.int32))
            cols["top"].append(logits.argmax(-1).astype(np.int32))
            cols["seq"].append(np.full(keep, s, dtype=np.int32))
            cols["pos"].append(np.arange(lo, at + len(part), dtype=np.int32))
        rows += len(fed)
    seconds = time.perf_counter() - t0
    log(f"features: {len(sequences)} sequences, {rows} rows fed in {seconds:.1f} s ({rows / max(seconds, 1e-9):.0f} "
        f"rows/s)")
    out = {k: np.concatenate(v) for k, v in cols.items()}
    out["next_draft"] = to_draft_ids(out["next"], vocab, target.vocab_size)
    out["top_draft"] = to_draft_ids(out["top"], vocab, target.vocab_size)
    out["vocab"] = np.asarray(vocab, dtype=np.int32)
    out["features"] = index
    return out


def save_features(path: Path, data: dict[str, np.ndarray]) -> Path:
    """One .npz, written whole or not at all."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        np.savez(f, **data)
    partial.replace(path)
    return path


def load_features(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}
