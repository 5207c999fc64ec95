"""Does a row's result depend on how many rows share its pass?  The target's self-check at load.

Speculative output is target-only output token for token only if the target gives a position the
same logits, bit for bit, whether that position is decoded alone (one token a pass) or verified
among draft tokens (k tokens a pass).  That is a property of the CPU's kernels, not of the model:

* ONNX Runtime's CPU GroupQueryAttention takes another kernel for a lone query row, on every CPU.
  Our graphs pad a one-token pass's attention with a copy of its row (memspec.attention_pad), so
  attention always runs the multi-row kernel, while the matrix multiplies stay one row.
* MatMulNBits (4-bit, the q4 variant) is row-invariant on AVX-512 hosts, but on AVX2-only CPUs a
  lone row takes a GEMV kernel that sums in another order (3e-6 apart on one layer's output,
  up to 0.9 apart on the logits): every pass of two or more rows agrees, one row does not
  (docs/history/results.md has the per-operator table).  Padding the whole pass to two rows fixes it,
  at the cost of a two-row pass for each decoded token.

So a session that is asked for exactness (min_rows >= 2, `[runtime] batch_invariant`) first tries
its cheapest padding and, where the probe finds a difference, pads every one-token pass to two
rows and probes again.  Whatever the outcome is, it is reported: `RowCheck.warning()` goes to the
log, `memspec generate`, GetStatus / `memspec status` and `/metrics`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from memspec.runtime.contracts import UNCHECKED, WARNING, RowCheck, Target  # noqa: F401 (re-exported)

CONTEXT = 8  # tokens cached before the probe rows
PROBE = 5  # probe rows: fed one at a time, in passes of 2 and 3, and in one pass of 5


class Padded(Target, Protocol):
    """A target whose one-token passes can be padded to more rows (ONNX Runtime's sessions)."""

    pad_rows: int  # tokens a pass is padded to


def _probe_ids(session: Target) -> list[int]:
    vocab = session.vocab_size or 1000
    return [(31 * i + 7) % vocab for i in range(CONTEXT + PROBE)]


def row_differences(session: Target) -> dict[str, float]:
    """{pass sizes: largest logit difference} between the probe rows' logits computed one token a
    pass (what target-only decoding runs), in passes of 2 and 3, and in one pass of all 5 (what
    verification runs), each after the same cached context, with the session's padding as it is.
    Every value 0.0: a row's logits do not depend on how many rows share its pass."""
    ids = _probe_ids(session)
    ctx, rows = ids[:CONTEXT], ids[CONTEXT:]

    def passes(sizes: tuple[int, ...]) -> np.ndarray:
        cache = session.new_cache(CONTEXT + PROBE + 1)
        session.forward(cache, ctx, keep=1)
        out, at = [], 0
        for n in sizes:
            out.append(session.forward(cache, rows[at:at + n], keep=n))
            at += n
        return np.concatenate(out)

    whole = passes((PROBE,))
    return {f"1 and {PROBE}": float(np.abs(passes((1,) * PROBE) - whole).max()),
            f"2+3 and {PROBE}": float(np.abs(passes((2, 3)) - whole).max())}


def check(target: Target) -> RowCheck:
    """The probe on a target with no padding to choose (memspec.runtime.native_target, exact by
    construction): checked all the same, since nothing is assumed."""
    diffs = row_differences(target)
    worst = max(diffs, key=diffs.get)
    if diffs[worst] == 0.0:
        return RowCheck(True, 1, 0.0, "")
    return RowCheck(False, 1, diffs[worst], f"a row's logits differ by up to {diffs[worst]:.3g} between passes of "
                                            f"{worst} rows (memspec's native kernels must never do this: a bug to "
                                            f"report, with `python bench/row_invariance.py`'s output)")


def settle(session: Padded, escalate: bool) -> RowCheck:
    """Probe the session; if it is not exact and `escalate` (the caller asked for exactness), pad
    every one-token pass to two rows and probe again.  Leaves session.pad_rows at what holds."""
    first = row_differences(session)
    if max(first.values()) == 0.0:
        return RowCheck(True, session.pad_rows, 0.0, "")
    if escalate and session.pad_rows < 2:
        cheap = session.pad_rows
        session.pad_rows = 2
        second = row_differences(session)
        if max(second.values()) == 0.0:
            worst = max(first, key=first.get)
            return RowCheck(True, 2, 0.0, f"one-token passes run as two rows: alone, a row's logits differ by "
                                          f"up to {first[worst]:.3g} between passes of {worst} rows")
        session.pad_rows = cheap
    worst = max(first, key=first.get)
    what = (f"a row's logits differ by up to {first[worst]:.3g} between passes of {worst} rows "
            f"(ONNX Runtime's kernels on this CPU round a row differently with the row count)")
    if not escalate:
        what += "; [runtime] batch_invariant = false leaves one-token passes unpadded"
    else:
        what += "; padding one-token passes to two rows did not remove it"
    return RowCheck(False, session.pad_rows, first[worst], what)
