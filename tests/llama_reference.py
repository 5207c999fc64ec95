"""A float64 NumPy llama/qwen2 forward pass: the reference the ONNX graphs are checked against.

Written from the model's definition (RMSNorm, rotary half-rotation, grouped-query
attention with qwen2's Q/K/V biases, SwiGLU, tied or separate head) and kept
deliberately plain: no cache tricks.
"""

from __future__ import annotations

import numpy as np

from memspec.models.gguf import GGUFModel


class ReferenceLlama:
    def __init__(self, model: GGUFModel, n_layers: int | None = None):
        self.cfg = c = model.config
        self.n_layers = n_layers or c.n_layers
        f = lambda n: model.float32(n).astype(np.float64)  # noqa: E731
        self.emb = f("token_embd.weight")
        self.norm = f("output_norm.weight")
        self.head = self.emb if c.tied_embeddings else f("output.weight")
        self.layers = [
            {k: f(f"blk.{i}.{k}.weight") for k in
             ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
            for i in range(self.n_layers)
        ]
        for i, L in enumerate(self.layers):  # zero biases where the model has none
            for k in ("attn_q", "attn_k", "attn_v"):
                L[f"{k}.bias"] = f(f"blk.{i}.{k}.bias") if c.qkv_bias else np.zeros(L[k].shape[0])

    def _rms(self, x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.cfg.rms_eps) * w

    def _rope(self, x, pos):  # x: (heads, T, hd)
        hd = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (np.arange(0, hd, 2) / hd))
        ang = pos[:, None] * inv[None, :]
        cos, sin = np.cos(ang), np.sin(ang)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def logits(self, ids: list[int]) -> np.ndarray:
        """(T, V) float64 logits for every position of `ids`."""
        return self.hidden_states(ids)[-1] @ self.head.T

    def hidden_states(self, ids: list[int]) -> list[np.ndarray]:
        """n_layers + 1 arrays (T, H) float64, as a Hugging Face model's hidden_states: the
        embeddings, the residual stream after each layer but the last, the final norm's output."""
        c = self.cfg
        T = len(ids)
        x = self.emb[np.asarray(ids)]
        pos = np.arange(T, dtype=np.float64)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        rep = c.n_heads // c.n_kv_heads
        states = [x]
        for L in self.layers:
            h = self._rms(x, L["attn_norm"])
            q = (h @ L["attn_q"].T + L["attn_q.bias"]).reshape(T, c.n_heads, c.head_dim).transpose(1, 0, 2)
            k = (h @ L["attn_k"].T + L["attn_k.bias"]).reshape(T, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            v = (h @ L["attn_v"].T + L["attn_v.bias"]).reshape(T, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
            q, k = self._rope(q, pos), self._rope(k, pos)
            k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
            s = q @ k.transpose(0, 2, 1) / np.sqrt(c.head_dim) + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            a = (p @ v).transpose(1, 0, 2).reshape(T, -1)
            x = x + a @ L["attn_output"].T
            h = self._rms(x, L["ffn_norm"])
            g = h @ L["ffn_gate"].T
            x = x + ((g / (1 + np.exp(-g))) * (h @ L["ffn_up"].T)) @ L["ffn_down"].T
            states.append(x)
        return states[:-1] + [self._rms(x, self.norm)]


def first_position_logits(model: GGUFModel, token: int) -> np.ndarray:
    """(V,) float64 logits after one token, one layer's weights dequantized at a time: with a single
    position attention is the token's own value, so even a 1.5B model's reference fits in memory."""
    c = model.config
    f = lambda n: model.float32(n).astype(np.float64)  # noqa: E731
    rms = lambda x, w: x / np.sqrt((x * x).mean() + c.rms_eps) * w  # noqa: E731
    x = model.float32("token_embd.weight")[token].astype(np.float64)
    for i in range(c.n_layers):
        w = lambda k: f(f"blk.{i}.{k}")  # noqa: E731
        h = rms(x, w("attn_norm.weight"))
        v = h @ w("attn_v.weight").T + (w("attn_v.bias") if c.qkv_bias else 0.0)
        a = np.repeat(v.reshape(c.n_kv_heads, c.head_dim), c.n_heads // c.n_kv_heads, axis=0).reshape(-1)
        x = x + a @ w("attn_output.weight").T
        h = rms(x, w("ffn_norm.weight"))
        g = h @ w("ffn_gate.weight").T
        x = x + ((g / (1 + np.exp(-g))) * (h @ w("ffn_up.weight").T)) @ w("ffn_down.weight").T
    head = "token_embd.weight" if c.tied_embeddings else "output.weight"
    return rms(x, f("output_norm.weight")) @ f(head).T
