#!/usr/bin/env python3
"""Write the vocabulary list of a sibling draft (memspec/data/<target family>-draft-vocab.json).

A draft built from a sibling (memspec.models.sibling) keeps only the embedding and head rows of
the target ids listed here.  The list is what `train-draft` would choose (select_vocab): the
required ids (control, special and whitespace-only tokens), then the ids the target itself uses
most, counted over

* the teacher data sets `train-draft --target T` cached in --work (the target's greedy answers
  to the built-in domains' prompts, with its top-k alternatives, never a benchmark's prompt), and
* code text: the Python standard library's source of the interpreter running this script,
  tokenized with the target's tokenizer (weight --code-weight per token).

The list is shipped, not made at pull time, so that every device builds the same draft.

Usage::

    python scripts/make_draft_vocab.py --target qwen2.5-coder-1.5b --size 32768 \\
        --out memspec/data/qwen2.5-coder-draft-vocab.json
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memspec.training import log  # noqa: E402
from memspec.training.drafts import _target_files, required_ids, select_vocab, token_counts  # noqa: E402


def stdlib_counts(tok, vocab: int) -> tuple[np.ndarray, int]:
    counts = np.zeros(vocab, dtype=np.float64)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts)
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        np.add.at(counts, tok.encode(text), 1.0)
    return counts, len(files)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "memspec-train"))
    ap.add_argument("--code-weight", type=float, default=0.05, help="weight of one standard-library token")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch

    tok, _ = _target_files(args.target)
    work = Path(args.work) / args.target
    sets = sorted(work.glob("data-*.pt"))
    if not sets:
        raise SystemExit(f"no teacher data in {work}; run `memspec train-draft --target {args.target}` first")
    samples, held_out, used = [], [], {}
    for p in sets:
        data = torch.load(p, weights_only=False)
        samples += data["train"]  # the held-out answers stay out of the list, and measure it
        held_out += data["eval"]
        used[p.stem] = data["info"]
    counts = token_counts(samples, tok.vocab_size)
    code, n_files = stdlib_counts(tok, tok.vocab_size)
    ids = select_vocab(counts + args.code_weight * code, args.size, required_ids(tok))
    answers = np.concatenate([np.asarray(s["answer"]) for s in held_out])
    covered = float(np.isin(answers, ids).mean())
    log(f"{len(ids)} ids; they cover {covered:.2%} of the {len(answers)} held-out answer tokens")
    out = {
        "target": args.target,
        "made_by": "python scripts/make_draft_vocab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "data": used,
        "code_text": f"{n_files} files of the Python {sys.version.split()[0]} standard library, weight {args.code_weight}",
        "held_out_answer_coverage": round(covered, 4),
        "ids": ids,
    }
    Path(args.out).write_text(json.dumps(out, separators=(",", ":")) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
