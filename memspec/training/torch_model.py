"""The draft's torch model: a llama decoder whose tensor names are the GGUF's (training only).

The teacher is this model with the target's GGUF weights (float32); a draft is this model
at a smaller shape (memspec.training.drafts.draft_config).  `tensors()` hands the weights to
the ONNX export under the GGUF names.  Importing this module imports torch, so the training
pipeline imports it only when it runs (`memspec --help` never does).
"""

from __future__ import annotations

import numpy as np

from memspec.models.gguf import DecoderConfig
from memspec.training import require_torch

torch = require_torch()
nn, F = torch.nn, torch.nn.functional


def rms(x, w, eps):
    """RMSNorm over the last axis, scaled by w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, cos, sin):  # HF rotate_half (non-interleaved)
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


class Block(nn.Module):
    """One pre-norm decoder layer: grouped-query attention with rotary positions, then a SwiGLU MLP."""

    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.c = c
        self.attn_norm = nn.Parameter(torch.ones(c.hidden))
        self.attn_q = nn.Linear(c.hidden, c.n_heads * c.head_dim, bias=c.qkv_bias)  # qwen2: Q/K/V biases
        self.attn_k = nn.Linear(c.hidden, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.attn_v = nn.Linear(c.hidden, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.attn_output = nn.Linear(c.n_heads * c.head_dim, c.hidden, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(c.hidden))
        self.ffn_gate = nn.Linear(c.hidden, c.ffn, bias=False)
        self.ffn_up = nn.Linear(c.hidden, c.ffn, bias=False)
        self.ffn_down = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x, cos, sin, mask, cache, i):
        c = self.c
        B, T, _ = x.shape
        h = rms(x, self.attn_norm, c.rms_eps)
        q = self.attn_q(h).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.attn_k(h).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, kvh, T, hd)
        v = self.attn_v(h).view(B, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:
            if len(cache) > i:
                k = torch.cat([cache[i][0], k], dim=2)
                v = torch.cat([cache[i][1], v], dim=2)
                cache[i] = (k, v)
            else:
                cache.append((k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        x = x + self.attn_output(a.transpose(1, 2).reshape(B, T, -1))
        h = rms(x, self.ffn_norm, c.rms_eps)
        return x + self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))


class Llama(nn.Module):
    """Llama or qwen2 decoder, tied or separate head; tensor names map 1:1 to GGUF names (see `tensors`)."""

    def __init__(self, c: DecoderConfig):
        super().__init__()
        self.c = c
        self.token_embd = nn.Embedding(c.vocab, c.hidden)
        self.output = None if c.tied_embeddings else nn.Linear(c.hidden, c.vocab, bias=False)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.output_norm = nn.Parameter(torch.ones(c.hidden))
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids, pos=None, mask=None, cache=None):
        """ids (B, T) -> logits (B, T, V).  pos (B, T) positions; mask (B, 1, T, S) bool, None = causal."""
        B, T = ids.shape
        if pos is None:
            pos = torch.arange(T).expand(B, T)
        ang = pos.to(torch.float64)[..., None] * self.inv_freq  # (B, T, hd/2)
        ang = torch.cat([ang, ang], dim=-1)[:, None]  # (B, 1, T, hd)
        x = self.token_embd(ids)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)  # the model's dtype (float32, or bfloat16 for a teacher)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, mask, cache, i)
        head = self.token_embd.weight if self.output is None else self.output.weight
        return rms(x, self.output_norm, self.c.rms_eps) @ head.T

    def tensors(self) -> dict[str, np.ndarray]:
        """Float32 weights under GGUF names, HF layout (what ArrayWeights takes)."""
        out = {"token_embd.weight": self.token_embd.weight, "output_norm.weight": self.output_norm}
        if self.output is not None:
            out["output.weight"] = self.output.weight
        for i, blk in enumerate(self.blocks):
            for name, p in blk.named_parameters():  # attn_q.weight, attn_q.bias (GGUF's names), attn_norm
                out[f"blk.{i}.{name}" if "." in name else f"blk.{i}.{name}.weight"] = p
        return {k: v.detach().float().cpu().numpy() for k, v in out.items()}

    def load_tensors(self, tensors) -> None:
        """Inverse of `tensors`: takes a name -> array mapping or a GGUFModel/ArrayWeights."""
        get = tensors.float32 if hasattr(tensors, "float32") else tensors.__getitem__
        with torch.no_grad():
            for name in self.tensors_names():
                self._param(name).copy_(torch.from_numpy(np.array(get(name), dtype=np.float32)))

    def tensors_names(self) -> list[str]:
        names = ["token_embd.weight", "output_norm.weight"] + ([] if self.output is None else ["output.weight"])
        for i in range(self.c.n_layers):
            names += [f"blk.{i}.{k}.weight" for k in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")]
            if self.c.qkv_bias:
                names += [f"blk.{i}.{k}.bias" for k in ("attn_q", "attn_k", "attn_v")]
        return names

    def _param(self, name: str):
        if name == "token_embd.weight":
            return self.token_embd.weight
        if name == "output_norm.weight":
            return self.output_norm
        if name == "output.weight":
            return self.output.weight
        _, i, k, kind = name.split(".")
        p = getattr(self.blocks[int(i)], k)
        return p if isinstance(p, nn.Parameter) else getattr(p, kind)  # a Linear's .weight or .bias
