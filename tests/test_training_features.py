"""memspec.training.features: the target's own answers teacher-forced in prefill chunks give, per
answer position, the target's hidden states and its next token, with a draft vocabulary cut to the
tokens the answers use."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.runtime import kernels
from memspec.training.features import draft_vocabulary, extract_features, load_features, save_features, to_draft_ids

TEXTS = ["Write a haiku about the sea.", "What is 17 times 3?", "Name three uses of a hash map.",
         "Translate 'good morning' into French."]


def test_the_draft_vocabulary_is_the_fewest_most_used_tokens_that_cover_the_share():
    answers = [[5, 5, 5, 5, 7, 7, 9], [5, 7, 3]]  # 5: 5 of 10, 7: 3, 9: 1, 3: 1
    assert draft_vocabulary(answers, 12, coverage=0.5).tolist() == [5]
    assert draft_vocabulary(answers, 12, coverage=0.8).tolist() == [5, 7]
    assert draft_vocabulary(answers, 12, coverage=0.9).tolist() == [5, 7, 3]  # a tie: the lower id first
    assert draft_vocabulary(answers, 12, coverage=1.0).tolist() == [5, 7, 3, 9]
    assert draft_vocabulary(answers, 12, coverage=0.5, required=[11, 5]).tolist() == [11, 5]
    assert draft_vocabulary(answers, 12, coverage=0.8, size=5).tolist() == [5, 7, 0, 1, 2]  # then the lowest ids
    assert to_draft_ids(np.array([7, 9, 5]), np.array([5, 7], np.int32), 12).tolist() == [1, -1, 0]
    with pytest.raises(ValueError, match="coverage"):
        draft_vocabulary(answers, 12, coverage=0)


@pytest.mark.skipif(not kernels.available(), reason=kernels.NOT_BUILT)
def test_features_of_the_targets_answers_are_the_rows_it_serves(gguf_path, tmp_path):
    from memspec.models.tokenizer import Tokenizer
    from memspec.runtime.native_target import NativeTarget
    from memspec.training.teacher import NativeTeacher

    tok = Tokenizer.from_gguf(gguf_path)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in TEXTS]
    records = NativeTeacher(gguf_path, threads=1, batch=4).answers(prompts, 20, tok.eos_token_id)
    seqs = [(r["prompt"], r["answer"]) for r in records]
    vocab = draft_vocabulary([a for _, a in seqs], tok.vocab_size, coverage=0.9)
    t = NativeTarget(gguf_path, threads=2, check_rows=False)
    data = extract_features(t, seqs, vocab, features=(8, -1), chunk=16)  # prompts span several chunks
    n = sum(len(a) for _, a in seqs)  # one row per answer token
    assert data["hidden"].shape == (n, 2, t.hidden_size) and data["features"].tolist() == [8, t.n_layers]
    assert data["next"].tolist() == [x for _, a in seqs for x in a]
    assert np.array_equal(data["top"], data["next"])  # the target's own greedy answers
    assert data["pos"].tolist() == [p for pr, a in seqs for p in range(len(pr) - 1, len(pr) + len(a) - 1)]
    assert data["token"].tolist() == [x for pr, a in seqs for x in (pr + a)[len(pr) - 1:-1]]
    covered = data["next_draft"] >= 0
    assert covered.mean() >= 0.9 and np.array_equal(vocab[data["next_draft"][covered]], data["next"][covered])
    # each row's states are those the target computes serving it: the sequence fed one token at a time
    s = 2
    prompt, answer = seqs[s]
    c = t.new_cache()
    t.forward(c, prompt[:-1])
    alone = np.concatenate([t.forward(c, [x], features=(8, -1))[1] for x in (prompt + answer)[len(prompt) - 1:-1]])
    assert np.array_equal(data["hidden"][data["seq"] == s], alone)
    back = load_features(save_features(tmp_path / "f.npz", data))
    assert back.keys() == data.keys() and all(np.array_equal(back[k], data[k]) for k in data)


def test_an_onnx_target_is_refused_by_its_own_word(tmp_path):
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.sessions import DecoderSession
    from tiny_models import build_tiny

    onnx = DecoderSession(build_tiny(tmp_path / "t.onnx", seed=1), SessionConfig(max_context=32, intra_op_threads=1))
    with pytest.raises(ValueError, match="native engine"):
        extract_features(onnx, [([1], [2])], np.array([2], np.int32))
