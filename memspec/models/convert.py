"""Build an ONNX Runtime decoder from a llama or qwen2 GGUF.

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
  q4    the GGUF's own blocks, no re-quantization.  4-bit types (Q4_1, Q4_K:
        w = s*q + o per 32) run as 4-bit MatMulNBits with the default zero
        point 8 plus a block-sum correction blocksum(x) @ (o + 8s)^T; the
        others (Q5_0, Q5_K, Q6_K, Q8_0) as 8-bit MatMulNBits whose stored
        values are q shifted onto the default zero point 128 (Q6_K in blocks
        of 16), with the same correction where the type has a min (Q5_K).
        Float matrices stay float32 MatMuls.  Fused projections (QKV, gate/up)
        whose tensors differ in type run as one MatMul per type, concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memspec.models.gguf import FLOAT_TYPES, QK, ArrayWeights, Blocks, DecoderConfig, GGUFModel

VARIANTS = ("fp32", "q4")  # what a pull builds
# Built only when asked: q4's weights with float16 activations and KV cache, for CUDA, whose
# GroupQueryAttention runs in float16/bfloat16 only.  Its scales are rounded to float16.
ON_REQUEST = ("q4f16",)
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
    half_activations: bool = False  # every float tensor float16: weights, scales, norms, rotary tables
    names: set = field(default_factory=set)  # initializers made so far (a shared constant is made once)

    def init(self, name: str, array: np.ndarray) -> str:
        if name in self.names:
            return name
        self.names.add(name)
        array = np.asarray(array, order="C")
        if self.half_activations and array.dtype == np.float32:
            array = array.astype(np.float16)
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


def _nbits_pieces(b: Blocks) -> tuple[np.ndarray, np.ndarray | None]:
    """(stored data, remainder) of w = scale * (q - zero) + offset for the contrib ops' blocks,
    which compute scale * (stored - Z) with their default zero point Z = 2^(bits-1).

    8 bits: stored = q - zero + Z (every 8-bit type's q fits), remainder = offset (or None).
    4 bits: stored = q, two per byte, remainder = scale * (Z - zero) + offset per 32 weights
    (None for symmetric blocks, zero = Z and no offset)."""
    z = 1 << (b.bits - 1)
    if b.bits == 8:
        return (b.q.astype(np.int16) - b.zero + z).astype(np.uint8), b.offset
    packed = (b.q[..., 0::2] | (b.q[..., 1::2] << 4)).astype(np.uint8)  # (N, nb, block/2)
    if b.zero == z and b.offset is None:  # symmetric blocks (Q4_0): nothing is left over
        return packed, None
    rest = (z - b.zero) * b.scale
    return packed, rest if b.offset is None else b.offset + rest


class DecoderBuilder:
    """Turns one GGUF into one ONNX decoder variant."""

    def __init__(self, model: GGUFModel | ArrayWeights, variant: str, max_positions: int | None = None,
                 weight_dtype: str = "float32", pad_attention: bool = True):
        """weight_dtype="float16" (fp32 variant only) stores matrices as float16 initializers
        cast to float32 when the session loads; the computation stays float32.

        pad_attention: a one-token pass gives attention a copy of its query row as a second one
        (the copy's K/V land in the slot after the token, which the next pass overwrites), so that
        it takes GroupQueryAttention's multi-row kernel, as verification passes do, and rounds as
        they do, while every matrix multiply still runs one row.  Targets want it (decoding and
        verifying then agree bit for bit); drafts, which never verify, do not."""
        if variant not in VARIANTS + ON_REQUEST:
            raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS + ON_REQUEST)}")
        if weight_dtype not in WEIGHT_DTYPES or (weight_dtype == "float16" and variant != "fp32"):
            raise ValueError(f"weight_dtype {weight_dtype!r} is not available for variant {variant!r}")
        self.m = model
        self.cfg: DecoderConfig = model.config
        self.variant = variant
        self.max_positions = max_positions or self.cfg.context_length
        self.g = _Graph(half_weights=weight_dtype == "float16", half_activations=variant == "q4f16")
        self.pad_attention = pad_attention
        self._blocksums: dict[str, str] = {}  # input -> its per-32 block sums, made once
        self._pad: tuple[str, str] | None = None  # (pad (1,) int64: 1 for a one-token pass, else 0; S (1,))

    # -- linear layers ------------------------------------------------------
    def _linear(self, x: str, tensors: list[str], name: str, blocksum, bias: list[str] | None = None) -> str:
        """x @ concat(W_t for t in tensors)^T (+ concat(bias)).  `blocksum()` makes x summed per
        32-block (only weights with a min need it).  Tensors of different types are not fused."""
        runs = [list(ts) for _, ts in groupby(tensors, key=self._kind)]  # consecutive tensors of one kind
        if len(runs) == 1:
            y = self._linear_run(x, tensors, name, blocksum)
        else:
            parts = [self._linear_run(x, ts, f"{name}/{j}", blocksum) for j, ts in enumerate(runs)]
            y = self.g.node("Concat", parts, f"{name}/Concat", axis=-1)
        if bias:
            b = np.concatenate([self.m.float32(t) for t in bias])
            y = self.g.node("Add", [y, self.g.init(f"{name}.bias", b)], f"{name}/BiasAdd")
        return y

    def _kind(self, tensor: str) -> str:
        """What a matrix runs as: 'float', or its ggml block type."""
        qtype = self.m.qtype(tensor)
        return "float" if self.variant == "fp32" or qtype in FLOAT_TYPES else qtype

    def _linear_run(self, x: str, tensors: list[str], name: str, blocksum) -> str:
        """One MatMul over tensors of one kind."""
        if self._kind(tensors[0]) == "float":
            w = np.concatenate([self.m.float32(t) for t in tensors], axis=0)  # (N, K)
            return self.g.node("MatMul", [x, self.g.init(f"{name}.weight", w.T)], f"{name}/MatMul")
        parts = [self.m.blocks(t) for t in tensors]
        b = Blocks(
            q=np.concatenate([p.q for p in parts], axis=0),  # (N, nb, block)
            scale=np.concatenate([p.scale for p in parts], axis=0),  # (N, nb)
            zero=parts[0].zero, bits=parts[0].bits,
            offset=None if parts[0].offset is None else np.concatenate([p.offset for p in parts], axis=0),
        )
        return self._linear_blocks(x, b, name, blocksum)

    def _linear_blocks(self, x: str, b: Blocks, name: str, blocksum) -> str:
        """Blocks as MatMulNBits plus, where they leave a per-block remainder, blocksum(x) @ remainder^T."""
        data, corr = _nbits_pieces(b)
        if corr is None:
            return self._matmul_nbits(x, name, data, b.scale, b.bits, b.block)
        assert corr.shape[1] * QK == b.q.shape[1] * b.block, f"{name}: the correction is per {QK} weights"
        sums = blocksum()  # (B, S, K/32)
        main = self._matmul_nbits(x, name, data, b.scale, b.bits, b.block)
        fix = self.g.node("MatMul", [sums, self.g.init(f"{name}.block_bias", corr.T)], f"{name}/BlockBias")
        return self.g.node("Add", [main, fix], f"{name}/Add")

    def _matmul_nbits(self, x: str, name: str, data: np.ndarray, scales: np.ndarray, bits: int, block: int) -> str:
        """x @ W^T with W as (N, n_blocks, ...) packed blocks and (N, n_blocks) scales (int8 compute)."""
        n, nb = scales.shape
        return self.g.node(
            "MatMulNBits",
            [x, self.g.init(f"{name}.qweight", data), self.g.init(f"{name}.scales", scales.reshape(-1))],
            f"{name}/MatMulNBits",
            domain=MS,
            K=nb * block,
            N=n,
            bits=bits,
            block_size=block,
            accuracy_level=4,
        )

    def _blocksum(self, x: str, k: int, name: str) -> str:
        """Sum of x over each 32-wide block of its last axis: (B, S, K) -> (B, S, K/32)."""
        if x not in self._blocksums:
            shape = self.g.init(f"{name}.block_shape", np.array([0, 0, k // QK, QK], dtype=np.int64))
            r = self.g.node("Reshape", [x, shape], f"{name}/BlockReshape")
            axes = self.g.init(f"{name}.block_axes", np.array([-1], dtype=np.int64))
            self._blocksums[x] = self.g.node("ReduceSum", [r, axes], f"{name}/BlockSum", keepdims=0)
        return self._blocksums[x]

    # -- blocks -----------------------------------------------------------------
    def _norm_weight(self, tensor: str) -> str:
        return self.g.init(tensor, self.m.float32(tensor))

    def _embedding(self) -> str:
        name = "/model/embed_tokens"
        if self._kind("token_embd.weight") != "float":
            return self._embedding_blocks(name, self.m.blocks("token_embd.weight"))
        self._emb_f32 = self.g.init("embed.weight", self.m.float32("token_embd.weight"))
        return self.g.node("Gather", [self._emb_f32, "input_ids"], f"{name}/Gather")

    def _embedding_blocks(self, name: str, b: Blocks) -> str:
        """Gather rows of blocks exactly: GatherBlockQuantized, plus the rows' remainder per 32 weights."""
        data, rest = _nbits_pieces(b)
        e = self.g.node(
            "GatherBlockQuantized",
            [self.g.init("embed.qweight", data.reshape(self.cfg.vocab, -1)), "input_ids", self.g.init("embed.scales", b.scale)],
            f"{name}/GatherBlockQuantized",
            domain=MS,
            bits=b.bits,
            block_size=b.block,
            quantize_axis=1,
            gather_axis=0,
        )
        if rest is None:
            return e
        h = self.cfg.hidden
        r = self.g.node("Gather", [self.g.init("embed.block_bias", rest), "input_ids"], f"{name}/BlockBias")  # (B, S, H/32)
        r = self.g.node("Unsqueeze", [r, self.g.init("embed.block_axis", np.array([-1]))], f"{name}/BlockBiasAxis")
        e = self.g.node("Reshape", [e, self.g.init("embed.block_shape", np.array([0, 0, h // QK, QK]))], f"{name}/Blocks")
        e = self.g.node("Add", [e, r], f"{name}/Add")
        return self.g.node("Reshape", [e, self.g.init("embed.shape", np.array([0, 0, h]))], f"{name}/Rows")

    def _lm_head(self, x: str) -> str:
        name = "/lm_head"
        head = "token_embd.weight" if self.cfg.tied_embeddings else "output.weight"
        if self._kind(head) != "float":
            return self._linear(x, [head], name, lambda: self._blocksum(x, self.cfg.hidden, name))
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
        """seqlens_k = committed+new-1 per row, total_sequence_length = mask width (int32); both
        one more for a one-token pass when attention is padded (its copy row comes after it)."""
        g = self.g
        s = g.node("ReduceSum", ["attention_mask", g.init("mask.axes", np.array([1]))], "/model/mask/ReduceSum", keepdims=0)
        s1 = g.node("Sub", [s, g.init("mask.one", np.array(1, dtype=np.int64))], "/model/mask/Sub")
        shape = g.node("Shape", ["attention_mask"], "/model/mask/Shape")
        width = g.node("Gather", [shape, g.init("mask.idx1", np.array(1, dtype=np.int64))], "/model/mask/Width", axis=0)
        if self.pad_attention:
            ids_shape = g.node("Shape", ["input_ids"], "/model/pad/Shape")
            n = g.node("Gather", [ids_shape, g.init("pad.idx1", np.array([1], dtype=np.int64))], "/model/pad/S", axis=0)
            one_token = g.node("Equal", [n, g.init("pad.one", np.array(1, dtype=np.int64))], "/model/pad/Equal")
            pad = g.node("Cast", [one_token], "/model/pad/Pad", to=TensorProto.INT64)  # (1,)
            self._pad = (pad, n)
            s1 = g.node("Add", [s1, pad], "/model/pad/SeqLens")
            width = g.node("Add", [width, g.node("Squeeze", [pad], "/model/pad/Scalar")], "/model/pad/Width")
        seqlens = g.node("Cast", [s1], "/model/mask/SeqLens", to=TensorProto.INT32)
        total = g.node("Cast", [width], "/model/mask/Total", to=TensorProto.INT32)
        return seqlens, total

    def _attention(self, i: int, x: str, seqlens: str, total: str, cos: str, sin: str) -> str:
        c = self.cfg
        p = f"/model/layers.{i}/attn"
        blk = f"blk.{i}"
        bs = lambda: self._blocksum(x, c.hidden, p)  # noqa: E731 (made only for weights with a min)
        bias = [f"{blk}.attn_{t}.bias" for t in "qkv"] if c.qkv_bias else None
        qkv = self._linear(x, [f"{blk}.attn_{t}.weight" for t in "qkv"], f"{p}/qkv_proj", bs, bias)
        if self._pad:  # (B, S, D) -> (B, S + pad, D): a one-token pass's row, twice
            zero, axis = self.g.init("pad.zero", np.array([0])), self.g.init("pad.axis1", np.array([1]))
            copy = self.g.node("Slice", [qkv, zero, self._pad[0], axis], f"{p}/PadRow")
            qkv = self.g.node("Concat", [qkv, copy], f"{p}/PadConcat", axis=1)
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
        if self._pad:  # the copy row's output goes
            a = self.g.node("Slice", [a, self.g.init("pad.zero", np.array([0])), self._pad[1],
                                      self.g.init("pad.axis1", np.array([1]))], f"{p}/Unpad")
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
        if g.half_activations:  # logits leave as float32, whatever the activations
            g.nodes.append(helper.make_node("Cast", [logits], ["logits"], name="/model/logits", to=TensorProto.FLOAT))
        else:
            g.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="/model/logits"))
        return self._model()

    def _model(self) -> onnx.ModelProto:
        c, g = self.cfg, self.g
        f = TensorProto.FLOAT16 if g.half_activations else TensorProto.FLOAT  # the KV cache's type
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
            helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, []),
        ]
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "logits_length", c.vocab])]
        kv = ["batch_size", c.n_kv_heads, "past_sequence_length", c.head_dim]
        kv_out = ["batch_size", c.n_kv_heads, "present_sequence_length", c.head_dim]
        for i in range(c.n_layers):
            pk, pv, ok, ov = kv_names(i)
            inputs += [helper.make_tensor_value_info(pk, f, kv), helper.make_tensor_value_info(pv, f, kv)]
            outputs += [helper.make_tensor_value_info(ok, f, kv_out), helper.make_tensor_value_info(ov, f, kv_out)]
        graph = helper.make_graph(g.nodes, "memspec_decoder", inputs, outputs)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)], ir_version=10,
            producer_name="memspec",
        )
        # The weights go in last, one at a time, each released once copied: make_graph and
        # make_model would each copy them all (three copies of a 7 GB fp32 1.5B at once).
        inits, g.inits = g.inits, []
        for k in range(len(inits)):
            model.graph.initializer.append(inits[k])
            inits[k] = None
        props = {"memspec.kv_layout": "shared_buffer", "memspec.variant": self.variant,
                 "memspec.graph": str(GRAPH_VERSION)}
        if self.pad_attention:
            props["memspec.attention_pad"] = "1"  # a one-token pass writes one slot past the token
        helper.set_model_props(model, props)
        return model


GRAPH_VERSION = 2  # 2: attention padded for one-token passes; a pull re-converts an older graph

PROTOBUF_LIMIT = 2**31 - 2**26  # a protobuf must stay under 2 GiB; keep a margin for the graph itself


def external_data_path(onnx_path: str | Path) -> Path:
    """Where a model too large for one protobuf keeps its weights: `<file>.data` beside it."""
    return Path(f"{onnx_path}.data")


def convert(gguf_path: str | Path, out_path: str | Path, variant: str, max_positions: int | None = None) -> Path:
    """Convert one GGUF into one ONNX decoder file; returns the file's path.

    A model whose weights pass the 2 GiB protobuf limit (the fp32 variant of a 1.5B) keeps
    them in external_data_path(out_path), written before the .onnx file appears."""
    model = GGUFModel(gguf_path)  # refuses an unsupported architecture or tensor type before any write
    proto = DecoderBuilder(model, variant, max_positions).build()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    data = external_data_path(out)
    data.unlink(missing_ok=True)  # a previous conversion's weights: onnx would append to them
    if sum(t.ByteSize() for t in proto.graph.initializer) > PROTOBUF_LIMIT:
        onnx.save_model(proto, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
    else:
        onnx.save_model(proto, str(tmp))
    tmp.replace(out)
    return out
