"""Logits shapers: what a request's output controls do to the target's logits, position by position.

A shaper belongs to one request and has state.  It turns the target's raw logits row at a
position into the row the request decodes from (greedy argmax, or sampling.probabilities),
given every token before that position.  Penalties, logit_bias and a grammar mask are shapers;
`compose` chains them into one.  A request that asks for none of them gets IDENTITY, and the
decode loop then never calls a shaper at all (`is_identity`): no cost on the hot path.

The contract (LogitsShaper)
---------------------------
The shaper is built for a request from its prompt (a repetition penalty counts the prompt's
tokens; a grammar starts after it).  From then on it holds a stack: the generated tokens
pushed so far.  Exactly three calls change or read it:

    shape(row) -> row'   row: (V,) the target's raw logits at the position right after every
                         token pushed so far.  Returns the (V,) shaped logits.  It must not
                         write into `row` (the loop reuses the raw rows for logprobs) and must
                         not change the stack.  -inf marks a forbidden token (a grammar mask);
                         at least one entry must stay finite.
    push(token)          `token` is now in the context: a draft token being proposed or
                         verified, or a committed one.  It is only ever a token that the
                         shape() at its position left finite.
    pop(n)               the last n pushed tokens are gone (rejected drafts); 0 <= n <= pushed.

The decode loop (memspec.speculation.speculative) calls them so that every shape() sees the
stack one-token decoding would have at that position:

    first token:     t = pick(shape(L)); push(t)                         L: the prompt's last row
    each step, the stack holding every committed generated token:
      draft:         for each proposed token x: shape(draft row in the target's vocabulary),
                     x drawn from it (q is that shaped distribution), push(x); then
                     pop(proposed): the stack is as before.  A draft that computes no rows
                     (prompt lookup, suffix) has its proposal cut before the first token
                     shape() forbids (allowed_prefix), pushing and popping the same way.
      verification:  target rows L[0..k] for proposals d[0..k-1]:
                     for i in 0..k: S[i] = shape(L[i]); push(d[i]) if i < k       (verify_rows)
                     accept n of k from S, with the recovered or bonus token t:
                     pop(k - n); push(t)                                          (settle)

So the state advances once per token, never once per step, and rolls back exactly what was
rejected.  Under continuous batching each request still runs this loop on its own thread
(only the target pass is shared), so the same calls happen there.

A grammar matcher fits it as llguidance's and xgrammar's do: push = consume_token,
pop = rollback(n), shape = the row with -inf where compute_mask says no.
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol, Sequence

import numpy as np


class LogitsShaper(Protocol):
    """One request's per-position logits transform (module docstring: the contract)."""

    def shape(self, row: np.ndarray) -> np.ndarray: ...  # (V,) raw -> (V,) shaped

    def push(self, token: int) -> None: ...

    def pop(self, n: int) -> None: ...


class Identity:
    """No control asked: the row as it is.  The loop skips every call on it (is_identity)."""

    def shape(self, row: np.ndarray) -> np.ndarray:
        return row

    def push(self, token: int) -> None:
        pass

    def pop(self, n: int) -> None:
        pass


IDENTITY = Identity()


def is_identity(shaper: LogitsShaper) -> bool:
    return isinstance(shaper, Identity)


class Chain:
    """Several shapers applied in order; every push and pop goes to each."""

    def __init__(self, parts: Sequence[LogitsShaper]):
        self.parts = list(parts)

    def shape(self, row: np.ndarray) -> np.ndarray:
        for p in self.parts:
            row = p.shape(row)
        return row

    def push(self, token: int) -> None:
        for p in self.parts:
            p.push(token)

    def pop(self, n: int) -> None:
        for p in self.parts:
            p.pop(n)


def compose(*shapers: LogitsShaper) -> LogitsShaper:
    """One shaper applying `shapers` in order: IDENTITY when none does anything, the one when one does."""
    parts: list[LogitsShaper] = []
    for s in shapers:
        if isinstance(s, Chain):
            parts.extend(s.parts)
        elif not is_identity(s):
            parts.append(s)
    if not parts:
        return IDENTITY
    return parts[0] if len(parts) == 1 else Chain(parts)


def forced(shaper: LogitsShaper, limit: int) -> list[int]:
    """The next tokens the shaper forces, at most `limit`: where a grammar admits only one way on
    (a JSON schema's keys and punctuation), its tokens (memspec.speculation.grammar); [] where
    nothing is forced.  A shaper forces tokens only if it has `forced_tokens`; in a chain, the one
    that does (penalties and biases reorder what a grammar admits, but cannot add to one path)."""
    if limit <= 0:
        return []
    for part in shaper.parts if isinstance(shaper, Chain) else (shaper,):
        tokens = getattr(part, "forced_tokens", None)
        if tokens is not None:
            return tokens(limit)
    return []


# -- the loop's side of the contract ---------------------------------------------------
def verify_rows(shaper: LogitsShaper, rows: np.ndarray, draft: Sequence[int]) -> np.ndarray:
    """(k+1, V) the shaped rows a verification decides from: rows (k+1, V) are the target's raw
    rows for the k draft tokens and the bonus; each draft token is pushed after its own row.
    Leaves the k draft tokens pushed (settle() pops the rejected ones)."""
    out = np.empty(rows.shape, dtype=np.float32)
    for i, row in enumerate(rows):
        out[i] = shaper.shape(row)
        if i < len(draft):
            shaper.push(int(draft[i]))
    return out


def settle(shaper: LogitsShaper, k: int, n_accepted: int, token: int) -> None:
    """After verify_rows over k drafts: drop the k - n_accepted rejected, push the recovered or bonus token."""
    shaper.pop(k - n_accepted)
    shaper.push(token)


def allowed_prefix(shaper: LogitsShaper, tokens: Sequence[int], vocab: int) -> list[int]:
    """The longest prefix of `tokens` that the shaper allows position by position (a proposal made
    without rows: prompt lookup, suffix).  Leaves the shaper as it found it."""
    zeros = np.zeros(vocab, dtype=np.float32)
    n = 0
    try:
        for t in tokens:
            if not np.isfinite(shaper.shape(zeros)[t]):
                break
            shaper.push(int(t))
            n += 1
    finally:
        shaper.pop(n)
    return list(tokens[:n])


# -- the controls of SamplingParams ----------------------------------------------------
class Penalties:
    """Repetition, frequency and presence penalties, as vLLM and llama.cpp apply them.

    repetition (HF / llama.cpp rule): every token in the prompt or generated so far has a positive
    logit divided by it and a negative one multiplied (over the whole context, no window).
    frequency and presence (OpenAI): logit -= count * frequency + (count > 0) * presence, counted
    over generated tokens only.  Repetition first, on the raw logits; then the other two.
    """

    def __init__(self, prompt: Sequence[int], frequency: float = 0.0, presence: float = 0.0, repetition: float = 1.0):
        self.frequency, self.presence, self.repetition = frequency, presence, repetition
        self.prompt_ids = np.unique(np.asarray(prompt, dtype=np.int64))  # (P,) distinct prompt tokens
        self.in_prompt = set(self.prompt_ids.tolist())
        self.counts: Counter[int] = Counter()  # generated token -> times pushed
        self.stack: list[int] = []

    def shape(self, row: np.ndarray) -> np.ndarray:
        out = row.astype(np.float32, copy=True)
        gen = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
        if self.repetition != 1.0:  # each seen token once: the prompt's, then generated ones it lacks
            fresh = [t for t in self.counts if t not in self.in_prompt]
            ids = np.concatenate([self.prompt_ids, np.asarray(fresh, dtype=np.int64)])
            z = out[ids]
            out[ids] = np.where(z > 0, z / self.repetition, z * self.repetition)
        if len(gen) and (self.frequency or self.presence):
            n = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
            out[gen] -= n * self.frequency + self.presence
        return out

    def push(self, token: int) -> None:
        self.stack.append(token)
        self.counts[token] += 1

    def pop(self, n: int) -> None:
        if n > len(self.stack):
            raise ValueError(f"pop({n}) with only {len(self.stack)} tokens pushed")
        for _ in range(n):
            t = self.stack.pop()
            self.counts[t] -= 1
            if not self.counts[t]:
                del self.counts[t]


class LogitBias:
    """OpenAI's logit_bias: a fixed number added to given tokens' logits at every position."""

    def __init__(self, bias: Sequence[tuple[int, float]]):
        self.ids = np.asarray([t for t, _ in bias], dtype=np.int64)
        self.bias = np.asarray([b for _, b in bias], dtype=np.float32)

    def shape(self, row: np.ndarray) -> np.ndarray:
        out = row.astype(np.float32, copy=True)
        np.add.at(out, self.ids, self.bias)  # add.at: an id given twice counts twice
        return out

    def push(self, token: int) -> None:
        pass  # no state

    def pop(self, n: int) -> None:
        pass


def for_sampling(params, prompt: Sequence[int]) -> LogitsShaper:
    """The shaper of a request's SamplingParams (memspec.request): its penalties, then its
    logit_bias; IDENTITY when it sets none."""
    penalties = (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
                 or params.repetition_penalty != 1.0)
    return compose(
        Penalties(prompt, params.frequency_penalty, params.presence_penalty, params.repetition_penalty)
        if penalties else IDENTITY,
        LogitBias(params.logit_bias) if params.logit_bias else IDENTITY,
    )
