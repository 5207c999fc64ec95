"""Read a GGUF file: its key/value metadata, and a decoder's hyper-parameters and tensors.

:func:`read_metadata` parses only the header and the key/value section, so the
tokenizer gets its vocabulary in a few tens of milliseconds; ``gguf.GGUFReader``
takes seconds on the same file because it wraps every string in a numpy view.
:class:`GGUFModel` takes its metadata from :func:`read_metadata` too, and the
``gguf`` package only for the tensors.

The GGUF stores weights the way llama.cpp wants them.  This module turns them
back into the layout of the Hugging Face checkpoint (``W[out, in]``, Q and K
rows in the non-interleaved rotary order) either as float32 or as the ggml
blocks' own integers and scales (:class:`Blocks`) for the quantized ONNX variant.
Architectures: llama and qwen2 (llama plus Q/K/V biases, Q/K rows not permuted).
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

QK = 32  # weights per ggml block; per K-quant sub-block that has a min
QK_K = 256  # weights per K-quant super-block
# ggml type -> (weights, bytes) per block, as ggml-common.h lays them out:
#   Q4_0  fp16 d, 16 bytes of nibbles                               w = d*(q - 8)
#   Q4_1  fp16 d, fp16 m, 16 bytes of nibbles                       w = d*q + m
#   Q5_0  fp16 d, 4 bytes of 5th bits, 16 bytes of nibbles          w = d*(q - 16)
#   Q8_0  fp16 d, 32 int8                                           w = d*q
#   Q4_K  fp16 d, fp16 dmin, 12 bytes of 6-bit sc/m, 128 of nibbles  w = d*sc*q - dmin*m per 32
#   Q5_K  as Q4_K plus 32 bytes of 5th bits                          w = d*sc*q - dmin*m per 32
#   Q6_K  128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 sc, fp16 d   w = d*sc*(q - 32) per 16
BLOCK_TYPES: dict[str, tuple[int, int]] = {
    "Q4_0": (QK, 18), "Q4_1": (QK, 20), "Q5_0": (QK, 22), "Q8_0": (QK, 34),
    "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}
FLOAT_TYPES = ("F32", "F16", "BF16")
HEAD_TENSORS = ("token_embd.weight", "output.weight")  # one row per token id: the embedding and the LM head
ARCHITECTURES = ("llama", "qwen2")

# Metadata value types (gguf.GGUFValueType): scalar code -> struct format, plus string and array.
_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALARS: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}


@dataclass(frozen=True)
class DecoderConfig:
    """Hyper-parameters of a llama-style decoder, as the GGUF metadata gives them."""

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
    arch: str = "llama"  # general.architecture: "llama" or "qwen2"
    qkv_bias: bool = False  # Q, K and V projections have biases (qwen2)


@dataclass(frozen=True)
class Q4Blocks:
    """A Q4_1 matrix (what ArrayWeights rounds to): w = d * q + m."""

    q: np.ndarray  # (N, n_blocks, 32) uint8 in [0, 15]
    d: np.ndarray  # (N, n_blocks) float32 scale
    m: np.ndarray  # (N, n_blocks) float32 minimum


@dataclass(frozen=True)
class Q8Blocks:
    """A Q8_0 matrix: w = d * q."""

    q: np.ndarray  # (N, n_blocks, 32) int8
    d: np.ndarray  # (N, n_blocks) float32 scale


@dataclass(frozen=True)
class Blocks:
    """A quantized matrix as its ggml blocks decode: w = scale * (q - zero) + offset, block by block.

    The fields are the file's own integers and the products ggml forms from them
    (d*sc, -dmin*m), so :meth:`dequantize` equals ``gguf.quants.dequantize`` bit for bit.
    """

    q: np.ndarray  # (N, n_blocks, block) uint8, the stored integers (Q8_0's int8 + 128)
    scale: np.ndarray  # (N, n_blocks) float32
    zero: int  # integer zero point of the type: 0 (Q4_1, Q4_K, Q5_K), 8 (Q4_0), 16 (Q5_0), 32 (Q6_K), 128 (Q8_0)
    bits: int  # 4 or 8: the MatMulNBits width that holds q
    offset: np.ndarray | None = None  # (N, K / 32) float32 added per 32 weights (m, -dmin*m), else None

    @property
    def block(self) -> int:
        return self.q.shape[-1]

    def dequantize(self) -> np.ndarray:
        """(N, K) float32, computed in ggml's order."""
        n = self.q.shape[0]
        w = self.scale[..., None] * (self.q.astype(np.int16) - self.zero).astype(np.float32)
        if self.offset is not None:
            w = w.reshape(n, -1, QK) + self.offset[..., None]
        return w.reshape(n, -1)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) float32."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _k_scale_min(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, (n, 8) uint8 each.

    Bytes 0-3 hold sc[0:4] (low 6 bits), 4-7 m[0:4]; 8-11 hold the low nibbles of
    sc[4:8] and the high nibbles of m[4:8], whose top 2 bits sit in bytes 0-7's top bits."""
    d, m, md = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """(n, B) bytes -> (n, 2B) values: each run of `run` bytes gives its low nibbles, then its high ones."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1)


def _bits(qh: np.ndarray, shifts: int, width: int, run: int) -> np.ndarray:
    """(n, B) bytes -> (n, shifts*B) values of `width` bits: each run of `run` bytes, shifted by 0, width, ..."""
    n = qh.shape[0]
    sh = (np.arange(shifts, dtype=np.uint8) * width).reshape(1, 1, shifts, 1)
    return ((qh.reshape(n, -1, 1, run) >> sh) & ((1 << width) - 1)).reshape(n, -1)


def _decode_q4_0(b: np.ndarray) -> Blocks:
    q = _nibbles(b[:, 2:], 16).reshape(-1, 1, QK)
    return Blocks(q=q, scale=_fp16(b[:, 0:2])[:, None], zero=8, bits=4)


def _decode_q4_1(b: np.ndarray) -> Blocks:
    q = _nibbles(b[:, 4:], 16).reshape(-1, 1, QK)
    return Blocks(q=q, scale=_fp16(b[:, 0:2])[:, None], zero=0, bits=4, offset=_fp16(b[:, 2:4])[:, None])


def _decode_q5_0(b: np.ndarray) -> Blocks:
    high = np.unpackbits(b[:, 2:6], axis=-1, bitorder="little")  # bit j of a little-endian uint32: weight j
    q = _nibbles(b[:, 6:], 16) | (high << 4)
    return Blocks(q=q.reshape(-1, 1, QK), scale=_fp16(b[:, 0:2])[:, None], zero=16, bits=8)


def _decode_q8_0(b: np.ndarray) -> Blocks:
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return Blocks(q=q.reshape(-1, 1, QK), scale=_fp16(b[:, 0:2])[:, None], zero=128, bits=8)


def _decode_k(b: np.ndarray, qs: np.ndarray, high: np.ndarray | None, bits: int) -> Blocks:
    """Q4_K / Q5_K: sub-block j of 32 is w = (d*sc[j]) * q - dmin*m[j]."""
    d, dmin = _fp16(b[:, 0:2])[:, None], _fp16(b[:, 2:4])[:, None]
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _nibbles(qs, 32)
    if high is not None:
        q = q | (high << 4)
    return Blocks(q=q.reshape(-1, 8, QK), scale=d * sc.astype(np.float32), zero=0, bits=bits,
                  offset=-(dmin * mn.astype(np.float32)))


def _decode_q4_k(b: np.ndarray) -> Blocks:
    return _decode_k(b, b[:, 16:], None, bits=4)


def _decode_q5_k(b: np.ndarray) -> Blocks:
    return _decode_k(b, b[:, 48:], _bits(b[:, 16:48], 8, 1, 32), bits=8)


def _decode_q6_k(b: np.ndarray) -> Blocks:
    """Sub-block j of 16 is w = (d*sc[j]) * (q - 32), q = low nibble | 2 high bits << 4."""
    q = _nibbles(b[:, 0:128], 64) | (_bits(b[:, 128:192], 4, 2, 32) << 4)
    scale = _fp16(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)
    return Blocks(q=q.reshape(-1, 16, 16), scale=scale, zero=32, bits=8)


_DECODERS = {"Q4_0": _decode_q4_0, "Q4_1": _decode_q4_1, "Q5_0": _decode_q5_0, "Q8_0": _decode_q8_0,
             "Q4_K": _decode_q4_k, "Q5_K": _decode_q5_k, "Q6_K": _decode_q6_k}


def decode_blocks(qtype: str, raw: np.ndarray) -> Blocks:
    """Raw ggml blocks of a matrix, (N, bytes per row) uint8, as :class:`Blocks` (N rows)."""
    _, nbytes = BLOCK_TYPES[qtype]
    n = raw.shape[0]
    b = _DECODERS[qtype](np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, nbytes))
    q = b.q.reshape(n, -1, b.q.shape[-1])
    offset = None if b.offset is None else b.offset.reshape(n, -1)
    return Blocks(q=q, scale=b.scale.reshape(n, -1), zero=b.zero, bits=b.bits, offset=offset)


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


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's data lies in a GGUF file, and what it is."""

    offset: int  # absolute byte offset of its first block in the file
    ggml_type: int  # ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length (k), shape[1] the rows (n)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file (v2/v3) into plain Python values.

    Tensor infos are never read.  Raises ModelFormatError, naming the offending
    value, for a missing, truncated or malformed file.
    """
    return _read_header(Path(path), tensors=False)[0]


def read_layout(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    """The metadata and every tensor's TensorInfo, without touching the tensors' data (milliseconds,
    where gguf.GGUFReader takes seconds).  A tensor whose data would run past the end of the file is
    a ModelFormatError naming it (a truncated download)."""
    return _read_header(Path(path), tensors=True)


def _read_header(path: Path, tensors: bool) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
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
        n_tensors = cur.scalar("Q")
        meta: dict[str, Any] = {}
        for _ in range(cur.scalar("Q")):
            key = cur.string()
            if key in meta:
                raise cur.error(f"metadata key {key!r} appears twice")
            meta[key] = cur.value(cur.scalar("I"))
        if not tensors:
            return meta, {}
        raw: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            shape = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
            raw.append((name, shape, cur.scalar("I"), cur.scalar("Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-cur.pos // align) * align  # the data section, aligned
        infos = {}
        for name, shape, ggml_type, rel in raw:
            info = TensorInfo(start + rel, ggml_type, shape)
            need = _tensor_bytes(info)
            if need is not None and info.offset + need > len(buf):
                raise cur.error(f"tensor {name!r} needs {need} bytes at byte {info.offset}, past the end "
                                f"({len(buf)} bytes): the file is truncated")
            infos[name] = info
        return meta, infos


def _tensor_bytes(info: TensorInfo) -> int | None:
    """Bytes of a tensor of a known type (None for a type this module does not know)."""
    import math

    sizes = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34),
             12: (256, 144), 13: (256, 176), 14: (256, 210)}  # ggml type id -> (weights, bytes) per block
    if info.ggml_type not in sizes:
        return None
    per, nbytes = sizes[info.ggml_type]
    return math.prod(info.shape) // per * nbytes


def decoder_config(meta: dict[str, Any], tensors, name: str) -> DecoderConfig:
    """The decoder's hyper-parameters from a GGUF's metadata; `tensors` maps names to objects with
    a ggml-order `shape` (the token embedding's gives the vocabulary).  `name` is the file's, for messages."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFormatError(f"{name}: architecture is {arch!r}, only 'llama' and 'qwen2' GGUF files can be run")

    def field(k: str, default=None):
        return meta.get(f"{arch}.{k}", default)

    def require(k: str):
        v = field(k)
        if v is None:
            raise ModelFormatError(f"{name}: metadata key {arch}.{k!r} is missing")
        return v

    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelFormatError(f"{name}: tensor 'token_embd.weight' is missing")
    n_heads = int(require("attention.head_count"))
    hidden = int(require("embedding_length"))
    return DecoderConfig(
        n_layers=int(require("block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(field("attention.head_count_kv", n_heads)),
        head_dim=int(field("attention.key_length", field("rope.dimension_count", hidden // n_heads))),
        ffn=int(require("feed_forward_length")),
        vocab=int(emb.shape[1]),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        rms_eps=float(require("attention.layer_norm_rms_epsilon")),
        context_length=int(field("context_length", 2048)),
        tied_embeddings="output.weight" not in tensors,
        arch=arch,
        qkv_bias="blk.0.attn_q.bias" in tensors,
    )


class GGUFModel:
    """A llama or qwen2 GGUF opened for conversion: refuses another architecture, or a tensor
    type outside FLOAT_TYPES and BLOCK_TYPES, when it is opened."""

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
        self._check_types()

    @property
    def tensor_names(self) -> list[str]:
        """Every tensor's name, in the file's order."""
        return list(self._tensors)

    @property
    def weight_count(self) -> int:
        """Weights in all tensors (what an fp32 variant stores at 4 bytes each)."""
        return sum(int(t.n_elements) for t in self._tensors.values())

    # -- metadata ---------------------------------------------------------
    def field(self, key: str, default=None):
        """Return one metadata value (str/int/float/bool or a list of them)."""
        return self.metadata.get(key, default)

    def _read_config(self) -> DecoderConfig:
        return decoder_config(self.metadata, self._tensors, self.path.name)

    def _check_types(self) -> None:
        """Refuse, before any work, a tensor whose ggml type the converter cannot map exactly."""
        for name, t in self._tensors.items():
            qtype = t.tensor_type.name
            if qtype not in FLOAT_TYPES and qtype not in BLOCK_TYPES:
                known = ", ".join((*FLOAT_TYPES, *BLOCK_TYPES))
                raise ModelFormatError(
                    f"{self.path.name}: tensor {name!r} is {qtype}, which memspec does not convert (it converts {known})"
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
        """Row permutation that undoes convert_hf_to_gguf's Q/K permute (llama only), else None."""
        if self.config.arch != "llama":
            return None  # qwen2's converter writes Q and K in the checkpoint's own order
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

    def blocks(self, name: str) -> Blocks:
        """The ggml blocks of a quantized matrix, decoded, rows in HF order."""
        qtype = self.qtype(name)
        if qtype not in BLOCK_TYPES:
            raise ModelFormatError(f"{name} is {qtype}, not a block type ({', '.join(BLOCK_TYPES)})")
        data = np.asarray(self._tensor(name).data)  # (N, bytes per row) uint8
        order = self._row_order(name, data.shape[0])
        return decode_blocks(qtype, data[order] if order is not None else data)


class ArrayWeights:
    """Float32 weights held in memory under GGUF tensor names (a trained draft).

    Offers the part of GGUFModel's interface that convert.DecoderBuilder uses,
    so a model trained here is built into the same ONNX layout as the target.
    With `quantize` ("Q8_0", "Q4_1" or "Q4_0") every matrix is offered as blocks of that
    ggml type, rounded to nearest here, so the builder's quantized variant can use them.
    Q4_0 (symmetric, a scale per 32 and no min) is the smallest: 4.5 bits a weight as
    4-bit MatMulNBits with nothing left over, where Q4_1 needs its block-sum correction.
    """

    QUANTIZE = ("Q8_0", "Q4_1", "Q4_0")

    def __init__(self, config: DecoderConfig, tensors: dict[str, np.ndarray], quantize: str | None = None):
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

    def q4_0(self, name: str) -> Blocks:
        """Symmetric 4-bit blocks of ggml's Q4_0 shape: d = w_max / -8 with w_max the block's
        weight of largest magnitude (sign kept, so it maps to q = 0), q = clip(round(w / d) + 8, 0, 15)."""
        b = self._blocks(name, "Q4_0")
        big = np.take_along_axis(b, np.abs(b).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        d = (big / -8.0).astype(np.float32)
        q = np.rint(b / np.where(d == 0, 1.0, d)[..., None]) + 8
        return Blocks(q=q.clip(0, 15).astype(np.uint8), scale=d, zero=8, bits=4)

    def blocks(self, name: str) -> Blocks:
        """The matrix's blocks in the builder's terms (GGUFModel.blocks)."""
        if self.qtype(name) == "Q4_0":
            return self.q4_0(name)
        if self.qtype(name) == "Q8_0":
            b = self.q8_0(name)
            return Blocks(q=(b.q.astype(np.int16) + 128).astype(np.uint8), scale=b.d, zero=128, bits=8)
        c = self.q4_1(name)
        return Blocks(q=c.q, scale=c.d, zero=0, bits=4, offset=c.m)
