"""Small random llama/qwen2 decoders built inside the tests, in memspec's ONNX layout.

GroupQueryAttention on the CPU needs head_dim to be a multiple of 16."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from memspec.models.convert import DecoderBuilder
from memspec.models.gguf import ArrayWeights, DecoderConfig


def tiny_config(vocab: int = 16, hidden: int = 64, layers: int = 2, arch: str = "llama") -> DecoderConfig:
    """arch="qwen2": Q/K/V biases and a separate output head."""
    qwen = arch == "qwen2"
    return DecoderConfig(n_layers=layers, hidden=hidden, n_heads=4, n_kv_heads=2, head_dim=hidden // 4,
                         ffn=2 * hidden, vocab=vocab, rope_theta=10000.0, rms_eps=1e-5, context_length=256,
                         tied_embeddings=not qwen, arch=arch, qkv_bias=qwen)


def tiny_weights(cfg: DecoderConfig, seed: int, scale: float = 1.0) -> ArrayWeights:
    """Random weights; `scale` sharpens the output distribution."""
    rng = np.random.default_rng(seed)
    h, kv = cfg.hidden, cfg.n_kv_heads * cfg.head_dim
    t = {"token_embd.weight": rng.standard_normal((cfg.vocab, h)) * scale,
         "output_norm.weight": np.ones(h)}
    if not cfg.tied_embeddings:
        t["output.weight"] = rng.standard_normal((cfg.vocab, h)) * scale
    for i in range(cfg.n_layers):
        shapes = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
                  "ffn_gate": (cfg.ffn, h), "ffn_up": (cfg.ffn, h), "ffn_down": (h, cfg.ffn)}
        for name, shape in shapes.items():
            t[f"blk.{i}.{name}.weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
        if cfg.qkv_bias:
            for name, n in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
                t[f"blk.{i}.{name}.bias"] = rng.standard_normal(n) * 0.5
        t[f"blk.{i}.attn_norm.weight"] = np.ones(h)
        t[f"blk.{i}.ffn_norm.weight"] = np.ones(h)
    return ArrayWeights(cfg, t)


def build_tiny(path: Path, seed: int, scale: float = 1.0, pad_attention: bool = True, **cfg_kwargs) -> Path:
    """pad_attention=False: a graph without the one-token attention padding (as before GRAPH_VERSION 2)."""
    cfg = tiny_config(**cfg_kwargs)
    onnx.save(DecoderBuilder(tiny_weights(cfg, seed, scale), "fp32", 256, pad_attention=pad_attention).build(),
              str(path))
    return path


def tiny_pair(folder: Path, vocab: int = 16):
    """A tiny ONNX target (seed 1) and a draft over the same vocabulary (seed 2), 64 tokens of
    context, one thread: (DecoderSession, DraftModel) for the decode loop's tests."""
    from memspec.runtime.config import SessionConfig
    from memspec.runtime.sessions import DecoderSession
    from memspec.speculation.drafts import DraftModel

    cfg = SessionConfig(max_context=64, intra_op_threads=1)
    target = DecoderSession(build_tiny(folder / "target.onnx", seed=1, scale=0.1, vocab=vocab), cfg)
    draft = DecoderSession(build_tiny(folder / "draft.onnx", seed=2, scale=0.1, vocab=vocab), cfg)
    return target, DraftModel("tiny-draft", draft, np.arange(vocab), vocab)


def with_row_dependence(path: Path, out: Path, lone_rows_only: bool) -> Path:
    """A copy of a decoder graph whose logits depend on how many tokens the pass feeds, as ONNX
    Runtime's 4-bit kernels do on AVX2-only CPUs: lone_rows_only=True adds 1e-3 to every logit of
    a one-token pass (a GEMV kernel of its own, which padding to two rows avoids); False adds 1e-3
    times the pass's token count (no padding helps)."""
    from onnx import TensorProto, helper, numpy_helper

    m = onnx.load(str(path))
    g = m.graph
    for node in g.node:  # the node that makes the logits now makes logits_raw
        node.output[:] = ["logits_raw" if o == "logits" else o for o in node.output]
    g.initializer.extend([numpy_helper.from_array(np.array([1], np.int64), "rowdep/one"),
                          numpy_helper.from_array(np.array(1e-3, np.float32), "rowdep/eps")])
    count = [helper.make_node("Shape", ["input_ids"], ["rowdep/shape"], start=1, end=2),
             helper.make_node("Cast", ["rowdep/shape"], ["rowdep/n"], to=TensorProto.FLOAT)]
    if lone_rows_only:
        count = [helper.make_node("Shape", ["input_ids"], ["rowdep/shape"], start=1, end=2),
                 helper.make_node("Equal", ["rowdep/shape", "rowdep/one"], ["rowdep/lone"]),
                 helper.make_node("Cast", ["rowdep/lone"], ["rowdep/n"], to=TensorProto.FLOAT)]
    g.node.extend([*count, helper.make_node("Mul", ["rowdep/n", "rowdep/eps"], ["rowdep/bias"]),
                   helper.make_node("Add", ["logits_raw", "rowdep/bias"], ["logits"])])
    onnx.save(m, str(out))
    return out
