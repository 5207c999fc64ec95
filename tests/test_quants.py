"""GGUF block types and qwen2: decoded bit for bit like gguf's own dequantization, and
converted exactly (tiny random decoders against the float64 reference).

The K-quant decoders are written into real GGUF files here (random blocks with finite
scales), so the whole path runs: metadata under the architecture's prefix, type checks,
row order, block decoding, the q4 graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from memspec.errors import ModelFormatError
from memspec.models.convert import DecoderBuilder, convert
from memspec.models.gguf import BLOCK_TYPES, ArrayWeights, GGUFModel, decode_blocks
from memspec.runtime.config import SessionConfig
from memspec.runtime.sessions import DecoderSession
from blocks import FP16_FIELDS, random_blocks

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("qtype", sorted(BLOCK_TYPES))
def test_blocks_dequantize_bit_for_bit_like_gguf(qtype):
    rng = np.random.default_rng(list(BLOCK_TYPES).index(qtype))
    raw = random_blocks(rng, qtype, 6, 512)
    first = raw[0, : BLOCK_TYPES[qtype][1]].copy()
    raw[0, : BLOCK_TYPES[qtype][1]] = 0xFF  # all-ones integers; the fp16 fields stay finite
    for at in FP16_FIELDS[qtype]:
        raw[0, at : at + 2] = first[at : at + 2]
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    got = decode_blocks(qtype, raw).dequantize()
    assert got.dtype == np.float32 and got.shape == (6, 512)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


# -- tiny GGUF files -------------------------------------------------------------------
HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 256, 512, 96, 4, 2
# Layer 0 mixes types inside the fused projections (q/k vs v, gate vs up); layer 1 is all 4-bit.
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
     "ffn_gate": "Q5_0", "ffn_up": "Q8_0", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q4_K", "attn_output": "Q4_1",
     "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q4_K"},
]


def write_tiny_gguf(path, arch: str, embd: str, head: str | None, seed: int = 0):
    """A 2-layer decoder in a GGUF file; head None = tied to the embedding.  qwen2 gets biases."""
    rng = np.random.default_rng(seed)
    hd, kv = HIDDEN // HEADS, KV_HEADS * HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(len(LAYER_TYPES))
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(1e6 if arch == "qwen2" else 1e4)
    w.add_layer_norm_rms_eps(1e-6)

    def matrix(name, qtype, n, k):
        w.add_tensor(name, random_blocks(rng, qtype, n, k), raw_dtype=gguf.GGMLQuantizationType[qtype])

    def vector(name, n, scale=0.0):
        w.add_tensor(name, (1.0 + scale * rng.standard_normal(n)).astype(np.float32))

    matrix("token_embd.weight", embd, VOCAB, HIDDEN)
    if head:
        matrix("output.weight", head, VOCAB, HIDDEN)
    vector("output_norm.weight", HIDDEN, 0.1)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    for i, types in enumerate(LAYER_TYPES):
        for name, (n, k) in shapes.items():
            matrix(f"blk.{i}.{name}.weight", types[name], n, k)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", (0.5 * rng.standard_normal(n)).astype(np.float32))
        vector(f"blk.{i}.attn_norm.weight", HIDDEN, 0.1)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN, 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run_logits(path, ids):
    s = DecoderSession(path, SessionConfig(max_context=64, intra_op_threads=1))
    c = s.new_cache()
    return np.concatenate([s.forward(c, ids[:10], keep=10), s.forward(c, ids[10:], keep=len(ids) - 10)])


def float_activations(path, out):
    """The same graph with MatMulNBits computing in float32 (accuracy_level 0, not int8)."""
    proto = onnx.load(str(path))
    for node in proto.graph.node:
        for a in node.attribute:
            if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = 0
    onnx.save(proto, str(out))
    return out


def check_against_reference(onnx_path, model, variant, ids):
    """fp32, and q4 with float activations, equal the float64 reference of the dequantized
    weights (the weights are exact); q4 as shipped rounds activations to int8, and stays close."""
    from llama_reference import ReferenceLlama

    want = ReferenceLlama(model).logits(ids)
    exact = onnx_path if variant == "fp32" else float_activations(onnx_path, onnx_path.with_suffix(".f.onnx"))
    err = np.abs(run_logits(exact, ids) - want).max() / want.std()
    assert err < 1e-4, f"{variant}: max |logit error| {err:.2e} of the logits' std"
    if variant == "q4":
        got = run_logits(onnx_path, ids)
        err = np.abs(got - want).max() / want.std()
        agree = np.mean(got.argmax(-1) == want.argmax(-1))
        assert err < 0.3 and agree >= 0.9, f"int8: max |logit error| {err:.3f} of the std, argmax agreement {agree:.2f}"


@pytest.mark.parametrize("variant", ["fp32", "q4"])
@pytest.mark.parametrize("arch, embd, head", [("qwen2", "Q4_K", "Q6_K"), ("qwen2", "Q6_K", "Q8_0"),
                                              ("llama", "Q5_K", None), ("qwen2", "Q5_0", "Q4_K")])
def test_k_quant_decoder_matches_the_float64_reference(tmp_path, variant, arch, embd, head):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, embd, head)
    model = GGUFModel(path)
    c = model.config
    assert (c.arch, c.qkv_bias, c.tied_embeddings) == (arch, arch == "qwen2", head is None)
    assert (c.n_layers, c.hidden, c.ffn, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab) == (2, 256, 512, 4, 2, 64, 96)
    assert c.rope_theta == (1e6 if arch == "qwen2" else 1e4) and c.rms_eps == pytest.approx(1e-6)
    out = convert(path, tmp_path / f"{variant}.onnx", variant)
    ids = list(np.random.default_rng(1).integers(0, VOCAB, size=24))
    check_against_reference(out, model, variant, ids)
    if variant == "q4":
        ops = [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node]
        # layer 0: qk | v, o, gate | up, down; layer 1: qkv, o, gate_up, down; the head
        assert "GatherBlockQuantized" in ops and ops.count("MatMulNBits") == 6 + 4 + 1


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row order for llama: each head's two rotary halves interleaved."""
    n, k = w.shape
    return w.reshape(heads, 2, n // heads // 2, k).swapaxes(1, 2).reshape(n, k)


def test_q_and_k_rows_are_unpermuted_for_llama_only(tmp_path):
    for arch in ("llama", "qwen2"):
        path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, "Q8_0", None)
        t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_k.weight")
        in_file = gguf.quants.dequantize(t.data, t.tensor_type)  # rows as the GGUF stores them
        got = GGUFModel(path).float32("blk.0.attn_k.weight")
        np.testing.assert_array_equal(llama_cpp_permute(got, KV_HEADS) if arch == "llama" else got, in_file)
        assert np.array_equal(got, in_file) == (arch == "qwen2")
        np.testing.assert_array_equal(GGUFModel(path).blocks("blk.0.attn_k.weight").dequantize(), got)


@pytest.mark.parametrize("variant, quantize", [("fp32", None), ("q4", "Q4_1"), ("q4", "Q8_0"), ("q4", "Q4_0")])
def test_tiny_qwen2_with_biases_matches_the_float64_reference(tmp_path, variant, quantize):
    """ArrayWeights with Q/K/V biases and a separate head; q4 against the reference of its own blocks."""
    from tiny_models import tiny_config, tiny_weights

    cfg = tiny_config(vocab=64, hidden=64, arch="qwen2")
    weights = ArrayWeights(cfg, tiny_weights(cfg, seed=4, scale=4.0)._tensors, quantize=quantize)
    path = tmp_path / "m.onnx"
    onnx.save(DecoderBuilder(weights, variant, 256).build(), str(path))
    exact = {n: weights.blocks(n).dequantize() if weights.qtype(n) != "F32" else weights.float32(n)
             for n in weights._tensors}
    ids = list(np.random.default_rng(2).integers(0, 64, size=24))
    check_against_reference(path, ArrayWeights(cfg, exact), variant, ids)


def test_q4_0_blocks_are_symmetric_and_leave_no_block_sum_correction(tmp_path):
    """Q4_0 (what a draft re-quantized from a sibling uses): each weight within half a step of its
    block's scale (a whole step where the side opposite the largest magnitude clips at +7), the
    largest-magnitude weight exact, and a graph without BlockBias MatMuls."""
    from tiny_models import tiny_config, tiny_weights

    cfg = tiny_config(vocab=64, hidden=64, arch="qwen2")
    weights = ArrayWeights(cfg, tiny_weights(cfg, seed=5, scale=4.0)._tensors, quantize="Q4_0")
    name = "blk.0.ffn_up.weight"
    b = weights.blocks(name)
    assert (b.zero, b.bits, b.offset, b.block) == (8, 4, None, 32)
    w = weights.float32(name).reshape(b.q.shape)
    err = np.abs(b.dequantize().reshape(b.q.shape) - w)
    step = np.abs(b.scale)[..., None]
    clipped = np.abs(w) > 7.5 * step  # (and the largest, exact)
    assert (err[~clipped] <= step.repeat(32, -1)[~clipped] * 0.5 + 1e-6).all()
    assert (err <= step + 1e-6).all()
    big = np.abs(w).argmax(axis=-1)[..., None]
    np.testing.assert_allclose(np.take_along_axis(b.dequantize().reshape(b.q.shape), big, -1),
                               np.take_along_axis(w, big, -1), rtol=1e-6)
    nodes = DecoderBuilder(weights, "q4", 256).build().graph.node
    assert any(n.op_type == "MatMulNBits" for n in nodes) and not any("BlockBias" in n.name for n in nodes)


def test_unsupported_type_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "q2k.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 256), (w.add_feed_forward_length, 512),
                   (w.add_head_count, 4), (w.add_layer_norm_rms_eps, 1e-6)):
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float32))
    q2k = np.zeros((8, 84), dtype=np.uint8)  # one Q2_K super-block of 256 per row
    w.add_tensor("blk.0.attn_q.weight", q2k, raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out" / "q4.onnx"
    with pytest.raises(ModelFormatError, match="tensor 'blk.0.attn_q.weight' is Q2_K, which memspec does not convert"):
        convert(path, out, "q4")
    assert not (tmp_path / "out").exists()


def test_a_model_past_the_protobuf_limit_keeps_its_weights_beside_it(tmp_path, monkeypatch):
    import memspec.models.convert as convert_module

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", "Q4_K", "Q6_K")
    small = convert(path, tmp_path / "small.onnx", "q4")
    monkeypatch.setattr(convert_module, "PROTOBUF_LIMIT", 0)
    big = convert(path, tmp_path / "big.onnx", "q4")
    size = convert_module.external_data_path(big).stat().st_size
    assert size > 10 * big.stat().st_size
    assert convert(path, big, "q4") == big and convert_module.external_data_path(big).stat().st_size == size
    ids = list(range(20))
    np.testing.assert_array_equal(run_logits(big, ids), run_logits(small, ids))


def test_q4f16_runs_float16_activations_and_cache_close_to_the_reference(tmp_path):
    """The CUDA variant, on the CPU (where ONNX Runtime casts some of its ops back to float32):
    float16 KV inputs and outputs, float32 logits, the q4 weights with float16 scales."""
    import onnxruntime as ort
    from llama_reference import ReferenceLlama

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", "Q4_K", "Q6_K")
    out = convert(path, tmp_path / "q4f16.onnx", "q4f16")
    s = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    kv = [i for i in s.get_inputs() if i.name.startswith("past_key_values.")]
    assert len(kv) == 4 and {i.type for i in kv} == {"tensor(float16)"}
    assert {o.type for o in s.get_outputs()} == {"tensor(float)", "tensor(float16)"}
    ids = list(np.random.default_rng(1).integers(0, VOCAB, size=24))
    feeds = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
             "logits_to_keep": np.array(0), **{i.name: np.zeros((1, KV_HEADS, 0, 64), np.float16) for i in kv}}
    got = s.run(["logits"], feeds)[0][0]
    want = ReferenceLlama(GGUFModel(path)).logits(ids)
    err = np.abs(got - want).max() / want.std()
    assert err < 0.3 and np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9, err


def test_a_q4f16_session_keeps_a_float16_cache_of_half_the_bytes(tmp_path):
    """DecoderSession reads the cache type from the graph: float16 buffers, half the KV bytes per
    token (what admission and the working set count), and steps that agree with one long pass."""
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.sessions import DecoderSession

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", "Q4_K", "Q6_K")
    q4 = DecoderSession(convert(path, tmp_path / "q4.onnx", "q4"), SessionConfig(max_context=64))
    f16 = DecoderSession(convert(path, tmp_path / "q4f16.onnx", "q4f16"), SessionConfig(max_context=64))
    assert (q4.kv_dtype, f16.kv_dtype) == (np.float32, np.float16)
    assert 2 * f16.kv_bytes_per_token() == q4.kv_bytes_per_token()
    assert f16.cache_nbytes(60) < q4.cache_nbytes(60) and f16.new_cache().nbytes * 2 == q4.new_cache().nbytes
    ids = [int(i) for i in np.random.default_rng(2).integers(0, VOCAB, size=20)]
    whole = f16.forward(f16.new_cache(), ids, keep=len(ids))
    cache = f16.new_cache()
    f16.forward(cache, ids[:12])
    steps = np.stack([f16.forward(cache, [t])[0] for t in ids[12:]])
    assert whole.dtype == np.float32 and cache.length == len(ids)
    np.testing.assert_allclose(steps, whole[12:], atol=0.05 * whole.std())
    assert np.mean(whole.argmax(-1) == q4.forward(q4.new_cache(), ids, keep=len(ids)).argmax(-1)) >= 0.9
