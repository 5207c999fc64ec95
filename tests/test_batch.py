"""The ragged batched graph (memspec.runtime.batch): every row's logits are its solo logits."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.errors import ContextOverflowError, ModelFormatError
from memspec.runtime.batch import BatchedTarget
from memspec.runtime.config import SessionConfig
from memspec.runtime.sessions import DecoderSession
from tiny_models import build_tiny


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-unpadded"])
def tiny(request, tmp_path_factory):
    """Graphs that pad a one-token pass's attention themselves (the converter's), and one that does
    not, whose one-token passes the session pads to two tokens (min_rows=2) and the batch too."""
    arch, _, unpadded = request.param.partition("-")
    path = build_tiny(tmp_path_factory.mktemp("batch") / "m.onnx", seed=5, vocab=96, arch=arch,
                      pad_attention=not unpadded)
    sess = DecoderSession(path, SessionConfig(max_context=96, intra_op_threads=1), min_rows=2)
    assert sess.graph_pads == (not unpadded) and sess.pad_rows == (2 if unpadded else 1)
    return sess


def _solo(sess, ctx, feed):
    c = sess.new_cache()
    sess.forward(c, ctx, keep=1)
    return sess.forward(c, feed, keep=len(feed))


def test_rows_equal_solo_bit_for_bit_in_any_batch(tiny):
    bt = BatchedTarget(tiny, rows=3)
    rng = np.random.default_rng(1)
    for _ in range(6):
        b = int(rng.integers(1, 4))
        ctxs = [list(map(int, rng.integers(0, 96, int(rng.integers(1, 40))))) for _ in range(b)]
        feeds = [list(map(int, rng.integers(0, 96, int(rng.integers(1, 7))))) for _ in range(b)]
        caches = [tiny.new_cache() for _ in range(b)]
        for c, ctx in zip(caches, ctxs):
            tiny.forward(c, ctx, keep=1)
        keep = [len(f) for f in feeds]
        out = bt.forward(caches, feeds, keep)
        for c, ctx, feed, got in zip(caches, ctxs, feeds, out):
            assert c.length == len(ctx) + len(feed)  # padding is not committed
            np.testing.assert_array_equal(got, _solo(tiny, ctx, feed))


def test_spare_slots_feed_no_token(tiny, monkeypatch):
    """A pass with fewer rows than slots runs the token-wise nodes over the real rows' tokens only
    (a spare slot used to feed a dummy token through every matrix); the rows stay bit-exact."""
    bt = BatchedTarget(tiny, rows=4)
    fed = {}
    bind = bt._binding.bind_cpu_input
    monkeypatch.setattr(bt._binding, "bind_cpu_input", lambda name, arr: (fed.__setitem__(name, arr), bind(name, arr)))
    a, b = tiny.new_cache(), tiny.new_cache()
    tiny.forward(a, [1, 2, 3], keep=1)
    tiny.forward(b, [4, 5], keep=1)
    out = bt.forward([a, b], [[6], [7, 8]], [1, 2])
    first = max(1, tiny.pad_rows)  # an unpadded graph's one-token row is padded on the host
    assert fed["input_ids"].shape == (1, first + 2)
    assert list(fed["row_sizes"]) == [2, 2, 1, 1]  # the one-token row with its copy (either way), spares 1
    assert list(fed["qkv_index"][-2:]) == [first + 1] * 2  # a spare row's attention reads the last token
    np.testing.assert_array_equal(out[0], _solo(tiny, [1, 2, 3], [6]))
    np.testing.assert_array_equal(out[1], _solo(tiny, [4, 5], [7, 8]))


def test_rollback_then_next_pass_matches_solo(tiny):
    """A rejected tail is rolled back by truncation; the next pass overwrites it, as alone."""
    bt = BatchedTarget(tiny, rows=2)
    a, b = tiny.new_cache(), tiny.new_cache()
    tiny.forward(a, [1, 2, 3], keep=1)
    tiny.forward(b, [4, 5, 6, 7, 8], keep=1)
    bt.forward([a, b], [[9, 10, 11], [12]], [3, 1])
    a.truncate(4)  # keep only 9
    got = bt.forward([b, a], [[13, 14], [15, 16]], [2, 1])
    np.testing.assert_array_equal(got[0], _solo(tiny, [4, 5, 6, 7, 8, 12], [13, 14]))
    np.testing.assert_array_equal(got[1], _solo(tiny, [1, 2, 3, 9], [15, 16])[-1:])


def test_keep_selects_the_last_rows_of_each_feed(tiny):
    bt = BatchedTarget(tiny, rows=2)
    a, b = tiny.new_cache(), tiny.new_cache()
    out = bt.forward([a, b], [[1, 2, 3, 4], [5, 6]], [1, 2])
    assert [o.shape[0] for o in out] == [1, 2]
    np.testing.assert_array_equal(out[0], tiny.forward(tiny.new_cache(), [1, 2, 3, 4], keep=1))


def test_bad_inputs_are_clear_errors(tiny):
    bt = BatchedTarget(tiny, rows=2)
    c = tiny.new_cache()
    with pytest.raises(ValueError, match="1..2 rows"):
        bt.forward([c, c, c], [[1], [2], [3]], [1, 1, 1])
    with pytest.raises(ValueError, match="at least one token"):
        bt.forward([c], [[]], [1])
    with pytest.raises(ContextOverflowError, match="capacity 96"):
        bt.forward([c], [list(range(97))], [1])
    with pytest.raises(ValueError, match="rows: 0 is out of range"):
        BatchedTarget(tiny, rows=0)


def test_a_growing_layout_is_refused(tmp_path):
    import onnx

    path = build_tiny(tmp_path / "m.onnx", seed=1, vocab=32)
    m = onnx.load(str(path))
    del m.metadata_props[:]  # no memspec.kv_layout: a growing cache
    onnx.save(m, str(tmp_path / "g.onnx"))
    with pytest.raises(ModelFormatError, match="memspec-converted"):
        BatchedTarget(DecoderSession(tmp_path / "g.onnx", SessionConfig(max_context=32)), rows=2)


def test_one_token_rows_are_padded_inside_the_ragged_graph(tiny):
    """On a padded graph the batched graph keeps no solo padding nodes, and a one-token row next to
    longer rows writes its copy row's K/V into its cache's slack slot, as its solo pass does."""
    import onnx

    from memspec.runtime.batch import ragged_graph

    names = [n.name for n in ragged_graph(onnx.load(str(tiny.path)), 2).graph.node]
    assert not any(n.startswith("/model/pad/") or n.endswith(("/PadRow", "/PadConcat", "/Unpad")) for n in names)
    layers = sum(n.endswith("/qkv_rows") for n in names)  # one Gather and one Split per layer, not per row
    assert layers and sum(n.endswith("/rows") for n in names) == layers
    bt = BatchedTarget(tiny, rows=3)
    a, b, c = tiny.new_cache(), tiny.new_cache(), tiny.new_cache()
    for cache, ctx in ((a, [1, 2, 3]), (b, [4, 5]), (c, [6, 7, 8, 9])):
        tiny.forward(cache, ctx, keep=1)
    out = bt.forward([a, b, c], [[10], [11, 12, 13], [14]], [1, 3, 1])
    np.testing.assert_array_equal(out[0], _solo(tiny, [1, 2, 3], [10]))
    np.testing.assert_array_equal(out[1], _solo(tiny, [4, 5], [11, 12, 13]))
    np.testing.assert_array_equal(out[2], _solo(tiny, [6, 7, 8, 9], [14]))
    assert (a.length, b.length, c.length) == (4, 5, 5)
    assert a.buffers[0].shape()[2] == a.capacity + tiny.graph_pads  # the copy row's slot


def test_release_unbinds_a_finished_cache(tiny):
    bt = BatchedTarget(tiny, rows=2)
    a, b = tiny.new_cache(), tiny.new_cache()
    bt.forward([a, b], [[1, 2], [3, 4]], [1, 1])
    bt.release(a)
    assert all(x is not a for x in bt._bound)


@pytest.mark.parametrize("variant", ["q4", "fp32"])
def test_real_target_rows_are_batch_invariant(model_store, variant):
    """SmolLM2: a row's logits in a batch of 1..3 are its solo logits, bit for bit (so greedy output
    under batching is token for token the solo output, and sampling sees the same distribution)."""
    sess = DecoderSession(model_store.get("smollm2-135m").variant_path(variant),
                          SessionConfig(max_context=160, intra_op_threads=2), min_rows=2, check_rows=True)
    assert sess.rows.exact, sess.rows  # as the target loads: padded to two rows where one row rounds apart
    bt = BatchedTarget(sess, rows=3)
    rng = np.random.default_rng(7)
    ctxs = [list(map(int, rng.integers(100, 40000, int(rng.integers(5, 90))))) for _ in range(3)]
    feeds = [list(map(int, rng.integers(100, 40000, k))) for k in (1, 4, 6)]
    for b in (1, 2, 3):
        caches = [sess.new_cache() for _ in range(b)]
        for c, ctx in zip(caches, ctxs):
            sess.forward(c, ctx, keep=1)
        out = bt.forward(caches, feeds[:b], [len(f) for f in feeds[:b]])
        for ctx, feed, got in zip(ctxs, feeds, out):
            np.testing.assert_array_equal(got, _solo(sess, ctx, feed))


def test_the_batched_graph_leaves_no_file_behind(tiny):
    """It is written beside the target to be loaded from a file, and removed once loaded."""
    before = sorted(p.name for p in tiny.path.parent.iterdir())
    BatchedTarget(tiny, rows=2)
    assert sorted(p.name for p in tiny.path.parent.iterdir()) == before


def test_an_unwritable_store_is_a_clear_error(tiny, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tiny.path.parent))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(ModelFormatError, match="cannot write the batched graph beside"):
        BatchedTarget(tiny, rows=2)


def test_a_folder_left_by_a_killed_load_is_swept(tiny):
    """A process killed while loading leaves its `.batched-*` folder (the weights, for the 1.5B 1.5
    GB) beside the target; the next load removes one that old, and never a fresh one (another
    process may be loading from it)."""
    import os
    import time

    old, fresh = tiny.path.parent / ".batched-old", tiny.path.parent / ".batched-fresh"
    for d in (old, fresh):
        d.mkdir()
        (d / "weights.bin").write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    try:
        BatchedTarget(tiny, rows=2)
        assert not old.exists() and fresh.exists()
    finally:
        import shutil

        shutil.rmtree(fresh, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
