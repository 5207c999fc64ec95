"""Read a GGUF file: its key/value metadata, and a llama's hyper-parameters and tensors.

:func:`read_metadata` parses only the header and the key/value section, so the
tokenizer gets its vocabulary in a few tens of milliseconds; ``gguf.GGUFReader``
takes seconds on the same file because it wraps every string in a numpy view.
:class:`GGUFModel` takes its metadata from :func:`read_metadata` too, and the
``gguf`` package only for the tensors.

The GGUF stores weights the way llama.cpp wants them.  This module turns them
back into the layout of the Hugging Face checkpoint (``W[out, in]``, Q and K
rows in the non-interleaved rotary order) either as float32 or as raw
quantized blocks for the 4-bit ONNX variant.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from memspec.errors import ModelFormatError

# Bytes per 32-weight block (see ggml-common.h): Q4_1 = fp16 d, fp16 m, 16 nibbles;
# Q8_0 = fp16 d, 32 int8.
QK = 32
Q4_1_BLOCK_BYTES = 20
Q8_0_BLOCK_BYTES = 34

# Metadata value types (gguf.GGUFValueType): scalar code -> struct format, plus string and array.
_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALARS: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a llama decoder, as the GGUF metadata gives them."""

    n_layers: int  # number of transformer blocks
    hidden: int  # model width (embedding length)
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # width of one head
    ffn: int  # SwiGLU inner width
    vocab: int  # vocabulary size
    rope_theta: float  # rotary base frequency
    rms_eps: float  # RMSNorm epsilon
    context_length: int  # longest context the model was trained for
    tied_embeddings: bool  # LM head shares the token embedding


@dataclass(frozen=True)
class Q4Blocks:
    """A Q4_1 matrix unpacked into MatMulNBits pieces.  w = d * (q - 8) + (m + 8 d)."""

    q: np.ndarray  # (N, n_blocks, 32) uint8 in [0, 15]
    d: np.ndarray  # (N, n_blocks) float32 scale
    m: np.ndarray  # (N, n_blocks) float32 minimum


@dataclass(frozen=True)
class Q8Blocks:
    """A Q8_0 matrix: w = d * q."""

    q: np.ndarray  # (N, n_blocks, 32) int8
    d: np.ndarray  # (N, n_blocks) float32 scale


class _Cursor:
    """Sequential little-endian reader over a GGUF header and key/value section."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def error(self, reason: str) -> ModelFormatError:
        return ModelFormatError(f"{self.path} is not a readable GGUF file: {reason}")

    def truncated(self, n: int) -> ModelFormatError:
        return self.error(f"metadata needs {n} bytes at byte {self.pos}, past the end ({len(self.buf)} bytes)")

    def take(self, n: int) -> bytes:
        raw = self.buf[self.pos : self.pos + n]
        if len(raw) != n:
            raise self.truncated(n)
        self.pos += n
        return raw

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        try:
            value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        except struct.error:  # fewer than size bytes left
            raise self.truncated(size) from None
        self.pos += size
        return value

    def string(self) -> str:
        raw = self.take(self.scalar("Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"invalid UTF-8 string {raw[:40]!r} in the metadata") from None

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            return self.array()
        if vtype not in _GGUF_SCALARS:
            raise self.error(f"unknown metadata value type {vtype} at byte {self.pos}")
        return self.scalar(_GGUF_SCALARS[vtype])

    def array(self) -> list[Any]:
        etype, count = self.scalar("I"), self.scalar("Q")
        fmt = _GGUF_SCALARS.get(etype)
        if fmt is None:
            return [self.value(etype) for _ in range(count)]
        raw = self.take(count * struct.calcsize(fmt))
        return np.frombuffer(raw, dtype=np.dtype("<" + fmt)).tolist()


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file (v2/v3) into plain Python values.

    Tensor infos are never read.  Raises ModelFormatError, naming the offending
    value, for a missing, truncated or malformed file.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"GGUF file not found: {path}")
    if path.stat().st_size == 0:
        raise ModelFormatError(f"{path} is not a readable GGUF file: it is empty")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        magic = buf[:4]
        if magic != _GGUF_MAGIC:
            raise cur.error(f"magic {magic!r}, expected {_GGUF_MAGIC!r}")
        cur.pos = 4
        version = cur.scalar("I")
        if version not in _GGUF_VERSIONS:
            raise cur.error(f"unsupported GGUF version {version} (expected 2 or 3)")
        cur.scalar("Q")  # tensor count: the tensors are GGUFModel's
        meta: dict[str, Any] = {}
        for _ in range(cur.scalar("Q")):
            key = cur.string()
            if key in meta:
                raise cur.error(f"metadata key {key!r} appears twice")
            meta[key] = cur.value(cur.scalar("I"))
        return meta


class GGUFModel:
    """A llama GGUF opened for conversion."""

    def __init__(self, path: str | Path):
        import gguf  # conversion-only dependency

        self.path = Path(path)
        self.metadata = read_metadata(self.path)  # key -> value; refuses missing or malformed files
        try:
            reader = gguf.GGUFReader(self.path)
        except Exception as exc:  # gguf raises bare ValueError/struct errors
            raise ModelFormatError(f"{self.path} is not a readable GGUF file: {exc}") from None
        self._gguf = gguf
        self._tensors = {t.name: t for t in reader.tensors}
        self.config = self._read_config()

    # -- metadata ---------------------------------------------------------
    def field(self, key: str, default=None):
        """Return one metadata value (str/int/float/bool or a list of them)."""
        return self.metadata.get(key, default)

    def _require(self, key: str):
        v = self.field(key)
        if v is None:
            raise ModelFormatError(f"{self.path.name}: metadata key {key!r} is missing")
        return v

    def _read_config(self) -> LlamaConfig:
        arch = self.field("general.architecture")
        if arch != "llama":
            raise ModelFormatError(
                f"{self.path.name}: architecture is {arch!r}, only 'llama' GGUF files can be converted"
            )
        n_heads = int(self._require("llama.attention.head_count"))
        hidden = int(self._require("llama.embedding_length"))
        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise ModelFormatError(f"{self.path.name}: tensor 'token_embd.weight' is missing")
        return LlamaConfig(
            n_layers=int(self._require("llama.block_count")),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(self.field("llama.attention.head_count_kv", n_heads)),
            head_dim=int(self.field("llama.rope.dimension_count", hidden // n_heads)),
            ffn=int(self._require("llama.feed_forward_length")),
            vocab=int(emb.shape[1]),
            rope_theta=float(self.field("llama.rope.freq_base", 10000.0)),
            rms_eps=float(self._require("llama.attention.layer_norm_rms_epsilon")),
            context_length=int(self.field("llama.context_length", 2048)),
            tied_embeddings="output.weight" not in self._tensors,
        )

    # -- tensors ----------------------------------------------------------
    def _tensor(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{self.path.name}: tensor {name!r} is missing")
        return t

    def qtype(self, name: str) -> str:
        """The ggml type name of a tensor ('F32', 'Q4_1', ...)."""
        return self._tensor(name).tensor_type.name

    def _row_order(self, name: str, n_rows: int) -> np.ndarray | None:
        """Row permutation that undoes convert_hf_to_gguf's Q/K permute, else None."""
        if name.endswith("attn_q.weight"):
            heads = self.config.n_heads
        elif name.endswith("attn_k.weight"):
            heads = self.config.n_kv_heads
        else:
            return None
        # GGUF row r = HF row perm[r] with perm = reshape(h, 2, hd/2).swapaxes(1, 2);
        # the inverse reads HF rows back in (h, hd/2, 2) -> (h, 2, hd/2) order.
        idx = np.arange(n_rows).reshape(heads, n_rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
        return idx

    def float32(self, name: str) -> np.ndarray:
        """Dequantized tensor as float32, HF layout ((N, K) for matrices)."""
        t = self._tensor(name)
        w = self._gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if w.ndim == 2:
            order = self._row_order(name, w.shape[0])
            if order is not None:
                w = w[order]
        return np.ascontiguousarray(w)

    def _raw_blocks(self, name: str, block_bytes: int) -> np.ndarray:
        t = self._tensor(name)
        data = np.asarray(t.data)
        n_rows = data.shape[0]
        blocks = data.reshape(n_rows, -1, block_bytes)
        order = self._row_order(name, n_rows)
        return blocks[order] if order is not None else blocks

    def q4_1(self, name: str) -> Q4Blocks:
        """Raw Q4_1 blocks of a matrix, rows in HF order."""
        if self.qtype(name) != "Q4_1":
            raise ModelFormatError(f"{name} is {self.qtype(name)}, expected Q4_1")
        b = self._raw_blocks(name, Q4_1_BLOCK_BYTES)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = b[..., 4:]
        # ggml packs weight j in the low nibble of byte j and weight j+16 in the high one.
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        return Q4Blocks(q=q, d=d, m=m)

    def q8_0(self, name: str) -> Q8Blocks:
        """Raw Q8_0 blocks of a matrix, rows in HF order."""
        if self.qtype(name) != "Q8_0":
            raise ModelFormatError(f"{name} is {self.qtype(name)}, expected Q8_0")
        b = self._raw_blocks(name, Q8_0_BLOCK_BYTES)
        d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = b[..., 2:].copy().view(np.int8)
        return Q8Blocks(q=q, d=d)


class ArrayWeights:
    """Float32 weights held in memory under GGUF tensor names (a trained draft).

    Offers the part of GGUFModel's interface that convert.DecoderBuilder uses,
    so a model trained here is built into the same ONNX layout as the target.
    With `quantize` ("Q8_0" or "Q4_1") every matrix is offered as blocks of that
    ggml type, rounded to nearest here, so the builder's quantized variant can use them.
    """

    QUANTIZE = ("Q8_0", "Q4_1")

    def __init__(self, config: LlamaConfig, tensors: dict[str, np.ndarray], quantize: str | None = None):
        if quantize is not None and quantize not in self.QUANTIZE:
            raise ValueError(f"quantize: {quantize!r} is not one of {', '.join(self.QUANTIZE)}")
        self.config = config
        self.quantize = quantize
        self._tensors = {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}

    def qtype(self, name: str) -> str:
        if name not in self._tensors:
            raise ModelFormatError(f"tensor {name!r} is missing")
        t = self._tensors[name]
        return self.quantize if self.quantize and t.ndim == 2 and t.shape[1] % QK == 0 else "F32"

    def float32(self, name: str) -> np.ndarray:
        self.qtype(name)
        return self._tensors[name]

    def _blocks(self, name: str, qtype: str) -> np.ndarray:
        if self.qtype(name) != qtype:
            raise ModelFormatError(f"{name} is {self.qtype(name)}, expected {qtype}")
        w = self._tensors[name]
        return w.reshape(w.shape[0], -1, QK)  # (N, n_blocks, 32)

    def q8_0(self, name: str) -> Q8Blocks:
        """Symmetric 8-bit blocks: d = max|w| / 127 per block of 32, q = round(w / d)."""
        b = self._blocks(name, "Q8_0")
        d = np.abs(b).max(axis=-1) / 127.0
        q = np.rint(b / np.where(d == 0, 1.0, d)[..., None]).clip(-127, 127).astype(np.int8)
        return Q8Blocks(q=q, d=d.astype(np.float32))

    def q4_1(self, name: str) -> Q4Blocks:
        """Asymmetric 4-bit blocks: m = min, d = (max - min) / 15 per block of 32, q = round((w - m) / d)."""
        b = self._blocks(name, "Q4_1")
        m = b.min(axis=-1)
        d = (b.max(axis=-1) - m) / 15.0
        q = np.rint((b - m[..., None]) / np.where(d == 0, 1.0, d)[..., None]).clip(0, 15).astype(np.uint8)
        return Q4Blocks(q=q, d=d.astype(np.float32), m=m.astype(np.float32))
