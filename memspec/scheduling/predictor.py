"""The predictor: expected tokens per second of each draft (and of target-only) for what comes next.

Speed factors into two parts that behave very differently:

    tok/s(d) = MAL(d) / (step_s(d) + per_draft_token_s(d) * drafted_per_step(d))   (one token a step or more)

* MAL (tokens committed per verification step) and drafted_per_step depend on
  the text only: greedy verification is deterministic, so they are exact labels
  with no timing noise, and they carry over to other hardware.  They are
  learnt from prompt and context features by gradient-boosted trees, one
  ensemble per (draft, quantity).
* The per-step costs are two numbers per draft, fitted robustly on the timed
  profiling steps (a line through seconds/step against drafted/step).  On a
  new device only these need measuring again.  The profile's steps draft one
  token or more, so the line holds from one draft token a step on; below it
  (a draft that the cost controller has mostly stopped) a step is priced
  between target-only's step (nothing drafted) and the line at one token
  (`Predictor.step_seconds`), not on the line extrapolated to zero, which
  lies below target-only's step (SmolLM2's draft-code: 0.76 of it) and so
  priced a draft that drafts nothing as faster than no draft.

Regressing tok/s directly would put the timing noise of every profiled
segment into the labels and tie the model to the profiling machine.

The fitted trees are saved as JSON (feature, threshold, children and value of
every node) and evaluated here with NumPy alone, all ensembles at once, in
float32 comparisons exactly as scikit-learn does, so a loaded predictor gives
the numbers of the scikit-learn model it was exported from.  scikit-learn is
needed only to train (`memspec train-predictor`, memspec.training.predictor_fit),
on the traces `memspec profile` records (memspec.training.profile).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memspec.errors import ModelFormatError
from memspec.request import NO_DRAFT
from memspec.scheduling.features import (CONTEXT_FEATURES, OVERLAP_FEATURES, PROMPT_FEATURES, UNKNOWN, GenerationContext,
                              context_features, overlap_features, prompt_features, prompt_ngrams)

FORMAT = "memspec-predictor"
VERSION = 1
NONE = NO_DRAFT  # the target-only policy, as the predictor scores it
SELF_FEATURES = ("self_acc",)  # the scored draft's own recent acceptance (UNKNOWN when it has not run)
FEATURES = (*PROMPT_FEATURES, *CONTEXT_FEATURES, *OVERLAP_FEATURES, *SELF_FEATURES)
QUANTITIES = ("mal", "drafted")  # per draft: tokens committed per step, draft tokens proposed per step
from memspec.models.store import SHIPPED_MODELS  # noqa: E402
DEFAULT_PATH = SHIPPED_MODELS / "predictor.json"


@dataclass
class Forest:
    """E tree ensembles of K trees each, packed into (E, K, M) node arrays (M = nodes of the largest tree).

    Leaves point to themselves with an infinite threshold, so walking `depth`
    levels from the root ends on every tree's leaf whatever its own depth.
    """

    feature: np.ndarray  # (E, K, M) int64 feature each node splits on (0 at leaves)
    threshold: np.ndarray  # (E, K, M) float64 go left when x <= threshold (+inf at leaves)
    left: np.ndarray  # (E, K, M) int64 left child (itself at leaves)
    right: np.ndarray  # (E, K, M) int64 right child (itself at leaves)
    value: np.ndarray  # (E, K, M) float64 leaf value times the ensemble's learning rate
    init: np.ndarray  # (E,) float64 the ensemble's constant start (the training mean)
    depth: int  # levels to walk

    def __post_init__(self):
        E, K, M = self.value.shape
        base = (np.arange(E * K) * M)[:, None]  # flat id of each tree's root
        self._root = base[:, 0]
        self._feature = self.feature.reshape(-1)
        self._threshold = self.threshold.reshape(-1)
        # children as flat ids, [left, right] side by side: child[2 * node + went_right]
        self._child = np.stack([self.left.reshape(E * K, M) + base, self.right.reshape(E * K, M) + base],
                               axis=-1).reshape(-1)
        self._value = self.value.reshape(-1)

    def predict(self, X: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """(n, R, F) inputs, (E,) which input row each ensemble reads -> (n, E) predictions."""
        E, K, _ = self.value.shape
        n, R, F = X.shape
        # scikit-learn compares the float32 input with the float64 threshold; so do we
        Xf = np.asarray(X, dtype=np.float32).reshape(-1)
        T = E * K
        col = np.repeat(np.asarray(rows) * F, K)  # (T,) where each tree's input row starts in a sample
        if n == 1:
            node, off = self._root, col
        else:
            node = np.tile(self._root, n)
            off = (np.arange(n) * (R * F)).repeat(T) + np.tile(col, n)
        for _ in range(self.depth):  # 1-D takes: the cheapest gather NumPy has
            x = Xf.take(self._feature.take(node) + off)
            node = self._child.take(2 * node + (x > self._threshold.take(node)))
        leaf = self._value[node].reshape(n, E, K)
        # summed tree by tree from the start value, in scikit-learn's order (bit-identical results)
        terms = np.empty((n, E, K + 1))
        terms[..., 0] = self.init
        terms[..., 1:] = leaf
        return np.cumsum(terms, axis=2)[..., -1]

    @classmethod
    def from_json(cls, ensembles: list[dict], n_features: int) -> "Forest":
        trees = [(e, t) for e in ensembles for t in e["trees"]]
        K = max(len(e["trees"]) for e in ensembles)
        M = max(len(t["feature"]) for _, t in trees)
        E = len(ensembles)
        feature = np.zeros((E, K, M), dtype=np.int64)
        threshold = np.full((E, K, M), np.inf)
        left = np.broadcast_to(np.arange(M), (E, K, M)).copy()
        right = left.copy()
        value = np.zeros((E, K, M))
        depth = 0
        for i, ens in enumerate(ensembles):
            lr = float(ens["learning_rate"])
            for k, t in enumerate(ens["trees"]):
                f, th = np.asarray(t["feature"], np.int64), np.asarray(t["threshold"], np.float64)
                lc, rc, v = (np.asarray(t[key], np.int64 if key != "value" else np.float64)
                             for key in ("left", "right", "value"))
                m = len(f)
                if not (len(th) == len(lc) == len(rc) == len(v) == m) or m == 0:
                    raise ValueError(f"tree {k} of ensemble {i} has arrays of different lengths")
                leaf = lc < 0
                if (f[~leaf] < 0).any() or (f[~leaf] >= n_features).any():
                    raise ValueError(f"tree {k} of ensemble {i} splits on a feature outside 0..{n_features - 1}")
                if ((lc[~leaf] <= np.arange(m)[~leaf]) | (lc[~leaf] >= m) | (rc[~leaf] <= np.arange(m)[~leaf])
                        | (rc[~leaf] >= m)).any():
                    raise ValueError(f"tree {k} of ensemble {i} has a child index out of order or range")
                feature[i, k, :m] = np.where(leaf, 0, f)
                threshold[i, k, :m] = np.where(leaf, np.inf, th)
                left[i, k, :m] = np.where(leaf, np.arange(m), lc)
                right[i, k, :m] = np.where(leaf, np.arange(m), rc)
                value[i, k, :m] = lr * v
                depth = max(depth, _depth(lc, rc))
        init = np.asarray([float(e["init"]) for e in ensembles])
        return cls(feature, threshold, left, right, value, init, depth)


def _depth(left: np.ndarray, right: np.ndarray) -> int:
    """Levels below the root of one tree (children come after their parent)."""
    d = np.zeros(len(left), dtype=np.int64)
    for i in range(len(left)):
        if left[i] >= 0:
            d[left[i]] = d[right[i]] = d[i] + 1
    return int(d.max())


class Predictor:
    """Scores each draft (and "none") by expected tokens per second for what comes next."""

    def __init__(self, drafts: tuple[str, ...], costs: dict[str, dict], ensembles: dict[str, dict],
                 info: dict | None = None, default: str | None = None, margin: float = 0.0):
        modeled = [d for d in drafts if d != NONE]
        missing = [f"{d}.{q}" for d in modeled for q in QUANTITIES if q not in ensembles.get(d, {})]
        if missing or NONE not in costs or any(d not in costs for d in modeled):
            raise ModelFormatError(f"predictor: incomplete model (missing ensembles {missing or 'none'}; "
                                   f"costs for {sorted(costs)}, drafts {list(drafts)})")
        self.drafts = tuple(drafts)  # the policies it scores: draft names and "none"
        self.costs = costs  # draft -> {"step_s", "per_draft_token_s"}
        self.ensembles = ensembles  # draft -> quantity -> ensemble JSON
        self.info = dict(info or {})  # how it was trained (traces, held-out scores)
        # The prior: the policy that was fastest over all training requests, and how much faster
        # (as a fraction) another must be predicted to be chosen over it.  The trees learn from
        # few prompts; a margin, chosen by held-out regret, keeps their noise from costing speed.
        if default is not None and default not in drafts:
            raise ModelFormatError(f"predictor: default {default!r} is not one of its drafts {list(drafts)}")
        if not (math.isfinite(margin) and margin >= 0):
            raise ModelFormatError(f"predictor: margin must be a finite number >= 0, got {margin!r}")
        self.default, self.margin = default, float(margin)
        self._modeled = modeled
        order = [(d, q) for d in modeled for q in QUANTITIES]
        self._forest = Forest.from_json([ensembles[d][q] for d, q in order], len(FEATURES))
        self._rows = np.asarray([modeled.index(d) for d, _ in order], dtype=np.int64)
        self._step_s = np.asarray([costs[d]["step_s"] for d in modeled])
        self._token_s = np.asarray([costs[d]["per_draft_token_s"] for d in modeled])
        self._columns = np.asarray([0 if d == NONE else 1 + modeled.index(d) for d in self.drafts])
        self._prompts: OrderedDict[str, tuple[np.ndarray, frozenset]] = OrderedDict()  # prompt -> features, ngrams

    def prior(self) -> dict[str, float]:
        """Each draft's worth before a prompt is seen, in tok/s over target-only (train-predictor's
        `prior_values`, kept in its info); {} for a predictor fitted before it recorded one."""
        raw = self.info.get("prior")
        if not isinstance(raw, dict):
            return {}
        out = {}
        for d, v in raw.items():
            try:
                v = float(v)
            except (TypeError, ValueError):
                continue
            if d in self._modeled and math.isfinite(v) and v > 0:
                out[d] = v
        return out

    # -- persistence -----------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "features": list(FEATURES), "quantities": list(QUANTITIES),
                "drafts": list(self.drafts), "costs": self.costs, "default": self.default, "margin": self.margin,
                "ensembles": self.ensembles, "info": self.info}

    def save(self, path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")
        tmp.replace(path)

    @classmethod
    def from_json(cls, data, where: str = "predictor") -> "Predictor":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ModelFormatError(f"{where}: not a memspec predictor (format {_get(data, 'format')!r}, "
                                   f"expected {FORMAT!r})")
        if data.get("version") != VERSION:
            raise ModelFormatError(f"{where}: predictor version {data.get('version')!r} is not supported "
                                   f"(this memspec reads version {VERSION}); retrain with `memspec train-predictor`")
        if data.get("features") != list(FEATURES) or data.get("quantities") != list(QUANTITIES):
            raise ModelFormatError(f"{where}: trained on a different feature set ({len(data.get('features') or [])} "
                                   f"features, this memspec computes {len(FEATURES)}); retrain with "
                                   f"`memspec train-predictor`")
        try:
            costs = {d: {"step_s": float(c["step_s"]), "per_draft_token_s": float(c["per_draft_token_s"])}
                     for d, c in data["costs"].items()}
            if any(not math.isfinite(v) or v < 0 for c in costs.values() for v in c.values()) or \
                    any(c["step_s"] <= 0 for c in costs.values()):
                raise ValueError("costs must be finite, step costs positive")
            return cls(tuple(data["drafts"]), costs, data["ensembles"], data.get("info"), data.get("default"),
                       float(data.get("margin") or 0.0))
        except ModelFormatError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ModelFormatError(f"{where}: malformed predictor: {type(exc).__name__}: {exc}") from None

    @classmethod
    def load(cls, path=DEFAULT_PATH) -> "Predictor":
        """Read a predictor saved by `save` (JSON only)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ModelFormatError(f"cannot read predictor {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"predictor {path} is not JSON: {exc.msg} at line {exc.lineno}") from None
        return cls.from_json(data, str(path))

    # -- prediction --------------------------------------------------------------------------
    def _prompt(self, text: str) -> tuple[np.ndarray, frozenset]:
        hit = self._prompts.get(text)
        if hit is None:
            hit = self._prompts[text] = (prompt_features(text), prompt_ngrams(text))
            if len(self._prompts) > 256:
                self._prompts.popitem(last=False)
        return hit

    def inputs(self, prompt_text: str, ctx: GenerationContext | None = None) -> np.ndarray:
        """(R, F) feature rows, one per modelled draft (they differ in self_acc only)."""
        return feature_rows(*self._prompt(prompt_text), ctx, self._modeled)

    def quantities(self, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(n, R, F) inputs -> (n, R) MAL and (n, R) drafted per step, clipped to what is possible."""
        raw = self._forest.predict(X, self._rows).reshape(X.shape[0], len(self._modeled), len(QUANTITIES))
        drafted = np.maximum(raw[..., 1], 0.0)
        mal = np.clip(raw[..., 0], 1.0, drafted + 1.0)
        return mal, drafted

    def step_seconds(self, drafted: np.ndarray, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Seconds of a step of the modelled drafts `rows` (all: their order in self.drafts less "none")
        at `drafted` draft tokens a step (broadcast against them): the fitted line from one token a
        step on; below one, between target-only's step (0 tokens: the draft sat the step out) and
        the line at one token, as a mean over steps that drafted a token or none at all is."""
        step_s, token_s = self._step_s[rows], self._token_s[rows]
        drafted = np.asarray(drafted, dtype=np.float64)
        idle = self.costs[NONE]["step_s"]
        one = step_s + token_s  # a step that drafted one token
        return np.where(drafted >= 1.0, step_s + token_s * drafted, idle + (one - idle) * np.clip(drafted, 0.0, 1.0))

    def tok_per_s(self, X: np.ndarray) -> np.ndarray:
        """(n, R, F) inputs -> (n, R + 1) expected tok/s, columns in self.drafts order."""
        mal, drafted = self.quantities(X)
        tps = mal / self.step_seconds(drafted)
        none = np.full((X.shape[0], 1), 1.0 / self.costs[NONE]["step_s"])
        out = np.concatenate([none, tps], axis=1)[:, self._columns]
        if self.default is not None and self.margin:
            out = out / np.where(np.asarray(self.drafts) == self.default, 1.0, 1.0 + self.margin)
        return out

    def rate(self, draft: str, mal: float, drafted: float) -> float:
        """The tok/s a modelled draft gives at `mal` tokens and `drafted` draft tokens a step, priced
        as predict() prices its own (the fitted step costs, the margin): a request's measured
        quantities weighed against the others' predicted ones, whatever the machine's pace now."""
        i = self._modeled.index(draft)
        tps = mal / float(self.step_seconds(drafted, i))
        return tps / (1.0 if draft == self.default or not self.margin else 1.0 + self.margin)

    def predict(self, prompt_text: str, ctx: GenerationContext | None = None) -> dict[str, float]:
        """Expected tokens per second of each draft (and "none") for what comes next."""
        tps = self.tok_per_s(self.inputs(prompt_text, ctx)[None])[0]
        return dict(zip(self.drafts, tps.tolist()))

    def best(self, prompt_text: str, ctx: GenerationContext | None = None,
             allowed: set[str] | None = None) -> str:
        """The policy with the highest expected tok/s (among `allowed`, when given)."""
        scores = self.predict(prompt_text, ctx)
        return max((d for d in scores if allowed is None or d in allowed), key=scores.__getitem__, default=NONE)


def feature_rows(pf: np.ndarray, grams: frozenset, ctx: GenerationContext | None, drafts) -> np.ndarray:
    """(len(drafts), len(FEATURES)) inputs: prompt, context and overlap features, then each draft's own acceptance."""
    row = np.concatenate([pf, context_features(ctx), overlap_features(grams, ctx), [UNKNOWN]])
    X = np.repeat(row[None, :], len(drafts), axis=0)
    if ctx is not None:
        X[:, -1] = [ctx.recent_acceptance.get(d, UNKNOWN) for d in drafts]
    return np.nan_to_num(X, nan=UNKNOWN)


def _get(data, key):
    return data.get(key) if isinstance(data, dict) else type(data).__name__
