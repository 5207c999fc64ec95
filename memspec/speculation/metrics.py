"""Per-request speculative-decoding metrics, in vLLM's vocabulary.

Counted here; exported (JSON, gRPC stats, logs) elsewhere.  The clock is passed
in so tests can run on a fake one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memspec.request import SpecStats


@dataclass
class SpecMetrics:
    num_drafts: int = 0  # verification steps that had at least one draft token
    num_draft_tokens: int = 0  # tokens proposed by drafts
    num_accepted_tokens: int = 0  # draft tokens the target accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = drafts whose token i was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [i] = drafts that proposed a token i
    draft_s: float = 0.0  # time spent drafting (including draft catch-up)
    verify_s: float = 0.0  # time spent in target forwards (prefill excluded)
    token_latencies_s: list[float] = field(default_factory=list)  # inter-token latency of each committed token
    drafts_used: dict[str, int] = field(default_factory=dict)  # draft name -> steps it proposed tokens in
    draft_failures: int = 0  # drafts that raised and were given up (the request went on target-only)
    tree_steps: int = 0  # steps verified as a token tree (memspec.speculation.tree)
    tree_rows: int = 0  # rows those passes added to their chains (the branches' tokens)
    tree_tokens: int = 0  # tokens committed through a branch, beyond what the chain alone would have
    forced_steps: int = 0  # steps that verified a grammar's forced tokens instead of a draft's proposal
    forced_tokens: int = 0  # tokens those steps proposed
    forced_accepted: int = 0  # ... and the target accepted

    def record_forced(self, proposed: int, accepted: int) -> None:
        """A step that verified `proposed` tokens the request's grammar forced (no draft ran)."""
        self.forced_steps += 1
        self.forced_tokens += proposed
        self.forced_accepted += accepted

    def record_tree(self, branch_rows: int, won: int) -> None:
        """A step verified as a tree: its branches' rows, and the tokens they won over the chain."""
        self.tree_steps += 1
        self.tree_rows += branch_rows
        self.tree_tokens += won

    def record_step(self, draft_name: str | None, n_drafted: int, n_accepted: int, n_committed: int,
                    draft_s: float, verify_s: float) -> None:
        """One draft-and-verify step (n_drafted = 0 for a target-only step)."""
        self.draft_s += draft_s
        self.verify_s += verify_s
        if n_drafted:
            self.num_drafts += 1
            self.num_draft_tokens += n_drafted
            self.num_accepted_tokens += n_accepted
            while len(self.drafted_per_position) < n_drafted:
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
            for i in range(n_drafted):
                self.drafted_per_position[i] += 1
            for i in range(n_accepted):
                self.accepted_per_position[i] += 1
        if draft_name is not None and n_drafted:  # a step the draft sat out is a plain target step
            self.drafts_used[draft_name] = self.drafts_used.get(draft_name, 0) + 1
        if n_committed:
            self.token_latencies_s.extend([(draft_s + verify_s) / n_committed] * n_committed)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verification step: 1 + accepted / drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def wasted_draft_tokens(self) -> int:
        return self.num_draft_tokens - self.num_accepted_tokens

    def freeze(self) -> SpecStats:
        """The request's stats as they leave the engine."""
        lat = np.asarray(self.token_latencies_s) * 1e3
        mean = float(lat.mean()) if lat.size else 0.0
        return SpecStats(
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            mean_acceptance_length=round(self.mean_acceptance_length, 4),
            acceptance_rate=round(self.num_accepted_tokens / self.num_draft_tokens, 4) if self.num_draft_tokens else 0.0,
            acceptance_by_position=tuple(
                round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ),
            wasted_draft_tokens=self.wasted_draft_tokens,
            draft_ms=round(self.draft_s * 1e3, 3),
            verify_ms=round(self.verify_s * 1e3, 3),
            itl_p50_ms=round(float(np.percentile(lat, 50)), 3) if lat.size else 0.0,
            itl_p99_ms=round(float(np.percentile(lat, 99)), 3) if lat.size else 0.0,
            itl_cv=round(float(lat.std() / mean), 4) if lat.size and mean > 0 else 0.0,
            drafts_used=dict(self.drafts_used),
            draft_failures=self.draft_failures,
            tree_steps=self.tree_steps,
            tree_rows=self.tree_rows,
            tree_tokens=self.tree_tokens,
            forced_steps=self.forced_steps,
            forced_tokens=self.forced_tokens,
            forced_accepted=self.forced_accepted,
        )
