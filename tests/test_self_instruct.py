"""Prompts the target writes itself (memspec.training.self_instruct, `memspec write-prompts`):
nucleus sampling, the native teacher's sampled texts, cleaning, and the file train-draft reads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memspec.training.prompts import near_measured
from memspec.training.self_instruct import (PASSAGE_TASKS, REQUEST_KINDS, clean, clean_passage, meta_passages,
                                            meta_requests, write_prompts)
from memspec.training.teacher import nucleus


def test_nucleus_draws_from_the_softmax_within_its_top_p():
    """Draws follow softmax(logits / T) renormalised over the nucleus: with top_p 1 every id comes
    as often as its probability says, with a smaller top_p only the ids of the nucleus come, and a
    top_p under the best id's probability is greedy."""
    logits = np.log(np.array([[0.5, 0.05, 0.3, 0.15]], dtype=np.float32))
    rng = [np.random.default_rng(7)]
    n = 6000
    counts = np.bincount([nucleus(logits, 1.0, 1.0, rng)[0] for _ in range(n)], minlength=4) / n
    assert np.allclose(counts, [0.5, 0.05, 0.3, 0.15], atol=0.025)
    inner = {nucleus(logits, 1.0, 0.75, rng)[0] for _ in range(500)}
    assert inner == {0, 2}  # 0.5 + 0.3 reach 0.75; 0.15 and 0.05 are outside
    assert {nucleus(logits, 1.0, 0.1, rng)[0] for _ in range(50)} == {0}
    hot = np.bincount([nucleus(logits, 4.0, 1.0, rng)[0] for _ in range(n)], minlength=4) / n
    assert hot[1] > 0.12  # a high temperature flattens: 0.05 -> about 0.17
    capped = {nucleus(logits, 1.0, 1.0, rng, cap=2)[0] for _ in range(500)}
    assert capped == {0, 2}


def test_nucleus_rows_draw_with_their_own_generators():
    logits = np.zeros((3, 50), dtype=np.float32)
    a = nucleus(logits, 1.0, 1.0, [np.random.default_rng(s) for s in (1, 2, 3)])
    b = nucleus(logits[1:], 1.0, 1.0, [np.random.default_rng(s) for s in (2, 3)])
    assert a[1:] == b


def test_sampled_texts_are_reproducible_whatever_the_batch_and_greedy_at_a_tiny_top_p(gguf_path):
    """Regression guard: prompt i's text depends on the prompt, the settings and (seed, i) only,
    so batching them differently changes nothing; a different seed writes something else; and a
    nucleus narrower than the best token is the target's greedy answer."""
    from memspec.training.teacher import NativeTeacher

    prompts = [[1, 9690, 198, 2683, 314, 253, 5356], [1, 4093, 198, 17361, 597, 30], [1, 504, 3056]]
    one = NativeTeacher(gguf_path, threads=1, batch=1)
    three = NativeTeacher(gguf_path, threads=1, batch=3)
    texts = one.sample(prompts, 12, 2, temperature=1.0, top_p=0.95, seed=5)
    assert texts == three.sample(prompts, 12, 2, temperature=1.0, top_p=0.95, seed=5)
    assert all(0 < len(t) <= 12 and 2 not in t for t in texts)
    assert texts != three.sample(prompts, 12, 2, temperature=1.0, top_p=0.95, seed=6)
    greedy = [r["answer"] for r in three.answers(prompts, 12, 2)]
    assert three.sample(prompts, 12, 2, temperature=1.0, top_p=1e-6, seed=0) == [g[:-1] if g[-1] == 2 else g
                                                                                  for g in greedy]
    with pytest.raises(ValueError, match="temperature"):
        three.sample(prompts, 4, 2, temperature=0.0)


@pytest.mark.parametrize("raw, want", [
    ('Sure! Here is a message:\n"How do bees make honey?"', "How do bees make honey?"),
    ('"Can you write a haiku about rain?"\n\nThis message asks for a poem.', "Can you write a haiku about rain?"),
    ("Message from Alice: What should I pack for Lisbon in March?", "What should I pack for Lisbon in March?"),
    ("How can I keep basil alive indoors?", "How can I keep basil alive indoors?"),
    ("Sure, you can ask the AI to summarize a paragraph.", None),
    ("Hi!", None),
])
def test_clean_keeps_the_message_and_drops_remarks(raw, want):
    assert clean(raw) == want


def test_clean_passage_wants_a_paragraph():
    body = " ".join(["Rivers carry water and soil from the hills to the sea."] * 4)
    assert clean_passage(f"Sure! Here is the text:\n{body}") == body
    assert clean_passage("Title: Rivers\n\n" + body) == body
    assert clean_passage("Too short to summarize.") is None


def test_meta_instructions_cover_every_category_and_repeat_with_the_seed():
    import random

    reqs = meta_requests(30, random.Random(1))
    assert [c for c, _ in reqs[:4]] == ["chat", "creative", "qa", "chat"]  # the default kinds, in turn
    assert {c for c, _ in meta_requests(30, random.Random(1), REQUEST_KINDS)} == set(REQUEST_KINDS)
    code = meta_requests(4, random.Random(1), ["code", "math"])
    assert [c for c, _ in code] == ["code", "math", "code", "math"]
    assert all(any(k.split("{s}")[0] in m for k in REQUEST_KINDS[c]) for c, m in code)  # a kind of its category
    assert reqs == meta_requests(30, random.Random(1)) and reqs != meta_requests(30, random.Random(2))
    assert all("{s}" not in m for _, m in reqs) and len(meta_passages(5, random.Random(1))) == 5


def test_written_prompts_are_kept_apart_from_the_benchmarks(gguf_path, model_store):
    """The real teacher (SmolLM2 here) writes the prompts: each comes with a known category, none
    twice, none a measured prompt or a near copy of one."""
    from memspec.models.tokenizer import Tokenizer
    from memspec.training.teacher import NativeTeacher

    folder = model_store.get("smollm2-135m").folder
    tok = Tokenizer.from_file(folder / "tokenizer.json", folder / "tokenizer_config.json")
    rows = write_prompts(NativeTeacher(gguf_path, threads=1, batch=8), tok, set(tok.eos_token_ids) | {2}, 6, 4,
                         seed=3)
    near = near_measured()
    assert rows and len({r["prompt"] for r in rows}) == len(rows)
    for r in rows:
        assert r["category"] in set(REQUEST_KINDS) | set(PASSAGE_TASKS)
        assert not near(r["prompt"])
        if r["category"] in PASSAGE_TASKS:
            assert any(r["prompt"].startswith(task) for task in PASSAGE_TASKS[r["category"]])
    json.dumps(rows)


@pytest.mark.parametrize("flags, message", [
    (["--requests", "0", "--passages", "0"], "not both 0"),
    (["--temperature", "0"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
])
def test_write_prompts_refuses_bad_settings_with_a_message(flags, message, tmp_path, capsys):
    from memspec.cli import main

    assert main(["write-prompts", "--out", str(tmp_path / "p.jsonl"), *flags]) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p.jsonl").exists()


def test_write_prompts_names_the_kinds_it_knows(tmp_path, capsys):
    from memspec.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["write-prompts", "--out", str(tmp_path / "p.jsonl"), "--kinds", "poetry"])
    assert exc.value.code == 2
    assert "invalid choice: 'poetry' (choose from 'chat', 'code', 'creative', 'math', 'qa')" in capsys.readouterr().err
