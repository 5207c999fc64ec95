"""memspec.models.gguf_write: a decoder written as a GGUF reads back as it was written, and both
engines run it as the reference forward pass does (the Q/K row order llama's GGUF permutes)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from memspec.models.gguf import GGUFModel
from memspec.models.gguf_write import gguf_row_order, write_decoder
from tiny_models import tiny_config, tiny_weights


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_round_trip_is_exact(tmp_path, arch):
    cfg = tiny_config(vocab=64, arch=arch)
    w = tiny_weights(cfg, seed=1)._tensors
    path = write_decoder(tmp_path / "d.gguf", cfg, w, "F32", name="tiny")
    m = GGUFModel(path)
    assert m.config == dataclasses.replace(cfg, rms_eps=float(np.float32(cfg.rms_eps)))  # stored as float32
    for name, t in w.items():  # llama's Q/K rows come back un-permuted: the permutation's inverse
        np.testing.assert_array_equal(m.float32(name), t.astype(np.float32), err_msg=name)
    assert not (tmp_path / "d.gguf.partial").exists()


def test_llama_q_rows_are_permuted_in_the_file():
    cfg = tiny_config(vocab=64, arch="llama")
    order = gguf_row_order("blk.0.attn_q.weight", cfg, cfg.n_heads * cfg.head_dim)
    half = cfg.head_dim // 2
    assert order[:4].tolist() == [0, half, 1, half + 1]  # each head's rotary halves interleaved
    assert sorted(order.tolist()) == list(range(cfg.n_heads * cfg.head_dim))
    assert gguf_row_order("blk.0.attn_v.weight", cfg, 32) is None
    assert gguf_row_order("blk.0.attn_q.weight", tiny_config(arch="qwen2"), 64) is None


# Q8_0: d = amax/127, half a step; Q4_0: d = (the signed weight of largest magnitude)/-8 and q in
# -8..7, so a weight of the other sign near amax clips to 7: up to one step
@pytest.mark.parametrize("qtype,step,steps", [("Q8_0", 127, 0.5), ("Q4_0", 8, 1.0)])
def test_blocks_reconstruct_within_their_rounding(tmp_path, qtype, step, steps):
    cfg = tiny_config(vocab=64)
    w = tiny_weights(cfg, seed=2)._tensors
    m = GGUFModel(write_decoder(tmp_path / "d.gguf", cfg, w, qtype))
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight"):
        assert m.qtype(name) == qtype
        x = w[name].astype(np.float32)
        d = np.abs(x.reshape(x.shape[0], -1, 32)).max(-1, keepdims=True) / step
        err = np.abs(m.float32(name).reshape(d.shape[0], -1, 32) - x.reshape(d.shape[0], -1, 32))
        # the rounding, plus the float16 scale's (relative 2^-11) times the largest |q|
        assert np.all(err <= d * (steps + step * 2.0 ** -11) + 1e-6), name
    assert m.qtype("blk.0.attn_norm.weight") == "F32"


def test_unknown_type_and_architecture_are_refused(tmp_path):
    cfg = tiny_config()
    w = tiny_weights(cfg, seed=0)._tensors
    with pytest.raises(ValueError, match="Q2_K"):
        write_decoder(tmp_path / "d.gguf", cfg, w, "Q2_K")
    with pytest.raises(ValueError, match="gemma"):
        write_decoder(tmp_path / "d.gguf", dataclasses.replace(cfg, arch="gemma"), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_engine_runs_the_written_file_as_the_reference(tmp_path, arch):
    from llama_reference import ReferenceLlama
    from memspec.runtime import kernels

    if not kernels.available():
        pytest.skip(kernels.NOT_BUILT)
    from memspec.runtime.native_target import NativeTarget

    cfg = tiny_config(vocab=64, arch=arch)
    path = write_decoder(tmp_path / "d.gguf", cfg, tiny_weights(cfg, seed=4)._tensors, "F32")
    ids = [3, 17, 5, 60, 1, 9]
    want = ReferenceLlama(GGUFModel(path)).logits(ids)
    t = NativeTarget(path, threads=1, max_context=32, check_rows=False)
    got = t.forward(t.new_cache(), ids, keep=len(ids))
    assert not t.rows.checked
    # float16 K/V round at about 1e-3 relative; a wrong Q/K row order would miss by whole units
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-2)
    assert (got.argmax(-1) == want.argmax(-1)).all()
