"""Build an ONNX Runtime decoder from a llama GGUF.

The graph follows the onnxruntime-genai layout so that any tool that knows it
can run our files (onnxruntime-genai itself, once logits_to_keep is fixed to 0,
which genai does not feed: bench/engines.py runs it on our q4 file):

    inputs : input_ids (B, S) int64, attention_mask (B, P+S) int64,
             past_key_values.{i}.key/value (B, kvh, P, hd) float32,
             logits_to_keep () int64  (0 = every position)
    outputs: logits (B, S', V), present.{i}.key/value (B, kvh, T, hd)

and uses the com.microsoft contrib ops GroupQueryAttention (packed QKV, rotary
inside), SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization and
MatMulNBits.  Past and present may be bound to one preallocated buffer; the
attention mask's length then gives the committed length, so rollback is just a
shorter mask.

Variants:
  fp32  every weight dequantized to float32: exact, about 2x slower.
  q4    the GGUF's own Q4_1 / Q8_0 blocks, no re-quantization.  Q4_1 blocks
        (w = d*q + m) run as MatMulNBits with the default zero point 8 plus a
        block-sum correction blocksum(x) @ (m + 8d)^T, which is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memspec.models.gguf import QK, ArrayWeights, GGUFModel, LlamaConfig

VARIANTS = ("fp32", "q4")
MS = "com.microsoft"
WEIGHT_DTYPES = ("float32", "float16")
HALF_EXEMPT = ("cos_cache", "sin_cache")  # rotary tables stay float32 even with float16 weights


def kv_names(i: int) -> tuple[str, str, str, str]:
    """(past key, past value, present key, present value) names of layer i."""
    return (
        f"past_key_values.{i}.key",
        f"past_key_values.{i}.value",
        f"present.{i}.key",
        f"present.{i}.value",
    )


@dataclass
class _Graph:
    """Collects nodes and initializers while the decoder is built."""

    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    half_weights: bool = False  # store float32 matrices as float16 + Cast (drafts: half the file size)

    def init(self, name: str, array: np.ndarray) -> str:
        array = np.array(array, order="C")
        if self.half_weights and array.dtype == np.float32 and array.ndim == 2 and name not in HALF_EXEMPT:
            # ORT folds the Cast at load time: the session holds float32 weights, the file float16.
            self.inits.append(numpy_helper.from_array(array.astype(np.float16), f"{name}.fp16"))
            self.nodes.append(helper.make_node("Cast", [f"{name}.fp16"], [name], name=f"{name}/Cast", to=TensorProto.FLOAT))
            return name
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def node(self, op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "", **attrs):
        outs = [f"{name}/output_{k}" for k in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs


class DecoderBuilder:
    """Turns one GGUF into one ONNX decoder variant."""

    def __init__(self, model: GGUFModel | ArrayWeights, variant: str, max_positions: int | None = None,
                 weight_dtype: str = "float32"):
        """weight_dtype="float16" (fp32 variant only) stores matrices as float16 initializers
        cast to float32 when the session loads; the computation stays float32."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
        if weight_dtype not in WEIGHT_DTYPES or (weight_dtype == "float16" and variant != "fp32"):
            raise ValueError(f"weight_dtype {weight_dtype!r} is not available for variant {variant!r}")
        self.m = model
        self.cfg: LlamaConfig = model.config
        self.variant = variant
        self.max_positions = max_positions or self.cfg.context_length
        self.g = _Graph(half_weights=weight_dtype == "float16")

    # -- linear layers ------------------------------------------------------
    def _linear(self, x: str, tensors: list[str], name: str, blocksum) -> str:
        """x @ concat(W_t for t in tensors)^T.  `blocksum()` makes x summed per 32-block (Q4_1 only)."""
        if self.variant == "fp32":
            w = np.concatenate([self.m.float32(t) for t in tensors], axis=0)  # (N, K)
            return self.g.node("MatMul", [x, self.g.init(f"{name}.weight", w.T)], f"{name}/MatMul")
        if all(self.m.qtype(t) == "Q4_1" for t in tensors):
            return self._linear_q4_1(x, tensors, name, blocksum)
        if all(self.m.qtype(t) == "Q8_0" for t in tensors):
            return self._linear_q8_0(x, tensors, name)
        raise NotImplementedError(f"q4 variant: {tensors} are {[self.m.qtype(t) for t in tensors]}")

    def _linear_q8_0(self, x: str, tensors: list[str], name: str) -> str:
        """Q8_0 blocks (w = d * q) as 8-bit MatMulNBits: stored q + 128, its default zero point."""
        parts = [self.m.q8_0(t) for t in tensors]
        q = np.concatenate([p.q for p in parts], axis=0)  # (N, nb, 32) int8
        d = np.concatenate([p.d for p in parts], axis=0)  # (N, nb)
        return self._matmul_nbits(x, name, (q.astype(np.int16) + 128).astype(np.uint8), d, bits=8)

    def _matmul_nbits(self, x: str, name: str, data: np.ndarray, scales: np.ndarray, bits: int) -> str:
        """x @ W^T with W as (N, n_blocks, ...) packed blocks of 32 and (N, n_blocks) scales (int8 compute)."""
        n, nb = scales.shape
        return self.g.node(
            "MatMulNBits",
            [x, self.g.init(f"{name}.qweight", data), self.g.init(f"{name}.scales", scales.reshape(-1))],
            f"{name}/MatMulNBits",
            domain=MS,
            K=nb * QK,
            N=n,
            bits=bits,
            block_size=QK,
            accuracy_level=4,
        )

    def _linear_q4_1(self, x: str, tensors: list[str], name: str, blocksum) -> str:
        blocksum = blocksum()
        parts = [self.m.q4_1(t) for t in tensors]
        q = np.concatenate([p.q for p in parts], axis=0)  # (N, nb, 32)
        d = np.concatenate([p.d for p in parts], axis=0)  # (N, nb)
        m = np.concatenate([p.m for p in parts], axis=0)  # (N, nb)
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # (N, nb, 16)
        main = self._matmul_nbits(x, name, packed, d, bits=4)
        corr = (m + 8.0 * d).T  # (nb, N): what zero point 8 leaves out, per block
        fix = self.g.node("MatMul", [blocksum, self.g.init(f"{name}.block_bias", corr)], f"{name}/BlockBias")
        return self.g.node("Add", [main, fix], f"{name}/Add")

    def _blocksum(self, x: str, k: int, name: str) -> str | None:
        """Sum of x over each 32-wide block of its last axis: (B, S, K) -> (B, S, K/32)."""
        if self.variant == "fp32":
            return None
        shape = self.g.init(f"{name}.block_shape", np.array([0, 0, k // QK, QK], dtype=np.int64))
        r = self.g.node("Reshape", [x, shape], f"{name}/BlockReshape")
        axes = self.g.init(f"{name}.block_axes", np.array([-1], dtype=np.int64))
        return self.g.node("ReduceSum", [r, axes], f"{name}/BlockSum", keepdims=0)

    # -- blocks -----------------------------------------------------------------
    def _norm_weight(self, tensor: str) -> str:
        return self.g.init(tensor, self.m.float32(tensor))

    def _embedding(self) -> str:
        name = "/model/embed_tokens"
        if self.variant == "q4" and self.m.qtype("token_embd.weight") == "Q8_0":
            blocks = self.m.q8_0("token_embd.weight")
            data = (blocks.q.astype(np.int16) + 128).astype(np.uint8).reshape(self.cfg.vocab, -1)
            return self.g.node(
                "GatherBlockQuantized",
                [self.g.init("embed.qweight", data), "input_ids", self.g.init("embed.scales", blocks.d)],
                f"{name}/GatherBlockQuantized",
                domain=MS,
                bits=8,
                block_size=QK,
                quantize_axis=1,
                gather_axis=0,
            )
        self._emb_f32 = self.g.init("embed.weight", self.m.float32("token_embd.weight"))
        return self.g.node("Gather", [self._emb_f32, "input_ids"], f"{name}/Gather")

    def _lm_head(self, x: str) -> str:
        name = "/lm_head"
        head = "token_embd.weight" if self.cfg.tied_embeddings else "output.weight"
        if self.variant == "q4" and self.m.qtype(head) == "Q8_0":
            return self._linear_q8_0(x, [head], name)
        if self.variant == "q4" and self.m.qtype(head) == "Q4_1":
            return self._linear_q4_1(x, [head], name, lambda: self._blocksum(x, self.cfg.hidden, name))
        w = self._emb_f32 if (head == "token_embd.weight" and hasattr(self, "_emb_f32")) else None
        if w is None:
            w = self.g.init("lm_head.weight", self.m.float32(head))
        # Gemm(transB) reads the (V, H) embedding in place: no transposed copy.
        flat = self.g.node("Reshape", [x, self.g.init("lm_head.flat", np.array([-1, self.cfg.hidden]))], f"{name}/Flatten")
        y = self.g.node("Gemm", [flat, w], f"{name}/Gemm", transB=1)
        shape = self.g.node("Shape", [x], f"{name}/Shape", end=2)
        out_shape = self.g.node(
            "Concat", [shape, self.g.init("lm_head.vocab", np.array([self.cfg.vocab]))], f"{name}/OutShape", axis=0
        )
        return self.g.node("Reshape", [y, out_shape], f"{name}/Unflatten")

    def _rotary_caches(self) -> tuple[str, str]:
        c = self.cfg
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim))
        t = np.arange(self.max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # (P, hd/2)
        return (
            self.g.init("cos_cache", np.cos(t).astype(np.float32)),
            self.g.init("sin_cache", np.sin(t).astype(np.float32)),
        )

    def _mask_lengths(self) -> tuple[str, str]:
        """seqlens_k = committed+new-1 per row, total_sequence_length = mask width (int32)."""
        g = self.g
        s = g.node("ReduceSum", ["attention_mask", g.init("mask.axes", np.array([1]))], "/model/mask/ReduceSum", keepdims=0)
        s1 = g.node("Sub", [s, g.init("mask.one", np.array(1, dtype=np.int64))], "/model/mask/Sub")
        seqlens = g.node("Cast", [s1], "/model/mask/SeqLens", to=TensorProto.INT32)
        shape = g.node("Shape", ["attention_mask"], "/model/mask/Shape")
        width = g.node("Gather", [shape, g.init("mask.idx1", np.array(1, dtype=np.int64))], "/model/mask/Width", axis=0)
        total = g.node("Cast", [width], "/model/mask/Total", to=TensorProto.INT32)
        return seqlens, total

    def _attention(self, i: int, x: str, seqlens: str, total: str, cos: str, sin: str) -> str:
        c = self.cfg
        p = f"/model/layers.{i}/attn"
        blk = f"blk.{i}"
        bs = lambda: self._blocksum(x, c.hidden, p)  # noqa: E731 (made only for Q4_1 weights)
        qkv = self._linear(x, [f"{blk}.attn_q.weight", f"{blk}.attn_k.weight", f"{blk}.attn_v.weight"], f"{p}/qkv_proj", bs)
        past_k, past_v, present_k, present_v = kv_names(i)
        gqa = helper.make_node(
            "GroupQueryAttention",
            [qkv, "", "", past_k, past_v, seqlens, total, cos, sin],
            [f"{p}/GroupQueryAttention/output_0", present_k, present_v],
            name=f"{p}/GroupQueryAttention",
            domain=MS,
            num_heads=c.n_heads,
            kv_num_heads=c.n_kv_heads,
            do_rotary=1,
            rotary_interleaved=0,
        )
        self.g.nodes.append(gqa)
        a = f"{p}/GroupQueryAttention/output_0"
        return self._linear(a, [f"{blk}.attn_output.weight"], f"{p}/o_proj", lambda: self._blocksum(a, c.hidden, f"{p}/o"))

    def _mlp(self, i: int, x: str) -> str:
        c = self.cfg
        p = f"/model/layers.{i}/mlp"
        blk = f"blk.{i}"
        gu = self._linear(x, [f"{blk}.ffn_gate.weight", f"{blk}.ffn_up.weight"], f"{p}/gate_up_proj",
                          lambda: self._blocksum(x, c.hidden, p))
        gate, up = self.g.node("Split", [gu, self.g.init(f"{p}.split", np.array([c.ffn, c.ffn]))], f"{p}/Split", n_out=2, axis=-1)
        sig = self.g.node("Sigmoid", [gate], f"{p}/act/Sigmoid")
        silu = self.g.node("Mul", [gate, sig], f"{p}/act/Mul")
        h = self.g.node("Mul", [silu, up], f"{p}/Mul")
        return self._linear(h, [f"{blk}.ffn_down.weight"], f"{p}/down_proj", lambda: self._blocksum(h, c.ffn, f"{p}/down"))

    def _skip_norm(self, x: str, skip: str, weight: str, name: str) -> tuple[str, str]:
        """(RMSNorm(x + skip), x + skip)."""
        outs = self.g.node(
            "SkipSimplifiedLayerNormalization", [x, skip, self._norm_weight(weight)], name, n_out=4,
            domain=MS, epsilon=self.cfg.rms_eps,
        )
        return outs[0], outs[3]

    def build(self) -> onnx.ModelProto:
        c, g = self.cfg, self.g
        emb = self._embedding()
        seqlens, total = self._mask_lengths()
        cos, sin = self._rotary_caches()
        h = g.node("SimplifiedLayerNormalization", [emb, self._norm_weight("blk.0.attn_norm.weight")],
                   "/model/layers.0/input_layernorm", axis=-1, epsilon=c.rms_eps)
        residual = emb
        for i in range(c.n_layers):
            attn = self._attention(i, h, seqlens, total, cos, sin)
            h, residual = self._skip_norm(attn, residual, f"blk.{i}.ffn_norm.weight", f"/model/layers.{i}/post_attention_layernorm")
            mlp = self._mlp(i, h)
            nxt = f"blk.{i + 1}.attn_norm.weight" if i + 1 < c.n_layers else "output_norm.weight"
            nm = f"/model/layers.{i + 1}/input_layernorm" if i + 1 < c.n_layers else "/model/norm"
            h, residual = self._skip_norm(mlp, residual, nxt, nm)
        # Only the last `logits_to_keep` positions reach the LM head (0 = all):
        # prefill asks for 1, verification for k+1.
        keep = g.node("Neg", ["logits_to_keep"], "/model/keep/Neg")
        start = g.node("Unsqueeze", [keep, g.init("keep.axes0", np.array([0]))], "/model/keep/Start")
        h = g.node("Slice", [h, start, g.init("keep.end", np.array([2**62])), g.init("keep.axis", np.array([1]))], "/model/keep/Slice")
        logits = self._lm_head(h)
        g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="/model/logits"))
        return self._model()

    def _model(self) -> onnx.ModelProto:
        c, g = self.cfg, self.g
        f = TensorProto.FLOAT
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
            helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, []),
        ]
        outputs = [helper.make_tensor_value_info("logits", f, ["batch_size", "logits_length", c.vocab])]
        kv = ["batch_size", c.n_kv_heads, "past_sequence_length", c.head_dim]
        kv_out = ["batch_size", c.n_kv_heads, "present_sequence_length", c.head_dim]
        for i in range(c.n_layers):
            pk, pv, ok, ov = kv_names(i)
            inputs += [helper.make_tensor_value_info(pk, f, kv), helper.make_tensor_value_info(pv, f, kv)]
            outputs += [helper.make_tensor_value_info(ok, f, kv_out), helper.make_tensor_value_info(ov, f, kv_out)]
        graph = helper.make_graph(g.nodes, "memspec_decoder", inputs, outputs, g.inits)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)], ir_version=10,
            producer_name="memspec",
        )
        helper.set_model_props(model, {"memspec.kv_layout": "shared_buffer", "memspec.variant": self.variant})
        return model


def convert(gguf_path: str | Path, out_path: str | Path, variant: str, max_positions: int | None = None) -> Path:
    """Convert one GGUF into one ONNX decoder file; returns the file's path."""
    model = GGUFModel(gguf_path)
    proto = DecoderBuilder(model, variant, max_positions).build()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    onnx.save_model(proto, str(tmp))
    tmp.replace(out)
    return out
