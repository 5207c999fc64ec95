"""The native CPU target: a llama or qwen2 decoder run from its GGUF file as it is.

    t = NativeTarget(gguf_path, threads=2, max_context=2048)
    c = t.new_cache()
    logits = t.forward(c, ids, keep=k)                          # (k, V) float32, rows for the last k ids
    c.truncate(n)                                               # roll back to n committed tokens
    rows = t.forward_batch([c1, c2], [ids1, ids2], keeps=[k1, k2])   # one pass; a list of (k_i, V)
    rows = t.forward_tree(c, ids, parents)                      # a token tree: (n, V), every node's row
    c.keep_path(start, path)                                    # keep one root-to-node path of it
    logits, hidden = t.forward(c, ids, keep=k, features=[-1])   # and the rows' hidden states: (k, 1, H)

The file is memory-mapped and its blocks are computed on where they lie (memspec/runtime/native/:
the C extension memspec.runtime._native): no conversion, no second copy.  The matrices the CPU's
path multiplies 8 rows at a time (Q4_K and Q6_K on AVX2) are repacked at load into that interleaved
order, losslessly, and their mapped pages dropped: `file_bytes` counts what stays resident.  A row's logits are
one fixed sequence of operations on that row's sequence and the weights, so they are the same
bit for bit whether its token is fed alone, among draft tokens, or beside other sequences' rows,
at any thread count (model.h).  The KV cache is float16 (kv="f16"), or int8 with one float32 scale
per position and KV head (kv="q8": about half the bytes; a row quantized once, when its position is
fed, from its own values, so logits stay exact at any row count), one buffer per sequence whose pages
the OS commits as positions are written; rollback is a shorter `length`.
"""

from __future__ import annotations

import mmap
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from memspec.errors import ModelFormatError
from memspec.models.gguf import TensorInfo, decoder_config, read_layout
from memspec.runtime import kernels
from memspec.runtime.config import KV_FORMATS
from memspec.runtime.costs import cost_key, step_costs
from memspec.runtime.contracts import UNCHECKED, RowCheck, physical_cores
from memspec.runtime.invariance import check
from memspec.runtime.kvcache import KVCache, committed_as_written, kv_cache_nbytes

LAYER_TENSORS = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                 "attn_q.bias", "attn_k.bias", "attn_v.bias", "ffn_norm.weight", "ffn_gate.weight",
                 "ffn_up.weight", "ffn_down.weight")  # the order memspec.runtime._native.Model reads them in
OPTIONAL = {"attn_q.bias", "attn_k.bias", "attn_v.bias"}  # qwen2 has them, llama not
PASS_ROWS = 512  # most rows of one pass that forward feeds a long single feed in (llama.cpp's n_batch)
FETCH_PASSES = 3  # one-row passes timed at load with each way of fetching the weights (Model.fetch_ahead) ...
FETCH_TIE = 0.02  # ... and within this share of each other, the kernels' own fetches
NEOX_ROPE = {"qwen2"}  # architectures whose rotary pairs are (i, i + d/2); llama's GGUF rows pair (2i, 2i+1)
def kv_row_bytes(kv: str, head_dim: int) -> int:
    """Bytes of one position's key or value for one KV head: head_dim float16s, or (q8) head_dim
    int8s and their float32 scale."""
    if kv not in KV_FORMATS:
        raise ValueError(f"kv = {kv!r}: the native engine's KV cache is one of {', '.join(KV_FORMATS)}")
    return head_dim + 4 if kv == "q8" else 2 * head_dim


class NativeCache(KVCache):
    """One sequence's keys and values: (layers, K/V, kv heads, capacity, head_dim) float16 (as
    uint16), or for kv="q8" (layers, K/V, kv heads, capacity, head_dim + 4) bytes: each position's
    int8s, then their float32 scale."""

    def __init__(self, capacity: int, n_layers: int, kv_heads: int, head_dim: int, kv: str = "f16"):
        super().__init__(capacity)  # no slack: a native pass is never padded
        # the OS commits pages as positions are written (kvcache.committed_as_written)
        row, dtype = (kv_row_bytes(kv, head_dim), np.uint8) if kv == "q8" else (head_dim, np.uint16)
        self.kv = kv
        self.data = committed_as_written((n_layers, 2, kv_heads, capacity, row), dtype)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def prefix(self, n: int) -> np.ndarray:
        """A copy of the first n committed positions' K/V (memspec.runtime.prefixes)."""
        if not 0 < n <= self.length:
            raise ValueError(f"a prefix of {n} tokens from a cache of {self.length}")
        return self.data[:, :, :, :n, :].copy()

    def load_prefix(self, kv: np.ndarray, n: int) -> None:
        """Commit the first n positions of `kv` (another cache's `prefix`) as this cache's start."""
        if kv.shape[:3] + kv.shape[4:] != self.data.shape[:3] + self.data.shape[4:] or not 0 < n <= kv.shape[3]:
            raise ValueError(f"a prefix of shape {kv.shape} (n={n}) does not fit a cache of shape {self.data.shape}")
        self.check_room(n)
        self.data[:, :, :, :n, :] = kv[:, :, :, :n, :]
        self.length = n

    def keep_path(self, start: int, path: Sequence[int]) -> None:
        """After a tree pass fed at `start` (NativeTarget.forward_tree): keep the nodes of `path` (node
        indices, the root first, each the parent of the next) as the committed positions start,
        start + 1, ..., moving each node's K/V from its slot start + index to start + depth.  An
        index is never below its depth and grows along the path, so no move overwrites a slot a later
        one reads.  The other nodes' slots are written over by the next pass."""
        if not path or path[0] != 0 or list(path) != sorted(set(path)) or not 0 <= start < start + path[-1] + 1 \
                <= self.length:
            raise ValueError(f"a tree path must start at the root (0) and go down by increasing node indices "
                             f"within the {self.length - start} nodes fed at {start}; got {list(path)}")
        for depth, node in enumerate(path):
            if node != depth:
                self.data[:, :, :, start + depth, :] = self.data[:, :, :, start + node, :]
        self.length = start + len(path)


class NativeTarget:
    """A decoder over one memory-mapped GGUF, run by memspec's own kernels."""

    # a position's K/V and logits are the same whatever shared its pass, so a prompt may start from
    # another request's stored prefix (memspec.runtime.prefixes)
    prefix_reuse = True
    # a pass may verify a token tree (forward_tree): each node's row is exact by construction
    trees = True
    # a pass may also return its kept rows' hidden states (features=), copied out of the pass itself
    features = True

    def __init__(self, path: str | Path, threads: int = 0, max_context: int = 2048, isa: str | None = None,
                 check_rows: bool = True, kv: str = "f16"):
        """check_rows: run the row-invariance self-check at load (a target's answer depends on it; a
        draft's, which only proposes, does not: UNCHECKED).  kv: the KV cache's format, "f16" or "q8"."""
        self.path = Path(path)
        meta, tensors = read_layout(self.path)
        self.config = cfg = decoder_config(meta, tensors, self.path.name)
        native = kernels.module()  # NativeKernelsUnavailable where the extension was not built
        self.max_context = max_context
        self.vocab_size = cfg.vocab
        self.n_layers, self.kv_heads, self.head_dim = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self.hidden_size = cfg.hidden
        self.kv, self.kv_row_bytes = kv, kv_row_bytes(kv, cfg.head_dim)
        self.threads = threads or physical_cores()
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

        def spec(name: str, optional: bool = False):
            info = tensors.get(name)
            if info is None:
                if optional:
                    return None
                raise ModelFormatError(f"{self.path.name}: tensor {name!r} is missing")
            return _spec(info)

        head = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied head: the embedding
        layers = [[spec(f"blk.{i}.{t}", t in OPTIONAL) for t in LAYER_TENSORS] for i in range(cfg.n_layers)]
        config = (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn, cfg.vocab,
                  int(cfg.arch in NEOX_ROPE), cfg.rope_theta, cfg.rms_eps)
        try:
            self.model = native.Model(self._map, config, spec("token_embd.weight"), spec("output_norm.weight"),
                                      spec(head), layers, self.threads, isa=isa,
                                      release_packed=True, kv=kv)
        except ValueError as exc:  # an unsupported type, a wrong shape, a truncated file
            raise ModelFormatError(f"{self.path.name}: {exc}") from None
        self.file_bytes = self._resident_bytes()
        self.model.fetch_ahead = self._faster_fetch()
        self.isa = isa or native.isa()
        self.device = "cpu"
        self.providers = [f"memspec-native ({self.isa})"]  # what computes it, as GetStatus lists engines
        self.rows: RowCheck = check(self) if check_rows else UNCHECKED  # memspec.runtime.invariance

    @property
    def fetch_ahead(self) -> bool:
        """How this target's one-row passes fetch their weights (the extension's Model.fetch_ahead,
        chosen at load by _faster_fetch)."""
        return self.model.fetch_ahead

    def _faster_fetch(self, passes: int = FETCH_PASSES) -> bool:
        """Whether one-row passes run faster with the kernels fetching their weights ahead (the
        extension's Model.fetch_ahead) than with the driver's bursts, timed here: the same bits
        either way, and the answer is the machine's (the 1.5B on a 2-vCPU Xeon: 34 against 58 ms a
        step; on a Zen, once, 1.07x the other way).  `passes` one-token passes with each, taking
        turns; the faster fastest pass wins, the kernels' fetches on a tie."""
        cache = self.new_cache(4)
        best = {True: float("inf"), False: float("inf")}
        ids, pos, seq, keep = (np.zeros(1, dtype=np.int32) for _ in range(4))
        logits = np.empty((1, self.vocab_size), dtype=np.float32)
        for i in range(2 * passes + 2):
            on = i % 2 == 0
            self.model.fetch_ahead = on
            t0 = time.perf_counter()
            self.model.forward([cache.data], [cache.capacity], ids, pos, seq, keep, logits)
            if i >= 2:  # the first of each warms the pool and the caches
                best[on] = min(best[on], time.perf_counter() - t0)
        return best[True] <= best[False] * (1 + FETCH_TIE)

    def _resident_bytes(self) -> int:
        """What the target can hold resident: the file, less the ranges of the matrices the extension
        repacked at load (Model.packed_ranges: their mapped pages dropped, no pass reads them again;
        the page cache keeps them, reclaimable), plus the repacked copy."""
        released = sum(nbytes for _, nbytes in self.model.packed_ranges)
        return self.path.stat().st_size - released + self.model.packed_bytes

    # -- caches -------------------------------------------------------------
    def new_cache(self, capacity: int | None = None) -> NativeCache:
        return NativeCache(capacity or self.max_context, self.n_layers, self.kv_heads, self.head_dim, self.kv)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_heads * self.kv_row_bytes

    def cache_nbytes(self, tokens: int) -> int:
        """Resident bytes of one sequence's cache once it holds `tokens` tokens: the pages of each
        (layer, K/V, head) row written so far (memspec.runtime.kvcache.kv_cache_nbytes)."""
        return kv_cache_nbytes(2 * self.n_layers * self.kv_heads, self.kv_row_bytes, tokens, self.max_context, 1)

    # -- costs --------------------------------------------------------------
    def cost_key(self, max_k: int) -> str:
        """What measure_step_costs(max_k) depends on (memspec.runtime.costs keeps curves by it)."""
        return cost_key(self.path, max_k, ["memspec-native", kernels.build_id(), self.isa, self.kv], self.threads, 1)

    def measure_step_costs(self, max_k: int, context: int = 64, repeats: int = 3) -> list[float]:
        """memspec.runtime.costs.step_costs: seconds of a pass over k = 1..max_k tokens."""
        return step_costs(self, max_k, context, repeats)

    # -- forward ------------------------------------------------------------
    def feature_index(self, features: Sequence[int]) -> np.ndarray:
        """The hidden states `features` names, as the extension numbers them (int32): 0 the token's
        embedding, i in 1..n_layers-1 the residual stream after layer i-1, n_layers the final norm's
        output (the head's input), as a Hugging Face model's hidden_states; a negative index counts
        from the end of those n_layers + 1 (-1: the head's input)."""
        n = self.n_layers + 1
        if not len(features) or any(not -n <= int(f) < n for f in features):
            raise ValueError(f"features must name one or more of the {n} hidden states (-{n}..{n - 1}); "
                             f"got {list(features)}")
        return np.asarray([int(f) % n for f in features], dtype=np.int32)

    def forward(self, cache: NativeCache, ids: Sequence[int], keep: int = 1,
                features: Sequence[int] | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Feed `ids` after the committed tokens; return the logits of the last `keep` positions,
        (keep, V) float32.  cache.length advances by len(ids).  features (feature_index): return
        (logits, hidden), hidden (keep, len(features), H) float32 the same rows' hidden states.

        A long feed (a prompt fed alone) goes in passes of at most PASS_ROWS rows, the last holding
        the kept ones: each row's result is the same in any pass, and a pass's activations (about
        75 KB a row for the 1.5B) stay a few tens of MB, in cache, not a GB."""
        n, keep = len(ids), min(max(keep, 1), max(len(ids), 1))
        cache.check_room(n)  # before any pass commits a row
        head = max(0, n - max(keep, PASS_ROWS))  # rows fed before the last pass, whose logits nobody reads
        for at in range(0, head, PASS_ROWS):
            self.forward_batch([cache], [ids[at:min(at + PASS_ROWS, head)]], [1])
        return self.forward_batch([cache], [ids[head:]], [keep], features)[0]

    def forward_batch(self, caches: Sequence[NativeCache], feeds: Sequence[Sequence[int]],
                      keeps: Sequence[int], features: Sequence[int] | None = None) -> list:
        """One pass over several sequences: feeds[i] after caches[i]'s committed tokens; returns, per
        sequence, the logits of its last keeps[i] positions, (keeps[i], V) float32.  Each row's logits
        are what it would get alone.  A cache may appear only once.  features (feature_index): per
        sequence (logits, hidden), hidden (keeps[i], len(features), H) float32 those rows' hidden
        states, copied out of the pass (no extra work; bit for bit what the row gets alone)."""
        if not len(caches) == len(feeds) == len(keeps) or not caches:
            raise ValueError(f"a pass takes one or more sequences, each with one cache, one feed and one keep "
                             f"(got {len(caches)} caches, {len(feeds)} feeds, {len(keeps)} keeps)")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a cache appears twice in one pass; feed a sequence's tokens as one feed")
        ids, pos, seq, keep, spans = [], [], [], [], []
        for s, (cache, feed, k) in enumerate(zip(caches, feeds, keeps)):
            n = len(feed)
            cache.check_room(n)
            bad = [t for t in feed if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
            k = min(max(k, 1), n)
            spans.append((len(keep), k))
            keep.extend(range(len(ids) + n - k, len(ids) + n))
            ids.extend(feed)
            pos.extend(range(cache.length, cache.length + n))
            seq.extend([s] * n)
        logits = np.empty((len(keep), self.vocab_size), dtype=np.float32)
        i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
        index = None if features is None else self.feature_index(features)
        hidden = None if index is None else np.empty((len(keep), len(index) * self.hidden_size), np.float32)
        self.model.forward([c.data for c in caches], [c.capacity for c in caches], i32(ids), i32(pos), i32(seq),
                           i32(keep), logits, None, hidden, index)
        for cache, feed in zip(caches, feeds):
            cache.length += len(feed)
        if hidden is None:
            return [logits[s: s + k] for s, k in spans]
        hidden = hidden.reshape(len(keep), len(index), self.hidden_size)
        return [(logits[s: s + k], hidden[s: s + k]) for s, k in spans]

    def forward_tree(self, cache: NativeCache, ids: Sequence[int], parents: Sequence[int],
                     features: Sequence[int] | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """One pass over a token tree after the committed tokens: node i feeds ids[i] under node
        parents[i] (-1 for the root, node 0; every other parent an earlier node).  Node i sits at
        position cache.length + its depth and attends the committed tokens, then its ancestors and
        itself: its logits are, bit for bit, those of the chain root .. i fed alone (model.h).
        Returns every node's logits, (n, V) float32; cache.length advances by n (slot cache.length + i
        holds node i's K/V until keep_path keeps one path).  features (feature_index): (logits, hidden),
        hidden (n, len(features), H) every node's hidden states, those of its chain fed alone."""
        n = len(ids)
        if n != len(parents) or n < 1 or parents[0] != -1 or any(not 0 <= a < i for i, a in enumerate(parents) if i):
            raise ValueError(f"a token tree is a root (parent -1) and nodes each under an earlier one; got parents "
                             f"{list(parents)} for {n} ids")
        cache.check_room(n)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        logits = np.empty((n, self.vocab_size), dtype=np.float32)
        i32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
        index = None if features is None else self.feature_index(features)
        hidden = None if index is None else np.empty((n, len(index) * self.hidden_size), np.float32)
        self.model.forward([cache.data], [cache.capacity], i32(ids), i32([cache.length + d for d in depth]),
                           i32([0] * n), i32(range(n)), logits, i32(parents), hidden, index)
        cache.length += n
        return logits if hidden is None else (logits, hidden.reshape(n, len(index), self.hidden_size))


class NativeBatch:
    """The batch loop's pass over several requests' rows on the native target
    (memspec.speculation.batching): NativeTarget.forward_batch itself.  Each row's logits are what
    it gets alone, at any row count, by construction; the pass reads the target's one copy of the
    weights (mapped, or repacked at load), so batching costs no memory beyond each request's own KV
    cache."""

    weight_bytes = 0  # no second copy of the weights (ONNX Runtime's batched graph holds one)

    def __init__(self, target: NativeTarget, rows: int):
        if not 1 <= rows <= 64:
            raise ValueError(f"rows: {rows} is out of range; allowed 1..64")
        self.target = target
        self.rows = rows

    def forward(self, caches: Sequence[NativeCache], feeds: Sequence[Sequence[int]],
                keep: Sequence[int]) -> list[np.ndarray]:
        if not 1 <= len(feeds) <= self.rows:
            raise ValueError(f"a pass takes 1..{self.rows} rows (got {len(feeds)})")
        return self.target.forward_batch(caches, feeds, keep)

    def release(self, cache: NativeCache) -> None:
        """Nothing is bound to a row: a cache's memory goes with its last reference."""

    def measure_pass_costs(self, max_k: int, context: int = 64, repeats: int = 3) -> dict[int, list[float]]:
        """{b: [unused, k=1..max_k]} seconds of a pass of b rows x k tokens (costs.pass_costs)."""
        from memspec.runtime.costs import pass_costs

        return pass_costs(self, max_k, context, repeats)


def _spec(info: TensorInfo) -> tuple[int, int, int, int]:
    """(offset, ggml_type, n, k) as the extension reads a tensor: a matrix is n rows of k."""
    if len(info.shape) == 1:
        return info.offset, info.ggml_type, int(info.shape[0]), 1
    return info.offset, info.ggml_type, int(info.shape[1]), int(info.shape[0])
