"""The native target's features (contracts.FeatureTarget): the hidden states of the rows a pass
keeps, copied out of that pass.  A row's hidden states are the same bit for bit however it is fed
(alone, among draft tokens, beside other sequences' rows, in a tree, at any thread count), they
are the states the model's definition gives, and asking for them changes no logit."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.runtime import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.NOT_BUILT)  # test_native_build.py
V = 64  # the tiny decoders' vocabulary


def open_target(path, threads):
    from memspec.runtime.native_target import NativeTarget

    return NativeTarget(path, threads=threads, max_context=96, check_rows=False)


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    """Tiny llama and qwen2 decoders (4 layers) written as GGUFs, Q8_0 so the matmuls run on blocks."""
    from memspec.models.gguf_write import write_decoder
    from tiny_models import tiny_config, tiny_weights

    d = tmp_path_factory.mktemp("features")
    out = {}
    for arch in ("llama", "qwen2"):
        cfg = tiny_config(vocab=V, layers=4, arch=arch)
        out[arch] = write_decoder(d / f"{arch}.gguf", cfg, tiny_weights(cfg, seed=5, scale=0.5)._tensors, "Q8_0")
    return out


@pytest.fixture(scope="module", params=["smollm2", "tiny-llama", "tiny-qwen2"])
def model(request, tiny_paths):
    """(path, vocabulary, every hidden state's index) of one model."""
    if request.param == "smollm2":
        path = request.getfixturevalue("gguf_path")
        t = open_target(path, 1)
        return path, t.vocab_size, list(range(t.n_layers + 1))
    path = tiny_paths[request.param.split("-")[1]]
    return path, V, list(range(5))


def alone(t, ids, features):
    """Each row of `ids` fed one token at a time: (logits (T, V), hidden (T, F, H))."""
    c = t.new_cache()
    rows = [t.forward(c, [i], features=features) for i in ids]
    return np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])


@pytest.mark.parametrize("threads", [1, 2])
def test_hidden_states_of_verified_rows_are_those_of_the_rows_fed_alone(model, threads):
    """Multi-row, batched and tree passes, at 1 and 2 threads, against one token at a time at 1."""
    path, vocab, every = model
    t, ref_t = open_target(path, threads), open_target(path, 1)
    rng = np.random.default_rng(threads)
    ids = list(map(int, rng.integers(0, vocab, 20)))
    want_logits, want = alone(ref_t, ids, every)
    assert want.shape == (20, len(every), t.hidden_size) and np.isfinite(want).all()
    # a prefill pass of 12 rows, then a verify pass of 8 keeping all of them
    c = t.new_cache()
    logits, hidden = t.forward(c, ids[:12], keep=12, features=every)
    assert np.array_equal(hidden, want[:12]) and np.array_equal(logits, want_logits[:12])
    logits, hidden = t.forward(c, ids[12:], keep=8, features=every)
    assert np.array_equal(hidden, want[12:]) and np.array_equal(logits, want_logits[12:])
    # a batched pass: each sequence at its own length, fed 1..5 tokens, keeping some of its rows
    caches, feeds, keeps, refs = [], [], [], []
    for s in range(4):
        seq = list(map(int, rng.integers(0, vocab, 16)))
        ctx, k = int(rng.integers(1, 11)), int(rng.integers(1, 6))
        c = t.new_cache()
        t.forward(c, seq[:ctx])
        caches.append(c), feeds.append(seq[ctx:ctx + k]), keeps.append(int(rng.integers(1, k + 1)))
        refs.append(alone(ref_t, seq[:ctx + k], every)[1][ctx + k - keeps[-1]:ctx + k])
    for (_, hidden), ref in zip(t.forward_batch(caches, feeds, keeps, features=every), refs):
        assert np.array_equal(hidden, ref)
    # a tree pass: node i's hidden states are those of the chain root .. i after the context
    parents = [-1, 0, 1, 2, 0, 4, 1, 6]
    nodes = list(map(int, rng.integers(0, vocab, len(parents))))
    c = t.new_cache()
    t.forward(c, ids[:7])
    _, hidden = t.forward_tree(c, nodes, parents, features=[-1, 0, 2])
    for i in range(len(parents)):
        chain, a = [], i
        while a >= 0:
            chain.insert(0, nodes[a])
            a = parents[a]
        assert np.array_equal(hidden[i], alone(ref_t, ids[:7] + chain, [every[-1], 0, 2])[1][-1]), i


def test_asking_for_features_changes_no_logit_and_no_cache(gguf_path):
    t = open_target(gguf_path, 2)
    ids = [(31 * i + 7) % t.vocab_size for i in range(24)]
    a, b = t.new_cache(), t.new_cache()
    plain = t.forward(a, ids, keep=24)
    logits, hidden = t.forward(b, ids, keep=24, features=[3, 15, -1])
    assert np.array_equal(plain, logits)
    assert np.array_equal(a.data[:, :, :, :24], b.data[:, :, :, :24]) and a.length == b.length == 24
    assert hidden.shape == (24, 3, t.hidden_size)
    # the head's input is what the logits are made of: the (tied, Q4_1) head applied to it, within
    # the head's 8-bit activations (about 2% of the largest logit here; a state before the final
    # norm misses by hundreds of times the logits)
    from memspec.models.gguf import GGUFModel

    head = GGUFModel(gguf_path).float32("token_embd.weight")
    np.testing.assert_allclose(hidden[:, 2] @ head.T, logits, atol=0.03 * np.abs(logits).max())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hidden_states_are_those_of_the_models_definition(tmp_path, arch):
    """Each numbered state against the float64 reference (an F32 file: only the 8-bit activations and
    the float16 K/V round, about 3e-4 of the largest value); a neighbouring state misses by 0.4 to
    1.5 of it."""
    from llama_reference import ReferenceLlama
    from memspec.models.gguf import GGUFModel
    from memspec.models.gguf_write import write_decoder
    from tiny_models import tiny_config, tiny_weights

    cfg = tiny_config(vocab=V, layers=3, arch=arch)
    path = write_decoder(tmp_path / "d.gguf", cfg, tiny_weights(cfg, seed=6)._tensors, "F32")
    ids = [3, 17, 5, 60, 1, 9, 33]
    want = ReferenceLlama(GGUFModel(path)).hidden_states(ids)
    t = open_target(path, 1)
    _, hidden = t.forward(t.new_cache(), ids, keep=len(ids), features=[0, 1, 2, 3])
    for i in range(4):
        scale = np.abs(want[i]).max()
        np.testing.assert_allclose(hidden[:, i], want[i], atol=5e-3 * scale, err_msg=f"hidden state {i}")
    assert np.array_equal(hidden[:, 0], GGUFModel(path).float32("token_embd.weight")[ids])


def test_bad_feature_indices_are_refused_and_the_target_keeps_working(gguf_path):
    t = open_target(gguf_path, 1)
    c = t.new_cache()
    for bad in ([], [t.n_layers + 1], [-(t.n_layers + 2)]):
        with pytest.raises(ValueError, match="hidden states"):
            t.forward(c, [1, 2], features=bad)
    assert c.length == 0
    with pytest.raises(ValueError, match="feature index"):  # the extension's own check
        t.model.forward([c.data], [c.capacity], np.int32([1]), np.int32([0]), np.int32([0]), np.int32([0]),
                        np.empty((1, t.vocab_size), np.float32), None, np.empty((1, t.hidden_size), np.float32),
                        np.int32([t.n_layers + 1]))
    with pytest.raises(ValueError, match="both or neither"):
        t.model.forward([c.data], [c.capacity], np.int32([1]), np.int32([0]), np.int32([0]), np.int32([0]),
                        np.empty((1, t.vocab_size), np.float32), None, None, np.int32([1]))
    assert np.array_equal(t.forward(c, [1, 2], keep=2), open_target(gguf_path, 1).forward(t.new_cache(), [1, 2], keep=2))


def test_only_the_native_engine_says_it_has_features():
    from memspec.runtime.native_target import NativeTarget
    from memspec.runtime.sessions import DecoderSession
    from memspec.speculation.batching import Slot

    assert NativeTarget.features and not DecoderSession.features and not Slot.features
