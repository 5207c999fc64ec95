"""ONNX Runtime decoder sessions and their KV caches.

A `DecoderSession` offers exactly what a speculative engine needs:

    cache = session.new_cache()
    logits = session.forward(cache, ids, keep=k)   # (k, V); cache.length += len(ids)
    cache.truncate(n)                              # roll back to n committed tokens

Two graph layouts are understood, read from the model's own inputs:

* ``gqa`` (onnxruntime-genai, ours): past and present share one preallocated
  buffer through IOBinding.  The attention mask's width tells GroupQueryAttention
  where to write, so rollback is only a smaller `length`: stale slots past it
  are overwritten by the next step and never attended to.
* ``growing`` (optimum / HF export): present = past + new.  The cache keeps the
  returned arrays and rollback slices them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from memspec.errors import ConfigError, ModelFormatError
from memspec.runtime.config import onnxruntime_missing

try:
    import onnxruntime as ort
except ImportError:  # memspec does not depend on one ONNX Runtime build: the machine picks it
    raise ConfigError(onnxruntime_missing()) from None
from memspec.runtime.config import SessionConfig
from memspec.runtime.context import opening_context
from memspec.runtime.contracts import UNCHECKED, RowCheck, physical_cores
from memspec.runtime.invariance import settle
from memspec.runtime.kvcache import PAGE, KVCache, kv_cache_nbytes  # noqa: F401 (PAGE: re-exported)

PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def resolve_providers(wanted: Sequence[str]) -> list[str]:
    """Execution providers to use, from what this onnxruntime build reports at run time."""
    available = ort.get_available_providers()
    if not wanted or tuple(wanted) == ("auto",):
        # TensorRT needs engine caches configured to be useful; auto takes CUDA, then CPU.
        return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    missing = [p for p in wanted if p not in available]
    if missing:
        raise ModelFormatError(
            f"execution provider(s) {', '.join(missing)} are not in this onnxruntime build "
            f"(available: {', '.join(available)})"
        )
    return list(wanted)


KV_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class SharedBufferCache(KVCache):
    """One preallocated (1, kvh, capacity, hd) buffer per layer and per K/V."""

    def __init__(self, capacity: int, n_layers: int, kv_heads: int, head_dim: int, device: str = "cpu",
                 dtype: type = np.float32, slack: int = 0):
        super().__init__(capacity, slack)
        shape = (1, kv_heads, capacity + slack, head_dim)  # slack: slots a padded pass writes past the last token
        self.buffers = [
            ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, 0) for _ in range(2 * n_layers)
        ]
        self._nbytes = 2 * n_layers * int(np.prod(shape)) * np.dtype(dtype).itemsize
        # Set up by the session on the first pass, then reused by every pass of the request:
        self.binding = None  # its IOBinding, with the buffers bound as past and present
        self.ones = None  # (1, capacity) int64 ones: the attention mask is a prefix of it
        self.logits: dict = {}  # rows -> (1, rows, V) float32 output of one-position passes (padded or not)

    @property
    def nbytes(self) -> int:
        return self._nbytes


class GrowingCache(KVCache):
    """Past arrays that grow with each step (optimum layout)."""

    def __init__(self, capacity: int, n_layers: int, kv_heads: int, head_dim: int, dtype: type = np.float32):
        super().__init__(capacity)
        self.arrays = [np.zeros((1, kv_heads, 0, head_dim), dtype) for _ in range(2 * n_layers)]

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.arrays = [a[:, :, :length] for a in self.arrays]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class DecoderSession:
    """One decoder model in ONNX Runtime, shapes read from the model itself."""

    # exact reuse needs a row's K/V to be the same at any row count, which ONNX Runtime's kernels
    # are not everywhere (memspec.runtime.invariance); its caches offer no prefix copy either
    prefix_reuse = False
    trees = False  # its attention takes chains only: drafts are verified as chains (NativeTarget.forward_tree)
    features = False  # its graph outputs logits and K/V only: no hidden states (contracts.FeatureTarget)

    def __init__(self, path: str | Path, config: SessionConfig = SessionConfig(), arena: bool = False,
                 threads: int | None = None, min_rows: int = 1, spinning: bool = True, check_rows: bool = False):
        """arena=True keeps ORT's CPU memory arena: faster steps, but freed memory stays in the
        process.  The pinned target uses it; drafts, which are loaded and evicted, do not.

        min_rows=2 runs every pass over at least two tokens (a one-token step is padded with a
        copy of its token, whose logits and K/V are dropped).  ONNX Runtime's CPU attention takes
        another GEMM kernel for a single query row, which rounds differently; with int8
        activations that flips near-ties between target-only decoding and verification.  Padded,
        every pass takes the multi-row kernels and the two agree bit for bit.

        A graph of ours that pads attention itself (metadata memspec.attention_pad) needs none of
        that: it gives attention, the one kernel that differs, the copy row, while its matrix
        multiplies run one row (on the 1.5B a two-row pass costs 1.2x a one-row pass).

        That holds where the matrix multiplies are row-invariant, which ONNX Runtime's 4-bit kernels
        are not on every CPU (AVX2-only: a lone row takes a GEMV kernel of its own).  check_rows=True
        (targets) probes this at load (memspec.runtime.invariance): with min_rows=2 a session whose
        one-token passes still differ pads them to two rows after all; `rows` says what was found.

        spinning=False: its threads sleep as soon as a run ends (drafts: a pool spinning after its
        run would steal the cores the target verifies on next); a one-thread pool never spins."""
        self.path = Path(path)
        self.min_rows = min_rows
        if not self.path.is_file():
            raise ModelFormatError(f"model file not found: {self.path}")
        opts = ort.SessionOptions()
        threads = threads if threads is not None else config.intra_op_threads
        opts.intra_op_num_threads = threads or physical_cores()
        self.threads = opts.intra_op_num_threads
        if opts.intra_op_num_threads == 1 or not spinning:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.log_severity_level = 3
        opts.enable_cpu_mem_arena = arena
        self.providers = resolve_providers(config.providers)
        try:
            self.session = ort.InferenceSession(str(self.path), opts, providers=self.providers)
        except Exception as exc:
            raise ModelFormatError(f"onnxruntime cannot load {self.path}: {exc}") from None
        self.device = "cuda" if self.session.get_providers()[0] != "CPUExecutionProvider" else "cpu"
        self._read_layout(opening_context(config.max_context, None))  # "auto" unresolved: the former 2048
        # the self-check's finding (and the padding it settled on: pad_rows), or UNCHECKED
        self.rows: RowCheck = settle(self, escalate=min_rows >= 2) if check_rows else UNCHECKED

    def _read_layout(self, max_context: int) -> None:
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = [o.name for o in self.session.get_outputs()]
        if "input_ids" not in inputs or "logits" not in outputs:
            raise ModelFormatError(f"{self.path.name} is not a decoder: it needs input_ids and logits")
        self.past_names = sorted(
            (n for n in inputs if n.startswith("past_key_values.")),
            key=lambda n: (int(n.split(".")[1]), n.endswith("value")),
        )
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        if not self.past_names or any(n not in outputs for n in self.present_names):
            raise ModelFormatError(f"{self.path.name}: past_key_values.* inputs and present.* outputs are required")
        _, kv_heads, _, head_dim = inputs[self.past_names[0]].shape
        # float32, or float16 in the q4f16 variant (CUDA's attention runs in half precision only)
        kv_type = inputs[self.past_names[0]].type
        if kv_type not in KV_TYPES:
            raise ModelFormatError(f"{self.path.name}: KV cache of type {kv_type}; memspec runs "
                                   f"{' and '.join(KV_TYPES)}")
        self.kv_dtype = KV_TYPES[kv_type]
        self.kv = "f16" if self.kv_dtype == np.float16 else "f32"  # the graph's own ([runtime] kv: native only)
        logits_shape = self.session.get_outputs()[outputs.index("logits")].shape
        self.vocab_size = int(logits_shape[-1]) if isinstance(logits_shape[-1], int) else None
        self.n_layers = len(self.past_names) // 2
        self.kv_heads, self.head_dim = int(kv_heads), int(head_dim)
        self.has_keep = "logits_to_keep" in inputs
        self.has_position_ids = "position_ids" in inputs
        # Our converter marks graphs whose attention can share past/present buffers;
        # any other decoder runs with a growing cache, which every layout supports.
        meta = self.session.get_modelmeta().custom_metadata_map
        self.layout = "gqa" if meta.get("memspec.kv_layout") == "shared_buffer" else "growing"
        self.graph_pads = self.layout == "gqa" and meta.get("memspec.attention_pad") == "1"
        # tokens a pass is padded to here (the graph pads itself; the self-check may raise it to 2),
        # and slots written past the last token (1 either way)
        self.pad_rows = 1 if self.graph_pads else self.min_rows
        self.slack = 1 if self.graph_pads else self.min_rows - 1
        # slots a cache's buffer has past its capacity: the graph's padded pass writes one even at
        # the last slot (the session pads only where the cache has room)
        self.buffer_slack = 1 if self.graph_pads else 0
        self.max_context = max_context

    # -- caches -------------------------------------------------------------
    def new_cache(self, capacity: int | None = None) -> KVCache:
        cap = capacity or self.max_context
        if self.layout == "gqa":
            return SharedBufferCache(cap, self.n_layers, self.kv_heads, self.head_dim, self.device, self.kv_dtype,
                                     self.buffer_slack)
        return GrowingCache(cap, self.n_layers, self.kv_heads, self.head_dim, self.kv_dtype)

    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_heads * self.head_dim * np.dtype(self.kv_dtype).itemsize

    def cache_nbytes(self, tokens: int) -> int:
        """Resident bytes of one request's KV cache once it holds `tokens` tokens.

        The shared buffer is allocated for the full capacity, but the OS commits its
        pages only when they are written: one (layer, K/V, head) row of `capacity`
        slots each, filled from the front.  So it costs the pages of `tokens` slots
        per row, rounded up to whole pages plus one (rows need not start on a page),
        never more than the capacity.  A growing cache holds exactly `tokens`.  With
        padding (min_rows, or the graph's own), a step writes `slack` slots past the last token."""
        tokens += self.slack
        if self.layout != "gqa":
            return self.kv_bytes_per_token() * max(0, min(tokens, self.max_context))
        return kv_cache_nbytes(2 * self.n_layers * self.kv_heads, self.head_dim, tokens,
                               self.max_context + self.buffer_slack, np.dtype(self.kv_dtype).itemsize)

    # -- forward ------------------------------------------------------------
    def forward(self, cache: KVCache, ids: Sequence[int], keep: int = 1) -> np.ndarray:
        """Feed `ids` after the committed tokens; return logits of the last `keep` positions.

        Returns (keep, V) float32.  cache.length advances by len(ids); call
        cache.truncate() to commit fewer.
        """
        n = len(ids)
        cache.check_room(n)
        keep = min(max(keep, 1), n)
        # padding rows (pad_rows), when the cache has room for them, its slack slot included (so
        # that a pass into the last slot is padded too); they are dropped below
        pad = min(max(self.pad_rows - n, 0), cache.capacity + cache.slack - cache.length - n)
        if pad:
            ids = [*ids, *[ids[-1]] * pad]
        if isinstance(cache, SharedBufferCache):
            logits = self._forward_shared(cache, ids, keep + pad)
        else:
            logits = self._forward_growing(cache, ids, keep + pad)
        cache.length += n + pad
        if pad:
            cache.truncate(cache.length - pad)
            logits = logits[:keep]
        return logits

    def _forward_shared(self, cache: SharedBufferCache, ids: Sequence[int], keep: int) -> np.ndarray:
        """One pass with the cache's buffers as past and present.  The binding, the mask and the
        logits of one-position passes (padded to min_rows or not) are made on the request's first
        such pass and reused (rebuilding them cost 0.9 ms of a 12 ms q4 step)."""
        total = cache.length + len(ids)
        binding = cache.binding
        if binding is None:
            binding = cache.binding = self.session.io_binding()
            binding.bind_output("logits", "cpu")  # first: a rebound name keeps its place, get_outputs()[0]
            for name, present, buf in zip(self.past_names, self.present_names, cache.buffers):
                binding.bind_ortvalue_input(name, buf)
                binding.bind_ortvalue_output(present, buf)
            cache.ones = np.ones((1, cache.capacity + cache.slack), dtype=np.int64)
        binding.bind_cpu_input("input_ids", np.asarray([ids], dtype=np.int64))
        binding.bind_cpu_input("attention_mask", cache.ones[:, :total])
        binding.bind_cpu_input("logits_to_keep", np.array(keep, dtype=np.int64))
        if keep <= self.pad_rows and self.vocab_size:
            out = cache.logits.get(keep)
            if out is None:
                out = cache.logits[keep] = ort.OrtValue.ortvalue_from_shape_and_type(
                    (1, keep, self.vocab_size), np.float32, "cpu", 0)
            binding.bind_ortvalue_output("logits", out)
            self.session.run_with_iobinding(binding)
            return out.numpy()[0].copy()  # numpy() is a view the next pass overwrites
        binding.bind_output("logits", "cpu")  # a verification pass: its own (keep, V) array
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()[0]

    def _forward_growing(self, cache: GrowingCache, ids: Sequence[int], keep: int) -> np.ndarray:
        total = cache.length + len(ids)
        feeds = {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "attention_mask": np.ones((1, total), dtype=np.int64),
        }
        if self.has_keep:
            feeds["logits_to_keep"] = np.array(keep, dtype=np.int64)
        if self.has_position_ids:
            feeds["position_ids"] = np.arange(cache.length, total, dtype=np.int64)[None, :]
        feeds.update(zip(self.past_names, cache.arrays))
        out = self.session.run(["logits", *self.present_names], feeds)
        cache.arrays = out[1:]
        return out[0][0, -keep:]

    def cost_key(self, max_k: int) -> str:
        """What measure_step_costs(max_k) depends on (memspec.runtime.costs keeps curves by it)."""
        from memspec.runtime.costs import cost_key

        return cost_key(self.path, max_k, [ort.__version__, self.session.get_providers()], self.threads,
                        self.pad_rows)

    def measure_step_costs(self, max_k: int, context: int = 64, repeats: int = 3) -> list[float]:
        """memspec.runtime.costs.step_costs: seconds of a pass over k = 1..max_k tokens."""
        from memspec.runtime.costs import step_costs

        return step_costs(self, max_k, context, repeats)

    def forward_batch(self, caches: Sequence[KVCache], feeds: Sequence[Sequence[int]],
                      keeps: Sequence[int]) -> list[np.ndarray]:
        """Several sequences, one pass each, in turn (this graph takes one sequence a pass; the
        batched graph, memspec.runtime.batch, is the one that shares passes)."""
        if not len(caches) == len(feeds) == len(keeps):
            raise ValueError(f"one cache, one feed and one keep per sequence (got {len(caches)} caches, "
                             f"{len(feeds)} feeds, {len(keeps)} keeps)")
        return [self.forward(c, f, keep=k) for c, f, k in zip(caches, feeds, keeps)]
