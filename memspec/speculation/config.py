"""Speculation's configs: when a draft stops proposing, and how long proposals are.

Kept apart from the decode loop and the drafts (NumPy, ONNX Runtime), so that loading
a config (and the light CLI commands) imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from memspec.errors import ConfigError


@dataclass(frozen=True)
class DraftLimits:
    """When a draft stops proposing early (GELATO / llama.cpp p_min)."""

    p_min: float = 0.3  # stop when the draft's top probability falls below this
    max_entropy: float = 4.0  # ... or when its entropy (nats) rises above this
    loop_tokens: int = 8  # a context ending in a loop this long continues it instead (0: never)
    lookup_ngram: int = 2  # ... or one whose last n >= this many tokens occurred before, what followed (0: never)
    recall_tokens: int = 8  # ... or, where the scheduler holds the suffix draft, one whose last n >= this many
    #                         tokens agree with a request the daemon saw, what followed there (0: never)


SAMPLING_SCHEMES = ("coupled", "standard")


@dataclass(frozen=True)
class SpecConfig:
    """How long draft proposals are ([speculative] in the config; [scheduler] picks the draft)."""

    p_min: float = DraftLimits.p_min  # a draft stops proposing when its top probability falls below this
    max_entropy: float = DraftLimits.max_entropy  # ... or when its entropy (nats) rises above this
    loop_tokens: int = DraftLimits.loop_tokens  # a model draft continues a loop this long itself (0: never)
    lookup_ngram: int = DraftLimits.lookup_ngram  # ... and copies what followed its last n >= this earlier (0: never)
    recall_tokens: int = DraftLimits.recall_tokens  # a step copies what followed the text's last n >= this many
    #                                                 tokens in an earlier request (the suffix index) instead of
    #                                                 running the picked draft (0: never; else 2..24)
    gamma: int = 5  # draft tokens proposed per step at the start
    gamma_min: int = 1  # the step controller never proposes fewer (while drafting at all)
    gamma_max: int = 8  # never propose more
    adaptive: bool = True  # adapt gamma as the request runs (False: always `gamma`)
    controller: str = "cost"  # "cost": gamma that maximises expected tokens per unit of cost, from the
    #                           acceptance seen so far and the target's measured verification cost (0 =
    #                           a plain target step when drafting does not pay); "step": +1 after a full
    #                           acceptance, -1 after a rejection
    trees: bool = False  # where the target takes token trees (the native engine), verify the draft's alternatives
    #                      at the first positions beside its chain when the cost model says they pay
    #                      (memspec.speculation.tree); false: chains only
    gate: bool = True  # with the cost controller, verify only the prefix of each proposal worth its rows, by
    #                    the target's acceptance at the draft's entropy there and the pass costs timed as the
    #                    engine runs (memspec.speculation.confidence); false: every proposed token
    suffix_mb: int = 4  # the suffix draft's index of recent prompts and answers, per target, counted in the
    #                     memory budget (memspec.speculation.suffix); 0 = no suffix draft
    suffix_corpus: bool = True  # the suffix draft also proposes from the target's own answers to training prompts
    #                             where models/ ships them (corpus-TARGET.npz, memspec build-corpus), in an index
    #                             of their own, never evicted, counted with the draft's bytes
    sampling: str = "coupled"  # how a sampled request draws: "coupled" (noise keyed by seed, position and token:
    #                            a seed gives the target-only answer whatever the draft; memspec.speculation.
    #                            sampling) or "standard" (one stream a request, the speculative-sampling rule)

    def __post_init__(self):
        if self.sampling not in SAMPLING_SCHEMES:
            raise ConfigError(f"[speculative] sampling: {self.sampling!r} is not one of {', '.join(SAMPLING_SCHEMES)}")

    def draft_limits(self) -> DraftLimits:
        """What a draft model reads of this config: when it stops proposing, and when it copies."""
        return DraftLimits(self.p_min, self.max_entropy, self.loop_tokens, self.lookup_ngram, self.recall_tokens)
