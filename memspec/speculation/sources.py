"""Where each request's draft comes from: the interface the engine asks, and the fixed pool.

The engine has one mode.  It asks its `DraftSource` to check a request, to size the
draft caches the request may hold, and for the request's `DraftSelector`.  Two
sources exist: `DraftPool` here (drafts loaded up front, a request names the one it
wants) and the scheduler (memspec.scheduling.scheduler.Scheduler: a policy picks,
drafts come and go in a memory-bounded working set).  The engine never imports the
scheduler; memspec.build puts the two together.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Protocol

from memspec.request import NO_DRAFT, GenerationRequest, unknown_draft, unknown_policy
from memspec.speculation.drafts import PROMPT_LOOKUP, PromptLookup, Proposer
from memspec.speculation.speculative import DraftSelector, FixedDraft
from memspec.speculation.corpus import Corpus, corpus_path
from memspec.speculation.suffix import SUFFIX, SuffixDraft, SuffixIndex, corpus_index, corpus_max_bytes, index_nbytes

log = logging.getLogger(__name__)

KVSizer = Callable[[int], int]  # tokens -> resident bytes of one cache holding that many


@dataclass(frozen=True)
class DraftRow:
    """One draft a source may run, as GetStatus lists it."""

    name: str
    resident: bool  # loaded now
    bytes: int  # what it holds (or, not resident, what it is planned at)


@dataclass(frozen=True)
class SourceStatus:
    """What a draft source reports (GetStatus)."""

    drafts: list[DraftRow]  # every draft it may run, by name
    budget_bytes: int | None = None  # the memory budget it keeps; None = it keeps none
    scheduler: dict[str, float] = field(default_factory=dict)  # its counters ({}: it keeps none)
    predictor: dict[str, float] = field(default_factory=dict)  # its predictor's counters ({}: none)


class DraftSource(Protocol):
    """The engine's one way to a request's draft."""

    def check(self, req: GenerationRequest) -> None: ...  # refuse an unknown draft or policy before any work

    def draft_kv_sizers(self, req: GenerationRequest) -> list[KVSizer]: ...  # draft caches it may hold (largest counts)

    def selector(self, req: GenerationRequest, prompt: list[int], capacity: int,
                 cancelled: Callable[[], bool]) -> DraftSelector | None: ...  # cancelled: ends a wait for a load

    def reserve_kv(self, nbytes: int, cancelled: Callable[[], bool]) -> ContextManager[None]: ...  # in its budget

    def hint(self, queued: list[GenerationRequest]) -> None: ...  # requests waiting: preload what they need

    def pinned(self) -> dict[str, Proposer]: ...  # drafts held for the engine's whole life (resident with it)

    def unload(self, name: str) -> int | None: ...  # drop a resident draft: bytes freed; None: not resident

    def shrink(self, nbytes: int) -> int: ...  # evict unleased drafts until nbytes are freed: bytes freed

    def add_spare(self, release: Callable[[], int]) -> None: ...  # a cache to empty first under memory pressure

    def learn(self, tokens: list[int]) -> None: ...  # a request's prompt and committed output (the suffix draft's index)

    def forget(self) -> None: ...  # drop what learn() indexed (a benchmark round starts from nothing)

    def report(self) -> SourceStatus: ...

    def close(self) -> None: ...  # stop background work and drop the drafts (idempotent)


@dataclass(frozen=True)
class DraftMaker:
    """The one place each kind of draft is made for a target: prompt lookup, the suffix draft, and
    the drafts in the store made for it (in the target's tokens, or in their own: textdraft).  The
    fixed pool (memspec.build.load_pool) makes every one up front; the scheduler
    (memspec.scheduling.scheduler.from_store) makes each when its working set loads it.  A new kind
    of draft is added here, and both have it."""

    store: object  # the ModelStore the drafts are loaded from
    target_vocab: int  # the target's vocabulary: every draft proposes ids below it
    manifests: list  # the store's drafts made for the target that this machine runs
    config: object  # SessionConfig: how a model draft runs (engine, threads, context)
    limits: object  # DraftLimits: how far a draft proposes, and its n-gram shortcuts
    suffix_bytes: int = 0  # the suffix draft's index (0: no suffix draft)
    tokenizer: object = None  # the target's: a draft in its own tokens reads the context as text through it
    corpus: Corpus | None = None  # the target's own answers the suffix draft starts with (speculation.corpus)

    @classmethod
    def for_target(cls, store, target_name: str, target_vocab: int, config=None, limits=None,
                   names: list[str] | None = None, suffix_bytes: int = 0, tokenizer=None,
                   corpus: bool = True) -> "DraftMaker":
        """The drafts for `target_name` (only `names` of the store's, where given) that this machine
        runs; those it cannot are logged once (drafts.say_left_out).  With `corpus`, the suffix draft
        starts from the target's shipped corpus (models/corpus-TARGET.npz), where there is one."""
        from memspec.runtime.config import SessionConfig
        from memspec.speculation.config import DraftLimits
        from memspec.speculation.drafts import runnable_drafts, say_left_out, target_drafts

        config, limits = config or SessionConfig(), limits or DraftLimits()
        drafts, left = runnable_drafts(target_drafts(store, target_name, names), config)
        say_left_out(left, config)
        found = shipped_corpus(store, target_name, target_vocab) if corpus and suffix_bytes else None
        return cls(store, target_vocab, drafts, config, limits, suffix_bytes, tokenizer, found)

    def suffix_nbytes(self) -> int:
        """The suffix draft's bytes: its index of what the daemon serves, and its corpus's (0: none)."""
        return suffix_nbytes(self.suffix_bytes, self.corpus)

    @property
    def names(self) -> list[str]:
        """Every draft it makes: prompt lookup, the suffix draft where it has an index, the store's."""
        return self.names_for(self.manifests, self.suffix_bytes > 0)

    @staticmethod
    def names_for(manifests: list, suffix: bool) -> list[str]:
        """The drafts a maker over `manifests` makes (with a suffix draft, where `suffix`), by name."""
        return [PROMPT_LOOKUP, *([SUFFIX] if suffix else []), *(m.name for m in manifests)]

    def make(self, name: str) -> Proposer:
        """The draft `name`, loaded (a model draft's weights are read here)."""
        if name == PROMPT_LOOKUP:
            return PromptLookup(self.target_vocab, loop_tokens=self.limits.loop_tokens)
        if name == SUFFIX and self.suffix_bytes:
            corpus = corpus_index(self.corpus.sequences) if self.corpus is not None else None
            return SuffixDraft(SuffixIndex(self.suffix_bytes), self.target_vocab, loop_tokens=self.limits.loop_tokens,
                               corpus=corpus)
        if any(m.name == name for m in self.manifests):
            from memspec.speculation.textdraft import load_draft

            return load_draft(self.store, name, self.target_vocab, self.config, self.limits, self.tokenizer)
        raise ValueError(f"no draft {name!r} is made here; the drafts are {', '.join(self.names)}")

    def make_all(self) -> dict[str, Proposer]:
        """Every draft, loaded now, by name."""
        return {name: self.make(name) for name in self.names}


def shipped_corpus(store, target_name: str, target_vocab: int) -> Corpus | None:
    """The corpus models/ ships for the target (speculation.corpus), or None: none ships, or its file
    is bad (a warning: a bad file costs the corpus, not the daemon)."""
    shipped = getattr(store, "shipped", None)
    if shipped is None or not corpus_path(shipped, target_name).is_file():
        return None
    try:
        return Corpus.load(corpus_path(shipped, target_name), target_name, target_vocab)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("the suffix draft's corpus for %s is not used: %s", target_name, exc)
        return None


def suffix_nbytes(suffix_bytes: int, corpus: Corpus | None) -> int:
    """The bytes of a suffix draft over an index of `suffix_bytes` (0: no suffix draft) and `corpus`:
    what the memory budget plans it at, and what it holds."""
    if not suffix_bytes:
        return 0
    held = corpus_max_bytes(len(s) for s in corpus.sequences) if corpus is not None else 0
    return index_nbytes(suffix_bytes) + (index_nbytes(held) if held else 0)


class DraftPool(Mapping[str, Proposer]):
    """Drafts loaded up front, kept for the engine's life, with no budget: a request runs the
    draft it names (`draft`, or a fixed / target-only `policy`), else `default`."""

    def __init__(self, proposers: Mapping[str, Proposer] | None = None, default: str | None = None):
        self.proposers: dict[str, Proposer] = dict(proposers or {})  # name -> loaded proposer
        self.default = default  # the draft of a request that names none; None = target only

    # -- Mapping: the loaded proposers by name --------------------------------------------
    def __getitem__(self, name: str) -> Proposer:
        return self.proposers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.proposers)

    def __len__(self) -> int:
        return len(self.proposers)

    # -- DraftSource ----------------------------------------------------------------------
    def policies(self) -> list[str]:
        """The policies a pool can run: target-only, or one of its drafts throughout."""
        return ["target-only", *(f"fixed:{d}" for d in sorted(self.proposers))]

    def draft_of(self, req: GenerationRequest) -> Proposer | None:
        """The proposer a request runs with (None = target only)."""
        field_name, name = "draft", req.draft
        if not name and req.policy is not None:
            if req.policy.kind not in ("target-only", "fixed"):
                raise unknown_policy(str(req.policy), self.policies())
            field_name, name = "policy", req.policy.draft or NO_DRAFT
        name = name or self.default
        if name in (None, NO_DRAFT):
            return None
        if name not in self.proposers:
            raise unknown_draft(name, self.proposers, field_name)
        return self.proposers[name]

    def check(self, req: GenerationRequest) -> None:
        self.draft_of(req)

    def draft_kv_sizers(self, req: GenerationRequest) -> list[KVSizer]:
        proposer = self.draft_of(req)
        return [proposer.session.cache_nbytes] if proposer is not None and proposer.session is not None else []

    def selector(self, req: GenerationRequest, prompt: list[int], capacity: int,
                 cancelled: Callable[[], bool] = lambda: False) -> DraftSelector | None:
        proposer = self.draft_of(req)  # loaded already: nothing to wait for
        return FixedDraft(proposer.name, proposer.begin(capacity)) if proposer is not None else None

    def reserve_kv(self, nbytes: int, cancelled: Callable[[], bool]) -> ContextManager[None]:
        return contextlib.nullcontext()  # no budget: admission's check against free memory is the only one

    def hint(self, queued: list[GenerationRequest]) -> None:
        pass  # everything is loaded already

    def pinned(self) -> dict[str, Proposer]:
        return dict(self.proposers)

    def unload(self, name: str) -> int | None:
        proposer = self.proposers.get(name)
        if proposer is None:
            return None
        # a new dict, not a pop: status() may be iterating the old one on another thread
        self.proposers = {n: p for n, p in self.proposers.items() if n != name}
        return proposer.nbytes

    def shrink(self, nbytes: int) -> int:
        return 0  # a fixed pool: its drafts go with the engine

    def add_spare(self, release: Callable[[], int]) -> None:
        pass  # no budget and no pressure check: nothing would ever call it

    def learn(self, tokens: list[int]) -> None:
        """The suffix draft, when the pool has it, indexes what a finished request committed."""
        draft = self.proposers.get(SUFFIX)
        if isinstance(draft, SuffixDraft):
            draft.learn(tokens)

    def forget(self) -> None:
        draft = self.proposers.get(SUFFIX)
        if isinstance(draft, SuffixDraft):
            draft.forget()

    def report(self) -> SourceStatus:
        return SourceStatus([DraftRow(n, True, int(p.nbytes)) for n, p in sorted(self.proposers.items())])

    def close(self) -> None:
        pass  # the proposers go with the pool; none runs in the background
