"""Draft proposers: small model drafts with their own vocabulary, and prompt lookup.

A model draft ships as a GGUF (variant "gguf": ggml blocks, memspec.models.gguf_write) or as an
ONNX graph.  Where the native kernels run on the CPU the GGUF runs on them as it is (a
NativeTarget of its own, on its own threads: a step costs what its bytes cost); where ONNX
Runtime runs the drafts (a GPU, no compiler, or `[runtime] backend = "onnxruntime"`) the draft's
graph is built from its GGUF once, into the store (draft_graph).

A proposer is loaded once (`DraftModel`, shared by requests) and gives each
request its own state (`begin()`), which keeps the draft's KV cache in step
with the committed context: before each proposal it reuses the longest prefix
it already has cached and feeds the rest ("catch-up"), so rejected draft
tokens are rolled back and a fully accepted run is completed.

A native draft also keeps recent requests' K/V (memspec.runtime.prefixes, as the target does):
a request's first catch-up starts from the longest stored start of its prompt (every chat prompt
begins with the same template, and a conversation's next turn with the turns before it), and
each request stores its prompt, then at its end its committed context, for the requests after it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from memspec.speculation import sampling
from memspec.errors import ConfigError, ModelFormatError
from memspec.request import SamplingParams
from memspec.runtime.config import LARGE_DRAFT_BYTES, SessionConfig
from memspec.runtime.contracts import Target
from memspec.runtime.prefixes import PrefixCache
from memspec.runtime.target import open_draft
from memspec.speculation.config import DraftLimits
from memspec.speculation.logits import IDENTITY, LogitsShaper, allowed_prefix, is_identity
from memspec.models.store import Manifest, ModelStore, speaks_own_tokenizer

log = logging.getLogger(__name__)
PROMPT_LOOKUP = "prompt-lookup"
LOOKUP_MAX_NGRAM = 8  # a model draft's lookup prefers the longest earlier match up to this many tokens
FEED_MIN_TOKENS = 8  # a catch-up at least this long is timed (a shorter one is mostly fixed cost)
ALT_POSITIONS = 3  # positions at which a draft offers its alternatives (Proposal.alternatives) ...
ALT_WIDTH = 2  # ... and how many at each (memspec.speculation.tree)
PREFIX_SHARE = 16  # a native draft's stored prompts hold at most 1/16 of its file's bytes of K/V: inside the
#                    footprint budgets plan it at (memory.FOOTPRINT_PER_FILE_BYTE["gguf"] 1.25, its load ~1.1)


@dataclass
class Proposal:
    tokens: list[int]  # (k,) proposed target token ids
    q: sampling.DraftRows | None  # the draft distributions the k tokens were drawn from (sampling only)
    entropy: list[float]  # (k,) draft entropy at each position (nats)
    setup_s: float = 0.0  # seconds of a catch-up of FEED_MIN_TOKENS or more (the prompt's prefill, a
    #                       switch to this draft): spent once, not a cost of each token it drafts
    # [i]: other continuations where tokens[i] stands, best first, each a list of tokens whose first
    # replaces tokens[i] (the draft's next choices there; prompt lookup: other earlier occurrences);
    # for the first positions only, or none (memspec.speculation.tree verifies them as branches)
    alternatives: list[list[list[int]]] = dataclasses.field(default_factory=list)

    def prefix(self, m: int) -> "Proposal":
        """Its first m tokens (what the target verifies when the rest is not worth a row)."""
        if m >= len(self.tokens):
            return self
        return Proposal(self.tokens[:m], None if self.q is None else self.q.prefix(m), self.entropy[:m], self.setup_s,
                        self.alternatives[:m])


class DraftState(Protocol):
    # under the request's shaper, left as found; alternatives: also offer Proposal.alternatives (token
    # trees on, no shaper): they cost extra work, so a draft computes them only when asked
    # rng: the request's randomness (sampling.Randomness: a stream, or coupled noise keyed by the
    # answer position, len(context) + i for the i-th proposed token)
    def propose(self, context: list[int], k: int, params: SamplingParams, rng: sampling.Randomness,
                shaper: LogitsShaper = IDENTITY, alternatives: bool = False) -> Proposal: ...

    def close(self) -> None: ...


class Proposer(Protocol):
    name: str
    nbytes: int  # its files' bytes (0: prompt lookup)
    session: Target | None  # its model; None for prompt lookup, which holds no weights and no cache

    def begin(self, capacity: int) -> DraftState: ...

    def feed_seconds_per_token(self) -> float | None: ...  # its measured catch-up cost; None: not yet measured


def loop_continuation(context: list[int], k: int, min_tokens: int, max_period: int = 8) -> list[int]:
    """The next `k` tokens of the loop the context ends in, or [] if it ends in none.

    A loop: the last `min_tokens` tokens, and at least two periods, each equal the token one
    period `p` <= `max_period` earlier (`id = 5111111`, the same line again and again).  Small
    targets fall into such loops under greedy decoding and, once in one, stay with near certainty
    (SmolLM2's argmax continues a repeated span 80-90% of the time after 12 repeated tokens), but a
    draft trained on the target's sensible answers does not follow them.
    """
    if min_tokens <= 0 or k <= 0:
        return []
    n = len(context)
    for p in range(1, max_period + 1):
        m = max(min_tokens, 2 * p)
        if n < m + p:
            break
        if context[n - m:] == context[n - m - p:n - p]:
            return [context[n - p + j % p] for j in range(k)]
    return []


def top_alternatives(probs: np.ndarray, chosen: int, width: int = ALT_WIDTH) -> list[int]:
    """The `width` most likely ids of a (V,) distribution other than `chosen`, best first, those of
    probability above 0 only (argmax after argmax, each masked and restored: a tenth of argpartition's
    time on a 150k vocabulary)."""
    out, held = [], [(chosen, probs[chosen])]
    probs[chosen] = -1.0
    for _ in range(width):
        i = int(np.argmax(probs))
        if probs[i] <= 0.0:
            break
        out.append(i)
        held.append((i, probs[i]))
        probs[i] = -1.0
    for i, v in held:
        probs[i] = v
    return out


def ngram_alternatives(context: list[int], first: int, k: int, min_ngram: int, max_ngram: int,
                       width: int = ALT_WIDTH) -> list[list[int]]:
    """Up to `width` other continuations of the context's last n-gram (longest n first, the latest
    occurrence first), each up to `k` tokens and none starting with `first` or with another's first
    token: where ngram_continuation's guess is wrong, what else followed the same words."""
    if min_ngram < 1 or k <= 0:
        return []
    arr = np.asarray(context)
    L = len(arr)
    out, firsts = [], {first}
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
        for hit in np.nonzero((windows == arr[L - n:]).all(axis=1))[0][::-1]:
            start = int(hit) + n
            if int(arr[start]) not in firsts:
                firsts.add(int(arr[start]))
                out.append(arr[start: start + k].tolist())
                if len(out) == width:
                    return out
    return out


def ngram_continuation(context: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the context's last n-gram,
    for the longest n in [min_ngram, max_ngram] that occurred before; [] if none did (or min_ngram < 1).

    Every draft asks this before each proposal: the earlier positions holding the last token are
    found in one pass, then each match is extended backwards, the latest first (7 us a call at 60-200
    tokens of context, where comparing every window for each n took 122)."""
    L = len(context)
    if min_ngram < 1 or k <= 0 or max_ngram < min_ngram or L < min_ngram + 1:
        return []
    best_n, best_end = 0, -1
    for end in np.flatnonzero(np.asarray(context[: L - 1]) == context[-1])[::-1].tolist():
        n, most = 1, min(max_ngram, end + 1)
        while n < most and context[end - n] == context[L - 1 - n]:
            n += 1
        if n > best_n:  # the latest match of the longest length (matches are visited latest first)
            best_n, best_end = n, end
            if n == max_ngram:
                break
    if best_n < min_ngram:
        return []
    return list(context[best_end + 1: best_end + 1 + k])


# -- model drafts -----------------------------------------------------------------
def draft_threads(config: SessionConfig, nbytes: int) -> int:
    """A draft's thread count: config.draft_threads, or by its size when that is 0 (auto): one
    thread under LARGE_DRAFT_BYTES, else the target's (intra_op_threads; 0 = one per physical core)."""
    if config.draft_threads:
        return config.draft_threads
    return config.intra_op_threads if nbytes >= LARGE_DRAFT_BYTES else 1


GGUF_VARIANT = "gguf"  # a draft shipped as ggml blocks (memspec.models.gguf_write)
GRAPH_VARIANT = "q4"  # the graph built from it for ONNX Runtime (DecoderBuilder's block variant)


def draft_variant(m: Manifest) -> str:
    """The variant a draft ships as: "gguf" (ggml blocks, either engine), else its one ONNX
    graph (q8: 8-bit weights; q4: 4-bit; fp32: float16-stored)."""
    return GGUF_VARIANT if GGUF_VARIANT in m.variants else next(iter(m.variants))


def draft_engine(m: Manifest, config: SessionConfig) -> str:
    """"native" or "onnxruntime": the engine that runs draft `m` under `config`.  A GGUF draft runs
    natively wherever the engine `config` gives the drafts (their providers, else the target's)
    is the native one, or "auto" would be on this CPU; an ONNX-only draft runs in ONNX Runtime."""
    from memspec.runtime.plan import resolve_backend

    if GGUF_VARIANT not in m.variants:
        return "onnxruntime"
    providers = config.draft_providers or config.providers
    backend = "auto" if config.draft_providers else config.backend
    try:
        return resolve_backend(backend, providers)
    except ConfigError:  # "native" asked with GPU providers for the drafts: ONNX Runtime runs them
        return "onnxruntime"


def draft_graph(store: ModelStore, m: Manifest) -> Path:
    """The ONNX graph ONNX Runtime runs for draft `m`: its own ONNX variant, else the graph built
    from its GGUF, once, into the store (`<home>/built/<name>-<sha>/q4.onnx`, keyed by the GGUF's
    sha256 so that a new GGUF builds anew)."""
    variant = draft_variant(m)
    if variant != GGUF_VARIANT:
        return m.variant_path(variant)
    rec = m.variants[GGUF_VARIANT]
    out = store.home / "built" / f"{m.name}-{rec.get('sha256', 'unhashed')[:12]}" / f"{GRAPH_VARIANT}.onnx"
    if out.is_file():
        return out
    import onnx

    from memspec.models.convert import DecoderBuilder
    from memspec.models.gguf import GGUFModel

    proto = DecoderBuilder(GGUFModel(m.variant_path(GGUF_VARIANT)), GRAPH_VARIANT, pad_attention=False).build()
    out.parent.mkdir(parents=True, exist_ok=True)
    # a name of its own: two processes (a daemon and a CLI) may build it at once; the last rename wins
    tmp = out.with_name(f"{out.name}.{os.getpid()}-{threading.get_ident()}.partial")
    onnx.save_model(proto, str(tmp))
    tmp.replace(out)
    return out


def read_vocab_map(m: Manifest, target_vocab: int) -> np.ndarray:
    """A draft's vocabulary map, (V_draft,) the target id of each draft id, checked against the
    target's vocabulary."""
    vocab_file = m.path_of({"path": m.extra.get("draft_vocab", "vocab.json")})  # inside the draft's folder
    try:
        to_target = np.asarray(json.loads(vocab_file.read_text()), dtype=np.int64)
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"draft {m.name!r}: cannot read its vocabulary map {vocab_file}: {exc}") from None
    if to_target.ndim != 1 or to_target.min() < 0 or to_target.max() >= target_vocab:
        raise ModelFormatError(
            f"draft {m.name!r} is not compatible with the target: its vocabulary map holds ids "
            f"{to_target.min()}..{to_target.max()}, the target's vocabulary has {target_vocab}"
        )
    if len(np.unique(to_target)) != len(to_target):  # a sampled draft's q is its row put on these ids
        raise ModelFormatError(f"draft {m.name!r}: its vocabulary map {vocab_file.name} gives one target id "
                               f"to two draft ids; each draft id must stand for a different target id")
    return to_target


def target_to_draft(to_target: np.ndarray, target_vocab: int) -> np.ndarray:
    """(V_target,) the draft id of each target id; ids the draft lacks map to its id of the
    target's token 0 (the unknown token), else to 0."""
    hits = np.nonzero(to_target == 0)[0]
    to_draft = np.full(target_vocab, int(hits[0]) if len(hits) else 0, dtype=np.int64)
    to_draft[to_target] = np.arange(len(to_target))
    return to_draft


class DraftModel:
    """An ONNX draft and the map between its vocabulary and the target's."""

    def __init__(self, name: str, session: Target, to_target: np.ndarray, target_vocab: int,
                 limits: DraftLimits = DraftLimits(), manifest: Manifest | None = None,
                 prefixes: PrefixCache | None = None):
        self.name = name
        self.session = session
        self.to_target = to_target  # (V_draft,) target id of each draft id
        self.to_draft = target_to_draft(to_target, target_vocab)  # (V_target,)
        self.target_vocab = target_vocab
        self.limits = limits
        self.manifest = manifest
        self.nbytes = manifest.total_bytes if manifest else session.path.stat().st_size
        self.variant = draft_variant(manifest) if manifest else session.path.stem
        self._fed = [0, 0.0]  # tokens and seconds of the timed catch-ups, over every request's state
        self._fed_lock = threading.Lock()
        self.prefixes = prefixes  # recent requests' K/V (draft_prefixes); None: kept by none

    @classmethod
    def load(cls, store: ModelStore, name: str, target_vocab: int, config: SessionConfig = SessionConfig(),
             limits: DraftLimits = DraftLimits()) -> "DraftModel":
        m = store.get(name)
        if m.role != "draft":
            raise ModelFormatError(f"model {name!r} is a {m.role}, not a draft")
        variant = draft_variant(m)
        store.check_files(m, variant)  # a tampered or truncated file is refused before it is parsed
        to_target = read_vocab_map(m, target_vocab)
        threads = draft_threads(config, m.variant_bytes(variant))
        if draft_engine(m, config) == "native":
            try:
                session = open_draft(m.variant_path(variant), "native", config, threads)
            except ModelFormatError as exc:
                raise ModelFormatError(f"draft {name!r}: {exc}") from None
        else:
            session = open_draft(draft_graph(store, m), "onnxruntime", config, threads)
        if session.vocab_size not in (None, len(to_target)):
            raise ModelFormatError(
                f"draft {name!r}: the model has {session.vocab_size} logits but its map has {len(to_target)} ids"
            )
        return cls(name, session, to_target, target_vocab, limits, m,
                   draft_prefixes(session, m.variant_bytes(variant), config))

    def begin(self, capacity: int) -> "ModelDraftState":
        return ModelDraftState(self, capacity)

    def fed(self, tokens: int, seconds: float) -> None:
        """A catch-up of `tokens` took `seconds` (a request's state reports it)."""
        with self._fed_lock:
            self._fed[0] += tokens
            self._fed[1] += seconds

    def feed_seconds_per_token(self) -> float | None:
        """Seconds a token of context costs to catch up on (a request that switches to this draft
        feeds it the whole context first); None until a catch-up of FEED_MIN_TOKENS was timed."""
        with self._fed_lock:
            tokens, seconds = self._fed
        return seconds / tokens if tokens else None


def draft_prefixes(session: Target, file_bytes: int, config: SessionConfig) -> PrefixCache | None:
    """The store of recent requests' K/V a draft keeps: where its engine computes a reused prefix bit
    for bit (`prefix_reuse`: the native one) and `[runtime] prefix_cache_mb` is on, at most
    1/PREFIX_SHARE of its file's bytes (and never more than the target's); else None."""
    if not getattr(session, "prefix_reuse", False) or config.prefix_cache_mb <= 0:
        return None
    return PrefixCache(min(file_bytes // PREFIX_SHARE, config.prefix_cache_mb << 20))


class ModelDraftState:
    """One request's draft cache."""

    def __init__(self, draft: DraftModel, capacity: int):
        self.d = draft
        self.cache = draft.session.new_cache(capacity)
        self.cached: list[int] = []  # target ids whose K/V are in the draft cache
        self.committed = 0  # how many of `cached` are committed context (the last catch-up's)

    def _catch_up(self, context: list[int]) -> tuple[np.ndarray, float]:
        """Roll back to the longest cached prefix of context, feed the rest; return the last logits
        and the seconds a long feed took (FEED_MIN_TOKENS or more; else 0.0).  The first catch-up
        starts from the draft's stored prefixes and stores the prompt for the requests after it."""
        first = not self.cached and self.d.prefixes is not None and self.cache.length == 0
        if first:
            ids = self.d.to_draft[context].tolist()  # the prompt in the draft's ids: looked up, then stored
            self.cached.extend(context[: self.d.prefixes.fill(self.cache, ids)])
        n = 0
        limit = min(len(self.cached), len(context) - 1)  # always feed at least the last token
        while n < limit and self.cached[n] == context[n]:
            n += 1
        self.cache.truncate(n)
        del self.cached[n:]
        feed = context[n:]
        t0 = time.perf_counter()
        logits = self.d.session.forward(self.cache, self.d.to_draft[feed].tolist(), keep=1)[-1]
        setup = 0.0
        if len(feed) >= FEED_MIN_TOKENS:
            setup = time.perf_counter() - t0
            self.d.fed(len(feed), setup)
        self.cached.extend(feed)
        self.committed = len(context)
        if first:
            self.d.prefixes.store(ids, self.cache)
        return logits, setup

    def propose(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator,
                shaper: LogitsShaper = IDENTITY, alternatives: bool = False) -> Proposal:
        k = min(k, self.cache.capacity - len(context))
        if k <= 0:
            return Proposal([], None, [])
        lim = self.d.limits
        seen = (loop_continuation(context, k, lim.loop_tokens)
                or ngram_continuation(context, k, lim.lookup_ngram, LOOKUP_MAX_NGRAM))
        if seen:  # the model does not run; its cache catches up when it next does
            prop = deterministic_proposal(seen, self.d.target_vocab, params, shaper)
            if alternatives and is_identity(shaper):  # other earlier occurrences, for a token tree
                prop.alternatives = [ngram_alternatives(context, seen[0], k, lim.lookup_ngram, LOOKUP_MAX_NGRAM)]
            return prop
        logits, setup = self._catch_up(context)
        if not is_identity(shaper):
            return self._propose_shaped(logits, setup, len(context), k, params, rng, shaper)
        tokens, qs, ents, alts = [], [], [], []
        for i in range(k):
            summary = params.greedy and not alternatives  # the token and its confidence: no distribution built
            if summary:
                did, top, ent = sampling.greedy_summary(logits)
            else:
                probs = sampling.probabilities(logits, 1.0) if params.greedy else sampling.probabilities(
                    logits, params.temperature, params.top_k, params.top_p, params.min_p)
                ent, top = float(-(probs * np.log(np.maximum(probs, 1e-30))).sum()), float(probs.max())
            if i > 0 and (top < self.d.limits.p_min or ent > self.d.limits.max_entropy):
                break  # the draft is unsure: stop and let the target verify what we have
            if not summary:  # coupled noise is keyed by the target's ids: the draft's argmax is the target's
                did = (int(np.argmax(probs)) if params.greedy
                       else sampling.draw(probs, rng, len(context) + i, self.d.to_target))
            tokens.append(int(self.d.to_target[did]))
            ents.append(ent)
            if not params.greedy and not sampling.coupled(rng):  # the speculative-sampling rule reads q
                qs.append(probs)
            if alternatives and i < ALT_POSITIONS:  # its next choices here, for a token tree
                alts.append([[int(self.d.to_target[a])] for a in top_alternatives(probs, did)])
            if i + 1 < k:
                logits = self.d.session.forward(self.cache, [did], keep=1)[-1]
                self.cached.append(tokens[-1])
        return Proposal(tokens, sampling.DraftRows(np.stack(qs), self.d.to_target) if qs else None, ents, setup, alts)

    def _propose_shaped(self, logits: np.ndarray, setup: float, at: int, k: int, params: SamplingParams,
                        rng: sampling.Randomness, shaper: LogitsShaper) -> Proposal:
        """propose() under a shaper: each draft row is put in the target's vocabulary (-inf where the
        draft has no token) and shaped with the tokens proposed before it, so that q is the
        distribution each token was really drawn from.  The pushed tokens are popped at the end.
        at: the context's length (coupled noise: token i is the one after at + i tokens)."""
        tokens, qs, ents = [], [], []
        row = np.full(self.d.target_vocab, -np.inf, dtype=np.float32)
        try:
            for i in range(k):
                row[self.d.to_target] = logits
                z = shaper.shape(row)
                if not np.isfinite(z.max()):
                    break  # the shaper forbids every token this draft has
                probs = sampling.probabilities(z, 1.0) if params.greedy else sampling.probabilities(
                    z, params.temperature, params.top_k, params.top_p, params.min_p)
                ent = float(-(probs * np.log(np.maximum(probs, 1e-30))).sum())
                if i > 0 and (probs.max() < self.d.limits.p_min or ent > self.d.limits.max_entropy):
                    break  # the draft is unsure: stop and let the target verify what we have
                tid = int(np.argmax(probs)) if params.greedy else sampling.draw(probs, rng, at + i)
                shaper.push(tid)
                tokens.append(tid)
                ents.append(ent)
                if not params.greedy and not sampling.coupled(rng):  # the speculative-sampling rule reads q
                    qs.append(probs[self.d.to_target])  # 0 on every other id: the row is -inf there
                if i + 1 < k:
                    logits = self.d.session.forward(self.cache, [int(self.d.to_draft[tid])], keep=1)[-1]
                    self.cached.append(tid)
        finally:
            shaper.pop(len(tokens))
        return Proposal(tokens, sampling.DraftRows(np.stack(qs), self.d.to_target) if qs else None, ents, setup)

    def close(self) -> None:
        """Store the committed context for the requests after this one (a conversation's next turn
        resends it), then drop the cache."""
        if self.cache is not None and self.d.prefixes is not None and self.committed:
            self.d.prefixes.store(self.d.to_draft[self.cached[: self.committed]].tolist(), self.cache)
        self.cache = None


def deterministic_proposal(tokens: list[int], target_vocab: int, params: SamplingParams,
                           shaper: LogitsShaper = IDENTITY) -> Proposal:
    """Tokens proposed without a distribution: when sampling, q is one-hot on each of them.  Under a
    shaper they stop before the first token it forbids (no target row could accept it)."""
    if not is_identity(shaper):
        tokens = allowed_prefix(shaper, tokens, target_vocab)
    q = sampling.DraftRows.one_hot(tokens) if tokens and not params.greedy else None
    return Proposal(list(tokens), q, [0.0] * len(tokens))


# -- prompt lookup -------------------------------------------------------------------
class PromptLookup:
    """Zero-memory draft: continue the loop the context ends in, else the latest earlier
    occurrence of the context's last n-gram (the longest n up to `max_ngram` first)."""

    name = PROMPT_LOOKUP
    nbytes = 0
    session = None

    def __init__(self, target_vocab: int, max_ngram: int = LOOKUP_MAX_NGRAM, min_ngram: int = 1,
                 loop_tokens: int = DraftLimits.loop_tokens):
        self.target_vocab = target_vocab
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.loop_tokens = loop_tokens

    def begin(self, capacity: int) -> "PromptLookupState":
        return PromptLookupState(self)

    def feed_seconds_per_token(self) -> float:
        return 0.0  # nothing to catch up on


class PromptLookupState:
    def __init__(self, pl: PromptLookup):
        self.pl = pl

    def find(self, context: list[int], k: int) -> list[int]:
        return (loop_continuation(context, k, self.pl.loop_tokens)
                or ngram_continuation(context, k, self.pl.min_ngram, self.pl.max_ngram))

    def propose(self, context: list[int], k: int, params: SamplingParams, rng: np.random.Generator,
                shaper: LogitsShaper = IDENTITY, alternatives: bool = False) -> Proposal:
        prop = deterministic_proposal(self.find(context, k), self.pl.target_vocab, params, shaper)
        if prop.tokens and alternatives and is_identity(shaper):  # other earlier occurrences, for a tree
            prop.alternatives = [ngram_alternatives(context, prop.tokens[0], len(prop.tokens), self.pl.min_ngram,
                                                    self.pl.max_ngram)]
        return prop

    def close(self) -> None:
        pass


def target_drafts(store: ModelStore, target_name: str, names: list[str] | None = None,
                  config: SessionConfig | None = None) -> list:
    """The manifests of every draft in the store made for `target_name` (or only `names`); with
    `config`, only those this machine runs (runnable_drafts)."""
    drafts = [m for m in store.list() if m.role == "draft" and m.extra.get("target") == target_name
              and (names is None or m.name in names)]
    return drafts if config is None else runnable_drafts(drafts, config)[0]


def runnable_drafts(drafts: list, config: SessionConfig) -> tuple[list, list]:
    """(the drafts this machine runs, those it cannot): without ONNX Runtime installed, a draft that
    would run in it (an ONNX-only draft, or drafts given GPU providers) cannot; a GGUF draft on the
    native engine, prompt lookup and the suffix draft need none.  A draft in its own tokens
    (textdraft) runs on the native engine only, so not where the drafts run in ONNX Runtime."""
    from memspec.runtime.config import onnxruntime_missing

    config = config or SessionConfig()
    native = {m.name for m in drafts if draft_engine(m, config) == "native"}
    if onnxruntime_missing() is None:
        kept = [m for m in drafts if m.name in native or not speaks_own_tokenizer(m)]
    else:
        kept = [m for m in drafts if m.name in native]
    return kept, [m for m in drafts if m not in kept]


def say_left_out(left: list, config: SessionConfig) -> None:
    """The one log line for the drafts runnable_drafts left out, where any were."""
    if not left:
        return
    from memspec.runtime.config import onnxruntime_missing

    text = [m.name for m in left if speaks_own_tokenizer(m)]
    if text:
        log.warning("drafts %s draft in their own tokens on the native engine only, and the drafts here run in "
                    "ONNX Runtime; they are left out", ", ".join(text))
    other = [m.name for m in left if m.name not in text]
    if other:
        log.warning("drafts %s need ONNX Runtime and are left out; this machine drafts with GGUF drafts on the "
                    "native engine, prompt lookup and the suffix draft (%s)", ", ".join(other), onnxruntime_missing())
