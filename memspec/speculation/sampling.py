"""Pure NumPy sampling maths.  No ONNX Runtime here; the randomness is passed in.

Two kinds of randomness draw a sampled token (`draw`):

- a np.random.Generator: the standard scheme.  One stream per request, a draw from p with one
  uniform; speculative verification then uses the speculative-sampling rule (verify_sampled).
  How many numbers a step consumes depends on what was drafted, so the answer for a seed depends
  on the draft.
- a Coupled: position-keyed Gumbel noise (Daliri, Musco and Suresh 2024, "Coupling without
  communication and drafter-invariant speculative decoding").  The token at answer position i is
  argmax_j (log p_j + G(seed, i, j)): a draw from p (the Gumbel-max trick) whose noise depends on
  the seed, the position and the token id only.  A draft proposes the argmax of its own row plus
  the same noise, and verification is the greedy rule on the target's perturbed rows
  (verify_coupled), so the answer for a seed is the target-only answer, whatever the draft.
"""

from __future__ import annotations

import math
from typing import Union

import numpy as np


def greedy(logits: np.ndarray) -> int:
    """Index of the largest logit of a (V,) row."""
    return int(np.argmax(logits))


def log_probs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` under a (V,) row of raw logits (log-softmax, float64),
    and the k most likely tokens with theirs, most likely first (of equal ones, the lower id:
    kth_largest's candidates, not a partition of the whole row)."""
    z = logits.astype(np.float64)
    lse = z.max() + np.log(np.exp(z - z.max()).sum())
    top = np.flatnonzero(z >= kth_largest(z, k)) if 0 < k < z.shape[-1] else np.arange(z.shape[-1] if k else 0)
    top = top[np.argsort(-z[top], kind="stable")][:k]
    return float(z[token] - lse), [(int(i), float(z[i] - lse)) for i in top]


def probabilities(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> np.ndarray:
    """The (V,) float64 distribution that sampling draws from.

    temperature > 0 scales the logits; top_k > 0 keeps the k most likely tokens;
    top_p < 1 keeps the smallest set whose mass reaches top_p; min_p > 0 then keeps
    the tokens at least min_p times as likely as the most likely one (llama.cpp's
    order: top_k, top_p, min_p; all after temperature here).  Filtered tokens get
    probability 0 and the rest are renormalised.

    In place where it can be, the same operations on the same float64 values as ever: five fresh
    arrays a row (0.6-1.2 MB each, a page fault every 4 KB) made this 2.5 ms over the 1.5B's
    151,936 logits on a Zen 4, a tenth of a target step for every token drawn and every row a
    sampled request verifies; now 0.3 ms.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    p = np.array(logits, dtype=np.float64)
    p /= temperature
    if 0 < top_k < p.shape[-1]:
        p[p < kth_largest(p, top_k)] = -np.inf
    p -= p.max()
    np.exp(p, out=p)
    p /= p.sum()
    if top_p < 1.0:
        keep = nucleus(p, top_p)
        kept = np.zeros_like(p)
        kept[keep] = p[keep]
        p = kept
        p /= p.sum()
    if min_p > 0.0:  # a ratio to the top: the same before or after top_p's renormalisation
        p[p < min_p * p.max()] = 0.0
        p /= p.sum()
    return p


NUCLEUS_STEPS = (2.0 ** -8, 2.0 ** -24)  # nucleus(): the tokens within these ratios of the top are sorted first
KTH_BANDS = (8.0, 16.0, 32.0, 64.0)  # kth_largest(): the values within this much of the top are partitioned first


def kth_largest(z: np.ndarray, k: int) -> float:
    """The k-th largest value of a (V,) row, ties counted (np.partition(z, -k)[-k], exactly).

    Partitioning all of the 1.5B's 151,936 logits took 3 ms a row on a Zen 4, for every token drawn
    with top_k and every row a top_k request verifies.  The values within 8 (then 16, 32, 64) of the
    largest are partitioned alone once there are k of them: the k-th largest is then among them, and
    so is every value above it, so it is theirs; where even the widest band holds fewer, all of them.
    A band of logits 8 wide is odds of e^-8 to the top: a few hundred tokens of a real row."""
    top = z.max()
    for band in KTH_BANDS:
        cand = z[z >= top - band]
        if cand.size >= k:
            return float(np.partition(cand, -k)[-k])
    return float(np.partition(z, -k)[-k])


def nucleus(p: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most likely tokens whose mass reaches top_p (the one that crosses it
    included), most likely first, ties in index order: the prefix of p's stable descending sort.

    Sorting all of p for it took 20 ms a row over the 1.5B's 151,936 tokens on a Zen 4, a whole
    target step for every token drawn (and for every row of a verification pass).  A nucleus holds
    few tokens: the ones at least 2^-8 as likely as the top are sorted alone, and their running sum
    is the full sort's first entries (every token outside is less likely than each of them), the
    same values added in the same order, so the cut is the same; where they hold less than top_p,
    those at least 2^-24 as likely, then all."""
    top = p.max()
    for scale in NUCLEUS_STEPS:
        cand = np.flatnonzero(p >= top * scale)  # every token this likely, in index order: sorted first
        order = cand[np.argsort(-p[cand], kind="stable")]
        cut = int(np.searchsorted(np.cumsum(p[order]), top_p, side="left"))  # where the running mass reaches top_p
        if cut < len(order):
            return order[: cut + 1]  # every token whose preceding mass is below top_p (the first always stays)
    order = np.argsort(-p, kind="stable")  # the nucleus reaches further down (or the sum falls short of top_p)
    return order[: int(np.searchsorted(np.cumsum(p[order]), top_p, side="left")) + 1]


def pick(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: "Randomness",
         min_p: float = 0.0, at: int = 0) -> int:
    """The next token from a (V,) row: argmax when temperature is 0, else a draw from the filtered
    distribution (draw(): `at` is the context length before it, for coupled noise)."""
    if temperature == 0.0:
        return greedy(logits)
    return draw(probabilities(logits, temperature, top_k, top_p, min_p), rng, at)


def greedy_summary(logits: np.ndarray) -> tuple[int, float, float]:
    """A greedy draft's view of one (V,) row of logits: its argmax, the softmax's largest probability
    and the softmax's entropy (nats), in float32 and one exponential per logit.

    What a greedy draft needs of its distribution (the token, and the confidence that stops it or
    trims its proposal: memspec.speculation.drafts, .confidence), without the float64 distribution
    a sampled token is drawn from: probabilities() and an entropy over it took 0.3-0.6 ms over the
    0.5B sibling's 32,768 logits on a Zen 4 (this: 0.03 ms), as much as a small draft's forward.
    H = log S - sum(e z) / S with z = x - max x, e = exp z and S = sum e; a logit of -inf counts
    as exp(-1e30) = 0 (it adds nothing either way).
    """
    x = np.asarray(logits, dtype=np.float32)
    i = int(x.argmax())
    z = np.maximum(x - x[i], np.float32(-1e30))
    e = np.exp(z)
    total = float(e.sum(dtype=np.float64))
    return i, 1.0 / total, max(math.log(total) - float(np.dot(e, z)) / total, 0.0)


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from the (V,) distribution p (inverse CDF, one uniform)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.shape[-1] - 1))


# -- coupled sampling: Gumbel-max with noise keyed by (seed, position, token) --------------
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_TOKEN_STRIDE = np.uint64(0xD1B54A32D192ED03)  # an odd multiplier: token ids spread over 64 bits
# G = -log(-log u) with u in [2^-54, 1 - 2^-54] (gumbel()) lies in [-3.63, 37.43]: a token whose
# log-probability is more than their difference below the top one's never wins, whatever its noise
GUMBEL_SPAN = 41.1


def _mix64(x: int) -> int:
    """splitmix64's finaliser on one Python int (mod 2^64)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping products), in place."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def noise_key(seed: int, position: int) -> int:
    """The 64-bit key of answer position `position` under `seed` (two rounds of splitmix64: nearby
    seeds and positions give unrelated keys)."""
    if not 0 <= seed <= _M64 or position < 0:
        raise ValueError(f"noise_key: seed {seed} must be in 0..2^64-1 and position {position} >= 0")
    return _mix64((_mix64((seed + _GOLDEN) & _M64) + (position + 1) * _GOLDEN) & _M64)


def exponentials(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """(n,) float64 standard exponential noise E = -log U of token ids `ids` (n,) at answer
    `position` under `seed`: each value a function of (seed, position, id) alone (a counter-based
    hash, no stream), so any subset of a row can be computed by itself and every caller sees the
    same numbers.  U = (the hash's top 53 bits + 1/2) / 2^53, in (0, 1), never 0 or 1."""
    x = np.asarray(ids, dtype=np.uint64) * _TOKEN_STRIDE
    x += np.uint64(noise_key(seed, position))
    x = _mix64_array(x)
    x >>= np.uint64(11)
    u = x.astype(np.float64)
    u += 0.5
    u *= 2.0 ** -53
    np.log(u, out=u)
    u *= -1.0
    return u


def gumbel(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """(n,) float64 standard Gumbel noise G = -log E of token ids `ids` at answer `position` under
    `seed` (exponentials())."""
    return -np.log(exponentials(seed, position, ids))


def gumbel_argmax(p: np.ndarray, seed: int, position: int, ids: np.ndarray | None = None) -> int:
    """The index j of a (V,) distribution p maximising log p_j + G(seed, position, ids[j]): a draw
    from p (Gumbel-max), repeatable from (seed, position).  ids: (V,) the token id of each entry for
    the noise (a draft's row in its own vocabulary: its target ids); None: the entry's own index.
    Computed as the argmax of p_j / E_j (the same: log p - log E), one logarithm a token; only the
    entries within GUMBEL_SPAN of the top log-probability can win, so only theirs are computed."""
    cand = np.flatnonzero(p >= p.max() * math.exp(-GUMBEL_SPAN))
    e = exponentials(seed, position, cand if ids is None else np.asarray(ids)[cand])
    return int(cand[np.argmax(p[cand] / e)])


class Coupled:
    """One request's coupled randomness (module docstring): its seed, and `origin`, the context
    length at which its answer starts (the prompt's), so that `position(at)` is the answer position
    of the token drawn after `at` tokens of context."""

    def __init__(self, seed: int, origin: int):
        if not 0 <= seed <= _M64:
            raise ValueError(f"seed {seed} is out of range; allowed 0..2^64-1")
        self.seed, self.origin = seed, origin

    def position(self, at: int) -> int:
        if at < self.origin:
            raise ValueError(f"a token drawn after {at} tokens of context comes before the answer, "
                             f"which starts after {self.origin}")
        return at - self.origin

    def argmax(self, p: np.ndarray, at: int, ids: np.ndarray | None = None) -> int:
        return gumbel_argmax(p, self.seed, self.position(at), ids)


Randomness = Union[np.random.Generator, Coupled]


def coupled(rng) -> bool:
    """Whether `rng` is position-keyed noise (else a stream, or None where nothing is sampled)."""
    return isinstance(rng, Coupled)


def draw(p: np.ndarray, rng: Randomness, at: int, ids: np.ndarray | None = None) -> int:
    """One sampled index of the (V,) distribution p: the token after `at` tokens of context.
    Coupled: the Gumbel argmax at that position (ids: the noise's token id of each entry); a stream:
    one draw from it (at and ids unused)."""
    if isinstance(rng, Coupled):
        return rng.argmax(p, at, ids)
    return sample(p, rng)


# -- speculative verification ------------------------------------------------------
# p: (k+1, V) target distributions at each draft position (the last row is for
#    the bonus token), or a TargetRows that builds each on first use; q: the draft
#    distributions the draft tokens were drawn from (DraftRows); draft: (k,) token
#    ids.  All in the target's vocabulary.


class DraftRows:
    """q, the distributions a draft drew its k tokens from, as the draft has them: row i is probs[i]
    on the target ids `ids` and 0 on every other id.  ids: (n,), one list for every row (a model
    draft's vocabulary, 16,384-32,768 ids where the Qwen targets have 151,936), or (k, n), one a row
    (a deterministic proposal: n = 1, one-hot).  Nothing of the size of the target's vocabulary is
    built a drafted token, and the residual of a rejection touches the row's ids only."""

    def __init__(self, probs: np.ndarray, ids: np.ndarray):
        probs, ids = np.asarray(probs, dtype=np.float64), np.asarray(ids, dtype=np.int64)
        if probs.ndim != 2 or ids.shape not in ((probs.shape[1],), probs.shape):
            raise ValueError(f"DraftRows: probs {probs.shape} and ids {ids.shape} do not line up")
        self.probs, self.ids = probs, ids

    @classmethod
    def one_hot(cls, tokens) -> "DraftRows":
        """Tokens proposed without a distribution: q is 1 on each."""
        return cls(np.ones((len(tokens), 1)), np.asarray(tokens, dtype=np.int64).reshape(-1, 1))

    def __len__(self) -> int:
        return len(self.probs)

    def prefix(self, m: int) -> "DraftRows":
        return DraftRows(self.probs[:m], self.ids if self.ids.ndim == 1 else self.ids[:m])

    def row_ids(self, i: int) -> np.ndarray:
        return self.ids if self.ids.ndim == 1 else self.ids[i]

    def at(self, i: int, token: int) -> float:
        """q_i(token)."""
        hit = np.flatnonzero(self.row_ids(i) == token)
        return float(self.probs[i, hit[0]]) if len(hit) else 0.0

    def residual(self, i: int, p: np.ndarray) -> np.ndarray:
        """max(p - q_i, 0), not normalised, as a new (V,) row."""
        ids, r = self.row_ids(i), p.copy()
        r[ids] = np.maximum(p[ids] - self.probs[i], 0.0)
        return r

    def dense(self, vocab: int) -> np.ndarray:
        """The rows over the whole vocabulary, (k, vocab)."""
        q = np.zeros((len(self), vocab))
        for i in range(len(self)):
            q[i, self.row_ids(i)] = self.probs[i]
        return q


class TargetRows:
    """The target's sampling distributions over a verified pass's rows, each built when first read:
    verification stops at the first rejection, so the rows after it (most of them where the draft
    is often wrong) never pay for their softmax and filters over the whole vocabulary."""

    def __init__(self, logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0):
        self.logits = logits  # (n, V) raw rows
        self.args = (temperature, top_k, top_p, min_p)
        self.built: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> np.ndarray:
        row = self.built.get(i)
        if row is None:
            row = self.built[i] = probabilities(self.logits[i], *self.args)
        return row


def verify_greedy(target_argmax: np.ndarray, draft: np.ndarray) -> tuple[int, int]:
    """Accept draft tokens while they equal the target's argmax.

    target_argmax: (k+1,) argmax of the target at each draft position.
    Returns (n_accepted, next_token): the recovered token after a rejection,
    or the bonus token when every draft token was accepted.
    """
    k = len(draft)
    mismatch = np.nonzero(target_argmax[:k] != draft)[0]
    n = int(mismatch[0]) if len(mismatch) else k
    return n, int(target_argmax[n])


def verify_sampled(p, q: DraftRows, draft: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """The speculative-sampling rule; the committed tokens are distributed exactly as p.

    Draft token i is accepted with probability min(1, p_i(x) / q_i(x)) (q >= p:
    accept with probability p/q; q < p: always accept).  At the first rejection
    the token is resampled from the residual max(p_i - q_i, 0), normalised.
    If all k are accepted a bonus token is drawn from p_k.
    """
    k = len(draft)
    for i in range(k):
        token, accepted = speculative_draw(p[i], q, i, int(draft[i]), rng)
        if not accepted:
            return i, token
    return k, sample(p[k], rng)


def verify_coupled(p, draft: np.ndarray, noise: Coupled, at: int) -> tuple[int, int]:
    """The greedy rule on perturbed rows: draft token i is accepted while it is the Gumbel argmax
    of the target's row i (p[i], the token after at + i tokens of context), which is the token the
    target alone would sample there; the first that is not is replaced by it (the recovered token),
    and after k accepted the bonus token is row k's.  p: (k+1, V) rows or a TargetRows (the rows
    after the first rejection are never built).  The committed tokens are the target-only answer's."""
    for i in range(len(draft) + 1):
        token = noise.argmax(p[i], at + i)
        if i == len(draft) or token != int(draft[i]):
            return i, token
    raise AssertionError("unreachable")


def speculative_draw(p: np.ndarray, q: DraftRows, i: int, token: int, rng: np.random.Generator) -> tuple[int, bool]:
    """One position of the rule: the draft's `token` (drawn from q's row i) with probability
    min(1, p(token) / q_i(token)), else a draw from the residual max(p - q_i, 0), normalised; the
    token committed there and whether it was the draft's (verify_sampled; a token tree's walk)."""
    if rng.random() * q.at(i, token) < p[token]:  # u < p/q without dividing by zero
        return token, True
    residual = q.residual(i, p)
    total = residual.sum()
    # residual mass is 0 only when p == q, where a rejection cannot happen
    return sample(residual / total if total > 0 else p, rng), False
