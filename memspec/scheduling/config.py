"""The scheduler's config: draft selection and the resident set ([scheduler] in the config file).

Kept apart from memspec.scheduling.scheduler, so that loading a config imports no
draft, session or runtime module.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Draft selection and the resident set ([scheduler] in the config)."""

    policy: str = "memspec"  # target-only, fixed:<draft>, bandit, memspec or oracle
    budget_mb: int = 0  # target + resident drafts may not exceed this; 0 = no budget
    pressure_floor_mb: int = 256  # below this much available system memory: evict drafts, then target-only; 0 = off
    switch_every_steps: int = 8  # memspec: ask the predictor again every this many steps (fewer where asking
    #                              would take over 2% of the time: selector.ASK_SHARE)
    switch_margin: float = 0.15  # memspec: switch only for a predicted gain of at least this fraction
    ucb_c: float = 0.5  # bandit: exploration weight (rewards are scaled to [0, 1])
    bandit_reward: str = "tok_per_s"  # bandit: "tok_per_s" or "acceptance_per_cost"
    preload: bool = True  # memspec: load what queued and likely requests need ahead of time
    expected_tokens: int = 128  # memspec: tokens a request is expected to run for (capped by max_tokens)
    value_decay: float = 0.8  # memspec: weight of the past in each draft's expected value (EMA)
    predictor: str = ""  # memspec: predictor JSON; "" = models/predictor-VARIANT.json, else models/predictor.json
    oracle: str = ""  # oracle: JSON {prompt: draft} or JSONL traces {prompt, draft, tok_per_s}
    retry_after_s: float = 30.0  # a draft that failed to load is not tried again for this long
    load_wait_s: float = 60.0  # a request waits at most this long for its draft to load, then runs target-only
