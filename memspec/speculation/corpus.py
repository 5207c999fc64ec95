"""The suffix draft's shipped corpus, as a file: the target's own answers to training prompts.

Made by `memspec build-corpus` (memspec.training.corpus), shipped in models/ as
corpus-TARGET.npz, read by the draft maker (memspec.speculation.sources) into an index of its own
that requests never evict (memspec.speculation.suffix.corpus_index).

A file holds (npz): `tokens` (N,) int32, every sequence (prompt and answer) one after another;
`lengths` (S,) int32, each sequence's length; `meta`, JSON: the target's name and vocabulary, the
domains, prompts per domain, seed and answer length it was made with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


def corpus_path(models_dir: Path, target: str) -> Path:
    """Where the corpus of `target` ships: next to the shipped drafts and predictors."""
    return Path(models_dir) / f"corpus-{target}.npz"


@dataclass(frozen=True)
class Corpus:
    """A target's answers, as the suffix draft reads them."""

    sequences: list[np.ndarray]  # each (n,) int64: a prompt and its answer
    meta: dict  # target, vocab, domains, per_domain, seed, max_new

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        flat = np.concatenate(self.sequences).astype(np.int32) if self.sequences else np.zeros(0, np.int32)
        np.savez_compressed(path, tokens=flat, lengths=np.array([len(s) for s in self.sequences], np.int32),
                            meta=np.array(json.dumps(self.meta, sort_keys=True)))
        return path

    @classmethod
    def load(cls, path: Path, target: str | None = None, vocab: int | None = None) -> "Corpus":
        """The corpus at `path`; a ValueError where it was made for another target or vocabulary
        (ids of another tokenizer would propose nonsense that verification rejects at a cost)."""
        with np.load(path, allow_pickle=False) as z:
            flat, lengths, meta = z["tokens"].astype(np.int64), z["lengths"], json.loads(str(z["meta"]))
        if int(lengths.sum()) != len(flat):
            raise ValueError(f"{path}: its lengths add up to {int(lengths.sum())} tokens, it holds {len(flat)}")
        if target is not None and meta.get("target") != target:
            raise ValueError(f"{path} holds {meta.get('target')!r}'s answers, not {target!r}'s")
        if vocab is not None and len(flat) and flat.max() >= vocab:
            raise ValueError(f"{path}: holds token id {flat.max()}, the target's vocabulary has {vocab}")
        return cls(np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else [], meta)
