"""The converted target in ONNX Runtime: exactness, multi-token steps, rollback."""

from __future__ import annotations

import numpy as np
import pytest

from memspec.errors import ContextOverflowError, ModelFormatError
from memspec.runtime.config import SessionConfig
from memspec.runtime.plan import variant_for
from memspec.runtime.sessions import DecoderSession

# A chat-formatted prompt and the start of its answer (greedy fp32 output).
IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
       19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531,
       198, 504, 3575, 282, 4649, 314, 7042, 30]


@pytest.fixture(scope="module")
def reference_logits(gguf_model):
    from llama_reference import ReferenceLlama

    return ReferenceLlama(gguf_model).logits(IDS)


@pytest.fixture(scope="module", params=["fp32", "q4"])
def session(request, model_store):
    path = model_store.get("smollm2-135m").variant_path(request.param)
    return request.param, DecoderSession(path, SessionConfig(max_context=128, intra_op_threads=2))


def test_fp32_matches_float64_reference(model_store, reference_logits):
    s = DecoderSession(model_store.get("smollm2-135m").variant_path("fp32"), SessionConfig(max_context=64))
    out = s.forward(s.new_cache(), IDS, keep=len(IDS))
    assert out.shape == reference_logits.shape
    err = np.abs(out - reference_logits).max()
    assert err < 1e-3, f"fp32 differs from the float64 reference by {err}"
    assert (out.argmax(-1) == reference_logits.argmax(-1)).all()


def test_q4_close_to_reference(model_store, reference_logits):
    s = DecoderSession(model_store.get("smollm2-135m").variant_path("q4"), SessionConfig(max_context=64))
    out = s.forward(s.new_cache(), IDS, keep=len(IDS))
    # int8 activations (accuracy_level 4) move logits a little; the weights are the GGUF's own.
    assert np.abs(out - reference_logits).mean() < 0.5
    assert (out.argmax(-1) == reference_logits.argmax(-1)).mean() >= 0.9


def test_layout_read_from_model(session):
    _, s = session
    assert (s.n_layers, s.kv_heads, s.head_dim, s.vocab_size) == (30, 3, 64, 49152)
    assert s.layout == "gqa"


def test_chunked_prefill_equals_one_shot(session):
    _, s = session
    full = s.forward(s.new_cache(), IDS, keep=len(IDS))
    c = s.new_cache()
    a = s.forward(c, IDS[:20], keep=20)
    b = s.forward(c, IDS[20:], keep=len(IDS) - 20)
    assert c.length == len(IDS)
    np.testing.assert_allclose(np.concatenate([a, b]), full, atol=1e-4)


def test_single_steps_equal_one_multi_token_step(session):
    variant, s = session
    c = s.new_cache()
    s.forward(c, IDS[:30], keep=1)
    multi = s.forward(c, IDS[30:38], keep=8)
    c.truncate(30)
    single = np.stack([s.forward(c, [t], keep=1)[0] for t in IDS[30:38]])
    if variant == "fp32":
        np.testing.assert_allclose(single, multi, atol=2e-4)
    else:  # q4: the 1-row and k-row int8 kernels round differently
        assert np.abs(single - multi).mean() < 0.3
        assert (single.argmax(-1) == multi.argmax(-1)).mean() >= 0.875


def plain_nbytes(path, tokens: int) -> int:
    return DecoderSession(path, SessionConfig(max_context=128, intra_op_threads=2)).cache_nbytes(tokens)


@pytest.mark.parametrize("variant", ["fp32", "q4"])
def test_batch_invariant_single_steps_equal_multi_token_steps_bit_for_bit(model_store, variant):
    """min_rows=2 (`[runtime] batch_invariant`), as the target loads (check_rows): a one-token step
    takes the same kernels as a verification pass (the graph pads its attention; where this CPU's
    4-bit kernels round a lone row differently, the whole pass is padded to two rows), and its
    logits are those of the multi-token pass exactly, on q4 too; the padding leaves no trace in
    the cache."""
    path = model_store.get("smollm2-135m").variant_path(variant)
    s = DecoderSession(path, SessionConfig(max_context=128, intra_op_threads=2), min_rows=2, check_rows=True)
    assert s.rows.exact, s.rows  # where it is not, tests/test_invariance.py checks that it is reported
    c = s.new_cache()
    s.forward(c, IDS[:30], keep=1)
    multi = s.forward(c, IDS[30:36], keep=6)
    c.truncate(30)
    single = np.stack([s.forward(c, [t], keep=1)[0] for t in IDS[30:36]])
    assert c.length == 36
    np.testing.assert_array_equal(single, multi)
    # the cache holds what one multi-token pass would have written: the padding left no trace
    c2 = s.new_cache()
    s.forward(c2, IDS[:30], keep=1)
    s.forward(c2, IDS[30:36], keep=6)
    np.testing.assert_array_equal(s.forward(c, IDS[36:40], keep=4), s.forward(c2, IDS[36:40], keep=4))
    # the budget counts the padding slot a step writes past the last token
    assert s.cache_nbytes(100) == plain_nbytes(path, 101)
    # the last slot of the cache: the padding row goes to the buffer's slack slot
    full, ref = s.new_cache(capacity=11), s.new_cache(capacity=12)
    s.forward(full, IDS[:10], keep=1)
    s.forward(ref, IDS[:10], keep=1)
    last = s.forward(full, IDS[10:11], keep=1)
    assert last.shape == (1, s.vocab_size) and full.length == 11
    assert np.array_equal(last, s.forward(ref, IDS[10:12], keep=2)[:1])


def test_rollback_overwrites_rejected_tokens(session):
    _, s = session
    c = s.new_cache()
    s.forward(c, IDS[:30], keep=1)
    want = s.forward(c, IDS[30:34], keep=4)
    c.truncate(30)
    s.forward(c, [7, 8, 9, 10, 11], keep=5)  # a rejected draft run
    c.truncate(30)
    got = s.forward(c, IDS[30:34], keep=4)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_requests_interleaved_on_one_session_keep_their_own_caches(session):
    """Each cache keeps its own binding (its buffers as past and present) and its own output
    buffer: two requests stepping in turn get what each gets alone, and the logits a step
    returned stay as they were after the next step."""
    check_interleaved_requests(session[1])


def test_padded_requests_interleaved_keep_their_own_caches(model_store):
    """The same with batch_invariant's padded one-token passes (two rows, one dropped)."""
    path = model_store.get("smollm2-135m").variant_path("q4")
    check_interleaved_requests(DecoderSession(path, SessionConfig(max_context=128, intra_op_threads=2), min_rows=2))


def check_interleaved_requests(s: DecoderSession) -> None:
    alone = s.new_cache()
    want = [s.forward(alone, IDS[:8], keep=1)] + [s.forward(alone, [t], keep=1) for t in IDS[8:14]]
    a, b = s.new_cache(), s.new_cache()
    got_a = [s.forward(a, IDS[:8], keep=1)]
    s.forward(b, IDS[20:30], keep=1)
    for t in IDS[8:14]:
        got_a.append(s.forward(a, [t], keep=1))
        s.forward(b, [t + 1], keep=1)
        s.forward(b, [t + 2, t + 3], keep=2)  # a verification pass between one-position steps
    assert all(np.abs(w1 - w2).max() > 0 for w1, w2 in zip(want, want[1:]))  # not one buffer's views
    for g, w in zip(got_a, want):
        np.testing.assert_array_equal(g, w)


def test_keep_returns_last_rows(session):
    _, s = session
    all_rows = s.forward(s.new_cache(), IDS[:10], keep=10)
    last3 = s.forward(s.new_cache(), IDS[:10], keep=3)
    np.testing.assert_allclose(last3, all_rows[-3:], atol=1e-4)


def test_context_overflow_is_refused(session):
    _, s = session
    c = s.new_cache(capacity=16)
    s.forward(c, list(range(100, 110)), keep=1)
    with pytest.raises(ContextOverflowError, match="10 cached \\+ 7 new tokens > capacity 16"):
        s.forward(c, list(range(7)), keep=1)
    assert c.length == 10


def test_truncate_beyond_length_is_refused(session):
    _, s = session
    c = s.new_cache()
    s.forward(c, [1, 2, 3], keep=1)
    with pytest.raises(ValueError, match="length 3 to 5"):
        c.truncate(5)


def test_missing_and_bad_model_files(tmp_path):
    with pytest.raises(ModelFormatError, match="not found"):
        DecoderSession(tmp_path / "nope.onnx")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelFormatError, match="cannot load"):
        DecoderSession(bad)


def test_cache_costs_the_pages_it_touches_not_its_capacity(model_store):
    """cache_nbytes() plans memory by tokens: the shared buffer's untouched pages stay uncommitted."""
    import psutil

    s = DecoderSession(model_store.get("smollm2-135m").variant_path("fp32"), SessionConfig(max_context=2048))
    s.forward(s.new_cache(), IDS[:8], keep=1)  # warm up: the session's own buffers
    proc = psutil.Process()
    capacity_bytes = s.kv_bytes_per_token() * 2048  # 90 MiB
    before = proc.memory_info().rss
    cache = s.new_cache()
    assert proc.memory_info().rss - before < 0.1 * capacity_bytes
    s.forward(cache, IDS, keep=1)
    grown = proc.memory_info().rss - before
    assert grown < 0.1 * capacity_bytes
    # 44 tokens x 64 x fp32 = 11 KiB per (layer, K/V, head) row: 3 pages, plus 1 for alignment
    assert s.cache_nbytes(len(IDS)) == 2 * 30 * 3 * 4 * 4096
    # never more than the buffer: the capacity, plus the slot a padded one-token pass writes past it
    assert s.graph_pads and s.cache_nbytes(10**6) == s.kv_bytes_per_token() * (2048 + 1)


def test_cuda_serves_q4_from_its_float16_twin():
    """CUDA's GroupQueryAttention is float16/bfloat16 only: a float32 graph would run attention on
    the CPU, so q4 loads as q4f16 on CUDA where it exists, and says what to build where it doesn't."""
    cuda = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert variant_for("q4", cuda, ["q4", "q4f16"]) == ("q4f16", None)
    assert variant_for("q4", ["TensorrtExecutionProvider", *cuda], ["q4f16"]) == ("q4f16", None)
    variant, warning = variant_for("q4", cuda, ["q4"])
    assert variant == "q4" and "attention will run on the CPU" in warning and "--variant q4f16" in warning
    assert variant_for("q4", ["CPUExecutionProvider"], ["q4", "q4f16"]) == ("q4", None)
    assert variant_for("fp32", cuda, ["fp32", "q4f16"]) == ("fp32", None)
    assert variant_for("q4f16", ["CPUExecutionProvider"], ["q4f16"]) == ("q4f16", None)


@pytest.mark.parametrize("variant", ["q4", "fp32"])
def test_a_one_token_pass_rounds_as_a_verification_pass_without_padding_the_matmuls(model_store, variant):
    """The graph gives attention a copy of a lone query row (memspec.attention_pad): with no
    padding by the session, a one-token pass equals row 0 of a two-token pass bit for bit, the
    copy's slot is overwritten by the next token, and a pass into the last slot still fits.  That
    holds on fp32 on every CPU, and on q4 where its 4-bit kernel is row-invariant (AVX-512 hosts);
    where it is not, the self-check says so (and the target pads whole passes instead)."""
    s = DecoderSession(model_store.get("smollm2-135m").variant_path(variant), SessionConfig(max_context=64),
                       check_rows=True)
    assert s.graph_pads and s.pad_rows == 1 and s.slack == 1
    if not s.rows.exact:
        assert variant == "q4" and s.rows.warning(), s.rows
        return
    for ctx in (1, 9, 30):
        a, b = s.new_cache(), s.new_cache()
        s.forward(a, IDS[:ctx])
        s.forward(b, IDS[:ctx])
        one = s.forward(a, [IDS[ctx]])[0]
        two = s.forward(b, IDS[ctx:ctx + 2], keep=2)
        assert a.length == ctx + 1 and np.array_equal(one, two[0]), ctx
        b.truncate(ctx + 1)
        assert np.array_equal(s.forward(a, [IDS[ctx + 1]])[0], s.forward(b, [IDS[ctx + 1]])[0])
    full = s.new_cache()
    s.forward(full, (IDS * 2)[:63])
    assert s.forward(full, [IDS[0]]).shape == (1, s.vocab_size) and full.length == full.capacity == 64
