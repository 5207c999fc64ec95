"""A draft that speaks its own tokenizer (memspec.speculation.textdraft): the bridge between two
tokenizers by text, its pull, and its proposals verified by the target, output unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from memspec.models.tokenizer import Tokenizer
from memspec.request import SamplingParams
from memspec.speculation.config import DraftLimits, SpecConfig
from memspec.speculation.drafts import DraftModel
from memspec.speculation.metrics import SpecMetrics
from memspec.speculation.speculative import FixedDraft, speculative_steps
from memspec.speculation.textdraft import ANCHOR_GUARD, TextBridge, TextDraft, end_map, load_draft

END = "<|im_end|>"
CORPUS = [
    "The sky is blue because of the scattering of light by the atmosphere. When sunlight passes through "
    "the air, blue light is scattered more than other colors.",
    "def is_palindrome(s):\n    s = s.replace(' ', '').lower()\n    return s == s[::-1]\n",
    "Cats purr for a variety of reasons, but one of the most common is to communicate with their owners.",
    "To solve 12 * 7 + 3, first multiply 12 by 7 to get 84, then add 3 to get 87.",
]


def bpe(vocab_size: int, corpus=CORPUS) -> Tokenizer:
    """A byte-level BPE trained here on `corpus` (two sizes tokenize the same text differently)."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(corpus * 4, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    end = hf.token_to_id(END)
    return Tokenizer(json.loads(hf.to_str()), {"eos_token_id": end, "eos_token_ids": [end]})


@pytest.fixture(scope="module")
def two():
    target, draft = bpe(300), bpe(420)
    bridge = TextBridge(draft, target, end_map(draft, target))
    return target, draft, bridge


def text_of(tok: Tokenizer, ids) -> bytes:
    return b"".join(tok.token_bytes(i) for i in ids)


def test_the_draft_reads_the_same_text_and_its_anchor_keeps_the_encoded_tail_short(two):
    target, draft, bridge = two
    ids = target.encode(" ".join(CORPUS))
    assert target.encode(CORPUS[0]) != draft.encode(CORPUS[0])  # the two really differ
    longest = 0
    for n in range(1, len(ids) + 1):  # the context grows a token at a time, as a request's does
        got = bridge.draft_context(ids[:n])
        assert text_of(draft, got) == text_of(target, ids[:n])
        tail = n - len(bridge.anchor)
        longest = max(longest, len(text_of(target, ids[len(bridge.anchor):n])))
        assert text_of(draft, bridge.anchor_ids) == text_of(target, bridge.anchor)
    assert len(bridge.anchor) > len(ids) - 20 and tail < 20
    assert longest < ANCHOR_GUARD + 40  # each step encodes a few words, not the whole context


def test_a_context_that_goes_back_or_changes_starts_the_anchor_again(two):
    target, draft, bridge = two
    ids = target.encode(CORPUS[0])
    bridge.draft_context(ids)
    assert bridge.anchor
    other = target.encode(CORPUS[2])
    assert text_of(draft, bridge.draft_context(other)) == text_of(target, other)
    short = other[:3]
    assert text_of(draft, bridge.draft_context(short)) == text_of(target, short)


def test_the_drafts_text_becomes_target_tokens_the_last_kept_and_nothing_after_its_end(two):
    """Every token of the draft's text is proposed, the last too: it may be a word the draft stopped
    inside ("scatter" of "scattered"), which the target then rejects for the price of a row; dropping
    it cost SmolLM2 a draft step a step to learn whether the word went on (qa 1.19x -> 1.48x)."""
    target, draft, bridge = two
    words = draft.encode(" blue light is scattered")
    want = target.encode(" blue light is scattered")
    assert bridge.target_tokens(words) == want
    cut = draft.encode(" blue light is scatter")
    assert bridge.target_tokens(cut) == target.encode(" blue light is scatter")  # the target's to reject
    end = draft.eos_token_id
    assert bridge.target_tokens(words + [end, *words]) == want + [target.eos_token_id]  # nothing after the end
    assert bridge.target_tokens([]) == [] and bridge.target_tokens([end]) == [target.eos_token_id]


def test_an_end_the_target_has_no_token_for_ends_the_proposal_with_its_words_whole(two):
    target, draft, _ = two
    other = Tokenizer(json.loads(target.to_json().replace(END, "<|eot|>")),
                      {"eos_token_id": 0, "eos_token_ids": [0]})  # the target's end is not the draft's text
    assert end_map(draft, other) == {}
    bridge = TextBridge(draft, other, end_map(draft, other))
    words = draft.encode(" blue light is scattered")
    assert bridge.target_tokens(words + [draft.eos_token_id]) == other.encode(" blue light is scattered")


# -- with the model --------------------------------------------------------------------------
def smol_text_draft(gguf_path, tok, limits=DraftLimits(p_min=0.0, max_entropy=np.inf, loop_tokens=0, lookup_ngram=0)):
    """SmolLM2 drafting for itself through text: the model runs at every proposal (no copying of
    earlier n-grams, no early stop)."""
    from memspec.runtime.native_target import NativeTarget

    session = NativeTarget(gguf_path, threads=1)
    inner = DraftModel("smol-text", session, np.arange(session.vocab_size), session.vocab_size, limits)
    return TextDraft("smol-text", inner, tok, tok, tok.vocab_size)


@pytest.fixture(scope="module")
def smol(gguf_path, model_store):
    from memspec.runtime.native_target import NativeTarget

    m = model_store.get("smollm2-135m")
    tok = Tokenizer.from_file(m.folder / "tokenizer.json", m.folder / "tokenizer_config.json")
    return NativeTarget(gguf_path, threads=2), tok


def smol_prompt(tok, text):
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_a_text_draft_of_the_target_itself_is_accepted_and_leaves_the_output_unchanged(smol, gguf_path):
    """The target drafting for itself through text: every token the target's own, and nearly every
    drafted token accepted, which holds only where the bridge hands the draft the very context the
    target has (a misaligned one drafts something else; what it may still miss: a text the target
    wrote in other tokens than its tokenizer gives it, which the draft then reads as those)."""
    target, tok = smol
    draft = smol_text_draft(gguf_path, tok)
    for text in ("Why is the sky blue?", "Write a Python function that reverses a list."):
        prompt = smol_prompt(tok, text)
        m = SpecMetrics()
        got = []
        for committed in speculative_steps(target, target.new_cache(len(prompt) + 80), prompt,
                                           FixedDraft("smol-text", draft.begin(len(prompt) + 80)), SamplingParams(),
                                           np.random.default_rng(3), SpecConfig(gamma=4, adaptive=False), m):
            got.extend(committed)
            if len(got) >= 64 or got[-1] in tok.eos_token_ids:
                break
        c = target.new_cache(len(prompt) + 80)
        want = [int(target.forward(c, prompt, keep=1)[-1].argmax())]
        while len(want) < len(got):
            want.append(int(target.forward(c, [want[-1]], keep=1)[-1].argmax()))
        assert got == want
        assert m.num_draft_tokens > 20 and m.num_accepted_tokens / m.num_draft_tokens > 0.9


def test_sampled_proposals_are_one_hot_so_the_sampling_rule_stays_exact(smol, gguf_path):
    """Under sampling the draft still proposes its greedy text; q is one-hot on each proposed token
    (what the speculative-sampling rule accepts exactly: tests/test_speculative.py's chi-square for
    prompt lookup), never the draft's own distribution over ids the target does not share."""
    target, tok = smol
    draft = smol_text_draft(gguf_path, tok)
    prompt = smol_prompt(tok, "Why is the sky blue?")
    state = draft.begin(len(prompt) + 16)
    prop = state.propose(prompt, 4, SamplingParams(temperature=0.8, seed=1), np.random.default_rng(1))
    assert 0 < len(prop.tokens) <= 4 and len(prop.entropy) == len(prop.tokens)
    for i, t in enumerate(prop.tokens):
        assert prop.q.at(i, t) == 1.0
    state.close()


def test_pull_keeps_the_gguf_as_published_with_its_tokenizer_and_the_pool_loads_it(tmp_path, gguf_path, smol):
    import os
    import shutil

    from memspec.errors import ConfigError, ModelNotFoundError
    from memspec.models.pull import pull
    from memspec.models.store import ModelStore
    from memspec.runtime.config import SessionConfig

    store = ModelStore(tmp_path / "home", shipped=None)
    store.downloads_dir.mkdir(parents=True)
    try:  # the base's GGUF already downloaded (pull checks it, and fetches nothing)
        os.link(gguf_path, store.downloads_dir / gguf_path.name)
    except OSError:
        shutil.copyfile(gguf_path, store.downloads_dir / gguf_path.name)
    m = pull(store, "smollm2-135m-draft")
    assert m.role == "draft" and m.extra["tokenizer"] == "own" and m.extra["target"] == "qwen2.5-coder-1.5b"
    assert set(m.tokenizer) == {"tokenizer.json", "tokenizer_config.json"} and set(m.variants) == {"gguf"}
    said = []
    pull(store, "smollm2-135m-draft", progress=said.append)
    assert said == ["smollm2-135m-draft: up to date"]
    with pytest.raises(ModelNotFoundError, match="native engine only; drop --variant"):
        pull(store, "smollm2-135m-draft", ("q4",))
    _, tok = smol  # any target's tokenizer: the draft reads and writes text
    d = load_draft(store, "smollm2-135m-draft", tok.vocab_size, SessionConfig(), DraftLimits(), tok)
    assert isinstance(d, TextDraft) and d.nbytes == m.total_bytes and d.tokenizer.vocab_size == 49152
    with pytest.raises(ConfigError, match="needs the target's tokenizer"):
        load_draft(store, "smollm2-135m-draft", tok.vocab_size, SessionConfig(), DraftLimits())
