"""Writing a decoder as a GGUF file: how memspec stores the drafts it trains or cuts.

A GGUF of ggml blocks is what the native engine runs as it is (memspec.runtime.native_target)
and what the ONNX builder reads (memspec.models.gguf.GGUFModel), so one file serves both
engines.  Its weights come in as float32 under the GGUF's tensor names, rows in the Hugging Face
order that GGUFModel.float32 hands out; a llama file stores its Q and K rows permuted the way
llama.cpp's converter writes them, so they are permuted here (and un-permuted on the way back).

    write_decoder(path, config, tensors, qtype="Q8_0")       # matrices as Q8_0 blocks

Every matrix whose rows are whole blocks of 32 becomes `qtype` blocks (`embd_qtype` for the token
embedding and a separate LM head); vectors (norms, biases) stay float32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from memspec.models.gguf import ARCHITECTURES, HEAD_TENSORS, DecoderConfig, QK

QTYPES = ("Q8_0", "Q4_0", "F32")  # what a draft is written as: 8-bit, 4-bit symmetric, or float


def gguf_row_order(name: str, config: DecoderConfig, n_rows: int) -> np.ndarray | None:
    """Row permutation that turns a Q or K matrix from Hugging Face order into a llama GGUF's
    (convert_hf_to_gguf's permute: each head's rotary halves interleaved); None for other
    tensors and for qwen2, whose GGUF keeps the checkpoint's order."""
    if config.arch != "llama":
        return None
    if name.endswith("attn_q.weight"):
        heads = config.n_heads
    elif name.endswith("attn_k.weight"):
        heads = config.n_kv_heads
    else:
        return None
    # GGUF row r holds HF row perm[r]: per head, (2, hd/2) -> (hd/2, 2)
    return np.arange(n_rows).reshape(heads, 2, n_rows // heads // 2).swapaxes(1, 2).reshape(-1)


def _quantized(w: np.ndarray, qtype: str):
    """(data, ggml type) of one tensor as `qtype` blocks, or float32 where its rows are not whole blocks."""
    from gguf import GGMLQuantizationType, quants

    if qtype == "F32" or w.ndim != 2 or w.shape[1] % QK:
        return np.ascontiguousarray(w, dtype=np.float32), GGMLQuantizationType.F32
    t = GGMLQuantizationType[qtype]
    return quants.quantize(np.ascontiguousarray(w, dtype=np.float32), t), t


def write_decoder(path: str | Path, config: DecoderConfig, tensors: dict[str, np.ndarray], qtype: str = "Q8_0",
                  embd_qtype: str | None = None, name: str | None = None) -> Path:
    """Write `tensors` (GGUF names, float32, HF row order) as a GGUF decoder at `path`, atomically.

    qtype: the matrices' ggml type (QTYPES); embd_qtype: the token embedding's and LM head's
    (default: qtype).  name: general.name.  Raises ValueError on an unknown type or architecture."""
    import gguf

    for q in (qtype, embd_qtype or qtype):
        if q not in QTYPES:
            raise ValueError(f"qtype: {q!r} is not one of {', '.join(QTYPES)}")
    if config.arch not in ARCHITECTURES:
        raise ValueError(f"architecture {config.arch!r}: memspec writes {', '.join(ARCHITECTURES)} only")
    if "token_embd.weight" not in tensors:
        raise ValueError("tensor 'token_embd.weight' is missing")
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), config.arch)
    if name:
        w.add_name(name)
    w.add_context_length(config.context_length)
    w.add_embedding_length(config.hidden)
    w.add_block_count(config.n_layers)
    w.add_feed_forward_length(config.ffn)
    w.add_head_count(config.n_heads)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(float(config.rope_theta))
    w.add_layer_norm_rms_eps(float(config.rms_eps))
    for tname, t in tensors.items():
        t = np.asarray(t, dtype=np.float32)
        order = gguf_row_order(tname, config, t.shape[0]) if t.ndim == 2 else None
        if order is not None:
            t = t[order]
        data, ggml_type = _quantized(t, (embd_qtype or qtype) if tname in HEAD_TENSORS else qtype)
        w.add_tensor(tname, data, raw_dtype=ggml_type)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    tmp.replace(path)
    return path
