"""Token trees: a draft's alternatives verified beside its chain, in the same target pass.

A chain step feeds [last, d1 .. dk]; where the target rejects d_i it already gives its own token
there (the recovered token), so an alternative to d_i wins a token only through the row after it:
when d_i was wrong and the alternative was the target's token, the alternative's own row gives the
next token (and a branch of several tokens under it, each further one it accepts).  The tree:

    node 0        last                        (the root: the last committed token)
    nodes 1..k    d1 .. dk                    (the main chain: node i at depth i)
    then          each branch (at, tokens)    (tokens[0] replaces d_{at+1}: its parent is node `at`)

A target that takes trees (`target.trees`: the native engine) verifies it in one pass in which
each node's row is that of its chain fed alone, so the answer is the target's own
(forward_tree); then the cache keeps the committed path (keep_path).

Which branches go in (Planner.choose) is the cost model's: a branch at position `at` of rank r
(the draft's r-th alternative there) and length L wins alpha^at (1 - alpha) beta_r E(alpha, L - 1)
tokens (reach the position, d_{at+1} rejected, the alternative right, then its rows), for the
rows it adds to the pass at the measured cost curve; it goes in only where that beats the step's
tokens per unit of cost without it.  beta_r, how often a draft's r-th alternative holds the
target's token where its first choice did not, is measured on every step, chain or tree, per
draft (Planner.observe).

Verification walks the tree.  Greedy: follow the target's argmax while a child holds it.
Sampling keeps the target's distribution exactly: on the main chain the speculative-sampling rule
(accept d_i with probability min(1, p/q), else draw from the residual max(p - q, 0)), and where
the token drawn is a branch's first token, go down the branch; below that, draw from the node's
p and go on while a child holds the token drawn.  Every committed token is thus a draw from the
target's distribution after the tokens before it (on the chain by the rule's proof, elsewhere
directly); the tree only decides whether the pass already holds the row for the next draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memspec.request import SamplingParams
from memspec.runtime.kvcache import KVCache
from memspec.speculation import sampling
from memspec.speculation.drafts import Proposal

ALT_RANKS = 2  # alternatives a draft offers per position (its 2nd and 3rd choices)


@dataclass(frozen=True)
class Branch:
    at: int  # its first token replaces the chain's token `at` (0-based): its parent is node `at`
    tokens: tuple[int, ...]  # (L,) the branch, first token first
    rank: int  # which of the draft's alternatives at `at` it is (0: its 2nd choice)


@dataclass
class Tree:
    tokens: list[int]  # (n,) node tokens, node 0 the root
    parents: list[int]  # (n,) each node's parent, -1 for the root
    chain: int  # nodes 1..chain are the main chain

    @classmethod
    def build(cls, last: int, chain: list[int], branches: list[Branch]) -> "Tree":
        tokens, parents = [last, *chain], [-1, *range(len(chain))]
        for b in branches:
            for j, t in enumerate(b.tokens):
                parents.append(b.at if j == 0 else len(tokens) - 1)
                tokens.append(t)
        return cls(tokens, parents, len(chain))

    def children(self, node: int) -> list[int]:
        return [c for c in range(node + 1, len(self.tokens)) if self.parents[c] == node]


@dataclass
class TreeStep:
    """What a tree pass committed."""

    path: list[int]  # nodes kept, root first: the cache's committed path (keep_path)
    committed: list[int]  # the path's tokens past the root, then the next token
    main: int  # main-chain tokens accepted (what a chain pass would have accepted)
    rows: np.ndarray  # (len(committed), V): the rows that predicted each committed token


def walk(tree: Tree, rows: np.ndarray, q: sampling.DraftRows | None, params: SamplingParams,
         rng: sampling.Randomness, at: int = 0) -> tuple[list[int], int, int]:
    """(path, next token, main-chain tokens accepted) for a tree's rows (n, V) (module doc).
    q: the draft distributions of the main chain's tokens (sampling only); at: the context length
    before the root's row's token (coupled noise: a node at depth d draws the token after at + d)."""
    node, path, main = 0, [0], 0
    while True:
        kids = tree.children(node)
        on_chain = node < tree.chain  # node i of the main chain (branch nodes come after it), not its last
        if params.greedy:
            x = int(np.argmax(rows[node]))
        else:
            p = sampling.probabilities(rows[node], params.temperature, params.top_k, params.top_p, params.min_p)
            if sampling.coupled(rng):  # greedy on the perturbed row: the token the target alone draws there
                x = rng.argmax(p, at + len(path) - 1)
            elif on_chain:  # the draft's token stands, or the residual's draw replaces it
                x, _ = sampling.speculative_draw(p, q, node, tree.tokens[node + 1], rng)
            else:
                x = sampling.sample(p, rng)
        child = next((c for c in kids if tree.tokens[c] == x), None)
        if on_chain and child == node + 1:
            main += 1
        if child is None:
            return path, x, main
        node = child
        path.append(node)


def verify(target, cache: KVCache, context: list[int], prop: Proposal, branches: list[Branch],
           params: SamplingParams, rng: sampling.Randomness) -> TreeStep:
    """One tree pass (target.forward_tree) after `context` and its walk; the cache keeps the
    committed path."""
    tree = Tree.build(context[-1], prop.tokens, branches)
    start = cache.length
    rows = target.forward_tree(cache, tree.tokens, tree.parents)  # (n, V)
    path, nxt, main = walk(tree, rows, prop.q, params, rng, len(context))
    cache.keep_path(start, path)
    return TreeStep(path, [*(tree.tokens[i] for i in path[1:]), nxt], main, rows[path])


# -- the shape -------------------------------------------------------------------------
@dataclass
class AltStats:
    """One draft's alternatives: how often the r-th held the target's token where its first choice
    did not (decayed counts, as the cost controller counts acceptance)."""

    PRIOR = (0.3, 1.7)  # pseudo-counts (hits, misses): beta starts at 0.15
    DECAY = 0.95

    hits: list[float] = field(default_factory=lambda: [AltStats.PRIOR[0]] * ALT_RANKS)
    misses: list[float] = field(default_factory=lambda: [AltStats.PRIOR[1]] * ALT_RANKS)

    def beta(self, rank: int) -> float:
        return self.hits[rank] / (self.hits[rank] + self.misses[rank])

    def observe(self, alternatives: list[list[int]], token: int) -> None:
        """At the first rejected position the draft offered `alternatives` (first tokens, best
        first) and the target's token there was `token`."""
        for r in range(min(len(alternatives), ALT_RANKS)):
            hit = alternatives[r] == token
            self.hits[r] = self.DECAY * self.hits[r] + hit
            self.misses[r] = self.DECAY * self.misses[r] + (not hit)


def expected_tokens(alpha: float, gamma: int) -> float:
    """1 + alpha + ... + alpha^gamma (speculative.expected_tokens; here so that this module needs
    nothing of the loop's)."""
    return float(gamma + 1) if alpha >= 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def choose(prop: Proposal, alpha: float, stats: AltStats, verify_cost: list[float], draft_cost: float,
           room: int) -> list[Branch]:
    """The branches worth adding to this proposal's chain (module doc): greedily the one that leaves
    the step the most expected tokens per unit of cost, while that beats the step without it; []
    keeps the chain.
    verify_cost[n]: a pass of n rows relative to one row (up to the rows measured); room: the most
    rows the cache can take."""
    g = len(prop.tokens)
    if g == 0 or not prop.alternatives:
        return []
    limit = min(len(verify_cost) - 1, room)
    gained, cost, rows = expected_tokens(alpha, g), verify_cost[g + 1] + g * draft_cost, g + 1
    candidates = []
    for at, alts in enumerate(prop.alternatives[:g]):
        for rank, alt in enumerate(alts[:ALT_RANKS]):
            alt = tuple(alt[:g - at])  # never deeper than the chain: accepted tokens <= drafted ones
            if alt:
                candidates.append((at, rank, alt))
    chosen: list[Branch] = []
    while candidates:  # each time the branch (and its length) that leaves the step's best rate
        best, best_rate, best_len = None, gained / cost, 0
        for c in candidates:
            at, rank, alt = c
            for length in range(1, min(len(alt), limit - rows) + 1):
                win = alpha ** at * (1.0 - alpha) * stats.beta(rank) * expected_tokens(alpha, length - 1)
                rate = (gained + win) / (cost + verify_cost[rows + length] - verify_cost[rows])
                if rate > best_rate:
                    best, best_rate, best_len = c, rate, length
        if best is None:  # nothing left beats the step as it is
            break
        at, rank, alt = best
        gained += alpha ** at * (1.0 - alpha) * stats.beta(rank) * expected_tokens(alpha, best_len - 1)
        cost += verify_cost[rows + best_len] - verify_cost[rows]
        rows += best_len
        chosen.append(Branch(at, alt[:best_len], rank))
        candidates.remove(best)
    return sorted(chosen, key=lambda b: (b.at, b.rank))


class Planner:
    """One request's trees: per draft, its alternatives' record, and each step's branches."""

    def __init__(self):
        self.stats: dict[str, AltStats] = {}

    def choose(self, name: str, prop: Proposal, alpha: float, verify_cost: list[float], draft_cost: float,
               room: int) -> list[Branch]:
        return choose(prop, alpha, self.stats.setdefault(name, AltStats()), verify_cost, draft_cost, room)

    def observe(self, name: str, prop: Proposal, main: int, token: int) -> None:
        """A step's outcome, chain or tree: `main` of the chain's tokens accepted, then `token` the
        target's at the next position (a branch's first token, or the recovered one)."""
        if main < len(prop.tokens) and main < len(prop.alternatives):
            alts = [a[0] for a in prop.alternatives[main] if a]
            if alts:
                self.stats.setdefault(name, AltStats()).observe(alts, token)
