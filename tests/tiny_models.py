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
