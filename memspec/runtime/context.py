"""How many tokens a target's context holds: `[runtime] max_context`, per model where
`[runtime] model_max_context` names it.

"auto" (the default) is the model's trained context (the GGUF's `<arch>.context_length`, which
the store's manifest records for every target, ONNX graphs included), capped so that the KV
caches of the configured slots ([server] max_concurrent requests, each with the largest of its
drafts' caches beside the target's) fit the memory the process may use: what the memory budget
leaves once the target is loaded, or with no budget the system's available memory less the
headroom.  A number fixes the context.  Caches are allocated at this capacity but committed page by
page as positions are written (memspec.runtime.kvcache.committed_as_written), so a long context
costs memory only when a request fills it; admission reserves each request's prompt + max_tokens.

No engine is imported here: the composition (memspec.build) asks, and the engine's `max_context`
takes the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

ROUND = 256  # a context capped by memory is a multiple of this many tokens ...
FLOOR = 256  # ... and never fewer (a request that cannot fit the memory then is refused with a 507)
UNKNOWN_TRAINED = 2048  # a model whose trained context is not recorded (the former default)
MiB = 1 << 20


def setting_for(max_context: int | str, per_model: tuple[tuple[str, int | str], ...], model: str) -> int | str:
    """The max_context setting of `model`: its own in `[runtime] model_max_context`, else the default."""
    return dict(per_model).get(model, max_context)


def trained_context(architecture: dict | None) -> int | None:
    """The context a model was trained for, as its manifest records it (None: not recorded)."""
    n = (architecture or {}).get("context_length")
    return int(n) if n else None


def opening_context(setting: int | str, trained: int | None) -> int:
    """The capacity a target opens with: a fixed setting, else its trained context (the memory cap
    comes once it is loaded: choose)."""
    return setting if isinstance(setting, int) else (trained or UNKNOWN_TRAINED)


@dataclass(frozen=True)
class Choice:
    """The context chosen for a target, and why, in words (logged at load, shown by doctor)."""

    tokens: int
    reason: str


def choose(setting: int | str, trained: int | None, kv_bytes_per_token: int, slots: int, room_bytes: int,
           room_what: str = "the memory") -> Choice:
    """The context of a target: `setting` when it is a number; for "auto", its `trained` context,
    or fewer tokens (a multiple of ROUND, at least FLOOR) where `slots` caches of
    `kv_bytes_per_token` per token (the target's and the largest draft's) would not fit `room_bytes`."""
    if isinstance(setting, int):
        return Choice(setting, f"max_context = {setting}")
    model = trained or UNKNOWN_TRAINED
    said = f"trained context {trained}" if trained else f"trained context not recorded: {UNKNOWN_TRAINED}"
    per_slot = max(kv_bytes_per_token, 1) * slots
    fits = max(room_bytes, 0) // per_slot
    kv = f"{slots} slot(s) x {kv_bytes_per_token / 1024:.1f} KiB of KV per token"
    if fits >= model:
        return Choice(model, f"auto: the model's {said}; {kv} fit {room_what} ({room_bytes / MiB:.0f} MiB)")
    tokens = max(fits // ROUND * ROUND, min(FLOOR, model))
    return Choice(tokens, f"auto: the model's {said}, capped so that {kv} fit {room_what} "
                          f"({room_bytes / MiB:.0f} MiB)")
