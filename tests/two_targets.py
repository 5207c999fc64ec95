"""Two pulled targets under one daemon whose budget holds one at a time: the store, config and
question shared by tests/test_targets_e2e.py and scripts/target_switch.py (its figure)."""

from __future__ import annotations

from pathlib import Path

SMOL, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
# Planned at their load's peak (memspec.runtime.memory.planned_target_footprint): SmolLM2 q4 243 MiB,
# the 0.5B 1176 MiB.  With the daemon itself (50-130 MiB) this budget holds either, never both.
BUDGET_MB = 1450

CONFIG = """\
home = "{home}"
[model]
target = "{target}"
variant = "q4"
keep_alive = "5m"
[runtime]
max_context = 256
[limits]
max_tokens = 32
[server]
max_concurrent = 2
[scheduler]
policy = "target-only"
budget_mb = {budget}
"""


def store_of_two(home: Path, real_models: Path) -> Path:
    """A store holding exactly the two targets, as links to the real store's folders (so that a
    target someone else pulled, say the 1.5B, is not among the listed models)."""
    (home / "models").mkdir(parents=True)
    for name in (SMOL, QWEN):
        (home / "models" / name).symlink_to(real_models / name)
    return home


def config(home: Path, budget_mb: int = BUDGET_MB) -> str:
    return CONFIG.format(home=home, target=SMOL, budget=budget_mb)
