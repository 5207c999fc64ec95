"""What every target engine offers the layers above runtime/, in a module that imports no engine.

    t: Target                                  # memspec.runtime.target opens one from a plan
    c = t.new_cache()                          # a KVCache: `length` committed tokens, truncate() rolls back
    logits = t.forward(c, ids, keep=k)         # (k, vocab) float32, rows for the last k ids
    rows = t.forward_batch([c1, c2], [ids1, ids2], keeps=[k1, k2])   # one pass, a list of arrays

Two engines implement `Target`: memspec.runtime.native_target.NativeTarget (the GGUF's blocks as
they are, memspec's own exact kernels; CPU) and memspec.runtime.sessions.DecoderSession (a graph
converted for ONNX Runtime; CPU or CUDA).  The speculation layer, the scheduler and the daemon
import these contracts, never an engine: the native engine, and everything above it, runs on a
machine without ONNX Runtime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from memspec.runtime.kvcache import KVCache  # noqa: F401 (the cache every engine subclasses: part of the contract)

if TYPE_CHECKING:
    from memspec.models.store import Manifest
    from memspec.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class RowCheck:
    """What the target's self-check at load found (memspec.runtime.invariance), with the padding
    the engine settled on."""

    exact: bool  # every probe row's logits bit-identical in 1-, 2-, 3- and 5-row passes
    pad_rows: int  # tokens a pass is padded to (1: the graph pads attention only; 2: whole passes)
    max_diff: float  # largest logit difference between pass sizes, with the padding in force (0.0: exact)
    reason: str  # why: "" when exact as the graph is; else what differs (or differed, unpadded)
    checked: bool = True  # False: no probe ran (a session not asked to check), nothing is known

    def warning(self) -> str | None:
        """The one line the daemon and the CLI say where the target is not exact, else None."""
        return None if self.exact or not self.checked else f"{WARNING}: {self.reason}"


WARNING = "speculative output may differ from target-only output on this CPU"
UNCHECKED = RowCheck(exact=False, pad_rows=1, max_diff=0.0, reason="not checked", checked=False)


class Target(Protocol):
    """A decoder that verifies drafts: k rows of logits per pass, a KV cache per sequence."""

    path: Path  # the file it runs: an ONNX graph or a GGUF
    device: str  # "cpu" or "cuda"
    providers: list[str]  # what computes it: ONNX Runtime's execution providers, or "memspec-native (isa)"
    vocab_size: int | None  # rows of its logits (None: not known before a pass)
    max_context: int  # a new cache's capacity in tokens
    kv: str  # its KV cache's format: the native engine's [runtime] kv ("f16", "q8"), a graph's own ("f32", "f16")
    threads: int  # CPU threads a pass runs on
    rows: RowCheck  # the self-check at load: is a row's result the same at any row count?
    prefix_reuse: bool  # may a prompt start from another's stored K/V (memspec.runtime.prefixes)?
    trees: bool  # may a pass verify a token tree (forward_tree, then the cache's keep_path)? native only
    features: bool  # may a pass also return its rows' hidden states (FeatureTarget)? native only

    def new_cache(self, capacity: int | None = None) -> KVCache: ...

    def forward(self, cache: KVCache, ids: Sequence[int], keep: int = 1) -> np.ndarray: ...

    def forward_batch(self, caches: Sequence[KVCache], feeds: Sequence[Sequence[int]],
                      keeps: Sequence[int]) -> list[np.ndarray]: ...

    def kv_bytes_per_token(self) -> int: ...

    def cache_nbytes(self, tokens: int) -> int: ...  # one sequence's resident KV bytes at `tokens`

    def cost_key(self, max_k: int) -> str: ...

    def measure_step_costs(self, max_k: int, context: int = 64, repeats: int = 3) -> list[float]: ...


class FeatureTarget(Target, Protocol):
    """A target whose passes also hand over the hidden states of the rows they keep (`features` is
    True): what a draft that reads the target's features (EAGLE, Medusa) proposes from, at no
    extra pass.  `features` names hidden states as a Hugging Face model's hidden_states: 0 the
    token's embedding, i in 1..n_layers-1 the residual stream after layer i-1, n_layers the final
    norm's output (the head's input); negative from the end (-1: the head's input).  A row's hidden
    states are bit for bit what it gets fed alone, like its logits."""

    n_layers: int  # decoder layers
    hidden_size: int  # H, the width of one hidden state

    def forward(self, cache: KVCache, ids: Sequence[int], keep: int = 1,
                features: Sequence[int] | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]: ...
    # with features: (logits (keep, V), hidden (keep, len(features), H))

    def forward_batch(self, caches: Sequence[KVCache], feeds: Sequence[Sequence[int]], keeps: Sequence[int],
                      features: Sequence[int] | None = None) -> list: ...
    # with features: per sequence (logits (keeps[i], V), hidden (keeps[i], len(features), H))

    def forward_tree(self, cache: KVCache, ids: Sequence[int], parents: Sequence[int],
                     features: Sequence[int] | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]: ...
    # with features: (logits (n, V), hidden (n, len(features), H)), every node's


class BatchedPass(Protocol):
    """One pass over several requests' rows, for the batch loop (memspec.speculation.batching)."""

    target: Target  # the one-request target (a request alone runs on it directly)
    rows: int  # most rows (requests) in one pass
    weight_bytes: int  # memory it holds beyond the target's own: a second copy of the weights, or 0

    def forward(self, caches: Sequence[KVCache], feeds: Sequence[Sequence[int]],
                keep: Sequence[int]) -> list[np.ndarray]: ...

    def release(self, cache: KVCache) -> None: ...  # the request is gone: keep none of its cache

    def measure_pass_costs(self, max_k: int, context: int = 64, repeats: int = 3) -> dict[int, list[float]]: ...


@dataclass
class TargetModel:
    """A loaded target, as the engine takes it (memspec.runtime.target.load_target makes one): the
    model whose output is the answer, its tokenizer and its end-of-sequence ids."""

    name: str  # store name
    variant: str  # what its engine runs: "gguf" (the native engine), "q4", "fp32", ...
    session: Target  # the engine that runs it
    tokenizer: "Tokenizer"
    eos_ids: frozenset[int]
    manifest: "Manifest | None" = None
    plan: "memspec.runtime.plan.Plan | None" = None  # noqa: F821  (how it was loaded; None: opened by hand)

    @property
    def file_bytes(self) -> int:
        """Size of the loaded variant's weights (its external weights too): the manifest's record,
        else the file on disk."""
        if self.manifest is not None and self.variant in self.manifest.variants:
            return self.manifest.variant_bytes(self.variant)
        return self.session.path.stat().st_size

    @property
    def vocab_size(self) -> int | None:
        return self.session.vocab_size

    @property
    def max_context(self) -> int:
        return self.session.max_context


def physical_cores() -> int:
    """The default thread count of a target pass, for either engine."""
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except Exception:
        return os.cpu_count() or 1
